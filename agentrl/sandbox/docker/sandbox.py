# Over 400 lines: one container's calls (exec, files, commits, seal, close) share its handle.
"""`DockerSandbox`: one container, driven through the engine's API.

Blocking SDK calls run in threads; command output is read from the exec's socket on
the event loop, so a long command holds no thread. Teardown: `close()` (idempotent,
shielded from cancellation; it outlasts an engine outage of up to CLOSE_WAIT_S), the
atexit backstop, and the reaper for what neither could remove.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import posixpath
import re
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import docker
import requests
from docker.errors import DockerException, NotFound

from agentrl.errors import SandboxBroken, SandboxError, SandboxFileNotFound
from agentrl.sandbox.base import ExecRequest, ExecResult, HeadTail, SandboxSpec, Sealed, Usage
from agentrl.sandbox.docker import grading, host
from agentrl.sandbox.docker.engine import (
    DIR_MODE,
    INIT_ADDED,
    INIT_STATE,
    NAME,
    ORIGIN,
    OWNER,
    RUN,
    SNAPSHOT_OF,
    SNAPSHOT_REPO,
    SYMLINK_MODE,
    engine_error,
    first_line,
    get_archive,
    gone,
    owner,
    raw_socket,
    slug,
)
from agentrl.sandbox.docker.reap import backstop, keep_at_exit, remove_within, unremoved
from agentrl.sandbox.docker.shell import COLUMNS, PIDFILES, ROWS, DockerShell, with_pidfile
from agentrl.sandbox.seal import GradeScope
from agentrl.sandbox.shell import PtyShell

log = logging.getLogger(__name__)

MERGE = 'exec "$@" 2>&1'
GUARD_S = 10.0  # the client gives up this long after the in-container timeout should fire
CLOSE_WAIT_S = 30.0  # close() retries this long through an engine outage, then leaves it to reap

T = TypeVar("T")


class DockerSandbox:
    """One container. `close()` removes it; every call after that raises SandboxError."""

    def __init__(self, client: docker.DockerClient, container_id: str, spec: SandboxSpec) -> None:
        self._client = client
        self._api = client.api
        self._id = container_id
        # Once seal() made the grading copy: the agent's container, kept while it runs what
        # the agent left ("" once removed); None: not sealed.
        self._agent: str | None = None
        self._spec = spec
        self._shells: set[PtyShell] = set()
        self._shell_count = 0
        self._closed = False
        self._lock = threading.Lock()
        self.keepalive: int | None = None  # host pid of `sleep <ttl>`, which seal() spares
        self._host: host.HostView | None = None  # its cgroup and writable layer, found once
        self.init_state: InitState | None = None  # what keep_init() kept, if it kept anything
        self._snapshots = 0
        self._origin: tuple[str, str] | None = None  # (container, its chain's first image)
        self._commits: set[asyncio.Future[Any]] = set()  # commits in flight: close waits
        backstop.add(self._id, self.close_now)

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
        raw: socket.socket = raw_socket(stream)
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
            raise await self._stopped(gone(self._id, "its container stopped while a command ran"))
        timed_out = guard_fired or (code in (124, 137) and seconds >= request.timeout)
        return ExecResult(
            exit_code=None if timed_out else code,
            output=output.text(),
            timed_out=timed_out,
            seconds=seconds,
        )

    async def shell(self, argv: list[str]) -> DockerShell:
        """`argv` on a tty exec (bytes, echo on, 200 columns) in the workdir; its `close()`
        kills it and everything in its session."""
        self._check_open()
        self._shell_count += 1
        pidfile = f"{PIDFILES}{self._shell_count}.pid"
        created = await self._call(
            self._api.exec_create,
            self._id,
            with_pidfile(argv, pidfile),
            stdin=True,
            tty=True,
            workdir=self._spec.workdir,
        )
        exec_id = created["Id"]
        stream = await self._call(self._api.exec_start, exec_id, socket=True, tty=True)
        shell = DockerShell(self._api, self._id, exec_id, pidfile, stream, self.exec, self._shells)
        with contextlib.suppress(SandboxError):  # the shell may already have exited
            await self._call(self._api.exec_resize, exec_id, height=ROWS, width=COLUMNS)
        return shell

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        target = self._path(path)
        for _ in range(8):  # symlink hops; get_archive returns a link, not its target
            try:
                data, stat = await asyncio.to_thread(get_archive, self._api, self._id, target)
            except NotFound as exc:
                if "no such container" in str(exc).lower():
                    raise gone(self._id, "its container was removed") from exc
                raise SandboxFileNotFound(
                    f"{path}: no such file in sandbox {self._id[:12]}", fix="check the path"
                ) from exc
            except (DockerException, requests.RequestException) as exc:
                raise engine_error(self._id, exc) from exc
            if stat["mode"] & DIR_MODE:
                raise SandboxError(f"{path} is a directory in sandbox {self._id[:12]}")
            if not stat["mode"] & SYMLINK_MODE:
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
                raise gone(self._id, "its container was removed") from exc
        except (DockerException, requests.RequestException) as exc:
            raise engine_error(self._id, exc) from exc
        made = await self.exec(ExecRequest(command=["mkdir", "-p", parent], timeout=30))
        if made.exit_code != 0:
            raise SandboxError(f"cannot create {parent} in sandbox: {made.output.strip()[:200]}")
        await self._call(self._api.put_archive, self._id, parent, archive)

    async def snapshot(self, label: str) -> str:
        """Commit to `agentrl-snapshot/<run>:<name>-<label>`; returns the image id."""
        self._check_open()
        state = {INIT_STATE: self.init_state.image} if self.init_state else {}

        async def take() -> str:
            image = await self._commit(label, state)
            self._snapshots += 1  # it names the INIT state, which now goes with it
            return image

        return await self._settled(take())

    async def _settled(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` (a commit and its record) runs to its end even if the caller is
        cancelled: the engine finishes a commit it began, so the record must follow, and
        `close` waits for it before removing what the sandbox owns (a Ctrl-C during INIT
        left the INIT state's image behind)."""
        task = asyncio.ensure_future(work)
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)
        return await asyncio.shield(task)

    async def keep_init(self, scope: GradeScope) -> None:
        """INIT is over. What it made outside `scope`'s outputs (the task's files and its
        setup's, an install) is the task's, not the agent's: when it made any, the sandbox
        is committed as it is now, and the grading copy starts from that image rather than
        the task's, so the grader sees them as INIT left them. The output paths INIT added
        are remembered: one the agent deletes is deleted in the copy too."""
        self._check_open()
        _, changes, _ = await self._call(grading.origin_and_changes, self._api, self._id)
        # (a folder marked changed only holds changes: the engine's own mount points do)
        outside = {
            c.path
            for c in changes
            if not scope.covers(c.path) and not (c.is_dir and c.kind == "changed")
        }
        if not outside:
            return
        added = [c.path for c in changes if scope.covers(c.path) and c.kind == "added"]

        async def keep() -> None:
            image = await self._commit("init-state", {INIT_ADDED: json.dumps(added)})
            self.init_state = InitState(image=image, added=added, outside=outside, owned=True)

        await self._settled(keep())

    async def _commit(self, label: str, extra: dict[str, str]) -> str:
        """Commit the container as a snapshot of its run (gc and reaping treat it as one)."""
        spec = self._spec
        tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{spec.name}-{label}" if spec.name else label)
        if self._origin is None or self._origin[0] != self._id:  # a container's image is fixed
            self._origin = (self._id, await self._call(host.origin, self._api, self._id))
        origin = self._origin[1]
        labels = {
            RUN: spec.run_id,
            SNAPSHOT_OF: spec.run_id,
            OWNER: owner(),
            NAME: spec.name or "",
            ORIGIN: origin,
            **extra,
        }
        keep_at_exit(spec.run_id)
        image = await self._call(
            self._api.commit,
            self._id,
            repository=f"{SNAPSHOT_REPO}/{slug(spec.run_id)}",
            tag=tag.lstrip(".-")[:128] or "snapshot",
            conf={"Labels": labels},
        )
        return str(image["Id"])

    async def seal(self, scope: GradeScope) -> Sealed:
        """Become the grading copy: a new container from the task's image holding only the
        agent's changes under `scope`'s outputs. While the agent's container runs what the
        agent left (a service), it is kept and the copy joins its network namespace, so
        those answer the grader on loopback; otherwise it is removed once its changes are
        read, before the copy starts. With `scope.image` (a verifier of its own), the copy
        starts from that image, the agent's container is always gone first, and each
        output comes whole. Every call from now on acts on the copy."""
        self._check_open()
        if self._agent is not None:
            raise SandboxError(f"sandbox {self._id[:12]} is already sealed")
        from agentrl.sandbox.docker.provider import create_container

        origin, changes, note = await self._call(grading.origin_and_changes, self._api, self._id)
        notes = [note] if note else []
        separate = scope.image is not None  # a verifier of its own: nothing of INIT's either
        if separate:
            origin = str(scope.image)
            notes.append(
                f"graded in a verifier container of its own, from {scope.image}, once the "
                f"agent's was gone; carried whole from it: {', '.join(scope.outputs)}"
            )
        elif self.init_state is not None:  # the copy starts as INIT left the sandbox
            origin, changes = self.init_state.image, self.init_state.since(changes)
        running = await self._running()
        if running:
            spare = set(await self._spared())
            left = await self._call(grading.leftovers, self._api, self._id, spare)
            if left and not separate:
                notes.append(
                    f"{len(left)} agent process(es) kept running in the agent's own "
                    "container, reachable only over loopback: "
                    + "; ".join(a[:80] for a in left[:10])
                )
            else:  # nothing to reach: one container per episode, as the dispatcher counts
                await self._call(self._api.kill, self._id)
                # kill returns once the signal is sent; reading the layers of a container
                # the engine is still stopping failed ("RWLayer ... is unexpectedly nil").
                await self._call(self._api.wait, self._id, timeout=CLOSE_WAIT_S)
                running = False
        else:
            notes.append("the agent's container had stopped before grading (its own doing)")
        if separate:
            carried = await self._call(
                grading.collect_whole, self._api, self._id, changes, scope.outputs
            )
        else:
            carried = await self._call(grading.collect, self._api, self._id, changes, scope)
        try:
            agent, self._agent = self._id, self._id  # close() removes it from now on
            if not running:
                await self._call(remove_within, self._api, agent, CLOSE_WAIT_S)
                self._agent = ""
            copy_of = {"name": f"{self._spec.name or 'sandbox'}-grading", "mounts": {}}
            if separate:
                copy_of |= {"image": origin, "workdir": scope.cwd}
                if scope.env is not None:
                    copy_of["env"] = scope.env
            spec = self._spec.model_copy(update=copy_of)
            network = scope.network or (f"container:{agent}" if running else "none")
            copy = await asyncio.to_thread(create_container, self._client, spec, origin, network)
            with self._lock:  # close() removes both from now on
                self._id, self.keepalive, self._host = copy.id, copy.keepalive, None
            copy.disown()
            # One entry per sandbox, under its current id: left under the agent's, it held
            # every graded sandbox (its shells, its output buffers) until the process ended.
            backstop.discard(agent)
            backstop.add(self._id, self.close_now)
            return await self._call(grading.deliver, self._api, self._id, carried, scope, notes)
        finally:
            carried.close()

    async def _spared(self) -> list[int]:
        """Host pids that are the sandbox's own, not the agent's: docker-init, the
        keep-alive, and the shells its tools opened (their jobs are the agent's)."""
        state = (await self._call(self._api.inspect_container, self._id))["State"]
        shells = []
        for shell in list(self._shells):
            if isinstance(shell, DockerShell):
                info = await self._call(self._api.exec_inspect, shell.exec_id)
                shells.append(int(info.get("Pid") or 0))
        return [int(state.get("Pid") or 0), self.keepalive or 0, *shells]

    def disown(self) -> None:
        """Forget the container without removing it (another sandbox object owns it now)."""
        with self._lock:
            self._closed = True
        backstop.discard(self._id)

    async def stop_processes(self) -> list[str]:
        """SIGKILL every process but docker-init and the keep-alive, from the host while the
        container is frozen (needs no free pid inside); 'pid command line' of each."""
        self._check_open()
        return await self._call(host.stop_processes, self._api, self._id, self.keepalive)

    async def usage(self) -> Usage:
        """Counters from the container's cgroup and the size of its writable layer, read on
        this machine (None where the engine runs elsewhere or the driver is not overlay)."""
        self._check_open()
        if self._host is None:
            limit = self._spec.disk_mb << 20
            self._host = await self._call(host.HostView, self._api, self._id, limit)
        return await asyncio.to_thread(self._host.usage)

    async def connect_network(self, name: str) -> None:
        """Leave `--network none` for the Docker network `name` (nothing if already on it)."""
        self._check_open()
        info = await self._call(self._api.inspect_container, self._id)
        if name in ((info.get("NetworkSettings") or {}).get("Networks") or {}):
            return
        with contextlib.suppress(SandboxError):  # already off "none"
            await self._call(self._api.disconnect_container_from_network, self._id, "none")
        await self._call(self._api.connect_container_to_network, self._id, name)

    async def close(self) -> None:
        # Shielded: a cancelled caller (Ctrl-C) still gets its container removed, after
        # the commits in flight are recorded (what they made is the sandbox's to remove).
        try:
            if self._commits:
                await asyncio.wait(set(self._commits))
        finally:
            await asyncio.shield(asyncio.to_thread(self.close_now))

    def close_now(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Synchronous, idempotent removal (also what the atexit backstop calls). An engine
        that does not answer is retried for `wait_s`; after that the container is left to
        the reaper (the next provider started here, or `agentrl gc`), and a line says so."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for shell in list(self._shells):
                shell.release()
            try:
                for container_id in filter(None, (self._id, self._agent)):
                    remove_within(self._api, container_id, wait_s)
                state = self.init_state
                if state is not None and state.owned and not self._snapshots:
                    # snapshots taken name it: it goes with them (gc, or their removal)
                    with contextlib.suppress(NotFound):
                        self._api.remove_image(state.image)
            except (DockerException, requests.RequestException) as exc:
                unremoved.update(filter(None, (self._id, self._agent)))
                log.warning(
                    "sandbox %s was not removed within %g s: %s; fix: the next DockerProvider "
                    "started in this process removes it, or run `agentrl gc` once this "
                    "process has ended (its TTL stops it meanwhile)",
                    self._id[:12],
                    wait_s,
                    first_line(exc),
                )
        backstop.discard(self._id)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except NotFound as exc:
            raise gone(self._id, "its container was removed") from exc
        except (DockerException, requests.RequestException) as exc:
            error = engine_error(self._id, exc)
            if "is not running" in str(error):
                raise await self._stopped(error) from exc
            raise error from exc

    async def _stopped(self, error: SandboxError) -> SandboxError:
        """`error`, or SandboxBroken when the agent's own processes stopped the container."""
        if self._agent is not None:  # the grading copy: nothing of the agent's runs there
            return error
        why = await asyncio.to_thread(host.stopped_by_agent, self._api, self._id)
        if why is None:
            return error
        return SandboxBroken(f"sandbox {self._id[:12]}: {why}", fix="none: the agent did it")

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

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self._id[:12]} is closed", fix="start a new sandbox")


@dataclass
class InitState:
    """The sandbox as INIT left it, where INIT made something outside the outputs."""

    image: str
    """its commit: the grading copy's image"""
    added: list[str]
    """the output paths INIT added"""
    outside: set[str] = field(default_factory=set)
    """the paths INIT changed outside the outputs (known where INIT ran in this process)"""
    owned: bool = False
    """made by this sandbox (a restored one shares its snapshot's)"""

    def since(self, changes: list[grading.Change]) -> list[grading.Change]:
        """`changes` (over the task's image) as changes over this state: an output path INIT
        added that is gone now was deleted; what INIT changed outside is not the agent's."""
        present = {c.path for c in changes}
        deleted = [grading.Change(p, "deleted", False) for p in self.added if p not in present]
        return [c for c in changes if c.path not in self.outside] + deleted

    @classmethod
    def of_snapshot(cls, api: Any, snapshot_id: str) -> InitState | None:
        """The state a snapshot's sandbox was sealed against, if it had one and it is kept."""
        labels = api.inspect_image(snapshot_id).get("Config", {}).get("Labels") or {}
        image = labels.get(INIT_STATE)
        if not image:
            return None
        try:
            state = api.inspect_image(image).get("Config", {}).get("Labels") or {}
        except NotFound:
            return None
        return cls(image=image, added=json.loads(state.get(INIT_ADDED) or "[]"))


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


def _tar(name: str, data: bytes, mode: int) -> bytes:
    buffer = io.BytesIO()
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
