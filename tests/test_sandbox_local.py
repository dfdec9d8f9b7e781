"""The local provider: the sandbox interface over real subprocesses in a temp directory."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import read_until

import agentrl.sandbox.local as local_mod
from agentrl.errors import ConfigError, SandboxError, SandboxFileNotFound
from agentrl.sandbox import provider
from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.local import LocalProvider, LocalSandbox, snapshots_dir

T = TypeVar("T")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache"


def with_sandbox(
    body: Callable[[LocalSandbox], Awaitable[T]], spec: SandboxSpec | None = None
) -> T:
    async def go() -> T:
        sandbox = await LocalProvider().start(spec or SandboxSpec(run_id="test-local"))
        try:
            return await body(sandbox)
        finally:
            await sandbox.close()
            assert not sandbox.root.exists()

    return asyncio.run(go())


def test_exec_exit_codes_env_and_workdir() -> None:
    async def body(sb: LocalSandbox) -> None:
        ok = await sb.exec(ExecRequest(command="echo out; echo err >&2; pwd"))
        assert ok.exit_code == 0 and not ok.timed_out
        assert ok.output.splitlines() == ["out", "err", str(sb.root)]
        assert (await sb.exec(ExecRequest(command="exit 3"))).exit_code == 3
        argv = await sb.exec(ExecRequest(command=["python3", "-c", "print(6*7)"]))
        assert argv.output == "42\n"
        env = await sb.exec(
            ExecRequest(command="echo $FOO $BAR $PAGER $GIT_EDITOR", env={"BAR": "b"})
        )
        assert env.output == "f b cat true\n"
        await sb.exec(ExecRequest(command="mkdir -p sub/dir"))
        sub = await sb.exec(ExecRequest(command="pwd", workdir="/workspace/sub"))
        assert sub.output.strip() == str(sb.root / "sub")
        missing = await sb.exec(ExecRequest(command=["no-such-program-xyz"]))
        assert missing.exit_code == 127 and "no-such-program-xyz" in missing.output

    with_sandbox(body, SandboxSpec(run_id="test-local", env={"FOO": "f"}))


def test_timeout_kills_the_whole_session() -> None:
    async def body(sb: LocalSandbox) -> None:
        start = time.monotonic()
        res = await sb.exec(
            ExecRequest(command="sleep 1000 & echo $! > bg.pid; sleep 1000", timeout=1)
        )
        assert res.timed_out and res.exit_code is None
        assert time.monotonic() - start < 5
        bg = int((sb.root / "bg.pid").read_text())
        await asyncio.sleep(0.1)
        assert not _alive(bg)
        assert (await sb.exec(ExecRequest(command="echo still here"))).output == "still here\n"

    with_sandbox(body)


def test_background_child_holding_the_pipe_does_not_block_exec() -> None:
    async def body(sb: LocalSandbox) -> None:
        start = time.monotonic()
        res = await sb.exec(ExecRequest(command="sleep 30 & echo started"))
        assert res.exit_code == 0 and res.output == "started\n"
        assert time.monotonic() - start < 3

    with_sandbox(body)


def test_cancelled_exec_leaves_nothing_running() -> None:
    async def body(sb: LocalSandbox) -> None:
        task = asyncio.ensure_future(sb.exec(ExecRequest(command="echo $$ > me.pid; sleep 1000")))
        while not (sb.root / "me.pid").exists() or not (sb.root / "me.pid").read_text():
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        pid = int((sb.root / "me.pid").read_text())
        await asyncio.sleep(0.1)
        assert not _alive(pid)

    with_sandbox(body)


def test_huge_output_keeps_head_and_tail() -> None:
    async def body(sb: LocalSandbox) -> None:
        start = time.monotonic()
        cmd = "echo BEGIN; head -c 100000000 /dev/zero | tr '\\0' a; echo; echo END"
        res = await sb.exec(ExecRequest(command=cmd))
        assert time.monotonic() - start < 20
        assert res.exit_code == 0
        assert res.output.startswith("BEGIN\n") and res.output.endswith("END\n")
        assert "bytes elided" in res.output
        assert len(res.output) < 2_100_000

    with_sandbox(body)


def test_files_map_the_workdir_and_are_binary_safe() -> None:
    async def body(sb: LocalSandbox) -> None:
        every_byte = bytes(range(256))
        await sb.write_file("/workspace/a/b/bytes.bin", every_byte, mode=0o755)
        assert (sb.root / "a/b/bytes.bin").read_bytes() == every_byte
        assert (sb.root / "a/b/bytes.bin").stat().st_mode & 0o777 == 0o755
        assert await sb.read_file("a/b/bytes.bin") == every_byte
        big = os.urandom(5 * 1024 * 1024)
        await sb.write_file("big.bin", big)
        assert await sb.read_file("/workspace/big.bin") == big
        with pytest.raises(SandboxFileNotFound) as info:
            await sb.read_file("/workspace/nope.txt")
        assert isinstance(info.value, FileNotFoundError) and info.value.fix
        with pytest.raises(SandboxError, match="directory"):
            await sb.read_file("/workspace/a")

    with_sandbox(body)


def test_snapshot_and_restore(cache: Path) -> None:
    async def go() -> None:
        prov = LocalProvider()
        spec = SandboxSpec(run_id="test-local")
        sb = await prov.start(spec)
        try:
            await sb.write_file("kept.txt", b"v1")
            (sb.root / "link").symlink_to("kept.txt")
            snap = await sb.snapshot("traj 1/turn 3")
            await sb.write_file("kept.txt", b"v2")
            await sb.write_file("later.txt", b"x")
        finally:
            await sb.close()
        assert (snapshots_dir() / snap).is_dir() and snapshots_dir().is_relative_to(cache)
        restored = await prov.restore(snap, spec)
        try:
            assert await restored.read_file("kept.txt") == b"v1"
            assert (restored.root / "link").is_symlink()
            with pytest.raises(SandboxFileNotFound):
                await restored.read_file("later.txt")
        finally:
            await restored.close()
        with pytest.raises(SandboxError, match="no local snapshot"):
            await prov.restore("nope", spec)

    asyncio.run(go())


def test_shell_is_a_bytes_pty_and_can_be_killed() -> None:
    async def body(sb: LocalSandbox) -> None:
        sh = await sb.shell(["bash", "--norc", "--noprofile"])
        sh.send(b"cd /tmp && echo hi-$((1+1))\n")
        read_until(sh, b"hi-2", timeout=10)
        sh.send(b"sleep 1000 & echo bg=$!\n")
        bg = int(read_until(sh, rb"bg=(\d+)\r", timeout=10).group(1))
        await sh.close()
        await asyncio.sleep(0.1)
        assert not _alive(bg) and not sh.alive()
        await sh.close()  # idempotent
        again = await sb.shell(["bash", "--norc", "--noprofile"])
        again.send(b"echo $PWD\n")
        read_until(again, str(sb.root).encode(), timeout=10)
        with pytest.raises(TimeoutError):
            read_until(again, b"never printed", timeout=0.2)
        again.send(b"exit\n")
        with pytest.raises(EOFError):  # a shell that exits ends its output
            read_until(again, b"never printed", timeout=10)

    with_sandbox(body)


def test_close_is_idempotent_and_kills_shells() -> None:
    async def go() -> None:
        sb = await LocalProvider().start(SandboxSpec())
        sh = await sb.shell(["bash", "--norc", "--noprofile"])
        await sb.close()
        await sb.close()
        assert not sb.root.exists() and not sh.alive()
        with pytest.raises(SandboxError, match="closed"):
            await sb.exec(ExecRequest(command="true"))

    asyncio.run(go())


def test_warns_once_and_factory(caplog: pytest.LogCaptureFixture) -> None:
    local_mod._warned = False
    with caplog.at_level(logging.WARNING, logger="agentrl.sandbox.local"):
        assert isinstance(provider("local"), LocalProvider)
        LocalProvider()
    warnings = [r for r in caplog.records if "NO isolation" in r.getMessage()]
    assert len(warnings) == 1
    with pytest.raises(ConfigError, match="unknown sandbox provider") as info:
        provider("nope")
    assert "docker" in info.value.fix and "local" in info.value.fix


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie counts as dead (its parent has not reaped it yet).
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_disk_watchdog_and_process_guard_work_locally() -> None:
    from agentrl.tools.bash import BashTool

    async def body(sb: LocalSandbox) -> None:
        assert (await sb.usage()).processes == 0
        bash = BashTool(timeout=20)
        try:
            obs = await bash(sb, command="while :; do head -c 1M /dev/zero >> fill; done")
            assert obs.error and "wrote past its disk limit" in obs.text, obs.text
            assert "delete files" in (await bash(sb, command="echo ok")).text
            assert (await bash(sb, command="rm fill; echo ok")).text == "ok\n"
            await bash(sb, command="setsid sleep 1000 &")
            # The shell and the escaped sleep, once setsid has forked and exec'd it (the
            # prompt can come back first: under load a count in between saw 1).
            for _ in range(50):
                if (await sb.usage()).processes == 2:
                    break
                await asyncio.sleep(0.1)
            assert (await sb.usage()).processes == 2
            assert any("sleep 1000" in line for line in await sb.stop_processes())
            assert (await sb.usage()).processes == 0
        finally:
            await bash.close()

    with_sandbox(body, SandboxSpec(run_id="test-local", disk_mb=16))


def test_a_runs_snapshots_are_found_by_sandbox_name_and_no_other() -> None:
    """How a resumed episode finds a commit that landed unrecorded at a kill: by its run
    and sandbox name, newest first, never another sandbox's (`ep_1` is not `ep_10`'s)."""

    async def main() -> None:
        provider = LocalProvider()
        run = f"snapnames-{os.getpid()}"
        made: dict[str, list[str]] = {}
        for name in ("ep_1", "ep_10", "ep_1--x"):
            box = await provider.start(SandboxSpec(run_id=run, name=name))
            try:
                made[name] = [await box.snapshot("init"), await box.snapshot("turn-000")]
            finally:
                await box.close()
        try:
            for name, ids in made.items():
                assert await provider.snapshots_named(run, name) == ids[::-1]
            assert await provider.snapshots_named("other-run", "ep_1") == []
        finally:
            for ids in made.values():
                for i in ids:
                    await provider.remove_snapshot(i)

    asyncio.run(main())
