"""`agentrl run`: every instance of a task, N samples each, trajectories to JSONL plus a summary.

Episodes run through the configured dispatcher (default: pipeline, 4 slots), stream into
`trajectories.jsonl` as they finish and are summarised in `summary.json`: reward mean
and spread, stop reasons, tool calls and tool errors, timings.
"""

from __future__ import annotations

import hashlib
import json
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
from agentrl.trajectory import Trajectory, TrajectoryStore, agent_counts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.sandbox.base import SandboxProvider
    from agentrl.tasks.env import TaskEnv


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


def summarize(task: str, run_id: str, trajs: list[Trajectory], seconds: float) -> RunSummary:
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
    A feed may grow while it runs (`keep` may put more in it; the bar's total follows)."""
    graded, total, infra = 0, 0.0, 0
    size = (lambda: episodes.size) if isinstance(episodes, Feed) else (lambda: len(episodes))
    bar = progress.add_task("", total=size(), name=name)
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
    finally:
        progress.remove_task(bar)


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
) -> RunSummary:
    run_id = f"{task.spec.name}-{uuid.uuid4().hex[:8]}"
    env = make_env(task, provider, run_id)
    await preflight([env], sampler, tokenizer)  # before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    store = TrajectoryStore(out_dir / "trajectories.jsonl")
    conversations = out_dir / "conversations.jsonl"
    info = RunInfo(run_id=run_id, provider=provider.name, tasks=[task.path], model=model)
    write_run_info(out_dir, info)
    episodes = [
        Episode(task, inst, k, sampler, tokenizer, env, snapshots=snapshots)
        for inst in task.instances
        for k in range(samples)
    ]

    done: list[Trajectory] = []

    def keep(traj: Trajectory) -> None:
        done.append(traj)
        store.append(traj)
        with conversations.open("a", encoding="utf-8") as f:  # what the model saw
            messages = seen_messages(task, traj, tokenizer)
            f.write(json.dumps({"trajectory_id": traj.trajectory_id, "messages": messages}))
            f.write("\n")

    start = time.monotonic()
    with progress_bars(show_progress) as progress:
        await stream_episodes(
            episodes, dispatcher or PipelineConfig(concurrency=4), keep, progress, task.spec.name
        )
    summary = summarize(task.spec.name, run_id, done, time.monotonic() - start)
    write_atomic(out_dir / "summary.json", json.dumps(summary.model_dump(), indent=2) + "\n")
    return summary
