"""What every dispatcher shares: the episode feed, guarded stages, the metered gate, and
the result stream.

Episodes come from a `Feed`: a list given up front (a rollout of fixed size) or episodes
put in over time until `close()` (the async schedule admits groups as its staleness
budget allows). Workers `take` the next episode; the stream ends when the feed is closed
and every episode put in came out.

A stage never lets one episode's exception out (the episode's own boundary makes it
that episode's failed trajectory), so no episode can hang or cancel the others. When
the stream ends — finished, abandoned or
cancelled (Ctrl-C) — the workers are cancelled and every sandbox is closed, shielded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Coroutine, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from agentrl.dispatch.metrics import DispatchMetrics, EpisodeTiming, Recorder, summarize
from agentrl.trajectory import Trajectory

if TYPE_CHECKING:
    from agentrl.dispatch.base import _StageLimits
    from agentrl.episode import Episode
    from agentrl.play import Gate


class Feed:
    """Episodes for a dispatcher: `put` them (any time), `close()` when no more will come.

    `Feed.of(episodes)` is a closed feed holding a fixed list.
    """

    def __init__(self) -> None:
        self._queue: collections.deque[Episode] = collections.deque()
        self._waiters: list[asyncio.Future[None]] = []
        self.closed = False
        self.size = 0  # episodes put in so far
        self._ids: set[str] = set()

    @classmethod
    def of(cls, episodes: Iterable[Episode]) -> Feed:
        feed = cls()
        for ep in episodes:
            feed.put(ep)
        feed.close()
        return feed

    def put(self, ep: Episode) -> None:
        if self.closed:
            raise ValueError("put into a closed feed")
        if ep.trajectory_id in self._ids:
            raise ValueError(f"episodes must have distinct trajectory ids: {ep.trajectory_id!r}")
        self._ids.add(ep.trajectory_id)
        self._queue.append(ep)
        self.size += 1
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def changed(self) -> asyncio.Future[None]:
        """Done at the next put or close (registered now, so no wake-up is missed)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def take_nowait(self) -> Episode | None:
        """The next episode if one is waiting, else None."""
        return self._queue.popleft() if self._queue else None

    async def take(self) -> Episode | None:
        """The next episode, waiting for one; None once the feed is closed and empty."""
        while not self._queue:
            if self.closed:
                return None
            await self.changed()
        return self._queue.popleft()


class Run:
    """One dispatcher run over a feed of episodes: stage wrappers, counters, output queue."""

    def __init__(
        self,
        name: str,
        episodes: Sequence[Episode] | Feed,
        limits: _StageLimits,
        max_sandboxes: int,
    ) -> None:
        self.name, self.limits, self.max_sandboxes = name, limits, max_sandboxes
        self.feed = episodes if isinstance(episodes, Feed) else Feed.of(episodes)
        # Taken from the feed and not yet finished: what a teardown must close. Finished
        # ones leave, so a streaming run (the async schedule) holds only its live episodes.
        self.episodes: set[Episode] = set()
        self.rec = Recorder("generating", "init", "run", "eval", "sandboxes", "unrun")
        self.rec.set("unrun", self.feed.size)
        self.out: asyncio.Queue[Trajectory] = asyncio.Queue()
        self.timings: list[EpisodeTiming] = []
        self.metrics: DispatchMetrics | None = None
        self.yielded = 0
        self.runs_ended = 0  # episodes whose RUN ended (or whose INIT failed)

    async def take(self) -> Episode | None:
        """The next episode for a worker (None: the feed is done)."""
        return self._taken(await self.feed.take())

    def take_nowait(self) -> Episode | None:
        return self._taken(self.feed.take_nowait())

    def _taken(self, ep: Episode | None) -> Episode | None:
        if ep is not None:
            self.episodes.add(ep)
            self._count_unrun()  # a streaming feed grew since the last count
        return ep

    def _count_unrun(self, ended: int = 0) -> None:
        self.runs_ended += ended
        self.rec.set("unrun", self.feed.size - self.runs_ended)

    def gate(self, inner: Gate | None = None) -> Gate:
        """`inner` (a slot, a barrier, or nothing), counting the requests in the sampler."""

        @asynccontextmanager
        async def held() -> AsyncIterator[None]:
            outer = inner() if inner is not None else contextlib.nullcontext()
            async with outer, self.rec.held("generating"):
                yield

        return held

    async def init(self, ep: Episode) -> None:
        self.rec.add("sandboxes", 1)
        async with self.rec.held("init"):
            await ep.init(timeout=self.limits.init_timeout, attempts=self.limits.init_attempts)
        if ep.failed:
            self._count_unrun(1)

    async def run(self, ep: Episode, gate: Gate) -> None:
        if ep.failed:
            return
        async with self.rec.held("run"):
            await ep.run(gate, timeout=self.limits.run_timeout)
        self._count_unrun(1)

    async def evaluate(self, ep: Episode) -> None:
        async with self.rec.held("eval"):
            await ep.evaluate(timeout=self.limits.eval_timeout)

    async def finish(self, ep: Episode) -> None:
        """Hand the trajectory out, then close the sandbox (the consumer need not wait)."""
        traj = ep.result()
        self.timings.append(
            EpisodeTiming(
                trajectory_id=ep.trajectory_id,
                init_s=round(ep.seconds["init"], 3),
                run_s=round(ep.seconds["run"], 3),
                eval_s=round(ep.seconds["eval"], 3),
                init_attempts=ep.env_info.init_attempts,
                stop_reason=traj.stop_reason.value,
            )
        )
        self.out.put_nowait(traj)
        await ep.close()
        self.episodes.discard(ep)
        self.rec.add("sandboxes", -1)

    async def stream(self, workers: list[Coroutine[Any, Any, None]]) -> AsyncIterator[Trajectory]:
        """Run `workers` until every episode came out; yield trajectories as they do."""
        tasks = [asyncio.create_task(w) for w in workers]
        try:
            while not self._done():
                get = asyncio.ensure_future(self.out.get())
                fed: asyncio.Future[None] | None = None  # wakes on a put or close
                try:
                    while not get.done() and not self._done():
                        if fed is None or fed.done():
                            fed = self.feed.changed()
                        # Only the workers still running: a finished one would make this spin.
                        waits: list[asyncio.Future[Any]] = [get, fed]
                        waits += [task for task in tasks if not task.done()]
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                        for task in tasks:  # a worker bug must surface, not hang the run
                            if task.done() and not task.cancelled() and task.exception():
                                raise RuntimeError(f"{self.name} dispatcher worker died") from (
                                    task.exception()
                                )
                finally:
                    if fed is not None:
                        fed.cancel()
                    if not get.done():
                        get.cancel()
                if get.done() and not get.cancelled():
                    self.yielded += 1
                    yield get.result()
        finally:
            await asyncio.shield(self._teardown(tasks))
            self.metrics = summarize(
                self.rec,
                dispatcher=self.name,
                slots=self.limits.concurrency,
                max_sandboxes=self.max_sandboxes,
                timings=self.timings,
            )

    def _done(self) -> bool:
        return self.feed.closed and self.yielded == self.feed.size

    async def _teardown(self, tasks: list[asyncio.Task[None]]) -> None:
        await cancel_and_wait(tasks)
        await asyncio.gather(*(ep.close() for ep in self.episodes), return_exceptions=True)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, every: float = 1.0) -> None:
    """Cancel `tasks` and return when every one has ended (their errors are dropped).

    A task that swallowed its cancellation and awaited again is cancelled again, every
    `every` seconds: Python 3.11's `asyncio.wait_for` loses a cancel that arrives as the
    call it wraps finishes, and a dispatcher worker then waits on its queue for ever (a
    finished async training run hung in teardown this way).
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
    for task in tasks:  # retrieved, so asyncio does not log them as never retrieved
        if not task.cancelled():
            task.exception()
