"""The ReAct episode end to end: real tokenizer, real Docker sandbox, real grader.

Policies: the scripted one (deterministic replies through the real chat template) and
the embedded SmolLM2 model. Every episode must come back as one validated trajectory
whose token ids decode to exactly the conversation its turn records describe.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import Field

from agentrl.episode import conversation, run_episode
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler, load_script
from agentrl.sandbox.base import Sandbox
from agentrl.sandbox.docker import DockerProvider
from agentrl.sandbox.images import docker_client
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Task
from agentrl.tools.base import ModelTool, Observation, ToolArgs, ToolOptions
from agentrl.trajectory import StopReason, Trajectory, TrajectoryStore

pytestmark = [pytest.mark.docker, pytest.mark.model]
DATA = Path(__file__).parent / "data" / "agent"
RUN_ID = f"test-agent-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def task() -> Task:
    return load_task(DATA / "echo_task.yaml")


def episode(task: Task, tokenizer, sampler, instance: int = 0) -> Trajectory:
    async def main() -> Trajectory:
        env = TaskEnv(task, DockerProvider(), RUN_ID)
        return await run_episode(task, task.instances[instance], 0, sampler, tokenizer, env)

    return asyncio.run(main())


def conversation_ids(task: Task, traj: Trajectory, tokenizer) -> list[int]:
    """The ids rebuilt from the turn records alone, through the chat template."""
    return conversation(task, traj, tokenizer).ids


def test_oracle_script_earns_one_and_the_ledger_is_exact(task: Task, tokenizer) -> None:
    traj = episode(task, tokenizer, ScriptedSampler(load_script(DATA / "oracle.yaml"), tokenizer))
    assert traj.stop_reason == StopReason.finished
    assert traj.reward == 1.0 and traj.trainable
    assert [t.tool_call.name for t in traj.turns if t.tool_call] == ["bash", "finish"]
    assert "greeting.txt" in traj.turns[0].observation and traj.turns[0].exit_code == 0
    assert traj.env.image == "agentrl/base:bookworm" and traj.env.task_hash == task.hash
    # Token-in-token-out: the ids are exactly the conversation the turn records describe.
    assert traj.prompt_ids + traj.response_ids == conversation_ids(task, traj, tokenizer)
    sampled = [i for i, m in enumerate(traj.loss_mask) if m]
    assert sampled == [i for t in traj.turns for i in range(*t.span)]


def test_doing_nothing_earns_zero(task: Task, tokenizer) -> None:
    traj = episode(task, tokenizer, ScriptedSampler(load_script(DATA / "noop.yaml"), tokenizer))
    assert (traj.stop_reason, traj.reward) == (StopReason.finished, 0.0)


def test_malformed_calls_get_guidance_and_the_episode_goes_on(task: Task, tokenizer) -> None:
    sampler = ScriptedSampler(load_script(DATA / "clumsy.yaml"), tokenizer)
    traj = episode(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.max_turns and len(traj.turns) == 4
    first, second, third, fourth = (t.observation for t in traj.turns)
    assert first.startswith("error: no tool call found") and "<tool_call>" in first
    assert second.startswith("error: the text inside <tool_call> is not valid JSON")
    assert third.startswith("error: unknown tool 'python'; available: bash, finish")
    assert fourth == "still going\n"
    assert traj.reward == 0.0
    assert traj.prompt_ids + traj.response_ids == conversation_ids(task, traj, tokenizer)


def test_missing_image_is_an_infrastructure_failure_with_zero_mask(task: Task, tokenizer) -> None:
    spec = task.spec.model_copy(
        update={"sandbox": task.spec.sandbox.model_copy(update={"image": "agentrl/nope:x"})}
    )
    broken = task.model_copy(update={"spec": spec})
    traj = episode(broken, tokenizer, ScriptedSampler(["x"], tokenizer))
    assert traj.stop_reason == StopReason.sandbox_error and not traj.trainable
    assert "not found" in (traj.error or "") and traj.num_sampled == 0


def test_a_crashing_grader_is_an_eval_error(task: Task, tokenizer) -> None:
    grader = task.spec.grader.model_copy(update={"reward_file": "/nonexistent/reward.txt"})
    broken = task.model_copy(update={"spec": task.spec.model_copy(update={"grader": grader})})
    sampler = ScriptedSampler(load_script(DATA / "oracle.yaml"), tokenizer)
    traj = episode(broken, tokenizer, sampler)
    assert traj.stop_reason == StopReason.eval_error and traj.reward is None
    assert traj.num_sampled == 0 and traj.error


def test_a_failing_sampler_is_an_aborted_episode_not_an_agent_failure(
    task: Task, tokenizer
) -> None:
    from agentrl.inference.local import LocalSampler

    sampler = LocalSampler.embedded()
    asyncio.run(sampler.close())  # a real sampler that now refuses every request
    traj = episode(task, tokenizer, sampler)
    assert traj.stop_reason == StopReason.aborted and not traj.trainable
    assert "closed" in (traj.error or "") and traj.reward is None and traj.num_sampled == 0


class BuggyArgs(ToolArgs):
    x: int = Field(description="any number")


class BuggyTool(ModelTool[BuggyArgs, ToolOptions]):
    """A tool with a bug: its body raises TypeError."""

    name = "buggy"
    description = "Counts nothing: its body raises a TypeError (a tool bug)."
    Args = BuggyArgs
    Options = ToolOptions

    async def run(self, sandbox: Sandbox, args: BuggyArgs) -> Observation:
        return Observation(text=str(len(args.x)))  # type: ignore[arg-type]  # the bug


def test_a_type_error_inside_a_tool_is_its_bug_not_bad_arguments(
    task: Task, tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """Arguments that do not fit are told to the model and the episode goes on; a
    TypeError from the tool's own body ends it as infrastructure, traceback logged."""
    buggy = task.model_copy(
        update={"spec": task.spec.model_copy(update={"tools": [*task.spec.tools, _BUGGY]})}
    )
    replies = [
        '<tool_call>{"name": "buggy", "arguments": {"y": 1}}</tool_call>',
        '<tool_call>{"name": "buggy", "arguments": {"x": 1}}</tool_call>',
    ]
    traj = episode(buggy, tokenizer, ScriptedSampler(replies, tokenizer))
    told = traj.turns[0].observation
    assert "the `x` argument is required" in told and "unknown argument(s) y" in told
    assert traj.stop_reason == StopReason.aborted and not traj.trainable
    assert traj.reward is None and (traj.error or "").startswith("TypeError: ")
    assert len(traj.turns) == 2 and "bad arguments" not in (traj.error or "")
    crashed = [r for r in caplog.records if r.name == "agentrl.episode.episode" and r.exc_info]
    assert crashed and "RUN crashed" in crashed[0].getMessage()


_BUGGY = f"{__name__}:BuggyTool"


def test_context_limit_ends_the_episode(task: Task, tokenizer) -> None:
    limits = task.spec.limits.model_copy(update={"context_length": 600, "max_new_tokens": 500})
    small = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    sampler = ScriptedSampler(["<tool_call>" + "x" * 4000], tokenizer)
    traj = episode(small, tokenizer, sampler)
    assert traj.stop_reason in (StopReason.context_limit, StopReason.sampler_length)
    assert len(traj.prompt_ids) + len(traj.response_ids) <= 600 + 2


def test_embedded_model_episode_is_a_valid_exact_trajectory(task: Task, tokenizer) -> None:
    from agentrl.inference.local import LocalSampler

    limits = task.spec.limits.model_copy(update={"max_turns": 2, "max_new_tokens": 48})
    small = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    sampler = LocalSampler.embedded()
    try:
        traj = episode(small, tokenizer, sampler)
    finally:
        asyncio.run(sampler.close())
    assert traj.trainable and traj.num_sampled > 0
    assert all(lp <= 0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m)
    assert {v for v, m in zip(traj.token_versions, traj.loss_mask, strict=True) if m} == {0}
    assert traj.prompt_ids + traj.response_ids == conversation_ids(small, traj, tokenizer)


def test_agentrl_run_writes_trajectories_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable, "-m", "agentrl.cli", "run", str(DATA / "echo_task.yaml"),
            "--policy", f"scripted:{DATA / 'oracle.yaml'}", "-n", "2", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    trajs = list(TrajectoryStore(out / "trajectories.jsonl").read())
    assert len(trajs) == 4 and {t.group_id for t in trajs} == {"greet", "farewell"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_mean"] == 1.0 and summary["stop_reasons"] == {"finished": 4}
    assert summary["tool_calls"] == 8 and summary["tool_errors"] == 0
    assert "reward_mean" in res.stdout
    for traj in trajs:  # each grade's evidence, linked from its trajectory
        assert traj.grade_file == f"trajectories.grades/{traj.trajectory_id}.json"
        evidence = json.loads((out / traj.grade_file).read_text())
        assert evidence["grader"] == "command" and evidence["exit_code"] == 0
        assert evidence["command"].startswith("test ")
        # The tools closed before EVAL (the bash tool's shell with them): the seal found
        # nothing of the agent's still running (tests/test_reward_integrity.py has it stop
        # what an attacker leaves behind).
        assert evidence["sealed"]["stopped"] == []


def test_embedded_model_run_decodes_to_exactly_the_conversation_it_reports(
    tmp_path: Path, tokenizer
) -> None:
    out = tmp_path / "run"
    res = subprocess.run(
        [
            sys.executable, "-m", "agentrl.cli", "run", str(DATA / "echo_task.yaml"),
            "--policy", "local", "-n", "1", "--max-turns", "2", "--max-new-tokens", "40",
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    trajs = {t.trajectory_id: t for t in TrajectoryStore(out / "trajectories.jsonl").read()}
    shown = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert {c["trajectory_id"] for c in shown} == set(trajs) and len(trajs) == 2
    for convo in shown:
        traj = trajs[convo["trajectory_id"]]
        assert traj.trainable and traj.num_sampled > 0
        messages = convo["messages"]
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=messages[-1]["role"] != "assistant"
        )
        decoded = tokenizer.decode(traj.prompt_ids + traj.response_ids)
        # The one allowed difference: the template's newline after a final <|im_end|> that
        # the model sampled (nothing follows it, so it was never appended).
        assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("", "\n")


def test_bash_block_actions_run_in_the_sandbox_and_are_graded(tokenizer) -> None:
    """The shipped training task: one ```bash block per reply, no tool schemas shown."""
    task = load_task(Path(__file__).parents[1] / "tasks" / "train" / "shell-basics" / "task.yaml")
    touch, mkdir = task.instances[0], task.instances[1]  # touch notes.txt / mkdir build
    assert (touch.fields["name"], mkdir.fields["kind"]) == ("notes.txt", "dir")
    script = load_script(DATA / "bash_block.yaml")  # ```bash\ntouch notes.txt\n```\nprose
    assert task.spec.sampling.stop == ["```\n"]

    right, wrong = asyncio.run(_episodes(task, [touch, mkdir], ScriptedSampler(script, tokenizer)))
    assert right.reward == 1.0 and wrong.reward == 0.0
    assert right.turns[0].tool_call is not None
    assert right.turns[0].tool_call.arguments == {"command": "touch notes.txt"}
    assert right.stop_reason == StopReason.max_turns  # one turn, then graded
    # The reply ended at the closing fence, on a token that is not the end of the turn.
    assert right.turns[0].action == "```bash\ntouch notes.txt\n```\n"
    assert right.turns[0].finish_reason == "stop"
    assert tokenizer.eos_token_id not in right.response_ids[slice(*right.turns[0].span)]
    assert "<tools>" not in tokenizer.decode(right.prompt_ids)  # the system prompt explains
    assert right.prompt_ids + right.response_ids == conversation_ids(task, right, tokenizer)

    # Two turns: the stop-string turn is closed by the template before the observation,
    # and the ids still equal the conversation rebuilt from the turn records.
    limits = task.spec.limits.model_copy(update={"max_turns": 2})
    longer = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    (two,) = asyncio.run(_episodes(longer, [touch], ScriptedSampler(script, tokenizer)))
    assert len(two.turns) == 2 and two.turns[0].observation == "(no output)"
    assert two.prompt_ids + two.response_ids == conversation_ids(longer, two, tokenizer)


async def _episodes(task: Task, instances: list, sampler: ScriptedSampler) -> list[Trajectory]:
    tokenizer = sampler.tokenizer
    env = TaskEnv(task, DockerProvider(), RUN_ID)
    return [await run_episode(task, inst, 0, sampler, tokenizer, env) for inst in instances]


def test_no_container_is_left_behind() -> None:
    client = docker_client()
    try:
        left = client.containers.list(all=True, filters={"label": f"agentrl.run={RUN_ID}"})
    finally:
        client.close()
    assert left == []


def test_a_reply_the_server_aborted_ends_the_episode_as_aborted(task: Task, tokenizer) -> None:
    """A cut reply (finish_reason abort) that no router finished is never acted on."""
    import threading
    import time

    from agentrl.inference.local import LocalSampler

    limits = task.spec.limits.model_copy(update={"max_new_tokens": 400})
    long = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    sampler = LocalSampler.embedded()

    def pause_once_decoding() -> None:
        while sampler.stats.batches == 0:
            time.sleep(0.05)
        time.sleep(0.3)
        sampler.pause("abort")  # what vLLM's POST /pause does by default

    pauser = threading.Thread(target=pause_once_decoding)
    pauser.start()
    try:
        traj = episode(long, tokenizer, sampler)
    finally:
        pauser.join()
        sampler.resume()
        asyncio.run(sampler.close())
    assert traj.stop_reason == StopReason.aborted and not traj.trainable
    assert "aborted this reply" in (traj.error or "")
    assert traj.turns[-1].finish_reason == "abort" and traj.turns[-1].tool_call is None
