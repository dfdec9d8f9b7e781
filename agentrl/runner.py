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
from pathlib import Path
from typing import TYPE_CHECKING

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
from agentrl.tasks.spec import SnapshotPolicy, Task
from agentrl.trajectory import BRANCHES, Trajectory, TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.evaluation import EvalSpec
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
    run_id = folder.run_id(f"{task.spec.name}-{uuid.uuid4().hex[:8]}")
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
    factory = Episodes(sampler, tokenizer, {task.spec.name: env}, snapshots, folder.journal)
    episodes = [factory.fresh(task, instances[inst], k) for _, inst, k in todo]

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
        folder.journal.clear()  # every episode asked is recorded: nothing is in flight
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
