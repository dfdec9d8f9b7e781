"""`Shell` over a pexpect spawn: what the docker and local shells share.

pexpect stays behind this class: callers see bytes, a timeout and `EOFError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import subprocess
import sys
import termios

import pexpect
from pexpect.fdpexpect import fdspawn
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


ON_THE_PTY = """
import fcntl, os, signal, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGXFSZ):
    signal.signal(sig, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])
"""
"""Run by a fresh Python, the child's session leader: the pty becomes its terminal (Ctrl-C
reaches the foreground job), signals go back to their defaults (ignored ones survive exec:
a background parent ignores SIGINT, Python SIGPIPE), then it execs `argv` (same pid)."""


def spawn_on_pty(
    argv: list[str], *, cwd: str | None, env: dict[str, str] | None, size: tuple[int, int]
) -> tuple[fdspawn, subprocess.Popen[bytes]]:
    """`argv` on a new pty of this machine (`size`: rows, columns; echo on), the leader of
    its own session: pexpect on the pty's master, and the process.

    No Python runs between fork and exec (no `preexec_fn`, no `pexpect.spawn`, whose
    ptyprocess runs Python in the child): in a process holding torch, pyarrow and the rest,
    Python in a forked child has crashed there with SIGSEGV."""
    master, slave = os.openpty()
    try:
        rows, cols = size
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        process = subprocess.Popen(
            [sys.executable, "-c", ON_THE_PTY, *argv],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return fdspawn(master, encoding=None, maxread=1 << 16, use_poll=True), process
