"""`Shell` over a pexpect spawn: what the docker and local shells share.

pexpect stays behind this class: callers see bytes, a timeout and `EOFError`.
"""

from __future__ import annotations

import contextlib

import pexpect
from pexpect.spawnbase import SpawnBase

READ_BYTES = 1 << 16


class PtyShell:
    """A pexpect spawn (bytes mode, pty echo on) behind the `Shell` protocol.

    Subclasses say how to end it: `release()` synchronously (also what a closing
    sandbox calls for each shell it opened), `close()` when ending it takes more.
    """

    def __init__(self, spawn: SpawnBase, opened: set[PtyShell]) -> None:
        spawn.delaybeforesend = None  # pexpect sleeps 50 ms before each send otherwise
        self._spawn = spawn
        self._opened = opened  # the sandbox's open shells; this one leaves it when closed
        self._closed = False
        opened.add(self)

    def send(self, data: bytes) -> None:
        self._spawn.send(data)

    def read(self, timeout: float) -> bytes:
        try:
            data: bytes = self._spawn.read_nonblocking(size=READ_BYTES, timeout=timeout)
        except pexpect.TIMEOUT:
            return b""
        except pexpect.EOF as exc:
            raise EOFError("the shell exited") from exc
        return data

    def alive(self) -> bool:
        return not self._closed and bool(self._spawn.isalive())

    async def close(self) -> None:
        self.release()

    def release(self) -> None:
        """End it without waiting on anything; idempotent."""
        self._closed = True
        self._opened.discard(self)
        with contextlib.suppress(Exception):
            self._spawn.close()
