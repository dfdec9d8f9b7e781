"""Sandbox workers on Ray: each Docker node runs one actor that owns its sandboxes.

The driver's dispatcher still runs INIT / RUN / EVAL; an episode's `RemoteTaskEnv`
sends each stage's work to the `SandboxWorker` actor holding its sandbox. The actor runs
a `TaskEnv` of its own (so a recipe image is built on the node that starts it, and
setup and grading run next to the container) and the task's tools (a bash tool's pty
cannot cross processes). What crosses is picklable: the Task, the Instance, tool
arguments, and the response models (Observation, ExecResult, Grade, SandboxInfo).

A node that dies takes its actor with it: every call to it then raises `SandboxLost`
(a SandboxError), so the episode ends as `sandbox_error` — or, during INIT, is retried
on another node when `init_attempts` allows — and the run goes on with the nodes left.
The dead node's containers are reaped when it returns: the new worker's DockerProvider
removes containers whose owning process died. Nodes that join (or return) are picked
up within `refresh_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from agentrl.cluster.local import NODE_RESOURCE, ClusterError
from agentrl.cluster.worker import SandboxInfo, SandboxWorker, WorkerStatus
from agentrl.errors import ConfigError, SandboxError, first_line
from agentrl.sandbox.base import (
    ExecRequest,
    ExecResult,
    Sandbox,
    SandboxSpec,
    Sealed,
    Shell,
)
from agentrl.sandbox.seal import GradeScope
from agentrl.tasks.env import Opening, build_tools
from agentrl.tasks.evidence import Grade
from agentrl.tasks.spec import Instance, Task
from agentrl.tools.base import Observation, Tool

log = logging.getLogger(__name__)


class SandboxLost(SandboxError):
    """The node (or worker process) holding a sandbox is gone."""

    default_fix = "the episode ends as sandbox_error; see `agentrl cluster status`"


class _Worker:
    """The driver's handle on one node's SandboxWorker."""

    def __init__(self, actor: Any, node: str, node_id: str, capacity: int) -> None:
        self.actor, self.node, self.node_id, self.capacity = actor, node, node_id, capacity
        self.live = 0
        self.dead = False

    async def call(self, method: str, *args: Any) -> Any:
        from ray.exceptions import RayActorError, RayTaskError

        if self.dead:
            raise SandboxLost(f"sandbox node {self.node} is gone")
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayTaskError as e:  # the call failed on the node: its own error, as raised
            cause = e.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise SandboxError(f"node {self.node}: {method} failed: {e}") from None
        except RayActorError as e:  # the actor died: its node (or process) is gone
            self.dead = True
            why = first_line(e, limit=160)
            raise SandboxLost(f"sandbox node {self.node} is gone ({why})") from None


class SandboxFleet:
    """One SandboxWorker per alive node that offers `resource`; picks the least loaded."""

    def __init__(self, run_id: str, *, resource: str = "sandbox", refresh_s: float = 5.0) -> None:
        self.run_id, self.resource, self.refresh_s = run_id, resource, refresh_s
        self.workers: dict[str, _Worker] = {}  # by Ray node id
        self.snapshots: dict[str, _Worker] = {}  # snapshot id -> the node that holds it
        self._refreshed = -float("inf")
        self._lock = asyncio.Lock()
        self._freed = asyncio.Event()  # a slot was released

    async def start(self) -> None:
        await self.refresh()
        if not self.alive():
            raise ClusterError(
                f"no alive node of the Ray cluster offers the {self.resource!r} resource",
                fix=f"start sandbox nodes with: ray start --resources "
                f"'{{\"{self.resource}\": 8}}' (or: agentrl cluster up)",
            )

    def alive(self) -> list[_Worker]:
        return [w for w in self.workers.values() if not w.dead]

    async def refresh(self) -> None:
        """Forget workers on dead nodes; start one on every new sandbox node."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        async with self._lock:
            nodes = await asyncio.to_thread(ray.nodes)
            up = {n["NodeID"]: n for n in nodes if n["Alive"]}
            for node_id, worker in list(self.workers.items()):
                if worker.dead or node_id not in up:
                    worker.dead = True
                    del self.workers[node_id]
            remote = ray.remote(SandboxWorker)
            started = []
            for node_id, info in up.items():
                capacity = int(info["Resources"].get(self.resource, 0))
                if capacity <= 0 or node_id in self.workers:
                    continue
                name = node_name(info)
                actor = remote.options(  # type: ignore[attr-defined]
                    num_cpus=0,
                    max_concurrency=1000,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(self.run_id, name)
                started.append(_Worker(actor, name, node_id, capacity))
            for worker in started:
                try:  # bounded: a node that hangs must not stall every INIT behind the lock
                    status: WorkerStatus = await asyncio.wait_for(worker.call("status"), 120)
                except (SandboxError, TimeoutError) as e:
                    log.warning("sandbox worker on node %s did not start: %r", worker.node, e)
                    with contextlib.suppress(Exception):
                        ray.kill(worker.actor)
                    continue
                if status.reaped:
                    log.info("node %s: reaped %d container(s)", worker.node, status.reaped)
                self.workers[worker.node_id] = worker
            self._refreshed = time.monotonic()

    async def acquire(self, on: _Worker | None = None) -> _Worker:
        """A sandbox slot on the alive worker with the most room (live / capacity lowest),
        or on `on` only (a restore goes where its snapshot is); waits while they are
        full: a node's `sandbox` amount is a hard limit."""
        while True:
            if time.monotonic() - self._refreshed > self.refresh_s:
                await self.refresh()
            alive = self.alive()
            if not alive:
                await self.refresh()
                alive = self.alive()
            if not alive:
                raise SandboxLost("no sandbox node of the Ray cluster is alive")
            if on is not None and on.dead:
                raise SandboxLost(f"node {on.node} is gone, and the snapshots it held")
            room = [w for w in ([on] if on is not None else alive) if w.live < w.capacity]
            if room:
                worker = min(room, key=lambda w: (w.live / w.capacity, w.live))
                worker.live += 1
                return worker
            self._freed.clear()
            with contextlib.suppress(TimeoutError):  # a node may join meanwhile
                await asyncio.wait_for(self._freed.wait(), self.refresh_s)

    def release(self, worker: _Worker) -> None:
        worker.live -= 1
        self._freed.set()

    async def close(self) -> None:
        """Close the sandboxes still open on every alive node; end the workers."""
        import ray

        async def end(worker: _Worker) -> None:
            with contextlib.suppress(SandboxError):
                await asyncio.wait_for(worker.call("shutdown"), 60)
            with contextlib.suppress(Exception):
                ray.kill(worker.actor)

        await asyncio.gather(*(end(w) for w in self.alive()), return_exceptions=True)
        self.workers.clear()


def node_name(info: dict[str, Any]) -> str:
    """A node's name: its `agentrl_node_<name>` resource, else its address and id."""
    for key in info["Resources"]:
        if key.startswith(NODE_RESOURCE):
            return str(key[len(NODE_RESOURCE) :])
    return f"{info['NodeManagerAddress']}/{info['NodeID'][:8]}"


class RaySandbox:
    """A sandbox held by a node's worker: every call goes to that worker."""

    def __init__(self, worker: _Worker, info: SandboxInfo, fleet: SandboxFleet) -> None:
        self.worker, self.info, self.fleet = worker, info, fleet
        self._closed = False

    @property
    def id(self) -> str:
        return self.info.sandbox_id

    @property
    def spec(self) -> SandboxSpec:
        return self.info.spec

    async def exec(self, request: ExecRequest) -> ExecResult:
        result: ExecResult = await self.worker.call("exec", self.id, request)
        return result

    async def shell(self, argv: list[str]) -> Shell:
        raise SandboxError(
            "a sandbox on a Ray node has no local pty; its tools run on the node",
            fix="call tools through RemoteTaskEnv.tools()",
        )

    async def read_file(self, path: str) -> bytes:
        data: bytes = await self.worker.call("read_file", self.id, path)
        return data

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await self.worker.call("write_file", self.id, path, data, mode)

    async def snapshot(self, label: str) -> str:
        snapshot_id: str = await self.worker.call("snapshot", self.id, label)
        self.fleet.snapshots[snapshot_id] = self.worker  # restore and removal go there
        return snapshot_id

    async def keep_init(self, scope: GradeScope) -> None:
        await self.worker.call("keep_init", self.id, scope)

    async def seal(self, scope: GradeScope) -> Sealed:
        sealed: Sealed = await self.worker.call("seal", self.id, scope)
        return sealed

    async def connect_network(self, name: str) -> None:
        await self.worker.call("connect_network", self.id, name)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Observation:
        obs: Observation = await self.worker.call("tool", self.id, name, arguments)
        return obs

    async def close(self) -> None:
        """Idempotent; a sandbox on a dead node is gone already (reaped when it returns)."""
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(SandboxLost):
                await self.worker.call("close", self.id)
        finally:  # the slot frees once the container is gone
            self.fleet.release(self.worker)


class RemoteTool:
    """A task tool that runs on the node of the sandbox it is called with."""

    def __init__(self, tool: Tool) -> None:
        self.name, self.description, self.parameters = tool.name, tool.description, tool.parameters

    async def __call__(self, sandbox: Sandbox, /, **arguments: Any) -> Observation:
        if not isinstance(sandbox, RaySandbox):
            raise SandboxError(f"tool {self.name}: a remote tool needs a sandbox on a Ray node")
        return await sandbox.call_tool(self.name, arguments)

    async def close(self, *, keep_processes: bool = False) -> None:
        return None  # the node closes the tool with its sandbox


class RemoteTaskEnv:
    """A task's EpisodeEnv whose sandboxes live on the fleet's nodes."""

    def __init__(self, task: Task, fleet: SandboxFleet, run_id: str) -> None:
        self.task, self.fleet, self.run_id = task, fleet, run_id
        self._schemas = [RemoteTool(t) for t in build_tools(task).values()]
        self._image: str | None = None

    @property
    def provider_name(self) -> str:
        return "docker"

    @property
    def can_snapshot(self) -> bool:
        return True  # the nodes' Docker commits

    def tools(self) -> dict[str, Tool]:
        return {t.name: t for t in self._schemas}

    async def image(self) -> str:
        if self._image is None:
            raise SandboxError("no sandbox was started yet: its node resolves the image")
        return self._image

    async def _held(self, worker: _Worker, method: str, *args: Any) -> RaySandbox:
        """Start a sandbox on `worker`, in a slot already taken there."""
        try:
            info: SandboxInfo = await worker.call(method, *args)
        except BaseException:
            self.fleet.release(worker)
            raise
        self._image = info.image
        return RaySandbox(worker, info, self.fleet)

    async def init(self, instance: Instance, name: str) -> Sandbox:
        worker = await self.fleet.acquire()
        return await self._held(worker, "init", self.task, instance, name)

    async def restore(self, instance: Instance, snapshot_id: str, name: str) -> Sandbox:
        """On the node that holds the snapshot, once it has room (branch credit restores
        many at once: a node's capacity holds for them too)."""
        worker = await self.fleet.acquire(on=self.fleet.snapshots.get(snapshot_id))
        return await self._held(worker, "restore", self.task, instance, snapshot_id, name)

    async def opening(self, sandbox: Sandbox, instance: Instance) -> Opening | None:
        if self.task.format == "openenv":
            raise ConfigError(
                f"{self.task.spec.name}: OpenEnv environments run on this machine's Docker "
                "engine, not on the cluster's nodes (not yet)",
                fix="train it without `cluster:` in the train config",
            )
        return None

    async def evaluate(self, sandbox: Sandbox, instance: Instance) -> Grade:
        if not isinstance(sandbox, RaySandbox):
            raise SandboxError("RemoteTaskEnv grades only the sandboxes it started")
        grade: Grade = await sandbox.worker.call("evaluate", sandbox.id, instance)
        return grade

    async def snapshots_named(self, name: str) -> list[str]:
        """[]: a node's snapshots are found through the fleet's map, which a killed driver
        lost; what such a commit left there, `agentrl gc --snapshots` on the node removes."""
        return []

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        worker = self.fleet.snapshots.get(snapshot_id)
        if worker is None or worker.dead:
            return 0
        size: int = await worker.call("snapshot_bytes", snapshot_id)
        return size

    async def remove_snapshot(self, snapshot_id: str) -> int:
        worker = self.fleet.snapshots.pop(snapshot_id, None)
        if worker is None or worker.dead:
            return 0  # `agentrl gc --snapshots` on that node reclaims it
        freed: int = await worker.call("remove_snapshot", snapshot_id)
        return freed
