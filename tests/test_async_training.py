"""The fully-async schedule: the staleness budget, filtering, epochs, resume, versions.

The budget's counters are checked property-based (hypothesis): as a state machine over
every interleaving of admissions, finishes, consumption and steps, and under random
timings with real asyncio tasks. The whole-run tests train a tiny randomly initialised
Llama with the real FSDP backend, the real pipeline dispatcher and real sandboxes (the
`local` provider, so no Docker); only generation is simulated
(`agentrl.inference.simulated`: no GPU here), which lets each test script every
episode's reward and duration. The simulated sampler publishes as a server paused with
"keep" does: in-flight requests wait, then decode on under the new version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.async_schedule import Admission, BudgetError, Group, GroupBuffer
from agentrl.backends.fsdp import FSDPConfig
from agentrl.dispatch.base import PipelineConfig
from agentrl.errors import ConfigError
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler
from agentrl.tasks.load import load_task
from agentrl.train_config import AsyncSchedule, CheckpointConfig, EvalConfig, TrainConfig
from agentrl.trainer import Trainer
from agentrl.trajectory import TrajectoryStore

TASK = Path(__file__).parent / "data" / "async" / "task.yaml"
WIN = "```bash\ntouch ok\n```"
LOSE = "```bash\ntrue\n```"


# --- the budget as a state machine --------------------------------------------------


class BudgetMachine(RuleBasedStateMachine):
    """Any order of events the controller can produce keeps every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.adm: Admission | None = None

    @precondition(lambda self: self.adm is None)
    @rule(b=st.integers(1, 4), s=st.integers(0, 3))
    def start(self, b: int, s: int) -> None:
        self.adm = Admission(b, s)

    @precondition(lambda self: self.adm is not None and self.adm.can_admit())
    @rule()
    def admit(self) -> None:
        assert self.adm is not None
        assert self.adm.admit() == self.adm.step

    @precondition(lambda self: self.adm is not None and self.adm.running > 0)
    @rule(keep=st.booleans())
    def finish(self, keep: bool) -> None:
        assert self.adm is not None
        self.adm.finish(keep=keep)

    @precondition(
        lambda self: self.adm is not None and self.adm.buffered >= self.adm.groups_per_step
    )
    @rule()
    def train_a_step(self) -> None:
        assert self.adm is not None
        self.adm.consume(self.adm.groups_per_step)
        self.adm.advance()

    @precondition(lambda self: self.adm is not None and self.adm.running == 0)
    @rule()
    def end_the_epoch(self) -> None:
        assert self.adm is not None
        partial = self.adm.buffered % self.adm.groups_per_step
        self.adm.drop(partial) if self.adm.buffered < self.adm.groups_per_step else None

    @invariant()
    def counters_hold(self) -> None:
        if self.adm is None:
            return
        a = self.adm
        a.check()  # raises BudgetError
        assert a.submitted == a.accepted + a.filtered + a.running
        assert a.buffered + a.running <= a.groups_per_step * (a.max_staleness + 1)
        if a.running == 0 and a.buffered == 0:  # an empty pipeline can always admit
            assert a.can_admit()


TestBudgetMachine = BudgetMachine.TestCase
TestBudgetMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_the_budget_refuses_what_would_break_it() -> None:
    adm = Admission(2, 0)
    adm.admit()
    adm.admit()
    with pytest.raises(BudgetError, match="beyond the budget"):
        adm.admit()
    with pytest.raises(BudgetError, match="consume 2 of 0"):
        adm.consume(2)
    resumed = Admission.resumed(2, 1, step=3)
    assert resumed.counters() == {
        "submitted": 6,
        "accepted": 6,
        "filtered": 0,
        "running": 0,
        "buffered": 0,
    }
    assert resumed.limit == (1 + 3 + 1) * 2


# --- the buffer under random timings --------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3),
    s=st.integers(0, 3),
    durations=st.lists(st.floats(0.0, 0.004), min_size=6, max_size=30),
    kept=st.lists(st.booleans(), min_size=30, max_size=30),
    train_s=st.floats(0.0, 0.003),
    seed=st.integers(0, 1000),
)
def test_the_buffer_keeps_the_budget_under_random_timings(
    b: int, s: int, durations: list[float], kept: list[bool], train_s: float, seed: int
) -> None:
    """Producer, group tasks and trainer run concurrently with random durations and
    random filtering; epochs of len(durations) prompts; the run must end (no deadlock)."""
    rng = random.Random(seed)

    async def main() -> tuple[GroupBuffer, list[tuple[int, int]]]:
        buf = GroupBuffer(Admission(b, s))
        consumed: list[tuple[int, int]] = []  # (scheduled, consumed step)
        groups: list[asyncio.Task[None]] = []

        async def run_group(g: Group, d: float, keep: bool) -> None:
            await asyncio.sleep(d)
            await buf.finish(g, keep=keep)

        async def produce() -> None:
            for epoch in range(2):
                for i, d in enumerate(durations):
                    step = await buf.admit()
                    g = Group(len(groups), epoch, f"p{i}", step, 1)
                    groups.append(asyncio.create_task(run_group(g, d * rng.random(), kept[i])))
                await buf.end_epoch()

        producer = asyncio.create_task(produce())
        epochs_closed = 0
        while epochs_closed < 2:
            batch, epoch_end = await buf.take(b)
            if epoch_end:
                assert len(batch) < b
                epochs_closed += 1
                await buf.next_epoch()
                continue
            step = buf.admission.step
            consumed += [(g.scheduled_step, step) for g in batch]
            await asyncio.sleep(train_s)
            await buf.advance()
        await asyncio.wait_for(producer, 5)
        await asyncio.gather(*groups)
        return buf, consumed

    buf, consumed = asyncio.run(asyncio.wait_for(main(), 30))
    for row in buf.timeline:  # every recorded moment
        assert row["submitted"] == row["accepted"] + row["filtered"] + row["running"]
        assert row["buffered"] + row["running"] <= b * (s + 1)
        assert row["accepted"] + row["running"] <= (s + row["step"] + 1) * b
    if s == 0:  # generation never runs ahead of its update
        assert all(scheduled == step for scheduled, step in consumed)
    assert buf.admission.running == 0
    assert buf.admission.submitted == 2 * len(durations)


# --- whole runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=49152,  # the embedded tokenizer's
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def outcome_by_sample(session: str) -> bool:
    """Default policy: even samples win, odd lose (every group has a reward spread)."""
    return int(session.rsplit("_", 1)[1]) % 2 == 0


def train(
    out: Path,
    model: Path,
    *,
    steps: int = 3,
    groups: int = 2,
    samples: int = 2,
    staleness: int = 1,
    wins: Callable[[str], bool] = outcome_by_sample,
    tokens: Callable[[str], int] = lambda session: 40,
    resume: bool = False,
    crash_after_publishes: int | None = None,
    **schedule: Any,
) -> tuple[dict[str, Any], SimulatedSampler]:
    """One async run of the probe task; returns (summary, the sampler it used)."""

    def script(session: str) -> Script:
        return Script(replies=[WIN if wins(session) else LOSE], tokens=[tokens(session)])

    sampler = SimulatedSampler(script, load_tokenizer(), LatencyModel(base_s=0.002))
    if crash_after_publishes is not None:
        publish = sampler.update_weights

        def failing(state: Any, version: int) -> None:
            if sampler.publishes >= crash_after_publishes:
                raise RuntimeError("injected crash while publishing")
            publish(state, version)

        sampler.update_weights = failing  # type: ignore[method-assign]
    config = TrainConfig(
        name="async-probe",
        tasks=[str(TASK)],
        model=str(model),
        backend=FSDPConfig(lr=1e-3, micro_batch_tokens=4096),
        schedule=AsyncSchedule(
            type="async",
            steps=steps,
            prompts_per_step=groups,
            n_samples_per_prompt=samples,
            max_staleness_steps=staleness,
            **schedule,
        ),
        dispatcher=PipelineConfig(concurrency=32),
        eval=EvalConfig(holdout_every=4, samples=1),
        checkpoint=CheckpointConfig(every=1, keep=1),
        provider="local",
    )
    trainer = Trainer(config, [load_task(TASK)], out, show_progress=False, sampler=sampler)
    return asyncio.run(trainer.run(resume=resume)), sampler


def rows(out: Path, kind: str = "train") -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_s0_never_lets_generation_run_ahead_of_its_update(
    tmp_path: Path, tiny_dir: Path
) -> None:
    summary, sampler = train(tmp_path, tiny_dir, steps=3, staleness=0)
    assert summary["steps"] == 3 and summary["schedule"] == "async"
    train_rows = rows(tmp_path)
    assert [r["lag"] for r in train_rows] == [{"0": 2}] * 3
    trajs = [t for t in TrajectoryStore(tmp_path / "trajectories.jsonl")]
    assert len(trajs) == 3 * 2 * 2 and all(t.consumed_step is not None for t in trajs)
    # Version v + 1 is published before step v's groups exist: every token of a group
    # consumed at step c was sampled by the weights published after step c - 1.
    first = train_rows[0]["policy_version"] - 1  # the version published at start
    for t in trajs:
        assert t.scheduled_step == t.consumed_step
        sampled = {v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m}
        assert sampled == {first + t.consumed_step}
    assert all(r["tokens_by_age"] == {"0": r["sampled_tokens"]} for r in train_rows)
    for r in train_rows:  # the invariant is in every row, as logged
        assert r["submitted"] == r["accepted"] + r["filtered"] + r["running"]
        assert r["buffered"] + r["running"] <= 2
    assert (tmp_path / "async.png").stat().st_size > 0
    timeline = [json.loads(x) for x in (tmp_path / "admission.jsonl").read_text().splitlines()]
    assert timeline and all(r["buffered"] + r["running"] <= 2 for r in timeline)
