"""An episode played by an external agent harness (a task's `agent:`), in place of
agentrl's own loop: RUN starts the harness pointed at a gateway session, records every
model call it makes (`Recorder`), and ends when the harness exits.

The harness runs `beside` the sandbox (on this machine, in a scratch folder, acting on
the sandbox through `$AGENTRL_EXEC_URL`) or in the `sandbox` (through the sandbox's
exec; the harness must reach the gateway on 127.0.0.1, which a local sandbox does and a
Docker sandbox, with no network, does not). Its environment names the session:
`OPENAI_BASE_URL`/`OPENAI_API_BASE`, `OPENAI_API_KEY`, `AGENTRL_MODEL`, the instance's
task text (`AGENTRL_TASK`, `AGENTRL_TASK_FILE`), `AGENTRL_AGENT_DIR`, `AGENTRL_EXEC_URL`,
`AGENTRL_HARNESSES` (the adapters shipped with agentrl, e.g. mini-swe-agent's).

How it ends, as a stop reason: the harness exits with an ok exit code -> `finished`;
agentrl refused a call (turns or context used up) -> `max_turns` / `context_limit`, and
the harness is stopped after `stop_grace`; the agent's own time ran out ->
`episode_timeout`; the sampler failed, the harness exited otherwise, or it never called
the model -> `aborted` (infrastructure: never graded, never trained on).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import string
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.errors import ConfigError
from agentrl.gateway import server
from agentrl.gateway.recorder import Recorder
from agentrl.sandbox.base import ExecRequest
from agentrl.trajectory import AgentInfo, StopReason

if TYPE_CHECKING:
    from agentrl.agent import Episode, Gate
    from agentrl.tasks.spec import AgentConfig

HARNESSES = Path(__file__).resolve().parent.parent / "harnesses"
LOG_TAIL_BYTES = 4000


def harness_name(agent: AgentConfig) -> str:
    words = shlex.split(agent.command, posix=True) or [agent.command]
    return agent.name or Path(words[0]).name


async def run_harness(episode: Episode, gate: Gate) -> None:
    """RUN for an external agent: raises what `Episode.boundary` turns into the stop
    reason (see module docstring)."""
    from agentrl.agent import EpisodeEnd

    agent = episode.task.spec.agent
    assert agent is not None and episode.sandbox is not None  # run() checks
    if agent.where == "sandbox" and episode.env.provider_name != "local":
        raise ConfigError(
            f"agent.where: sandbox needs the sandbox to reach the gateway on 127.0.0.1; a "
            f"{episode.env.provider_name} sandbox has no network",
            fix="use agent.where: beside (the harness acts on the sandbox through "
            "$AGENTRL_EXEC_URL), or the local sandbox provider",
        )
    gateway = server.shared()
    recorder = episode.recorder = Recorder(episode, gate, server.MODEL_NAME)
    sid = gateway.open(recorder)
    scratch = Path(tempfile.mkdtemp(prefix="agentrl-agent-"))
    info = AgentInfo(name=harness_name(agent), command=agent.command, where=agent.where)
    episode.agent_info = info
    try:
        env = _environment(episode, agent, gateway, sid, scratch)
        if agent.where == "beside":
            info.exit_code, log = await _beside(agent, env, scratch, recorder)
        else:
            info.exit_code, log = await _inside(episode, agent, env, recorder)
        info.log_tail = log[-LOG_TAIL_BYTES:]
    finally:
        recorder.end()
        gateway.close_session(sid)
        info.calls, info.edits, info.drift = recorder.calls, recorder.edits, recorder.drift
        info.overridden = dict(recorder.overridden)
        shutil.rmtree(scratch, ignore_errors=True)
    turns = episode.turns
    if turns and episode.snapshots.due(len(turns)) and turns[-1].snapshot_id is None:
        episode.snapshots.start(episode.sandbox, turns[-1], f"turn-{len(turns) - 1:03d}")
    if recorder.failure is not None:
        raise recorder.failure
    if recorder.stop is not None:
        raise EpisodeEnd(recorder.stop)
    last = info.log_tail.strip().splitlines()[-1:] or ["(it printed nothing)"]
    if info.exit_code not in agent.ok_exit_codes:
        episode.fail(
            StopReason.aborted,
            f"the agent harness {info.name!r} exited {info.exit_code}: {last[0][:300]}",
            "run the task's agent.command by hand to see why (or list the exit code in "
            "agent.ok_exit_codes if it means a normal end)",
        )
        return
    if recorder.calls == 0:
        episode.fail(
            StopReason.aborted,
            f"the agent harness {info.name!r} exited without calling the model: {last[0][:300]}",
            "point the harness at $OPENAI_BASE_URL with the key $OPENAI_API_KEY",
        )
        return
    raise EpisodeEnd(StopReason.finished)


def _environment(
    episode: Episode, agent: AgentConfig, gateway: server.Gateway, sid: str, scratch: Path
) -> dict[str, str]:
    task_text = episode.instance.render(episode.task.spec.prompt.instance)
    task_file = scratch / "task.txt"
    task_file.write_text(task_text, encoding="utf-8")
    base = gateway.base_url(sid)
    ours = {
        "OPENAI_BASE_URL": base,
        "OPENAI_API_BASE": base,
        "OPENAI_API_KEY": sid,
        "AGENTRL_MODEL": server.MODEL_NAME,
        "AGENTRL_TASK": task_text,
        "AGENTRL_TASK_FILE": str(task_file),
        "AGENTRL_AGENT_DIR": str(scratch),
        "AGENTRL_HARNESSES": str(HARNESSES),
        "AGENTRL_TRAJECTORY_ID": episode.trajectory_id,
    }
    if agent.where == "beside":
        ours["AGENTRL_EXEC_URL"] = f"{gateway.url}/sessions/{sid}/exec"
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
    episode: Episode, agent: AgentConfig, env: dict[str, str], recorder: Recorder
) -> tuple[int | None, str]:
    """Run the harness in the sandbox through its exec (killed when cancelled)."""
    assert episode.sandbox is not None
    limits = episode.task.spec.limits
    request = ExecRequest(command=agent.command, timeout=limits.episode_timeout * 10, env=env)
    run = asyncio.ensure_future(episode.sandbox.exec(request))
    try:
        await _until_exit_or_over(run, recorder, agent.stop_grace)
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
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
