"""The bash tool against real sandboxes: a local shell and a real Docker container.

Every hostile command the issue lists must leave the episode going with a clear
observation. Docker cases run in `agentrl/base:bookworm` with --network none.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agentrl.sandbox.base import ExecRequest, Sandbox, SandboxSpec
from agentrl.tools.bash import BashTool

RUN_ID = f"test-bash-{uuid.uuid4().hex[:8]}"


@asynccontextmanager
async def sandbox_of(kind: str, **spec: Any) -> AsyncIterator[Sandbox]:
    if kind == "docker":
        from agentrl.sandbox.docker import DockerProvider

        provider: Any = DockerProvider()
    else:
        from agentrl.sandbox.local import LocalProvider

        provider = LocalProvider()
    box = await provider.start(SandboxSpec(run_id=RUN_ID, **spec))
    try:
        yield box
    finally:
        await box.close()


def run(kind: str, body: Callable[[Sandbox, BashTool], Awaitable[None]], **spec: Any) -> None:
    tool_timeout = spec.pop("tool_timeout", 5.0)
    grace = spec.pop("interrupt_grace", 8.0)

    async def main() -> None:
        async with sandbox_of(kind, **spec) as box:
            tool = BashTool(timeout=tool_timeout, interrupt_grace=grace)
            try:
                await body(box, tool)
            finally:
                await tool.close()

    asyncio.run(main())


KINDS = [pytest.param("local"), pytest.param("docker", marks=pytest.mark.docker)]


@pytest.mark.parametrize("kind", KINDS)
def test_state_persists_and_exit_codes_come_back(kind: str) -> None:
    async def body(box: Sandbox, bash: BashTool) -> None:
        obs = await bash(box, command="mkdir -p sub && cd sub && export GREETING=hi")
        assert (obs.exit_code, obs.error) == (0, False)
        obs = await bash(box, command='basename "$PWD"; echo "$GREETING"')
        assert obs.text == "sub\nhi\n"
        obs = await bash(box, command="python3 -m venv --without-pip venv && . venv/bin/activate")
        assert obs.exit_code == 0, obs.text
        obs = await bash(box, command='basename "$VIRTUAL_ENV"; which python3')
        venv = obs.text.splitlines()
        assert venv[0] == "venv" and venv[1].endswith("/sub/venv/bin/python3")
        obs = await bash(box, command="ls /nonexistent")
        assert obs.exit_code == 2 and "[exit code 2]" in obs.text
        obs = await bash(box, command="printf 'no newline'")
        assert obs.text == "no newline"
        # Quotes, unicode, a here-doc and an unbalanced quote: none may wedge the shell.
        obs = await bash(box, command="cat <<'EOF'\nit's \"quoted\" $HOME `x` \\ 日本\nEOF")
        assert obs.text == 'it\'s "quoted" $HOME `x` \\ 日本\n'
        obs = await bash(box, command="echo 'unbalanced")
        assert obs.exit_code == 2 and "unexpected EOF" in obs.text
        long_line = "echo " + "x" * 20_000
        obs = await bash(box, command=long_line)
        assert obs.text.strip() == "x" * 20_000 or "elided" in obs.text
        assert (await bash(box, command="echo still-here")).text == "still-here\n"

    run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_stdin_pagers_and_editors_never_hang(kind: str) -> None:
    async def body(box: Sandbox, bash: BashTool) -> None:
        for command in ("cat", "read line; echo got:$line", "python3"):
            obs = await bash(box, command=command)
            assert not obs.error, (command, obs.text)
        setup = (
            "git init -q r && cd r && "
            "git -c user.email=a@b -c user.name=a commit -q --allow-empty -m one"
        )
        assert (await bash(box, command=setup)).exit_code == 0
        obs = await bash(box, command="git log")
        assert "one" in obs.text and obs.exit_code == 0
        obs = await bash(box, command="less /etc/os-release")
        assert "NAME=" in obs.text and obs.exit_code == 0
        obs = await bash(box, command="vim notes.txt")
        assert obs.exit_code == 1 and "str_replace_editor" in obs.text
        obs = await bash(box, command="git commit -q --allow-empty")  # GIT_EDITOR=true
        assert not obs.error
        cd_back = await bash(box, command="cd .. && pwd")
        assert cd_back.exit_code == 0

    run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_interrupts_and_a_wedged_shell_is_restarted(kind: str) -> None:
    async def body(box: Sandbox, bash: BashTool) -> None:
        await bash(box, command="cd /tmp && export KEEP=1")
        start = time.monotonic()
        obs = await bash(box, command="sleep 1000")
        assert time.monotonic() - start < 30
        assert obs.error and obs.exit_code is None
        assert "timed out after 2 s and was interrupted" in obs.text
        obs = await bash(box, command="pwd; echo $KEEP")
        assert obs.text == "/tmp\n1\n"  # Ctrl-C kept the shell and its state
        # Ctrl-C is ignored (the trap is inherited by sleep): only a restart gets the shell back.
        obs = await bash(box, command="trap '' INT; sleep 1000")
        assert "did not recover from Ctrl-C" in obs.text and "new shell" in obs.text
        obs = await bash(box, command="echo alive; echo ${KEEP:-reset}")
        assert obs.text == "alive\nreset\n"

    run(kind, body, tool_timeout=2.0, interrupt_grace=2.0)  # the wedged shell waits it out


@pytest.mark.parametrize("kind", KINDS)
def test_a_command_that_kills_the_shell(kind: str) -> None:
    async def body(box: Sandbox, bash: BashTool) -> None:
        obs = await bash(box, command="exit 3")
        assert obs.error and "shell exited" in obs.text
        assert (await bash(box, command="echo back")).text == "back\n"
        obs = await bash(box, command="kill -9 $$")
        assert obs.error and "new shell" in obs.text
        assert (await bash(box, command="echo back again")).text == "back again\n"

    run(kind, body)


@pytest.mark.parametrize("kind", KINDS)
def test_huge_output_keeps_head_and_tail(kind: str) -> None:
    async def body(box: Sandbox, bash: BashTool) -> None:
        obs = await bash(box, command="seq 1 2000000")
        assert obs.text.startswith("1\n2\n3\n")
        assert obs.text.endswith("1999999\n2000000\n")
        assert "bytes elided" in obs.text
        assert len(obs.text) < 25_000
        obs = await bash(box, command="head -c 100000000 /dev/zero | tr '\\0' a; echo; echo END")
        assert obs.exit_code == 0
        assert obs.text.endswith("END\n") and "bytes elided" in obs.text
        assert len(obs.text) < 25_000

    run(kind, body, tool_timeout=60.0)


@pytest.mark.docker
def test_hostile_commands_are_contained_in_docker() -> None:
    marker = f"/etc/agentrl-bash-test-{uuid.uuid4().hex[:6]}"

    async def body(box: Sandbox, bash: BashTool) -> None:
        obs = await bash(box, command=":(){ :|:& };:")  # returns at once; the bomb runs on
        assert obs.exit_code == 0
        # Every call still comes back (bounded by the tool timeout) with an observation.
        start = time.monotonic()
        obs = await bash(box, command="ls / > /dev/null && echo forked-fine")
        assert time.monotonic() - start < 60
        assert "forked-fine" in obs.text or "fork" in obs.text or obs.error
        # Killing the shell's session from the host ends the bomb (no free pid is needed).
        await bash.close()
        fresh = BashTool(timeout=20)
        try:
            obs = await fresh(box, command="ls / > /dev/null && ps -e --no-headers | wc -l")
            assert obs.exit_code == 0 and int(obs.text) < 10, obs.text
            obs = await fresh(box, command="python3 -c 'x = bytearray(2 * 1024**3)'")
            assert obs.exit_code == 137, obs.text  # the OOM killer, inside the container only
            probe = "import socket; socket.create_connection(('127.0.0.1', 9), 2)"
            obs = await fresh(box, command=f'python3 -c "{probe}"')
            assert obs.exit_code == 1 and "refused" in obs.text.lower()
            obs = await fresh(box, command="tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
            assert obs.text == "lo\n"  # --network none: loopback only
            obs = await fresh(box, command=f"echo x > {marker} && cat {marker}")
            assert obs.text == "x\n"
            assert (await fresh(box, command="echo alive")).text == "alive\n"
        finally:
            await fresh.close()

    run("docker", body, memory_mb=256, pids=64, tool_timeout=20.0)
    assert not Path(marker).exists()  # the write outside the workdir stayed in the container


@pytest.mark.docker
def test_no_container_is_left_behind() -> None:
    from agentrl.sandbox.images import docker_client

    client = docker_client()
    try:
        left = client.containers.list(all=True, filters={"label": f"agentrl.run={RUN_ID}"})
    finally:
        client.close()
    assert left == []


@pytest.mark.parametrize("kind", KINDS)
def test_processes_left_beyond_the_allowance_are_stopped(kind: str) -> None:
    async def body(box: Sandbox, bash: BashTool) -> None:
        strict = BashTool(timeout=10, max_background=1)
        try:
            # Durations no other test sleeps: a local sandbox's `ps` sees the whole host,
            # and the other test worker's sleeps with it.
            obs = await strict(box, command="cd /tmp; sleep 7771 & echo started")
            assert obs.text.endswith("started\n") and not obs.error  # one may stay
            obs = await strict(box, command="pwd; jobs | wc -l")
            assert obs.text == "/tmp\n1\n"
            obs = await strict(box, command="sleep 7772 & sleep 7773 & echo two-more")
            assert obs.error and "3 processes were left running (at most 1 may stay)" in obs.text
            assert "every process the agent started was stopped" in obs.text
            obs = await strict(box, command="pwd; ps -eo args | grep -c '^sleep 777'")
            assert obs.text.splitlines()[1:] == ["0", "[exit code 1]"], obs.text
            assert obs.text.splitlines()[0] != "/tmp"  # a new shell, in the workdir
        finally:
            await strict.close()

    run(kind, body)


def test_max_background_is_checked_when_a_task_is_validated(tmp_path: Path) -> None:
    from agentrl.tasks.load import check_task

    task = tmp_path / "task.yaml"
    task.write_text(
        "name: t\ninstances: [{id: a}]\nprompt: {system: s, instance: i}\n"
        "tools: [{name: bash, options: {max_background: -1}}]\n"
        "grader: {type: command, command: 'true'}\n"
    )
    problems = [str(p) for p in check_task(task)]
    assert any("max_background" in p and "greater than or equal to 0" in p for p in problems)
    task.write_text(task.read_text().replace("-1", "4"))
    assert check_task(task) == []


@pytest.mark.docker
def test_one_watch_looks_at_every_idle_shell_and_finds_what_one_left() -> None:
    """Eight idle shells: one task watches all of them (not one each), every sandbox is
    looked at, and a background process left in one while no command runs is found and
    stopped between commands, said with the next observation."""
    from agentrl.sandbox.docker import DockerProvider
    from agentrl.tools.bash_watch import IdleWatch

    async def main() -> None:
        provider = DockerProvider()
        spec = SandboxSpec(run_id=RUN_ID, pids=64)
        boxes = await asyncio.gather(*(provider.start(spec) for _ in range(8)))
        tools = [BashTool(timeout=10, max_background=0) for _ in boxes]
        try:
            await asyncio.gather(*(t(b, command="true") for t, b in zip(tools, boxes, strict=True)))
            watch = IdleWatch.of_loop()
            assert len(watch.watched) == 8
            named = [t for t in asyncio.all_tasks() if t.get_name() == "bash idle watch"]
            assert len(named) == 1
            # A process started behind the shell's back, as a command's leftover would be.
            await boxes[3].exec(ExecRequest(command="nohup sleep 7781 >/dev/null 2>&1 &"))
            deadline = time.monotonic() + 20
            while (not tools[3]._pending or watch.looks < 8) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert watch.looks >= 8
            obs = await tools[3](boxes[3], command="echo next")
            assert "while no command ran, 1 processes were left running" in obs.text
            assert all(not t._pending for i, t in enumerate(tools) if i != 3)
        finally:
            await asyncio.gather(*(t.close() for t in tools))
            await asyncio.gather(*(b.close() for b in boxes))
        assert watch.watched == {}

    asyncio.run(main())


@pytest.mark.docker
def test_a_restored_sandbox_gets_its_shell_back_as_the_agent_left_it() -> None:
    """Working directory and exported variables travel with a snapshot (a resume, a
    branch or a replay goes on in the shell the agent had); a restart after a hazard
    still resets them, as its observation says."""
    from agentrl.sandbox.docker import DockerProvider

    async def main() -> None:
        provider = DockerProvider()
        spec = SandboxSpec(run_id=RUN_ID)
        box = await provider.start(spec)
        first, second = BashTool(timeout=10), BashTool(timeout=10)
        restored = snapshot = None
        try:
            obs = await first(
                box, command="mkdir -p '/opt/a b' && cd '/opt/a b' && export FOO='x y'"
            )
            assert not obs.error
            snapshot = await box.snapshot("shell")
            restored = await provider.restore(snapshot, spec)
            obs = await second(restored, command='pwd; echo "$FOO"')
            assert obs.text == "/opt/a b\nx y\n"
            obs = await second(restored, command="exit 3")  # the shell is gone: a new one
            assert "working directory and environment are reset" in obs.text
            obs = await second(restored, command='pwd; echo "[$FOO]"')
            assert obs.text == "/workspace\n[]\n"
        finally:
            await first.close()
            await second.close()
            await box.close()
            if restored is not None:
                await restored.close()
            if snapshot is not None:  # after the container made from it is gone
                assert await provider.remove_snapshot(snapshot) > 0

    asyncio.run(main())
