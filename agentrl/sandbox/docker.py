"""The `docker` provider: each sandbox is one container on the local Docker engine.

A container starts with no network, CPU/memory/pids limits, every capability dropped
but the few a root shell needs, and `no-new-privileges`. It is labelled with its run,
its owner (`host:pid`) and an expiry, and its main process is `sleep <ttl>` under
docker-init (which also reaps zombies), so it stops by itself when the TTL passes.
Teardown: `close()` (idempotent, shielded from cancellation; it outlasts an engine
outage of up to CLOSE_WAIT_S), an atexit backstop, and `reap()`, which every new provider
runs and `gc()` (`agentrl gc`) exposes.

Disk: the engine's size quota (`storage_opt`) where its storage driver has one (overlay2
on xfs with pquota), found out from the first container's start and remembered per
client; elsewhere `usage()` measures the writable layer on the host, for the bash tool's
watchdog to act on.

Blocking SDK calls run in threads; command output is read from the exec's socket on
the event loop, so a long command holds no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import posixpath
import re
import signal
import socket
import ssl
import stat
import tarfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from pexpect.fdpexpect import fdspawn
from pydantic import BaseModel, ConfigDict
from tenacity import (
    retry,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from agentrl.errors import ConfigError, SandboxError, SandboxFileNotFound
from agentrl.sandbox.base import (
    FORCED_ENV,
    ExecRequest,
    ExecResult,
    HeadTail,
    SandboxSpec,
    Sealed,
    Usage,
)
from agentrl.sandbox.images import docker_client
from agentrl.sandbox.procs import (
    Cgroup,
    ExitBackstop,
    in_cgroup,
    kill_session,
    pid_alive,
    tree_bytes,
)
from agentrl.sandbox.seal import is_protected, path_dirs

log = logging.getLogger(__name__)

RUN, NAME, OWNER, EXPIRES = "agentrl.run", "agentrl.name", "agentrl.owner", "agentrl.expires"
SNAPSHOT_OF = "agentrl.snapshot"
ORIGIN = "agentrl.origin"  # on a snapshot: the image its chain of snapshots started from
PROTECTED = "agentrl.protected"  # on a snapshot: protected paths changed since ORIGIN (JSON)
NODE = "agentrl.node"  # the Ray node whose sandbox worker started it
SNAPSHOT_REPO = "agentrl-snapshot"
# What a root shell needs for ordinary work (files, chmod/chown, git, su to a user).
CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID"]
SHELL_ROWS, SHELL_COLUMNS = 24, 200
MERGE = 'exec "$@" 2>&1'
GUARD_S = 10.0  # the client gives up this long after the in-container timeout should fire
_DIR, _SYMLINK = 1 << 31, 1 << 27  # Go's os.ModeDir and os.ModeSymlink, as get_archive reports
_KINDS = {0: "changed", 1: "added", 2: "deleted"}  # the engine's diff kinds
STOP_ROUNDS = 5  # freeze-and-kill rounds before seal() gives up on a process that survives
CLOSE_WAIT_S = 30.0  # close() retries this long through an engine outage, then leaves it to reap

T = TypeVar("T")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, APIError):
        return bool(exc.is_server_error())
    return isinstance(exc, requests.ConnectionError | requests.ReadTimeout)


_retry = retry(
    retry=retry_if_exception(_transient),
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.5, max=4),
    reraise=True,
)


def owner() -> str:
    """This process as the `agentrl.owner` label names it."""
    return f"{socket.gethostname()}:{os.getpid()}"


class GcReport(BaseModel):
    """What `gc` or `remove_run` removed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    containers: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0


class DockerProvider:
    """Starts `DockerSandbox`es; reaps what dead runs left when constructed."""

    name: Literal["docker", "local"] = "docker"

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
        """A new sandbox from a `snapshot()` image, with `spec`'s limits and labels."""
        return await self._launch(spec, snapshot_id)

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        """The snapshot layer's size (0 if the image is gone)."""
        try:
            return await asyncio.to_thread(snapshot_bytes, self.client, snapshot_id)
        except NotFound:
            return 0

    async def remove_snapshot(self, snapshot_id: str) -> int:
        """Remove a snapshot image; returns the bytes its layer held (0 if already gone)."""
        return await asyncio.to_thread(_remove_snapshot, self.client, snapshot_id) or 0

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


class DockerSandbox:
    """One container. `close()` removes it; every call after that raises SandboxError."""

    def __init__(self, client: docker.DockerClient, container_id: str, spec: SandboxSpec) -> None:
        self._api = client.api
        self._id = container_id
        self._spec = spec
        self._shells: dict[int, _Shell] = {}
        self._shell_count = 0
        self._closed = False
        self._lock = threading.Lock()
        self.keepalive: int | None = None  # host pid of `sleep <ttl>`, which seal() spares
        self._host: tuple[Cgroup, Path | None] | None = None  # its cgroup and writable layer
        _backstop.add(self._id, self.close_now)

    @property
    def id(self) -> str:
        return self._id

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self._spec.workdir, path))

    async def exec(self, request: ExecRequest) -> ExecResult:
        """Run to completion; coreutils `timeout` kills the command's process group inside."""
        self._check_open()
        command = request.command
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        started = time.monotonic()
        created = await self._call(
            self._api.exec_create,
            self._id,
            # One pipe for both streams keeps their order; docker's two would race.
            ["timeout", "-s", "KILL", f"{request.timeout:.3f}", "sh", "-c", MERGE, "sh", *argv],
            workdir=self._path(request.workdir or "."),
            environment=request.env or None,
        )
        stream = await self._call(self._api.exec_start, created["Id"], socket=True)
        output, guard_fired = HeadTail(), False
        raw: socket.socket = _raw_socket(stream)
        try:
            raw.setblocking(False)
            await asyncio.wait_for(_read_frames(raw, output), request.timeout + GUARD_S)
        except TimeoutError:
            guard_fired = True
        finally:
            stream.close()  # drops docker-py's reference; closing `raw` ends the connection
            raw.close()
        code = await self._exit_code(created["Id"])
        seconds = time.monotonic() - started
        if code in (137, None) and not await self._running():
            raise self._gone("its container stopped while a command ran")
        timed_out = guard_fired or (code in (124, 137) and seconds >= request.timeout)
        return ExecResult(
            exit_code=None if timed_out else code,
            output=output.text(),
            timed_out=timed_out,
            seconds=seconds,
        )

    async def shell(self, argv: list[str]) -> fdspawn:
        """A pexpect `fdspawn` (bytes mode, tty echo on, 200 columns) over the exec's socket.

        A wedged shell is restarted with `await kill_shell(old)` then `await shell(argv)`.
        """
        self._check_open()
        self._shell_count += 1
        pidfile = f"/tmp/.agentrl-shell-{self._shell_count}.pid"
        # runc makes each exec a session leader; its pid (saved here) names the session.
        wrapped = ["sh", "-c", 'echo $$ > "$0"; exec "$@"', pidfile, *argv]
        created = await self._call(
            self._api.exec_create,
            self._id,
            wrapped,
            stdin=True,
            tty=True,
            workdir=self._spec.workdir,
        )
        stream = await self._call(self._api.exec_start, created["Id"], socket=True, tty=True)
        raw: socket.socket = _raw_socket(stream)
        raw.settimeout(None)
        # A dup of its own, so pexpect's close() cannot close an fd number the socket owns.
        spawn = fdspawn(os.dup(raw.fileno()), encoding=None, maxread=1 << 16, use_poll=True)
        self._shells[id(spawn)] = _Shell(created["Id"], pidfile, stream, spawn)
        with contextlib.suppress(SandboxError):  # the shell may already have exited
            await self._call(
                self._api.exec_resize, created["Id"], height=SHELL_ROWS, width=SHELL_COLUMNS
            )
        return spawn

    async def kill_shell(self, shell: Any) -> None:
        """SIGKILL a `shell()` and every process in its session, and release its socket."""
        record = self._shells.pop(id(shell), None)
        if record is None:
            with contextlib.suppress(Exception):
                shell.close()
            return
        # From the host first: it needs no free pid in the container (a fork bomb may hold
        # them all). The engine's exec Pid is the session leader, in the host's pid space.
        with contextlib.suppress(SandboxError, KeyError, TypeError, ValueError):
            info = await self._call(self._api.exec_inspect, record.exec_id)
            if info.get("Pid"):
                kill_session(int(info["Pid"]), cgroup_marker=self._id)
        script = (
            f'p=$(cat {record.pidfile} 2>/dev/null); rm -f {record.pidfile}; [ -n "$p" ] || exit 0;'
            ' pkill -KILL -s "$p" || kill -KILL -- -"$p" "$p"'
        )
        if not self._closed:
            with contextlib.suppress(SandboxError):
                await self.exec(ExecRequest(command=["sh", "-c", script], timeout=10))
        record.release()

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        target = self._path(path)
        for _ in range(8):  # symlink hops; get_archive returns a link, not its target
            try:
                data, stat = await asyncio.to_thread(_get_archive, self._api, self._id, target)
            except NotFound as exc:
                if "no such container" in str(exc).lower():
                    raise self._gone("its container was removed") from exc
                raise SandboxFileNotFound(
                    f"{path}: no such file in sandbox {self._id[:12]}", fix="check the path"
                ) from exc
            except (DockerException, requests.RequestException) as exc:
                raise self._error(exc) from exc
            if stat["mode"] & _DIR:
                raise SandboxError(f"{path} is a directory in sandbox {self._id[:12]}")
            if not stat["mode"] & _SYMLINK:
                with tarfile.open(fileobj=io.BytesIO(data)) as archive:
                    member = archive.extractfile(archive.getmembers()[0])
                    return member.read() if member is not None else b""
            target = posixpath.join(posixpath.dirname(target), stat["linkTarget"])
        raise SandboxError(f"{path}: too many levels of symbolic links")

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write through the API (binary-safe), creating parent directories."""
        self._check_open()
        target = self._path(path)
        parent, archive = posixpath.dirname(target), _tar(posixpath.basename(target), data, mode)
        try:
            await asyncio.to_thread(self._api.put_archive, self._id, parent, archive)
            return
        except NotFound as exc:
            if "no such container" in str(exc).lower():
                raise self._gone("its container was removed") from exc
        except (DockerException, requests.RequestException) as exc:
            raise self._error(exc) from exc
        made = await self.exec(ExecRequest(command=["mkdir", "-p", parent], timeout=30))
        if made.exit_code != 0:
            raise SandboxError(f"cannot create {parent} in sandbox: {made.output.strip()[:200]}")
        await self._call(self._api.put_archive, self._id, parent, archive)

    async def snapshot(self, label: str) -> str:
        """Commit to `agentrl-snapshot/<run>:<name>-<label>`; returns the image id."""
        self._check_open()
        spec = self._spec
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{spec.name}-{label}" if spec.name else label)
        origin, protected = await self._call(self._protected_changes)
        labels = {
            RUN: spec.run_id,
            SNAPSHOT_OF: spec.run_id,
            OWNER: owner(),
            NAME: spec.name or "",
            ORIGIN: origin,
            PROTECTED: json.dumps(protected, separators=(",", ":")),
        }
        image = await self._call(
            self._api.commit,
            self._id,
            repository=f"{SNAPSHOT_REPO}/{_slug(spec.run_id)}",
            tag=tag.lstrip(".-")[:128] or "snapshot",
            conf={"Labels": labels},
        )
        return str(image["Id"])

    async def seal(self) -> Sealed:
        """Stop every process but docker-init and the keep-alive (frozen first, so none can
        fork meanwhile), then put protected paths back as the origin image has them."""
        stopped = await self.stop_processes()
        restored = await self._call(self._restore_protected)
        return Sealed(stopped=stopped, restored=restored)

    async def stop_processes(self) -> list[str]:
        """SIGKILL every process but docker-init and the keep-alive, from the host while the
        container is frozen (needs no free pid inside); 'pid command line' of each."""
        self._check_open()
        return await self._call(self._stop_processes)

    async def usage(self) -> Usage:
        """Counters from the container's cgroup and the size of its writable layer, read on
        this machine (None where the engine runs elsewhere or the driver is not overlay)."""
        self._check_open()
        if self._host is None:
            info = await self._call(self._api.inspect_container, self._id)
            init = int(info["State"]["Pid"] or 0)
            cgroup = Cgroup.of(init) if in_cgroup(init, self._id) else Cgroup(None, None)
            self._host = (cgroup, _upper_dir(info))
        return await asyncio.to_thread(self._read_usage)

    def _read_usage(self) -> Usage:
        assert self._host is not None
        cgroup, upper = self._host
        return Usage(
            processes=cgroup.processes(),
            pids_refused=cgroup.pids_refused(),
            oom_kills=cgroup.oom_kills(),
            disk_bytes=tree_bytes(upper) if upper is not None else None,
        )

    def _stop_processes(self) -> list[str]:
        api, stopped = self._api, list[str]()
        for _ in range(STOP_ROUNDS):
            state = api.inspect_container(self._id)["State"]
            if not state.get("Running"):
                raise self._gone("its container stopped")
            keep = {int(state["Pid"]), self.keepalive}
            if all(pid in keep for pid, _, _ in _top(api, self._id)):
                return stopped  # nothing left: no one to start anything either
            api.pause(self._id)  # the freezer: nothing in the container runs, or forks
            try:
                doomed = [(pid, args) for pid, _, args in _top(api, self._id) if pid not in keep]
                for pid, args in doomed:
                    if not in_cgroup(pid, self._id):  # an engine on another machine
                        raise SandboxError(
                            f"sandbox {self._id[:12]}: cannot stop process {pid} ({args}): "
                            "the Docker engine does not run on this machine",
                            fix="grade on the machine whose Docker engine runs the sandboxes "
                            "(a Ray sandbox node does this)",
                        )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)  # delivered the moment it thaws
            finally:
                api.unpause(self._id)
            if not doomed:
                return stopped
            stopped += [f"{pid} {args}" for pid, args in doomed]
            time.sleep(0.05)  # docker-init reaps them
        left = [f"{pid} {args}" for pid, _, args in _top(api, self._id) if pid not in keep]
        if left:
            raise SandboxError(f"sandbox {self._id[:12]}: processes survive SIGKILL: {left}")
        return stopped

    def _protected_changes(self) -> tuple[str, list[list[str]]]:
        """(origin image id, [[path, kind], ...]) of protected paths changed since the origin:
        this container's own changes and those its snapshot image carries."""
        info = self._api.inspect_container(self._id)
        image = self._api.inspect_image(info["Image"])
        labels = image.get("Config", {}).get("Labels") or {}
        origin = labels.get(ORIGIN) or str(image["Id"])
        changes = {p: k for p, k in json.loads(labels.get(PROTECTED) or "[]")}
        dirs = path_dirs(info.get("Config", {}).get("Env"))
        found = _upper_changes(info)
        if found is None:  # the engine's own diff: right everywhere, slow on some engines
            found = [
                (e["Path"], _KINDS.get(e["Kind"], "changed"))
                for e in self._api.diff(self._id) or []
            ]
        for path, kind in found:
            if is_protected(path, dirs):
                changes[path] = kind
        return origin, [[p, k] for p, k in sorted(changes.items())]

    def _restore_protected(self) -> list[str]:
        origin, changes = self._protected_changes()
        if not changes:
            return []
        api, absent = self._api, []
        helper = api.create_container(
            origin, entrypoint=["true"], network_disabled=True, labels={RUN: "", OWNER: owner()}
        )["Id"]
        try:
            for path, _ in changes:
                try:
                    data, stat = _get_archive(api, helper, path)
                except NotFound:
                    absent.append(path)
                    continue
                if not stat["mode"] & _DIR:  # a folder's changed files are listed themselves
                    api.put_archive(self._id, posixpath.dirname(path), data)
        finally:
            _remove(api, helper)
        if absent:  # after the put-backs: `rm` itself may have been one of them
            done = api.exec_create(self._id, ["rm", "-rf", "--", *absent], user="root")
            api.exec_start(done["Id"])
            if api.exec_inspect(done["Id"])["ExitCode"] != 0:
                raise SandboxError(f"sandbox {self._id[:12]}: cannot remove {absent}")
        return [f"{path} ({kind})" for path, kind in changes]

    async def connect_network(self, name: str) -> None:
        """Leave `--network none` for the Docker network `name`."""
        self._check_open()
        with contextlib.suppress(SandboxError):  # already off "none"
            await self._call(self._api.disconnect_container_from_network, self._id, "none")
        await self._call(self._api.connect_container_to_network, self._id, name)

    async def close(self) -> None:
        # Shielded: a cancelled caller (Ctrl-C) still gets its container removed.
        await asyncio.shield(asyncio.to_thread(self.close_now))

    def close_now(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Synchronous, idempotent removal (also what the atexit backstop calls). An engine
        that does not answer is retried for `wait_s`; after that the container is left to
        the reaper (the next provider started here, or `agentrl gc`), and a line says so."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for record in self._shells.values():
                record.release()
            self._shells.clear()
            try:
                _remove_within(self._api, self._id, wait_s)
            except (DockerException, requests.RequestException) as exc:
                _unremoved.add(self._id)
                log.warning(
                    "sandbox %s was not removed within %g s: %s; fix: the next DockerProvider "
                    "started in this process removes it, or run `agentrl gc` once this "
                    "process has ended (its TTL stops it meanwhile)",
                    self._id[:12],
                    wait_s,
                    _first_line(exc),
                )
        _backstop.discard(self._id)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except NotFound as exc:
            raise self._gone("its container was removed") from exc
        except (DockerException, requests.RequestException) as exc:
            raise self._error(exc) from exc

    async def _exit_code(self, exec_id: str) -> int | None:
        for _ in range(50):  # the stream can end a moment before the engine records the exit
            info = await self._call(self._api.exec_inspect, exec_id)
            if not info["Running"]:
                return info["ExitCode"]  # type: ignore[no-any-return]
            await asyncio.sleep(0.02)
        return None

    async def _running(self) -> bool:
        try:
            state = (await self._call(self._api.inspect_container, self._id))["State"]
        except SandboxError:
            return False
        return bool(state.get("Running")) and not state.get("Paused")

    def _error(self, exc: BaseException) -> SandboxError:
        first = _first_line(exc)
        if isinstance(exc, APIError) and exc.status_code == 409 and "not running" in first:
            return self._gone("its container is not running")
        return SandboxError(f"sandbox {self._id[:12]}: docker: {first}")

    def _gone(self, why: str) -> SandboxError:
        return SandboxError(
            f"sandbox {self._id[:12]} is gone: {why}",
            fix="start a new sandbox (it was removed from outside, or its TTL passed)",
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self._id[:12]} is closed", fix="start a new sandbox")


@dataclass
class _Shell:
    exec_id: str
    pidfile: str
    stream: Any  # docker-py's SocketIO: holding it keeps the connection open
    spawn: fdspawn

    def release(self) -> None:
        with contextlib.suppress(Exception):
            self.spawn.close()
        raw = getattr(self.stream, "_sock", None)
        with contextlib.suppress(Exception):
            self.stream.close()
            if raw is not None:
                raw.close()


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


def _create(client: docker.DockerClient, spec: SandboxSpec, image: str) -> DockerSandbox:
    """Create and start a container (blocking; runs in a thread)."""
    api = client.api
    name = f"agentrl-{_slug(spec.run_id)[:40]}-{uuid.uuid4().hex[:10]}"
    labels = {
        RUN: spec.run_id,
        NAME: spec.name or "",
        OWNER: owner(),
        EXPIRES: str(int(time.time()) + spec.ttl_seconds),
        **({NODE: spec.node} if spec.node else {}),
    }

    @_retry
    def create(quota: bool) -> str:
        host_config = api.create_host_config(
            network_mode="none",
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
            log.info("the Docker engine's storage driver has no size quota: disk is watched")
            quota = False
            container_id = create(quota)
        _quota_support[api] = quota
    except ImageNotFound as exc:
        snapshot = image.startswith("sha256:") or image.startswith(f"{SNAPSHOT_REPO}/")
        fix = (
            "the snapshot was removed (agentrl gc --snapshots); snapshot again"
            if snapshot
            else f"agentrl images build {image.split('/')[-1].split(':')[0]}"
            if image.startswith("agentrl/")
            else f"docker pull {image} (or docker load it)"
        )
        raise SandboxError(f"image {image} not found", fix=fix) from exc
    except (DockerException, requests.RequestException) as exc:
        raise SandboxError(f"cannot create a sandbox from {image}: {_first_line(exc)}") from exc
    sandbox = DockerSandbox(client, container_id, spec)
    try:
        _retry(api.start)(container_id)
        sandbox.keepalive = _keepalive(api, container_id)
    except (DockerException, requests.RequestException) as exc:
        sandbox.close_now()
        raise SandboxError(f"sandbox from {image} did not start: {_first_line(exc)}") from exc
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
    for top, folders, files in os.walk(upper):  # never follows a link the agent made
        for name in [*folders, *files]:
            entry = Path(top) / name
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


def _keepalive(api: Any, container_id: str) -> int:
    """The host pid of the main process (`sleep <ttl>`, docker-init's child) of a new container."""
    init = int(api.inspect_container(container_id)["State"]["Pid"])
    for _ in range(100):
        child = next((pid for pid, ppid, _ in _top(api, container_id) if ppid == init), None)
        if child is not None:
            return child
        time.sleep(0.01)
    raise SandboxError(f"sandbox {container_id[:12]}: its main process did not start")


def _top(api: Any, container_id: str) -> list[tuple[int, int, str]]:
    """(host pid, host parent pid, command line) of each process in the container."""
    listing = api.top(container_id, ps_args="-eo pid,ppid,args")
    return [(int(row[0]), int(row[1]), row[2]) for row in listing.get("Processes") or []]


async def _read_frames(raw: socket.socket, output: HeadTail) -> None:
    """Read a non-tty exec stream: frames of [kind, 0, 0, 0, size (4 bytes BE), payload]."""
    loop = asyncio.get_running_loop()
    pending = bytearray()
    while data := await loop.sock_recv(raw, 1 << 16):
        pending += data
        start = 0
        while len(pending) - start >= 8:
            size = int.from_bytes(pending[start + 4 : start + 8], "big")
            if len(pending) - start - 8 < size:
                break
            output.feed(bytes(pending[start + 8 : start + 8 + size]))
            start += 8 + size
        del pending[:start]


def _raw_socket(stream: Any) -> socket.socket:
    """The socket under docker-py's SocketIO (a local engine: unix socket or plain TCP)."""
    raw = getattr(stream, "_sock", stream)
    if not isinstance(raw, socket.socket) or isinstance(raw, ssl.SSLSocket):
        stream.close()
        raise SandboxError(
            f"exec streams over {type(raw).__name__} are not supported",
            fix="use a local engine (unix socket or plain TCP DOCKER_HOST)",
        )
    return raw


def _get_archive(api: Any, container_id: str, path: str) -> tuple[bytes, dict[str, Any]]:
    stream, stat = api.get_archive(container_id, path)
    return b"".join(stream), stat


def _tar(name: str, data: bytes, mode: int) -> bytes:
    buffer = io.BytesIO()
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _slug(text: str) -> str:
    """A lowercase form valid in image repository and container names."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "run"


def _first_line(exc: BaseException) -> str:
    """One readable line: an engine that cannot be reached is named, not urllib3's tuple."""
    if isinstance(exc, requests.ConnectionError | requests.Timeout):
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        how = "did not answer in time" if isinstance(exc, requests.Timeout) else "is unreachable"
        return f"the Docker engine at {host} {how} (is it running, or restarting?)"
    text = getattr(exc, "explanation", None) or str(exc) or type(exc).__name__
    return str(text).strip().splitlines()[0][:300]


def _remove_once(api: Any, container_id: str) -> None:
    try:
        api.remove_container(container_id, force=True)
    except NotFound:
        pass
    except APIError as exc:
        if exc.status_code != 409 or "already in progress" not in str(exc):
            raise
    _unremoved.discard(container_id)


_remove = _retry(_remove_once)


def _remove_within(api: Any, container_id: str, seconds: float) -> None:
    """Remove a container, retrying transient engine errors (a restart) for `seconds`."""
    retry(
        retry=retry_if_exception(_transient),
        stop=stop_after_delay(seconds),
        wait=wait_exponential(multiplier=0.25, max=2),
        reraise=True,
    )(_remove_once)(api, container_id)


# ---- leftovers: the atexit backstop, the reaper and gc ----

_backstop = ExitBackstop()
_unremoved: set[str] = set()
"""Containers whose close() gave up in this process; the next `reap()` here removes them."""


class _Start:
    """A container start in a worker thread that its caller may abandon (Ctrl-C): the
    container is then removed, by the thread or by the caller, whichever is second."""

    def __init__(self, client: docker.DockerClient, spec: SandboxSpec, image: str) -> None:
        self.client, self.spec, self.image = client, spec, image
        self._lock = threading.Lock()
        self._abandoned = False
        self._made: DockerSandbox | None = None

    def run(self) -> DockerSandbox:
        sandbox = _create(self.client, self.spec, self.image)
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


def _owner_dead(labels: dict[str, str]) -> bool:
    host, _, pid = labels.get(OWNER, "").rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not pid_alive(int(pid))


def reap(client: docker.DockerClient, *, run_id: str | None = None) -> int:
    """Remove agentrl containers that exited, expired, or whose owner died on this host."""
    filters = {"label": [f"{RUN}={run_id}" if run_id else RUN, OWNER]}
    removed, now = 0, time.time()
    for summary in client.api.containers(all=True, filters=filters):
        labels = summary.get("Labels") or {}
        expires = labels.get(EXPIRES, "")
        expired = expires.isdigit() and int(expires) < now
        ours = summary["Id"] in _unremoved
        if summary.get("State") in ("exited", "dead") or expired or ours or _owner_dead(labels):
            try:
                _remove(client.api, summary["Id"])
                removed += 1
            except (DockerException, requests.RequestException) as exc:
                log.warning("could not reap %s: %s", summary["Id"][:12], _first_line(exc))
    return removed


def remove_run(client: docker.DockerClient, run_id: str, *, snapshots: bool = False) -> GcReport:
    """Remove every container of `run_id`, alive or not (and its snapshots if asked)."""
    containers = client.api.containers(all=True, filters={"label": f"{RUN}={run_id}"})
    for summary in containers:
        _remove(client.api, summary["Id"])
    images, freed = (
        _remove_snapshots(client, lambda labels: labels.get(RUN) == run_id) if snapshots else (0, 0)
    )
    return GcReport(containers=len(containers), snapshots=images, snapshot_bytes=freed)


def gc(
    *, run_id: str | None = None, snapshots: bool = False, client: docker.DockerClient | None = None
) -> GcReport:
    """What `agentrl gc` does: reap dead runs' containers and, if asked, their snapshots.

    A snapshot's run is dead when its owner process on this host is gone and no
    container of the run is left; snapshots made on other hosts are kept.
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
                wanted = run_id is None or labels.get(RUN) == run_id
                return wanted and _owner_dead(labels) and labels.get(RUN) not in live_runs

            images, freed = _remove_snapshots(client, dead)
        return GcReport(containers=containers, snapshots=images, snapshot_bytes=freed)
    finally:
        if own:
            client.close()


def snapshot_bytes(client: docker.DockerClient, snapshot_id: str) -> int:
    """Disk the snapshot's own layer takes (its size less its parent image's)."""
    info = client.api.inspect_image(snapshot_id)
    parent = info.get("Parent")
    base = client.api.inspect_image(parent)["Size"] if parent else 0
    return max(0, int(info["Size"]) - int(base))


def _remove_snapshot(client: docker.DockerClient, snapshot_id: str) -> int | None:
    """Remove one snapshot image; the bytes freed, or None if nothing was removed."""
    try:
        size = snapshot_bytes(client, snapshot_id)
        client.api.remove_image(snapshot_id, force=True)
    except NotFound:
        return None
    except (DockerException, requests.RequestException) as exc:  # e.g. a child image uses it
        log.warning("kept snapshot %s: %s", snapshot_id[:19], _first_line(exc))
        return None
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
            size = _remove_snapshot(client, image["Id"])
            if size is not None:
                removed, freed = removed + 1, freed + size
    return removed, freed
