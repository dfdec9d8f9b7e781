"""The dispatcher's utilisation numbers from its counters' step series (pure arithmetic)."""

from __future__ import annotations

import time

from agentrl.dispatch.metrics import Recorder, summarize


def metrics(generating: list[tuple[float, int]], unrun: list[tuple[float, int]], wall: float):
    rec = Recorder("generating", "unrun")
    rec.series = {"generating": [(0.0, 0), *generating], "unrun": [(0.0, 0), *unrun]}
    rec.start = time.monotonic() - wall
    return summarize(rec, dispatcher="pipeline", slots=4, max_sandboxes=8, timings=[])


def test_a_fixed_batch_is_steady_from_full_slots_to_its_drain() -> None:
    m = metrics([(1.0, 4), (8.0, 2), (10.0, 0)], [(0.5, 12), (6.0, 3), (9.0, 0)], wall=10.0)
    assert m.steady_window == (1.0, 6.0) and m.utilisation_steady == 1.0


def test_a_streaming_feed_is_steady_until_its_last_drain_not_its_first_dip() -> None:
    """The async schedule admits groups as steps free room: the episodes left to run dip
    below the slots and refill many times before the end. The window ran from full
    slots to the first dip (empty here, so it read 0.0); it ends at the last drain."""
    generating = [(1.0, 4), (3.0, 2), (4.0, 4), (20.0, 1), (22.0, 0)]
    unrun = [(0.5, 4), (2.0, 2), (4.0, 6), (19.0, 1), (21.0, 0)]
    m = metrics(generating, unrun, wall=22.0)
    assert m.steady_window == (1.0, 19.0)
    assert m.utilisation_steady == round((2 * 4 + 1 * 2 + 15 * 4) / 18 / 4, 4)
