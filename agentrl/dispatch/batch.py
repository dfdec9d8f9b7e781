"""The bounded async batch: `concurrency` slots, each INIT -> RUN -> EVAL one episode at a
time (the baseline of the published 1.55x pipeline result). A slot's generation
capacity idles while its episode starts a sandbox, runs a tool or is graded."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING

from agentrl.dispatch.core import Feed, Run

if TYPE_CHECKING:
    from agentrl.dispatch.base import BatchConfig
    from agentrl.dispatch.metrics import DispatchMetrics
    from agentrl.episode import Episode
    from agentrl.trajectory import Trajectory


class BatchDispatcher:
    def __init__(self, config: BatchConfig) -> None:
        self.config = config
        self.metrics: DispatchMetrics | None = None

    async def run(self, episodes: Sequence[Episode] | Feed) -> AsyncGenerator[Trajectory, None]:
        run = Run("batch", episodes, self.config, self.config.concurrency)
        gate = run.gate()  # the slot itself bounds generation

        async def slot() -> None:
            while (ep := await run.take()) is not None:  # each slot takes the next episode
                try:
                    await run.init(ep)
                    await run.run(ep, gate)
                    await run.evaluate(ep)
                finally:
                    await run.finish(ep)

        try:
            async for traj in run.stream([slot() for _ in range(self.config.concurrency)]):
                yield traj
        finally:
            self.metrics = run.metrics
