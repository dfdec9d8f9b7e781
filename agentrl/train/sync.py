"""The sync schedule. Each step: the next `prompts_per_step` training prompts (in the
seeded data order), `n_samples_per_prompt` episodes each through the dispatcher with
version v, advantages per group, one optimizer step over the batch, and the new
weights published to the sampler (version v + 1). With branch credit, a group's
continuations join the same dispatcher run as soon as its episodes are back (sampled
with version v too), and the step trains once every group's are back."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from agentrl.batch import batch_stats
from agentrl.train.data import data_order
from agentrl.train.records import TrainRecord
from agentrl.train.sampler import MeteredSampler

if TYPE_CHECKING:
    from agentrl.train.run import TrainRun


async def sync_steps(
    run: TrainRun, start: int
) -> AsyncGenerator[tuple[TrainRecord, dict[str, Any]], None]:
    """The steps after `start`: (the step's record, its checkpoint extra) after each."""
    sched = run.config.schedule
    B, n = sched.prompts_per_step, sched.n_samples_per_prompt
    meter = MeteredSampler(run.sampler)
    branches = run.branches(meter)
    # A step killed mid-rollout goes on (agentrl.episode.journal) where its episodes have
    # replay points (TrainRun.replayable: keeping the finished ones while running those in
    # flight again from INIT would favour short episodes). Not yet with branch credit,
    # whose continuations hold their parents' snapshots.
    resumable = branches is None
    for step in range(start, sched.steps):
        prompts = [run.train[i] for i in data_order(len(run.train), run.config.seed, step * B, B)]
        # first_sample: unique trajectory ids across the run
        episodes = run.make_episodes(
            prompts,
            n,
            meter,
            first_sample=step * n,
            scheduled_step=step,
            branches=branches,
            resumable=resumable,
        )
        t0, idle = time.monotonic(), meter.idle_s()
        trajs = await run.rollout_groups(
            episodes, n, f"step {step + 1} rollout", branches, resumable=resumable
        )
        t1 = time.monotonic()
        trajs = [t.model_copy(update={"consumed_step": step}) for t in trajs]
        for t in trajs:
            run.keep(t)
        scores = batch_stats([t for t in trajs if t.branch_of is None])
        learned = await run.learn(trajs)
        wall = max(time.monotonic() - t0, 1e-9)
        record = TrainRecord(
            step=step + 1,
            **scores,
            prompts=[p.id for p in prompts],
            **learned,
            rollout_s=round(t1 - t0, 2),
            wait_s=round(t1 - t0, 3),  # the trainer waits for the whole rollout
            trainer_idle_frac=round((t1 - t0) / wall, 4),
            sampler_idle_frac=round((meter.idle_s() - idle) / wall, 4),
            step_s=round(wall, 3),
        )
        run.metrics.write(record)
        yield record, {}
