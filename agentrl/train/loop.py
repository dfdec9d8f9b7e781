"""The run's loop: resume or start fresh, then the schedule's steps with evaluation and
checkpoints on their cadence, then the summary and the plots.

Held-out instances are evaluated before the first step, every `eval.every` steps and
after the last one. A checkpoint records how many metric lines and trajectories were
written when it was taken; a resumed run drops those written after, so the files read
as one uninterrupted run.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import time
from contextlib import aclosing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl import atomic
from agentrl.batch import batch_stats
from agentrl.episode.journal import JOURNAL
from agentrl.evaluation import EvalSpec, Evaluation
from agentrl.train.asynchronous import async_steps
from agentrl.train.plots import plot_async, plot_reward, tensorboard
from agentrl.train.records import EvalRecord, Summary
from agentrl.train.sync import sync_steps
from agentrl.train_config import AsyncSchedule
from agentrl.trajectory import TrajectoryStore
from agentrl.weights.checkpoint import latest_checkpoint

if TYPE_CHECKING:
    from agentrl.train.run import TrainRun

log = logging.getLogger(__name__)

# What a fresh start removes from its folder (a resumed run truncates instead).
RUN_FILES = (
    "metrics.jsonl",
    "trajectories.jsonl",
    "trajectories.jsonl.index",  # agentrl view's
    "summary.json",
    "reward.png",
    "admission.jsonl",
    "async.png",
    JOURNAL,
)
RUN_FOLDERS = ("checkpoints", "eval", "tensorboard")


def checkpoints(out: Path) -> Path:
    """Where a run in `out` keeps its checkpoints (`step-N`, atomic)."""
    return out / "checkpoints"


async def train_loop(run: TrainRun, *, resume: bool) -> Summary:
    """Train `run` to `schedule.steps`; returns the summary it wrote."""
    cfg, sched = run.config, run.config.schedule
    resumed = await _resume_or_start(run, resume)
    # It samples the learner's weights; a resumed run's under the version they had, so the
    # token versions of a run read the same whatever kills it met.
    await run.learner.call(run.backend.publish, run.sampler, resumed.get("policy_version"))
    run.open_journal()
    board = run.metrics.board = tensorboard(run.out / "tensorboard")
    start = int(resumed.get("step", 0))
    started = time.monotonic()
    try:
        with run.progress:
            bar = run.progress.add_task("", total=sched.steps, completed=start, name="train")
            if start == 0:
                await evaluate(run, 0)
            if isinstance(sched, AsyncSchedule):
                steps = async_steps(run, sched, resumed)
            else:
                steps = sync_steps(run, start)
            async with aclosing(steps) as records:
                async for record, extra in records:
                    loss = (record.model_extra or {}).get("loss", 0)
                    description = f"reward {record.reward_mean:.2f}  loss {loss:.3f}"
                    run.progress.update(bar, advance=1, description=description)
                    done = record.step
                    if (cfg.eval.every and done % cfg.eval.every == 0) or done == sched.steps:
                        await evaluate(run, done)
                    if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or (
                        done == sched.steps
                    ):
                        await run.learner.call(checkpoint, run, done, extra)
                        if run.journal is not None:  # the checkpoint holds what was kept
                            run.journal.drop(run.kept)
                        run.kept.clear()
    finally:
        if board is not None:
            board.close()
    metrics = run.out / "metrics.jsonl"
    summary = Summary.of(metrics, cfg.name, sched.type, time.monotonic() - started)
    atomic.write_text(run.out / "summary.json", json.dumps(summary.model_dump(), indent=2) + "\n")
    plot_reward(metrics, run.out / "reward.png", cfg.name)
    if isinstance(sched, AsyncSchedule):
        plot_async(run.out, cfg.name, sched.max_staleness_steps)
    return summary


async def evaluate(run: TrainRun, step: int) -> EvalRecord:
    """`eval.samples` attempts of each held-out instance with the weights after `step`,
    recorded and scored as `agentrl eval` does, into `eval/step-N/`."""
    samples = run.config.eval.samples
    held = sorted({p.task for p in run.held})
    spec = EvalSpec(
        tasks={run.tasks[t].spec.name: run.tasks[t].hash for t in held},
        paths=[str(Path(run.tasks[t].path).resolve()) for t in held],
        policy=f"{run.out.resolve()} after step {step}",
        temperature=run.config.temperature,
    )
    evaluation = Evaluation(eval_folder(run.out, step), spec, overwrite=True)
    evaluation.start(run.run_id, run.config.provider, model=run.config.model)
    episodes = run.make_episodes(run.held, samples, run.sampler)
    t0 = time.monotonic()
    trajs = await run.rollout(episodes, f"eval after step {step}", evaluation.record)
    asked = [
        (run.tasks[p.task].spec.name, p.instance.id, a) for p in run.held for a in range(samples)
    ]
    overall = evaluation.results(asked, samples).scores.overall
    record = EvalRecord(
        step=step,
        **batch_stats(trajs),
        pass_at_1=float("nan") if overall.pass_at_1 is None else overall.pass_at_1,
        pass_at_1_ci95=overall.pass_at_1_ci95,
        pass_at_k=overall.pass_at_k,
        eval_s=round(time.monotonic() - t0, 2),
    )
    run.metrics.write(record)
    return record


def eval_folder(out: Path, step: int) -> Path:
    """Where a run in `out` records its held-out evaluation after `step` steps."""
    return out / "eval" / f"step-{step:06d}"


def checkpoint(run: TrainRun, done: int, extra: dict[str, Any]) -> None:
    """Save the backend after `done` steps with what a resume needs (on the learner
    thread); keep the newest `checkpoint.keep`."""
    root = checkpoints(run.out)
    # What was written up to now: a resume drops what comes after.
    written = {"metrics_lines": run.metrics.lines, "trajectories": run.stored}
    # `model` names the base the weights belong to (agentrl eval --policy exports them).
    meta = {
        "step": done,
        "seed": run.config.seed,
        "model": run.config.model,
        "policy_version": run.sampler.policy_version,
        **written,
        **extra,
    }
    path = run.backend.save_checkpoint(root, meta, step=done)
    log.info("checkpoint %s", path)
    complete = sorted(p for p in root.glob("step-*") if ".tmp" not in p.name)
    for old in complete[: -run.config.checkpoint.keep]:
        shutil.rmtree(old, ignore_errors=True)


async def _resume_or_start(run: TrainRun, resume: bool) -> dict[str, Any]:
    """The newest checkpoint's extra, the files cut back to it; or {} and a clean folder."""
    if resume and (path := latest_checkpoint(checkpoints(run.out))) is not None:
        resumed: dict[str, Any] = await run.learner.call(run.backend.load_checkpoint, path)
        run.metrics.truncate(resumed["metrics_lines"])
        run.stored = resumed["trajectories"]
        trajs = run.out / "trajectories.jsonl"
        if trajs.exists():
            kept = list(itertools.islice(TrajectoryStore(trajs), run.stored))
            atomic.write_text(trajs, "".join(t.to_json() + "\n" for t in kept))
        log.info("resumed from %s at step %d", path, resumed["step"])
        return resumed
    for name in RUN_FILES:
        (run.out / name).unlink(missing_ok=True)
    for folder in RUN_FOLDERS:
        shutil.rmtree(run.out / folder, ignore_errors=True)
    return {}
