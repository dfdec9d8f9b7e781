"""Episodes through a dispatcher, each trajectory handed on as it finishes, with progress
a person can follow: a bar on a terminal, log lines elsewhere (a file, a pipe)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentrl.dispatch.core import Feed

if TYPE_CHECKING:
    from agentrl.dispatch.base import DispatchConfig
    from agentrl.episode import Episode
    from agentrl.trajectory import Trajectory

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
"""Where no bar is drawn (output to a file or a pipe), a progress line at most this often."""


def progress_bars(show: bool) -> Progress:
    """Bars named by their `name` field, with a count, the time and a description."""
    return Progress(
        TextColumn("[bold]{task.fields[name]}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        disable=not show,
    )


async def stream_episodes(
    episodes: list[Episode] | Feed,
    dispatcher: DispatchConfig,
    keep: Callable[[Trajectory], None],
    progress: Progress,
    name: str,
) -> None:
    """Run `episodes` through a fresh dispatcher, handing each trajectory to `keep` as it
    finishes (nothing else holds it), under a bar `name` showing the reward mean so far.
    A feed may grow while it runs (`keep` may put more in it; the bar's total follows).
    Where no bar is live (output to a file or a pipe), the same news is logged instead:
    at the start, after the first episode, at most every LOG_EVERY_S seconds, and after
    the last."""
    graded, total, infra = 0, 0.0, 0
    size = (lambda: episodes.size) if isinstance(episodes, Feed) else (lambda: len(episodes))
    bar = progress.add_task("", total=size(), name=name)
    lines = progress.disable or not progress.console.is_terminal  # rich draws nothing there
    start = said = time.monotonic()
    if lines:
        log.info("%s: %d episodes to run", name, size())
    try:
        async with aclosing(dispatcher.build().run(episodes)) as stream:
            async for traj in stream:
                keep(traj)
                if traj.trainable:
                    graded, total = graded + 1, total + (traj.reward or 0.0)
                else:
                    infra += 1
                mean = f"{total / graded:.2f}" if graded else "-"
                shown = f"reward mean {mean}" + (f", {infra} infra failures" if infra else "")
                progress.update(bar, advance=1, total=size(), description=shown)
                now, done = time.monotonic(), graded + infra
                if lines and (now - said >= LOG_EVERY_S or done in (1, size())):
                    said = now
                    elapsed = time.strftime("%H:%M:%S", time.gmtime(now - start))
                    log.info("%s: %d/%d episodes, %s, %s", name, done, size(), shown, elapsed)
    finally:
        progress.remove_task(bar)
