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
import functools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentrl.backends.fsdp import FSDPConfig
from agentrl.dispatch.base import PipelineConfig
from agentrl.errors import ConfigError
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import SnapshotPolicy
from agentrl.train import Trainer
from agentrl.train.admission import Admission, BudgetError, Group, GroupBuffer
from agentrl.train_config import AsyncSchedule, CheckpointConfig, EvalConfig, TrainConfig
from agentrl.trajectory import TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


@functools.cache
def tokenizer() -> PreTrainedTokenizerBase:
    """The embedded tokenizer, loaded once for every run of this module."""
    return load_tokenizer()


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
    crash_after: int | None = None,
    hold: Callable[[str], Awaitable[None]] | None = None,
    box: list[SimulatedSampler] | None = None,
    checkpoint_every: int = 0,
    mid_reply: bool = False,
    snapshots: int = 0,
    **schedule: Any,
) -> tuple[dict[str, Any], SimulatedSampler]:
    """One async run of the probe task; returns (summary, the sampler it used).

    `crash_after`: publications that succeed before one raises. `hold(session)` runs
    before each request is sampled (to hold an episode back). `box` receives the sampler.
    `checkpoint_every`: 0 saves only after the last step (what resume needs is tested
    with 1). `mid_reply`: each publication after the first waits (up to 2 s) until a
    reply has been decoding for 0.2 s, so it lands mid-reply even where a loaded machine
    makes the training step outlast every reply.
    """

    def script(session: str) -> Script:
        return Script(replies=[WIN if wins(session) else LOSE], tokens=[tokens(session)])

    # mid_reply: replies slow enough (300 tokens: 3 s) to outlast a training step even on a
    # loaded machine, so a publication finds one decoding (seen: at 0.6 s, none did)
    latency = LatencyModel(base_s=0.01 if mid_reply else 0.002)
    sampler = SimulatedSampler(script, tokenizer(), latency)
    if box is not None:
        box.append(sampler)
    if crash_after is not None:
        publish = sampler.update_weights

        def failing(state: Any, version: int) -> None:
            if sampler.publishes >= crash_after:
                raise RuntimeError("injected crash while publishing")
            publish(state, version)

        sampler.update_weights = failing  # type: ignore[method-assign]
    if hold is not None:
        generate = sampler.generate

        async def held(prompt_ids: list[int], params: Any, session_id: str | None = None) -> Any:
            await hold(session_id or "")
            return await generate(prompt_ids, params, session_id)

        sampler.generate = held  # type: ignore[method-assign]
    if mid_reply:
        starts: list[float] = []  # when each reply in flight began
        decode, publish_now = sampler.generate, sampler.update_weights

        async def timed(prompt_ids: list[int], params: Any, session_id: str | None = None) -> Any:
            start = time.monotonic()
            starts.append(start)
            try:
                return await decode(prompt_ids, params, session_id)
            finally:
                starts.remove(start)

        def publish_mid_reply(state: Any, version: int) -> None:
            deadline = time.monotonic() + 2.0
            while sampler.publishes and time.monotonic() < deadline:
                if any(time.monotonic() - s > 0.2 for s in list(starts)):
                    break
                time.sleep(0.005)
            publish_now(state, version)

        sampler.generate = timed  # type: ignore[method-assign]
        sampler.update_weights = publish_mid_reply  # type: ignore[method-assign]
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
        checkpoint=CheckpointConfig(every=checkpoint_every, keep=1),
        provider="local",
        snapshots=SnapshotPolicy(every=snapshots) if snapshots else None,
    )
    trainer = Trainer(config, [load_task(TASK)], out, show_progress=False, sampler=sampler)
    return asyncio.run(trainer.run(resume=resume)), sampler


def rows(out: Path, kind: str = "train") -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_s0_never_lets_generation_run_ahead_of_its_update(tmp_path: Path, tiny_dir: Path) -> None:
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


HELD = {f"p{i:02d}" for i in range(0, 20, 4)}  # the held-out instances (evaluation)


def sample_of(session: str) -> int:
    return int(session.rsplit("_", 1)[1])


def test_a_group_that_outlives_the_budget_is_trained_with_a_warning(
    tmp_path: Path, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first group's episodes wait until 3 steps are published; S = 1 lets the run go
    on without it; it arrives with lag > S, is trained on, and its lag is recorded."""
    sampler_box: list[SimulatedSampler] = []

    async def held_back(session: str) -> None:
        if session.split("_")[0] not in HELD and sample_of(session) < 2:  # group 0
            while sampler_box[0].publishes < 4:  # the start's publication + 3 steps
                await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="agentrl.train"):
        train(tmp_path, tiny_dir, steps=5, groups=1, staleness=1, hold=held_back, box=sampler_box)
    train_rows = rows(tmp_path)
    assert len(train_rows) == 5
    late = [r for r in train_rows if r["stale_groups"]]
    assert len(late) == 1 and late[0]["lag_max"] >= 3 and late[0]["step"] >= 4
    assert "exceeds max_staleness_steps 1 (trained on)" in caplog.text
    for r in train_rows:  # the budget held all the same
        assert r["buffered"] + r["running"] <= 2
    trained = [t for t in TrajectoryStore(tmp_path / "trajectories.jsonl") if t.consumed_step]
    group0 = [t for t in trained if sample_of(t.trajectory_id) < 2]
    assert len(group0) == 2 and all(t.scheduled_step == 0 for t in group0)


def test_zero_variance_groups_are_filtered_and_free_their_slots(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """Prompts p01-p07 always lose (no signal): filtered, replaced, never trained; S = 0
    and a full budget of such groups would deadlock if filtering kept their slots."""
    losers = {f"p{i:02d}" for i in range(1, 8)}

    def wins(session: str) -> bool:
        return session.split("_")[0] not in losers and outcome_by_sample(session)

    train(tmp_path, tiny_dir, steps=4, groups=2, staleness=0, wins=wins)
    train_rows = rows(tmp_path)
    assert len(train_rows) == 4
    trained_prompts = {p for r in train_rows for p in r["prompts"]}
    assert not {p.split(":")[1] for p in trained_prompts} & losers
    assert train_rows[-1]["filtered"] > 0
    trajs = list(TrajectoryStore(tmp_path / "trajectories.jsonl"))
    filtered = [t for t in trajs if t.consumed_step is None]
    assert filtered and {t.group_id for t in filtered} <= losers
    assert all(t.reward == 0.0 for t in filtered)


def test_an_all_zero_reward_dataset_ends_with_a_clear_error_not_a_hang(
    tmp_path: Path, tiny_dir: Path
) -> None:
    with pytest.raises(ConfigError, match="epoch 0 could not fill one mini-batch: 15 of its"):
        train(tmp_path, tiny_dir, steps=2, groups=2, staleness=0, wins=lambda s: False)
    end = rows(tmp_path, "epoch_end")
    assert all(row.pop("rss_mb") > 0 for row in end)  # every row says the memory in use
    assert end == [
        {
            "kind": "epoch_end",
            "step": 0,
            "epoch": 0,
            "trained_prompts": 0,
            "filtered_prompts": 15,
            "partial_batch": [],
        }
    ]
    # Unfiltered, the same data trains (steps without a gradient are skipped, not stuck).
    summary, _ = train(
        tmp_path / "unfiltered",
        tiny_dir,
        steps=2,
        groups=2,
        staleness=0,
        wins=lambda s: False,
        filter_zero_variance=False,
    )
    assert summary["steps"] == 2
    assert all(
        r["skipped"] == "no group had a reward spread" for r in rows(tmp_path / "unfiltered")
    )


def test_an_epoch_that_cannot_fill_a_batch_ends_with_its_partial_batch_reported(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """15 training prompts in mini-batches of 4 groups: 3 steps, then 3 groups left over
    (reported, not trained); epoch 1 starts with a fresh permutation."""
    train(tmp_path, tiny_dir, steps=4, groups=4, staleness=1)
    ends = rows(tmp_path, "epoch_end")
    assert len(ends) == 1 and ends[0]["step"] == 3 and ends[0]["trained_prompts"] == 12
    assert len(ends[0]["partial_batch"]) == 3
    train_rows = rows(tmp_path)
    assert [r["epoch"] for r in train_rows] == [0, 0, 0, 1]
    epoch0 = [p for r in train_rows[:3] for p in r["prompts"]]
    assert len(set(epoch0)) == 12  # no prompt twice in an epoch
    assert not set(ends[0]["partial_batch"]) & set(epoch0)


def test_resume_after_a_crash_mid_epoch_skips_exactly_the_consumed_prompts(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """A crash while publishing step 4 (checkpoint of step 3 complete, groups in flight
    and filtered after it); the resumed run trains steps 4-6 on prompts none of which
    was trained or filtered before the checkpoint, and never repeats one."""
    losers = {"p01", "p02", "p03"}

    def wins(session: str) -> bool:
        return session.split("_")[0] not in losers and outcome_by_sample(session)

    with pytest.raises(RuntimeError, match="injected crash"):
        train(
            tmp_path,
            tiny_dir,
            steps=6,
            groups=2,
            staleness=1,
            wins=wins,
            crash_after=4,
            checkpoint_every=1,
        )
    before = rows(tmp_path)
    assert [r["step"] for r in before] == [1, 2, 3]
    meta = (tmp_path / "checkpoints" / "step-000003" / "meta.json").read_text()
    ckpt = json.loads(meta)["extra"]
    used = set(ckpt["trained_prompts"]) | set(ckpt["filtered_prompts"])
    assert set(ckpt["trained_prompts"]) == {p for r in before for p in r["prompts"]}

    train(
        tmp_path,
        tiny_dir,
        steps=6,
        groups=2,
        staleness=1,
        wins=wins,
        resume=True,
        checkpoint_every=1,
    )
    after = rows(tmp_path)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
    assert after[:3] == before  # the lines of steps 1-3 were kept as they were
    resumed_prompts = [p for r in after[3:] for p in r["prompts"]]
    assert not set(resumed_prompts) & used
    all_prompts = [p for r in after for p in r["prompts"]]
    assert len(all_prompts) == len(set(all_prompts)) == 12  # one epoch: none twice
    trajs = list(TrajectoryStore(tmp_path / "trajectories.jsonl"))
    ids = [t.trajectory_id for t in trajs]
    assert len(ids) == len(set(ids))
    groups: dict[str, set[int | None]] = {}
    for t in trajs:  # every stored group was trained once, or filtered once
        groups.setdefault(t.group_id, set()).add(t.consumed_step)
    assert all(len(steps) == 1 for steps in groups.values())


def test_with_replay_points_groups_a_crash_left_unconsumed_are_taken_from_the_journal(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """The same crash with `snapshots: every 1`: the groups admitted and not consumed by
    the checkpoint (back, or still out) are readmitted with their ids; those back come as
    they were (the step the crash cut short trains on the same episodes), those out go on
    from their last snapshot; nothing is trained twice and every token's version is one
    the resumed run has."""
    kw: dict[str, Any] = dict(steps=6, groups=2, staleness=1, checkpoint_every=1, snapshots=1)

    async def hold(session: str) -> None:  # groups 8 and 9 are still out at the crash
        await asyncio.sleep(60 if sample_of(session) >= 16 else 0)

    with pytest.raises(RuntimeError, match="injected crash"):
        train(tmp_path, tiny_dir, crash_after=4, hold=hold, **kw)
    journal = tmp_path / "inflight.jsonl"
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    back = {x["t"]: x["done"] for x in lines if "done" in x}
    out = {x["t"] for x in lines if "open" in x} - set(back)
    assert back, "no group was back and unconsumed at the crash"
    meta = json.loads((tmp_path / "checkpoints" / "step-000003" / "meta.json").read_text())
    assert meta["extra"]["policy_version"] == 4  # v1 published first, then after steps 1-3

    train(tmp_path, tiny_dir, resume=True, **kw)
    after = rows(tmp_path)
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
    trajs = {t.trajectory_id: t for t in TrajectoryStore(tmp_path / "trajectories.jsonl")}
    assert len(trajs) == len(list(TrajectoryStore(tmp_path / "trajectories.jsonl")))
    taken = [tid for tid in back if tid in trajs]
    assert taken, "no episode that was back came from the journal"
    for tid in taken:  # as they were, bar when and where they were consumed
        kept = json.loads(trajs[tid].to_json())
        assert {k: v for k, v in kept.items() if k not in ("consumed_step", "grade_file")} == {
            k: v for k, v in back[tid].items() if k not in ("consumed_step", "grade_file")
        }
    assert out and all(trajs[tid].resumed_at == [0] for tid in out)  # from INIT's snapshot
    groups: dict[str, set[int | None]] = {}
    for t in trajs.values():  # every stored group was trained once, or filtered once
        groups.setdefault(t.group_id, set()).add(t.consumed_step)
    assert all(len(steps) == 1 for steps in groups.values())


def test_with_staleness_replies_span_publications_and_each_token_keeps_its_version(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """S = 2 and long replies: publications land mid-reply (pause keep); the ledger then
    shows two versions in one reply, never one newer than the consuming step's."""
    train(tmp_path, tiny_dir, steps=4, groups=1, staleness=2, tokens=lambda s: 300, mid_reply=True)
    train_rows = rows(tmp_path)
    first = train_rows[0]["policy_version"] - 1
    trained = [
        t for t in TrajectoryStore(tmp_path / "trajectories.jsonl") if t.consumed_step is not None
    ]
    spanning = 0
    for t in trained:
        sampled = [v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m]
        assert sampled == sorted(sampled)
        assert first + t.scheduled_step <= sampled[0] and sampled[-1] <= first + t.consumed_step
        spanning += len(set(sampled)) > 1
    assert spanning > 0
    ages = {int(k) for r in train_rows for k in r["tokens_by_age"]}
    assert max(ages) >= 1
    assert max(int(k) for r in train_rows for k in r["lag"]) >= 1
