"""The docker provider against the real engine: limits hold and nothing is left behind.

Every test labels its containers with a fresh run id; the `run_id` fixture asserts
afterwards that no container or snapshot image with that label remains.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import read_until
from docker.errors import NotFound

from agentrl.errors import SandboxError, SandboxFileNotFound
from agentrl.sandbox import provider
from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.docker import DockerProvider, DockerSandbox, gc, reap, remove_run
from agentrl.sandbox.images import docker_client

pytestmark = pytest.mark.docker
T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]


def _leftovers(run_id: str) -> tuple[list[str], list[str]]:
    client = docker_client()
    try:
        containers = client.api.containers(all=True, filters={"label": f"agentrl.run={run_id}"})
        images = client.api.images(all=True, filters={"label": f"agentrl.snapshot={run_id}"})
        return [c["Id"] for c in containers], [i["Id"] for i in images]
    finally:
        client.close()


@pytest.fixture
def run_id() -> Iterator[str]:
    run = f"test-sandbox-{uuid.uuid4().hex[:8]}"
    yield run
    containers, images = _leftovers(run)
    if containers or images:  # clean up before failing, so one failure leaks nothing
        client = docker_client()
        remove_run(client, run, snapshots=True)
        client.close()
    assert (containers, images) == ([], [])


def with_sandbox(spec: SandboxSpec, body: Callable[[DockerSandbox], Awaitable[T]]) -> T:
    async def go() -> T:
        sandbox = await DockerProvider(reap_at_start=False).start(spec)
        try:
            return await body(sandbox)
        finally:
            await sandbox.close()

    return asyncio.run(go())


def cmd(
    command: str, timeout: float = 30, workdir: str | None = None, env: dict[str, str] | None = None
) -> ExecRequest:
    return ExecRequest(command=command, timeout=timeout, workdir=workdir, env=env or {})


def test_exec_exit_codes_env_workdir_and_timeout(run_id: str) -> None:
    async def body(sb: DockerSandbox) -> None:
        ok = await sb.exec(cmd("echo out; echo err >&2; pwd; echo $FOO $PAGER $GIT_PAGER"))
        assert (ok.exit_code, ok.timed_out) == (0, False)
        assert ok.output == "out\nerr\n/srv/work\nf cat cat\n"
        assert (await sb.exec(cmd("exit 3"))).exit_code == 3
        argv = await sb.exec(ExecRequest(command=["python3", "-c", "print(6*7)"]))
        assert argv.output == "42\n"
        assert (await sb.exec(cmd("echo $BAR", env={"BAR": "b"}))).output == "b\n"
        assert (await sb.exec(cmd("mkdir sub && cd sub && pwd"))).output == "/srv/work/sub\n"
        assert (await sb.exec(cmd("pwd", workdir="sub"))).output == "/srv/work/sub\n"
        missing = await sb.exec(ExecRequest(command=["no-such-program-xyz"]))
        assert missing.exit_code == 127 and "no-such-program-xyz" in missing.output

        start = time.monotonic()
        slow = await sb.exec(cmd("echo before; sleep 1000", timeout=2))
        assert slow.timed_out and slow.exit_code is None and slow.output == "before\n"
        assert time.monotonic() - start < 6
        assert "sleep 1000" not in (await sb.exec(cmd("ps -eo args"))).output
        assert (await sb.exec(cmd("echo alive"))).output == "alive\n"

    with_sandbox(SandboxSpec(run_id=run_id, workdir="/srv/work", env={"FOO": "f"}), body)


def test_files_are_binary_safe_and_stay_inside(run_id: str) -> None:
    async def body(sb: DockerSandbox) -> None:
        every_byte = bytes(range(256))
        await sb.write_file("deep/er/bytes.bin", every_byte, mode=0o751)
        assert await sb.read_file("/workspace/deep/er/bytes.bin") == every_byte
        listing = await sb.exec(cmd("stat -c '%a %s' deep/er/bytes.bin"))
        assert listing.output == "751 256\n"
        big = os.urandom(5 * 1024 * 1024)
        await sb.write_file("/workspace/big.bin", big)
        assert await sb.read_file("big.bin") == big
        sums = await sb.exec(cmd("sha256sum big.bin | cut -c1-16"))
        assert sums.output.strip() == __import__("hashlib").sha256(big).hexdigest()[:16]
        await sb.exec(cmd("ln -s deep/er/bytes.bin link"))
        assert await sb.read_file("link") == every_byte

        with pytest.raises(SandboxFileNotFound) as info:
            await sb.read_file("nope.txt")
        assert isinstance(info.value, FileNotFoundError) and "nope.txt" in str(info.value)
        with pytest.raises(SandboxError, match="directory"):
            await sb.read_file("deep")

        # Outside the workdir: exists in the container, never on the host.
        await sb.write_file("/etc/agentrl-test", b"inside")
        shell_write = await sb.exec(cmd("echo x > /etc/agentrl-test2 && cat /etc/agentrl-test"))
        assert shell_write.output == "inside"
        assert await sb.read_file("/etc/agentrl-test2") == b"x\n"
        assert not Path("/etc/agentrl-test").exists()
        assert not Path("/etc/agentrl-test2").exists()

    with_sandbox(SandboxSpec(run_id=run_id), body)


def test_a_sandbox_has_dockers_default_capabilities_less_raw_sockets(run_id: str) -> None:
    """Published tasks are written for Docker's default set: a root shell's work, and a
    daemon that chroots (postfix) or binds a low port. NET_RAW is left out, and nothing
    beyond the default set (mounting) is granted."""
    script = """
        set -e
        git init -q repo && cd repo
        git config user.email a@b.c && git config user.name agent
        echo hi > f && chmod 640 f && chown nobody:nogroup f
        git add f && git commit -qm first && git log --oneline | wc -l
        useradd -m worker && su worker -c 'touch /tmp/mine && id -un'
        chroot / true && echo chrooted
        grep CapEff /proc/self/status
        """

    async def body(sb: DockerSandbox) -> None:
        res = await sb.exec(cmd(textwrap.dedent(script)))
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        assert lines[:3] == ["1", "worker", "chrooted"]
        # Docker's default effective set is a80425fb; bit 13 (0x2000) is CAP_NET_RAW.
        assert lines[3].split()[1] == f"{0xA80425FB & ~(1 << 13):016x}"
        denied = await sb.exec(cmd("mount -t tmpfs none /mnt"))
        assert denied.exit_code != 0

    with_sandbox(SandboxSpec(run_id=run_id), body)


def test_snapshot_then_restore(run_id: str) -> None:
    async def go() -> None:
        prov = DockerProvider(reap_at_start=False)
        spec = SandboxSpec(run_id=run_id, name="traj-7")
        sb = await prov.start(spec)
        try:
            await sb.write_file("kept.txt", b"v1")
            snap = await sb.snapshot("turn 3")
            await sb.write_file("kept.txt", b"v2")
            await sb.write_file("later.txt", b"x")
        finally:
            await sb.close()
        tags = prov.client.images.get(snap).tags
        assert tags == [f"agentrl-snapshot/{run_id}:traj-7-turn-3"]
        restored = await prov.restore(snap, spec)
        try:
            assert await restored.read_file("kept.txt") == b"v1"
            with pytest.raises(SandboxFileNotFound):
                await restored.read_file("later.txt")
            assert (await restored.exec(cmd("echo restored"))).output == "restored\n"
        finally:
            await restored.close()
        # Its owner (this process) is alive, so gc keeps it; remove_run takes it.
        assert gc(run_id=run_id, snapshots=True).snapshots == 0
        assert remove_run(prov.client, run_id, snapshots=True).snapshots == 1

    asyncio.run(go())


def test_no_network_but_loopback(run_id: str) -> None:
    probe = "import socket; socket.create_connection(('127.0.0.1', 9), timeout=2)"

    async def body(sb: DockerSandbox) -> None:
        devices = await sb.exec(cmd("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"))
        assert devices.output.split() == ["lo"]
        # No route but loopback's, so nothing can leave the container (we send nothing out).
        routes = await sb.exec(cmd("tail -n +2 /proc/net/route; cat /proc/net/ipv6_route"))
        assert {line.split()[-1] for line in routes.output.splitlines()} <= {"lo"}
        refused = await sb.exec(ExecRequest(command=["python3", "-c", probe]))
        assert refused.exit_code != 0 and "ConnectionRefusedError" in refused.output

    with_sandbox(SandboxSpec(run_id=run_id), body)


def test_fork_bomb_and_memory_hog_are_contained(run_id: str) -> None:
    hog = "b = b'x' * (2 * 1024**3); print('survived')"

    async def body(sb: DockerSandbox) -> None:
        # The bomb stays in the command's process group, so the timeout kills all of it.
        bomb = await sb.exec(cmd(":(){ :|:& };:; sleep 30", timeout=3))
        assert bomb.timed_out and "fork" in bomb.output  # the pids limit said no
        after = await sb.exec(cmd("echo after bomb; ps -e --no-headers | wc -l"))
        assert after.output.splitlines()[0] == "after bomb"
        assert int(after.output.splitlines()[1]) < 10
        start = time.monotonic()
        oom = await sb.exec(ExecRequest(command=["python3", "-c", hog], timeout=60))
        assert oom.exit_code == 137 and not oom.timed_out and "survived" not in oom.output
        assert time.monotonic() - start < 30
        assert (await sb.exec(cmd("echo after hog"))).output == "after hog\n"

    with_sandbox(SandboxSpec(run_id=run_id, memory_mb=256, pids=128), body)


def test_huge_output_is_elided_quickly(run_id: str) -> None:
    async def body(sb: DockerSandbox) -> None:
        start = time.monotonic()
        big = "echo BEGIN; head -c 100000000 /dev/zero | tr '\\0' a; echo; echo END"
        res = await sb.exec(cmd(big, timeout=60))
        assert time.monotonic() - start < 20
        assert res.exit_code == 0 and "bytes elided" in res.output
        assert res.output.startswith("BEGIN\naaa") and res.output.endswith("aaa\nEND\n")
        assert len(res.output) < 2_200_000

    with_sandbox(SandboxSpec(run_id=run_id), body)


def test_shell_runs_on_a_tty_over_the_socket_and_can_be_restarted(run_id: str) -> None:
    async def body(sb: DockerSandbox) -> None:
        sh = await sb.shell(["bash", "--norc", "--noprofile"])
        sh.send(b"cd /tmp && echo hi-$((1+1)) && stty size\n")
        read_until(sh, b"hi-2\r\n24 200", timeout=10)
        sh.send(b"sleep 1000 &\n")
        sh.send(b"sleep 999\n")  # wedged: the foreground command never returns
        with pytest.raises(TimeoutError):
            read_until(sh, b"never", timeout=0.3)
        await sh.close()
        assert not sh.alive()
        left = await sb.exec(cmd("ps -eo args"))
        assert "sleep 99" not in left.output and "bash --norc" not in left.output
        await sh.close()  # idempotent
        again = await sb.shell(["bash", "--norc", "--noprofile"])
        again.send(b"echo fresh in $PWD\n")
        read_until(again, b"fresh in /workspace", timeout=10)
        again.send(b"exit\n")
        with pytest.raises(EOFError):  # a shell that exits ends its stream
            read_until(again, b"never", timeout=10)

    with_sandbox(SandboxSpec(run_id=run_id), body)


def test_container_removed_from_outside_is_a_one_line_error(run_id: str) -> None:
    async def body(sb: DockerSandbox) -> None:
        client = docker_client()
        client.api.remove_container(sb.id, force=True)
        client.close()
        with pytest.raises(SandboxError) as info:
            await sb.exec(cmd("echo hi"))
        assert "is gone" in str(info.value) and "\n" not in str(info.value)
        with pytest.raises(SandboxError, match="is gone"):
            await sb.write_file("f", b"x")
        with pytest.raises(SandboxError, match="is gone"):
            await sb.read_file("f")
        await sb.close()
        await sb.close()

    with_sandbox(SandboxSpec(run_id=run_id), body)


def test_missing_image_says_how_to_get_it(run_id: str) -> None:
    async def go() -> None:
        prov = provider("docker", reap_at_start=False)
        with pytest.raises(SandboxError, match="image agentrl/nope:bookworm not found") as info:
            await prov.start(SandboxSpec(run_id=run_id, image="agentrl/nope:bookworm"))
        # No recipe makes it: building `nope` would fail, so the fix names what exists.
        assert info.value.fix is not None and "agentrl images build" not in info.value.fix
        assert "did you mean agentrl/base:bookworm?" in info.value.fix

    asyncio.run(go())


def test_close_survives_cancellation_and_starts_are_bounded(run_id: str) -> None:
    async def go() -> None:
        prov = DockerProvider(reap_at_start=False, max_concurrent_starts=2, starts_per_second=20)
        spec = SandboxSpec(run_id=run_id)
        boxes = await asyncio.gather(*(prov.start(spec) for _ in range(3)))
        assert len({b.id for b in boxes}) == 3
        for box in boxes:
            closing = asyncio.ensure_future(box.close())
            await asyncio.sleep(0)
            closing.cancel()  # Ctrl-C during close: the removal still completes
            with pytest.raises(asyncio.CancelledError):
                await closing
        # A start cancelled mid-way removes what it made, too.
        starting = asyncio.ensure_future(prov.start(spec))
        await asyncio.sleep(0.05)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        for _ in range(100):
            if _leftovers(run_id) == ([], []):
                break
            await asyncio.sleep(0.1)

    asyncio.run(go())


DRIVER = """
import asyncio, sys
from agentrl.sandbox.base import SandboxSpec
from agentrl.sandbox.docker import DockerProvider

async def main():
    sandbox = await DockerProvider(reap_at_start=False).start(SandboxSpec(run_id=sys.argv[1]))
    print(sandbox.id, flush=True)
    if sys.argv[2] == "hang":
        await asyncio.sleep(600)

asyncio.run(main())
"""


def _driver(run_id: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, run_id, mode], stdout=subprocess.PIPE, text=True, cwd=REPO
    )


def test_sigkilled_driver_is_reaped_at_the_next_start(run_id: str) -> None:
    driver = _driver(run_id, "hang")
    try:
        assert driver.stdout is not None
        container = driver.stdout.readline().strip()
        assert container and _leftovers(run_id)[0] == [container]
        DockerProvider()  # its owner is alive: the container must survive a reap
        assert _leftovers(run_id)[0] == [container]
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert _leftovers(run_id)[0] == [container]
    DockerProvider()
    assert _leftovers(run_id) == ([], [])


def test_a_driver_that_forgets_close_is_cleaned_at_exit(run_id: str) -> None:
    driver = _driver(run_id, "return")
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 0 and out.strip()
    assert _leftovers(run_id) == ([], [])


def test_ttl_stops_the_container_by_itself(run_id: str) -> None:
    async def body(sb: DockerSandbox) -> None:
        client = docker_client()
        try:
            for _ in range(100):  # the TTL is 3 s from start
                try:
                    if client.api.inspect_container(sb.id)["State"]["Status"] == "exited":
                        break
                except NotFound:  # exited, and another process's reaper took it
                    break
                await asyncio.sleep(0.2)
            with pytest.raises(SandboxError, match="is gone"):
                await sb.exec(cmd("echo hi"))
            # An exited container is garbage whoever owns it (another process's reaper
            # may get there first, so check the outcome rather than who removed it).
            assert reap(client, run_id=run_id) in (0, 1)
            assert _leftovers(run_id)[0] == []
        finally:
            client.close()

    # Below the spec's 10 s floor (there for real runs) to keep this short; same mechanism.
    with_sandbox(SandboxSpec(run_id=run_id).model_copy(update={"ttl_seconds": 3}), body)


def test_agentrl_gc_removes_what_a_killed_driver_left(run_id: str) -> None:
    driver = _driver(run_id, "hang")
    assert driver.stdout is not None
    container = driver.stdout.readline().strip()
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert _leftovers(run_id)[0] == [container]
    res = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "gc", "--run", run_id, "--snapshots"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert f"removed 1 container(s) and 0 snapshot image(s) (0 B) of run {run_id}" in res.stdout
    assert _leftovers(run_id) == ([], [])


def test_the_writable_layer_is_walked_again_only_once_the_room_left_could_be_filled(
    run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size of what a sandbox wrote is a walk of its files, and it was taken at every
    usage look (half the driver's CPU a turn at SWE shape). Far under the limit, a look
    within room / DISK_RATE (and DISK_GAP_S) of the last walk reuses it; past the limit,
    every look walks (so deleting files is seen at once)."""
    from agentrl.sandbox.docker import host

    walks = []
    real = host.tree_bytes
    monkeypatch.setattr(host, "tree_bytes", lambda root: walks.append(root) or real(root))
    monkeypatch.setattr(host, "DISK_GAP_S", 60.0)  # a loaded machine's exec is no walk

    async def go() -> None:
        prov = DockerProvider(reap_at_start=False)
        roomy = await prov.start(SandboxSpec(run_id=run_id, disk_mb=10240))
        tight = await prov.start(SandboxSpec(run_id=run_id, disk_mb=16))
        try:
            first = (await roomy.usage()).disk_bytes
            await roomy.exec(cmd("head -c 4M /dev/zero > /tmp/f"))
            assert (await roomy.usage()).disk_bytes == first and len(walks) == 1
            await tight.exec(cmd("head -c 20M /dev/zero > /tmp/f"))
            over = [(await tight.usage()).disk_bytes for _ in range(3)]  # at the limit
            assert len(walks) == 4 and all(b is not None and b >= 15 << 20 for b in over)
            await tight.exec(cmd("rm /tmp/f"))
            after = (await tight.usage()).disk_bytes
            assert after is not None and after < 1 << 20 and len(walks) == 5
            monkeypatch.setattr(host, "DISK_GAP_S", 0.0)  # the gap bounds it too
            await roomy.usage()
            assert len(walks) == 6
        finally:
            await roomy.close()
            await tight.close()

    asyncio.run(go())


def test_disk_limit_is_the_engines_quota_or_measured_from_the_host(run_id: str) -> None:
    from agentrl.sandbox.docker.provider import _quota_support

    async def go() -> None:
        prov = DockerProvider(reap_at_start=False)
        sb = await prov.start(SandboxSpec(run_id=run_id, disk_mb=64))
        try:
            quota = _quota_support.get(prov.client.api)
            assert quota in (True, False)  # found out at the first start, and remembered
            fill = await sb.exec(cmd("head -c 100M /dev/zero > /tmp/fill; echo $?", timeout=60))
            written = (await sb.usage()).disk_bytes
            if quota:  # xfs with pquota: the engine refuses the write itself
                assert "No space left on device" in fill.output
            else:  # no quota in this driver: the bash tool's watchdog acts on this figure
                assert fill.output == "0\n"
                assert written is not None and 100 << 20 <= written < 110 << 20
            await sb.exec(cmd("rm /tmp/fill"))
            after = (await sb.usage()).disk_bytes
            assert after is not None and after < 1 << 20
            second = await prov.start(SandboxSpec(run_id=run_id, disk_mb=64))
            await second.close()
            assert _quota_support.get(prov.client.api) is quota
        finally:
            await sb.close()

    asyncio.run(go())


def test_usage_and_stop_processes_work_from_the_host(run_id: str) -> None:
    async def body(sb: DockerSandbox) -> None:
        idle = await sb.usage()
        assert idle.processes == 2  # docker-init and the keep-alive
        assert (idle.pids_refused, idle.oom_kills) == (0, 0)
        await sb.exec(cmd("setsid nohup sleep 1000 >/dev/null 2>&1 & sleep 1000 >/dev/null &"))
        assert (await sb.usage()).processes == 4
        bomb = await sb.exec(cmd(":(){ :|:& };:; sleep 30", timeout=3))
        assert bomb.timed_out
        hog = await sb.exec(ExecRequest(command=["python3", "-c", "b = b'x' * 1024**3"]))
        assert hog.exit_code == 137
        used = await sb.usage()
        assert used.pids_refused and used.pids_refused > 0 and used.oom_kills == 1
        stopped = await sb.stop_processes()
        assert sum("sleep 1000" in line for line in stopped) == 2, stopped
        assert (await sb.usage()).processes == 2
        assert (await sb.exec(cmd("echo alive"))).output == "alive\n"

    with_sandbox(SandboxSpec(run_id=run_id, pids=64, memory_mb=256), body)


class EngineProxy:
    """A unix socket at `path` forwarding to the real engine's while it is up: taking it
    down is an engine outage for a client pointed at it, without touching the engine."""

    def __init__(self, path: Path, engine: str = "/var/run/docker.sock") -> None:
        self.path, self.engine = path, engine
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []

    def up(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(16)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.path.unlink(missing_ok=True)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self.conns.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.engine)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineProxy]:
    folder = Path(tempfile.mkdtemp(prefix="agentrl-engine-", dir="/tmp"))
    engine = EngineProxy(folder / "docker.sock")
    engine.up()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{engine.path}")
    yield engine
    engine.down()
    shutil.rmtree(folder, ignore_errors=True)


def test_close_outlasts_a_short_engine_outage(run_id: str, proxy: EngineProxy) -> None:
    async def go() -> None:
        sb = await DockerProvider(reap_at_start=False).start(SandboxSpec(run_id=run_id))
        proxy.down()  # the engine "restarts": its socket is gone for 1 s
        back = threading.Timer(1.0, proxy.up)
        back.start()
        start = time.monotonic()
        try:
            await sb.close()
        finally:
            back.join()
        assert 1.0 <= time.monotonic() - start < 15
        assert _leftovers(run_id) == ([], [])

    asyncio.run(go())


def test_close_gives_up_in_bounded_time_in_one_line_and_the_reaper_removes_it(
    run_id: str,
    proxy: EngineProxy,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def go() -> str:
        sb = await DockerProvider(reap_at_start=False).start(SandboxSpec(run_id=run_id))
        proxy.down()  # and it stays down
        start = time.monotonic()
        await asyncio.to_thread(sb.close_now, 1.0)
        assert time.monotonic() - start < 10
        return sb.id

    with caplog.at_level("WARNING", logger="agentrl.sandbox.docker"):
        container = asyncio.run(go())
    (line,) = [r.getMessage() for r in caplog.records if container[:12] in r.getMessage()]
    assert "\n" not in line and "Connection aborted" not in line and "FileNotFoundError" not in line
    assert "is unreachable" in line and "agentrl gc" in line, line
    monkeypatch.undo()  # the real engine again, unchanged: the container is still there
    assert _leftovers(run_id)[0] == [container]
    client = docker_client(timeout=10)  # the next start's reaper in this process takes it
    try:
        assert reap(client, run_id=run_id) == 1
    finally:
        client.close()
    assert _leftovers(run_id) == ([], [])


def test_a_stopped_container_of_a_live_run_is_its_owners_not_the_reapers(run_id: str) -> None:
    """An agent that stops its own container (`kill -9 -1`) leaves it for its run to grade
    (sandbox_broken): another provider started on the host (another agentrl process, a
    parallel test) must not reap it. Seen: the grade then failed as "container removed"."""

    async def go() -> None:
        sandbox = await DockerProvider(reap_at_start=False).start(SandboxSpec(run_id=run_id))
        try:
            with contextlib.suppress(SandboxError):
                await sandbox.exec(ExecRequest(command="kill -9 -1; true"))
            client = docker_client()
            try:
                deadline = time.monotonic() + 30
                while client.api.inspect_container(sandbox.id)["State"]["Running"]:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
                reap(client)  # what every provider started on this host does first
                assert client.api.inspect_container(sandbox.id)["State"]["Status"] == "exited"
            finally:
                client.close()
        finally:
            await sandbox.close()

    asyncio.run(go())


def test_a_graded_sandbox_is_let_go_once_closed(run_id: str) -> None:
    """Sealing moves the sandbox to its grading copy's container: the exit backstop then
    holds it under the copy's id alone, and nothing once it is closed. Before, the
    agent's id stayed behind, and with it every graded sandbox (its shells, its output
    buffers) until the process ended: 4 MB an episode in the full-shape rehearsal."""
    import gc as collector
    import weakref

    from agentrl.sandbox.docker.reap import backstop
    from agentrl.sandbox.seal import GradeScope

    async def main() -> weakref.ref[DockerSandbox]:
        sandbox = await DockerProvider(reap_at_start=False).start(
            SandboxSpec(run_id=run_id, workdir="/workspace")
        )
        agent = sandbox._id
        await sandbox.exec(ExecRequest(command="echo hi > /workspace/a"))
        await sandbox.seal(GradeScope(outputs=("/workspace",)))
        assert agent not in backstop._live and sandbox._id in backstop._live
        await sandbox.close()
        assert sandbox._id not in backstop._live
        return weakref.ref(sandbox)

    ref = asyncio.run(main())
    collector.collect()
    assert ref() is None  # nothing holds the sandbox any more
