"""The warm pool hands out sandboxes that are already running, and cleans up after itself."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.docker import DockerProvider
from agentrl.sandbox.images import docker_client
from agentrl.sandbox.pool import WarmPool

pytestmark = pytest.mark.docker


def _count(run_id: str) -> int:
    client = docker_client()
    try:
        return len(client.containers.list(all=True, filters={"label": f"agentrl.run={run_id}"}))
    finally:
        client.close()


def test_pool_hands_out_ready_sandboxes_and_refills() -> None:
    run_id = f"test-pool-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        pool = WarmPool(DockerProvider(), SandboxSpec(run_id=run_id), size=2)
        await pool.start()
        assert pool.idle == 2 and _count(run_id) == 2
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
            assert pool.idle == 2
        finally:
            for sandbox in taken:
                await sandbox.close()
            await pool.close()
            await pool.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await pool.acquire()

    asyncio.run(main())
    assert _count(run_id) == 0


def test_pool_start_error_leaves_nothing_running() -> None:
    run_id = f"test-pool-{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        spec = SandboxSpec(run_id=run_id, image="agentrl/no-such-image:nope")
        pool = WarmPool(DockerProvider(), spec, size=2)
        with pytest.raises(Exception, match="not found"):
            await pool.start()

    asyncio.run(main())
    assert _count(run_id) == 0
