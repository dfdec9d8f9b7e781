"""Context management in real episodes: the task's `context:` policy (agentrl/context.py).

Episodes run a scripted policy through the real SmolLM2 chat template and tokenizer in a
local sandbox (isolation is not the point here), and are graded. Each test checks the
trajectory's segments against the policy and that `conversation()` rebuilds exactly the
same segments from the turn records.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentrl.cli import main
from agentrl.episode import conversation, run_episode
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler
from agentrl.sandbox.local import LocalProvider
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.load import check_task, load_task
from agentrl.tasks.spec import Task
from agentrl.train_config import AlgorithmConfig
from agentrl.trajectory import StopReason, Trajectory

pytestmark = pytest.mark.model
RUN_ID = f"test-context-{uuid.uuid4().hex[:8]}"
SYSTEM = "You work in a Linux shell."
TASK = "Create done.txt in the working directory, then call finish."
FINISH = '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def bash(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>{call}</tool_call>"


def write_task(folder: Path, context: dict[str, Any], **limits: int) -> Path:
    spec = {
        "name": "context",
        "instances": [{"id": "only"}],
        "prompt": {"system": SYSTEM, "instance": TASK},
        "tools": ["bash", "finish"],
        "limits": {"max_turns": 12, "max_new_tokens": 64, "context_length": 1024, **limits},
        "context": context,
        "grader": {"type": "command", "command": "test -f done.txt"},
    }
    path = folder / "task.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def make_task(folder: Path, context: dict[str, Any], **limits: int) -> Task:
    return load_task(write_task(folder, context, **limits))


def play(task: Task, replies: list[str], tokenizer) -> Trajectory:
    async def main() -> Trajectory:
        env = TaskEnv(task, LocalProvider(), RUN_ID)
        sampler = ScriptedSampler(replies, tokenizer)
        return await run_episode(task, task.instances[0], 0, sampler, tokenizer, env)

    return asyncio.run(main())


def assert_rebuilt(task: Task, traj: Trajectory, tokenizer) -> None:
    """`conversation()` rebuilds the recorded segments exactly, from the turns alone."""
    rebuilt = conversation(task, traj, tokenizer).all_segments
    assert [(s.reason, s.prompt_ids, s.response_ids, s.loss_mask) for s in rebuilt] == [
        (s.reason, s.prompt_ids, s.response_ids, s.loss_mask) for s in traj.ledgers()
    ]


def seen(traj: Trajectory, segment: int, tokenizer) -> str:
    """The text of one segment's ids: what the model saw in it."""
    ledger = traj.ledgers()[segment]
    return str(tokenizer.decode(ledger.prompt_ids + ledger.response_ids))


def test_a_long_observation_keeps_head_and_tail_and_says_how_much_was_cut(
    tmp_path: Path, tokenizer
) -> None:
    task = make_task(tmp_path, {"observation_tokens": 48})
    replies = [bash("seq 1 400"), bash("echo short"), bash("touch done.txt"), FINISH]
    traj = play(task, replies, tokenizer)
    assert (traj.stop_reason, traj.reward, traj.segments) == (StopReason.finished, 1.0, [])
    long, short = traj.turns[0].observation, traj.turns[1].observation
    full = "".join(f"{i}\n" for i in range(1, 401))
    cut = len(tokenizer.encode(full, add_special_tokens=False)) - 48
    assert long.startswith("1\n2\n3\n") and long.endswith("398\n399\n400\n")
    assert f"\n[... {cut} tokens of output cut ...]\n" in long
    assert "\n200\n" not in long and len(tokenizer.encode(long)) < 48 + 16
    assert short == "short\n"  # under the limit: untouched
    assert long in seen(traj, 0, tokenizer)  # the turn records what the model saw
    assert full not in seen(traj, 0, tokenizer)
    assert_rebuilt(task, traj, tokenizer)


def test_drop_oldest_continues_in_a_segment_that_fits_the_budget(tmp_path: Path, tokenizer) -> None:
    budget = 640
    context = {"history": "drop_oldest", "budget_tokens": budget, "keep_turns": 2}
    task = make_task(tmp_path, {**context, "observation_tokens": 64})
    steps = [bash(f"echo step-{k}; seq 1 60") for k in range(6)]
    traj = play(task, [*steps, bash("touch done.txt"), FINISH], tokenizer)
    assert (traj.stop_reason, traj.reward) == (StopReason.finished, 1.0)  # graded
    assert traj.segments and all(s.reason == "drop_oldest" for s in traj.segments)
    assert len(traj.prompt_ids) + 64 <= budget  # the first prompt fits: nothing dropped yet
    for k, segment in enumerate(traj.segments, start=1):
        assert len(segment.prompt_ids) + 64 <= budget  # the new prompt fits the budget
        prompt = str(tokenizer.decode(segment.prompt_ids))
        assert SYSTEM in prompt and TASK in prompt and "turns were dropped" in prompt
        before = [t for t in traj.turns if t.segment < k]
        for turn in before[-2:]:  # keep_turns: the last two are never dropped
            assert turn.action in prompt and turn.observation in prompt
        assert before[0].action not in prompt  # the oldest went
    # Every turn was sampled once; the segments hold them in order.
    assert [t.segment for t in traj.turns] == sorted(t.segment for t in traj.turns)
    assert_rebuilt(task, traj, tokenizer)


def test_drop_oldest_never_drops_the_last_keep_turns_even_over_budget(
    tmp_path: Path, tokenizer
) -> None:
    context = {"history": "drop_oldest", "budget_tokens": 640, "keep_turns": 4}
    task = make_task(tmp_path, {**context, "observation_tokens": 64})
    steps = [bash(f"echo step-{k}; seq 1 60") for k in range(6)]
    traj = play(task, [*steps, bash("touch done.txt"), FINISH], tokenizer)
    assert (traj.stop_reason, traj.reward) == (StopReason.finished, 1.0)
    assert traj.segments and any(len(s.prompt_ids) + 64 > 640 for s in traj.segments)
    for k, segment in enumerate(traj.segments, start=1):
        prompt = str(tokenizer.decode(segment.prompt_ids))
        before = [t for t in traj.turns if t.segment < k]
        assert all(t.action in prompt for t in before[-4:]) and before[0].action not in prompt
    assert_rebuilt(task, traj, tokenizer)


SUMMARY = "I printed numbers three times; nothing else is done. Next: create done.txt."


def test_summarize_asks_the_policy_and_continues_from_its_summary(
    tmp_path: Path, tokenizer
) -> None:
    ask = "Context is full. Summarize your progress in two sentences."
    context = {
        "history": "summarize",
        "budget_tokens": 640,
        "keep_turns": 1,
        "summary_prompt": ask,
        "summary_tokens": 64,
        "observation_tokens": 64,
    }
    actions = 5  # max_turns: exactly the actions scripted, so a summary must not count
    task = make_task(tmp_path, context, max_turns=actions)
    steps = [bash(f"echo step-{k}; seq 1 60") for k in range(3)]
    replies = [*steps, SUMMARY, bash("touch done.txt"), FINISH]
    traj = play(task, replies, tokenizer)
    assert (traj.stop_reason, traj.reward) == (StopReason.finished, 1.0)
    assert [t.kind for t in traj.turns] == ["action"] * 3 + ["summary"] + ["action"] * 2
    assert [s.reason for s in traj.segments] == ["summary"]  # asking started none
    summary = traj.turns[3]
    assert summary.action == SUMMARY and summary.tool_call is None
    start, end = summary.span
    assert set(traj.ledgers()[summary.segment].loss_mask[start:end]) == {1}  # trained on
    # Rebuilt up to the summary: the chat that was put to the policy, the request last.
    before = conversation(task, traj, tokenizer, upto=3)
    assert before.messages[-1] == {"role": "user", "content": ask}
    assert before.ids == traj.prompt_ids + traj.response_ids[:start]
    asked = seen(traj, 0, tokenizer)
    assert asked.index(traj.turns[2].observation) < asked.index(ask) < asked.index(SUMMARY)
    after = str(tokenizer.decode(traj.segments[0].prompt_ids))
    assert SYSTEM in after and TASK in after and SUMMARY in after
    assert traj.turns[2].action in after  # keep_turns: the last turn, verbatim
    assert traj.turns[1].action not in after and ask not in after
    assert_rebuilt(task, traj, tokenizer)


def test_by_default_a_summary_has_its_room(tmp_path: Path, tokenizer) -> None:
    """With no budget_tokens, a summarizing policy's budget is the context less the
    summary's tokens and its request's, so the summary asked when the next turn would pass
    it gets all of summary_tokens (when the observation that fills the budget stays within
    it): a summary longer than that is cut at summary_tokens and the episode goes on.
    Before, the budget was the whole context (the summary had a few tokens left), then the
    context less summary_tokens alone, which left the default request (about 70 tokens)
    out: the trail task's summaries got 4 tokens, were cut off by the context and ended
    every episode context_limit."""
    context = {"history": "summarize", "keep_turns": 1, "summary_tokens": 64}
    task = make_task(tmp_path, context, context_length=460, max_turns=3)
    rambling = "I printed numbers, then more numbers, and will go on printing them. " * 8
    assert len(tokenizer.encode(rambling)) > 64
    steps = [bash(f"echo step-{k}; seq 1 3") for k in range(3)]
    traj = play(task, [steps[0], rambling, *steps[1:]], tokenizer)  # asked after one turn
    kinds = [t.kind for t in traj.turns]
    assert kinds[:3] == ["action", "summary", "action"]  # the episode went on after it
    summary = traj.turns[1]
    assert summary.finish_reason == "length"  # cut at summary_tokens, not by the context
    assert summary.span[1] - summary.span[0] == 64
    assert len(traj.prompt_ids) + summary.span[1] <= 512
    assert [s.reason for s in traj.segments][:1] == ["summary"]
    assert_rebuilt(task, traj, tokenizer)


def test_a_summary_is_never_asked_twice_in_a_row_and_a_full_context_ends_the_episode(
    tmp_path: Path, tokenizer
) -> None:
    # Three kept turns of long output overflow the budget even after a summary.
    context = {"history": "summarize", "budget_tokens": 700, "keep_turns": 3}
    task = make_task(tmp_path, {**context, "summary_tokens": 32}, context_length=1024)
    traj = play(task, [bash(f"echo step-{k}; seq 1 40") for k in range(30)], tokenizer)
    kinds = [t.kind for t in traj.turns]
    assert "summary" in kinds and ("summary", "summary") not in zip(kinds, kinds[1:], strict=False)
    assert traj.stop_reason == StopReason.context_limit and traj.reward == 0.0
    assert_rebuilt(task, traj, tokenizer)


def test_a_summary_the_context_cuts_off_ends_the_episode_context_limit(
    tmp_path: Path, tokenizer
) -> None:
    # The summary is asked with less room left in the context than it takes.
    context = {"history": "summarize", "budget_tokens": 900, "summary_tokens": 400}
    task = make_task(tmp_path, context)
    rambling = "I ran seq many times and looked at numbers. " * 40
    traj = play(task, [bash(f"echo step-{k}; seq 1 20") for k in range(6)] + [rambling], tokenizer)
    assert [t.kind for t in traj.turns] == ["action"] * 6 + ["summary"]
    assert traj.turns[-1].finish_reason == "length" and traj.segments == []
    assert traj.stop_reason == StopReason.context_limit
    assert_rebuilt(task, traj, tokenizer)


@pytest.mark.parametrize(
    "context",
    [
        {},  # history: keep
        {"history": "drop_oldest", "budget_tokens": 480, "keep_turns": 4},  # nothing droppable
    ],
)
def test_an_episode_that_fills_the_context_ends_context_limit(
    tmp_path: Path, tokenizer, context: dict[str, Any]
) -> None:
    task = make_task(tmp_path, context, context_length=512)
    traj = play(task, [bash(f"echo step-{k}; seq 1 50") for k in range(10)], tokenizer)
    assert traj.stop_reason == StopReason.context_limit
    assert traj.trainable and traj.reward == 0.0  # graded: the agent's outcome
    for ledger in traj.ledgers():  # every sampled token was sampled within the context
        sampled = [i for i, m in enumerate(ledger.loss_mask) if m]
        assert not sampled or len(ledger.prompt_ids) + sampled[-1] < 512
    # The overlong rule: masked by default (DAPO's overlong filtering), trained if asked.
    assert not AlgorithmConfig().trains_on(traj)
    assert AlgorithmConfig(overlong="train").trains_on(traj)
    assert_rebuilt(task, traj, tokenizer)


def test_validate_refuses_a_prompt_longer_than_the_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_task(tmp_path, {}, context_length=512)
    spec = yaml.safe_load(path.read_text())
    spec["instances"] = [{"id": "brief"}, {"id": "wordy", "notes": "apple " * 300}]
    spec["prompt"]["instance"] = TASK + " {notes}"
    spec["instances"][0]["notes"] = "short"
    path.write_text(yaml.safe_dump(spec))
    assert check_task(path) == []  # no tokenizer: under 32 bytes a token, it may fit
    assert main(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    problem, fix = err.splitlines()
    assert problem.startswith(f"{path}: instance wordy: the first prompt is ")
    assert problem.endswith("tokens; limits.context_length is 512: no room for a reply")
    assert fix.startswith("fix: shorten the task's prompt")
    spec["limits"]["context_length"] = 1024
    path.write_text(yaml.safe_dump(spec))
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: ok (2 instances, agentrl task)\n"
    assert main(["validate", "--model", str(tmp_path / "nowhere"), str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"--model {tmp_path / 'nowhere'}: no such folder",
        "fix: pass embedded, or a model's folder",
    ]


def test_validate_refuses_rows_whose_prompt_is_longer_than_the_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = Path(__file__).parents[1] / "tasks" / "swe_bench" / "instances.jsonl"
    row = json.loads(rows.read_text().splitlines()[0])
    row["problem_statement"] = "word " * 40_000  # 200 kB: fits 32 bytes a token, not 32k tokens
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert main(["validate", str(path)]) == 1
    problem, fix = capsys.readouterr().err.splitlines()
    assert problem.startswith(f"{path}: instance {row['instance_id']}: the first prompt is ")
    assert problem.endswith("tokens; limits.context_length is 32,768: no room for a reply")
    assert fix.startswith("fix: shorten the task's prompt")


@pytest.mark.parametrize(
    ("context", "limits", "message"),
    [
        (
            {"history": "summarize", "summary_tokens": 1000},
            {"context_length": 1024},
            "context.summary_tokens (1000) leaves no room for the prompt after a summary",
        ),
        (
            {"history": "drop_oldest", "budget_tokens": 64},
            {"max_new_tokens": 64},
            "context.budget_tokens (64) leaves no room for a prompt",
        ),
        ({"budget_tokens": 512}, {}, "context.budget_tokens does nothing with history: keep"),
        (
            {"history": "summarize", "budget_tokens": 2048},
            {"context_length": 1024},
            "context.budget_tokens (2048) is above limits.context_length (1024)",
        ),
    ],
)
def test_validate_refuses_a_context_policy_that_cannot_work(
    tmp_path: Path, context: dict[str, Any], limits: dict[str, int], message: str
) -> None:
    (problem,) = check_task(write_task(tmp_path, context, **limits))
    assert message in problem.message


def test_a_continuation_from_a_state_its_context_policy_had_yet_to_trim_runs(
    tmp_path: Path, tokenizer
) -> None:
    """A branch continuation starts from its parent's chat before turn t, which can be
    longer than the context: the observation before t filled it, and drop_oldest trims
    before t is sampled. INIT took that chat for a first prompt that cannot fit and
    aborted the continuation as an infrastructure failure (on the trail task, 6 of 32
    continuations a step)."""
    from agentrl.episode.factory import Episodes, played

    task = make_task(tmp_path, {"history": "drop_oldest", "keep_turns": 1}, context_length=512)
    replies = [bash(f"echo step-{k}; seq 1 30") for k in range(4)] + [
        bash("touch done.txt"),
        FINISH,
    ]
    parent = play(task, replies, tokenizer)
    assert (parent.stop_reason, parent.reward) == (StopReason.finished, 1.0) and parent.segments
    turn = next(  # a state the parent's context policy trimmed before going on
        k
        for k in range(1, len(parent.turns))
        if len(conversation(task, parent, tokenizer, upto=k)) >= 512
    )

    async def main() -> Trajectory:
        env = TaskEnv(task, LocalProvider(), RUN_ID)
        episodes = Episodes(ScriptedSampler(replies[turn:], tokenizer), tokenizer, {"context": env})
        return await played(
            episodes.continued(
                task,
                task.instances[0],
                parent,
                turn,
                trajectory_id=f"{parent.trajectory_id}~{turn}-0",
                purpose="value",
                snapshot=None,
            )  # fmt: skip
        )

    branch = asyncio.run(main())
    assert branch.error is None
    assert (branch.stop_reason, branch.reward) == (StopReason.finished, 1.0)
    assert branch.turns[turn].segment > parent.turns[turn - 1].segment  # trimmed, then sampled
    assert [s.reason for s in branch.segments] == [s.reason for s in parent.segments]
