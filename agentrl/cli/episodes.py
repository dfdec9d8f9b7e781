# Over 400 lines: the commands on episodes (run, check, replay, failures, view) share printing.
"""`agentrl run`, `check`, `replay`, `failures`, `view` and `export-trajectories`: episodes
of tasks, and what they left."""

from __future__ import annotations

import argparse
import asyncio
import json
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from agentrl.cli.output import console, err_console, human_bytes, tag
from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.check import CheckRow
    from agentrl.replay import ReplayReport
    from agentrl.runner import RunJob, RunSummary
    from agentrl.sandbox.base import SandboxProvider
    from agentrl.tasks.spec import AgentConfig


def run(args: argparse.Namespace) -> int:
    """One task; a dataset folder runs its tasks side by side (one dispatcher, its slots
    across them), each into a folder of its own under --out (the exit code is the worst
    of theirs)."""
    from agentrl.cli.evaluate import _policy_name
    from agentrl.tasks.formats import expand

    paths = expand([args.task])
    played = (_policy_name(args.policy), _model(args))  # read once for all the tasks
    if len(paths) == 1 and paths[0] == Path(args.task):
        job = _job(args, paths[0], args.out, played, strict=True)
        again = "--resume" if args.out else f"--out {job.out_dir} --resume"
        (summary,) = _play(args, [job], played[1], again)
        return _report(summary, job.out_dir)
    base = args.out or Path("runs") / f"{Path(args.task).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    ids = instance_ids(args.instances)
    jobs = [_job(args, p, base / p.name, played, strict=False) for p in paths]
    if ids:
        jobs = [j for j in jobs if j.task.instances]
        if not jobs:
            raise ConfigError(
                f"no task of {args.task} has instance {', '.join(ids)}",
                fix="leave out --instances, or name instances the dataset's tasks have",
            )
    console.print(f"{args.task}: a dataset of {len(jobs)} tasks, each run into {base}/<task>")
    again = "--resume" if args.out else f"--out {base} --resume"
    summaries = _play(args, jobs, played[1], again, name=Path(args.task).name)
    return max(_report(s, j.out_dir, brief=True) for s, j in zip(summaries, jobs, strict=True))


def _job(
    args: argparse.Namespace,
    path: Path,
    out: Path | None,
    played: tuple[str, str],
    *,
    strict: bool,
) -> RunJob:
    """The task at `path` as `agentrl run ARGS` runs it, into `out` (claimed: refused
    where it holds something the flags do not say what to do with); `played`: the
    policy's name and the model whose tokenizer the ids are in."""
    from agentrl.runner import RunJob, run_spec
    from agentrl.tasks.formats import load_any
    from agentrl.tasks.select import select_instances, with_overrides

    task = load_any(path)
    task = select_instances(task, instance_ids(args.instances), strict=strict)
    overrides = limit_overrides(args)
    task = with_overrides(task, overrides, agent=agent_override(args))
    if args.snapshots is not None:  # --snapshots N: every N turns, the task's policy otherwise
        every = task.spec.snapshots.model_copy(update={"every": args.snapshots})
        task = task.model_copy(update={"spec": task.spec.model_copy(update={"snapshots": every})})
    out = out or Path("runs") / f"{task.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if task.instances:
        # in a dataset, --resume goes on with the tasks begun and starts the others
        _claim(out, resume=args.resume and (strict or out.is_dir()), overwrite=args.overwrite)
    spec = run_spec(task, *played, overrides)
    return RunJob(task, out, spec)


def _model(args: argparse.Namespace) -> str:
    """Whose tokenizer the run's token ids are in: --model, else the policy's."""
    from agentrl.inference.config import parse_policy

    model = args.model or parse_policy(args.policy).tokenizer_model()
    return str(Path(model).resolve()) if Path(model).is_dir() else model


def _play(
    args: argparse.Namespace, jobs: list[RunJob], model: str, again: str, name: str | None = None
) -> list[RunSummary]:
    """Run `jobs` with the policy, its ids in `model`'s tokenizer; after Ctrl-C, say what
    each folder holds and `again`: the flags that continue it."""
    from pydantic import TypeAdapter

    from agentrl.dispatch import DispatchConfig
    from agentrl.inference.config import parse_policy
    from agentrl.inference.embedded import model_tokenizer
    from agentrl.runner import run_tasks
    from agentrl.sandbox import provider

    dispatcher = TypeAdapter(DispatchConfig).validate_python(
        {"type": args.dispatcher, "concurrency": args.concurrency}
    )
    tokenizer = model_tokenizer(model)
    sampler = parse_policy(args.policy).build(tokenizer=tokenizer)

    async def go() -> list[RunSummary]:
        try:
            return await run_tasks(
                jobs,
                sampler,
                tokenizer,
                provider(args.provider),
                samples=args.samples,
                dispatcher=dispatcher,
                model=model,
                overwrite=args.overwrite,
                name=name,
            )
        finally:
            await sampler.close()

    try:
        return asyncio.run(go())
    except KeyboardInterrupt:
        for job in jobs:
            _how_to_continue(job.out_dir, again)
        raise


def _report(summary: RunSummary, out: Path, *, brief: bool = False) -> int:
    """Print what the run into `out` did (`brief`: one line, a dataset's task); exit code
    1 where every episode was an infrastructure failure."""
    from agentrl.batch import finite

    failed, total = summary.infra_failures, summary.episodes
    if brief:
        mean = "-" if summary.reward_mean is None else f"{summary.reward_mean:.3f}"
        infra = f", {failed} infrastructure failures" if failed else ""
        console.print(f"{summary.task}: {total} episodes, reward mean {mean}{infra} -> {out}")
        return 1 if total and failed == total else 0
    table = Table(title=f"agentrl run {summary.task} -> {out}")
    table.add_column("metric")
    table.add_column("value")
    infra_keys = ("infra_failures", "infra_error", "infra_fix")
    for key, value in finite(
        summary.model_dump(exclude={*infra_keys, "complete", "missing"})
    ).items():
        shown = f"{value:.3f}" if isinstance(value, float) else "-" if value is None else str(value)
        table.add_row(key, shown, style="dim" if value is None else None)
    console.print(table)
    _print_first_conversation(out / "conversations.jsonl")
    console.print(
        f"trajectories: {out / 'trajectories.jsonl'}  conversations: {out / 'conversations.jsonl'}"
    )
    if failed:  # apart from the rewards: these episodes were not graded, and never trained on
        err_console.print(
            tag(
                "infrastructure failures:",
                "red",
                f"{failed} of {total} episodes (not graded, not counted in the reward): "
                f"see `agentrl failures {out}`",
            )
        )
        err_console.print(f"first: {summary.infra_error}")
        if summary.infra_fix:
            err_console.print(f"fix: {summary.infra_fix}")
    return 1 if total and failed == total else 0


def _claim(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse an --out that already holds something unless told what to do with it, as
    `agentrl train` does; refuse a --resume with nothing to continue."""
    from agentrl.evaluation import EVAL_INFO

    used = out.is_dir() and any(out.iterdir())
    if used and not (resume or overwrite):
        raise ConfigError(
            f"{out} already holds a run",
            fix="continue it with --resume, replace it with --overwrite, or pick --out DIR",
        )
    if resume and not used:
        raise ConfigError(
            f"--resume: {out} holds no run to continue",
            fix="start it without --resume, or point --out at the run to continue",
        )
    if resume and not (out / EVAL_INFO).is_file():
        raise ConfigError(
            f"--resume: {out} has no {EVAL_INFO} (not a run folder, or one written before "
            "runs could be resumed)",
            fix="replace it with --overwrite, or pick --out DIR",
        )


def _how_to_continue(out: Path, flags: str) -> None:
    """After Ctrl-C: what the interrupted run recorded, and the flags that continue it."""
    from agentrl.runner import SUMMARY, RunSummary

    try:
        summary = RunSummary.model_validate_json((out / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # interrupted before any episode ran: nothing to continue
    if summary.complete:
        return
    asked = summary.episodes + summary.missing
    err_console.print(
        f"{summary.episodes} of {asked} episodes are recorded in {out} (summary.json "
        f"marked incomplete); the same command with {flags} runs the other {summary.missing}"
    )


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
    from agentrl.atomic import write_text
    from agentrl.check import check_paths
    from agentrl.sandbox import provider

    with console.status("running each instance's reference solution and a no-op..."):
        rows = check_paths(
            args.paths,
            provider(args.provider),
            instances=instance_ids(args.instances),
            concurrency=args.concurrency,
        )
    # Short cells only: a failure's explanation goes below the table, so it reads at 80 columns.
    # The title above the table, not in it: a table narrower than the title wraps it.
    console.print("agentrl check: the oracle must earn 1.0, doing nothing less", soft_wrap=False)
    table = Table()
    table.add_column("task")
    table.add_column("instance")
    for col in ("oracle", "no-op", "result"):
        table.add_column(col, no_wrap=True)
    table.add_column("s", justify="right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.task,
            row.instance,
            _reward(row.oracle.reward),
            _reward(row.noop.reward),
            row.verdict,
            f"{row.oracle.seconds + row.noop.seconds:.0f}",
            style=None if row.ok else "red",
        )
    console.print(table, soft_wrap=False)
    bad = [r for r in rows if not r.ok]
    console.print(f"{len(rows) - len(bad)} of {len(rows)} instances pass")
    fixed: dict[str, str] = {}  # a fix already given -> the instance it was given for
    for row in bad:
        _print_check_failure(row, fixed)
    for note in dict.fromkeys(n for r in rows for n in r.notes):
        console.print(f"note: {note}", soft_wrap=False)
    if args.json:
        data = json.dumps([r.model_dump() for r in rows], indent=2) + "\n"
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_text(args.json, data)
    return 1 if bad or not rows else 0


ERROR_LINES = 3
"""Lines a failing episode's error takes below the check table (its whole log is a file)."""


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _print_clipped(text: str) -> None:
    """`text` cut to the terminal's width (with an ellipsis), never wrapped."""
    console.print(text, no_wrap=True, overflow="ellipsis", soft_wrap=False)


def _indented(label: str, text: str, most: int | None = None) -> None:
    """`    label text`, wrapped to the terminal's width under its own indent (in `most`
    lines at most, the rest elided)."""
    width = max(console.width, 40)
    pad = " " * (4 + len(label) + 1)
    wrapped = textwrap.fill(
        text,
        width,
        initial_indent=f"    {label} ",
        subsequent_indent=pad,
        max_lines=most,
        placeholder=" …",
    )
    console.print(wrapped, soft_wrap=True)


def _without_output(error: str) -> str:
    """An error without the end of the output a grader appended (`line | line | ...`):
    the lines below the table show that output better."""
    cut = error.find(" | ")
    return error if cut < 0 else error[: error.rfind(": ", 0, cut)]


def _print_check_failure(row: CheckRow, fixed: dict[str, str]) -> None:
    """A failing instance: what each episode earned, the lines that explain it, where its
    whole log is, and the fix (once; a later instance with the same fix points back)."""
    name = row.instance if row.instance == row.task else f"{row.task}/{row.instance}"
    console.print(tag(f"FAIL {name}:", "red", row.verdict))
    shown: list[str] = []
    for what, o in (("oracle", row.oracle), ("no-op", row.noop)):
        brief = ", ".join(x for x in (f"reward {_reward(o.reward)}", o.tests) if x)
        text = _without_output(o.error) if o.error else brief
        if shown and text == shown[0] and o.error:
            text = "the same"
        shown.append(text)
        if o.error:  # wrapped, not cut at the edge: its detail (a path, a key) is the point
            _indented(f"{what}:", text, most=None if o.excerpt and not o.log else ERROR_LINES)
        else:
            _print_clipped(f"    {what}: {text}")
    for o in (row.oracle, row.noop):
        if o.log:
            for text in o.excerpt:
                _print_clipped(f"    | {text}")
            console.print(f"    whole log: {o.log}")  # never cut: it is for copying
    if row.fix in fixed:
        console.print(f"    fix: as for {fixed[row.fix]} above")
    elif row.fix:
        fixed[row.fix] = name
        _indented("fix:", row.fix)


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
    return _print_replay(asyncio.run(replay.replay(run_dir, tid, k)))


def _print_replay(report: ReplayReport) -> int:
    """What replay found; the exit status says what differed: 0 nothing (volatile details
    aside), 3 an observation, 4 only the re-graded reward."""
    where = f"snapshot {report.snapshot[:19]}" if report.snapshot else "a fresh INIT (no snapshot)"
    console.print(
        f"{report.trajectory_id}: restored before turn {report.restored_at} from {where}; "
        f"replayed turns {report.replayed_turns}"
    )
    for d in report.volatile:
        kinds = ", ".join(d.volatile)
        console.print(tag("note:", "yellow", f"turn {d.turn} differs only in {kinds}; replayed on"))
        changed = [ln for ln in d.diff.splitlines()[2:] if ln[:1] in "+-"]
        for line in changed[:6]:
            _print_clipped(f"    {line}")
    if report.grade_error is not None:
        graded = f"re-grading failed: {report.grade_error}"
    else:
        graded = f"re-graded reward {_reward(report.reward_replayed)}"
    recorded = report.reward_recorded
    graded += f" (recorded {'none: not graded' if recorded is None else _reward(recorded)})"
    if report.divergence is not None:
        d = report.divergence
        console.print(
            tag(
                "diverged",
                "red",
                f"at turn {d.turn} ({d.tool or 'no tool call'}): the observation differs beyond "
                "volatile details, and replay stopped there:",
            )
        )
        console.print(d.diff)
        console.print(f"{graded}, in the sandbox as turn {d.turn} left it")
        return 3
    turns = [d.turn for d in report.volatile]
    also = f" (turns {turns} up to volatile details)" if turns else ""
    if not report.reward_matched:
        console.print(
            tag("reward differs:", "red", f"every replayed observation matched{also}, but {graded}")
        )
        return 4
    console.print(
        tag(
            "matched:",
            "green",
            f"every replayed observation equals the recorded one{also}; {graded}",
        )
    )
    return 0


def _note_divergence(turn: int) -> None:
    err_console.print(tag("note:", "yellow", f"turn {turn} diverged on the way"))


def export_trajectories(args: argparse.Namespace) -> int:
    from agentrl.atif import export_run

    out = args.out or args.run_dir / "atif"
    n = export_run(args.run_dir, out)
    console.print(f"wrote {n} ATIF trajectories under {out}")
    return 0


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
        from agentrl.run_info import read_run_info
        from agentrl.sandbox import provider

        sandboxes = provider(read_run_info(args.run_dir).provider)
        size = sum(asyncio.run(_sizes(sandboxes, kept)))
        console.print(f"snapshots of these episodes: {len(kept)}, {human_bytes(size)} on disk")
    return 0


def _print_evidence(path: Path, lines: int = 8) -> None:
    """What the grader saw, in brief: the command, exit code, failed tests, the output's end."""
    from agentrl.tasks.evidence import Evidence

    try:
        evidence = Evidence.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        console.print(f"    grade {path}: unreadable ({type(e).__name__})")
        return
    say = lambda text: console.print(f"    {text}")  # noqa: E731
    code = evidence.exit_code  # None: a function graded, no command exited
    ended = f"-> exit {code}" if code is not None else "(a function: it has no exit code)"
    say(f"grader {evidence.grader}: {evidence.command[:160]} {ended}")
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

    from agentrl.cli.serving import serve_until_stopped
    from agentrl.view.export import export
    from agentrl.view.folder import RunFolder
    from agentrl.view.imported import import_atif, is_foreign
    from agentrl.view.server import ViewServer

    root = import_atif(args.run_dir) if is_foreign(args.run_dir) else args.run_dir
    folder = RunFolder(root, model=args.model)
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
    try:  # it serves on its own thread
        serve_until_stopped(f"viewing {folder.root} at {server.url} (Ctrl-C stops)")
    finally:
        server.close()
    return 0
