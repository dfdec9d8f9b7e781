"""Lock-step turns (the classic batched multi-turn rollout): waves of `concurrency`
episodes; in each turn every live episode submits its request, the batch is released
together and returns together, then everyone runs tools. A finished episode leaves
the barrier; the next wave starts when the whole wave is graded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from agentrl.dispatch.core import Feed, Run

if TYPE_CHECKING:
    from agentrl.dispatch.base import SyncConfig
    from agentrl.dispatch.metrics import DispatchMetrics
    from agentrl.episode import Episode
    from agentrl.trajectory import Trajectory


class LockStep:
    """A generation barrier for `parties` episodes; `leave()` when one is done."""

    def __init__(self, parties: int) -> None:
        self.live = parties
        self._waiting: list[asyncio.Future[None]] = []
        self._in_round = 0
        self._round_done = asyncio.Event()

    def leave(self) -> None:
        self.live -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._waiting and len(self._waiting) >= self.live:
            self._in_round, self._round_done = len(self._waiting), asyncio.Event()
            for fut in self._waiting:
                fut.set_result(None)
            self._waiting = []

    def _left_round(self, done: asyncio.Event) -> None:
        self._in_round -= 1
        if self._in_round <= 0:
            done.set()

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[None]:
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        self._maybe_release()
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.done():  # released, then cancelled before it ran: leave the round
                self._left_round(self._round_done)
            else:
                self._waiting.remove(fut)
                fut.cancel()
            raise
        done = self._round_done
        try:
            yield
        finally:
            self._left_round(done)
            await done.wait()  # a batched generate returns when its longest request does


class SyncDispatcher:
    def __init__(self, config: SyncConfig) -> None:
        self.config = config
        self.metrics: DispatchMetrics | None = None

    async def run(self, episodes: Sequence[Episode] | Feed) -> AsyncGenerator[Trajectory, None]:
        run = Run("sync", episodes, self.config, self.config.concurrency)
        size = self.config.concurrency

        async def one(ep: Episode, barrier: LockStep) -> None:
            try:
                try:
                    await run.init(ep)
                    await run.run(ep, run.gate(barrier))
                finally:
                    barrier.leave()
                await run.evaluate(ep)
            finally:
                await run.finish(ep)

        async def waves() -> None:
            # A wave: the next episode and those already waiting, up to `concurrency` (a
            # streaming feed's admissions must not wait for a wave that will never fill).
            while (first := await run.take()) is not None:
                wave = [first]
                while len(wave) < size and (ep := run.take_nowait()) is not None:
                    wave.append(ep)
                barrier = LockStep(len(wave))
                await asyncio.gather(*(one(ep, barrier) for ep in wave))

        try:
            async for traj in run.stream([waves()]):
                yield traj
        finally:
            self.metrics = run.metrics
