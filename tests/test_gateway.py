"""The gateway and its recorder, driven by a real harness on the official `openai` SDK
(tool calls, streaming, a client that edits history), in a real Docker sandbox, with the
real SmolLM2 tokenizer and chat template.

Token exactness is checked against the sampler itself: a recording wrapper keeps every
prompt the sampler was given and every id it returned, and each must sit in the
trajectory's ledger exactly where the turn records say (0 unexplained mismatches).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from agentrl.episode import make_env, run_episode
from agentrl.gateway import server
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Task
from agentrl.trajectory import StopReason, Trajectory, TrajectoryStore

pytestmark = [pytest.mark.docker, pytest.mark.model]
DATA = Path(__file__).parent / "data" / "gateway"
RUN_ID = f"test-gateway-{uuid.uuid4().hex[:8]}"

WRITE = (
    "I will write the file.\n<tool_call>"
    '{"name": "bash", "arguments": {"command": "printf hello > /workspace/greeting.txt"}}'
    "</tool_call>"
)
LOOK = (
    '<tool_call>{"name": "bash", "arguments": {"command": "cat /workspace/greeting.txt"}}'
    "</tool_call>"
)


class Recording:
    """A sampler that keeps what it was given and what it gave back."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[list[int], Completion]] = []

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        completion = await self.inner.generate(prompt_ids, params, session_id)
        self.calls.append((list(prompt_ids), completion))
        return completion

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHON", sys.executable)
    monkeypatch.setenv("AGENTRL_TEST_DATA", str(DATA))

    def flags(*args: str) -> None:
        monkeypatch.setenv("CLIENT_FLAGS", " ".join(args))

    flags()
    return flags


def play(task: Task, tokenizer, sampler, *, close: bool = False) -> Trajectory:
    async def main() -> Trajectory:
        env = make_env(task, DockerProvider(), RUN_ID)  # its sandboxes mount the gateway
        try:
            return await run_episode(task, task.instances[0], 0, sampler, tokenizer, env)
        finally:
            if close:  # on the loop its connections were made on
                await sampler.close()

    return asyncio.run(main())


def unexplained(traj: Trajectory, calls: list[tuple[list[int], Completion]]) -> list[str]:
    """Every way the ledger differs from what the sampler saw and produced."""
    ledgers, problems = traj.ledgers(), []
    if len(calls) != len(traj.turns):
        problems.append(f"{len(calls)} sampler calls, {len(traj.turns)} turns")
    for k, (turn, (prompt, completion)) in enumerate(zip(traj.turns, calls, strict=False)):
        ledger = ledgers[turn.segment]
        start, end = turn.span
        if ledger.prompt_ids + ledger.response_ids[:start] != prompt:
            problems.append(f"turn {k}: the ledger's prompt is not what the sampler was given")
        if ledger.response_ids[start:end] != completion.token_ids:
            problems.append(f"turn {k}: the ledger's sampled ids are not the sampler's")
    for s, ledger in enumerate(ledgers):
        spans = {i for t in traj.turns if t.segment == s for i in range(*t.span)}
        if {i for i, m in enumerate(ledger.loss_mask) if m} != spans:
            problems.append(f"segment {s}: mask 1 is not exactly the sampled spans")
    return problems


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_openai_sdk_harness_with_tool_calls_is_recorded_token_exactly(
    harness, tokenizer, stream: bool
) -> None:
    harness("--stream") if stream else harness()
    task = load_task(DATA / "task.yaml")
    sampler = Recording(ScriptedSampler([WRITE, LOOK, "The file is written."], tokenizer))
    traj = play(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.finished, traj.error
    assert traj.reward == 1.0 and traj.trainable
    assert traj.agent is not None and traj.agent.exit_code == 0
    assert (traj.agent.calls, traj.agent.edits, len(traj.segments)) == (3, 0, 0)
    assert unexplained(traj, sampler.calls) == []
    # Each later prompt extends the one before by the ids sampled, then the tool result.
    (p0, c0), (p1, _), (p2, _) = sampler.calls
    assert p1[: len(p0) + len(c0.token_ids)] == p0 + c0.token_ids
    assert p2[: len(p1)] == p1
    # The harness echoed the replies back as OpenAI tool calls; rendered as sent they
    # tokenize otherwise (SmolLM2's template drops tool_calls): drift kept out.
    assert traj.agent.drift == 2
    first, second, last = traj.turns
    assert first.tool_call is not None and first.tool_call.name == "bash"
    assert first.exit_code == 0 and first.tool_seconds > 0
    assert "hello" in second.observation and last.tool_call is None
    assert traj.agent.overridden == ({} if stream else {"temperature": 3})


def test_a_harness_that_edits_history_gets_segments_not_corrupted_masks(harness, tokenizer) -> None:
    harness("--edit")
    task = load_task(DATA / "task.yaml")
    sampler = Recording(ScriptedSampler([WRITE, LOOK, "Done."], tokenizer))
    traj = play(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.finished and traj.reward == 1.0
    assert traj.agent is not None and traj.agent.edits == 1
    assert [s.reason for s in traj.segments] == ["client"]
    assert unexplained(traj, sampler.calls) == []
    # The new segment's prompt renders the edited message; the old one kept its own.
    edited = tokenizer.decode(traj.segments[0].prompt_ids)
    assert "(Task, restated.)" in edited
    assert "(Task, restated.)" not in tokenizer.decode(traj.prompt_ids)
    assert [t.segment for t in traj.turns] == [0, 1, 1]
    assert traj.turns[0].observation == "exit code 0\n"  # found after the edit too
    assert sum(traj.segments[0].loss_mask) == sum(len(c.token_ids) for _, c in sampler.calls[1:])


class SlowFirst(Recording):
    """Its first reply takes 4 s: longer than the harness waits before it retries."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        if not self.calls and not getattr(self, "waited", False):
            self.waited = True
            await asyncio.sleep(4)
        return await super().generate(prompt_ids, params, session_id)


def test_a_call_the_harness_gave_up_on_and_retried_is_recorded_once(harness, tokenizer) -> None:
    harness("--timeout", "1.5")
    task = load_task(DATA / "task.yaml")
    sampler = SlowFirst(ScriptedSampler([WRITE, "Done."], tokenizer))
    traj = play(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.finished and traj.reward == 1.0, traj.error
    assert traj.agent is not None and (traj.agent.calls, traj.agent.edits) == (2, 0)
    assert sampler.waited and len(sampler.calls) == 2  # the first try was cancelled:
    assert traj.turns[0].gen_seconds < 1.0  # the reply recorded is the retry's
    assert unexplained(traj, sampler.calls) == []


def test_refused_turns_stop_the_harness_and_end_max_turns(harness, tokenizer) -> None:
    harness("--calls", "50")
    task = load_task(DATA / "task.yaml")
    sampler = Recording(ScriptedSampler([LOOK], tokenizer))  # never stops calling bash
    traj = play(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.max_turns and traj.trainable
    assert traj.agent is not None and traj.agent.calls == task.spec.limits.max_turns
    assert "NotFoundError" in traj.agent.log_tail  # the SDK does not retry a 404
    assert unexplained(traj, sampler.calls) == []


def test_a_harness_that_fails_before_calling_is_infrastructure(
    monkeypatch: pytest.MonkeyPatch, tokenizer
) -> None:
    task = load_task(DATA / "task.yaml")
    agent = task.spec.agent.model_copy(update={"command": "echo 'no module named foo' >&2; exit 3"})
    broken = task.model_copy(update={"spec": task.spec.model_copy(update={"agent": agent})})
    traj = play(broken, tokenizer, ScriptedSampler([WRITE], tokenizer))
    assert traj.stop_reason == StopReason.aborted and not traj.trainable
    assert traj.reward is None and traj.num_sampled == 0
    assert "exited 3: no module named foo" in (traj.error or "") and traj.fix


def test_sessions_are_private_and_errors_have_openai_shape() -> None:
    gateway = server.shared()

    def post(path: str, body: object, key: str | None = None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(gateway.url + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    status, body = post("/sessions/not-a-session/v1/chat/completions", chat)
    assert status == 401 and "unknown or finished session" in body["error"]["message"]
    assert body["error"]["type"] == "authentication_error"
    status, body = post("/v1/chat/completions", chat)
    assert status == 401 and "no session" in body["error"]["message"]
    status, body = post("/v1/chat/completions", chat, key="guess")
    assert status == 401
    with urllib.request.urlopen(gateway.url + "/v1/models", timeout=10) as answer:
        assert json.load(answer)["data"][0]["id"] == server.MODEL_NAME


def test_a_harness_inside_a_networkless_docker_sandbox_reaches_its_session(tokenizer) -> None:
    """Through the gateway's Unix socket, mounted read-only, and the forwarder."""
    task = load_task(DATA / "task_inside.yaml")
    sampler = Recording(ScriptedSampler([WRITE, "Written."], tokenizer))
    traj = play(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.finished, (traj.error, traj.agent)
    assert traj.reward == 1.0 and traj.agent is not None
    assert (traj.agent.where, traj.agent.calls, traj.agent.exit_code) == ("sandbox", 2, 0)
    assert "inside harness done" in traj.agent.log_tail
    assert unexplained(traj, sampler.calls) == []


def test_agentrl_run_plays_any_task_with_the_agent_named_by_flag(harness, tmp_path: Path) -> None:
    """`--agent FILE`: the README's echo-file task (its own loop is agentrl's), played by
    the openai-SDK harness, with snapshots after each turn; replay cannot act its turns
    again (they were the harness's) and says so; a bad agent file is one line and a fix."""
    script = tmp_path / "script.yaml"
    script.write_text(json.dumps([WRITE, "Done."]))
    task = Path(__file__).parent.parent / "examples" / "tasks" / "echo-file" / "task.yaml"
    out = tmp_path / "run"
    # The script writes greeting.txt: instance farewell fails, so its snapshots are kept.
    command = [sys.executable, "-m", "agentrl.cli", "run", str(task), "--instances", "farewell"]
    command += ["--policy", f"scripted:{script}", "--agent", str(DATA / "agent.yaml")]
    done = subprocess.run(
        [*command, "--snapshots", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (traj,) = list(TrajectoryStore(out / "trajectories.jsonl"))
    assert traj.agent is not None and traj.agent.name == "openai-client"
    assert traj.agent.calls == 2 and traj.reward == 0.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agent"] == {"episodes": 1, "calls": 2, "edits": 0, "drift": 1}
    snapshots = [traj.env.init_snapshot, *(t.snapshot_id for t in traj.turns)]
    try:
        assert all(snapshots) and len(snapshots) == 3
        replayed = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "replay", str(out), "farewell_0"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        for snapshot in filter(None, snapshots):
            asyncio.run(DockerProvider().remove_snapshot(snapshot))
    assert replayed.returncode == 1 and "Traceback" not in replayed.stderr
    assert "played by the external agent 'openai-client'" in replayed.stderr
    assert "--shell" in replayed.stderr  # the fix
    bad = tmp_path / "bad.yaml"
    bad.write_text("command: x\nwhere: moon\n")
    done = subprocess.run(
        [*command[:-2], "--agent", str(bad), "--out", str(tmp_path / "bad")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "bad.yaml:2" in done.stderr and "where" in done.stderr, done.stderr
    assert not (tmp_path / "bad").exists()


def test_a_harness_that_renders_its_own_prompts_extends_one_segment(harness, tokenizer) -> None:
    """`/v1/completions` with text prompts, the session found by its API key: a prompt
    that begins with the last one and all sampled after it extends the ledger."""
    task = load_task(DATA / "task.yaml")
    command = '"$PYTHON" "$AGENTRL_TEST_DATA/completions_client.py"'
    agent = task.spec.agent.model_copy(update={"command": command, "name": "completions"})
    task = task.model_copy(update={"spec": task.spec.model_copy(update={"agent": agent})})
    sampler = Recording(ScriptedSampler([WRITE, "Done."], tokenizer))
    traj = play(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.finished and traj.reward == 1.0, traj.error
    assert traj.agent is not None and (traj.agent.calls, traj.agent.edits) == (2, 0)
    assert traj.segments == [] and unexplained(traj, sampler.calls) == []
    assert f"({server.MODEL_NAME})" in traj.agent.log_tail


def test_the_gateway_fronts_replicas_behind_the_router(harness, tokenizer) -> None:
    """The policy is SmolLM2 behind `agentrl serve`, reached through the router (the GPU
    path, with vLLM replicas in its place): the gateway sends the ledger's ids and
    records the ids, logprobs, versions and replica that came back."""
    from agentrl.inference.config import RouterConfig
    from agentrl.inference.local import LocalSampler
    from agentrl.inference.serve import serve

    local = LocalSampler.embedded()
    http, url = serve(local, tokenizer)
    try:
        router = RouterConfig(urls=[url.removesuffix("/v1")]).build(tokenizer=tokenizer)
        sampler = Recording(router)
        traj = play(load_task(DATA / "task.yaml"), tokenizer, sampler, close=True)
    finally:
        http.close()
        asyncio.run(local.close())
    assert traj.trainable and traj.agent is not None and traj.agent.calls >= 1, traj.error
    assert unexplained(traj, sampler.calls) == []
    assert all(t.replica for t in traj.turns)
    sampled = [
        lp
        for ledger in traj.ledgers()
        for lp, m in zip(ledger.logprobs, ledger.loss_mask, strict=True)
        if m
    ]
    assert sampled and all(lp <= 0.0 for lp in sampled) and any(lp < 0.0 for lp in sampled)


class FailsSecond(Recording):
    """Its second call fails with a bug (no SamplerError: nothing the gateway expects)."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        if self.calls:
            raise RuntimeError("a bug in the sampler")
        return await super().generate(prompt_ids, params, session_id)


SWALLOWING = """
import json, os, urllib.request
for _ in range(2):
    body = {"messages": [{"role": "user", "content": os.environ["AGENTRL_TASK"]}]}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=60).read()
    except Exception as e:
        print("ignored:", e)
"""


def test_a_failed_call_is_infrastructure_even_if_the_harness_exits_0(
    harness, tmp_path: Path, tokenizer
) -> None:
    """A harness that swallows the gateway's error and exits 0 does not make agentrl's
    failure the agent's: the episode is aborted, never graded."""
    (tmp_path / "swallow.py").write_text(SWALLOWING)
    task = load_task(DATA / "task.yaml")
    command = f'"$PYTHON" {tmp_path / "swallow.py"}'
    agent = task.spec.agent.model_copy(update={"command": command})
    task = task.model_copy(update={"spec": task.spec.model_copy(update={"agent": agent})})
    traj = play(task, tokenizer, FailsSecond(ScriptedSampler(["Hello."], tokenizer)))
    assert traj.agent is not None and traj.agent.exit_code == 0
    assert "ignored: HTTP Error 404" in traj.agent.log_tail
    assert traj.stop_reason == StopReason.aborted and not traj.trainable
    assert traj.reward is None and traj.num_sampled == 0
    assert traj.error == "RuntimeError: a bug in the sampler"
