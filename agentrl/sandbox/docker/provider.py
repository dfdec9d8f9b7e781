"""`DockerProvider`: starts containers, at a bounded rate, with their limits and labels.

Disk: the engine's size quota (`storage_opt`) where its storage driver has one (overlay2
on xfs with pquota), found out from the first container's start and remembered per
client; elsewhere `usage()` measures the writable layer on the host, for the bash tool's
watchdog to act on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import weakref
from typing import Any

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound

from agentrl.errors import ConfigError, SandboxError, SnapshotGone
from agentrl.sandbox.base import FORCED_ENV, Capabilities, SandboxSpec
from agentrl.sandbox.docker.engine import (
    EXPIRES,
    INIT_ADDED,
    NAME,
    NODE,
    OWNER,
    RUN,
    SNAPSHOT_OF,
    SNAPSHOT_REPO,
    first_line,
    owner,
    retry_transient,
    slug,
    top,
)
from agentrl.sandbox.docker.reap import reap, remove_run, remove_snapshot, snapshot_bytes
from agentrl.sandbox.docker.sandbox import DockerSandbox, InitState
from agentrl.sandbox.images import docker_client, missing_image_fix

log = logging.getLogger(__name__)

# Docker's default set, less NET_RAW: published tasks are written for the default set (a
# mail server's daemons chroot; services bind low ports, drop privileges, make device
# nodes), and raw sockets would let an agent given a network forge packets on it.
CAPS = [
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
]


class DockerProvider:
    """Starts `DockerSandbox`es; reaps what dead runs left when constructed."""

    name = "docker"
    capabilities = Capabilities(
        images=True,
        shell=True,
        snapshots=True,
        grading_copy=True,
        network=True,
        metered=True,
        mounts=True,
    )

    def __init__(
        self,
        *,
        max_concurrent_starts: int = 8,
        starts_per_second: float = 10.0,
        reap_at_start: bool = True,
    ) -> None:
        if max_concurrent_starts < 1 or starts_per_second <= 0:
            raise ConfigError(
                "docker provider: max_concurrent_starts must be >= 1 and starts_per_second > 0",
                fix="e.g. max_concurrent_starts=8, starts_per_second=10",
            )
        self.client = docker_client()
        self._starts = asyncio.Semaphore(max_concurrent_starts)
        self._rate = _TokenBucket(starts_per_second)
        if reap_at_start:
            removed = reap(self.client)
            log.log(logging.INFO if removed else logging.DEBUG, "reaped %d container(s)", removed)

    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        return await self._launch(spec, spec.image)

    async def restore(self, snapshot_id: str, spec: SandboxSpec) -> DockerSandbox:
        """A new sandbox from a `snapshot()` image, with `spec`'s limits and labels, graded
        against the state INIT left its sandbox in where that was kept (`keep_init`)."""
        sandbox = await self._launch(spec, snapshot_id)
        try:
            sandbox.init_state = await asyncio.to_thread(
                InitState.of_snapshot, self.client.api, snapshot_id
            )
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        """The snapshot layer's size (0 if the image is gone)."""
        try:
            return await asyncio.to_thread(snapshot_bytes, self.client, snapshot_id)
        except NotFound:
            return 0

    async def remove_snapshot(self, snapshot_id: str) -> int:
        """Remove a snapshot image; returns the bytes its layer held (0 if already gone)."""
        return await asyncio.to_thread(remove_snapshot, self.client, snapshot_id) or 0

    async def snapshots_named(self, run_id: str, name: str) -> list[str]:
        """By their labels, newest first (an INIT state's image is not a snapshot)."""
        labels = [f"{SNAPSHOT_OF}={run_id}", f"{NAME}={name}"]

        def query() -> list[str]:
            images = self.client.api.images(all=True, filters={"label": labels})
            ordered = sorted(images, key=lambda i: i.get("Created", 0), reverse=True)
            return [i["Id"] for i in ordered if INIT_ADDED not in (i.get("Labels") or {})]

        return await asyncio.to_thread(query)

    def end_run(self, run_id: str) -> None:
        """Remove every container of `run_id` still there (its snapshots stay, for replay)."""
        remove_run(self.client, run_id)

    async def _launch(self, spec: SandboxSpec, image: str) -> DockerSandbox:
        async with self._starts:
            await self._rate.acquire()
            start = _Start(self.client, spec, image)
            task = asyncio.ensure_future(asyncio.to_thread(start.run))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                # Whoever comes second removes the container: the starting thread if it is
                # still starting, else this task, before the cancellation goes on.
                made = start.abandon()
                if made is not None:
                    await asyncio.shield(asyncio.to_thread(made.close_now))
                raise


class _TokenBucket:
    """At most `rate` acquisitions per second on average, in bursts of up to `rate`."""

    def __init__(self, rate: float) -> None:
        self.rate, self.burst = rate, max(1.0, rate)
        self.tokens, self.last = self.burst, time.monotonic()

    async def acquire(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


class _Start:
    """A container start in a worker thread that its caller may abandon (Ctrl-C): the
    container is then removed, by the thread or by the caller, whichever is second."""

    def __init__(self, client: docker.DockerClient, spec: SandboxSpec, image: str) -> None:
        self.client, self.spec, self.image = client, spec, image
        self._lock = threading.Lock()
        self._abandoned = False
        self._made: DockerSandbox | None = None

    def run(self) -> DockerSandbox:
        sandbox = create_container(self.client, self.spec, self.image)
        with self._lock:
            abandoned, self._made = self._abandoned, sandbox
        if abandoned:
            sandbox.close_now()
        return sandbox

    def abandon(self) -> DockerSandbox | None:
        """Mark the start abandoned; the sandbox if it already exists (the caller closes it)."""
        with self._lock:
            self._abandoned = True
            return self._made


def create_container(
    client: docker.DockerClient, spec: SandboxSpec, image: str, network: str = "none"
) -> DockerSandbox:
    """Create and start a container (blocking; runs in a thread); `network`: Docker's
    network mode (`none`, or `container:<id>` to share another's)."""
    api = client.api
    name = f"agentrl-{slug(spec.run_id)[:40]}-{uuid.uuid4().hex[:10]}"
    labels = {
        RUN: spec.run_id,
        NAME: spec.name or "",
        OWNER: owner(),
        EXPIRES: str(int(time.time()) + spec.ttl_seconds),
        **({NODE: spec.node} if spec.node else {}),
    }

    @retry_transient
    def create(quota: bool) -> str:
        host_config = api.create_host_config(
            network_mode=network,
            init=True,
            nano_cpus=int(spec.cpus * 1e9),
            mem_limit=f"{spec.memory_mb}m",
            memswap_limit=f"{spec.memory_mb}m",
            pids_limit=spec.pids,
            storage_opt={"size": f"{spec.disk_mb}M"} if quota else None,
            cap_drop=["ALL"],
            cap_add=CAPS,
            security_opt=["no-new-privileges"],
            privileged=False,
            binds={host: {"bind": inside, "mode": "ro"} for host, inside in spec.mounts.items()}
            or None,
        )
        try:
            return str(
                api.create_container(
                    image,
                    entrypoint=["sleep"],
                    command=[str(spec.ttl_seconds)],
                    name=name,
                    labels=labels,
                    working_dir=spec.workdir,
                    environment={**spec.env, **FORCED_ENV},
                    host_config=host_config,
                    detach=True,
                )["Id"]
            )
        except APIError as exc:
            if quota and _no_quota(exc):
                raise _NoQuota from exc  # not transient: never retried
            if exc.status_code != 409:  # 409: an earlier attempt made it after all
                raise
            return str(api.inspect_container(name)["Id"])

    try:
        quota = _quota_support.get(api, True)
        try:
            container_id = create(quota)
        except _NoQuota:
            # Said once per client, and only with --debug: it changes nothing a person does.
            log.debug("the Docker engine's storage driver has no size quota: disk is watched")
            quota = False
            container_id = create(quota)
        _quota_support[api] = quota
    except ImageNotFound as exc:
        if image.startswith("sha256:") or image.startswith(f"{SNAPSHOT_REPO}/"):
            raise SnapshotGone(
                f"snapshot {image[:19]} not found: it was removed (agentrl gc --snapshots)",
                fix="replay from an earlier snapshot or from INIT (agentrl replay does so "
                "itself), or run the episode again with snapshots on",
            ) from exc
        raise SandboxError(f"image {image} not found", fix=missing_image_fix(image)) from exc
    except (DockerException, requests.RequestException) as exc:
        raise SandboxError(f"cannot create a sandbox from {image}: {first_line(exc)}") from exc
    sandbox = DockerSandbox(client, container_id, spec)
    try:
        retry_transient(api.start)(container_id)
        sandbox.keepalive = _keepalive(api, container_id)
    except (DockerException, requests.RequestException) as exc:
        sandbox.close_now()
        raise SandboxError(f"sandbox from {image} did not start: {first_line(exc)}") from exc
    except BaseException:
        sandbox.close_now()
        raise
    return sandbox


_quota_support: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""Per engine client: whether its storage driver took a size quota (absent: not tried yet)."""


class _NoQuota(Exception):
    """The engine's storage driver has no size quota (overlay2 needs xfs with pquota)."""


def _no_quota(exc: APIError) -> bool:
    text = str(exc.explanation or exc).lower()
    return any(words in text for words in ("storage-opt", "storage opt", "storage option"))


def _keepalive(api: Any, container_id: str) -> int:
    """The host pid of the main process (`sleep <ttl>`, docker-init's child) of a new container."""
    init = int(api.inspect_container(container_id)["State"]["Pid"])
    for _ in range(100):
        child = next((pid for pid, ppid, _ in top(api, container_id) if ppid == init), None)
        if child is not None:
            return child
        time.sleep(0.01)
    raise SandboxError(f"sandbox {container_id[:12]}: its main process did not start")
