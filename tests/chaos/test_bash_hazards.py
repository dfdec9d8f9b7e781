"""A hazard corpus for the bash tool in a real Docker sandbox (`agentrl/base:bookworm`,
--network none): whatever an agent's command does, an observation comes back in bounded
time, the next command (`echo ok`) answers promptly and cleanly, and closing leaves no
container behind.

Cases share one sandbox per group (the guard clears what each case leaves), so the
file runs in well under a minute. The image has no vi, nano, less or man: the shell's
editor and pager functions answer for them, and `read < /dev/tty` stands in for a
program that waits on the terminal.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from conftest import labelled_containers

from agentrl.sandbox.base import SandboxSpec
from agentrl.sandbox.docker import DockerProvider, DockerSandbox, remove_run
from agentrl.sandbox.images import docker_client
from agentrl.tools.bash import BashTool

pytestmark = pytest.mark.docker
T = TypeVar("T")
RUN_ID = f"test-chaos-{uuid.uuid4().hex[:8]}"
OUT_OF_PIDS = "the sandbox ran out of processes"
OUT_OF_MEMORY = "the sandbox ran out of memory"
PAST_DISK = "the sandbox wrote past its disk limit"
NEW_SHELL = "a new shell"
GROUPS: dict[str, dict[str, Any]] = {
    "pids": {"spec": {"pids": 128, "memory_mb": 512}, "timeout": 20.0},
    "tty": {"spec": {}, "timeout": 3.0},
    "memory": {"spec": {"memory_mb": 256}, "timeout": 20.0},
    "disk": {"spec": {"disk_mb": 64}, "timeout": 20.0},
}


@dataclass(frozen=True)
class Case:
    group: str
    command: str
    says: str | tuple[str, ...] = ""  # in the hazard's observation (one of them)
    within: float = 8.0  # seconds the hazard's observation may take
    next_says: str = ""  # in the `echo ok` observation, after "ok"
    cleanup: str = ""  # run after `echo ok`, so the group's next case starts clean
    wait_idle_clear: bool = False  # poll until the idle watch has stopped what it left


REPO = (
    "git init -q /tmp/r && cd /tmp/r && "
    "git -c user.email=a@b -c user.name=a commit -q --allow-empty -m first-commit"
)
OVER = "over its 64 MiB disk limit"
CASES = {
    # Processes: a bomb that returns at once, and two loops that run into the pids limit.
    # Backgrounded, the bomb may hit the pids limit before the look after the command,
    # or be found there still growing: either way it is stopped and the agent told why.
    "fork-bomb": Case("pids", ":(){ :|:& };:", says=(OUT_OF_PIDS, "processes were left running")),
    "background-loop-bomb": Case("pids", "while :; do sleep 100 & done", says=OUT_OF_PIDS),
    "seq-bomb": Case("pids", "for i in $(seq 2000); do sleep 1000 & done", says=OUT_OF_PIDS),
    # Output, pagers, editors, the terminal.
    "infinite-output": Case("tty", "yes", says="bytes elided", within=3 + 10),
    "binary-output": Case("tty", "head -c 4096 /dev/urandom"),
    "pager-more": Case("tty", "more /etc/os-release", says="NAME="),
    "pager-less": Case("tty", "less /etc/os-release", says="NAME="),
    "pager-git-log": Case("tty", f"{REPO} && git log", says="first-commit"),
    "pager-man": Case("tty", "man ls", says="[exit code"),  # not in the image: no hang
    "editor-vi": Case("tty", "vi notes.txt", says="str_replace_editor"),
    "editor-nano": Case("tty", "nano notes.txt", says="str_replace_editor"),
    "reads-the-tty": Case("tty", "read -r line < /dev/tty", says="timed out", within=3 + 10),
    "reads-stdin": Case("tty", "cat", says="(no output)"),
    "stty-echo": Case("tty", "stty echo onlcr icrnl < /dev/tty", says="(no output)"),
    "stty-raw": Case("tty", "stty raw -isig < /dev/tty", says="(no output)"),
    "exit": Case("tty", "exit 3", says=NEW_SHELL),
    "exec-bash": Case("tty", "exec bash", says=NEW_SHELL),
    "kill-the-shell": Case("tty", "kill -9 $$", says=NEW_SHELL),
    "background-writer": Case(
        "tty", "(while :; do date >> /tmp/x; done) &", cleanup="kill %1; rm -f /tmp/x"
    ),
    # Memory: in the foreground, and a background hog the next allocation collides with.
    "memory-pipe": Case("memory", "head -c 5G /dev/zero | tail", says=OUT_OF_MEMORY),
    "memory-python": Case("memory", "python3 -c \"b = b'x' * 1024**3\"", says=OUT_OF_MEMORY),
    "memory-background-hog": Case(
        "memory",
        "python3 -c \"import time; b = b'x' * (200 * 1024**2); time.sleep(1000)\" & sleep 2; "
        "python3 -c \"b = b'x' * (150 * 1024**2)\"",
        says=OUT_OF_MEMORY,
    ),
    # Disk (64 MiB here): the written data stays; the agent is told to delete it.
    "disk-at-once": Case(
        "disk",
        "head -c 300M /dev/zero > /tmp/fill",
        says=PAST_DISK,
        next_says=OVER,
        cleanup="rm -f /tmp/fill",
    ),
    "disk-endless": Case(
        "disk",
        "while :; do head -c 1M /dev/zero >> /tmp/fill; done",
        says=PAST_DISK,
        next_says=OVER,
        cleanup="rm -f /tmp/fill",
    ),
    "disk-background": Case(
        "disk",
        "(while :; do head -c 1M /dev/zero >> /tmp/fill; sleep 0.01; done) &",
        next_says=f"while no command ran, {PAST_DISK}",
        cleanup="rm -f /tmp/fill",
        wait_idle_clear=True,
    ),
}


class Sandboxes:
    """One event loop for the module and one sandbox (with its bash tool) per group."""

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.provider: DockerProvider | None = None
        self.open: dict[str, tuple[DockerSandbox, BashTool]] = {}

    def run(self, coro: Awaitable[T]) -> T:
        async def wrap() -> T:
            return await coro

        return self.runner.run(wrap())

    def get(self, group: str) -> tuple[DockerSandbox, BashTool]:
        if group not in self.open:
            config = GROUPS[group]
            self.provider = self.provider or DockerProvider(reap_at_start=False)
            spec = SandboxSpec(run_id=RUN_ID, name=group, **config["spec"])
            box = self.run(self.provider.start(spec))
            self.open[group] = (box, BashTool(timeout=config["timeout"]))
        return self.open[group]

    def close(self) -> None:
        for box, tool in self.open.values():
            self.run(tool.close())
            self.run(box.close())
        self.runner.close()


@pytest.fixture(scope="module")
def sandboxes() -> Iterator[Sandboxes]:
    boxes = Sandboxes()
    try:
        yield boxes
    finally:
        boxes.close()
        left = labelled_containers(RUN_ID)
        if left:  # clean up before failing, so one failure leaks nothing
            client = docker_client()
            remove_run(client, RUN_ID)
            client.close()
        assert left == [], "closing left containers behind"


async def _wait_idle_clear(box: DockerSandbox, limit_mb: int, bound: float = 20.0) -> None:
    """Until the sandbox is past its disk limit and nothing but init, keep-alive and a
    fresh shell runs (the idle watch stopped the writer)."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        usage = await box.usage()
        if (usage.disk_bytes or 0) > limit_mb << 20 and usage.processes == 3:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the idle watch did not stop the writer within {bound:g} s: {usage}")


@pytest.mark.parametrize("name", list(CASES))
def test_hazard_is_contained(name: str, sandboxes: Sandboxes) -> None:
    case = CASES[name]
    box, bash = sandboxes.get(case.group)
    start = time.monotonic()
    obs = sandboxes.run(bash(box, command=case.command))
    took = time.monotonic() - start
    assert took < case.within, f"{took:.1f} s: {obs.text[-500:]}"
    says = (case.says,) if isinstance(case.says, str) else case.says
    assert any(said in obs.text for said in says), obs.text[-1000:]
    if case.wait_idle_clear:
        sandboxes.run(_wait_idle_clear(box, box.spec.disk_mb))

    start = time.monotonic()
    after = sandboxes.run(bash(box, command="echo ok"))
    assert time.monotonic() - start < 3, after.text[-500:]
    assert after.text.startswith("ok\n"), after.text[-1000:]
    rest = after.text.removeprefix("ok\n")
    if case.next_says:
        assert case.next_says in rest, rest
    else:
        assert rest == "" and after.exit_code == 0, rest
    if case.cleanup:
        cleaned = sandboxes.run(bash(box, command=case.cleanup))
        assert cleaned.exit_code == 0, cleaned.text
        assert sandboxes.run(bash(box, command="echo clean")).text == "clean\n"
