"""Segmented episodes through every consumer, with real components.

The tiny model of conftest (SmolLM2's tokenizer, random weights) is copied into a folder
whose chat template rewrites history: an earlier assistant reply renders cut to its first
8 characters (`every`, as templates that drop earlier reasoning do, so each observation
starts a new segment) or only the first reply does (`first`, so the second segment holds
several turns). The policy is that model sampling in this process (stop string " ", so a
reply ends within a few tokens and the episode goes on), the sandboxes are `local`. On
those episodes: the ledger check and the store, each segment's prompt against the
template's rendering, the FSDP (full and LoRA) and Tinker learners scoring every segment
as the sampler did, `agentrl train` in both schedules, replay and branching, and
`algorithm.overlong`. (Over 400 lines: every consumer is checked on the same recorded
run, one per template, which a split would record again per file.)
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from agentrl import replay
from agentrl.algorithms import LossConfig, compute_advantages
from agentrl.backends.base import Sample, samples_from
from agentrl.episode import conversation, make_env, run_episode
from agentrl.errors import TrajectoryError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import model_tokenizer
from agentrl.inference.local import LocalSampler
from agentrl.runner import run_task
from agentrl.sandbox.local import LocalProvider
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import SnapshotPolicy, Task
from agentrl.trajectory import StopReason, Trajectory, TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.tinker_server.server import TinkerServer

_HEAD = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
_TAIL = (
    "[cut] {{ m['content'][:8] }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {  # an earlier reply renders cut: every one of them, or only the first
    "every": _HEAD + "{% if m['role'] == 'assistant' and not loop.last %}" + _TAIL,
    "first": _HEAD
    + "{% if m['role'] == 'assistant' and loop.index0 == 2 and not loop.last %}"
    + _TAIL,
}
SYSTEM = "You run shell commands. Answer with one bash code block."
# Each INIT takes the next number from COUNTER (mkdir is atomic) and creates the file the
# grader wants on even numbers: episodes run one after another win and lose in turn.
TASK = """\
name: segmented
sandbox:
  image: agentrl/base:bookworm
  workdir: /workspace
  setup:
    - 'i=0; while ! mkdir COUNTER/$i 2>/dev/null; do i=$((i+1)); done'
    - 'if [ $(($(ls COUNTER | wc -l) % 2)) = 1 ]; then touch {name}; fi'
instances:
  - {id: held, name: held.txt}
  - {id: a, name: a.txt}
  - {id: b, name: b.txt}
prompt:
  action_format: bash_block
  system: SYSTEM
  instance: Create an empty file named {name}.
tools: [bash]
limits:
  {max_turns: 3, max_new_tokens: 16, context_length: 512, tool_timeout: 10, episode_timeout: 120}
sampling: {temperature: 1.0, stop: [" "]}
grader: {type: command, command: 'test -f {name}'}
""".replace("SYSTEM", SYSTEM)
# Sampled at temperature 1 in float32 by the sampler (a KV cache, a token at a time) and
# scored by the learner (one forward pass over the whole sequence) on the same weights:
# they differ by float32 rounding alone (measured: at most 1e-6 a segment). The random
# model's logprobs all lie near -ln(49152), yet one token changed or shifted moves a
# segment's mean by 0.05 nats or more: 1e-4 sits far from both.
MISMATCH_TOL = 1e-4
PPO = LossConfig(type="ppo")


def write_task(folder: Path, counter: Path, text: str = TASK) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    counter.mkdir(parents=True, exist_ok=True)
    path = folder / "task.yaml"
    path.write_text(text.replace("COUNTER", str(counter)))
    return path


def rewriting_model(tiny_dir: Path, dest: Path, template: str) -> Path:
    """A copy of the tiny model folder whose tokenizer has `template`."""
    shutil.copytree(tiny_dir, dest)
    tok = model_tokenizer(str(tiny_dir))
    tok.chat_template = template
    tok.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module", params=list(TEMPLATES))
def model_dir(request: pytest.FixtureRequest, tiny_dir: Path, tmp_path_factory: Any) -> Path:
    """The tiny model with a chat template that rewrites history."""
    folder = tmp_path_factory.mktemp(f"rewrites-{request.param}")
    return rewriting_model(tiny_dir, folder / "model", TEMPLATES[request.param])


@dataclass
class Run:
    """An `agentrl run` of the task by the tiny model, with what the sampler was asked
    and answered, per episode."""

    dir: Path
    task: Task
    tokenizer: PreTrainedTokenizerBase
    sampler: LocalSampler
    trajs: list[Trajectory]
    calls: dict[str, list[tuple[list[int], Completion]]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def run(model_dir: Path, tmp_path_factory: Any) -> Iterator[Run]:
    root = tmp_path_factory.mktemp("run")
    task = load_task(write_task(root / "task", root / "counter"))
    tokenizer = model_tokenizer(str(model_dir))
    assert tokenizer.chat_template in TEMPLATES.values()
    sampler = LocalSampler.for_model(str(model_dir))
    calls: dict[str, list[tuple[list[int], Completion]]] = defaultdict(list)
    generate = sampler.generate

    async def recorded(
        prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        completion = await generate(prompt_ids, params, session_id)
        calls[session_id or ""].append((list(prompt_ids), completion))
        return completion

    sampler.generate = recorded  # type: ignore[method-assign]
    out = root / "out"
    policy = SnapshotPolicy(every=1, keep_successful=1.0)
    asyncio.run(
        run_task(
            task, sampler, tokenizer, LocalProvider(), out, show_progress=False, snapshots=policy
        )
    )
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
    try:
        yield Run(out, task, tokenizer, sampler, trajs, dict(calls))
    finally:
        asyncio.run(sampler.close())
        ids = replay.snapshot_ids(trajs)
        asyncio.run(_remove_snapshots(ids))


async def _remove_snapshots(ids: list[str]) -> None:
    provider = LocalProvider()
    for i in ids:
        await provider.remove_snapshot(i)


def sampled_ledgers(trajs: list[Trajectory]) -> list[tuple[str, int]]:
    return [
        (t.trajectory_id, k)
        for t in trajs
        for k, ledger in enumerate(t.ledgers())
        if any(ledger.loss_mask)
    ]


# -- 1. the ledger check and the store -------------------------------------------------


def test_a_segmented_record_is_checked_per_segment_and_round_trips(
    run: Run, tmp_path: Path
) -> None:
    assert all(t.segments for t in run.trajs)
    store = TrajectoryStore(tmp_path / "copy.jsonl")
    for t in run.trajs:
        store.append(t.check())
    assert list(store) == run.trajs

    traj = run.trajs[0]
    bad = traj.model_copy(deep=True)
    bad.segments[0].loss_mask.pop()
    with pytest.raises(TrajectoryError, match=r"segments\[0\]\.loss_mask: length"):
        bad.check()
    bad = traj.model_copy(deep=True)
    at = bad.segments[0].loss_mask.index(1)
    bad.segments[0].logprobs[at] = 0.5
    with pytest.raises(TrajectoryError, match=rf"segments\[0\]\.logprobs\[{at}\]: 0.5"):
        bad.check()
    bad = traj.model_copy(deep=True)
    last = len(bad.turns) - 1
    bad.turns[last].segment = len(bad.ledgers())  # a ledger the episode does not have
    with pytest.raises(TrajectoryError, match=rf"turns\[{last}\]\.segment"):
        bad.check()

    # `agentrl validate` passes the file, and names the broken segment of a bad one.
    broken = tmp_path / "broken.jsonl"
    record = json.loads(traj.to_json())
    record["segments"][0]["token_versions"][at] = -1
    broken.write_text(json.dumps(record) + "\n")
    ok, bad_run = (
        subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "validate", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        for path in (run.dir / "trajectories.jsonl", broken)
    )
    assert ok.returncode == 0, ok.stderr
    assert f"{len(run.trajs)} trajectories, all valid" in ok.stdout
    assert bad_run.returncode == 1 and "Traceback" not in bad_run.stderr
    assert f"segments[0].token_versions[{at}]" in bad_run.stderr


# -- 2. what the sampler was given and what it gave back ------------------------------


def test_each_segment_begins_with_the_templates_rendering_and_keeps_sampled_ids(
    run: Run,
) -> None:
    tok = run.tokenizer
    assert len(run.trajs) == 3
    for traj in run.trajs:
        assert traj.stop_reason == StopReason.max_turns and len(traj.turns) == 3
        ledgers = traj.ledgers()
        assert len(ledgers) >= 2 and all(s.reason == "template" for s in traj.segments)
        goal = next(i for i in run.task.instances if i.id == traj.group_id).fields["name"]
        opening = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Create an empty file named {goal}."},
        ]
        for k, ledger in enumerate(ledgers):
            history = [
                m
                for t in traj.turns
                if t.segment < k
                for m in (
                    {"role": "assistant", "content": t.action},
                    {"role": "tool", "content": t.observation},
                )
            ]
            text = tok.apply_chat_template(
                opening + history, tokenize=False, add_generation_prompt=True
            )
            assert tok.decode(ledger.prompt_ids) == text
            assert ledger.prompt_ids == tok.encode(text, add_special_tokens=False)
            spans = [t.span for t in traj.turns if t.segment == k]
            sampled = {i for start, end in spans for i in range(start, end)}
            assert {i for i, m in enumerate(ledger.loss_mask) if m} == sampled
        # The sampler's answers, verbatim, each asked with the ids of its segment so far.
        calls = run.calls[traj.trajectory_id]
        assert len(calls) == len(traj.turns)
        for turn, (asked, completion) in zip(traj.turns, calls, strict=True):
            ledger, (start, end) = ledgers[turn.segment], turn.span
            assert asked == ledger.prompt_ids + ledger.response_ids[:start]
            assert ledger.response_ids[start:end] == completion.token_ids
            assert ledger.logprobs[start:end] == completion.logprobs
            assert ledger.token_versions[start:end] == completion.token_versions
            assert all(lp < 0.0 for lp in completion.logprobs)


# -- 3. every learner trains every segment --------------------------------------------


def test_fsdp_scores_every_segment_as_the_sampler_did(run: Run, model_dir: Path) -> None:
    from agentrl.backends.fsdp import FSDPConfig
    from agentrl.weights.config import LoraSpec

    samples = samples_from(run.trajs, {t.trajectory_id: 1.0 for t in run.trajs})
    assert [(s.trajectory_id, s.segment) for s in samples] == sampled_ledgers(run.trajs)
    assert len(samples) > len(run.trajs)
    sampled = sum(t.num_sampled for t in run.trajs)
    for config in (FSDPConfig(temperature=1.0), FSDPConfig(temperature=1.0, lora=LoraSpec(rank=4))):
        backend = config.build(model_dir)
        try:
            for s in samples:  # one segment at a time: each one's own mismatch
                got = backend.forward_backward([s], PPO)
                assert got["logprob_mismatch"] < MISMATCH_TOL, (s.trajectory_id, s.segment)
            whole = backend.forward_backward(samples, PPO)
            assert whole["sequences"] == len(samples) and whole["tokens"] == sampled
            assert whole["logprob_mismatch"] < MISMATCH_TOL
            # the segments a rewrite of history began, on their own
            assert any(s.segment for s in samples)
            assert whole["logprob_mismatch_rewritten"] < MISMATCH_TOL
            first_only = [s for s in samples if not s.segment]
            assert "logprob_mismatch_rewritten" not in backend.forward_backward(first_only, PPO)
        finally:
            backend.close()


def test_tinker_takes_segmented_samples_in_one_step(
    run: Run, model_dir: Path, tinker_server: TinkerServer
) -> None:
    """Through the real SDK against `agentrl serve-tinker` serving the same tiny weights:
    one step on every segment, equal to the native learner's step on them."""
    from agentrl.backends.fsdp import FSDPConfig
    from agentrl.backends.tinker import TinkerConfig

    samples = samples_from(run.trajs, {t.trajectory_id: 0.5 for t in run.trajs})
    loss = LossConfig(type="ppo", dual_clip=None)  # Tinker's ppo has no dual clip
    remote = TinkerConfig(
        base_url=tinker_server.url, base_model="tiny", lora_rank=0, lr=1e-3
    ).build()
    native = FSDPConfig(lr=1e-3, temperature=1.0).build(model_dir)
    try:
        got, want = remote.train_step(samples, loss), native.train_step(samples, loss)
    finally:
        remote.close()
        native.close()
    assert remote.step == 1
    assert got["tokens"] == want["tokens"] == sum(s.num_sampled for s in samples)
    assert got["logprob_mismatch"] < MISMATCH_TOL
    assert got["logprob_mismatch_rewritten"] < MISMATCH_TOL
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


# -- 5. replay and branching ----------------------------------------------------------


def test_the_conversation_rebuilds_every_segment(run: Run) -> None:
    for traj in run.trajs:
        rebuilt = conversation(run.task, traj, run.tokenizer).all_segments
        recorded = traj.ledgers()
        assert len(rebuilt) == len(recorded), traj.trajectory_id
        for chat, ledger in zip(rebuilt, recorded, strict=True):
            assert chat.reason == ledger.reason
            assert chat.prompt_ids == ledger.prompt_ids
            assert chat.response_ids == ledger.response_ids
            assert chat.loss_mask == ledger.loss_mask
            assert chat.logprobs == ledger.logprobs
            assert chat.versions == ledger.token_versions


def test_a_branch_inside_the_second_segment_keeps_the_tokens_before_it(run: Run) -> None:
    original = run.trajs[0]
    second = [k for k, t in enumerate(original.turns) if t.segment == 1]
    turn = second[-1]  # "first": the second segment's last turn, after others in it
    branch, divergence = asyncio.run(
        replay.branch(
            run.dir, original.trajectory_id, turn, run.sampler, run.tokenizer,
            provider=LocalProvider(),
        )
    )  # fmt: skip
    try:
        assert divergence is None
        branch.check()
        before, after = original.ledgers(), branch.ledgers()
        assert after[0] == before[0]
        start = original.turns[turn].span[0]
        for name in ("response_ids", "loss_mask", "logprobs", "token_versions"):
            assert getattr(after[1], name)[:start] == getattr(before[1], name)[:start], name
        assert after[1].prompt_ids == before[1].prompt_ids
        assert branch.turns[:turn] == original.turns[:turn]
        new = branch.turns[turn]
        assert new.segment == 1 and new.span[0] == start
        assert all(after[1].loss_mask[i] == 1 for i in range(*new.span))
    finally:
        asyncio.run(_remove_snapshots(replay.snapshot_ids([branch])))


# -- 4. `agentrl train`, both schedules -----------------------------------------------

TRAIN = """\
name: segmented
tasks: [task.yaml]
model: MODEL
provider: local
backend: {type: fsdp, lr: 1.0e-4}
dispatcher: {type: batch, concurrency: 1}
eval: {holdout_every: 4, samples: 1}
checkpoint: {every: 0, keep: 1}
seed: 3
"""
SCHEDULES = {
    "sync": "schedule: {type: sync, steps: 1, prompts_per_step: 2, n_samples_per_prompt: 2}\n",
    "async": "schedule: {type: async, steps: 1, prompts_per_step: 1, n_samples_per_prompt: 2,"
    " max_staleness_steps: 0}\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_agentrl_train_trains_every_segment(schedule: str, tiny_dir: Path, tmp_path: Path) -> None:
    model_dir = rewriting_model(tiny_dir, tmp_path / "model", TEMPLATES["every"])
    config = write_task(tmp_path / "config", tmp_path / "counter").with_name("train.yaml")
    config.write_text(TRAIN.replace("MODEL", str(model_dir)) + SCHEDULES[schedule])
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(config), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["kind"] == "train"]
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))  # read back: each one checked
    trained = [t for t in trajs if t.consumed_step == 0 and t.num_sampled]
    assert row["segments"] == sum(len(t.segments) for t in trained) > 0
    assert row["samples"] == len(sampled_ledgers(trained)) > len(trained)
    # Episodes take turns winning (see TASK): every group has a spread, so the step trains.
    assert row["skipped"] in (None, 0.0) and row["policy_version"] >= 1
    assert row["logprob_mismatch"] < MISMATCH_TOL  # on-policy: every segment as sampled
    assert row["logprob_mismatch_rewritten"] < MISMATCH_TOL
    assert row["sequences"] == row["samples"]


# -- 6. algorithm.overlong -------------------------------------------------------------


def test_overlong_masks_a_context_limit_episode_but_keeps_its_reward_in_the_baseline(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Group `a`: two episodes that ran their turns and lost (reward 0) and one that hit
    the context limit and won (reward 1). Masked, the loss never sees the third's tokens,
    yet the other two get a nonzero advantage only because its reward is in the baseline."""
    from agentrl.backends.fsdp import FSDPConfig
    from agentrl.train.run import Learner, TrainRun
    from agentrl.train_config import AlgorithmConfig

    model_dir = rewriting_model(tiny_dir, tmp_path / "model", TEMPLATES["every"])
    tok = model_tokenizer(str(model_dir))
    system = SYSTEM + " Keep it short." * 8  # a prompt over the least context_length
    opening = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Create an empty file named a.txt."},
    ]
    text = tok.apply_chat_template(opening, tokenize=False, add_generation_prompt=True)
    prompt = len(tok.encode(text, add_special_tokens=False))
    lose = TASK.replace("then touch {name}; fi", "then :; fi")
    win = TASK.replace("then touch {name}; fi", "then :; fi; touch {name}")
    cramped = win.replace(SYSTEM, system).replace(
        "context_length: 512", f"context_length: {prompt + 4}"
    )
    sampler = LocalSampler.for_model(str(model_dir))
    backend = FSDPConfig(temperature=1.0).build(model_dir)
    learner = Learner()
    seen: list[list[Sample]] = []
    train_step = backend.train_step

    def spied(samples: list[Sample], loss: LossConfig) -> dict[str, float]:
        seen.append(list(samples))
        return train_step(samples, loss)

    backend.train_step = spied  # type: ignore[method-assign]
    try:
        trajs = []
        for k, text in enumerate([lose, lose, cramped]):
            task = load_task(write_task(tmp_path / str(k), tmp_path / "counter", text))
            env = make_env(task, LocalProvider(), f"overlong-{k}")
            instance = next(i for i in task.instances if i.id == "a")
            trajs.append(asyncio.run(run_episode(task, instance, k, sampler, tok, env)))
        assert [t.stop_reason for t in trajs] == [
            StopReason.max_turns, StopReason.max_turns, StopReason.context_limit
        ]  # fmt: skip
        assert [t.reward for t in trajs] == [0.0, 0.0, 1.0]
        assert [t.trajectory_id for t in trajs] == ["a_0", "a_1", "a_2"]
        for overlong in ("mask", "train"):
            algorithm = AlgorithmConfig(overlong=overlong)
            step = TrainRun(  # what learn() reads: the algorithm, learner, backend, sampler
                config=_Config(algorithm),  # type: ignore[arg-type]
                out=tmp_path, tasks=[], train=[], held=[], learner=learner, backend=backend,
                sampler=sampler, tokenizer=tok, envs=[],  # type: ignore[arg-type]
                metrics=None, store=None, progress=None, run_id="test",  # type: ignore[arg-type]
            )  # fmt: skip
            row = asyncio.run(step.learn(trajs))
            (samples,) = seen
            seen.clear()
            advantages = compute_advantages(trajs, algorithm.advantage)
            assert advantages["a_0"] == advantages["a_1"] < 0.0  # a_2's win is the baseline
            assert all(s.advantage == advantages[s.trajectory_id] for s in samples)
            trained = trajs[:2] if overlong == "mask" else trajs
            assert {s.trajectory_id for s in samples} == {t.trajectory_id for t in trained}
            assert row["samples"] == len(samples) == len(sampled_ledgers(trained))
            assert row["overlong_masked"] == (1 if overlong == "mask" else 0)
    finally:
        learner.shutdown()
        backend.close()
        asyncio.run(sampler.close())


@dataclass
class _Config:
    """The part of a TrainConfig that `TrainRun.learn` reads."""

    algorithm: Any
