"""Removing what sandboxes leave: containers (one at a time, or every one a dead run
left), snapshot images, and the atexit backstop for sandboxes never closed.

`reap()` runs in every new `DockerProvider`; `gc()` is `agentrl gc`. A run whose process
exits (normally, or on an exception) records that its snapshots are kept for replay
(`keep_at_exit`); `gc --snapshots` removes only those of runs killed before they could,
or of the run it is named.
"""

from __future__ import annotations

import atexit
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docker
import requests
from docker.errors import APIError, DockerException, NotFound
from pydantic import BaseModel, ConfigDict
from tenacity import retry, retry_if_exception, stop_after_delay, wait_exponential

from agentrl.sandbox.base import resumable, snapshots_root
from agentrl.sandbox.docker.engine import (
    EXPIRES,
    INIT_ADDED,
    INIT_STATE,
    OWNER,
    RUN,
    SNAPSHOT_OF,
    first_line,
    retry_transient,
    slug,
    transient,
)
from agentrl.sandbox.images import docker_client
from agentrl.sandbox.procs import ExitBackstop
from agentrl.scratch import pid_alive

log = logging.getLogger(__name__)

backstop = ExitBackstop()
"""Closes, at interpreter exit, every sandbox of this process not closed by then."""
unremoved: set[str] = set()
"""Containers whose close() gave up in this process; the next `reap()` here removes them."""
_keep: set[str] = set()
"""Runs that made snapshots in this process: recorded as kept when it exits."""


def kept_runs() -> Path:
    """Where a run whose process exited records that its snapshots are kept."""
    return snapshots_root() / "kept-runs"


def keep_at_exit(run_id: str) -> None:
    """Record, when this process exits (not when it is killed), that `run_id`'s snapshots
    are kept for replay: `gc --snapshots` then leaves them."""
    if not _keep:
        atexit.register(_record_kept)
    _keep.add(run_id)


def _record_kept() -> None:
    folder = kept_runs()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for run_id in _keep:
            (folder / slug(run_id)).write_text(run_id + "\n")
    except OSError as exc:
        log.warning("could not record kept snapshots in %s: %s", folder, exc)


def _forget_kept(client: docker.DockerClient) -> None:
    """Drop the records of kept runs that have no snapshot left on this engine."""
    folder = kept_runs()
    if not folder.is_dir():
        return
    images = client.api.images(all=True, filters={"label": SNAPSHOT_OF})
    left = {slug((i.get("Labels") or {}).get(RUN, "")) for i in images}
    for record in folder.iterdir():
        if record.name not in left:
            record.unlink(missing_ok=True)


def _kept(run_id: str | None) -> bool:
    """Whether the run's snapshots stay: its process exited (replay), or it was killed
    and its journal offers a resume from them."""
    if not run_id:
        return False
    return (kept_runs() / slug(run_id)).is_file() or resumable(run_id)


class GcReport(BaseModel):
    """What `gc` or `remove_run` removed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    containers: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0


def _remove_once(api: Any, container_id: str) -> None:
    try:
        api.remove_container(container_id, force=True)
    except NotFound:
        pass
    except APIError as exc:
        if exc.status_code != 409 or "already in progress" not in str(exc):
            raise
    unremoved.discard(container_id)


remove_container = retry_transient(_remove_once)
"""Remove a container (gone already is fine), retrying transient engine errors."""


def remove_within(api: Any, container_id: str, seconds: float) -> None:
    """Remove a container, retrying transient engine errors (a restart) for `seconds`."""
    retry(
        retry=retry_if_exception(transient),
        stop=stop_after_delay(seconds),
        wait=wait_exponential(multiplier=0.25, max=2),
        reraise=True,
    )(_remove_once)(api, container_id)


def _owner_dead(labels: dict[str, str]) -> bool:
    host, _, pid = labels.get(OWNER, "").rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid))


def reap(client: docker.DockerClient, *, run_id: str | None = None) -> int:
    """Remove agentrl containers that expired, whose owner died on this host, or whose
    close() here gave up, then the INIT states of dead owners no snapshot names. A
    container that merely stopped is its owner's to remove: a live run grades the
    container its agent stopped (`sandbox_broken`), and another agentrl process on the
    host reaping it would turn the agent's damage into an infrastructure error."""
    filters = {"label": [f"{RUN}={run_id}" if run_id else RUN, OWNER]}
    removed, now = 0, time.time()
    for summary in client.api.containers(all=True, filters=filters):
        labels = summary.get("Labels") or {}
        expires = labels.get(EXPIRES, "")
        expired = expires.isdigit() and int(expires) < now
        ours = summary["Id"] in unremoved
        if expired or ours or _owner_dead(labels):
            try:
                remove_container(client.api, summary["Id"])
                removed += 1
            except (DockerException, requests.RequestException) as exc:
                log.warning("could not reap %s: %s", summary["Id"][:12], first_line(exc))
    _reap_init_states(client, run_id)
    return removed


def _reap_init_states(client: docker.DockerClient, run_id: str | None) -> None:
    """Remove the INIT-state images (`keep_init`) whose owner died on this host and that
    no snapshot names: scratch of a sandbox whose process is gone (a killed driver, a
    dead node), which no restart, grading copy or replay can use any more. One a snapshot
    names stays with it (`remove_snapshot` takes it along)."""
    filters = {"label": [f"{RUN}={run_id}" if run_id else RUN, INIT_ADDED]}
    try:
        images = client.api.images(all=True, filters=filters)
    except (DockerException, requests.RequestException) as exc:
        log.warning("could not list INIT states: %s", first_line(exc))
        return
    for image in images:
        if _owner_dead(image.get("Labels") or {}):
            _remove_unnamed_init_state(client, image["Id"])


def remove_run(client: docker.DockerClient, run_id: str, *, snapshots: bool = False) -> GcReport:
    """Remove every container of `run_id`, alive or not (and its snapshots if asked)."""
    containers = client.api.containers(all=True, filters={"label": f"{RUN}={run_id}"})
    for summary in containers:
        remove_container(client.api, summary["Id"])
    images, freed = (
        _remove_snapshots(client, lambda labels: labels.get(RUN) == run_id) if snapshots else (0, 0)
    )
    return GcReport(containers=len(containers), snapshots=images, snapshot_bytes=freed)


def gc(
    *, run_id: str | None = None, snapshots: bool = False, client: docker.DockerClient | None = None
) -> GcReport:
    """What `agentrl gc` does: reap dead runs' containers and, if asked, their snapshots.

    A snapshot's run is dead when its owner process on this host is gone and no
    container of the run is left; of those, a run whose process exited kept its snapshots
    for replay (`keep_at_exit`), and a killed run whose journal is still there keeps them
    for its `--resume` (`record_resumable`), unless `run_id` names it. Snapshots made on
    other hosts are kept.
    """
    own = client is None
    client = client or docker_client()
    try:
        containers = reap(client, run_id=run_id)
        images = freed = 0
        if snapshots:
            live_runs = {
                (c.get("Labels") or {}).get(RUN)
                for c in client.api.containers(all=True, filters={"label": RUN})
            }

            def dead(labels: dict[str, str]) -> bool:
                run = labels.get(RUN)
                wanted = run == run_id if run_id is not None else not _kept(run)
                return wanted and _owner_dead(labels) and run not in live_runs

            images, freed = _remove_snapshots(client, dead)
            _forget_kept(client)
        return GcReport(containers=containers, snapshots=images, snapshot_bytes=freed)
    finally:
        if own:
            client.close()


def snapshot_bytes(client: docker.DockerClient, snapshot_id: str) -> int:
    """Disk the snapshot's own layer takes (its size less its parent image's)."""
    return _own_bytes(client, client.api.inspect_image(snapshot_id))


_sizes: dict[str, int] = {}
"""Image id -> its size: an id names its content, so its size never changes. A run's
snapshots share few parents (the instance images, a restored snapshot), each asked once."""


def _own_bytes(client: docker.DockerClient, info: dict[str, Any]) -> int:
    """Of an inspected image: its size less its parent image's."""
    parent = info.get("Parent")
    if not parent:
        return int(info["Size"])
    if parent not in _sizes:
        if len(_sizes) > 4096:
            _sizes.clear()
        _sizes[parent] = int(client.api.inspect_image(parent)["Size"])
    return max(0, int(info["Size"]) - _sizes[parent])


def remove_snapshot(client: docker.DockerClient, snapshot_id: str) -> int | None:
    """Remove one snapshot image; the bytes freed, or None if nothing was removed. The
    image of its sandbox as INIT left it (`keep_init`), which the sandbox left for its
    snapshots when it closed, goes with the last snapshot that names it."""
    try:
        info = client.api.inspect_image(snapshot_id)
        size = _own_bytes(client, info)
        init = (info["Config"].get("Labels") or {}).get(INIT_STATE)
        client.api.remove_image(snapshot_id, force=True)
    except NotFound:
        return None
    except (DockerException, requests.RequestException) as exc:  # e.g. a child image uses it
        log.warning("kept snapshot %s: %s", snapshot_id[:19], first_line(exc))
        return None
    if init:
        size += _remove_unnamed_init_state(client, init)
    return size


def _remove_unnamed_init_state(client: docker.DockerClient, image: str) -> int:
    """Remove an INIT-state image no snapshot names any more; the bytes freed. Snapshots
    are removed after their episode's EVAL (retention at close, branch reclaiming), so
    no grading copy is still to be made from it; one a grading copy runs from stays (the
    engine refuses it)."""
    try:
        if client.api.images(all=True, filters={"label": f"{INIT_STATE}={image}"}):
            return 0
        size = snapshot_bytes(client, image)
        client.api.remove_image(image)
    except NotFound:
        return 0
    except (DockerException, requests.RequestException) as exc:
        log.debug("kept the INIT state %s: %s", image[:19], first_line(exc))
        return 0
    return size


def _remove_snapshots(
    client: docker.DockerClient, doomed: Callable[[dict[str, str]], bool]
) -> tuple[int, int]:
    """(images removed, bytes freed) of the snapshots whose labels `doomed` accepts."""
    removed = freed = 0
    images = client.api.images(all=True, filters={"label": SNAPSHOT_OF})
    # Newest first: a snapshot of a restored snapshot is a child of the older image.
    for image in sorted(images, key=lambda i: i.get("Created", 0), reverse=True):
        if doomed(image.get("Labels") or {}):
            size = remove_snapshot(client, image["Id"])
            if size is not None:
                removed, freed = removed + 1, freed + size
    return removed, freed
