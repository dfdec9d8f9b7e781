"""A container's interactive shell: a tty exec whose socket pexpect reads.

runc makes each exec a session leader; ending the shell SIGKILLs that session, from
the host first (it needs no free pid in the container, which a fork bomb may hold
all of), then from inside for an engine on another machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

import requests
from docker.errors import DockerException
from pexpect.fdpexpect import fdspawn

from agentrl.errors import SandboxError
from agentrl.sandbox.base import ExecRequest, ExecResult
from agentrl.sandbox.docker.engine import raw_socket
from agentrl.sandbox.procs import kill_session
from agentrl.sandbox.shell import PtyShell

ROWS, COLUMNS = 24, 200


PIDFILES = "/tmp/.agentrl-shell-"
"""Where a sandbox's shells save their pids (`<PIDFILES><n>.pid`): agentrl's, not the agent's."""


def with_pidfile(argv: list[str], pidfile: str) -> list[str]:
    """`argv` under an `sh` that first saves its pid (which names the session) in `pidfile`."""
    return ["sh", "-c", 'echo $$ > "$0"; exec "$@"', pidfile, *argv]


class DockerShell(PtyShell):
    """A `shell()` of a `DockerSandbox`: bytes mode, tty echo on, 200 columns."""

    def __init__(
        self,
        api: Any,
        container_id: str,
        exec_id: str,
        pidfile: str,
        stream: Any,
        run: Callable[[ExecRequest], Awaitable[ExecResult]],
        opened: set[PtyShell],
    ) -> None:
        raw = raw_socket(stream)
        raw.settimeout(None)
        # A dup of its own, so pexpect's close() cannot close an fd number the socket owns.
        spawn = fdspawn(os.dup(raw.fileno()), encoding=None, maxread=1 << 16, use_poll=True)
        super().__init__(spawn, opened)
        self._api, self._container_id = api, container_id
        self._exec_id, self._pidfile = exec_id, pidfile
        self._stream = stream  # docker-py's SocketIO: holding it keeps the connection open
        self._run = run  # the sandbox's exec

    @property
    def exec_id(self) -> str:
        return self._exec_id

    async def close(self) -> None:
        """SIGKILL the shell and every process in its session, and release its socket."""
        if self._closed:
            return
        self._closed = True  # at once: a second close() has nothing left to do
        with contextlib.suppress(DockerException, requests.RequestException, KeyError, ValueError):
            info = await asyncio.to_thread(self._api.exec_inspect, self._exec_id)
            if info.get("Pid"):  # the session leader, in the host's pid space
                kill_session(int(info["Pid"]), cgroup_marker=self._container_id)
        script = (
            f'p=$(cat {self._pidfile} 2>/dev/null); rm -f {self._pidfile}; [ -n "$p" ] || exit 0;'
            ' pkill -KILL -s "$p" || kill -KILL -- -"$p" "$p"'
        )
        with contextlib.suppress(SandboxError):  # closed or gone: nothing left inside
            await self._run(ExecRequest(command=["sh", "-c", script], timeout=10))
        self.release()

    def release(self) -> None:
        super().release()
        raw = getattr(self._stream, "_sock", None)
        with contextlib.suppress(Exception):
            self._stream.close()
            if raw is not None:
                raw.close()
