"""`agentrl eval`: k attempts of every instance of some tasks, recorded so that an
interrupted evaluation continues where it stopped, then scored (`agentrl.scores`).

An evaluation folder holds what `agentrl run` writes (`trajectories.jsonl` with the
grades beside it, `run.json`), so `failures`, `replay` and the viewer read it as they
read a run, plus:

  eval.json     what is evaluated (tasks and their hashes, policy, overrides): a resume
                must evaluate the same thing, or it is refused
  results.json  the scores (`agentrl.scores.Scores`) of the attempts the command asked for

Attempt a of instance i is the trajectory `i_a` of its task. Each is appended (fsynced)
as it finishes, so a killed evaluation loses only the attempts in flight; run again, it
keeps every recorded attempt and runs only the missing ones (a torn last line, from a
kill mid-write, is dropped first). Asking for more attempts adds only those. Attempts
that failed for infrastructure reasons are kept and reported apart; `retry_infra` runs
them again in place of the failed records.

Training's held-out evaluations are scored by the same `scores.score` and written in
the same layout (`eval/step-N/` of a train run).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from agentrl import atomic
from agentrl.dispatch.stream import progress_bars, stream_episodes
from agentrl.episode import Episodes, make_env
from agentrl.episode.journal import JOURNAL, Journal
from agentrl.errors import ConfigError, TrajectoryError
from agentrl.preflight import preflight
from agentrl.run_info import RunInfo, read_run_info, write_run_info
from agentrl.scores import Outcome, Scores, score
from agentrl.snapshots import Retention
from agentrl.trajectory import INFRA_STOP_REASONS, Trajectory, TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.dispatch.base import DispatchConfig
    from agentrl.inference.base import Sampler
    from agentrl.sandbox.base import SandboxProvider
    from agentrl.tasks.spec import Task

EVAL_INFO = "eval.json"
RESULTS = "results.json"
TRAJECTORIES = "trajectories.jsonl"
PLOT = "pass_at_k.png"
CHUNK = 1024  # attempts dispatched together (the pipeline drains only between chunks)


class EvalSpec(BaseModel):
    """What an evaluation evaluates: a resume in the same folder must match it."""

    model_config = ConfigDict(extra="forbid")

    tasks: dict[str, str] = Field(description="task name -> the hash of its files")
    paths: list[str] = Field(description="the task files, folders or row files, absolute")
    policy: str
    model: str | None = Field(
        default=None, description="whose tokenizer the replies are in (None: the policy's)"
    )
    temperature: float | None = None
    limits: dict[str, int] = Field(default_factory=dict, description="overridden limits")

    def differences(self, other: EvalSpec) -> list[str]:
        """What differs from `other`, in words (paths may move; the hashes may not)."""
        out = []
        if self.tasks.keys() != other.tasks.keys():
            out.append(f"tasks {sorted(other.tasks)} vs {sorted(self.tasks)}")
        else:
            out += [f"task {n} changed" for n in self.tasks if self.tasks[n] != other.tasks[n]]
        for field in ("policy", "model", "temperature", "limits"):
            if getattr(self, field) != getattr(other, field):
                out.append(f"{field} {getattr(other, field)!r} vs {getattr(self, field)!r}")
        return out


class Results(BaseModel):
    """results.json."""

    model_config = ConfigDict(extra="forbid")

    spec: EvalSpec
    attempts: int = Field(description="attempts asked per instance (-k)")
    scores: Scores


Attempt = tuple[str, str, int]
"""(task name, instance id, attempt index): the trajectory `<instance>_<attempt>`."""


def wanted(tasks: Sequence[Task], attempts: int) -> list[Attempt]:
    """`attempts` attempts of every instance of `tasks`."""
    return [
        (task.spec.name, inst.id, a)
        for task in tasks
        for inst in task.instances
        for a in range(attempts)
    ]


def recorded(path: Path) -> list[Outcome]:
    """The outcomes of the attempts in `path` (none when it is missing), read one record
    at a time. A torn last line, left by a writer killed mid-append, is cut off the file
    first; a bad line elsewhere is an error."""
    if not path.is_file():
        return []
    store = TrajectoryStore(path)
    store.cut_torn_tail()
    return [Outcome.of(t) for t in store]


def drop_infra(path: Path) -> None:
    """Rewrite `path` without its infrastructure failures (atomically)."""
    if not path.is_file():
        return
    infra = {r.value for r in INFRA_STOP_REASONS}
    with path.open("rb") as src, atomic.atomic_file(path) as tmp, tmp.open("wb") as dst:
        for line in src:
            if line.strip() and json.loads(line)["stop_reason"] not in infra:
                dst.write(line)


class Evaluation:
    """One evaluation folder: its spec, what it recorded, what it still needs."""

    def __init__(self, out: Path, spec: EvalSpec, *, overwrite: bool = False) -> None:
        """Read what `out` recorded (nothing with `overwrite`: `start` then removes it);
        a folder holding another evaluation, or no evaluation, is refused."""
        self.out, self.spec, self.overwrite = out, spec, overwrite
        self.store = TrajectoryStore(out / TRAJECTORIES)
        self.journal = Journal(out / JOURNAL)  # its episodes in flight, for a resume
        self.done: list[Outcome] = []
        if overwrite:
            return
        info = out / EVAL_INFO
        if info.is_file():
            before = EvalSpec.model_validate_json(info.read_text(encoding="utf-8"))
            if differs := spec.differences(before):
                held = "an evaluation" if (out / RESULTS).is_file() else "a run"
                raise ConfigError(
                    f"{out} holds {held} of something else ({'; '.join(differs)})",
                    fix="pick another --out, or add --overwrite to start it again; to "
                    "continue it, run the same task with the same policy and limits",
                )
        elif (out / TRAJECTORIES).exists():
            raise ConfigError(
                f"{out} holds trajectories but no {EVAL_INFO}: not an evaluation folder",
                fix="pick another --out (an empty or new folder)",
            )
        try:
            self.done = recorded(out / TRAJECTORIES)
        except TrajectoryError as e:
            raise ConfigError(
                f"{out}: its recorded attempts cannot be read: {e.message}",
                fix="pick another --out, or add --overwrite to start it again",
            ) from None

    def start(
        self, run_id: str, provider: str, *, model: str | None = None, retry_infra: bool = False
    ) -> None:
        """Write eval.json and run.json, before any attempt is appended: with `overwrite`,
        remove what the folder recorded first; with `retry_infra`, drop the recorded
        infrastructure failures (they run again)."""
        self.out.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            for name in (EVAL_INFO, RESULTS, TRAJECTORIES, PLOT, JOURNAL):
                (self.out / name).unlink(missing_ok=True)
            shutil.rmtree(self.store.grades_dir, ignore_errors=True)
        else:  # recorded episodes (infrastructure failures too: a retry starts afresh)
            self.journal.drop(
                {(task, f"{inst}_{a}") for task, inst, a in (o.key for o in self.done)}
            )
        atomic.write_text(self.out / EVAL_INFO, self.spec.model_dump_json(indent=2) + "\n")
        self.journal.run_id = run_id
        info = RunInfo(run_id=run_id, provider=provider, tasks=self.spec.paths, model=model)
        write_run_info(self.out, info)
        if retry_infra:
            drop_infra(self.out / TRAJECTORIES)
            self.done = [o for o in self.done if o.graded]

    def run_id(self, new: str) -> str:
        """The run id to record: a folder whose journal holds episodes a killed process
        left in flight goes on as that run (their snapshots are its); else `new`."""
        if self.overwrite or not self.journal.path.is_file():
            return new
        try:
            return read_run_info(self.out).run_id
        except (ConfigError, ValueError):
            return new

    def missing(self, wanted: Sequence[Attempt], *, retry_infra: bool = False) -> list[Attempt]:
        """The attempts of `wanted` not recorded yet (with `retry_infra`, nor those
        recorded as infrastructure failures), every instance's first attempt first."""
        have = {o.key for o in self.done if o.graded or not retry_infra}
        todo = [w for w in wanted if w not in have]
        return sorted(todo, key=lambda w: w[2])  # stable: instances stay in file order

    def record(self, traj: Trajectory) -> None:
        self.store.append(traj)
        self.done.append(Outcome.of(traj))
        self.journal.closed(traj.task, traj.trajectory_id)  # recorded: out of the journal

    def results(self, wanted: Sequence[Attempt], attempts: int) -> Results:
        """Score the recorded attempts that `wanted` names, write results.json."""
        order = {w: n for n, w in enumerate(wanted)}  # instances in the tasks' order
        chosen = sorted((o for o in self.done if o.key in order), key=lambda o: order[o.key])
        results = Results(spec=self.spec, attempts=attempts, scores=score(chosen))
        atomic.write_text(self.out / RESULTS, results.model_dump_json(indent=2) + "\n")
        return results


async def run_attempts(
    evaluation: Evaluation,
    tasks: Sequence[Task],
    todo: Sequence[Attempt],
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    provider: SandboxProvider,
    dispatcher: DispatchConfig,
    *,
    retry_infra: bool = False,
    show_progress: bool = True,
    model: str | None = None,
) -> None:
    """Run the attempts `todo` and record each as it finishes; nothing is written before
    the preflight (sampler, prompts, one trial INIT per task) passes. `model`: whose
    tokenizer the ids are in, for run.json."""
    run_id = evaluation.run_id(f"eval-{uuid.uuid4().hex[:8]}")
    by_name = {t.spec.name: t for t in tasks}
    envs = {name: make_env(by_name[name], provider, run_id) for name in {a[0] for a in todo}}
    await preflight(list(envs.values()), sampler, tokenizer)
    evaluation.start(run_id, provider.name, model=model, retry_infra=retry_infra)
    instances = {(t.spec.name, i.id): i for t in tasks for i in t.instances}
    factory = Episodes(sampler, tokenizer, envs, journal=evaluation.journal, retention=Retention())
    # Episodes hold their tokenized prompts: built a chunk at a time, not thousands at once.
    chunks = [todo[i : i + CHUNK] for i in range(0, len(todo), CHUNK)]
    with progress_bars(show_progress) as progress:
        for n, chunk in enumerate(chunks, 1):
            episodes = [
                factory.fresh(by_name[name], instances[(name, inst)], a) for name, inst, a in chunk
            ]
            name = "eval" if len(chunks) == 1 else f"eval {n}/{len(chunks)}"
            await stream_episodes(episodes, dispatcher, evaluation.record, progress, name)
    evaluation.journal.clear()  # every attempt asked is recorded: nothing is in flight


def plot_pass_at_k(scores: Scores, png: Path, title: str) -> None:
    """pass@k against k for each task (and all of them), pass@1 with its 95% interval."""
    from agentrl.figures import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [*scores.tasks, scores.overall] if len(scores.tasks) > 1 else scores.tasks
    for row in rows:
        ks = [int(k) for k in row.pass_at_k]
        line = ax.plot(ks, [100 * v for v in row.pass_at_k.values()], marker="o", label=row.task)
        if row.pass_at_1 is not None:
            ax.errorbar(
                [1], [100 * row.pass_at_1], yerr=[100 * row.pass_at_1_ci95], capsize=4,
                color=line[0].get_color(),
            )  # fmt: skip
    ax.set_xscale("log", base=2)
    ticks = sorted({int(k) for row in rows for k in row.pass_at_k})
    ax.set_xticks(ticks, [str(k) for k in ticks])
    ax.minorticks_off()
    ax.set_xlabel("k (attempts drawn)")
    ax.set_ylabel("pass@k %")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.legend(loc="lower right")
    save(fig, png)


def results_of(path: Path) -> tuple[str, Scores]:
    """(name, scores) of an evaluation folder, a train run's `eval/step-N` folder, or a
    trajectories file (scored as it is)."""
    if path.is_dir():
        if (path / RESULTS).is_file():
            results = Results.model_validate_json((path / RESULTS).read_text(encoding="utf-8"))
            return str(path), results.scores
        if (path / TRAJECTORIES).is_file():
            return str(path), score(TrajectoryStore(path / TRAJECTORIES))
        raise ConfigError(
            f"{path} holds no {RESULTS} and no {TRAJECTORIES}",
            fix="pass folders `agentrl eval --out` wrote, or a train run's eval/step-N folders",
        )
    if path.is_file():
        return str(path), score(TrajectoryStore(path))
    raise ConfigError(f"{path}: no such folder or file", fix="check the path")
