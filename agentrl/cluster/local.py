"""A Ray cluster of several nodes on this one machine: `agentrl cluster up|status|down`.

Each node is a `ray start --block` process in its own session (setsid), at a loopback
address (HOST) with ports of its own, so two nodes never collide and one node can be killed
(SIGKILL to its process group: raylet, agents and the workers it started) without
touching the others — what a machine failure looks like to the rest of the cluster.
The head is node `head`; workers are `w1`, `w2`, ... Every node advertises the custom
resource `agentrl_node_<name>: 1` (so work can be pinned to it by name) and
`sandbox: <n>` (the live sandboxes it may host). State lives in one JSON file, written
atomically, so `status` and `down` work from any shell and `up` restarts a node that
died (the node "returns").

This is for tests and for trying the Ray path on a laptop; a real cluster is started
with `ray start` on each machine (README, "Scale out").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agentrl import atomic
from agentrl.errors import AgentRLError, ConfigError
from agentrl.http import free_ports
from agentrl.scratch import pid_alive

log = logging.getLogger(__name__)

NODE_RESOURCE = "agentrl_node_"
"""Prefix of the custom resource that names a node (`agentrl_node_w1: 1`)."""
SANDBOX_RESOURCE = "sandbox"
"""The custom resource a node hosting Docker sandboxes advertises: how many it may run."""
HOST = "127.0.0.2"
"""The nodes' address: loopback, but not 127.0.0.1, which Ray swaps for the machine's
network address (and traffic of a local cluster must stay on loopback)."""


class ClusterError(AgentRLError, RuntimeError):
    """The local Ray cluster could not be started, reached or stopped."""

    default_fix = "see the node logs in the cluster folder; `agentrl cluster down` cleans up"


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    head: bool = False
    sandboxes: int = Field(ge=0, description="the node's `sandbox` resource")
    cpus: int = Field(ge=1, description="the CPUs Ray schedules on it (not a real limit)")
    pid: int = 0
    ports: dict[str, int] = Field(default_factory=dict)
    log: str = ""


class ClusterState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str
    nodes: list[Node]

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ClusterError(
            f"no node {name!r} in the local cluster (nodes: "
            f"{', '.join(n.name for n in self.nodes)})",
            fix="name one of those",
        )


def default_dir() -> Path:
    return Path(os.environ.get("AGENTRL_CLUSTER_DIR", Path.home() / ".cache/agentrl/cluster"))


def _state_file(folder: Path) -> Path:
    return folder / "cluster.json"


def load_state(folder: Path | None = None) -> ClusterState | None:
    path = _state_file(folder or default_dir())
    if not path.exists():
        return None
    return ClusterState.model_validate_json(path.read_text())


def _save(folder: Path, state: ClusterState) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_text(_state_file(folder), state.model_dump_json(indent=2))


def _ray() -> str:
    exe = Path(sys.executable).with_name("ray")
    if exe.exists():
        return str(exe)
    found = shutil.which("ray")
    if found is None:
        raise ClusterError("the `ray` command is not installed", fix="pip install 'agentrl[ray]'")
    return found


PORT_NAMES = (
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)
WORKER_PORTS = 40
"""Ports per node for Ray worker processes (one per actor or task process)."""


def alive(pid: int) -> bool:
    """Whether the process runs: a zombie (killed, not yet reaped by its parent) does not."""
    if pid <= 0 or not pid_alive(pid):
        return False
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _command(node: Node, address: str) -> list[str]:
    resources = {f"{NODE_RESOURCE}{node.name}": 1}
    if node.sandboxes:
        resources[SANDBOX_RESOURCE] = node.sandboxes
    argv = [
        _ray(),
        "start",
        "--block",
        f"--node-ip-address={HOST}",
        f"--num-cpus={node.cpus}",
        "--num-gpus=0",
        f"--resources={json.dumps(resources)}",
        "--disable-usage-stats",
        f"--object-store-memory={256 << 20}",
    ]
    if node.head:
        argv += ["--head", f"--port={address.rsplit(':', 1)[1]}", "--include-dashboard=false"]
        argv += [f"--ray-client-server-port={node.ports['ray-client-server-port']}"]
    else:
        argv += [f"--address={address}"]
    argv += [f"--{name}={node.ports[name]}" for name in PORT_NAMES]
    low = node.ports["min-worker-port"]
    argv += [f"--min-worker-port={low}", f"--max-worker-port={low + WORKER_PORTS - 1}"]
    return argv


def _launch(folder: Path, node: Node, address: str, taken: list[int]) -> Node:
    names = list(PORT_NAMES) + (["ray-client-server-port"] if node.head else [])
    ports = dict(zip(names, free_ports(len(names), HOST), strict=True))
    ports["min-worker-port"] = _worker_range(node, taken)
    node = node.model_copy(update={"ports": ports, "log": str(folder / f"{node.name}.log")})
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
    # On SIGTERM a node would first drain for up to 30 s (for Ray Serve replicas, which a
    # local cluster has none of); `down` stops the whole cluster, so it stops at once.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    with Path(node.log).open("ab") as log:
        proc = subprocess.Popen(
            _command(node, address),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killed as one machine
            env=env,
        )
    return node.model_copy(update={"pid": proc.pid})


def _worker_range(node: Node, taken: list[int]) -> int:
    """A block of WORKER_PORTS ports free now, below the kernel's ephemeral range (so no
    outgoing connection takes one) and apart from the other nodes' blocks (`taken`)."""
    for low in range(20000, 32000, WORKER_PORTS):
        if any(abs(low - other) < WORKER_PORTS for other in taken):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(low, low + WORKER_PORTS):
                    s = stack.enter_context(socket.socket())
                    s.bind((HOST, port))
            except OSError:
                continue
            return low
    raise ClusterError(f"no block of {WORKER_PORTS} free ports for node {node.name}")


def up(
    folder: Path | None = None,
    *,
    workers: int = 2,
    sandboxes: int = 4,
    head_sandboxes: int = 0,
    cpus: int = 4,
    timeout: float = 120.0,
) -> ClusterState:
    """Start the head and `workers` worker nodes; a node of a cluster already up that
    died is started again (with the same name and resources). Returns when Ray sees
    every node alive."""
    folder = folder or default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    state = load_state(folder)
    if state is None or not alive(state.node("head").pid):
        if state is not None:
            down(folder)
        (gcs,) = free_ports(1, HOST)
        head = Node(name="head", head=True, sandboxes=head_sandboxes, cpus=cpus)
        state = ClusterState(address=f"{HOST}:{gcs}", nodes=[head])
        state.nodes[0] = _launch(folder, head, state.address, [])
        _save(folder, state)
        _wait_for_gcs(state, timeout)
        wait_alive(state, ["head"], timeout)
    wanted = [Node(name=f"w{i}", sandboxes=sandboxes, cpus=cpus) for i in range(1, workers + 1)]
    for node in wanted:
        known = next((n for n in state.nodes if n.name == node.name), None)
        if known is not None and alive(known.pid):
            continue
        node = known.model_copy(update={"pid": 0}) if known is not None else node
        others = [n.ports["min-worker-port"] for n in state.nodes if n.name != node.name]
        started = _launch(folder, node, state.address, others)
        state.nodes = [n for n in state.nodes if n.name != node.name] + [started]
        _save(folder, state)
        wait_alive(state, [node.name], timeout)  # one at a time: no two race for ports
    return state


def _wait_for_gcs(state: ClusterState, timeout: float) -> None:
    host, port = state.address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    head = state.node("head")
    while time.monotonic() < deadline:
        if not alive(head.pid):
            raise ClusterError(f"the head node exited while starting; see {head.log}")
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 1):
            return
        time.sleep(0.3)
    raise ClusterError(f"the head node did not listen on {state.address} in {timeout:.0f} s")


def live_nodes(address: str) -> dict[str, bool]:
    """Node name -> alive, as the cluster's GCS reports it (asked from a subprocess, so
    the caller's own Ray connection, if any, is not touched)."""
    code = (
        "import json, ray\n"
        f"ray.init(address={address!r}, logging_level='ERROR', log_to_driver=False, "
        f"_node_ip_address={driver_ip(address)!r})\n"
        "out = {}\n"
        "for n in ray.nodes():\n"
        f"    names = [k[{len(NODE_RESOURCE)}:] for k in n['Resources'] "
        f"if k.startswith({NODE_RESOURCE!r})]\n"
        "    for name in names: out[name] = out.get(name, False) or n['Alive']\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {tail[0]}")
    result: dict[str, bool] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def wait_alive(state: ClusterState, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for name in names:
            node = state.node(name)
            if not alive(node.pid):
                raise ClusterError(f"node {name} exited while starting; see {node.log}")
        seen = live_nodes(state.address)
        if all(seen.get(name) for name in names):
            return
        if time.monotonic() > deadline:
            missing = [n for n in names if not seen.get(n)]
            raise ClusterError(f"nodes {missing} did not join in {timeout:.0f} s")
        time.sleep(0.5)


def kill_node(name: str, folder: Path | None = None) -> None:
    """SIGKILL node `name`'s whole process group: the node is gone as a crashed machine
    would be (its containers stay, owned by dead processes, until the node returns)."""
    folder = folder or default_dir()
    state = load_state(folder)
    if state is None:
        raise ClusterError("no local cluster is up", fix="agentrl cluster up")
    node = state.node(name)
    _kill_group(node.pid, signal.SIGKILL)


def _kill_group(pid: int, sig: int) -> None:
    if pid <= 0:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def down(folder: Path | None = None, *, grace: float = 10.0) -> int:
    """Stop every node (SIGTERM, then SIGKILL after `grace` s) and forget the cluster;
    returns the nodes that were still running."""
    folder = folder or default_dir()
    state = load_state(folder)
    if state is None:
        return 0
    running = [n for n in state.nodes if alive(n.pid)]
    for node in reversed(state.nodes):  # workers first, the head last
        _kill_group(node.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(n.pid) for n in running) and time.monotonic() < deadline:
        time.sleep(0.2)
    if late := [n.name for n in running if alive(n.pid)]:
        log.warning("node(s) %s still running %.0f s after SIGTERM: killed", late, grace)
    for node in state.nodes:
        _kill_group(node.pid, signal.SIGKILL)
    _state_file(folder).unlink(missing_ok=True)
    return len(running)


def driver_ip(address: str) -> str | None:
    """The IP a driver of the cluster at `address` must claim: the loopback address of
    a local cluster (Ray would otherwise look for a raylet at the machine's own IP)."""
    host = address.removeprefix("ray://").rpartition(":")[0]
    return host if host.startswith("127.") else None


def check_address(address: str) -> str:
    """`address` as Ray takes it; a clear error for an obviously wrong one."""
    if address == "auto" or address.startswith("ray://"):
        return address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"cluster.address {address!r} is not host:port, 'auto' or ray://host:port",
            fix="e.g. 10.0.0.5:6379 (the head's --port), as `agentrl cluster status` prints",
        )
    return address
