"""The watch between commands: one task per event loop looks at every idle shell's
sandbox in turn (`BashTool.look_idle`), within a fixed share of a core, so what it costs
does not grow with the number of sandboxes (see `agentrl.tools.bash`)."""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from agentrl.sandbox.base import Sandbox, Usage

WATCH_S = 0.5  # usage is read this often while a command runs (less often if reading is slow)
IDLE_SHARE = 0.05  # of one core, at most, for the looks between commands, all shells together


class Watched(Protocol):
    """What the watch looks through: a shell's tool, False once it stops watching."""

    async def look_idle(self, sandbox: Sandbox) -> bool: ...


class IdleWatch:
    """The looks between commands for every idle shell on one event loop, by one task:
    each watched sandbox in turn, every WATCH_S at most, and the looks together within
    IDLE_SHARE of a core (after a look that took t seconds the watch rests t / IDLE_SHARE
    before the next one). A few sandboxes are each looked at every WATCH_S, as before; a
    fleet of 512 costs what a few do, each sandbox looked at less often."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, IdleWatch] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        self.watched: dict[Watched, Sandbox] = {}
        self.looks = 0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def of_loop(cls) -> IdleWatch:
        loop = asyncio.get_running_loop()
        if (watch := cls._by_loop.get(loop)) is None:
            watch = cls._by_loop[loop] = cls()
        return watch

    def add(self, tool: Watched, sandbox: Sandbox) -> None:
        self.watched[tool] = sandbox
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="bash idle watch")

    def remove(self, tool: Watched) -> None:
        self.watched.pop(tool, None)

    async def _run(self) -> None:
        due: dict[Watched, float] = {}
        while self.watched:
            now = time.monotonic()
            tool, sandbox = min(self.watched.items(), key=lambda kv: due.get(kv[0], 0.0))
            wait = due.get(tool, now + WATCH_S) - now
            if tool not in due:
                due[tool] = now + WATCH_S  # a new shell: its first look a WATCH_S away
                continue
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            started = time.monotonic()
            keep = await tool.look_idle(sandbox)
            self.looks += 1
            took = time.monotonic() - started
            due[tool] = time.monotonic() + WATCH_S
            if not keep:
                self.remove(tool)
            for gone in set(due) - set(self.watched):
                del due[gone]
            await asyncio.sleep(took * (1 / IDLE_SHARE - 1))  # the share of a core


def grew(before: int | None, after: int | None) -> bool:
    """Whether a counter rose between two looks (unknown counts as not)."""
    return before is not None and after is not None and after > before


def over_disk(usage: Usage, limit_mb: int) -> bool:
    return usage.disk_bytes is not None and usage.disk_bytes > limit_mb * 1024 * 1024


def mib(n: int | None) -> int:
    return (n or 0) // (1024 * 1024)
