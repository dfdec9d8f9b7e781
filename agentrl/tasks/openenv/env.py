"""An OpenEnv environment's episodes: its server in the sandbox, its actions as tools, its
steps' rewards as the grade.

INIT starts the sandbox from the environment's image, starts the image's own command (its
server, as the image runs it when published), waits for `/health`, reads `/schema`,
opens a WebSocket session through the relay (`agentrl.tasks.openenv.session`) and resets
the environment with the instance's fields. The reset observation opens the chat
(`Opening`). The tools are the environment's actions: an MCP environment's tools as it
lists them (`tools/list`), each called as a `call_tool` step; otherwise one tool whose
arguments are the action's schema. Every step's reward is its turn's reward; `done` ends
the episode (finished). EVAL runs nothing: the grade is the rewards the server gave, as it
gave them, recorded on this machine as they came (`EnvironmentGrader`).

What is whose failure: the server not starting, not answering, or refusing a session at
INIT is infrastructure (sandbox_error). A step the server refuses or raises on
(VALIDATION_ERROR, EXECUTION_ERROR) is the agent's failed call: an error observation. The
server going away during the agent's step is the agent's doing (its action is the only
thing that ran there): SandboxBroken, graded on the rewards before it. The environment's
state lives in its server's memory, which a container snapshot does not hold: these
sandboxes take no snapshots (no replay points, no branches).
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.errors import ConfigError, SandboxBroken, SandboxError, one_line
from agentrl.sandbox.base import ExecRequest, Sandbox, SandboxProvider
from agentrl.tasks.env import Opening, TaskEnv, build_tools
from agentrl.tasks.evidence import Evidence, Grade, truncate
from agentrl.tasks.openenv.image import build_env_image
from agentrl.tasks.openenv.load import environment_folder, manifest, server_port
from agentrl.tasks.openenv.session import AGENT_ERRORS, RELAY, EnvError, EnvSession, SessionLost
from agentrl.tasks.spec import EnvironmentGrader, Instance, Task
from agentrl.tools.base import Observation, Tool

START_TIMEOUT_S = 180.0
"""Seconds the server has to answer /health after its command starts."""
SERVER_LOG = "/tmp/agentrl-openenv-server.log"
OBSERVATION_CHARS = 16_000
PROBE = r"""
import json, sys, time, urllib.request
port, wait, log = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + wait
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=5).read()
        break
    except Exception as e:
        if time.monotonic() > deadline:
            try:
                tail = open(log, errors="replace").read()[-1500:]
            except OSError:
                tail = ""
            print(json.dumps({"error": f"{type(e).__name__}: {e}", "log": tail}))
            sys.exit(0)
        time.sleep(0.25)
schema = json.loads(urllib.request.urlopen(base + "/schema", timeout=30).read())
print(json.dumps({"schema": schema}))
"""
"""Run by the image's python3: waits for the server, then prints its schemas (or why not)."""


@dataclass
class Live:
    """One episode's environment: its session, its tools' specs, what its steps gave."""

    session: EnvSession
    mcp: bool
    specs: list[dict[str, Any]]
    first: dict[str, Any]
    rewards: list[float] = field(default_factory=list)
    steps: int = 0
    done: bool = False
    lost: str | None = None

    async def act(self, action: dict[str, Any], tool: str) -> Observation:
        """One step; the observation as the agent sees it."""
        try:
            reply = await self.session.step(action)
        except EnvError as e:
            if e.code in AGENT_ERRORS:
                return Observation(text=f"error: {tool}: {e.message}", error=True)
            raise SandboxError(
                f"the environment's server answered a step with {e}",
                fix="look at the environment's server (its log is /tmp/agentrl-openenv-"
                "server.log in the sandbox)",
            ) from e
        except SessionLost as e:
            self.lost = str(e)
            raise SandboxBroken(
                f"the environment's server went away during the agent's step ({tool}): {e}",
                fix="none: the agent's action ended it",
            ) from e
        reward = reply.get("reward")
        if isinstance(reward, int | float) and not isinstance(reward, bool):
            if not math.isfinite(reward):  # never a reward: the environment is broken
                raise SandboxError(
                    f"the environment's server gave the step a reward of {reward}",
                    fix="fix the environment's reward: a finite number, or none",
                )
            self.rewards.append(float(reward))
        else:
            reward = None
        self.steps += 1
        self.done = bool(reply.get("done"))
        observation = reply.get("observation")
        data = observation if isinstance(observation, dict) else {}
        text, failed = _mcp_text(data) if self.mcp else (_text(data), False)
        exit_code = data.get("exit_code")
        return Observation(
            text=_clip(text),
            error=failed,
            done=self.done,
            reward=reward,
            exit_code=exit_code if isinstance(exit_code, int) else None,
        )


class EnvTool:
    """One of the environment's actions, as a tool of the episode whose sandbox it runs in."""

    def __init__(
        self, env: OpenEnvTaskEnv, spec: dict[str, Any], mcp: bool, sandbox_id: str
    ) -> None:
        self._env, self._mcp, self._sandbox_id = env, mcp, sandbox_id
        self.name: str = spec["name"]
        self.description: str = spec["description"]
        self.parameters: dict[str, Any] = spec["parameters"]

    async def __call__(self, sandbox: Sandbox, /, **arguments: Any) -> Observation:
        live = self._env.live(sandbox)
        if self._mcp:
            action = {"type": "call_tool", "tool_name": self.name, "arguments": arguments}
        else:
            action = dict(arguments)
        return await live.act(action, self.name)

    async def close(self, *, keep_processes: bool = False) -> None:
        """EVAL's close (keep_processes) leaves the session to the grade; the episode's
        last close forgets it (an episode that never reached EVAL)."""
        if not keep_processes:
            self._env.forget(self._sandbox_id)


class OpenEnvTaskEnv(TaskEnv):
    """INIT starts the environment's server and session; EVAL grades its steps' rewards."""

    def __init__(self, task: Task, provider: SandboxProvider, run_id: str) -> None:
        super().__init__(task, provider, run_id)
        self._live: dict[str, Live] = {}
        self._command: list[str] | None = None
        self._workdir = "/"

    @property
    def can_snapshot(self) -> bool:
        return False  # the environment's state is its server's memory

    async def resolve_image(self) -> str:
        if not self.provider.capabilities.images:
            raise ConfigError(
                f"{self.task.path}: an OpenEnv environment runs in its own image, and the "
                f"{self.provider_name} provider starts none",
                fix="use the docker provider",
            )
        folder = environment_folder(self.task)
        tag = await asyncio.to_thread(build_env_image, folder, manifest(folder).name)
        self._command, self._workdir = await asyncio.to_thread(_server_command, tag)
        return tag

    def live(self, sandbox: Sandbox) -> Live:
        live = self._live.get(sandbox.id)
        if live is None:
            raise SandboxError(f"sandbox {sandbox.id[:12]} has no environment session")
        return live

    async def init(self, instance: Instance, name: str) -> Sandbox:
        sandbox = await self.provider.start(await self.spec(instance, name))
        try:
            self._live[sandbox.id] = await self._open(sandbox, instance)
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    async def _open(self, sandbox: Sandbox, instance: Instance) -> Live:
        assert self._command is not None  # image() ran first (spec() awaits it)
        port, timeout = server_port(self.task), self.task.spec.limits.tool_timeout
        script = f"cd {shlex.quote(self._workdir)} && exec {shlex.join(self._command)}"
        start = f"setsid sh -c {shlex.quote(script)} > {SERVER_LOG} 2>&1 < /dev/null &"
        started = await sandbox.exec(ExecRequest(command=["sh", "-c", start], timeout=30))
        if started.exit_code != 0:
            raise SandboxError(f"the environment's server did not start: {started.output[-300:]}")
        probe = await sandbox.exec(
            ExecRequest(
                command=["python3", "-c", PROBE, str(port), str(START_TIMEOUT_S), SERVER_LOG],
                timeout=START_TIMEOUT_S + 60,
            )
        )
        try:
            found = json.loads(probe.output.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            found = {"error": f"the probe exited {probe.exit_code}", "log": probe.output}
        if "schema" not in found:
            raise SandboxError(
                f"the environment's server did not answer on port {port} within "
                f"{START_TIMEOUT_S:g} s: {found.get('error')}; its log ends: "
                f"{one_line(str(found.get('log', '')))[-400:]}",
                fix="run the image by hand (docker run) and read the server's log",
            )
        action = found["schema"].get("action") or {}
        mcp = _is_mcp(action)
        session = EnvSession(
            await sandbox.shell(["python3", "-c", RELAY, str(port)]), timeout=timeout
        )
        try:
            await session.open()
            first = await session.reset(**instance.fields)
            specs = (
                [_mcp_spec(t) for t in await session.list_tools()]
                if mcp
                else [_action_spec(action)]
            )
        except (SessionLost, EnvError) as e:
            await session.close()
            raise SandboxError(f"the environment's session did not open: {e}") from e
        return Live(session=session, mcp=mcp, specs=specs, first=first)

    async def opening(self, sandbox: Sandbox, instance: Instance) -> Opening | None:
        live = self.live(sandbox)
        tools: dict[str, Tool] = {
            s["name"]: EnvTool(self, s, live.mcp, sandbox.id) for s in live.specs
        }
        for name, tool in build_tools(self.task).items():  # finish: the agent may end it
            tools.setdefault(name, tool)
        observation = live.first.get("observation")
        text = _text(observation if isinstance(observation, dict) else {})
        return Opening(text=_clip(text) or "(empty)", tools=tools)

    async def evaluate(self, sandbox: Sandbox, instance: Instance) -> Grade:
        started = time.monotonic()
        live = self._live.pop(sandbox.id, None)
        if live is None:
            raise SandboxError(f"sandbox {sandbox.id[:12]} has no environment session")
        await live.session.close()
        grader = self.task.spec.grader
        how = grader.reward if isinstance(grader, EnvironmentGrader) else "sum"
        reward = sum(live.rewards) if how == "sum" else (live.rewards or [0.0])[-1]
        notes = [
            f"{live.steps} step(s); rewards given: {live.rewards or 'none'}; "
            f"the episode's reward is their {how}; done: {live.done}"
        ]
        if live.lost:
            notes.append(f"the server went away during a step: {live.lost}")
        evidence = Evidence(grader="openenv", notes=notes)
        components = {"steps": live.steps, "step_rewards": live.rewards, "done": live.done}
        return Grade(
            reward=reward,
            components=components,
            evidence=evidence,
            seconds=time.monotonic() - started,
        )

    @property
    def has_reference(self) -> bool:
        return False

    async def run_oracle(self, sandbox: Sandbox, instance: Instance) -> str:
        raise ConfigError(
            f"{self.task.path}: an OpenEnv environment has no reference solution",
            fix="`agentrl check` starts it, resets it and grades a no-op; `agentrl run` plays it",
        )

    def forget(self, sandbox_id: str) -> None:
        self._live.pop(sandbox_id, None)


def _server_command(tag: str) -> tuple[list[str], str]:
    """The image's own command (entrypoint + cmd) and working directory."""
    from agentrl.sandbox.images import docker_client

    client = docker_client()
    try:
        config = client.images.get(tag).attrs.get("Config") or {}
    finally:
        client.close()
    command = list(config.get("Entrypoint") or []) + list(config.get("Cmd") or [])
    if not command:
        raise ConfigError(
            f"image {tag} has no command (CMD) to start the environment's server",
            fix="the environment's Dockerfile must end with the CMD that serves it",
        )
    return command, config.get("WorkingDir") or "/"


def _is_mcp(action_schema: dict[str, Any]) -> bool:
    """An MCP environment's actions are `call_tool` / `list_tools` (its action schema is
    `CallToolAction`'s)."""
    kind = (action_schema.get("properties") or {}).get("type") or {}
    return kind.get("const") == "call_tool" or kind.get("default") == "call_tool"


def _mcp_spec(tool: dict[str, Any]) -> dict[str, Any]:
    schema = tool.get("inputSchema") or tool.get("input_schema") or {"type": "object"}
    return {
        "name": str(tool["name"]),
        "description": (tool.get("description") or "").strip() or str(tool["name"]),
        "parameters": _clean(schema),
    }


def _action_spec(action: dict[str, Any]) -> dict[str, Any]:
    """The one tool of an environment whose action is its own model: named after it
    (`ReasoningGymAction` -> `reasoning_gym`), its fields (less `metadata`) as arguments."""
    title = str(action.get("title") or "act").removesuffix("Action") or "act"
    name = "".join(f"_{c.lower()}" if c.isupper() else c for c in title).lstrip("_")
    schema = {**action, "properties": dict(action.get("properties") or {})}
    schema["properties"].pop("metadata", None)
    schema["required"] = [r for r in schema.get("required", []) if r != "metadata"]
    description = (schema.pop("description", None) or "").strip()
    return {
        "name": name,
        "description": description or f"one step: {title}",
        "parameters": _clean(schema),
    }


def _clean(schema: Any) -> Any:
    """A JSON schema as chat templates show it: no titles."""
    if isinstance(schema, dict):
        return {k: _clean(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_clean(v) for v in schema]
    return schema


def _mcp_text(data: dict[str, Any]) -> tuple[str, bool]:
    """A `call_tool` observation: the tool's result (its text content where it has one),
    or its error."""
    error = data.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else error
        return f"error: {message}", True
    result = data.get("result")
    if isinstance(result, dict):
        if result.get("is_error") or result.get("isError"):
            return f"error: {_content(result)}", True
        return _content(result), False
    return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)), False


def _content(result: dict[str, Any]) -> str:
    texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict)]
    if texts:
        return "\n".join(texts)
    for key in ("structured_content", "structuredContent", "data"):
        if result.get(key) is not None:
            value = result[key]
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return json.dumps(result, ensure_ascii=False)


def _text(data: dict[str, Any]) -> str:
    """An observation's fields as lines (`name: value`; a multi-line text below its name);
    empty fields left out."""
    lines = []
    for key, value in data.items():
        if value is None or value == "" or value == [] or value == {}:
            continue
        if isinstance(value, str):
            lines.append(f"{key}:\n{value}" if "\n" in value else f"{key}: {value}")
        else:
            lines.append(f"{key}: {json.dumps(value, ensure_ascii=False)}")
    return "\n".join(lines)


def _clip(text: str) -> str:
    return truncate(text, OBSERVATION_CHARS)
