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

import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, Field

from agentrl import atomic
from agentrl.batch import BatchStats, batch_stats, finite
from agentrl.dispatch.base import DispatchConfig, PipelineConfig
from agentrl.dispatch.stream import progress_bars, stream_episodes
from agentrl.episode import Episodes, make_env, seen_messages
from agentrl.errors import ConfigError
from agentrl.inference.base import Sampler
from agentrl.preflight import preflight
from agentrl.run_info import read_run_info
from agentrl.snapshots import Retention
from agentrl.tasks.spec import SnapshotPolicy, Task
from agentrl.trajectory import BRANCHES, Trajectory, TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.evaluation import Attempt, EvalSpec, Evaluation
    from agentrl.sandbox.base import SandboxProvider

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
CONVERSATIONS = "conversations.jsonl"
RUN_FILES = (SUMMARY, CONVERSATIONS, "trajectories.jsonl.index", BRANCHES)
"""What a run folder holds beside an evaluation's files: `overwrite` removes these too."""


class RunSummary(BatchStats):
    """What a run did, in numbers (`agentrl.batch`), and of which run."""

    model_config = ConfigDict(extra="forbid")

    task: str
    run_id: str
    seconds: float
    complete: bool = Field(
        default=True, description="False: interrupted, `missing` episodes not run (--resume)"
    )
    missing: int = Field(default=0, description="episodes asked for and not recorded")


def summarize(
    task: str, run_id: str, trajs: list[Trajectory], seconds: float, missing: int = 0
) -> RunSummary:
    return RunSummary(
        task=task,
        run_id=run_id,
        seconds=round(seconds, 3),
        complete=not missing,
        missing=missing,
        **batch_stats(trajs),
    )


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


@dataclass(frozen=True)
class RunJob:
    """One task of a run and the folder it runs into; `spec`: what that folder records
    as run (default: this task, played by the sampler's class)."""

    task: Task
    out_dir: Path
    spec: EvalSpec | None = None


async def run_task(
    task: Task,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    provider: SandboxProvider,
    out_dir: Path,
    *,
    spec: EvalSpec | None = None,
    **options: Any,
) -> RunSummary:
    """`run_tasks` of one task into `out_dir`."""
    (summary,) = await run_tasks(
        [RunJob(task, out_dir, spec)], sampler, tokenizer, provider, **options
    )
    return summary


async def run_tasks(
    jobs: Sequence[RunJob],
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    provider: SandboxProvider,
    *,
    samples: int = 1,
    dispatcher: DispatchConfig | None = None,
    show_progress: bool = True,
    snapshots: SnapshotPolicy | None = None,
    model: str | None = None,
    overwrite: bool = False,
    name: str | None = None,
) -> list[RunSummary]:
    """`samples` episodes of every instance of each job's task (sample k of instance i is
    the trajectory `i_k`) into the job's folder, then its `summary.json` over every one
    recorded. All the jobs' episodes share one dispatcher (a dataset's tasks run side by
    side, `dispatcher`'s slots across them) and one preflight; each folder is its own run.

    A folder that holds a run of the same spec is continued: its episodes are kept, only
    the missing ones run; `overwrite` starts it again; a folder holding anything else is
    refused (ConfigError). Nothing is written before the preflight passes. Interrupted
    (Ctrl-C, SIGTERM, an error), each folder's summary of the episodes recorded is
    written, marked incomplete. `model`: whose tokenizer the token ids are in, for
    run.json; `name`: the progress bar's (default: the one task's name)."""
    from agentrl.evaluation import Evaluation, wanted

    names = [job.task.spec.name for job in jobs]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(
            f"two tasks of the run are named {twice[0]}", fix="run them in separate runs"
        )
    runs = []
    for job in jobs:
        spec = job.spec or run_spec(job.task, type(sampler).__qualname__, model)
        folder = Evaluation(job.out_dir, spec, overwrite=overwrite)
        asked = wanted([job.task], samples)
        todo = folder.missing(asked)
        if kept := len(asked) - len(todo):
            log.info("%s: %d of %d episodes already recorded (kept)", job.out_dir, kept, len(asked))
        before = 0.0 if overwrite else _seconds_before(job.out_dir)
        run_id = folder.run_id(f"{job.task.spec.name}-{uuid.uuid4().hex[:8]}")
        runs.append(_Run(job.task, job.out_dir, folder, asked, todo, before, run_id))
    start = time.monotonic()
    going = [r for r in runs if r.todo]
    envs = {r.task.spec.name: make_env(r.task, provider, r.run_id) for r in going}
    if going:
        await preflight(list(envs.values()), sampler, tokenizer)  # before anything is written
    episodes, retention = [], Retention()  # one bound on kept snapshots per task of the run
    for r in going:
        r.folder.start(r.run_id, provider.name, model=model)
        if overwrite:
            for file in RUN_FILES:
                (r.out_dir / file).unlink(missing_ok=True)
        else:  # a line torn by a kill, or one whose trajectory's line was, goes
            ids = {f"{o.instance}_{o.attempt}" for o in r.folder.done}
            _keep_conversations(r.out_dir / CONVERSATIONS, ids)
        instances = {i.id: i for i in r.task.instances}
        factory = Episodes(sampler, tokenizer, envs, snapshots, r.folder.journal, retention)
        episodes += [factory.fresh(r.task, instances[inst], k) for _, inst, k in r.todo]
    by_task = {r.task.spec.name: r for r in going}

    def keep(traj: Trajectory) -> None:
        r = by_task[traj.task]
        r.folder.record(traj)
        with (r.out_dir / CONVERSATIONS).open("a", encoding="utf-8") as f:  # what it saw
            messages = seen_messages(r.task, traj, tokenizer)
            f.write(json.dumps({"trajectory_id": traj.trajectory_id, "messages": messages}))
            f.write("\n")

    try:
        if episodes:
            with progress_bars(show_progress) as progress:
                await stream_episodes(
                    episodes,
                    dispatcher or PipelineConfig(concurrency=4),
                    keep,
                    progress,
                    name or names[0],
                )
        for r in going:  # every episode asked is recorded: nothing is in flight
            r.folder.journal.clear()
    finally:  # interrupted too: what finished is summarised, and says it is not all
        seconds = time.monotonic() - start
        summaries = [
            _summary(
                r.out_dir,
                r.task,
                r.run_id if r.todo else _run_id_of(r.out_dir, r.run_id),
                set(r.asked),
                r.before + (seconds if r.todo else 0.0),
            )
            for r in runs
        ]
    return summaries


@dataclass
class _Run:
    """A job's folder as `run_tasks` finds it: what is asked, what is still to run."""

    task: Task
    out_dir: Path
    folder: Evaluation
    asked: list[Attempt]
    todo: list[Attempt]
    before: float
    run_id: str


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
    atomic.write_text(out_dir / SUMMARY, json.dumps(finite(summary.model_dump()), indent=2) + "\n")
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
    atomic.write_text(path, "".join(kept))
