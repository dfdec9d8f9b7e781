"""A warm pool: sandboxes started ahead of time, so an episode's INIT takes one from a queue.

Starting a container costs ~0.5 s; handing out one that is already running costs a
queue get. The pool refills in the background after each hand-out and never holds
more than `size` idle sandboxes. Sandboxes handed out belong to the caller (who
closes them); `close()` closes only the idle ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from agentrl.sandbox.base import Sandbox, SandboxProvider, SandboxSpec

log = logging.getLogger(__name__)


class WarmPool:
    """Keeps up to `size` started sandboxes of one spec ready to hand out."""

    def __init__(self, provider: SandboxProvider, spec: SandboxSpec, size: int = 4) -> None:
        if size < 1:
            raise ValueError(f"a warm pool needs size >= 1, got {size}")
        self.provider, self.spec, self.size = provider, spec, size
        self._ready: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._filling: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def idle(self) -> int:
        return self._ready.qsize()

    def _refill(self) -> None:
        while not self._closed and self._ready.qsize() + len(self._filling) < self.size:
            task = asyncio.create_task(self._start_one())
            self._filling.add(task)
            task.add_done_callback(self._filling.discard)

    async def _start_one(self) -> None:
        try:
            sandbox = await self.provider.start(self.spec)
        except Exception as e:  # the caller sees start errors on acquire, not here
            log.warning("warm pool could not start a sandbox: %s", e)
            await asyncio.sleep(1.0)  # do not spin on a broken engine
            return
        if self._closed:
            await sandbox.close()
            return
        self._ready.put_nowait(sandbox)

    async def start(self) -> None:
        """Fill every slot now; a start error propagates and nothing is left running."""
        missing = self.size - self._ready.qsize()
        results = await asyncio.gather(
            *(self.provider.start(self.spec) for _ in range(missing)), return_exceptions=True
        )
        started = [r for r in results if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        for sandbox in started:
            self._ready.put_nowait(sandbox)
        if failed:
            await self.close()
            raise failed[0]

    async def acquire(self) -> Sandbox:
        """A ready sandbox (started directly if the pool is empty); the pool refills."""
        if self._closed:
            raise RuntimeError("the warm pool is closed")
        try:
            sandbox = self._ready.get_nowait()
        except asyncio.QueueEmpty:
            sandbox = await self.provider.start(self.spec)
        self._refill()
        return sandbox

    async def close(self) -> None:
        """Stop refilling and close the idle sandboxes; idempotent."""
        self._closed = True
        for task in list(self._filling):
            with contextlib.suppress(Exception):
                await task  # a start in flight finishes, then sees _closed and closes
        while not self._ready.empty():
            await self._ready.get_nowait().close()
