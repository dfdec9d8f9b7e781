"""The `agentrl` command line: the one place errors become a line for a person.

Every command runs inside `main`, which turns an AgentRLError into `error: ...` plus
`fix: ...` and exit code 1, Ctrl-C into exit 130, and any other exception into one
line that points at `--debug` (which shows the traceback instead).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentrl import __version__
from agentrl.errors import AgentRLError, ConfigError

if TYPE_CHECKING:
    from agentrl.sandbox.base import SandboxProvider

# No string is ever read as rich markup: paths, ids and messages print as written ("[/x]"
# in a trajectory id is text); colour comes only from `_tag`.
console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)
log = logging.getLogger("agentrl")


def _tag(label: str, style: str, text: str = "") -> Text:
    """`label` in `style`, then `text` as written."""
    return Text.assemble((label, style), " " + text if text else "")


def _cmd_doctor(args: argparse.Namespace) -> int:
    from agentrl.doctor import print_report, run_checks

    checks = run_checks()
    print_report(checks, console)
    return 0 if all(c.ok or not c.required for c in checks) else 1


def _cmd_images_build(args: argparse.Namespace) -> int:
    from agentrl.sandbox.images import build_image

    for name in args.names:
        with console.status(f"building sandbox image {name!r} ({args.method})..."):
            info = build_image(name, method=args.method, force=args.force)
        verb = f"built in {info.seconds:.0f} s via {info.method}" if info.built else "up to date"
        console.print(f"{info.tag}: {verb} (recipe {info.recipe_hash}, image {info.id[:19]})")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from agentrl.inference.embedded import load_tokenizer
    from agentrl.runner import load_any_task, make_policy, run_task, select_instances
    from agentrl.sandbox import provider

    task = select_instances(load_any_task(args.task), _ids(args.instances))
    overrides = {
        k: v
        for k, v in (("max_turns", args.max_turns), ("max_new_tokens", args.max_new_tokens))
        if v is not None
    }
    if overrides:  # validated like the file itself: impossible limits are refused
        try:
            limits = type(task.spec.limits).model_validate(
                {**task.spec.limits.model_dump(), **overrides}
            )
        except ValidationError as e:
            raise ConfigError(f"limits: {e.errors()[0]['msg']}") from e
        task = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    snapshots = None
    if args.snapshots is not None:
        policy = task.spec.snapshots
        snapshots = policy.model_copy(update={"every": args.snapshots})
    tokenizer = load_tokenizer()
    sampler = make_policy(args.policy, tokenizer)
    out = args.out or Path("runs") / f"{task.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"

    async def go() -> object:
        try:
            return await run_task(
                task,
                sampler,
                tokenizer,
                provider(args.provider),
                out,
                samples=args.samples,
                concurrency=args.concurrency,
                dispatcher=args.dispatcher,
                snapshots=snapshots,
            )
        finally:
            await sampler.close()

    summary = asyncio.run(go())
    table = Table(title=f"agentrl run {task.spec.name} -> {out}")
    table.add_column("metric")
    table.add_column("value")
    infra_keys = ("infra_failures", "first_infra_error", "first_infra_fix")
    for key, value in summary.model_dump(exclude=set(infra_keys)).items():  # type: ignore[attr-defined]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        table.add_row(key, shown, style="dim" if value is None else None)
    console.print(table)
    _print_first_conversation(out / "conversations.jsonl")
    console.print(
        f"trajectories: {out / 'trajectories.jsonl'}  conversations: {out / 'conversations.jsonl'}"
    )
    failed, total = summary.infra_failures, summary.trajectories  # type: ignore[attr-defined]
    if failed:  # apart from the rewards: these episodes were not graded, and never trained on
        err_console.print(
            _tag(
                "infrastructure failures:",
                "red",
                f"{failed} of {total} episodes (not graded, not counted in the reward): "
                f"see `agentrl failures {out}`",
            )
        )
        err_console.print(f"first: {summary.first_infra_error}")  # type: ignore[attr-defined]
        if summary.first_infra_fix:  # type: ignore[attr-defined]
            err_console.print(f"fix: {summary.first_infra_fix}")  # type: ignore[attr-defined]
    return 1 if total and failed == total else 0


def _ids(text: str | None) -> list[str] | None:
    """`--instances a,b,c` as a list (None: every instance)."""
    if not text:
        return None
    return [i.strip() for i in text.split(",") if i.strip()]


def _cmd_check(args: argparse.Namespace) -> int:
    from agentrl.check import check_paths
    from agentrl.runner import write_atomic
    from agentrl.sandbox import provider

    with console.status("running each instance's reference solution and a no-op..."):
        rows = check_paths(
            args.paths,
            provider(args.provider),
            instances=_ids(args.instances),
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
    if args.json:
        data = json.dumps([r.model_dump() for r in rows], indent=2) + "\n"
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, data)
    return 1 if bad or not rows else 0


def _reward(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _cmd_train(args: argparse.Namespace) -> int:
    from agentrl.runner import load_any_task
    from agentrl.train_config import load_train_config
    from agentrl.trainer import Trainer
    from agentrl.yamlfile import readable

    config = load_train_config(args.config)
    data = config.model_dump(exclude_unset=True)  # what the file says, and only that
    if args.steps is not None:
        data["schedule"]["steps"] = args.steps
    if args.servers is not None:
        urls = [u for u in args.servers.split(",") if u.strip()]
        data["servers"] = {**(data.get("servers") or {}), "urls": urls}
    if args.seed is not None:
        data["seed"] = args.seed
    try:  # the flags are validated like the file: --steps 0 is refused, not ignored
        config = type(config).model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        flag = {"schedule": "--steps", "servers": "--servers", "seed": "--seed"}
        raise ConfigError(
            f"{flag.get(str(err['loc'][0]), 'a flag')}: {readable(err)}",
            fix="give a value the train config itself could hold",
        ) from None
    base = args.config.parent
    tasks = [load_any_task(base / t) for t in config.tasks]
    out = args.out or Path("runs") / config.name
    if out.exists() and any(out.iterdir()) and not args.resume and not args.overwrite:
        raise ConfigError(
            f"{out} already holds a run",
            fix="continue it with --resume, replace it with --overwrite, or pick --out DIR",
        )
    trainer = Trainer(config, tasks, out)
    summary = asyncio.run(trainer.run(resume=args.resume))
    if not summary:  # a torchrun rank other than 0: rank 0 reports
        return 0
    table = Table(title=f"agentrl train {config.name} -> {out}")
    table.add_column("held-out")
    table.add_column("step")
    table.add_column("reward (95% CI)")
    table.add_column("episodes")
    for key in ("eval_before", "eval_after"):
        row = summary.get(key)
        if row:
            reward = f"{row['reward_mean']:.3f} +- {row['reward_ci95']:.3f}"
            table.add_row(key.removeprefix("eval_"), str(row["step"]), reward, str(row["episodes"]))
    console.print(table)
    console.print(f"metrics: {out / 'metrics.jsonl'}  reward curve: {out / 'reward.png'}")
    return 0


def _note_divergence(turn: int) -> None:
    err_console.print(_tag("note:", "yellow", f"turn {turn} diverged on the way"))


def _cmd_replay(args: argparse.Namespace) -> int:
    from agentrl import replay
    from agentrl.trajectory import Trajectory

    run_dir, tid, k = args.run_dir, args.trajectory_id, args.from_turn
    if args.shell:
        code, divergence = asyncio.run(replay.open_shell(run_dir, tid, k))
        if divergence is not None:
            err_console.print(
                _tag("note:", "yellow", f"turn {divergence.turn} diverged on the way")
            )
        return 0 if code in (0, 130) else code
    if args.policy:
        from agentrl.inference.embedded import load_tokenizer
        from agentrl.runner import make_policy

        tokenizer = load_tokenizer()
        sampler = make_policy(args.policy, tokenizer)

        async def go() -> tuple[Trajectory, replay.Divergence | None]:
            try:
                return await replay.branch(run_dir, tid, k, sampler, tokenizer)
            finally:
                await sampler.close()

        traj, divergence = asyncio.run(go())
        if divergence is not None:
            err_console.print(
                _tag("note:", "yellow", f"turn {divergence.turn} diverged on the way")
            )
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
            _tag(
                "matched:",
                "green",
                "every replayed observation equals the recorded one (reward recorded "
                f"{report.reward_recorded}, replayed {report.reward_replayed})",
            )
        )
        return 0
    d = report.divergence
    console.print(_tag("diverged", "red", f"at turn {d.turn} ({d.tool or 'no tool call'}):"))
    console.print(d.diff)
    return 3


def _cmd_failures(args: argparse.Namespace) -> int:
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
        console.print(f"snapshots of these episodes: {len(kept)}, {_bytes(size)} on disk")
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
        ("restored", evidence.sealed.restored if evidence.sealed else []),
        ("notes", evidence.notes),
    ):
        if items:
            say(f"{label}: {'; '.join(items)[:300]}")
    tail_lines = [ln for ln in evidence.output.splitlines() if ln.strip()][-lines:]
    for line in tail_lines:
        say(f"| {line[:200]}")
    say(f"evidence: {path}")


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


async def _sizes(sandboxes: SandboxProvider, ids: list[str]) -> list[int]:
    return [await sandboxes.snapshot_bytes(i) for i in ids]


def _print_first_conversation(path: Path, chars: int = 400) -> None:
    import json

    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    if not lines:
        return
    first = json.loads(lines[0])
    console.rule(f"conversation {first['trajectory_id']}")
    for message in first["messages"]:
        text = message["content"]
        text = text if len(text) <= chars else text[: chars // 2] + " [...] " + text[-chars // 2 :]
        console.print(_tag(f"{message['role']}:", "bold", text))


def _cmd_gc(args: argparse.Namespace) -> int:
    from agentrl.sandbox.docker import gc

    report = gc(run_id=args.run, snapshots=args.snapshots)
    what = f"run {args.run}" if args.run else "dead runs"
    console.print(
        f"removed {report.containers} container(s)"
        + (
            f" and {report.snapshots} snapshot image(s) ({_bytes(report.snapshot_bytes)})"
            if args.snapshots
            else ""
        )
        + f" of {what}"
    )
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    from agentrl.chat import ChatSession
    from agentrl.inference.base import SamplingParams
    from agentrl.inference.embedded import EMBEDDED_NAME, load_tokenizer
    from agentrl.inference.local import LocalSampler

    with console.status(f"loading {EMBEDDED_NAME}..."):
        sampler = LocalSampler.embedded()
        tokenizer = load_tokenizer()
    session = ChatSession(tokenizer, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )

    async def one() -> tuple[str, float, int, str, int]:
        try:
            start = time.perf_counter()
            c = await sampler.generate(session.prompt_ids, params, session_id="cli")
            seconds = time.perf_counter() - start
        finally:
            await sampler.close()
        text = session.add_sampled(c.token_ids, c.finish_reason)
        return text, seconds, len(c.token_ids), c.finish_reason, c.policy_version

    text, seconds, n, finish, version = asyncio.run(one())
    console.print(_tag("user:", "bold", args.prompt))
    console.print(_tag(f"{EMBEDDED_NAME}:", "bold", text.strip()))
    console.print(
        f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tok/s), "
        f"finish_reason={finish}, policy_version={version}, "
        f"prompt {len(session.prompt_ids)} tokens",
        style="dim",
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from agentrl.inference.embedded import EMBEDDED_NAME, load_tokenizer
    from agentrl.inference.local import LocalSampler
    from agentrl.inference.serve import serve

    with console.status(f"loading {EMBEDDED_NAME}..."):
        sampler = LocalSampler.embedded()
        tokenizer = load_tokenizer()
    server, url = serve(sampler, tokenizer, port=args.port)
    console.print(f"serving {EMBEDDED_NAME} at {url}")
    root = url.removesuffix("/v1")
    console.print(
        f"use it with: agentrl run TASK --policy openai:{url}, or as one of the replicas of "
        f"agentrl train CONFIG --servers {root},...   (Ctrl-C stops)",
    )
    try:
        _wait_for_stop()
    finally:
        server.close()
        asyncio.run(sampler.close())
    return 0


def _wait_for_stop() -> None:
    """Block until Ctrl-C (or SIGTERM, which `_terminate` turns into one)."""
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("stopping")


def _cmd_serve_tinker(args: argparse.Namespace) -> int:
    from agentrl.tinker_server.server import serve

    server = serve(
        args.model,
        name=args.name,
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        max_models=args.max_models,
        keep_samplers=args.keep_samplers,
        api_key=args.api_key,
    )
    config = server.service.config
    console.print(f"serving the Tinker API for {config.name} at {server.url}")
    console.print(
        f"use it with: tinker.ServiceClient(base_url={server.url!r}, api_key='tml-...'); "
        f"save_state writes to {config.state_dir}   (Ctrl-C stops)",
    )
    try:
        _wait_for_stop()
    finally:
        server.close()
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
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


def _cmd_validate(args: argparse.Namespace) -> int:
    fixes = [fix for path in args.files if (fix := _validate_one(path)) is not None]
    for fix in dict.fromkeys(fixes):
        err_console.print(_tag("fix:", "yellow", fix))
    return 1 if fixes else 0


def _validate_one(path: Path) -> str | None:
    """Print what `path` is, or what is wrong with it; None if valid, else the fix."""
    from agentrl.tasks.load import is_task_path
    from agentrl.textfile import UnreadableFile, regular_file
    from agentrl.trajectory import TrajectoryStore
    from agentrl.yamlfile import ConfigFileError

    try:
        if path.exists() and not path.is_dir():  # a FIFO would block the readers below
            regular_file(path)
        if path.suffix in (".json", ".jsonl") and _is_swe_bench(path):
            from agentrl.tasks.swe_bench import load_swe_bench

            rows = load_swe_bench(path)
            console.print(f"{path}: ok ({len(rows.instances)} instances, {rows.format} rows)")
        elif path.suffix == ".jsonl":
            count = sum(1 for _ in TrajectoryStore(path).read())
            console.print(f"{path}: {count} trajectories, all valid")
        elif path.suffix in (".yaml", ".yml") and _is_train_config(path):
            from agentrl.train_config import load_train_config

            console.print(f"{path}: ok (train config {load_train_config(path).name})")
        elif is_task_path(path):  # a .yaml/.yml task, or a task folder (load_task dispatches)
            console.print(f"{path}: ok ({_described(path)})")
        else:
            what = "a task (.yaml/.yml, a folder with task.yaml) nor trajectories (.jsonl)"
            err_console.print(f"{path}: neither {what}")
            return "name a task file or folder, a train config, rows or trajectories"
    except UnreadableFile as e:  # a FIFO, a folder, not UTF-8: before any parser
        err_console.print(f"{e.path}:{e.line}: file: {e.reason}")
        return e.fix
    except ConfigFileError as e:  # TaskError included: each problem as file:line: field: ...
        for problem in e.problems:
            err_console.print(str(problem))
        return e.fix or ConfigFileError.default_fix
    except AgentRLError as e:
        err_console.print(str(e))
        return e.fix or "fix the file, then validate it again"
    return None


def _described(path: Path) -> str:
    from agentrl.tasks.load import load_task

    task = load_task(path)
    return f"{len(task.instances)} instances, {task.format} task"


def _is_train_config(path: Path) -> bool:
    """Train configs have a top-level `schedule:`; tasks never do."""
    from agentrl.textfile import MAX_BYTES

    if not path.is_file() or path.stat().st_size > MAX_BYTES:
        return False  # the task loader says what is wrong with it
    return any(line.startswith(b"schedule:") for line in path.read_bytes().splitlines())


def _is_swe_bench(path: Path) -> bool:
    """SWE-bench rows carry `instance_id`; trajectories carry `trajectory_id`."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        head = f.read(4096).decode("utf-8", errors="replace")
    return '"instance_id"' in head and '"trajectory_id"' not in head


class _Parser(argparse.ArgumentParser):
    """argparse, but a wrong command line reads like every other error: one line, a fix,
    exit code 1 (argparse's own is usage text and exit 2)."""

    def error(self, message: str) -> NoReturn:
        err_console.print(_tag("error:", "red", f"{self.prog}: {message}"))
        err_console.print(_tag("fix:", "yellow", f"{self.prog} --help lists the arguments"))
        sys.exit(1)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # NaN fails the first test
        raise argparse.ArgumentTypeError(f"{value} is not a temperature (0 or more)")
    return value


def _port(text: str) -> int:
    value = _at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agentrl", description="Train LLM agents with RL on tool-using tasks.")
    p.add_argument("--version", action="version", version=f"agentrl {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("doctor", help="check this machine and say how to fix what is missing")
    d.set_defaults(func=_cmd_doctor)

    images = sub.add_parser("images", help="sandbox images")
    isub = images.add_subparsers(dest="images_command", required=True, metavar="ACTION")
    b = isub.add_parser("build", help="build sandbox images from sandboxes/<name>/")
    b.add_argument("names", nargs="*", default=["base"], help="recipe names (default: base)")
    b.add_argument(
        "--method",
        choices=["auto", "dockerfile", "debootstrap"],
        default="auto",
        help="auto uses the Dockerfile when its base image can be had, else debootstrap",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    b.set_defaults(func=_cmd_images_build)

    r = sub.add_parser("run", help="run a task's instances with a policy; trajectories + summary")
    r.add_argument("task", help="a task YAML file, or a Terminal-Bench / Harbor task folder")
    r.add_argument(
        "--policy",
        default="local",
        help="local (the embedded model), openai:URL, router:URL,URL,... or scripted:FILE",
    )
    r.add_argument("-n", "--samples", type=_at_least(1), default=1, help="episodes per instance")
    r.add_argument("--instances", help="only these instances (comma-separated ids)")
    r.add_argument("--out", type=Path, help="output folder (default runs/<task>-<time>)")
    r.add_argument("--provider", default="docker", help="sandbox provider: docker or local")
    r.add_argument("--concurrency", type=_at_least(1), default=4, help="generation slots")
    r.add_argument("--dispatcher", default="pipeline", help="pipeline (default), batch, or sync")
    r.add_argument("--max-turns", type=_at_least(1), help="override the task's limits.max_turns")
    r.add_argument("--max-new-tokens", type=_at_least(1), help="override limits.max_new_tokens")
    r.add_argument(
        "--snapshots",
        type=_at_least(0),
        metavar="K",
        help="snapshot the sandbox after INIT and every K turns (0: off); overrides the task",
    )
    r.set_defaults(func=_cmd_run)

    ck = sub.add_parser(
        "check",
        help="run every instance's reference solution and a no-op through the real grader",
    )
    ck.add_argument("paths", nargs="+", type=Path, help="task files, task folders, row files")
    ck.add_argument("--instances", help="only these instances (comma-separated ids)")
    ck.add_argument("--json", type=Path, help="also write the table as JSON here")
    ck.add_argument("--provider", default="docker", help="sandbox provider: docker or local")
    ck.add_argument("--concurrency", type=_at_least(1), default=2, help="instances at once")
    ck.set_defaults(func=_cmd_check)

    rp = sub.add_parser(
        "replay", help="restore a recorded episode's sandbox and act on its replies again"
    )
    rp.add_argument("run_dir", type=Path, help="a folder `agentrl run` or `agentrl train` wrote")
    rp.add_argument("trajectory_id")
    rp.add_argument(
        "--from-turn", type=_at_least(0), default=0, help="restore the state before turn K"
    )
    how = rp.add_mutually_exclusive_group()
    how.add_argument("--shell", action="store_true", help="open a bash in the restored sandbox")
    how.add_argument(
        "--policy", help="let a policy continue from turn K (local, openai:URL, scripted:FILE)"
    )
    rp.set_defaults(func=_cmd_replay)

    fl = sub.add_parser("failures", help="a run's failed episodes, grouped, with replay commands")
    fl.add_argument("run_dir", type=Path)
    fl.add_argument("--all", action="store_true", help="a replay command for every episode")
    fl.set_defaults(func=_cmd_failures)

    t = sub.add_parser("train", help="train a model on tasks (the main job); see examples/")
    t.add_argument("config", type=Path, help="a train config YAML file")
    t.add_argument("--out", type=Path, help="output folder (default runs/<name>)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    t.add_argument("--steps", type=int, help="override schedule.steps")
    t.add_argument("--seed", type=int, help="override seed (data order, RNGs)")
    t.add_argument(
        "--servers",
        help="sample on these servers (comma-separated URLs, e.g. agentrl serve replicas) "
        "behind the router instead of in-process; overrides servers.urls",
    )
    t.set_defaults(func=_cmd_train)

    g = sub.add_parser("gc", help="remove sandboxes (and snapshots) that dead runs left behind")
    g.add_argument("--snapshots", action="store_true", help="also remove dead runs' snapshots")
    g.add_argument("--run", help="only this run id")
    g.set_defaults(func=_cmd_gc)

    s = sub.add_parser("sample", help="one reply from the embedded model (a smoke test)")
    s.add_argument(
        "prompt", nargs="?", default="In one sentence, what does the bash command `ls -la` do?"
    )
    s.add_argument("--max-tokens", type=_at_least(1), default=64)
    s.add_argument("--temperature", type=_temperature, default=0.7)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_cmd_sample)

    sv = sub.add_parser(
        "serve", help="serve the embedded model over an OpenAI-compatible API on 127.0.0.1"
    )
    sv.add_argument("--port", type=_port, default=8000, help="port (0 picks a free one)")
    sv.set_defaults(func=_cmd_serve)

    st = sub.add_parser(
        "serve-tinker",
        help="serve a model for training and sampling over the Tinker API (tinker SDK 0.38)",
    )
    st.add_argument(
        "--model", default="embedded", help="embedded (SmolLM2-135M-Instruct) or a model folder"
    )
    st.add_argument(
        "--name",
        help="the base_model name clients ask for (default: HuggingFaceTB/SmolLM2-135M-Instruct "
        "for embedded, else the folder's name)",
    )
    st.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    st.add_argument("--port", type=_port, default=8100, help="port (0 picks a free one)")
    st.add_argument(
        "--state-dir",
        type=Path,
        help="where save_state writes checkpoints (default: ~/.cache/agentrl/tinker-state, "
        "or $AGENTRL_CACHE/tinker-state)",
    )
    st.add_argument(
        "--max-models",
        type=_at_least(1),
        default=2,
        help="training models held at once (default 2)",
    )
    st.add_argument(
        "--keep-samplers",
        type=_at_least(1),
        default=2,
        help="sampling snapshots kept per training model; older ones are released (default 2)",
    )
    st.add_argument("--api-key", help="require this X-API-Key on every request (default: none)")
    st.set_defaults(func=_cmd_serve_tinker)

    v = sub.add_parser(
        "validate", help="validate task files (YAML, task folders) and trajectory files (JSONL)"
    )
    v.add_argument("files", nargs="+", type=Path)
    v.set_defaults(func=_cmd_validate)

    cl = sub.add_parser(
        "cluster", help="a local multi-node Ray cluster on 127.0.0.1 (tests, trying Ray)"
    )
    cl.add_argument("--dir", help="state and logs (default ~/.cache/agentrl/cluster)")
    clsub = cl.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    cu = clsub.add_parser("up", help="start the head and worker nodes (restarts dead ones)")
    cu.add_argument("--workers", type=_at_least(0), default=2, help="worker nodes (default 2)")
    cu.add_argument("--sandboxes", type=_at_least(1), default=4, help="sandboxes per worker node")
    cu.add_argument("--cpus", type=_at_least(1), default=4, help="CPUs Ray schedules per node")
    clsub.add_parser("status", help="the nodes, whether Ray sees them, their containers")
    clsub.add_parser("down", help="stop every node")
    ck = clsub.add_parser("kill-node", help="SIGKILL one node, as a machine failure would")
    ck.add_argument("node", help="w1, w2, ...")
    cl.set_defaults(func=_cmd_cluster)
    return p


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so every finally (sandbox close, temp dirs) runs.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("urllib3", "docker", "filelock", "httpx", "httpx2", "openai", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except AgentRLError as e:
        if args.debug:
            traceback.print_exc()
        err_console.print(_tag("error:", "red", str(e)))
        if e.fix:
            err_console.print(_tag("fix:", "yellow", e.fix))
        return 1
    except Exception as e:  # the CLI boundary: one line, traceback only with --debug
        if args.debug:
            traceback.print_exc()
        err_console.print(
            _tag(
                "internal error:",
                "red",
                f"{type(e).__name__}: {e} (rerun with --debug for the traceback, and report it)",
            )
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
