"""The harness player: an episode played by an external agent harness (a task's
`agent:`), in place of agentrl's own loop: RUN starts the harness pointed at a gateway
session, records every model call it makes (`Recorder`, the episode's ledger), and ends
when the harness exits.

The harness runs `beside` the sandbox (on this machine, in a scratch folder, acting on
the sandbox through `$AGENTRL_EXEC_URL`) or in the `sandbox` (through the sandbox's
exec, so it must be installed in the image). A Docker sandbox has no network: the
gateway's Unix socket is mounted into it read-only and a small forwarder
(`agentrl/harnesses/forward.py`, on the sandbox's python3) serves it on
127.0.0.1:FORWARD_PORT inside. Its environment names the session:
`OPENAI_BASE_URL`/`OPENAI_API_BASE`, `OPENAI_API_KEY`, `AGENTRL_MODEL`, the instance's
task text (`AGENTRL_TASK`, `AGENTRL_TASK_FILE`), `AGENTRL_AGENT_DIR`, `AGENTRL_EXEC_URL`,
`AGENTRL_HARNESSES` (the adapters shipped with agentrl, e.g. mini-swe-agent's) and
`AGENTRL_TASK_DIR` (the task file's folder: a harness's config beside the task).

How it ends, as a stop reason: the harness exits with an ok exit code -> `finished`;
agentrl refused a call (turns or context used up: HTTP 404, or OpenAI's
context_length_exceeded 400) -> `max_turns` / `context_limit`, and the harness is
stopped after `stop_grace`; the agent's own time ran out ->
`episode_timeout`; a call failed on agentrl's side (the sampler, the sandbox's exec, a
bug: even if the harness then exits 0), the harness exited otherwise, or it never called
the model -> `aborted` (`sandbox_error` when the sandbox failed; infrastructure: never
graded, never trained on).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import string
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from agentrl import scratch as scratch_dirs
from agentrl.errors import ConfigError, EpisodeAborted
from agentrl.gateway import server
from agentrl.gateway.recorder import Recorder
from agentrl.play import EpisodeEnd, Play
from agentrl.sandbox.base import ExecRequest, Metered
from agentrl.trajectory import AgentInfo, StopReason

if TYPE_CHECKING:
    from agentrl.tasks.spec import AgentConfig

HARNESSES = Path(__file__).resolve().parent.parent / "harnesses"
FORWARD_PORT = 18080
"""Where a harness inside a Docker sandbox finds the gateway (127.0.0.1, in the sandbox)."""
LOG_TAIL_BYTES = 4000


def harness_name(agent: AgentConfig) -> str:
    words = shlex.split(agent.command, posix=True) or [agent.command]
    return agent.name or Path(words[0]).name


class HarnessPlayer:
    """Plays RUN with the task's external harness (`agent:`), through a gateway session."""

    task_tools = False

    async def play(self, ctx: Play) -> NoReturn:
        raise EpisodeEnd(await _play(ctx))


async def _play(ctx: Play) -> StopReason:
    """The stop reason the harness ended with; raises what failed it (see the module
    docstring): `EpisodeAborted` for the harness's own failures."""
    agent = ctx.task.spec.agent
    assert agent is not None  # the factory plays a task with this player only then
    if agent.where == "sandbox" and ctx.sandbox.spec.node is not None:
        raise ConfigError(
            f"agent.where: sandbox on cluster node {ctx.sandbox.spec.node}: the harness "
            "there cannot reach this machine's gateway",
            fix="use agent.where: beside (the harness runs here and acts on the sandbox "
            "through $AGENTRL_EXEC_URL), or run the sandboxes on this machine",
        )
    gateway = server.shared()
    recorder = Recorder(ctx, server.MODEL_NAME)
    ctx.ledger = recorder
    sid = gateway.open(recorder)
    scratch = scratch_dirs.make("agent")
    info = ctx.agent = AgentInfo(name=harness_name(agent), command=agent.command, where=agent.where)
    try:
        if agent.where == "beside":
            env = await _environment(ctx, agent, gateway.url, sid, str(scratch))
            info.exit_code, log = await _beside(agent, env, scratch, recorder)
        else:
            # A sandbox with no network has the gateway's socket mounted (`mounts`).
            socket = server.SANDBOX_SOCKET_DIR in ctx.sandbox.spec.mounts.values()
            url = f"http://127.0.0.1:{FORWARD_PORT}" if socket else gateway.url
            inside = f"/tmp/agentrl-agent-{uuid.uuid4().hex[:12]}"
            env = await _environment(ctx, agent, url, sid, inside)
            info.exit_code, log = await _inside(ctx, agent, env, recorder, socket, inside)
        info.log_tail = log[-LOG_TAIL_BYTES:]
    finally:
        recorder.close()
        gateway.close_session(sid)
        info.calls, info.edits, info.drift = recorder.calls, recorder.edits, recorder.drift
        info.overridden = dict(recorder.overridden)
        shutil.rmtree(scratch, ignore_errors=True)
    ctx.snapshot_last_turn()
    if recorder.failure is not None:
        raise recorder.failure
    if recorder.stop is not None:
        return recorder.stop
    last = info.log_tail.strip().splitlines()[-1:] or ["(it printed nothing)"]
    if info.exit_code not in agent.ok_exit_codes:
        raise EpisodeAborted(
            f"the agent harness {info.name!r} exited {info.exit_code}: {last[0][:300]}",
            fix="run the task's agent.command by hand to see why (or list the exit code in "
            "agent.ok_exit_codes if it means a normal end)",
        )
    if recorder.calls == 0:
        raise EpisodeAborted(
            f"the agent harness {info.name!r} exited without calling the model: {last[0][:300]}",
            fix="point the harness at $OPENAI_BASE_URL with the key $OPENAI_API_KEY",
        )
    return StopReason.finished


def mounts(agent: AgentConfig | None) -> dict[str, str]:
    """What a sandbox of a task played by `agent` mounts: the gateway's socket folder,
    for a harness inside the sandbox (the sandbox has no network to reach it by)."""
    if agent is None or agent.where != "sandbox":
        return {}
    return {server.shared().socket_dir(): server.SANDBOX_SOCKET_DIR}


async def _environment(
    ctx: Play, agent: AgentConfig, url: str, sid: str, scratch: str
) -> dict[str, str]:
    """The harness's environment: the session at `url`, its scratch folder `scratch` (on
    this machine beside the sandbox, in the sandbox otherwise) holding the task text."""
    task_text = ctx.instance.render(ctx.task.spec.prompt.instance)
    task_file = f"{scratch}/task.txt"
    if agent.where == "beside":
        Path(task_file).write_text(task_text, encoding="utf-8")
    else:
        await ctx.sandbox.write_file(task_file, task_text.encode())
    base = f"{url}/sessions/{sid}/v1"
    ours = {
        "OPENAI_BASE_URL": base,
        "OPENAI_API_BASE": base,
        "OPENAI_API_KEY": sid,
        "AGENTRL_MODEL": server.MODEL_NAME,
        "AGENTRL_TASK": task_text,
        "AGENTRL_TASK_FILE": task_file,
        "AGENTRL_AGENT_DIR": scratch,
        "AGENTRL_TRAJECTORY_ID": ctx.trajectory_id,
    }
    if agent.where == "beside":
        ours["AGENTRL_EXEC_URL"] = f"{url}/sessions/{sid}/exec"
        ours["AGENTRL_HARNESSES"] = str(HARNESSES)
        ours["AGENTRL_TASK_DIR"] = str(Path(ctx.task.base_dir).resolve())
    # The gateway is on this machine (or this sandbox): never through a proxy.
    local = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1,localhost"]))
    ours["NO_PROXY"] = ours["no_proxy"] = local
    known = {**os.environ, **ours}
    extra = {k: string.Template(v).safe_substitute(known) for k, v in agent.env.items()}
    return {**ours, **extra}


async def _beside(
    agent: AgentConfig, env: dict[str, str], scratch: Path, recorder: Recorder
) -> tuple[int | None, str]:
    """Run the harness on this machine, in its own process group; (exit code, output)."""
    log_path = scratch / "harness.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            agent.command,
            cwd=scratch,
            env={**os.environ, **env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own group: stopping it stops all it started
        )
        try:
            await _until_exit_or_over(proc.wait(), recorder, agent.stop_grace)
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.shield(proc.wait())
    code = proc.returncode
    output = log_path.read_bytes()[-LOG_TAIL_BYTES:].decode(errors="replace")
    return (None if code is None or code < 0 else code), output


async def _inside(
    ctx: Play,
    agent: AgentConfig,
    env: dict[str, str],
    recorder: Recorder,
    forwarded: bool,
    scratch: str,
) -> tuple[int | None, str]:
    """Run the harness in the sandbox through its exec; stopped with the sandbox's
    processes when its episode is over. `forwarded`: behind the socket forwarder."""
    sandbox = ctx.sandbox
    command = agent.command
    if forwarded:
        forward = f"{scratch}/forward.py"
        await sandbox.write_file(forward, (HARNESSES / "forward.py").read_bytes())
        socket = f"{server.SANDBOX_SOCKET_DIR}/{server.SOCKET_NAME}"
        ready = f"{scratch}/forward.ready"
        env = {**env, "AGENTRL_AGENT_COMMAND": command}
        command = (
            f"python3 {forward} 127.0.0.1 {FORWARD_PORT} {socket} {ready} & "
            f"for _ in $(seq 200); do [ -e {ready} ] && break; sleep 0.05; done; "
            f'[ -e {ready} ] || {{ echo "agentrl: the gateway forwarder did not start '
            '(is python3 in the image?)"; exit 127; }; '
            'bash -c "$AGENTRL_AGENT_COMMAND"; code=$?; kill %1 2>/dev/null; exit $code'
        )
    limits = ctx.limits
    request = ExecRequest(command=command, timeout=limits.episode_timeout * 10, env=env)
    run = asyncio.ensure_future(sandbox.exec(request))
    try:
        await _until_exit_or_over(run, recorder, agent.stop_grace)
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        if isinstance(sandbox, Metered):  # what the harness left running, stopped
            with contextlib.suppress(Exception):
                await sandbox.stop_processes()
    if run.cancelled():
        return None, ""
    result = run.result()
    return result.exit_code, result.output


async def _until_exit_or_over(exited: Awaitable[object], recorder: Recorder, grace: float) -> None:
    """Wait for the harness to exit; once its episode is over, give it `grace` seconds."""
    done = asyncio.ensure_future(exited)
    over = asyncio.ensure_future(recorder.over.wait())
    try:
        await asyncio.wait({done, over}, return_when=asyncio.FIRST_COMPLETED)
        if not done.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(done), grace)
    finally:
        over.cancel()
        if not done.done():
            done.cancel()
