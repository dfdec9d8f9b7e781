"""One run as the loop and both schedules share it, and what every step does whichever
the schedule: build episodes, roll them out through the dispatcher, store what comes
back, train on it and publish the new weights on the learner thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.algorithms import branch_credit, compute_advantages, group_stats
from agentrl.backends.base import samples_from
from agentrl.dispatch.core import Feed
from agentrl.dispatch.stream import stream_episodes
from agentrl.episode import Episode, Episodes
from agentrl.episode.journal import JOURNAL, Journal
from agentrl.inference.base import Replicated
from agentrl.snapshots import Retention
from agentrl.train.admission import Group
from agentrl.train.branches import Branches, branch_metrics, collect_group

if TYPE_CHECKING:
    from rich.progress import Progress
    from transformers import PreTrainedTokenizerBase

    from agentrl.backends.base import TrainerBackend
    from agentrl.inference.base import Sampler
    from agentrl.tasks.env import EpisodeEnv
    from agentrl.tasks.spec import Task
    from agentrl.train.data import Prompt
    from agentrl.train.records import MetricsLog
    from agentrl.train.sampler import TrainSampler
    from agentrl.train_config import TrainConfig
    from agentrl.trajectory import Trajectory, TrajectoryStore

T = TypeVar("T")


class Learner:
    """The one thread that owns the backend: it is built, stepped, published, checkpointed
    and closed there, off the event loop, while generation and tools go on."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class TrainRun:
    """What rank 0 has once everything is started: the config, the data, the backend and
    sampler, the sandboxes, and the files the run writes."""

    config: TrainConfig
    out: Path
    tasks: Sequence[Task]
    train: Sequence[Prompt]
    held: Sequence[Prompt]
    learner: Learner
    backend: TrainerBackend
    sampler: TrainSampler
    tokenizer: PreTrainedTokenizerBase
    envs: Sequence[EpisodeEnv]
    metrics: MetricsLog
    store: TrajectoryStore
    progress: Progress
    run_id: str  # names its sandboxes (and `agentrl gc` finds them by it)
    stored: int = 0  # trajectories written (a checkpoint records it)
    journal: Journal | None = None  # its episodes in flight (set once the weights are out)
    kept: set[tuple[str, str]] = field(default_factory=set)  # stored since the checkpoint
    retention: Retention = field(default_factory=Retention)  # what finished episodes keep

    def branches(self, sampler: Sampler) -> Branches | None:
        """The planner of continuations when the estimator is branch (else None)."""
        cfg = self.config.algorithm.advantage.branch
        return None if cfg is None else Branches(self, cfg, sampler)

    def open_journal(self) -> None:
        """The journal of the training episodes in flight (`agentrl.episode.journal`):
        their replay points, and those back until a checkpoint holds them. Opened once the
        weights are published: a resumed run takes what its checkpoint's versions sampled."""
        self.journal = Journal(
            self.out / JOURNAL, version=self.sampler.policy_version, run_id=self.run_id
        )

    @property
    def replayable(self) -> bool:
        """Whether every training episode has replay points (a snapshot policy with a
        cadence, sandboxes that can snapshot)."""
        return all(
            (self.config.snapshots or task.spec.snapshots).every and env.can_snapshot
            for task, env in zip(self.tasks, self.envs, strict=True)
        )

    def factory(self, sampler: Sampler, *, resumable: bool = False) -> Episodes:
        """How this run's episodes are made, by `sampler`; `resumable`: a training step's,
        which go on from the journal after a kill."""
        envs = {task.spec.name: env for task, env in zip(self.tasks, self.envs, strict=True)}
        journal = self.journal if resumable and self.replayable else None
        return Episodes(
            sampler, self.tokenizer, envs, self.config.snapshots, journal, self.retention
        )

    def make_episodes(
        self,
        prompts: Sequence[Prompt],
        samples: int,
        sampler: Sampler,
        *,
        first_sample: int = 0,
        scheduled_step: int = 0,
        branches: Branches | None = None,
        resumable: bool = False,
    ) -> list[Episode]:
        """`samples` episodes of each prompt (a group), numbered from `first_sample`: a
        trajectory id is `<instance>_<sample>`, so numbering from the step's or the group's
        offset keeps ids unique across the run. With `branches`, training episodes the
        branch estimator will branch from: they commit what it needs and hold their
        snapshots until it reclaims them. `resumable`: a training step's episodes, which a
        run killed mid-step takes from its journal (`rollout_groups(resumable=True)`)."""
        branching = branches.cfg.snapshot_every() if branches is not None else 0
        factory = self.factory(sampler, resumable=resumable)
        episodes = [
            factory.fresh(
                self.tasks[p.task],
                p.instance,
                first_sample + k,
                scheduled_step=scheduled_step,
                branching=branching,
            )
            for p in prompts
            for k in range(samples)
        ]
        if branches is not None:
            branches.hold(episodes)
        return episodes

    async def rollout(
        self,
        episodes: list[Episode] | Feed,
        what: str,
        keep: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """Every episode through a fresh dispatcher, each handed to `keep` as it finishes;
        returns them in that order."""
        out: list[Trajectory] = []

        def kept(traj: Trajectory) -> None:
            out.append(traj)
            if keep is not None:
                keep(traj)

        await stream_episodes(episodes, self.config.dispatcher, kept, self.progress, what)
        return out

    async def rollout_groups(
        self,
        episodes: list[Episode],
        n: int,
        what: str,
        branches: Branches | None,
        *,
        resumable: bool = False,
    ) -> list[Trajectory]:
        """Every `n` consecutive episodes are a group; with `branches`, each group's
        continuations join the same dispatcher run once its episodes are back, and its
        snapshots are reclaimed after. Returns the groups' trajectories, group by group.
        `resumable`: each is journaled as it is back, so a rerun after a kill takes it."""
        if not episodes:
            return []
        feed, groups, done = Feed(), {}, []
        starts = range(0, len(episodes), n)
        for g in starts:
            first = episodes[g]
            group = Group(g // n, 0, first.instance.id, first.scheduled_step, n)
            for ep in episodes[g : g + n]:
                groups[ep.trajectory_id] = group
                feed.put(ep)

        def returned(traj: Trajectory) -> None:
            if resumable:
                self.back(traj)
            if (group := collect_group(traj, groups, feed, branches)) is not None:
                done.append(group)
                if len(done) == len(starts):
                    feed.close()

        try:
            await self.rollout(feed, what, returned)
        except BaseException:
            if branches is not None:  # stopped mid-rollout: no snapshot may stay held
                await asyncio.shield(branches.close())
            raise
        trajs = [t for group in done for t in group.trajectories]
        return trajs if branches is None else await branches.reclaim(trajs)

    def back(self, trajectory: Trajectory) -> None:
        """A training episode is back: journaled until a checkpoint holds it, so a run
        killed before then takes it as it was (where every episode has replay points)."""
        if self.journal is not None and self.replayable:
            self.journal.finished(trajectory)

    def keep(self, trajectory: Trajectory) -> None:
        """Append to trajectories.jsonl."""
        self.store.append(trajectory)
        self.stored += 1
        self.kept.add((trajectory.task, trajectory.trajectory_id))

    async def learn(self, trajs: list[Trajectory]) -> dict[str, Any]:
        """Advantages, one optimizer step over `trajs` and the publication, on the learner
        thread; returns the step's fields of its TrainRecord."""
        cfg, backend, sampler = self.config, self.backend, self.sampler
        adv = cfg.algorithm.advantage
        fresh = [t for t in trajs if t.branch_of is None]
        row: dict[str, Any] = {"zero_variance_groups": group_stats(trajs).zero_variance_groups}
        if adv.branch is None:
            advantages, per_turn = compute_advantages(trajs, adv), None
            learned_from = fresh
        else:  # continuations estimate values; trained on only when asked
            credit = branch_credit(trajs, adv)
            advantages, per_turn = credit.outcome, credit.per_turn
            learned_from = trajs if adv.branch.train else fresh
            row.update(branch_metrics(trajs, credit))
        trained = [t for t in learned_from if cfg.algorithm.trains_on(t)]
        samples = samples_from(trained, advantages, per_turn)
        row["overlong_masked"] = len(learned_from) - len(trained)
        row["samples"] = len(samples)
        supervised = cfg.algorithm.loss.type == "cross_entropy"  # advantages unused
        t1 = time.monotonic()
        if samples and (supervised or any(s.has_signal for s in samples)):
            row.update(await self.learner.call(backend.train_step, samples, cfg.algorithm.loss))
            t2 = time.monotonic()
            row["policy_version"] = await self.learner.call(backend.publish, sampler)
        else:  # every group tied: no gradient, nothing to publish; the prompts are consumed
            row["skipped"] = "no group had a reward spread" if samples else "no trainable episode"
            t2 = time.monotonic()
            row["policy_version"] = sampler.policy_version
        t3 = time.monotonic()
        row.update(train_s=round(t2 - t1, 2), publish_s=round(t3 - t2, 2))
        if isinstance(sampler, Replicated):  # which replica serves which version
            row["replicas"] = sampler.status()
        return row
