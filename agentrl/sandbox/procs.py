"""Host-side process control shared by the sandbox providers: killing processes, reading
a container's cgroup counters and sizing a folder, all without running anything inside."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


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


def kill_marked(marker: str, timeout: float = 5.0) -> list[str]:
    """SIGKILL every process of ours whose environment holds `marker` (`NAME=value`), and
    return once none is left ('pid command' of each): a process may fork while we look,
    and a killed one lingers until the kernel has torn it down (a loaded machine takes
    milliseconds), so it looks again, a little later each time, for up to `timeout` s."""
    own, wanted = os.getpid(), b"\0" + marker.encode() + b"\0"
    killed: dict[str, str] = {}
    deadline, pause = time.monotonic() + timeout, 0.005
    while True:
        found = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == own:
                continue
            with contextlib.suppress(OSError):  # a zombie's environ reads empty: gone
                if wanted in b"\0" + (entry / "environ").read_bytes() + b"\0":
                    command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").strip()
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.setdefault(entry.name, command.decode(errors="replace"))
                    found += 1
        if not found or time.monotonic() > deadline:
            return [f"{pid} {command}" for pid, command in killed.items()]
        time.sleep(pause)
        pause = min(2 * pause, 0.2)


def in_cgroup(pid: int, marker: str) -> bool:
    """Whether process `pid` on this host exists and its cgroup names `marker` (a container id)."""
    try:
        return marker in (Path("/proc") / str(pid) / "cgroup").read_text()
    except OSError:
        return False


def count_marked(marker: str) -> int:
    """How many processes of ours have `marker` (`NAME=value`) in their environment."""
    own, wanted, found = os.getpid(), b"\0" + marker.encode() + b"\0", 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != own:
            with contextlib.suppress(OSError):
                found += wanted in b"\0" + (entry / "environ").read_bytes() + b"\0"
    return found


def tree_bytes(root: Path) -> int:
    """Disk the files under `root` take (allocated blocks, so a sparse file costs what it
    holds); links are not followed and entries that vanish meanwhile are skipped."""
    total, folders = 0, [root]
    while folders:
        with contextlib.suppress(OSError), os.scandir(folders.pop()) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(Path(entry.path))
    return total


@dataclass(frozen=True)
class Cgroup:
    """The pids and memory controller folders of one process's cgroup on this host (v1 or
    v2); a counter reads None where its file is not there."""

    pids: Path | None
    memory: Path | None

    @classmethod
    def of(cls, pid: int) -> Cgroup:
        try:
            lines = (Path("/proc") / str(pid) / "cgroup").read_text().splitlines()
        except OSError:
            return cls(None, None)
        v1: dict[str, Path] = {}
        v2: Path | None = None
        for line in lines:  # "id:controllers:path"; v2's has no controllers
            _, controllers, path = line.split(":", 2)
            if controllers:
                for name in controllers.split(","):
                    v1[name] = CGROUP_ROOT / controllers / path.lstrip("/")
            else:
                v2 = CGROUP_ROOT / path.lstrip("/")

        def folder(name: str, probe: str) -> Path | None:
            for candidate in (v1.get(name), v2):
                if candidate is not None and (candidate / probe).is_file():
                    return candidate
            return None

        memory = folder("memory", "memory.oom_control") or folder("memory", "memory.events")
        return cls(folder("pids", "pids.current"), memory)

    def processes(self) -> int | None:
        return _read_int(self.pids, "pids.current")

    def pids_refused(self) -> int | None:
        return _read_field(self.pids, "pids.events", "max")

    def oom_kills(self) -> int | None:
        v1 = _read_field(self.memory, "memory.oom_control", "oom_kill")
        return v1 if v1 is not None else _read_field(self.memory, "memory.events", "oom_kill")


def _read_int(folder: Path | None, name: str) -> int | None:
    if folder is None:
        return None
    try:
        return int((folder / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _read_field(folder: Path | None, name: str, key: str) -> int | None:
    """The number after `key` in a flat-keyed cgroup file ("key value" lines)."""
    if folder is None:
        return None
    try:
        for line in (folder / name).read_text().splitlines():
            field, _, value = line.partition(" ")
            if field == key:
                return int(value)
    except (OSError, ValueError):
        return None
    return None


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
