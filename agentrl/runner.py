"""`agentrl run`: every instance of a task, N samples each, trajectories to JSONL plus a summary.

Episodes run through the configured dispatcher (default: pipeline, 4 slots), stream into
`trajectories.jsonl` as they finish and are summarised in `summary.json`: reward mean
and spread, stop reasons, tool calls and tool errors, timings.

A run folder is an evaluation folder (`agentrl.evaluation`: sample k of instance i is
the trajectory `i_k`, `eval.json` says what is run) plus `conversations.jsonl` and
`summary.json`, so a run continues as an evaluation does: the episodes it recorded are
kept and only the missing ones run. An interrupted run still writes its summary, of the
episodes that finished, marked incomplete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentrl.agent import Episode, seen_messages
from agentrl.dispatch.base import DispatchConfig, PipelineConfig
from agentrl.dispatch.core import Feed
from agentrl.errors import ConfigError
from agentrl.inference.base import Sampler
from agentrl.preflight import preflight
from agentrl.registry import resolve
from agentrl.tasks.spec import AgentConfig, SnapshotPolicy, Task
from agentrl.trajectory import BRANCHES, Trajectory, TrajectoryStore, agent_counts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.evaluation import EvalSpec
    from agentrl.sandbox.base import SandboxProvider
    from agentrl.tasks.env import TaskEnv

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
"""Where no bar is drawn (output to a file or a pipe), a progress line at most this often."""
SUMMARY = "summary.json"
CONVERSATIONS = "conversations.jsonl"
RUN_FILES = (SUMMARY, CONVERSATIONS, "trajectories.jsonl.index", BRANCHES)
"""What a run folder holds beside an evaluation's files: `overwrite` removes these too."""


class RunSummary(BaseModel):
    """What a run did, in numbers."""

    model_config = ConfigDict(extra="forbid")

    task: str
    run_id: str
    trajectories: int
    reward_mean: float | None
    reward_std: float | None
    reward_min: float | None
    reward_max: float | None
    stop_reasons: dict[str, int]
    infra_failures: int
    first_infra_error: str | None
    first_infra_fix: str | None
    turns_mean: float
    tool_calls: int
    tool_errors: int
    seconds: float
    gen_seconds: float
    tool_seconds: float
    agent: dict[str, int] = Field(
        default_factory=dict, description="external harnesses' calls, edits, drift ({}: none)"
    )
    complete: bool = Field(
        default=True, description="False: interrupted, `missing` episodes not run (--resume)"
    )
    missing: int = Field(default=0, description="episodes asked for and not recorded")


class RunInfo(BaseModel):
    """`run.json`: what a run folder needs to be replayed (`agentrl replay`)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    provider: str
    tasks: list[str]  # task files or folders, absolute
    model: str | None = Field(
        default=None,
        description="whose tokenizer the token ids are in: 'embedded' or a model folder "
        "(None: not recorded, a run written before this field)",
    )


RUN_INFO = "run.json"


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename: never a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_run_info(out_dir: Path, info: RunInfo) -> None:
    tasks = [str(Path(t).resolve()) for t in info.tasks]
    absolute = info.model_copy(update={"tasks": tasks})
    write_atomic(out_dir / RUN_INFO, json.dumps(absolute.model_dump(), indent=2))


def read_run_info(run_dir: Path) -> RunInfo:
    path = run_dir / RUN_INFO
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} has no {RUN_INFO}",
            fix="pass a folder that `agentrl run` or `agentrl train` wrote (this version or later)",
        )
    return RunInfo.model_validate_json(path.read_text())


def make_env(task: Task, provider: SandboxProvider, run_id: str) -> TaskEnv:
    """The task's runtime (TaskEnv, or the subclass its format names) for one run."""
    from agentrl.tasks.env import TaskEnv

    env_class = resolve({}, task.env, "task runtime")
    if not (isinstance(env_class, type) and issubclass(env_class, TaskEnv)):
        raise ConfigError(f"task runtime {task.env!r} is not a TaskEnv")
    return env_class(task, provider, run_id)


def with_overrides(
    task: Task,
    limits: dict[str, int] | None = None,
    temperature: float | None = None,
    agent: AgentConfig | None = None,
) -> Task:
    """`task` with some of its limits and its sampling temperature replaced, validated as
    the file itself is (impossible limits are a ConfigError); with `agent`, played by
    that external harness (its hash then names the harness too: an evaluation of the
    task's own agent is another evaluation)."""
    spec = task.spec
    if limits:
        try:
            new = type(spec.limits).model_validate({**spec.limits.model_dump(), **limits})
        except ValidationError as e:
            raise ConfigError(f"limits: {e.errors()[0]['msg']}") from e
        spec = spec.model_copy(update={"limits": new})
    if temperature is not None:
        sampling = spec.sampling.model_copy(update={"temperature": temperature})
        spec = spec.model_copy(update={"sampling": sampling})
    if agent is not None and agent != spec.agent:
        spec = spec.model_copy(update={"agent": agent})
        digest = hashlib.sha256(f"{task.hash}\n{agent.model_dump_json()}".encode()).hexdigest()
        return task.model_copy(update={"spec": spec, "hash": digest[: len(task.hash)]})
    return task if spec is task.spec else task.model_copy(update={"spec": spec})


def select_instances(task: Task, ids: list[str] | None, *, strict: bool = True) -> Task:
    """`task` with only the instances in `ids` (all when None); with `strict`, an id the
    task does not have is a ConfigError naming the ones it has."""
    if not ids:
        return task
    have = [i.id for i in task.instances]
    unknown = [i for i in ids if i not in have]
    if strict and unknown:
        listed = ", ".join(have[:8]) + (", ..." if len(have) > 8 else "")
        raise ConfigError(
            f"{task.path}: no instance {', '.join(unknown)}", fix=f"its instances: {listed}"
        )
    return task.model_copy(update={"instances": [i for i in task.instances if i.id in ids]})


def summarize(
    task: str, run_id: str, trajs: list[Trajectory], seconds: float, missing: int = 0
) -> RunSummary:
    rewards = [t.reward for t in trajs if t.trainable and t.reward is not None]
    infra = [t for t in trajs if not t.trainable]
    turns = [turn for t in trajs for turn in t.turns]
    calls = [turn for turn in turns if turn.tool_call is not None]
    errors = [turn for turn in turns if turn.observation.startswith("error:")]
    errors += [turn for turn in calls if turn.exit_code not in (None, 0)]
    return RunSummary(
        task=task,
        run_id=run_id,
        trajectories=len(trajs),
        reward_mean=statistics.fmean(rewards) if rewards else None,
        reward_std=statistics.pstdev(rewards) if rewards else None,
        reward_min=min(rewards) if rewards else None,
        reward_max=max(rewards) if rewards else None,
        stop_reasons=dict(Counter(t.stop_reason.value for t in trajs)),
        infra_failures=len(infra),
        first_infra_error=infra[0].error if infra else None,
        first_infra_fix=infra[0].fix if infra else None,
        turns_mean=len(turns) / len(trajs) if trajs else 0.0,
        tool_calls=len(calls),
        tool_errors=len(errors),
        seconds=round(seconds, 3),
        gen_seconds=round(sum(t.gen_seconds for t in turns), 3),
        tool_seconds=round(sum(t.tool_seconds for t in turns), 3),
        agent=agent_counts(trajs),
        complete=not missing,
        missing=missing,
    )


def progress_bars(show: bool) -> Progress:
    """Bars named by their `name` field, with a count, the time and a description."""
    return Progress(
        TextColumn("[bold]{task.fields[name]}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        disable=not show,
    )


async def stream_episodes(
    episodes: list[Episode] | Feed,
    dispatcher: DispatchConfig,
    keep: Callable[[Trajectory], None],
    progress: Progress,
    name: str,
) -> None:
    """Run `episodes` through a fresh dispatcher, handing each trajectory to `keep` as it
    finishes (nothing else holds it), under a bar `name` showing the reward mean so far.
    A feed may grow while it runs (`keep` may put more in it; the bar's total follows).
    Where no bar is live (output to a file or a pipe), the same news is logged instead:
    at the start, after the first episode, at most every LOG_EVERY_S seconds, and after
    the last."""
    graded, total, infra = 0, 0.0, 0
    size = (lambda: episodes.size) if isinstance(episodes, Feed) else (lambda: len(episodes))
    bar = progress.add_task("", total=size(), name=name)
    lines = progress.disable or not progress.console.is_terminal  # rich draws nothing there
    start = said = time.monotonic()
    if lines:
        log.info("%s: %d episodes to run", name, size())
    try:
        async with aclosing(dispatcher.build().run(episodes)) as stream:
            async for traj in stream:
                keep(traj)
                if traj.trainable:
                    graded, total = graded + 1, total + (traj.reward or 0.0)
                else:
                    infra += 1
                mean = f"{total / graded:.2f}" if graded else "-"
                shown = f"reward mean {mean}" + (f", {infra} infra failures" if infra else "")
                progress.update(bar, advance=1, total=size(), description=shown)
                now, done = time.monotonic(), graded + infra
                if lines and (now - said >= LOG_EVERY_S or done in (1, size())):
                    said = now
                    elapsed = time.strftime("%H:%M:%S", time.gmtime(now - start))
                    log.info("%s: %d/%d episodes, %s, %s", name, done, size(), shown, elapsed)
    finally:
        progress.remove_task(bar)


def run_spec(
    task: Task, policy: str, model: str | None = None, overrides: dict[str, int] | None = None
) -> EvalSpec:
    """What a run of `task` by `policy` runs, as `eval.json` records it: a resume must
    run the same (the task's files, the policy, its tokenizer, the limits overridden)."""
    from agentrl.evaluation import EvalSpec

    return EvalSpec(
        tasks={task.spec.name: task.hash},
        paths=[str(Path(task.path).resolve())],
        policy=policy,
        model=model,
        limits=overrides or {},
    )


async def run_task(
    task: Task,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    provider: SandboxProvider,
    out_dir: Path,
    *,
    samples: int = 1,
    dispatcher: DispatchConfig | None = None,
    show_progress: bool = True,
    snapshots: SnapshotPolicy | None = None,
    model: str | None = None,
    spec: EvalSpec | None = None,
    overwrite: bool = False,
) -> RunSummary:
    """`samples` episodes of every instance of `task` (sample k of instance i is the
    trajectory `i_k`) into `out_dir`, then `summary.json` over every one recorded.

    A folder that holds a run of the same `spec` (default: this task, played by the
    sampler's class) is continued: its episodes are kept, only the missing ones run;
    `overwrite` starts it again; a folder holding anything else is refused (ConfigError).
    Nothing is written before the preflight passes. Interrupted (Ctrl-C, SIGTERM, an
    error), the summary of the episodes recorded is written, marked incomplete.
    `model`: whose tokenizer the token ids are in, for run.json."""
    from agentrl.evaluation import Evaluation, wanted

    spec = spec or run_spec(task, type(sampler).__qualname__, model)
    folder = Evaluation(out_dir, spec, overwrite=overwrite)
    asked = wanted([task], samples)
    todo = folder.missing(asked)
    if kept := len(asked) - len(todo):
        log.info("%s: %d of %d episodes already recorded (kept)", out_dir, kept, len(asked))
    before = 0.0 if overwrite else _seconds_before(out_dir)
    start = time.monotonic()
    run_id = f"{task.spec.name}-{uuid.uuid4().hex[:8]}"
    if not todo:
        return _summary(out_dir, task, _run_id_of(out_dir, run_id), set(asked), before)
    env = make_env(task, provider, run_id)
    await preflight([env], sampler, tokenizer)  # before anything is written
    folder.start(run_id, provider.name, model=model)
    conversations = out_dir / CONVERSATIONS
    if overwrite:
        for name in RUN_FILES:
            (out_dir / name).unlink(missing_ok=True)
    else:  # a line torn by a kill, or one whose trajectory's line was, goes
        _keep_conversations(conversations, {f"{o.instance}_{o.attempt}" for o in folder.done})
    instances = {i.id: i for i in task.instances}
    episodes = [
        Episode(task, instances[inst], k, sampler, tokenizer, env, snapshots=snapshots)
        for _, inst, k in todo
    ]

    def keep(traj: Trajectory) -> None:
        folder.record(traj)
        with conversations.open("a", encoding="utf-8") as f:  # what the model saw
            messages = seen_messages(task, traj, tokenizer)
            f.write(json.dumps({"trajectory_id": traj.trajectory_id, "messages": messages}))
            f.write("\n")

    try:
        with progress_bars(show_progress) as progress:
            await stream_episodes(
                episodes,
                dispatcher or PipelineConfig(concurrency=4),
                keep,
                progress,
                task.spec.name,
            )
    finally:  # interrupted too: what finished is summarised, and says it is not all
        seconds = before + time.monotonic() - start
        summary = _summary(out_dir, task, run_id, set(asked), seconds)
    return summary


def _summary(
    out_dir: Path, task: Task, run_id: str, asked: set[tuple[str, str, int]], seconds: float
) -> RunSummary:
    """Summarise the recorded episodes `asked` names; write summary.json."""
    from agentrl.scores import Outcome

    path = out_dir / "trajectories.jsonl"
    trajs = (
        [t for t in TrajectoryStore(path) if Outcome.of(t).key in asked] if path.is_file() else []
    )
    summary = summarize(task.spec.name, run_id, trajs, seconds, missing=len(asked) - len(trajs))
    write_atomic(out_dir / SUMMARY, json.dumps(summary.model_dump(), indent=2) + "\n")
    return summary


def _seconds_before(out_dir: Path) -> float:
    """The wall seconds an earlier, interrupted or shorter, run in `out_dir` took (0: none)."""
    try:
        return RunSummary.model_validate_json((out_dir / SUMMARY).read_text()).seconds
    except (OSError, ValueError):
        return 0.0


def _run_id_of(out_dir: Path, default: str) -> str:
    try:
        return read_run_info(out_dir).run_id
    except (ConfigError, ValueError):
        return default


def _keep_conversations(path: Path, ids: set[str]) -> None:
    """Rewrite `path` with only the whole lines of the trajectories `ids`."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            if line.endswith("\n") and json.loads(line)["trajectory_id"] in ids:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    write_atomic(path, "".join(kept))
