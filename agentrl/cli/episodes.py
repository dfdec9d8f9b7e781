"""`agentrl run`, `check`, `replay`, `failures` and `view`: episodes of tasks, and what they
left."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from agentrl.cli.output import console, err_console, human_bytes, tag

if TYPE_CHECKING:
    from agentrl.runner import RunSummary
    from agentrl.sandbox.base import SandboxProvider
    from agentrl.tasks.spec import AgentConfig


def run(args: argparse.Namespace) -> int:
    from pydantic import TypeAdapter

    from agentrl.dispatch import DispatchConfig
    from agentrl.inference.config import parse_policy
    from agentrl.inference.embedded import model_tokenizer
    from agentrl.runner import run_task, select_instances, with_overrides
    from agentrl.sandbox import provider
    from agentrl.tasks.formats import load_any

    task = select_instances(load_any(args.task), instance_ids(args.instances))
    task = with_overrides(task, limit_overrides(args), agent=agent_override(args))
    snapshots = None
    if args.snapshots is not None:
        policy = task.spec.snapshots
        snapshots = policy.model_copy(update={"every": args.snapshots})
    dispatcher = TypeAdapter(DispatchConfig).validate_python(
        {"type": args.dispatcher, "concurrency": args.concurrency}
    )
    sampler_config = parse_policy(args.policy)
    model = args.model or sampler_config.tokenizer_model()
    tokenizer = model_tokenizer(model)
    sampler = sampler_config.build(tokenizer=tokenizer)
    out = args.out or Path("runs") / f"{task.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"

    async def go() -> RunSummary:
        try:
            return await run_task(
                task,
                sampler,
                tokenizer,
                provider(args.provider),
                out,
                samples=args.samples,
                dispatcher=dispatcher,
                snapshots=snapshots,
                model=model,
            )
        finally:
            await sampler.close()

    summary = asyncio.run(go())
    table = Table(title=f"agentrl run {task.spec.name} -> {out}")
    table.add_column("metric")
    table.add_column("value")
    infra_keys = ("infra_failures", "first_infra_error", "first_infra_fix")
    for key, value in summary.model_dump(exclude=set(infra_keys)).items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        table.add_row(key, shown, style="dim" if value is None else None)
    console.print(table)
    _print_first_conversation(out / "conversations.jsonl")
    console.print(
        f"trajectories: {out / 'trajectories.jsonl'}  conversations: {out / 'conversations.jsonl'}"
    )
    failed, total = summary.infra_failures, summary.trajectories
    if failed:  # apart from the rewards: these episodes were not graded, and never trained on
        err_console.print(
            tag(
                "infrastructure failures:",
                "red",
                f"{failed} of {total} episodes (not graded, not counted in the reward): "
                f"see `agentrl failures {out}`",
            )
        )
        err_console.print(f"first: {summary.first_infra_error}")
        if summary.first_infra_fix:
            err_console.print(f"fix: {summary.first_infra_fix}")
    return 1 if total and failed == total else 0


def limit_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The limits the command line overrides (--max-turns, --max-new-tokens)."""
    given = {"max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens}
    return {k: v for k, v in given.items() if v is not None}


def agent_override(args: argparse.Namespace) -> AgentConfig | None:
    """The external agent `--agent FILE` names (None: each task's own)."""
    if args.agent is None:
        return None
    from agentrl.tasks.spec import AgentConfig
    from agentrl.yamlfile import load_model

    return load_model(args.agent, AgentConfig, what="agent file")


def instance_ids(text: str | None) -> list[str] | None:
    """`--instances a,b,c` as a list (None: every instance)."""
    if not text:
        return None
    return [i.strip() for i in text.split(",") if i.strip()]


def _print_first_conversation(path: Path, chars: int = 400) -> None:
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    if not lines:
        return
    first = json.loads(lines[0])
    console.rule(f"conversation {first['trajectory_id']}")
    for message in first["messages"]:
        text = message["content"]
        text = text if len(text) <= chars else text[: chars // 2] + " [...] " + text[-chars // 2 :]
        console.print(tag(f"{message['role']}:", "bold", text))


def check(args: argparse.Namespace) -> int:
    from agentrl.check import check_paths
    from agentrl.runner import write_atomic
    from agentrl.sandbox import provider

    with console.status("running each instance's reference solution and a no-op..."):
        rows = check_paths(
            args.paths,
            provider(args.provider),
            instances=instance_ids(args.instances),
            concurrency=args.concurrency,
        )
    table = Table(title="agentrl check: the oracle must earn 1.0, doing nothing less")
    for col in ("task", "instance", "oracle", "no-op", "oracle tests", "no-op tests", "infra"):
        table.add_column(col)
    table.add_column("s", justify="right")
    for row in rows:
        errors = [e for e in (row.oracle.error, row.noop.error) if e]
        table.add_row(
            row.task,
            row.instance,
            _reward(row.oracle.reward),
            _reward(row.noop.reward),
            row.oracle.tests,
            row.noop.tests,
            "; ".join(errors),
            f"{row.oracle.seconds + row.noop.seconds:.0f}",
            style=None if row.ok else "red",
        )
    console.print(table)
    bad = [r for r in rows if not r.ok]
    console.print(f"{len(rows) - len(bad)} of {len(rows)} instances pass")
    for row in bad:
        for what, outcome in (("oracle", row.oracle), ("no-op", row.noop)):
            if outcome.fix:
                console.print(f"{row.instance} {what}: fix: {outcome.fix}")
    for note in dict.fromkeys(n for r in rows for n in r.notes):
        console.print(f"note: {note}")
    if args.json:
        data = json.dumps([r.model_dump() for r in rows], indent=2) + "\n"
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, data)
    return 1 if bad or not rows else 0


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def replay(args: argparse.Namespace) -> int:
    from agentrl import replay
    from agentrl.trajectory import Trajectory

    run_dir, tid, k = args.run_dir, args.trajectory_id, args.from_turn
    if args.shell:
        code, divergence = asyncio.run(replay.open_shell(run_dir, tid, k))
        if divergence is not None:
            _note_divergence(divergence.turn)
        return 0 if code in (0, 130) else code
    if args.policy:
        from agentrl.inference.config import parse_policy
        from agentrl.inference.embedded import model_tokenizer

        policy = parse_policy(args.policy)
        tokenizer = model_tokenizer(args.model or policy.tokenizer_model())
        sampler = policy.build(tokenizer=tokenizer)

        async def go() -> tuple[Trajectory, replay.Divergence | None]:
            try:
                return await replay.branch(run_dir, tid, k, sampler, tokenizer)
            finally:
                await sampler.close()

        traj, divergence = asyncio.run(go())
        if divergence is not None:
            _note_divergence(divergence.turn)
        console.print(
            f"branch {traj.trajectory_id} (from turn {k} of {tid}): {traj.stop_reason.value}, "
            f"reward {traj.reward}, {len(traj.turns)} turns -> {run_dir / replay.BRANCHES}"
        )
        return 0
    report = asyncio.run(replay.replay(run_dir, tid, k))
    where = f"snapshot {report.snapshot[:19]}" if report.snapshot else "a fresh INIT (no snapshot)"
    console.print(
        f"{tid}: restored before turn {report.restored_at} from {where}; "
        f"replayed turns {report.replayed_turns}"
    )
    if report.divergence is None:
        console.print(
            tag(
                "matched:",
                "green",
                "every replayed observation equals the recorded one (reward recorded "
                f"{report.reward_recorded}, replayed {report.reward_replayed})",
            )
        )
        return 0
    d = report.divergence
    console.print(tag("diverged", "red", f"at turn {d.turn} ({d.tool or 'no tool call'}):"))
    console.print(d.diff)
    return 3


def _note_divergence(turn: int) -> None:
    err_console.print(tag("note:", "yellow", f"turn {turn} diverged on the way"))


def failures(args: argparse.Namespace) -> int:
    from agentrl import replay

    groups = replay.failures(args.run_dir)
    if not groups:
        console.print(f"no failed episodes in {args.run_dir}")
        return 0
    table = Table(title=f"failed episodes in {args.run_dir}")
    for col in ("#", "stop reason", "outcome", "episodes", "for example"):
        table.add_column(col)
    for n, g in enumerate(groups, 1):
        example = g.trajectories[0].trajectory_id
        table.add_row(str(n), g.stop_reason, g.outcome, str(len(g.trajectories)), example)
    console.print(table)
    for n, g in enumerate(groups, 1):
        first = g.trajectories[0]
        console.print(f"#{n} {g.stop_reason}, {g.outcome}: for example {first.trajectory_id}")
        if first.fix:
            console.print(f"    fix: {first.fix}")
        if g.grades[0] is not None:
            _print_evidence(g.grades[0])
        shown = g.trajectories if args.all else g.trajectories[:1]
        for t in shown:  # whole lines, never wrapped: they are for copying
            console.print(f"#{n}  agentrl replay {args.run_dir} {t.trajectory_id}")
    failed = [t for g in groups for t in g.trajectories]
    kept = replay.snapshot_ids(failed)
    if kept:
        from agentrl.runner import read_run_info
        from agentrl.sandbox import provider

        sandboxes = provider(read_run_info(args.run_dir).provider)
        size = sum(asyncio.run(_sizes(sandboxes, kept)))
        console.print(f"snapshots of these episodes: {len(kept)}, {human_bytes(size)} on disk")
    return 0


def _print_evidence(path: Path, lines: int = 8) -> None:
    """What the grader saw, in brief: the command, exit code, failed tests, the output's end."""
    from agentrl.tasks.graders import Evidence

    try:
        evidence = Evidence.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        console.print(f"    grade {path}: unreadable ({type(e).__name__})")
        return
    say = lambda text: console.print(f"    {text}")  # noqa: E731
    say(f"grader {evidence.grader}: {evidence.command[:160]} -> exit {evidence.exit_code}")
    failed = [t for t, s in evidence.tests.items() if s not in ("PASSED", "XFAIL", "SKIPPED")]
    if evidence.tests:
        say(f"tests: {len(evidence.tests) - len(failed)} passed, {len(failed)} not: {failed[:5]}")
    for label, items in (
        ("reference", [evidence.reference] if evidence.reference else []),
        ("tampered (restored)", evidence.tampered),
        ("substitutions", evidence.substitutions),
        ("stopped", evidence.sealed.stopped if evidence.sealed else []),
        ("left out (outside the outputs)", evidence.sealed.restored if evidence.sealed else []),
        ("dropped from the outputs", evidence.sealed.dropped if evidence.sealed else []),
        ("grading copy", evidence.sealed.notes if evidence.sealed else []),
        ("notes", evidence.notes),
    ):
        if items:
            say(f"{label}: {'; '.join(items)[:300]}")
    tail_lines = [ln for ln in evidence.output.splitlines() if ln.strip()][-lines:]
    for line in tail_lines:
        say(f"| {line[:200]}")
    say(f"evidence: {path}")


async def _sizes(sandboxes: SandboxProvider, ids: list[str]) -> list[int]:
    return [await sandboxes.snapshot_bytes(i) for i in ids]


def view(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from agentrl.view.export import export
    from agentrl.view.folder import RunFolder
    from agentrl.view.server import ViewServer

    folder = RunFolder(args.run_dir, model=args.model)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn())
    with Progress(*columns, console=err_console, transient=True) as bars:
        task = bars.add_task("indexing", total=None)

        def indexing(what: str, done: int, total: int) -> None:
            bars.update(task, description=f"indexing {what}", completed=done, total=total)

        folder.refresh(indexing)
    if args.export is not None:
        with Progress(*columns[:2], console=err_console, transient=True) as bars:
            task = bars.add_task("exporting episodes", total=None)
            n = export(
                folder,
                args.export,
                progress=lambda done, total: bars.update(task, completed=done, total=total),
            )
        page = (args.export / "index.html").resolve()
        console.print(f"exported {n} episodes: open file://{page}")
        return 0
    server = ViewServer(folder, args.host, args.port)
    threading.Thread(target=folder.warm, name="tokenizer", daemon=True).start()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        err_console.print(tag("note:", "yellow", f"anyone who can reach {args.host} can read it"))
    console.print(f"viewing {folder.root} at {server.url} (Ctrl-C stops)")
    try:
        threading.Event().wait()  # it serves on its own thread
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
