"""A Docker provider whose commit of one label stalls after it landed in the engine, for
a kill to find it there unrecorded (tests/test_resume_at_turn.py): the state a driver
killed mid-commit leaves, made on purpose.

    PYTHONPATH=tests agentrl run TASK --provider stalled_commit_provider:StalledCommits

`AGENTRL_TEST_STALL_LABEL`: the snapshot label that stalls (e.g. turn-002);
`AGENTRL_TEST_STALL_MARK`: a file it writes the landed image's id to, then it waits."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from agentrl.sandbox.base import SandboxSpec
from agentrl.sandbox.docker import DockerProvider
from agentrl.sandbox.docker.sandbox import DockerSandbox


class StalledCommits(DockerProvider):
    async def start(self, spec: SandboxSpec) -> DockerSandbox:
        return _stalling(await super().start(spec))

    async def restore(self, snapshot_id: str, spec: SandboxSpec) -> DockerSandbox:
        return _stalling(await super().restore(snapshot_id, spec))


def _stalling(box: DockerSandbox) -> DockerSandbox:
    commit = box.snapshot

    async def snapshot(label: str) -> str:
        snapshot_id = await commit(label)
        if label == os.environ.get("AGENTRL_TEST_STALL_LABEL"):
            Path(os.environ["AGENTRL_TEST_STALL_MARK"]).write_text(snapshot_id)
            await asyncio.sleep(120)
        return snapshot_id

    box.snapshot = snapshot  # type: ignore[method-assign]
    return box
