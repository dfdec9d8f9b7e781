"""The sandbox node's side of the cluster: one `SandboxWorker` Ray actor per Docker node.

The actor runs a `TaskEnv` of its own (so a recipe image is built on the node that
starts it, and setup and grading run next to the container) and the task's tools (a
bash tool's pty cannot cross processes); the driver (sandboxes.py) addresses each
sandbox by id. At start it reaps the containers a previous incarnation of its node left.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from agentrl.errors import SandboxError
from agentrl.sandbox.base import (
    ExecRequest,
    ExecResult,
    Sandbox,
    SandboxProvider,
    SandboxSpec,
    Sealed,
)
from agentrl.sandbox.seal import GradeScope
from agentrl.tasks.env import TaskEnv, build_tools
from agentrl.tasks.evidence import Grade
from agentrl.tasks.spec import Instance, Task
from agentrl.tools.base import Observation, Tool


class SandboxInfo(BaseModel):
    """A sandbox a worker started: what the driver keeps to address it."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: str
    spec: SandboxSpec
    image: str


class WorkerStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str
    pid: int
    live: int
    reaped: int


class _NodeProvider:
    """The node's DockerProvider, stamping the node's name on every sandbox it starts."""

    def __init__(self, inner: SandboxProvider, node: str) -> None:
        self.inner, self.node = inner, node
        self.name, self.capabilities = inner.name, inner.capabilities

    async def start(self, spec: SandboxSpec) -> Sandbox:
        return await self.inner.start(spec.model_copy(update={"node": self.node}))

    async def restore(self, snapshot_id: str, spec: SandboxSpec) -> Sandbox:
        return await self.inner.restore(snapshot_id, spec.model_copy(update={"node": self.node}))

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        return await self.inner.snapshot_bytes(snapshot_id)

    async def remove_snapshot(self, snapshot_id: str) -> int:
        return await self.inner.remove_snapshot(snapshot_id)

    async def snapshots_named(self, run_id: str, name: str) -> list[str]:
        return await self.inner.snapshots_named(run_id, name)

    def end_run(self, run_id: str) -> None:
        self.inner.end_run(run_id)


@dataclass
class _Held:
    env: TaskEnv
    sandbox: Sandbox
    tools: dict[str, Tool] = field(default_factory=dict)


class SandboxWorker:
    """Ray actor (async): starts, drives, grades and closes the sandboxes of one node."""

    def __init__(self, run_id: str, node: str) -> None:
        from agentrl.sandbox.docker import DockerProvider, reap

        self.run_id, self.node = run_id, node
        docker = DockerProvider(reap_at_start=False)
        # Containers whose owner died on this host: a previous incarnation of this node.
        self.reaped = reap(docker.client)
        self.provider = _NodeProvider(docker, node)
        self._envs: dict[tuple[str, str], TaskEnv] = {}
        self._held: dict[str, _Held] = {}

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            node=self.node, pid=os.getpid(), live=len(self._held), reaped=self.reaped
        )

    def _env(self, task: Task) -> TaskEnv:
        from agentrl.episode import make_env

        key = (str(task.path), task.hash)
        if key not in self._envs:
            self._envs[key] = make_env(task, self.provider, self.run_id)
        return self._envs[key]

    def _take(self, sandbox_id: str) -> _Held:
        held = self._held.get(sandbox_id)
        if held is None:
            raise SandboxError(f"sandbox {sandbox_id[:12]} is not open on node {self.node}")
        return held

    async def _hold(self, env: TaskEnv, sandbox: Sandbox) -> SandboxInfo:
        self._held[sandbox.id] = _Held(env, sandbox, build_tools(env.task))
        return SandboxInfo(sandbox_id=sandbox.id, spec=sandbox.spec, image=await env.image())

    async def init(self, task: Task, instance: Instance, name: str) -> SandboxInfo:
        env = self._env(task)
        return await self._hold(env, await env.init(instance, name))

    async def restore(
        self, task: Task, instance: Instance, snapshot_id: str, name: str
    ) -> SandboxInfo:
        env = self._env(task)
        return await self._hold(env, await env.restore(instance, snapshot_id, name))

    async def tool(self, sandbox_id: str, name: str, arguments: dict[str, Any]) -> Observation:
        held = self._take(sandbox_id)
        return await held.tools[name](held.sandbox, **arguments)

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        return await self._take(sandbox_id).sandbox.exec(request)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._take(sandbox_id).sandbox.read_file(path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        await self._take(sandbox_id).sandbox.write_file(path, data, mode)

    async def snapshot(self, sandbox_id: str, label: str) -> str:
        return await self._take(sandbox_id).sandbox.snapshot(label)

    async def keep_init(self, sandbox_id: str, scope: GradeScope) -> None:
        await self._take(sandbox_id).sandbox.keep_init(scope)

    async def seal(self, sandbox_id: str, scope: GradeScope) -> Sealed:
        held = self._take(sandbox_id)
        await self._stop_tools(held)
        return await held.sandbox.seal(scope)

    async def connect_network(self, sandbox_id: str, name: str) -> None:
        await self._take(sandbox_id).sandbox.connect_network(name)

    async def evaluate(self, sandbox_id: str, instance: Instance) -> Grade:
        held = self._take(sandbox_id)
        await self._stop_tools(held)
        return await held.env.evaluate(held.sandbox, instance)

    @staticmethod
    async def _stop_tools(held: _Held) -> None:
        """RUN is over: this node's tools stop watching (the sandbox becomes its grading
        copy next) and leave the agent's processes running, as `Episode.evaluate` does."""
        from agentrl.toolcall import close_tools

        await close_tools(held.tools, keep_processes=True)

    async def close(self, sandbox_id: str) -> None:
        held = self._held.pop(sandbox_id, None)
        if held is not None:
            from agentrl.toolcall import close_all

            await close_all(held.tools, held.sandbox)

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        return await self.provider.snapshot_bytes(snapshot_id)

    async def remove_snapshot(self, snapshot_id: str) -> int:
        return await self.provider.remove_snapshot(snapshot_id)

    async def shutdown(self) -> int:
        """Close every sandbox still open here; returns how many there were."""
        open_ids = list(self._held)
        await asyncio.gather(*(self.close(i) for i in open_ids), return_exceptions=True)
        return len(open_ids)
