"""A sandbox provider that exists only in the tests: each sandbox is a temporary folder
standing in for its workdir, and commands run there through subprocess. No isolation,
no image, no shell, no snapshots, no grading copy, no network, no usage, no mounts.

It is the proof that the sandbox seam is open: this file and tests/test_sandbox_seam.py
add a provider, nothing in agentrl/ names it. It implements start, exec, read_file,
write_file and close, and declares every other ability absent (`Capabilities()`), so
agentrl refuses or skips each one with a message (agentrl/sandbox/base.py). Built as
`--provider sandbox_test_provider:FolderProvider` (or `provider:` in a train config).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path, PurePosixPath

from agentrl.errors import SandboxError, SandboxFileNotFound
from agentrl.sandbox.base import (
    Capabilities,
    ExecRequest,
    ExecResult,
    Sandbox,
    SandboxProvider,
    SandboxSpec,
)


class FolderProvider(SandboxProvider):
    """Starts `FolderSandbox`es; `root` is where their folders go (default: the system's
    temporary folder)."""

    name = "folder"  # its config's build() records the module:Class path instead
    capabilities = Capabilities()

    def __init__(self, root: str | None = None) -> None:
        self.root = root
        self.started: list[FolderSandbox] = []

    async def start(self, spec: SandboxSpec) -> Sandbox:
        sandbox = FolderSandbox(spec, Path(tempfile.mkdtemp(prefix="folder-", dir=self.root)))
        self.started.append(sandbox)
        return sandbox


class FolderSandbox(Sandbox):
    """A folder standing in for `spec.workdir`: paths under the workdir (or relative) land
    in it, any other is refused."""

    def __init__(self, spec: SandboxSpec, root: Path) -> None:
        self._spec, self.root = spec, root

    @property
    def id(self) -> str:
        return self.root.name

    @property
    def spec(self) -> SandboxSpec:
        return self._spec

    def path(self, path: str) -> Path:
        posix, workdir = PurePosixPath(path), PurePosixPath(self._spec.workdir)
        if not posix.is_absolute():
            return self.root / posix
        if posix == workdir or workdir in posix.parents:
            return self.root / posix.relative_to(workdir)
        raise SandboxError(f"{path}: outside the workdir of folder sandbox {self.id}")

    async def exec(self, request: ExecRequest) -> ExecResult:
        command = request.command
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        env = {**os.environ, **self._spec.env, **request.env}
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=self.path(request.workdir or self._spec.workdir),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), request.timeout)
        except TimeoutError:
            process.kill()
            output, _ = await process.communicate()
            return ExecResult(
                exit_code=None,
                output=output.decode(errors="replace"),
                timed_out=True,
                seconds=time.monotonic() - started,
            )
        return ExecResult(
            exit_code=process.returncode,
            output=output.decode(errors="replace"),
            seconds=time.monotonic() - started,
        )

    async def read_file(self, path: str) -> bytes:
        try:
            return self.path(path).read_bytes()
        except FileNotFoundError as exc:
            raise SandboxFileNotFound(f"{path}: no such file in sandbox {self.id}") from exc

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        target = self.path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)

    async def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self.root)
