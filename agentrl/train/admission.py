"""The fully-async schedule's bookkeeping: admission under a staleness budget, the buffer
of finished groups, and the epoch boundary.

With B groups per mini-batch and S = `max_staleness_steps`, at trainer step s (1-based;
`step` below counts the steps done, so s = step + 1) a group is admitted only while
accepted + running < (S + s) * B. `accepted` is cumulative (trained groups and buffered
ones), so the groups buffered or running never exceed B * (S + 1); with S = 0 only the
current mini-batch fits and generation cannot run ahead of its update. A group is
`running` from admission until its last episode is graded; then it is `accepted` into
the buffer or `filtered` (no reward signal), which frees its slot. At every moment
submitted = accepted + filtered + running (`Admission.check`).

The budget is aggregate, not per group: a long group admitted at step g can be consumed
at a step c > g + S. It is trained on; its lag c - g is recorded and logged as a warning.

Epochs are barriers, as in SkyRL: the prompts of epoch e are admitted in their seeded
order; when all are admitted and none is running, the full mini-batches left are trained
and what remains (fewer than B groups) is the epoch's partial batch: reported, not
trained, its prompts not marked used. Then epoch e + 1 begins.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentrl.trajectory import Trajectory


class BudgetError(AssertionError):
    """The admission counters broke an invariant: a bug, never a user error."""


@dataclass
class Admission:
    """The counters of the staleness budget (pure: no clock, no asyncio)."""

    groups_per_step: int  # B
    max_staleness: int  # S
    step: int = 0  # trainer steps done
    submitted: int = 0
    accepted: int = 0  # cumulative: trained + buffered
    filtered: int = 0
    running: int = 0
    consumed: int = 0  # accepted groups handed to the trainer

    @classmethod
    def resumed(cls, groups_per_step: int, max_staleness: int, step: int) -> Admission:
        """The counters of a run resumed after `step` steps (its buffer was lost)."""
        done = step * groups_per_step
        return cls(groups_per_step, max_staleness, step, done, done, 0, 0, done)

    @property
    def limit(self) -> int:
        """accepted + running may not exceed this at the current step."""
        return (self.max_staleness + self.step + 1) * self.groups_per_step

    @property
    def buffered(self) -> int:
        return self.accepted - self.consumed

    def can_admit(self) -> bool:
        return self.accepted + self.running < self.limit

    def admit(self) -> int:
        """Start a group; returns the step it is scheduled at (steps done so far)."""
        if not self.can_admit():
            raise BudgetError(f"admit beyond the budget: {self}")
        self.submitted += 1
        self.running += 1
        self.check()
        return self.step

    def finish(self, *, keep: bool) -> None:
        """A running group ended: into the buffer (keep) or filtered out."""
        if self.running <= 0:
            raise BudgetError(f"finish with no group running: {self}")
        self.running -= 1
        if keep:
            self.accepted += 1
        else:
            self.filtered += 1
        self.check()

    def consume(self, k: int) -> None:
        """The trainer takes `k` buffered groups."""
        if k > self.buffered:
            raise BudgetError(f"consume {k} of {self.buffered} buffered: {self}")
        self.consumed += k
        self.check()

    def drop(self, k: int) -> None:
        """An epoch's partial batch (k buffered groups) will not be trained: its slots are
        freed as a filtered group's are."""
        if k > self.buffered:
            raise BudgetError(f"drop {k} of {self.buffered} buffered: {self}")
        self.accepted -= k
        self.filtered += k
        self.check()

    def advance(self) -> None:
        """A trainer step is done (and its weights published): the budget grows by B."""
        self.step += 1
        self.check()

    def check(self) -> None:
        if self.submitted != self.accepted + self.filtered + self.running:
            raise BudgetError(f"submitted != accepted + filtered + running: {self}")
        if min(self.running, self.buffered, self.filtered) < 0:
            raise BudgetError(f"a negative counter: {self}")
        if self.accepted + self.running > self.limit:
            raise BudgetError(f"accepted + running > (S + s) * B: {self}")
        if self.buffered + self.running > (self.max_staleness + 1) * self.groups_per_step:
            raise BudgetError(f"buffered + running > B * (S + 1): {self}")

    def counters(self) -> dict[str, int]:
        return {
            "submitted": self.submitted,
            "accepted": self.accepted,
            "filtered": self.filtered,
            "running": self.running,
            "buffered": self.buffered,
        }


@dataclass
class Group:
    """The episodes of one prompt, admitted together at `scheduled_step`."""

    index: int  # run-wide admission order (its episodes' sample ids follow from it)
    epoch: int
    prompt_id: str
    scheduled_step: int
    size: int  # grows by its continuations when it is branched (`agentrl.train.branches`)
    trajectories: list[Trajectory] = field(default_factory=list)
    branched: bool = False

    @property
    def complete(self) -> bool:
        return len(self.trajectories) == self.size


def no_signal(trajectories: Sequence[Trajectory], tolerance: float) -> bool:
    """Whether a group carries no reward signal: among its live episodes (trainable, with
    sampled tokens) none, or two or more whose rewards lie within `tolerance`. A group
    with a single live episode is kept, as SkyRL keeps it."""
    live = [
        t.reward
        for t in trajectories
        if t.trainable and t.num_sampled > 0 and t.reward is not None and math.isfinite(t.reward)
    ]
    if not live:
        return True
    return len(live) >= 2 and max(live) - min(live) <= tolerance


class GroupBuffer:
    """`Admission` shared by the producer, the collector and the trainer on one loop.

    producer: `admit()` before starting a group, `end_epoch()` after the epoch's last.
    collector: `finish(group, keep)` when a group's last episode is graded.
    trainer: `take(B)` a mini-batch, `advance()` after publishing it; at an epoch's end
    `take` returns the partial batch instead, and the producer waits until the trainer
    has done its epoch bookkeeping and called `next_epoch()`. Every change is appended
    to `timeline` (seconds since start, counters).
    """

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self._changed = asyncio.Condition()
        self._ready: collections.deque[Group] = collections.deque()
        self._epoch_over = False
        self.start = time.monotonic()
        self.timeline: list[dict[str, Any]] = []
        self._record()

    def _record(self) -> None:
        row = {"t": round(time.monotonic() - self.start, 3), "step": self.admission.step}
        self.timeline.append(row | self.admission.counters())

    async def admit(self) -> int:
        async with self._changed:
            await self._changed.wait_for(self.admission.can_admit)
            step = self.admission.admit()
            self._record()
            return step

    async def finish(self, group: Group, *, keep: bool) -> None:
        async with self._changed:
            self.admission.finish(keep=keep)
            if keep:
                self._ready.append(group)
            self._record()
            self._changed.notify_all()

    async def end_epoch(self) -> None:
        """Every prompt of the epoch is admitted: returns once the trainer has called
        `next_epoch()`."""
        async with self._changed:
            self._epoch_over = True
            self._changed.notify_all()
            await self._changed.wait_for(lambda: not self._epoch_over)

    async def take(self, k: int) -> tuple[list[Group], bool]:
        """(k groups, False), or (the epoch's partial batch, True) at an epoch's end."""
        adm = self.admission
        async with self._changed:
            await self._changed.wait_for(
                lambda: len(self._ready) >= k or (self._epoch_over and adm.running == 0)
            )
            if len(self._ready) >= k:
                batch = [self._ready.popleft() for _ in range(k)]
                adm.consume(k)
                self._record()
                return batch, False
            partial = list(self._ready)
            self._ready.clear()
            adm.drop(len(partial))
            self._record()
            return partial, True

    async def next_epoch(self) -> None:
        """The trainer closed the epoch that `take` ended: the producer goes on."""
        async with self._changed:
            self._epoch_over = False
            self._changed.notify_all()

    async def advance(self) -> None:
        async with self._changed:
            self.admission.advance()
            self._record()
            self._changed.notify_all()
