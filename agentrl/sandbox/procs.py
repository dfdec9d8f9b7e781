"""Host-side process control shared by the sandbox providers."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path


def kill_session(sid: int, *, cgroup_marker: str | None = None) -> int:
    """SIGKILL every process in session `sid` (also those that left its process group).

    With `cgroup_marker` (a container id) only processes whose cgroup names it are
    touched, so a pid from another pid namespace can never hit a host process. Works
    without forking inside the sandbox, which matters when a fork bomb holds every
    pid it may have. Returns how many processes were signalled.
    """
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs (macOS): the process group is the best we can do
        with contextlib.suppress(OSError):
            os.killpg(sid, signal.SIGKILL)
        return 0
    killed = 0
    # A pid is not reused while some process still has it as its session id, so
    # members found here are really the session's, even after its leader was reaped.
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            # Fields after the ")" that ends the command name: state ppid pgrp session.
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) != sid:
                continue
            if cgroup_marker and cgroup_marker not in (entry / "cgroup").read_text():
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed += 1
    return killed


def kill_marked(marker: str, rounds: int = 5) -> list[str]:
    """SIGKILL every process of ours whose environment holds `marker` (`NAME=value`), in
    rounds until none is left (a process may fork while we look); 'pid command' of each."""
    own, wanted, killed = os.getpid(), b"\0" + marker.encode() + b"\0", []
    for _ in range(rounds):
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == own:
                continue
            with contextlib.suppress(OSError):
                if wanted in b"\0" + (entry / "environ").read_bytes() + b"\0":
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").strip()
                    os.kill(int(entry.name), signal.SIGKILL)
                    found.append(f"{entry.name} {command.decode(errors='replace')}")
        if not found:
            break
        killed += found
    return killed


def in_cgroup(pid: int, marker: str) -> bool:
    """Whether process `pid` on this host exists and its cgroup names `marker` (a container id)."""
    try:
        return marker in (Path("/proc") / str(pid) / "cgroup").read_text()
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ExitBackstop:
    """Closes, at interpreter exit, what was opened and never closed (STYLE rule 9).

    `add(key, close_now)` when something is opened, `discard(key)` when it is closed;
    whatever is left when the interpreter exits gets its synchronous close called.
    """

    def __init__(self) -> None:
        self._live: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._registered = False

    def add(self, key: str, close_now: Callable[[], None]) -> None:
        with self._lock:
            self._live[key] = close_now
            if not self._registered:
                self._registered = True
                atexit.register(self.close_all)

    def discard(self, key: str) -> None:
        with self._lock:
            self._live.pop(key, None)

    def close_all(self) -> None:
        with self._lock:
            left = list(self._live.values())
        for close_now in left:
            with contextlib.suppress(Exception):
                close_now()
