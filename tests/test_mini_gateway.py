"""mini-swe-agent, unmodified (PyPI mini-swe-agent 2.4.6, installed by bootstrap.sh in
.venv-mini), plays the shipped task tasks/train/look-then-act-mini through the gateway in
a real Docker sandbox: its litellm client calls the policy, its environment class acts on
the sandbox through agentrl's exec endpoint.

Token exactness is checked against the sampler (every prompt it was given, every id it
returned, where the turn records say), and against the learner: `agentrl train` with the
embedded SmolLM2 scores each recorded token under the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from build_swe_images import build, rows
from test_gateway import Recording, unexplained

from agentrl import corpus
from agentrl.episode import make_env, run_episode
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Task
from agentrl.trajectory import StopReason, Trajectory, TrajectoryStore

ROOT = Path(__file__).parent.parent
MINI = ROOT / ".venv-mini" / "bin" / "mini"
TASK = ROOT / "tasks" / "train" / "look-then-act-mini"
RUN_ID = f"test-mini-{uuid.uuid4().hex[:8]}"
LOOK, ACT = "```bash\ncat note.txt\n```\n", "```bash\ntouch gebut4.dat\n```\n"  # note-00's name

pytestmark = [
    pytest.mark.docker,
    pytest.mark.model,
    pytest.mark.slow,  # each episode starts mini (litellm imports in seconds)
    pytest.mark.skipif(not MINI.exists(), reason="no .venv-mini (bash bootstrap.sh installs it)"),
]


@pytest.fixture(autouse=True)
def mini(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_MINI", str(MINI))


def play(replies: list[str]) -> tuple[Trajectory, Recording]:
    tokenizer = load_tokenizer()
    task: Task = load_task(TASK / "task.yaml")
    sampler = Recording(ScriptedSampler(replies, tokenizer))

    async def main() -> Trajectory:
        env = make_env(task, DockerProvider(), RUN_ID)  # its sandboxes mount the gateway
        return await run_episode(task, task.instances[0], 0, sampler, tokenizer, env)

    return asyncio.run(main()), sampler


def test_mini_swe_agent_solves_the_shipped_task_and_is_recorded_token_exactly() -> None:
    traj, sampler = play([LOOK, ACT])
    agent = traj.agent
    assert agent is not None and agent.name == "mini-swe-agent", traj.error
    assert traj.stop_reason == StopReason.finished and traj.reward == 1.0, agent.log_tail
    assert (agent.exit_code, agent.calls, agent.edits, agent.drift) == (0, 2, 0, 0)
    assert "LimitsExceeded" in agent.log_tail  # mini stopped itself after its two steps
    assert unexplained(traj, sampler.calls) == []
    look, act = traj.turns
    assert look.tool_call is not None and look.tool_call.arguments["command"].endswith(
        "\ncat note.txt"
    )
    assert look.exit_code == 0 and look.observation.strip() == "Run: touch gebut4.dat"
    assert act.tool_call is not None and act.exit_code == 0


def test_a_reply_mini_drops_from_its_history_begins_a_segment() -> None:
    """mini keeps no reply it cannot parse (it sends its format error instead): its next
    call's history is not the one it was given, so the ledger continues in a new segment
    and the dropped reply keeps its tokens, sampled, in the first."""
    traj, sampler = play(["I will look at the note.", LOOK])
    assert traj.agent is not None and traj.agent.edits == 1, traj.error
    assert [s.reason for s in traj.segments] == ["client"]
    assert [t.segment for t in traj.turns] == [0, 1]
    assert unexplained(traj, sampler.calls) == []
    segment = load_tokenizer().decode(traj.segments[0].prompt_ids)
    assert "Reply with exactly one command" in segment and "I will look" not in segment


@pytest.mark.e2e
def test_mini_swe_agent_trains_a_model_on_what_it_sampled(tmp_path: Path, tiny_dir: Path) -> None:
    """One sync step of `agentrl train` on five instances of the shipped task (one held
    out), the tiny model sampling in process (the real SmolLM2 run is in docs/agents.md):
    the learner's logprobs equal the sampler's. The loss is cross-entropy on the sampled
    tokens, so the step always trains (a GRPO step whose groups all tie is skipped)."""
    text = (TASK / "task.yaml").read_text().replace("context_length: 1024", "context_length: 480")
    lines = text.splitlines()
    kept = [line for line in lines if not line.startswith("  - {id: note-") or "note-0" in line]
    kept = [line for line in kept if not any(f"note-0{d}" in line for d in "56789")]
    (tmp_path / "task.yaml").write_text("\n".join(kept) + "\n")
    (tmp_path / "mini.yaml").write_text((TASK / "mini.yaml").read_text())
    (tmp_path / "train.yaml").write_text(
        f"name: mini\ntasks: [task.yaml]\nmodel: {tiny_dir}\n"
        "backend: {type: fsdp, lr: 3.0e-5}\nalgorithm: {loss: {type: cross_entropy}}\n"
        "schedule: {type: sync, steps: 1, prompts_per_step: 1, n_samples_per_prompt: 2}\n"
        "dispatcher: {type: pipeline, concurrency: 4}\n"
        "eval: {holdout_every: 4, samples: 1}\ncheckpoint: {every: 1, keep: 1}\nseed: 0\n"
    )
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(tmp_path / "train.yaml")]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "AGENTRL_MINI": str(MINI)},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in rows if r["kind"] == "train"]
    assert train["logprob_mismatch"] < 1e-3
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
    assert len(trajs) == 2 and all(t.trainable for t in trajs), [t.error for t in trajs]
    assert all(t.agent is not None and t.agent.name == "mini-swe-agent" for t in trajs)
    assert all(t.agent.calls == len(t.turns) >= 1 for t in trajs if t.agent)


MARSHMALLOW = next(r for r in rows() if r.instance_id == "marshmallow-code__marshmallow-1359")


@pytest.mark.corpus("swe-bench/lite.jsonl", MARSHMALLOW.archive["local_path"])
def test_mini_in_tool_mode_plays_a_genuine_swe_bench_row(tmp_path: Path) -> None:
    """A published SWE-bench Lite row (the genuine corpus, see tests/corpus-swe.json) in its own
    image, played by mini in its default tool-call mode (its own prompts, its `bash`
    tool; `--agent`): the gateway turns the policy's Hermes calls into OpenAI tool_calls,
    mini runs them in the sandbox and submits with its sentinel, and the swebench rules
    grade the (unchanged) repository 0."""
    build(MARSHMALLOW)  # its image, from the repository archive (tests/build_swe_images.py)
    out, lite = tmp_path / "run", corpus.find("swe-bench/lite.jsonl")
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "run", str(lite)]
        + ["--instances", "marshmallow-code__marshmallow-1359", "--out", str(out)]
        + ["--agent", str(ROOT / "tests" / "data" / "gateway" / "mini-tool-mode.yaml")]
        + ["--policy", f"scripted:{ROOT / 'tests' / 'data' / 'gateway' / 'swe_script.json'}"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "AGENTRL_MINI": str(MINI)},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (traj,) = list(TrajectoryStore(out / "trajectories.jsonl"))
    assert traj.stop_reason == StopReason.finished and traj.reward == 0.0, traj.error
    assert traj.agent is not None and (traj.agent.calls, traj.agent.edits) == (2, 0)
    assert traj.agent.exit_code == 0 and "\nExit:\n" in traj.agent.log_tail  # it submitted
    look = traj.turns[0]
    assert look.tool_call is not None and look.tool_call.name == "bash" and look.exit_code == 0
    assert "schema.py" in look.observation and traj.grade_file
