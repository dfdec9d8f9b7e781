"""The `local` provider: a sandbox is a temporary directory on this machine.

For trying agentrl without Docker. There is NO isolation: commands run as you, with
your network, your processes and your files. Only `spec.workdir` is redirected: a
path under it lands in the temporary directory, any other absolute path is the host's
own. Snapshots are directory copies under `$AGENTRL_CACHE/snapshots/local/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path, PurePosixPath

from pexpect.fdpexpect import fdspawn

from agentrl import scratch
from agentrl.errors import SandboxError, SandboxFileNotFound, SnapshotGone
from agentrl.sandbox.base import (
    FORCED_ENV,
    Capabilities,
    ExecRequest,
    ExecResult,
    HeadTail,
    SandboxSpec,
    Sealed,
    Usage,
    snapshots_root,
)
from agentrl.sandbox.procs import ExitBackstop, count_marked, kill_marked, kill_session, tree_bytes
from agentrl.sandbox.seal import GradeScope
from agentrl.sandbox.shell import PtyShell, spawn_on_pty

log = logging.getLogger(__name__)

SHELL_DIMENSIONS = (24, 200)
MARKER = "AGENTRL_SANDBOX"
"""Environment variable naming the sandbox in every process it starts (what seal() stops)."""
# Like `docker exec`: once the command exits, wait this long for its background children
# to let go of the output pipe, then stop reading (they keep running).
PIPE_GRACE_S = 1.0
NO_ISOLATION = (
    "sandbox provider 'local' has NO isolation: agent commands run as %s on this machine "
    "with its network and files (only %s is redirected to a temp dir); use 'docker' for "
    "anything but trying things out"
)

_warned = False
_backstop = ExitBackstop()


def snapshots_dir() -> Path:
    """Where local snapshots live."""
    return snapshots_root() / "local"


def _is_snapshot(snapshot_id: str) -> bool:
    folder = snapshots_dir() / snapshot_id
    return "/" not in snapshot_id and not snapshot_id.startswith(".") and folder.is_dir()


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip(".-")


def _snapshot_prefix(run_id: str, name: str) -> str:
    """What every snapshot folder of a sandbox named `name` in run `run_id` begins with."""
    return f"{_safe(run_id)[:40]}--{_safe(name)[:60]}--"


def _tree_bytes(snapshot_id: str) -> int:
    return sum(
        (Path(top) / name).lstat().st_size
        for top, _, files in os.walk(snapshots_dir() / snapshot_id)  # links not followed
        for name in files
    )


class LocalProvider:
    """Starts `LocalSandbox`es; warns loudly, once per process, that they isolate nothing."""

    name = "local"
    capabilities = Capabilities(shell=True, snapshots=True, network=True, metered=True)
    """No image, no grading copy, no mounts (the host's files are its own); `network`: it
    has this machine's all along."""

    def __init__(self) -> None:
        global _warned
        if not _warned:
            _warned = True
            log.warning(NO_ISOLATION, os.environ.get("USER", f"uid {os.getuid()}"), "the workdir")

    async def start(self, spec: SandboxSpec) -> LocalSandbox:
        return LocalSandbox(spec, scratch.make("local"))

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        """Bytes of the files in a snapshot folder (0 if it is gone)."""
        return await asyncio.to_thread(_tree_bytes, snapshot_id) if _is_snapshot(snapshot_id) else 0

    async def remove_snapshot(self, snapshot_id: str) -> int:
        """Delete a snapshot folder; returns the bytes its files held (0 if already gone)."""
        if not _is_snapshot(snapshot_id):
            return 0

        def remove() -> int:
            size = _tree_bytes(snapshot_id)
            shutil.rmtree(snapshots_dir() / snapshot_id, ignore_errors=True)
            return size

        return await asyncio.to_thread(remove)

    async def restore(self, snapshot_id: str, spec: SandboxSpec) -> LocalSandbox:
        source = snapshots_dir() / snapshot_id
        if not _is_snapshot(snapshot_id):
            raise SnapshotGone(
                f"no local snapshot {snapshot_id!r} in {snapshots_dir()}",
                fix="pass an id that LocalSandbox.snapshot returned (with the same AGENTRL_CACHE)",
            )
        root = scratch.make("local")
        sandbox = LocalSandbox(spec, root)
        try:
            await asyncio.to_thread(
                shutil.copytree, source, root, symlinks=True, dirs_exist_ok=True
            )
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def snapshots_named(self, run_id: str, name: str) -> list[str]:
        """By their folders' names (run, sandbox name, label), newest first."""
        prefix = _snapshot_prefix(run_id, name)

        def find() -> list[str]:
            root = snapshots_dir()
            found = [  # the rest is the label and a suffix: another name's goes on with "--"
                p
                for p in root.glob(f"{glob.escape(prefix)}*")
                if p.is_dir() and "--" not in p.name[len(prefix) :]
            ]
            return [p.name for p in sorted(found, key=lambda p: p.stat().st_ctime_ns, reverse=True)]

        return await asyncio.to_thread(find)

    def end_run(self, run_id: str) -> None:
        """Nothing: a local sandbox's folder goes with its close (or the exit backstop)."""


class LocalSandbox:
    """A temporary directory standing in for `spec.workdir`; `close()` deletes it."""

    def __init__(self, spec: SandboxSpec, root: Path) -> None:
        self._spec = spec
        self.root = root.resolve()
        self._id = f"local-{self.root.name.removeprefix('agentrl-local-')}"
        self._running: set[int] = set()  # session ids of execs in flight
        self._shells: set[PtyShell] = set()
        self._closed = False
        self._lock = threading.Lock()
        _backstop.add(self._id, self.close_now)

    @property
    def id(self) -> str:
        return self._id

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    def path(self, path: str) -> Path:
        """Where `path`, as the sandbox names it, lies on this machine."""
        posix, workdir = PurePosixPath(path), PurePosixPath(self._spec.workdir)
        if not posix.is_absolute():
            return self.root / posix
        if posix == workdir or workdir in posix.parents:
            return self.root / posix.relative_to(workdir)
        return Path(posix)

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        # The bash tool's shell state (agentrl.tools.bash_wire): /tmp here is the host's.
        state = {"AGENTRL_SHELL_STATE": f"{self.root}.shell-state"}
        return {**os.environ, **self._spec.env, **FORCED_ENV, **extra, MARKER: self._id, **state}

    async def exec(self, request: ExecRequest) -> ExecResult:
        self._check_open()
        command = request.command
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        cwd = self.path(request.workdir or self._spec.workdir)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        collector = _Collector()
        try:
            transport, _ = await loop.subprocess_exec(
                lambda: collector,
                *argv,
                cwd=cwd,
                env=self._env(request.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own session: a timeout kills all it started
            )
        except OSError as exc:
            what = "directory" if not cwd.is_dir() else "command"
            output = f"cannot run {argv[0]!r} in {cwd}: {exc.strerror or exc} ({what})\n"
            return ExecResult(exit_code=127, output=output, seconds=time.monotonic() - started)
        self._running.add(transport.get_pid())
        timed_out = False
        try:
            try:
                await asyncio.wait_for(collector.exited.wait(), request.timeout)
            except TimeoutError:
                timed_out = True
                kill_session(transport.get_pid())
                await collector.exited.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(collector.eof.wait(), PIPE_GRACE_S)
        finally:
            if transport.get_returncode() is None:  # cancelled: leave nothing running
                kill_session(transport.get_pid())
            self._running.discard(transport.get_pid())
            transport.close()
        code = transport.get_returncode()
        exit_code = None if timed_out or code is None else (128 - code if code < 0 else code)
        return ExecResult(
            exit_code=exit_code,
            output=collector.output.text(),
            timed_out=timed_out,
            seconds=time.monotonic() - started,
        )

    async def shell(self, argv: list[str]) -> LocalShell:
        """`argv` on a pty (bytes, echo on, 200 columns) in the workdir; its `close()` kills
        it and everything in its session."""
        self._check_open()
        env = {**self._env({}), "TERM": self._spec.env.get("TERM", "xterm")}  # as docker's tty
        spawn, process = spawn_on_pty(
            argv, cwd=str(self.path(self._spec.workdir)), env=env, size=SHELL_DIMENSIONS
        )
        return LocalShell(spawn, self._shells, process)

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        target = self.path(path)
        try:
            return await asyncio.to_thread(target.read_bytes)
        except FileNotFoundError as exc:
            raise SandboxFileNotFound(
                f"{path}: no such file in sandbox {self._id}", fix="check the path"
            ) from exc
        except IsADirectoryError as exc:
            raise SandboxError(f"{path} is a directory in sandbox {self._id}") from exc

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._check_open()
        await asyncio.to_thread(_write, self.path(path), data, mode)

    async def snapshot(self, label: str) -> str:
        """Copy the directory tree (symlinks kept as links); returns the snapshot's folder name."""
        self._check_open()
        safe = _snapshot_prefix(self._spec.run_id, self._spec.name or "") + _safe(label)[:40]
        snapshot_id = f"{safe}-{uuid.uuid4().hex[:8]}"
        dest = snapshots_dir() / snapshot_id
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            await asyncio.to_thread(shutil.copytree, self.root, dest, symlinks=True)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return snapshot_id

    async def keep_init(self, scope: GradeScope) -> None:
        """Nothing: the local provider grades the directory itself, as INIT and the agent
        left it (no isolation)."""
        self._check_open()

    async def seal(self, scope: GradeScope) -> Sealed:
        """Stop every process that carries this sandbox's marker in its environment (setsid,
        nohup and disowned ones too; one that cleared its environment escapes: there is
        no isolation here). Nothing else: there is no image to grade a copy from, so the
        local provider is no defence against an agent that games its grader."""
        stopped = await self.stop_processes()
        notes = ["local provider: no isolation; the grader saw everything the agent changed"]
        return Sealed(stopped=stopped, notes=notes)

    async def stop_processes(self) -> list[str]:
        """SIGKILL every process carrying this sandbox's marker (see `seal`)."""
        self._check_open()
        return await asyncio.to_thread(kill_marked, f"{MARKER}={self._id}")

    async def usage(self) -> Usage:
        """Marked processes and the temp dir's size; no pids or memory limit applies here
        (no isolation), so those counters are unknown. Writes outside the workdir land on
        this machine's own disk and are not counted."""
        self._check_open()

        def read() -> Usage:
            marked = count_marked(f"{MARKER}={self._id}")
            return Usage(processes=marked, disk_bytes=tree_bytes(self.root))

        return await asyncio.to_thread(read)

    async def connect_network(self, name: str) -> None:
        """Nothing to do: a local sandbox has this machine's network all along."""

    async def close(self) -> None:
        await asyncio.shield(asyncio.to_thread(self.close_now))

    def close_now(self) -> None:
        """Synchronous, idempotent teardown (also what the atexit backstop calls)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sid in list(self._running):
                kill_session(sid)
            for shell in list(self._shells):
                shell.release()
            shutil.rmtree(self.root, ignore_errors=True)
            Path(f"{self.root}.shell-state").unlink(missing_ok=True)
        _backstop.discard(self._id)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self._id} is closed", fix="start a new sandbox")


class LocalShell(PtyShell):
    """A `shell()` of a `LocalSandbox`: a child process on a pty of this machine, the
    leader of its own session."""

    def __init__(
        self, spawn: fdspawn, opened: set[PtyShell], process: subprocess.Popen[bytes]
    ) -> None:
        super().__init__(spawn, opened)
        self._process = process

    def alive(self) -> bool:
        return not self._closed and self._process.poll() is None

    def release(self) -> None:
        """SIGKILL the shell and every process in its session, and reap it; idempotent."""
        if not self._closed:  # once: the pid may be reused after the reap
            kill_session(self._process.pid)
            super().release()  # closes the pty's master
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)


class _Collector(asyncio.SubprocessProtocol):
    """Gathers a command's output (bounded) and notes when it exits and the pipe closes."""

    def __init__(self) -> None:
        self.output = HeadTail()
        self.exited = asyncio.Event()
        self.eof = asyncio.Event()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.output.feed(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self.eof.set()

    def process_exited(self) -> None:
        self.exited.set()


def _write(target: Path, data: bytes, mode: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    target.chmod(mode)
