"""An episode's replay points: sandbox commits made in the background, and their retention.

After INIT and after every `every`-th turn the sandbox is committed while the next
generation runs; the next action waits for the commit (`settle`), so the snapshot holds
the state the turn left. A failed commit loses a replay point, never the episode.
Retention: a full-reward success keeps its snapshots only if it falls in the
`keep_successful` sample, drawn from a hash of its ids so the choice is reproducible;
the others are removed at close and recorded as none. An episode trained with branch
credit also commits the states its branches need and holds every snapshot at close;
`reclaimable` then says which of them the replay policy would not have kept.
What the finished episodes of a run keep stays within each task's `keep_gb`
(`Retention`): past it, the episodes that finished first lose theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentrl.errors import AgentRLError
from agentrl.sandbox.base import Sandbox
from agentrl.tasks.spec import SnapshotPolicy
from agentrl.trajectory import EnvInfo, Trajectory, Turn

if TYPE_CHECKING:
    from agentrl.tasks.env import EpisodeEnv

log = logging.getLogger(__name__)


class Snapshots:
    """The commits one episode makes (a branch inherits others, which it never removes)."""

    def __init__(self, policy: SnapshotPolicy, branching: int = 0) -> None:
        self.policy = policy
        self.branching = branching  # also commit before every k-th turn, and hold them all
        # The commit in flight, where its id goes (the turn, or the INIT record), and the
        # turns done that it holds.
        self._pending: tuple[Turn | EnvInfo, asyncio.Future[str], int] | None = None
        self.made: list[str] = []
        self._held_at: dict[str, tuple[int, Turn | EnvInfo]] = {}  # made: turns done, record
        self.pinned: str | None = None  # what the sandbox was restored from: never removed
        self.superseded: list[tuple[int, str]] = []  # (turns done, id) to remove now

    def due(self, turns_done: int, *, last: bool = False) -> bool:
        """Whether the turn that makes `turns_done` turns is committed (0: the INIT state).
        `last`: no turn can follow it, so no branch starts there (only replay wants it)."""
        every, k = self.policy.every, self.branching
        return (bool(every) and turns_done % every == 0) or (
            bool(k) and not last and turns_done > 0 and turns_done % k == 0
        )

    @property
    def held(self) -> bool:
        """Whether close leaves every snapshot in place (branches reclaim them)."""
        return bool(self.branching)

    def start(
        self,
        sandbox: Sandbox,
        record: Turn | EnvInfo,
        label: str,
        landed: Callable[[str], None] | None = None,
        done: int = 0,
    ) -> None:
        """Commit the sandbox, which has `done` turns behind it, in the background; its id
        goes to `record` once settled, and to `landed` (the run's journal) the moment the
        commit lands."""
        assert self._pending is None

        async def commit() -> str:
            snapshot_id = await sandbox.snapshot(label)
            if landed is not None:
                landed(snapshot_id)
            return snapshot_id

        self._pending = (record, asyncio.ensure_future(commit()), done)

    async def settle(self, name: str) -> None:
        """Wait for the commit in flight, if any, and record its id."""
        if self._pending is None:
            return
        record, commit, done = self._pending
        try:
            snapshot_id = await asyncio.shield(commit)  # a cancelled wait leaves it pending
        except AgentRLError as e:  # a failed commit loses a replay point, not the episode
            log.warning("%s: snapshot failed: %s", name, e)
            self._pending = None
            return
        self._pending = None
        previous = self.made[-1] if self.made else None
        self.made.append(snapshot_id)
        self._held_at[snapshot_id] = (done, record)
        _record(record, snapshot_id)
        if previous is not None:
            self._supersede(previous)

    def _supersede(self, snapshot_id: str) -> None:
        """With `keep_every`, a snapshot kept only to go on from after a kill is of no use
        once a newer one landed (each holds the whole state): it is unrecorded and queued
        for removal now, so the disk holds the kept ones and the newest while the episode
        runs (a commit holds all the agent changed since INIT: 1-10 MB on a SWE task)."""
        k = self.policy.keep_every
        done, record = self._held_at.get(snapshot_id, (0, None))
        if not k or self.held or done == 0 or done % k == 0 or snapshot_id == self.pinned:
            return
        if record is not None:
            _record(record, None)
        self.made.remove(snapshot_id)
        self.superseded.append((done, snapshot_id))

    def dropped(self, key: str, reward: float | None) -> bool:
        """Whether retention removes these snapshots: a full-reward success not in the
        `keep_successful` sample (drawn from `key`, the run and trajectory ids)."""
        if reward is None or reward < 1.0:
            return False
        draw = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
        return draw >= self.policy.keep_successful

    def thinned(self, turns: list[Turn]) -> set[str]:
        """What `keep_every` removes once the episode is over: the snapshots after a
        number of turns that is not a multiple of it (INIT's stays)."""
        k = self.policy.keep_every
        if not k:
            return set()
        made = set(self.made)
        return {
            t.snapshot_id for done, t in enumerate(turns, 1) if t.snapshot_id in made and done % k
        }

    def reclaimable(self, key: str, traj: Trajectory) -> set[str]:
        """The snapshots of a held episode that its replay policy would not have kept:
        those committed only for branching, and all of them for a success retention drops."""
        kept = self.policy.keep_every or self.policy.every
        drop_all = traj.trainable and self.dropped(key, traj.reward)
        return {sid for done, sid in recorded(traj) if drop_all or not (kept and done % kept == 0)}

    async def remove(self, remove: Callable[[str], Awaitable[int]], ids: set[str]) -> None:
        """Remove those of `ids` this episode made, newest first: after a resume, a
        snapshot of the restored sandbox is a child of the image it was restored from, and
        an image with children cannot be removed."""
        for snapshot_id in reversed(self.made):
            if snapshot_id in ids:
                with contextlib.suppress(Exception):  # gc --snapshots reclaims what is left
                    await remove(snapshot_id)


def recorded(traj: Trajectory) -> list[tuple[int, str]]:
    """(turns done, snapshot id) of every snapshot `traj` records, in the order made."""
    made = [(0, traj.env.init_snapshot)] + [
        (k + 1, turn.snapshot_id) for k, turn in enumerate(traj.turns)
    ]
    return [(done, sid) for done, sid in made if sid]


@dataclass
class _Kept:
    store: EpisodeEnv  # where the task's snapshots live: sized and removed there
    ids: list[str]  # in the order they were made
    size: int


@dataclass
class Retention:
    """The snapshots a run's finished episodes keep (for replay, `agentrl failures`),
    per task, oldest first. Each task's snapshot policy may bound them (`keep_gb`):
    once an episode's are counted in and the task's total passes the bound, the
    episodes that finished first lose all of theirs until it is back under (a replay of
    one then finds its snapshots removed and runs INIT again). So a run of days holds a
    bounded window of its newest failures, where without a bound the disk fills (2.3 GB
    an hour at 64 SWE sandboxes on 2 CPUs, benchmarks/full_shape.py).

    One per run, shared by the factories of its episodes (`Episodes`) and by branch
    credit's reclaiming. What a killed process had kept is not counted by the one that
    resumes it (`agentrl gc --snapshots --run RUN_ID` removes a run's)."""

    _kept: dict[str, OrderedDict[str, _Kept]] = field(default_factory=dict)
    _bytes: dict[str, int] = field(default_factory=dict)
    removed_episodes: int = 0
    freed_bytes: int = 0

    def bytes(self, task: str) -> int:
        """What task `task`'s finished episodes keep, as measured when they finished."""
        return self._bytes.get(task, 0)

    async def keep(
        self,
        task: str,
        key: str,
        ids: list[str],
        policy: SnapshotPolicy,
        store: EpisodeEnv,
    ) -> None:
        """Count in episode `key`'s kept snapshots `ids` (in the order made), then remove
        the oldest episodes' while the task's total is over `policy.keep_gb`."""
        if policy.keep_gb is None or not ids:
            return
        sizes = await asyncio.gather(
            *(store.snapshot_bytes(i) for i in ids), return_exceptions=True
        )  # one the engine cannot size now counts 0: a bound a little loose, never a crash
        size = sum(n for n in sizes if isinstance(n, int))
        kept = self._kept.setdefault(task, OrderedDict())
        before = kept.pop(key, None)  # counted again (a resumed episode's): once, newest
        kept[key] = _Kept(store, list(ids), size)
        total = self._bytes.get(task, 0) - (before.size if before else 0) + kept[key].size
        limit = int(policy.keep_gb * 2**30)
        victims = []
        while total > limit and kept:  # chosen before any await: closes run side by side
            _, oldest = kept.popitem(last=False)
            total -= oldest.size
            victims.append(oldest)
        self._bytes[task] = total
        for victim in victims:
            for snapshot_id in reversed(victim.ids):  # newest first: a child before its parent
                with contextlib.suppress(Exception):  # gc --snapshots reclaims what is left
                    self.freed_bytes += await victim.store.remove_snapshot(snapshot_id)
            self.removed_episodes += 1
        if victims:
            log.info(
                "%s: removed the snapshots of %d finished episode(s) to keep within "
                "keep_gb %g (%d removed this run)",
                task,
                len(victims),
                policy.keep_gb,
                self.removed_episodes,
            )


def _record(record: Turn | EnvInfo, snapshot_id: str | None) -> None:
    if isinstance(record, Turn):
        record.snapshot_id = snapshot_id
    else:
        record.init_snapshot = snapshot_id


def unrecorded(turns: list[Turn], env: EnvInfo, gone: set[str]) -> tuple[list[Turn], EnvInfo]:
    """Turn and INIT records without the snapshots in `gone` (removed, or being removed)."""
    turns = [
        t.model_copy(update={"snapshot_id": None}) if t.snapshot_id in gone else t for t in turns
    ]
    if env.init_snapshot in gone:
        env = env.model_copy(update={"init_snapshot": None})
    return turns, env


def without_snapshots(traj: Trajectory, gone: set[str]) -> Trajectory:
    """`traj` recording none of the snapshots in `gone`."""
    turns, env = unrecorded(traj.turns, traj.env, gone)
    if turns == traj.turns and env == traj.env:
        return traj
    return traj.model_copy(update={"turns": turns, "env": env})
