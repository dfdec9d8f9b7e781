"""The fully-async schedule. One dispatcher run is fed groups for the whole run, admitted
under the staleness budget (`agentrl.train.admission`); the trainer takes mini-batches of
finished groups while generation goes on, trains and publishes on the learner thread
(the sampler pauses with in-flight requests kept, so a reply may span two versions:
`token_versions` says which token came from which), then widens the budget by one step.

Zero-variance groups are filtered. Trained and filtered prompt ids of the current epoch
are checkpointed and skipped on resume. Each step's record adds the lag of its groups
(consumed - scheduled step), its sampled tokens by version age, the admission counters,
and the idle fractions of trainer and sampler; `admission.jsonl` holds the counters over
time (`async.png` plots them with the lag distribution).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.batch import batch_stats
from agentrl.dispatch.core import Feed, cancel_and_wait
from agentrl.errors import ConfigError
from agentrl.train.admission import Admission, Group, GroupBuffer, no_signal
from agentrl.train.branches import collect_group
from agentrl.train.data import epoch_order
from agentrl.train.records import EpochEndRecord, TrainRecord
from agentrl.train.sampler import MeteredSampler

if TYPE_CHECKING:
    from agentrl.train.data import Prompt
    from agentrl.train.run import TrainRun
    from agentrl.train_config import AsyncSchedule

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class DataState:
    """Where the schedule is in its data: checkpointed, so a resume neither repeats nor
    skips a prompt of the current epoch."""

    epoch: int = 0
    trained: set[str] = field(default_factory=set)  # prompt ids of this epoch
    filtered: set[str] = field(default_factory=set)
    next_group: int = 0  # admission index of the next group (its trajectory ids)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> DataState:
        return cls(
            int(extra.get("epoch", 0)),
            set(extra.get("trained_prompts", [])),
            set(extra.get("filtered_prompts", [])),
            int(extra.get("next_group", 0)),
        )

    def to_extra(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "trained_prompts": sorted(self.trained),
            "filtered_prompts": sorted(self.filtered),
            "next_group": self.next_group,
        }

    def next_epoch(self) -> None:
        self.epoch += 1
        self.trained.clear()
        self.filtered.clear()


async def async_steps(
    run: TrainRun, sched: AsyncSchedule, resumed: dict[str, Any]
) -> AsyncGenerator[tuple[TrainRecord, dict[str, Any]], None]:
    """The steps after the resumed one: (the step's record, its checkpoint extra) after each."""
    B, n, S = sched.prompts_per_step, sched.n_samples_per_prompt, sched.max_staleness_steps
    step = int(resumed.get("step", 0))
    data = DataState.from_extra(resumed)
    adm = Admission.resumed(B, S, step)
    buf = GroupBuffer(adm)
    meter = MeteredSampler(run.sampler)
    feed = Feed()
    groups: dict[str, Group] = {}  # trajectory id -> its group, until it comes back
    timeline = _Timeline(run.out / "admission.jsonl", buf)
    branches = run.branches(meter)
    # Groups a kill left unconsumed go on from the journal (agentrl.episode.journal) where
    # every episode has replay points; not with branch credit (see sync.py).
    resumable = branches is None and run.replayable

    async def produce() -> None:
        again = await readmit() if resumable else set()
        while True:
            used = data.trained | data.filtered | again
            again = set()  # those readmitted belong to the epoch they were admitted in
            for i in epoch_order(len(run.train), run.config.seed, data.epoch):
                prompt = run.train[i]
                if prompt.id in used:  # consumed (or readmitted) before a resume
                    continue
                scheduled = await buf.admit()
                group = Group(data.next_group, data.epoch, prompt.id, scheduled, n)
                data.next_group += 1
                # first_sample: unique trajectory ids across the run
                start(group, prompt)
            await buf.end_epoch()  # returns when the trainer has closed the epoch

    def start(group: Group, prompt: Prompt) -> None:
        episodes = run.make_episodes(
            [prompt],
            n,
            meter,
            first_sample=group.index * n,
            scheduled_step=group.scheduled_step,
            branches=branches,
            resumable=resumable,
        )
        for ep in episodes:
            groups[ep.trajectory_id] = group
            feed.put(ep)

    async def readmit() -> set[str]:
        """The groups the journal holds (admitted before a kill, never consumed), with
        their indices, prompts and scheduled steps; their prompt ids."""
        assert run.journal is not None
        held = _journaled(run, n, data)
        for index, prompt, scheduled in held:
            await buf.admit()
            start(Group(index, data.epoch, prompt.id, scheduled, n), prompt)
            data.next_group = max(data.next_group, index + 1)
        if held:
            log.info("%d groups a kill interrupted go on from the journal", len(held))
        return {prompt.id for _, prompt, _ in held}

    async def collect() -> None:
        async with aclosing(run.config.dispatcher.build().run(feed)) as stream:
            async for traj in stream:
                if resumable:
                    run.back(traj)
                if (group := collect_group(traj, groups, feed, branches)) is None:
                    continue
                if branches is not None:
                    group.trajectories = await branches.reclaim(group.trajectories)
                # With branches, a spread among the continuations is a signal too (a state
                # worth more or less than the group's mean), so they count here.
                keep = not (
                    sched.filter_zero_variance
                    and no_signal(group.trajectories, sched.filter_tolerance)
                )
                if not keep:
                    data.filtered.add(group.prompt_id)
                    for t in group.trajectories:  # consumed_step None: never trained
                        run.keep(t)
                await buf.finish(group, keep=keep)
                timeline.flush()

    workers = [
        asyncio.create_task(produce(), name="async producer"),
        asyncio.create_task(collect(), name="async collector"),
    ]
    last = time.monotonic()
    idle_before = meter.idle_s()
    try:
        while step < sched.steps:
            wait_from = time.monotonic()
            batch, epoch_end = await _watch(buf.take(B), workers)
            waited = time.monotonic() - wait_from
            timeline.flush()
            if epoch_end:
                _end_epoch(run, data, step, batch)
                data.next_epoch()
                await buf.next_epoch()
                continue
            lags = [step - g.scheduled_step for g in batch]
            for g, lag in zip(batch, lags, strict=True):
                if lag > S:
                    log.warning(
                        "group %d (prompt %s) scheduled at step %d is consumed at step %d: "
                        "lag %d exceeds max_staleness_steps %d (trained on)",
                        g.index, g.prompt_id, g.scheduled_step, step, lag, S,
                    )  # fmt: skip
            trajs = [
                t.model_copy(update={"consumed_step": step}) for g in batch for t in g.trajectories
            ]
            for t in trajs:
                run.keep(t)
            version = run.sampler.policy_version  # the learner's weights, last published
            fresh = [t for t in trajs if t.branch_of is None]
            scores = batch_stats(fresh)
            tokens_by_age = _histogram(
                version - v
                for t in fresh
                for v, m in zip(t.token_versions, t.loss_mask, strict=True)
                if m
            )
            learned = await run.learn(trajs)
            await buf.advance()
            step += 1
            prompts = [g.prompt_id for g in batch]
            data.trained.update(prompts)
            now, idle = time.monotonic(), meter.idle_s()
            wall = max(now - last, 1e-9)
            record = TrainRecord(
                step=step,
                **scores,
                prompts=prompts,
                epoch=data.epoch,
                lag=_histogram(lags),
                lag_max=max(lags),
                stale_groups=sum(lag > S for lag in lags),
                tokens_by_age=tokens_by_age,
                **learned,
                wait_s=round(waited, 3),
                trainer_idle_frac=round(waited / wall, 4),
                sampler_idle_frac=round((idle - idle_before) / wall, 4),
                step_s=round(wall, 3),
                submitted=adm.submitted,
                accepted=adm.accepted,
                filtered=adm.filtered,
                running=adm.running,
                buffered=adm.buffered,
            )
            last, idle_before = now, idle
            timeline.flush()
            run.metrics.write(record)
            yield record, data.to_extra()
    finally:
        feed.close()
        await cancel_and_wait(workers)
        if branches is not None:  # groups in flight at the end: their snapshots go too
            await branches.close()
        timeline.flush()


def _journaled(run: TrainRun, n: int, data: DataState) -> list[tuple[int, Prompt, int]]:
    """(group index, prompt, scheduled step) of each group the run's journal holds whose
    prompt this epoch has not consumed, in admission order."""
    assert run.journal is not None
    by_key = {(run.tasks[p.task].spec.name, p.instance.id): p for p in run.train}
    held: dict[int, tuple[Prompt, int]] = {}
    for (task, _), found in run.journal.pending().items():
        prompt = by_key.get((task, found.partial.group_id))
        if prompt is not None and prompt.id not in data.trained | data.filtered:
            held.setdefault(found.sample // n, (prompt, found.partial.scheduled_step))
    seen: set[str] = set()
    out = []
    for index, (prompt, scheduled) in sorted(held.items()):
        if prompt.id not in seen:  # one group per prompt in an epoch
            seen.add(prompt.id)
            out.append((index, prompt, scheduled))
    return out


def _end_epoch(run: TrainRun, data: DataState, step: int, partial: list[Group]) -> None:
    """Record the epoch's end; an epoch that trained nothing is a dead end, said clearly."""
    run.metrics.write(
        EpochEndRecord(
            step=step,
            epoch=data.epoch,
            trained_prompts=len(data.trained),
            filtered_prompts=len(data.filtered),
            partial_batch=[g.prompt_id for g in partial],
        )
    )
    log.info(
        "epoch %d ends: %d prompts trained, %d filtered, a partial batch of "
        "%d groups is not trained",
        data.epoch, len(data.trained), len(data.filtered), len(partial),
    )  # fmt: skip
    if not data.trained:
        raise ConfigError(
            f"epoch {data.epoch} could not fill one mini-batch: "
            f"{len(data.filtered)} of its {len(run.train)} prompts were "
            "filtered as having no reward signal (every episode of the group "
            "got the same reward)",
            fix="check the grader and the task's difficulty, raise "
            "n_samples_per_prompt, or set schedule.filter_zero_variance: false",
        )


class _Timeline:
    """Appends the admission counters' changes to admission.jsonl (wall-clock stamped)."""

    def __init__(self, path: Path, buffer: GroupBuffer) -> None:
        self.path, self.buffer, self.done = path, buffer, 0
        self.origin = time.time() - (time.monotonic() - buffer.start)

    def flush(self) -> None:
        rows = self.buffer.timeline[self.done :]
        if not rows:
            return
        with self.path.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"time": round(self.origin + r["t"], 3), **r}) + "\n")
        self.done += len(rows)


def _histogram(values: Iterable[int]) -> dict[str, int]:
    """{"value": count}, keys in numeric order (JSON keys are strings)."""
    counts = Counter(values)
    return {str(k): counts[k] for k in sorted(counts)}


async def _watch(awaitable: Awaitable[T], workers: list[asyncio.Task[None]]) -> T:
    """Await `awaitable`; if a worker ends first (it never should), raise what ended it."""
    main = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait([main, *workers], return_when=asyncio.FIRST_COMPLETED)
            if main in done:
                return main.result()
            for w in done:
                if not w.cancelled() and (error := w.exception()) is not None:
                    raise error
                raise RuntimeError(f"the {w.get_name()} stopped")
    finally:
        if not main.done():
            main.cancel()
