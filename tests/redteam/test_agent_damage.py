"""The agent's own damage is the agent's failure; the engine's is infrastructure.

An agent that stops its own sandbox during RUN (kills its keep-alive with `kill -9 -1`)
gets `sandbox_broken`: EVAL grades what it left (reward 0 here), the episode is trained
on, and its evidence says what happened. The same container stopped from outside
(`docker kill`, which a reaper or an engine shutdown does) stays `sandbox_error`, never a
reward. An engine restart cannot be done safely beside other tests; it is shown by
pointing the engine's start time at a process that started after the container.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from pathlib import Path

import pytest

from agentrl.episode import run_episode
from agentrl.errors import SandboxBroken, SandboxError
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler
from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.docker import DockerProvider, host
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.evidence import Evidence
from agentrl.tasks.load import load_task
from agentrl.trajectory import INFRA_STOP_REASONS, StopReason, Trajectory

pytestmark = [pytest.mark.docker, pytest.mark.redteam]

TASK = Path(__file__).resolve().parents[1] / "data" / "agent" / "echo_task.yaml"
KILL_ALL = '<tool_call>{"name": "bash", "arguments": {"command": "kill -9 -1"}}</tool_call>'
AFTER = '<tool_call>{"name": "bash", "arguments": {"command": "echo hello"}}</tool_call>'


def test_an_agent_that_kills_its_own_sandbox_is_graded_and_trained_on(run_id: str) -> None:
    task = load_task(TASK)
    tokenizer = load_tokenizer()

    async def go() -> Trajectory:
        env = TaskEnv(task, DockerProvider(reap_at_start=False), run_id)
        sampler = ScriptedSampler([KILL_ALL, AFTER, AFTER], tokenizer)
        return await run_episode(task, task.instances[0], 0, sampler, tokenizer, env)

    traj = asyncio.run(go())
    assert traj.stop_reason == StopReason.sandbox_broken, (traj.stop_reason, traj.error)
    assert traj.trainable and traj.stop_reason not in INFRA_STOP_REASONS
    assert traj.reward == 0.0  # graded: the file was never written
    evidence = traj._grade
    assert isinstance(evidence, Evidence) and evidence.sealed is not None
    assert "the agent stopped its sandbox" in evidence.notes[0]
    assert any("had stopped before grading" in n for n in evidence.sealed.notes)


def test_a_sandbox_stopped_from_outside_is_infrastructure(run_id: str) -> None:
    async def go() -> BaseException:
        sandbox = await DockerProvider(reap_at_start=False).start(SandboxSpec(run_id=run_id))
        try:
            subprocess.run(["docker", "kill", sandbox.id], check=True, capture_output=True)
            with pytest.raises(SandboxError) as caught:
                await sandbox.exec(ExecRequest(command="true"))
            return caught.value
        finally:
            await sandbox.close()

    error = asyncio.run(go())
    assert not isinstance(error, SandboxBroken), error


def test_after_an_engine_restart_a_stopped_sandbox_is_infrastructure(
    run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def go() -> tuple[str | None, str | None]:
        sandbox = await DockerProvider(reap_at_start=False).start(SandboxSpec(run_id=run_id))
        try:
            with contextlib.suppress(SandboxBroken):  # it may stop before the exec returns
                await sandbox.exec(ExecRequest(command="kill -9 -1; true"))
            await asyncio.sleep(0.5)
            api = sandbox._api
            seen_by_agent = host.stopped_by_agent(api, sandbox.id)
            await asyncio.sleep(1.5)  # /proc's start times are exact to a boot-time second
            later = subprocess.Popen(["sleep", "30"])  # an "engine" that started after it
            try:
                (tmp_path / "docker.pid").write_text(str(later.pid))
                real = host.engine_started
                monkeypatch.setattr(host, "engine_started", lambda: real(tmp_path / "docker.pid"))
                restarted = host.stopped_by_agent(api, sandbox.id)
            finally:
                later.kill()
            return seen_by_agent, restarted
        finally:
            await sandbox.close()

    seen_by_agent, restarted = asyncio.run(go())
    assert seen_by_agent is not None and "killed its main process" in seen_by_agent
    assert restarted is None
