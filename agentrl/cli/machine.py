"""`agentrl doctor`, `images build`, `gc` and `cluster`: this machine, its sandboxes, its
Ray nodes."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from agentrl.cli.output import console, human_bytes
from agentrl.errors import AgentRLError


def doctor(args: argparse.Namespace) -> int:
    from agentrl.doctor import print_report, run_checks

    checks = run_checks()
    print_report(checks, console)
    return 0 if all(c.ok or not c.required for c in checks) else 1


def images_build(args: argparse.Namespace) -> int:
    from agentrl.sandbox.images import build_image, build_standin, standin_recipes

    every = list(standin_recipes())
    names = [n for name in args.names for n in (every if name == "standins" else [name])]
    for name in names:
        with console.status(f"building sandbox image {name!r} ({args.method})..."):
            if ":" in name:  # a registry name: its stand-in, built from sandboxes/standins/
                info = build_standin(name, force=args.force)
            else:
                info = build_image(name, method=args.method, force=args.force)
        verb = f"built in {info.seconds:.0f} s via {info.method}" if info.built else "up to date"
        console.print(f"{info.tag}: {verb} (recipe {info.recipe_hash}, image {info.id[:19]})")
    return 0


def gc(args: argparse.Namespace) -> int:
    from agentrl import scratch
    from agentrl.sandbox.docker import gc

    folders = scratch.reap()  # the CLI reaped at start too; a process may have died since
    report = gc(run_id=args.run, snapshots=args.snapshots)
    what = f"run {args.run}" if args.run else "dead runs"
    console.print(
        f"removed {report.containers} container(s)"
        + (
            f" and {report.snapshots} snapshot image(s) ({human_bytes(report.snapshot_bytes)})"
            if args.snapshots
            else ""
        )
        + f" of {what}"
        + (f", and {folders} temporary folder(s) of dead processes" if folders else "")
    )
    return 0


def cluster(args: argparse.Namespace) -> int:
    from agentrl.cluster import local

    folder = Path(args.dir) if args.dir else None
    if args.cluster_command == "up":
        with console.status("starting Ray nodes on 127.0.0.1..."):
            state = local.up(folder, workers=args.workers, sandboxes=args.sandboxes, cpus=args.cpus)
        console.print(f"cluster up at {state.address}: {len(state.nodes)} node(s)")
        console.print(f"use it with, in a train config:  cluster: {{address: {state.address}}}")
        return 0
    if args.cluster_command == "down":
        stopped = local.down(folder)
        console.print(f"stopped {stopped} node(s)" if stopped else "no local cluster was up")
        return 0
    if args.cluster_command == "kill-node":
        local.kill_node(args.node, folder)
        console.print(f"killed node {args.node} (SIGKILL); `agentrl cluster up` restarts it")
        return 0
    return _cluster_status(folder)


def _cluster_status(folder: Path | None) -> int:
    from agentrl.cluster import local

    state = local.load_state(folder)
    if state is None:
        console.print("no local cluster is up (agentrl cluster up starts one)")
        return 1
    joined = local.live_nodes(state.address) if local.alive(state.node("head").pid) else {}
    containers = _containers_by_node()
    table = Table("node", "pid", "process", "in Ray", "sandboxes", "containers")
    for node in state.nodes:
        table.add_row(
            node.name + (" (head)" if node.head else ""),
            str(node.pid),
            "running" if local.alive(node.pid) else "dead",
            "alive" if joined.get(node.name) else "no",
            str(node.sandboxes),
            str(containers.get(node.name, 0)),
        )
    console.print(f"Ray cluster at {state.address}")
    console.print(table)
    return 0 if all(joined.get(n.name) for n in state.nodes) else 1


def _containers_by_node() -> dict[str, int]:
    """Running agentrl containers per `agentrl.node` label (empty if Docker is down)."""
    from agentrl.sandbox.docker import NODE
    from agentrl.sandbox.images import docker_client

    try:
        client = docker_client()
    except AgentRLError:
        return {}
    try:
        counts: dict[str, int] = {}
        for c in client.api.containers(filters={"label": NODE}):
            name = (c.get("Labels") or {}).get(NODE, "")
            counts[name] = counts.get(name, 0) + 1
        return counts
    finally:
        client.close()
