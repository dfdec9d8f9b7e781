"""What the host does to a container from outside, running nothing inside it (so it works
while a fork bomb holds every pid): read its usage, stop its processes while it is frozen,
and name the image a snapshot chain started from.

Blocking engine calls; `DockerSandbox` runs them in threads.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from docker.errors import APIError, NotFound

from agentrl.errors import SandboxError
from agentrl.sandbox.base import Usage
from agentrl.sandbox.docker.engine import (
    ORIGIN,
    gone,
    top,
)
from agentrl.sandbox.procs import Cgroup, in_cgroup, tree_bytes

_KINDS = {0: "changed", 1: "added", 2: "deleted"}  # the engine's diff kinds
STOP_ROUNDS = 5  # freeze-and-kill rounds before seal() gives up on a process that survives


DISK_RATE: float = 2 << 30
"""Bytes a second a sandbox is taken to write at most: the writable layer is walked again
once that rate could have filled the room left under the disk limit..."""
DISK_GAP_S = 2.0
"""...or this long after the last walk, whichever comes first (so a writer faster than
DISK_RATE passes the limit by at most this long's writes)."""


class HostView:
    """Where a container's counters and writable layer lie on this machine (found once).

    The counters are a file read each; the writable layer's size is a walk of every file
    the sandbox wrote, which at SWE shape was half the driver's CPU per turn when taken at
    every look. So it is walked again only when `DISK_RATE` could have filled the room
    the last walk left under `disk_limit`, and at least every `DISK_GAP_S`: far under a
    10 GiB limit every 2 s instead of at every look (~0.5 s while a command runs), and at
    every look near the limit."""

    def __init__(self, api: Any, container_id: str, disk_limit: int) -> None:
        info = api.inspect_container(container_id)
        init = int(info["State"]["Pid"] or 0)
        self.cgroup = Cgroup.of(init) if in_cgroup(init, container_id) else Cgroup(None, None)
        self.upper = _upper_dir(info)
        self.disk_limit = disk_limit
        self._walked: tuple[int, float] | None = None  # (bytes, when)

    def usage(self) -> Usage:
        return Usage(
            processes=self.cgroup.processes(),
            pids_refused=self.cgroup.pids_refused(),
            oom_kills=self.cgroup.oom_kills(),
            disk_bytes=self._disk_bytes(),
        )

    def _disk_bytes(self) -> int | None:
        if self.upper is None:
            return None
        now = time.monotonic()
        if self._walked is not None:
            size, at = self._walked
            if now - at < min((self.disk_limit - size) / DISK_RATE, DISK_GAP_S):
                return size  # nothing could have filled the room left since
        size = tree_bytes(self.upper)
        self._walked = (size, now)
        return size


def stop_processes(api: Any, container_id: str, keepalive: int | None) -> list[str]:
    """SIGKILL every process but docker-init and the keep-alive, from the host while the
    container is frozen (nothing can fork meanwhile); 'pid command line' of each."""
    stopped = list[str]()
    for _ in range(STOP_ROUNDS):
        state = api.inspect_container(container_id)["State"]
        if not state.get("Running"):
            raise gone(container_id, "its container stopped")
        keep = {int(state["Pid"]), keepalive}
        if all(pid in keep for pid, _, _ in top(api, container_id)):
            return stopped  # nothing left: no one to start anything either
        frozen = _freeze(api, container_id)
        try:
            doomed = [(pid, args) for pid, _, args in top(api, container_id) if pid not in keep]
            for pid, args in doomed:
                if not in_cgroup(pid, container_id):  # an engine on another machine
                    raise SandboxError(
                        f"sandbox {container_id[:12]}: cannot stop process {pid} ({args}): "
                        "the Docker engine does not run on this machine",
                        fix="grade on the machine whose Docker engine runs the sandboxes "
                        "(a Ray sandbox node does this)",
                    )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # delivered the moment it thaws
        finally:
            if frozen:
                api.unpause(container_id)
        if not doomed:
            return stopped
        stopped += [f"{pid} {args}" for pid, args in doomed]
        time.sleep(0.05)  # docker-init reaps them
    left = [f"{pid} {args}" for pid, _, args in top(api, container_id) if pid not in keep]
    if left:
        raise SandboxError(f"sandbox {container_id[:12]}: processes survive SIGKILL: {left}")
    return stopped


def _freeze(api: Any, container_id: str) -> bool:
    """Pause the container (the freezer: nothing in it runs, or forks). False when the
    runtime gave up freezing it (a fork bomb can outrun it): the round then kills what it
    sees anyway, and the next round tries again."""
    try:
        api.pause(container_id)
    except APIError as exc:
        if "unable to freeze" not in str(exc):
            raise
        return False
    return True


def stopped_by_agent(api: Any, container_id: str) -> str | None:
    """How a stopped container was stopped from inside, when it was (its processes killed
    its keep-alive or used all its memory, while the engine ran all along); None when it
    runs, was removed, ran out its TTL, or the engine restarted (or cannot be seen)."""
    try:
        state = api.inspect_container(container_id)["State"]
    except NotFound:
        return None
    if state.get("Running"):
        return None
    engine = engine_started()
    started = _timestamp(state.get("StartedAt"))
    if engine is None or started is None or engine > started:
        return None
    if _killed_from_outside(api, container_id, started):
        return None
    if state.get("OOMKilled"):
        return "its processes used all of its memory and the kernel stopped it"
    code = state.get("ExitCode")
    if code == 0:
        return None  # the keep-alive ran its course: the TTL
    return f"its processes killed its main process (exit {code}), which stopped it"


def _killed_from_outside(api: Any, container_id: str, since: float) -> bool:
    """Whether the engine was asked to kill or stop the container (`docker kill`/`stop`, a
    reaper, a shutdown): those leave a `kill` event; a death from inside leaves none."""
    events = api.events(
        since=int(since) - 1,
        until=int(time.time()) + 1,
        filters={"container": container_id, "event": ["kill", "stop"]},
        decode=True,
    )
    try:
        return any(True for _ in events)
    finally:
        with contextlib.suppress(Exception):
            events.close()


def engine_started(pidfile: Path = Path("/var/run/docker.pid")) -> float | None:
    """When this machine's Docker engine started (epoch seconds), or None if not known."""
    try:
        pid = int(pidfile.read_text().strip())
        ticks = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _timestamp(text: object) -> float | None:
    """Docker's RFC 3339 time (nanoseconds) as epoch seconds."""
    if not isinstance(text, str) or text.startswith("0001-"):
        return None
    head, _, rest = text.partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())[:6]
    try:
        moment = datetime.fromisoformat(f"{head}.{fraction or '0'}+00:00")
    except ValueError:
        return None
    return moment.timestamp()


def origin(api: Any, container_id: str) -> str:
    """The image the container's chain of snapshots started from (its own image if none)."""
    image = api.inspect_image(api.inspect_container(container_id)["Image"])
    labels = image.get("Config", {}).get("Labels") or {}
    return str(labels.get(ORIGIN) or image["Id"])


def _upper_dir(info: dict[str, Any]) -> Path | None:
    """The container's overlay upper layer (what it wrote) on this machine, if readable here."""
    driver = info.get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    if "overlay" not in str(driver.get("Name")) or not upper or not Path(upper).is_dir():
        return None
    return Path(upper)
