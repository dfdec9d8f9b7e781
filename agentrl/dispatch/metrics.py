"""What a dispatcher run did over time: generation-slot utilisation, stage occupancy,
queue depths and per-episode stage seconds, as a pydantic model that dumps to JSON.

A `Recorder` keeps one step series per counter (`generating`, `init`, `run`, `eval`,
`sandboxes`, queue depths, `unrun` = episodes whose RUN has not ended); `summarize`
turns them into `DispatchMetrics`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pydantic import BaseModel, ConfigDict, Field

Series = list[tuple[float, int]]
"""(seconds since the run started, counter value from then on), in time order."""


class EpisodeTiming(BaseModel):
    """Seconds one episode spent in each stage."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    init_s: float
    run_s: float
    eval_s: float
    init_attempts: int
    stop_reason: str


class DispatchMetrics(BaseModel):
    """One dispatcher run, in numbers (see `Recorder`)."""

    model_config = ConfigDict(extra="forbid")

    dispatcher: str
    generation_slots: int = Field(description="requests the sampler may serve at once")
    max_sandboxes: int = Field(description="live sandboxes allowed at once")
    episodes: int
    wall_seconds: float
    utilisation_mean: float = Field(description="busy generation slots / slots, over the run")
    utilisation_steady: float = Field(
        description="the same over the steady state: from the first moment every slot was busy "
        "until fewer episodes than slots were left to RUN for good (the drain; a streaming "
        "feed dips below and refills before it)"
    )
    steady_window: tuple[float, float]
    utilisation: list[tuple[float, float]] = Field(
        description="(bin start s, mean busy slots / slots in the bin)"
    )
    peaks: dict[str, int] = Field(description="highest value each counter reached")
    series: dict[str, Series] = Field(description="every counter's step series")
    timings: list[EpisodeTiming]


class Recorder:
    """Counters with their history, stamped with seconds since construction."""

    def __init__(self, *names: str) -> None:
        self.start = time.monotonic()
        self.level = dict.fromkeys(names, 0)
        self.series: dict[str, Series] = {name: [(0.0, 0)] for name in names}

    def now(self) -> float:
        return time.monotonic() - self.start

    def set(self, name: str, value: int) -> None:
        self.level[name] = value
        self.series.setdefault(name, [(0.0, 0)]).append((self.now(), value))

    def add(self, name: str, delta: int) -> None:
        self.set(name, self.level.get(name, 0) + delta)

    @asynccontextmanager
    async def held(self, name: str) -> AsyncIterator[None]:
        """Count one more in `name` while the block runs."""
        self.add(name, 1)
        try:
            yield
        finally:
            self.add(name, -1)


def integral(series: Series, a: float, b: float) -> float:
    """The area under a step series between `a` and `b`."""
    total = 0.0
    for (t, v), (t_next, _) in zip(series, [*series[1:], (max(b, series[-1][0]), 0)], strict=True):
        lo, hi = max(t, a), min(t_next, b)
        if hi > lo:
            total += v * (hi - lo)
    return total


def _drain(unrun: Series, slots: int, wall: float) -> float:
    """When fewer episodes than slots were left to RUN and it stayed so: the last drop
    below `slots` (a streaming feed, such as the async schedule's admission, dips and
    refills many times before its end); `wall` if it never dropped."""
    drain = None
    for t, v in unrun:
        if v >= slots:
            drain = None
        elif drain is None and t > 0:
            drain = t
    return wall if drain is None else drain


def summarize(
    rec: Recorder,
    *,
    dispatcher: str,
    slots: int,
    max_sandboxes: int,
    timings: list[EpisodeTiming],
    bins: int = 200,
) -> DispatchMetrics:
    wall = rec.now()
    gen = rec.series.get("generating", [(0.0, 0)])
    full = next((t for t, v in gen if v >= slots), None)
    drain = _drain(rec.series.get("unrun", []), slots, wall)
    start = full if full is not None else next((t for t, v in gen if v > 0), 0.0)
    end = max(drain, start)
    width = max(wall / bins, 1e-6)
    utilisation = [
        (round(k * width, 3), round(integral(gen, k * width, (k + 1) * width) / width / slots, 4))
        for k in range(bins)
    ]
    return DispatchMetrics(
        dispatcher=dispatcher,
        generation_slots=slots,
        max_sandboxes=max_sandboxes,
        episodes=len(timings),
        wall_seconds=round(wall, 3),
        utilisation_mean=round(integral(gen, 0.0, wall) / max(wall, 1e-9) / slots, 4),
        utilisation_steady=round(
            integral(gen, start, end) / max(end - start, 1e-9) / slots if end > start else 0.0, 4
        ),
        steady_window=(round(start, 3), round(end, 3)),
        utilisation=utilisation,
        peaks={name: max(v for _, v in s) for name, s in rec.series.items()},
        series={name: [(round(t, 4), v) for t, v in s] for name, s in rec.series.items()},
        timings=timings,
    )
