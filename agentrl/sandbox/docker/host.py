"""What the host does to a container from outside, running nothing inside it (so it works
while a fork bomb holds every pid): read its usage, stop its processes while it is frozen,
and, for `seal()`, find and put back the protected paths it changed.

Blocking engine calls; `DockerSandbox` runs them in threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import signal
import stat
import time
from pathlib import Path
from typing import Any

from docker.errors import APIError, NotFound

from agentrl.errors import SandboxError
from agentrl.sandbox.base import Usage
from agentrl.sandbox.docker.engine import (
    DIR_MODE,
    ORIGIN,
    OWNER,
    PROTECTED,
    RUN,
    get_archive,
    gone,
    owner,
    top,
)
from agentrl.sandbox.docker.reap import remove_container
from agentrl.sandbox.procs import Cgroup, in_cgroup, tree_bytes
from agentrl.sandbox.seal import is_protected, path_dirs

_KINDS = {0: "changed", 1: "added", 2: "deleted"}  # the engine's diff kinds
STOP_ROUNDS = 5  # freeze-and-kill rounds before seal() gives up on a process that survives


class HostView:
    """Where a container's counters and writable layer lie on this machine (found once)."""

    def __init__(self, api: Any, container_id: str) -> None:
        info = api.inspect_container(container_id)
        init = int(info["State"]["Pid"] or 0)
        self.cgroup = Cgroup.of(init) if in_cgroup(init, container_id) else Cgroup(None, None)
        self.upper = _upper_dir(info)

    def usage(self) -> Usage:
        return Usage(
            processes=self.cgroup.processes(),
            pids_refused=self.cgroup.pids_refused(),
            oom_kills=self.cgroup.oom_kills(),
            disk_bytes=tree_bytes(self.upper) if self.upper is not None else None,
        )


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


def protected_changes(api: Any, container_id: str) -> tuple[str, list[list[str]]]:
    """(origin image id, [[path, kind], ...]) of protected paths changed since the origin:
    this container's own changes and those its snapshot image carries."""
    info = api.inspect_container(container_id)
    image = api.inspect_image(info["Image"])
    labels = image.get("Config", {}).get("Labels") or {}
    origin = labels.get(ORIGIN) or str(image["Id"])
    changes = {p: k for p, k in json.loads(labels.get(PROTECTED) or "[]")}
    dirs = path_dirs(info.get("Config", {}).get("Env"))
    found = _upper_changes(info)
    if found is None:  # the engine's own diff: right everywhere, slow on some engines
        found = [
            (e["Path"], _KINDS.get(e["Kind"], "changed")) for e in api.diff(container_id) or []
        ]
    for path, kind in found:
        if is_protected(path, dirs):
            changes[path] = kind
    return origin, [[p, k] for p, k in sorted(changes.items())]


def restore_protected(api: Any, container_id: str) -> list[str]:
    """Put each protected path the container changed back as its origin image has it."""
    origin, changes = protected_changes(api, container_id)
    if not changes:
        return []
    absent = []
    helper = api.create_container(
        origin, entrypoint=["true"], network_disabled=True, labels={RUN: "", OWNER: owner()}
    )["Id"]
    try:
        for path, _ in changes:
            try:
                data, info = get_archive(api, helper, path)
            except NotFound:
                absent.append(path)
                continue
            if not info["mode"] & DIR_MODE:  # a folder's changed files are listed themselves
                api.put_archive(container_id, posixpath.dirname(path), data)
    finally:
        remove_container(api, helper)
    if absent:  # after the put-backs: `rm` itself may have been one of them
        done = api.exec_create(container_id, ["rm", "-rf", "--", *absent], user="root")
        api.exec_start(done["Id"])
        if api.exec_inspect(done["Id"])["ExitCode"] != 0:
            raise SandboxError(f"sandbox {container_id[:12]}: cannot remove {absent}")
    return [f"{path} ({kind})" for path, kind in changes]


def _upper_dir(info: dict[str, Any]) -> Path | None:
    """The container's overlay upper layer (what it wrote) on this machine, if readable here."""
    driver = info.get("GraphDriver") or {}
    upper = (driver.get("Data") or {}).get("UpperDir")
    if "overlay" not in str(driver.get("Name")) or not upper or not Path(upper).is_dir():
        return None
    return Path(upper)


def _upper_changes(info: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(path, kind) of what the container changed, read from its overlay2 upper layer on
    this machine (what `docker diff` reports, in milliseconds rather than the seconds a
    naive diff of the whole tree can take); None where that layer is not readable here."""
    upper = _upper_dir(info)
    if upper is None:
        return None
    data = (info.get("GraphDriver") or {}).get("Data") or {}
    lowers = [Path(d) for d in (data.get("LowerDir") or "").split(":") if d]
    found = []
    for top_dir, folders, files in os.walk(upper):  # never follows a link the agent made
        for name in [*folders, *files]:
            entry = Path(top_dir) / name
            relative = entry.relative_to(upper)
            st = entry.lstat()
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout
                kind = "deleted"
            elif any(os.path.lexists(low / relative) for low in lowers):
                kind = "changed"
            else:
                kind = "added"
            found.append((f"/{relative.as_posix()}", kind))
    return found
