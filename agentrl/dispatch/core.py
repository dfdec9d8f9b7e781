"""What every dispatcher shares: guarded stages, the metered gate, and the result stream.

A stage never lets one episode's exception out: it becomes that episode's failed
trajectory (INIT -> sandbox_error, RUN -> aborted, EVAL -> eval_error), so no episode
can hang or cancel the others. When the stream ends — finished, abandoned or
cancelled (Ctrl-C) — the workers are cancelled and every sandbox is closed, shielded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from agentrl.dispatch.metrics import DispatchMetrics, EpisodeTiming, Recorder, summarize
from agentrl.trajectory import StopReason, Trajectory

if TYPE_CHECKING:
    from agentrl.agent import Episode, Gate
    from agentrl.dispatch.base import _StageLimits


class Run:
    """One dispatcher run over `episodes`: stage wrappers, counters, output queue."""

    def __init__(
        self, name: str, episodes: Sequence[Episode], limits: _StageLimits, max_sandboxes: int
    ) -> None:
        self.name, self.limits, self.max_sandboxes = name, limits, max_sandboxes
        self.episodes = list(episodes)
        ids = [ep.trajectory_id for ep in self.episodes]
        if len(set(ids)) != len(ids):
            raise ValueError("episodes must have distinct trajectory ids")
        self.rec = Recorder("generating", "init", "run", "eval", "sandboxes", "unrun")
        self.rec.set("unrun", len(self.episodes))
        self.out: asyncio.Queue[Trajectory] = asyncio.Queue()
        self.timings: list[EpisodeTiming] = []
        self.metrics: DispatchMetrics | None = None

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
            await _guard(
                ep,
                StopReason.sandbox_error,
                ep.init(timeout=self.limits.init_timeout, attempts=self.limits.init_attempts),
            )
        if ep.failed:
            self.rec.add("unrun", -1)

    async def run(self, ep: Episode, gate: Gate) -> None:
        if ep.failed:
            return
        async with self.rec.held("run"):
            await _guard(ep, StopReason.aborted, ep.run(gate, timeout=self.limits.run_timeout))
        self.rec.add("unrun", -1)

    async def evaluate(self, ep: Episode) -> None:
        async with self.rec.held("eval"):
            await _guard(ep, StopReason.eval_error, ep.evaluate(timeout=self.limits.eval_timeout))

    async def finish(self, ep: Episode) -> None:
        """Hand the trajectory out, then close the sandbox (the consumer need not wait)."""
        try:
            traj = ep.result()
        except Exception as e:  # a trajectory that breaks the ledger is a bug: report it as data
            ep.fail(StopReason.aborted, f"{type(e).__name__}: {e}")
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
        self.rec.add("sandboxes", -1)

    async def stream(self, workers: list[Coroutine[Any, Any, None]]) -> AsyncIterator[Trajectory]:
        """Run `workers` until every episode came out; yield trajectories as they do."""
        tasks = [asyncio.create_task(w) for w in workers]
        try:
            for _ in self.episodes:
                get = asyncio.ensure_future(self.out.get())
                while not get.done():
                    # Only the workers still running: a finished one would make this spin.
                    pending = [task for task in tasks if not task.done()]
                    await asyncio.wait([get, *pending], return_when=asyncio.FIRST_COMPLETED)
                    for task in tasks:  # a worker bug must surface, not hang the run
                        if task.done() and not task.cancelled() and task.exception():
                            get.cancel()
                            raise RuntimeError(f"{self.name} dispatcher worker died") from (
                                task.exception()
                            )
                yield get.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.shield(self._teardown(tasks))
            self.metrics = summarize(
                self.rec,
                dispatcher=self.name,
                slots=self.limits.concurrency,
                max_sandboxes=self.max_sandboxes,
                timings=self.timings,
            )

    async def _teardown(self, tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(ep.close() for ep in self.episodes), return_exceptions=True)


async def _guard(ep: Episode, stop: StopReason, stage: Awaitable[None]) -> None:
    try:
        await stage
    except Exception as e:  # crash isolation: this episode fails, the others go on
        ep.fail(stop, f"{type(e).__name__}: {e}")
