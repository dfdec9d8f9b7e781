"""The dispatcher seam: episodes in, trajectories out as they finish.

A dispatcher schedules the stages of `agentrl.episode.Episode` (INIT, RUN, EVAL) and
decides what a trajectory holds while the sampler works for it (the gate). Configs
carry a `type` discriminator and build their dispatcher lazily.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from agentrl.dispatch.core import Feed
    from agentrl.dispatch.metrics import DispatchMetrics
    from agentrl.episode import Episode
    from agentrl.trajectory import Trajectory


class Dispatcher(Protocol):
    """Runs episodes; yields each one's trajectory exactly once, as it finishes."""

    metrics: DispatchMetrics | None
    """The last run's metrics (set when its stream ends)."""

    def run(self, episodes: Sequence[Episode] | Feed) -> AsyncGenerator[Trajectory, None]:
        """`episodes`: a fixed list, or a `Feed` that receives them over time."""
        ...


class _StageLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(default=8, ge=1, description="generation slots: requests in flight")
    init_timeout: float | None = Field(
        default=None, gt=0, description="seconds per INIT attempt (None: no limit)"
    )
    run_timeout: float | None = Field(
        default=None, gt=0, description="seconds for RUN (the task's episode_timeout also applies)"
    )
    eval_timeout: float | None = Field(default=None, gt=0, description="seconds for EVAL")
    init_attempts: int = Field(
        default=3, ge=1, description="INIT tries when the sandbox fails to start or set up"
    )


class BatchConfig(_StageLimits):
    """`concurrency` slots; each runs INIT -> RUN -> EVAL for one episode at a time."""

    type: Literal["batch"] = "batch"

    def build(self) -> Dispatcher:
        from agentrl.dispatch.batch import BatchDispatcher

        return BatchDispatcher(self)


class PipelineConfig(_StageLimits):
    """INIT, RUN and EVAL workers with bounded queues; a trajectory holds a generation
    slot only inside `sampler.generate`; live sandboxes are bounded separately."""

    type: Literal["pipeline"] = "pipeline"
    max_sandboxes: int | None = Field(
        default=None, ge=1, description="live sandboxes at once (default 3 x concurrency)"
    )
    init_workers: int | None = Field(
        default=None, ge=1, description="concurrent INITs (default: concurrency)"
    )
    eval_workers: int | None = Field(
        default=None, ge=1, description="concurrent EVALs (default: concurrency)"
    )
    queue_size: int = Field(default=4, ge=1, description="capacity of each queue between stages")
    slot_order: Literal["fair", "fifo"] = Field(
        default="fair",
        description="who gets a contended generation slot: the episode with the fewest turns"
        " so far (fair) or the longest-waiting request (fifo)",
    )

    @property
    def sandboxes(self) -> int:
        return self.max_sandboxes or 3 * self.concurrency

    def build(self) -> Dispatcher:
        from agentrl.dispatch.pipeline import PipelineDispatcher

        return PipelineDispatcher(self)


class SyncConfig(_StageLimits):
    """Waves of `concurrency` episodes in lock-step turns: all generate, then all act."""

    type: Literal["sync"] = "sync"

    def build(self) -> Dispatcher:
        from agentrl.dispatch.sync import SyncDispatcher

        return SyncDispatcher(self)


DispatchConfig = Annotated[BatchConfig | PipelineConfig | SyncConfig, Field(discriminator="type")]
