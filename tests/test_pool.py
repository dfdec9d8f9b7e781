"""The warm pool hands out sandboxes that are already running, and cleans up after itself.

What is tested is the pool, not isolation: it runs on the local provider, whose every
live sandbox is a folder `agentrl-local-*` in the temp dir (pointed at tmp_path here).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from agentrl.errors import SandboxError
from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.local import LocalProvider, LocalSandbox
from agentrl.sandbox.pool import WarmPool


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder where sandboxes live while they run."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _count(live: Path) -> int:
    return len(list(live.glob("agentrl-local-*")))


def test_pool_hands_out_ready_sandboxes_and_refills(live: Path) -> None:
    async def main() -> None:
        pool = WarmPool(LocalProvider(), SandboxSpec(run_id="test-pool"), size=2)
        await pool.start()
        assert pool.idle == 2 and _count(live) == 2
        taken = [await pool.acquire(), await pool.acquire(), await pool.acquire()]
        try:
            assert len({s.id for s in taken}) == 3  # the third was started on demand
            for sandbox in taken:
                result = await sandbox.exec(ExecRequest(command="echo ready"))
                assert result.output == "ready\n"
            for _ in range(100):  # the pool refills in the background
                if pool.idle == 2:
                    break
                await asyncio.sleep(0.1)
            assert pool.idle == 2 and _count(live) == 5
        finally:
            for sandbox in taken:
                await sandbox.close()
            await pool.close()
            await pool.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await pool.acquire()

    asyncio.run(main())
    assert _count(live) == 0


class EveryOtherFails(LocalProvider):
    """Its second, fourth... start fails, as an engine might mid-way."""

    def __init__(self) -> None:
        super().__init__()
        self.starts = 0

    async def start(self, spec: SandboxSpec) -> LocalSandbox:
        self.starts += 1
        if self.starts % 2 == 0:
            raise SandboxError("image agentrl/no-such-image:nope not found")
        return await super().start(spec)


def test_pool_start_error_leaves_nothing_running(live: Path) -> None:
    async def main() -> None:
        provider = EveryOtherFails()
        pool = WarmPool(provider, SandboxSpec(run_id="test-pool"), size=2)
        with pytest.raises(SandboxError, match="not found"):
            await pool.start()
        assert provider.starts == 2  # one started, and was closed again

    asyncio.run(main())
    assert _count(live) == 0
