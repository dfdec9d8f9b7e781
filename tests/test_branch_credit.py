"""Turn-level credit from sandbox branches (`estimator: branch`).

The estimator's arithmetic on built trajectories; then the real machinery on the local
provider (no Docker): a scripted task whose per-turn success probabilities are known by
construction (tests/data/branch), episodes and their continuations through the pipeline
dispatcher, snapshots restored and reclaimed; then whole training runs, sync and async,
through the real FSDP backend on a tiny model. The sampler is simulated (its replies are
the script's, drawn per session): what is tested is the machinery, not a model.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from agentrl.algorithm_config import AdvantageConfig, BranchConfig, LossConfig
from agentrl.algorithms import branch_credit, compute_advantages, policy_loss, state_keys
from agentrl.backends.base import samples_from
from agentrl.backends.config import FSDPConfig
from agentrl.dispatch import PipelineConfig
from agentrl.dispatch.stream import progress_bars
from agentrl.episode import make_env
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler
from agentrl.sandbox.local import LocalProvider, snapshots_dir
from agentrl.tasks.env import EpisodeEnv
from agentrl.tasks.load import load_task
from agentrl.train import Trainer
from agentrl.train.branches import branch_sampled_tokens, branch_turns
from agentrl.train.data import Prompt
from agentrl.train.run import TrainRun
from agentrl.train_config import (
    AlgorithmConfig,
    AsyncSchedule,
    CheckpointConfig,
    EvalConfig,
    SyncSchedule,
    TrainConfig,
)
from agentrl.trajectory import BranchOf, StopReason, Trajectory, TrajectoryStore, Turn

TASK = Path(__file__).parent / "data" / "branch" / "task.yaml"
P = (0.5, 0.8, 0.6)  # the chance the policy's turn t is good
V = [math.prod(P[t:]) for t in range(3)]  # value of a clean state before turn t: .24 .48 .6


# --- the estimator on built trajectories -------------------------------------------------


def built(
    tid: str,
    reward: float,
    turns: int,
    *,
    group: str = "g",
    branch_of: BranchOf | None = None,
    moves: str = "",
) -> Trajectory:
    """A trajectory of `turns` turns, each 2 sampled tokens and 1 observation token; turn
    k's first token is `moves[k]`'s code where given (the same for every trajectory else)."""
    response, mask, spans = [], [], []
    for k in range(turns):
        spans.append((len(response), len(response) + 2))
        response += [ord(moves[k]) if k < len(moves) else 10 + k, 20 + k, 99]
        mask += [1, 1, 0]
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        task="t",
        prompt_ids=[1, 2, 3],
        response_ids=response,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        token_versions=[0 if m else -1 for m in mask],
        reward=reward,
        stop_reason=StopReason.max_turns,
        turns=[Turn(action=f"a{k}", span=s) for k, s in enumerate(spans)],
        branch_of=branch_of,
    ).check()


def continuation(
    parent: str, turn: int, k: int, reward: float, turns: int = 3, moves: str = ""
) -> Trajectory:
    return built(
        f"{parent}~{turn}-{k}",
        reward,
        turns,
        branch_of=BranchOf(trajectory_id=parent, turn=turn, purpose="value"),
        moves=moves,
    )


BRANCH = AdvantageConfig(estimator="branch")
GRPO = AdvantageConfig(estimator="grpo")


def test_without_branches_every_turn_gets_grpos_advantage_bit_for_bit() -> None:
    group = [built("a", 1.0, 3), built("b", 0.0, 3), built("c", 0.0, 2)]
    credit = branch_credit(group, BRANCH)
    grpo = compute_advantages(group, GRPO)
    assert credit.outcome == grpo
    for t in group:
        assert credit.per_turn[t.trajectory_id] == [grpo[t.trajectory_id]] * len(t.turns)
    # ... and the samples carry it on exactly the sampled tokens
    (s,) = samples_from([group[0]], credit.outcome, credit.per_turn)
    assert s.advantages_T() == [grpo["a"] if m else 0.0 for m in s.loss_mask]


def test_turn_advantages_are_value_differences_that_sum_to_grpos() -> None:
    a, b = built("a", 1.0, 3), built("b", 0.0, 3)
    conts = [continuation("a", 1, k, r) for k, r in enumerate([1.0, 0.0, 1.0, 1.0])]
    conts += [continuation("a", 2, k, r) for k, r in enumerate([1.0, 1.0])]
    credit = branch_credit([a, b, *conts], BRANCH)
    sigma = math.sqrt(0.5) + BRANCH.eps  # the group's sample std of {1, 0}
    assert credit.values[("a", 1)] == (0.75, 4) and credit.values[("a", 2)] == (1.0, 2)
    expected = [(0.75 - 0.5) / sigma, (1.0 - 0.75) / sigma, (1.0 - 1.0) / sigma]
    assert credit.per_turn["a"] == pytest.approx(expected)
    assert sum(credit.per_turn["a"]) == pytest.approx(compute_advantages([a, b], GRPO)["a"])
    # b has no branched state: GRPO's advantage on every turn
    assert credit.per_turn["b"] == [compute_advantages([a, b], GRPO)["b"]] * 3
    # Continuations are in no group: the outcome advantages are the fresh episodes' alone.
    assert credit.outcome["a"] == compute_advantages([a, b], GRPO)["a"]
    # A turn between branched states gets its whole segment's difference.
    only_two = branch_credit([a, b, *conts[4:]], BRANCH)
    assert only_two.per_turn["a"] == pytest.approx([0.5 / sigma, 0.5 / sigma, 0.0])


def test_a_states_value_never_includes_the_episodes_own_reward() -> None:
    conts = [continuation("a", 1, k, r) for k, r in enumerate([1.0, 0.0])]
    won = branch_credit([built("a", 1.0, 3), built("b", 0.0, 3), *conts], BRANCH)
    lost = branch_credit([built("a", 0.0, 3), built("b", 1.0, 3), *conts], BRANCH)
    assert won.values == lost.values == {("a", 1): (0.5, 2)}


def test_a_group_with_equal_rewards_still_learns_from_its_branches() -> None:
    """All four failed, but the state after a's first turn wins half the time: its first
    turn is credited and the rest blamed; GRPO would give every token 0. With no spread to
    normalize by, the credit is the raw value difference (no batch std amplifies it)."""
    group = [built(x, 0.0, 3) for x in "abcd"]
    conts = [continuation("a", 1, k, r) for k, r in enumerate([1.0, 0.0])]
    credit = branch_credit([*group, *conts], BRANCH)
    assert all(v == 0.0 for v in compute_advantages(group, GRPO).values())
    first, second, third = credit.per_turn["a"]
    assert first == 0.5 and second == third == -first
    others = [built(x, r, 3, group="h") for x, r in (("e", 1.0), ("f", 0.0))]  # spread elsewhere
    assert branch_credit([*group, *conts, *others], BRANCH).per_turn["a"] == [0.5, -0.5, -0.5]
    assert credit.per_turn["b"] == [0.0] * 3


def test_each_turns_tokens_carry_that_turns_advantage() -> None:
    t = built("a", 1.0, 3)
    (s,) = samples_from([t], {"a": 9.0}, {"a": [0.1, -0.2, 0.3]})
    for u, a in zip(t.turns, [0.1, -0.2, 0.3], strict=True):
        start, end = 3 + u.span[0], 3 + u.span[1]  # after the 3 prompt tokens
        assert s.advantages_T()[start:end] == [a] * (end - start)
    assert [a for a, m in zip(s.advantages_T(), s.loss_mask, strict=True) if not m] == [0.0] * (
        len(s.tokens) - s.num_sampled
    )


def test_continuations_train_on_their_own_turns_only_when_asked() -> None:
    a, b = built("a", 1.0, 3), built("b", 0.0, 3)
    conts = [continuation("a", 2, k, r) for k, r in enumerate([1.0, 0.0])]
    trained = AdvantageConfig(estimator="branch", branch=BranchConfig(train=True))
    credit = branch_credit([a, b, *conts], trained)
    sigma = math.sqrt(0.5) + BRANCH.eps
    assert credit.per_turn["a~2-0"] == pytest.approx([0.0, 0.0, 0.5 / sigma])
    assert credit.per_turn["a~2-1"] == pytest.approx([0.0, 0.0, -0.5 / sigma])
    assert branch_credit([a, b, *conts], BRANCH).per_turn["a~2-0"] == [0.0] * 3


def test_a_continuations_sample_trains_only_what_it_sampled_itself() -> None:
    cont = continuation("a", 2, 0, 1.0)
    (s,) = samples_from([cont], {cont.trajectory_id: 0.7}, {cont.trajectory_id: [0, 0, 0.7]})
    own = 3 + cont.turns[2].span[0]  # the prompt pads 3 tokens
    assert s.loss_mask[:own] == [0] * own and s.sampler_logprobs[:own] == [0.0] * own
    assert s.loss_mask[own : own + 2] == [1, 1] and s.num_sampled == 2
    assert s.advantages_T()[own : own + 2] == [0.7, 0.7] and not any(s.advantages_T()[:own])
    assert branch_sampled_tokens(cont) == 2


def test_per_token_advantages_reach_the_loss_as_the_broadcast_scalar_would() -> None:
    lp = torch.tensor([[-1.0, -0.5, -0.2, -0.3]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.4, -0.2, -0.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    cfg = LossConfig()
    scalar, _ = policy_loss(lp, old, torch.tensor([0.8]), mask, cfg, total_tokens=3, total_seqs=1)
    per_token, _ = policy_loss(
        lp, old, torch.full((1, 4), 0.8), mask, cfg, total_tokens=3, total_seqs=1
    )
    assert float(scalar.detach()) == pytest.approx(float(per_token.detach()))
    mixed, _ = policy_loss(
        lp, old, torch.tensor([[0.0, 0.8, -0.8, 0.8]]), mask, cfg, total_tokens=3, total_seqs=1
    )
    assert float(mixed.detach()) != pytest.approx(float(scalar.detach()))


def test_branch_options_belong_to_the_branch_estimator() -> None:
    with pytest.raises(ValueError, match="only read by estimator branch"):
        AdvantageConfig(estimator="grpo", branch=BranchConfig())
    with pytest.raises(ValueError, match="not read by select every"):
        BranchConfig(select="every", count=2)
    assert AdvantageConfig(estimator="branch").branch == BranchConfig()


def test_episodes_commit_what_branching_and_replay_need() -> None:
    from agentrl.snapshots import Snapshots
    from agentrl.tasks.spec import SnapshotPolicy

    branching = Snapshots(SnapshotPolicy(every=0), branching=2)
    assert [n for n in range(7) if branching.due(n)] == [2, 4, 6] and branching.held
    assert not branching.due(4, last=True)  # no turn follows: nothing to branch from
    both = Snapshots(SnapshotPolicy(every=3), branching=2)
    assert [n for n in range(7) if both.due(n)] == [0, 2, 3, 4, 6]
    assert both.due(3, last=True) and not Snapshots(SnapshotPolicy(every=3)).held


def test_which_states_are_branched() -> None:
    t = built("a", 0.0, 4)
    for u in t.turns:
        u.snapshot_id = f"snap-{u.action}"
    assert branch_turns(t, BranchConfig(select="every", every=1)) == [1, 2, 3]
    assert branch_turns(t, BranchConfig(select="every", every=2)) == [2]
    assert branch_turns(t, BranchConfig(select="count", count=2)) == [1, 2]
    t.logprobs[t.turns[2].span[0]] = -5.0  # the least certain reply: turn 2
    assert branch_turns(t, BranchConfig(select="uncertain", count=1)) == [2, 3]
    t.turns[1].snapshot_id = None  # no snapshot after turn 1: no state before turn 2
    assert branch_turns(t, BranchConfig(select="every")) == [1, 3]


POOL = AdvantageConfig(estimator="branch", branch=BranchConfig(pool=True))


def test_pooled_siblings_that_took_the_same_turns_are_samples_of_each_others_states() -> None:
    """a and c won, b lost, all three by the same turns: no branch, yet each state has a
    value from the siblings that passed it, leaving the episode's own reward out."""
    group = [built("a", 1.0, 3), built("b", 0.0, 3), built("c", 1.0, 3)]
    assert branch_credit(group, BRANCH).per_turn["a"] == [compute_advantages(group, GRPO)["a"]] * 3
    credit = branch_credit(group, POOL)
    sigma = math.sqrt(1 / 3) + POOL.eps  # the group's sample std of {1, 0, 1}
    mean = 2 / 3
    assert credit.per_turn["a"] == pytest.approx([(0.5 - mean) / sigma, 0.0, 0.5 / sigma])
    assert credit.per_turn["b"] == pytest.approx([(1 - mean) / sigma, 0.0, -1 / sigma])
    for t in group:  # the differences still telescope to GRPO's advantage
        grpo = compute_advantages(group, GRPO)[t.trajectory_id]
        assert sum(credit.per_turn[t.trajectory_id]) == pytest.approx(grpo)
    assert sorted(n for _, n in credit.values.values()) == [3, 3]  # states 1 and 2, 3 each


def test_pooling_keeps_apart_what_differs_by_one_token_or_one_observation() -> None:
    a, b = built("a", 1.0, 3, moves="xyz"), built("b", 0.0, 3, moves="xqz")
    credit = branch_credit([a, b], POOL)
    sigma = math.sqrt(0.5) + POOL.eps
    # they share the state after turn 0 only: a's value there is b's reward alone, and
    # a's turns 1 and 2 share the difference to its own reward
    assert credit.per_turn["a"] == pytest.approx([-0.5 / sigma, 1 / sigma, 1 / sigma])
    b.turns[0].observation = "a different answer"
    assert branch_credit([a, b], POOL).per_turn["a"] == [compute_advantages([a, b], GRPO)["a"]] * 3
    # another group's identical turns are another instance's states
    c = built("c", 1.0, 3, moves="xyz", group="h")
    assert branch_credit([a, b, c], POOL).per_turn["a"] == pytest.approx(
        [compute_advantages([a, b], GRPO)["a"]] * 3
    )


def test_a_continuation_is_a_sample_of_every_state_it_passes_from_its_branch_point() -> None:
    a, b = built("a", 1.0, 3, moves="xyz"), built("b", 0.0, 3, moves="wqz")
    # restored before a's turn 1, it went its own way ("q", then "z") and lost
    cont = continuation("a", 1, 0, 0.0, moves="xqz")
    credit = branch_credit([a, b, cont], POOL)
    # a's state 1 ("x") has the continuation's 0; state 2 ("xy") none: a's turns 1-2 get
    # the difference to its own reward
    sigma = math.sqrt(0.5) + POOL.eps
    assert credit.per_turn["a"] == pytest.approx([-0.5 / sigma, 1 / sigma, 1 / sigma])
    # b never shared a state with either (its first turn differs): GRPO's advantage
    assert credit.per_turn["b"] == [compute_advantages([a, b], GRPO)["b"]] * 3
    # the continuation's state "xq" is a sample for no one else; it trains only if asked
    assert credit.per_turn[cont.trajectory_id] == [0.0] * 3


def test_a_pooled_state_is_branched_once_and_only_for_what_its_siblings_do_not_give() -> None:
    from agentrl.train.branches import branch_points

    group = [
        built(x, r, 3, moves=m)
        for x, r, m in (("a", 1.0, "xyz"), ("b", 0.0, "xyq"), ("c", 0.0, "xwz"), ("d", 1.0, "vvv"))
    ]
    for t in group:
        for u in t.turns:
            u.snapshot_id = f"snap-{t.trajectory_id}-{u.action}"
    plain = branch_points(group, BranchConfig(k=2))
    assert [(p.trajectory_id, turn, n) for p, turn, n in plain] == [
        (x, turn, 2) for x in "abcd" for turn in (1, 2)
    ]
    pooled = branch_points(group, BranchConfig(k=2, pool=True))
    # "x" passed by a, b, c (2 free samples each): none; "xy" by a and b: one more, from a;
    # "xw" (c), "v" and "vv" (d): two each
    assert [(p.trajectory_id, turn, n) for p, turn, n in pooled] == [
        ("a", 2, 1),
        ("c", 2, 2),
        ("d", 1, 2),
        ("d", 2, 2),
    ]


# --- the machinery on the local provider -------------------------------------------------


@functools.cache
def tokenizer() -> Any:
    return load_tokenizer()


def reply(session: str) -> Script:
    """The policy: from its first turn on (0, or the turn it was branched at), turn t is
    `touch s<t>` with probability P[t], else `touch bad`; drawn from the session id, so
    every episode and continuation is reproducible and independent."""
    start = int(session.split("~")[1].split("-")[0]) if "~" in session else 0
    rng = random.Random(session)
    names = [f"s{t}" if rng.random() < P[t] else "bad" for t in range(start, 3)]
    replies = [f"```bash\ntouch {name}; ls\n```" for name in names]
    return Script(replies=replies, tokens=[4] * len(replies))


def train_run(
    out: Path,
    branch: BranchConfig,
    *,
    snapshots: dict[str, Any] | None = None,
    env: EpisodeEnv | None = None,
) -> TrainRun:
    """What a training run has for rollouts (no learner: these tests train nothing)."""
    config = TrainConfig(
        name="branch-probe",
        tasks=[str(TASK)],
        algorithm=AlgorithmConfig(advantage=AdvantageConfig(estimator="branch", branch=branch)),
        schedule=SyncSchedule(steps=1, prompts_per_step=4, n_samples_per_prompt=4),
        dispatcher=PipelineConfig(concurrency=32),
        provider="local",
        snapshots=snapshots,
    )
    task = load_task(TASK)
    none = cast(Any, None)
    return TrainRun(
        config=config,
        out=out,
        tasks=[task],
        train=none,
        held=none,
        learner=none,
        backend=none,
        sampler=none,
        tokenizer=tokenizer(),
        envs=[env or make_env(task, LocalProvider(), "branch-test")],
        metrics=none,
        store=none,
        progress=progress_bars(False),
        run_id="branch-test",
    )


async def branched_rollout(run: TrainRun, instances: int, samples: int) -> list[Trajectory]:
    """`samples` episodes of each of the first `instances`, branched as `run` says."""
    sampler = SimulatedSampler(reply, tokenizer(), LatencyModel(base_s=0.0005))
    branches = run.branches(sampler)
    prompts = [Prompt(task=0, instance=inst) for inst in run.tasks[0].instances[:instances]]
    episodes = run.make_episodes(prompts, samples, sampler, branches=branches)
    return await run.rollout_groups(episodes, samples, "rollout", branches)


def rollout(run: TrainRun, instances: int, samples: int) -> list[Trajectory]:
    return asyncio.run(branched_rollout(run, instances, samples))


def snapshot_dirs() -> set[str]:
    root = snapshots_dir()
    return {p.name for p in root.iterdir()} if root.exists() else set()


@pytest.mark.slow  # 216 episodes on the local provider: ~45 s on 2 cores
def test_branch_values_match_the_known_state_values_and_restore_the_state_before_the_turn(
    tmp_path: Path,
) -> None:
    before = snapshot_dirs()
    run = train_run(tmp_path, BranchConfig(k=4))
    trajs = rollout(run, instances=6, samples=4)
    fresh = [t for t in trajs if t.branch_of is None]
    conts = [t for t in trajs if t.branch_of is not None]
    assert len(fresh) == 24 and all(t.trainable and len(t.turns) == 3 for t in fresh)
    assert len(conts) == 24 * 2 * 4 and all(t.trainable for t in conts)
    parents = {t.trajectory_id: t for t in fresh}

    # (b) Every continuation started from the state before its turn t: its first listing
    # is its parent's listing after turn t - 1 plus the one file it touched itself.
    for c in conts:
        assert c.branch_of is not None
        parent, t = parents[c.branch_of.trajectory_id], c.branch_of.turn
        restored = set(parent.turns[t - 1].observation.split())
        touched = c.turns[t].action.split("touch ")[1].split(";")[0]
        assert set(c.turns[t].observation.split()) == restored | {touched}
        assert f"s{t}" not in restored
        assert [u.action for u in c.turns[:t]] == [u.action for u in parent.turns[:t]]

    # (a) The estimates, pooled over clean states, lie within 4 standard errors of the
    # true values; a state where `bad` exists is worth exactly 0.
    credit = branch_credit(trajs, AdvantageConfig(estimator="branch"))
    for t in (1, 2):
        clean, dirty = [], []
        for (pid, turn), (value, n) in credit.values.items():
            if turn != t:
                continue
            bad = any("touch bad" in u.action for u in parents[pid].turns[:t])
            (dirty if bad else clean).append((value, n))
        assert all(value == 0.0 for value, _ in dirty)
        n = sum(k for _, k in clean)
        mean = sum(v * k for v, k in clean) / n
        assert n >= 20 and abs(mean - V[t]) <= 4 * math.sqrt(V[t] * (1 - V[t]) / n), (t, mean, n)

    # (c) A continuation's sample trains only its own turns; its prefix is mask 0.
    cont = conts[0]
    assert cont.branch_of is not None
    first = cont.turns[cont.branch_of.turn]
    (s,) = samples_from([cont], {cont.trajectory_id: 1.0})
    own = len(cont.prompt_ids) + first.span[0]
    assert not any(s.loss_mask[:own]) and not any(s.sampler_logprobs[:own])
    assert s.num_sampled == branch_sampled_tokens(cont) > 0

    # (e) Snapshots were held for the branches, then all reclaimed (the run keeps none for
    # replay: the task asks for none) and recorded as none.
    assert all(u.snapshot_id is None for t in trajs for u in t.turns)
    assert snapshot_dirs() <= before


@pytest.mark.slow  # ~100 episodes on the local provider
def test_pooled_branching_samples_each_state_k_times_with_fewer_continuations(
    tmp_path: Path,
) -> None:
    """With `pool`, siblings that touched the same files in the same order share states:
    each state is branched once, for what they do not give, so every fresh episode's
    branched states still have k samples besides its own, and the values stay right."""
    before = snapshot_dirs()
    trajs = rollout(train_run(tmp_path, BranchConfig(k=4, pool=True)), instances=6, samples=4)
    fresh = [t for t in trajs if t.branch_of is None]
    conts = [t for t in trajs if t.branch_of is not None]
    assert len(fresh) == 24 and all(t.trainable for t in conts)
    assert 0 < len(conts) < 24 * 2 * 4  # what branching every episode's states would take
    credit = branch_credit(
        trajs, AdvantageConfig(estimator="branch", branch=BranchConfig(pool=True))
    )
    for t in fresh:
        keys = state_keys(t, True)
        for u in (1, 2):
            assert credit.values[keys[u]][1] - 1 >= 4, (t.trajectory_id, u)
    passer = {state_keys(t, True)[u]: t for t in trajs for u in (1, 2)}
    for u in (1, 2):  # clean states (no `bad` yet), over the batch: within 4 standard errors
        clean = [
            (v, n)
            for key, (v, n) in credit.values.items()
            if key[1] == u and not any("touch bad" in w.action for w in passer[key].turns[:u])
        ]
        n = sum(k for _, k in clean)
        mean = sum(v * k for v, k in clean) / n
        assert abs(mean - V[u]) <= 4 * math.sqrt(V[u] * (1 - V[u]) / n), (u, mean, n)
    assert snapshot_dirs() <= before


def test_the_replay_policys_snapshots_stay_and_the_rest_are_reclaimed(tmp_path: Path) -> None:
    before = snapshot_dirs()
    run = train_run(tmp_path, BranchConfig(k=1, select="every", every=1), snapshots={"every": 2})
    trajs = rollout(run, instances=2, samples=4)
    fresh = [t for t in trajs if t.branch_of is None]
    kept = set()
    for t in fresh:
        ids = [u.snapshot_id for u in t.turns]
        if t.reward == 1.0:  # a success outside keep_successful keeps nothing
            assert ids == [None] * 3 and t.env.init_snapshot is None
        else:  # a failure keeps what `every: 2` commits: INIT and after turn 2 (index 1)
            assert ids[0] is None and ids[1] is not None and t.env.init_snapshot is not None
            kept |= {ids[1], t.env.init_snapshot}
    assert kept and snapshot_dirs() - before == kept
    asyncio.run(_remove(kept))


async def _remove(ids: set[str]) -> None:
    for sid in ids:
        await LocalProvider().remove_snapshot(sid)


# --- whole training runs -----------------------------------------------------------------


def trainer_run(out: Path, model: Path, schedule: Any) -> dict[str, Any]:
    config = TrainConfig(
        name="branch-probe",
        tasks=[str(TASK)],
        model=str(model),
        backend=FSDPConfig(lr=1e-3, micro_batch_tokens=4096),
        algorithm=AlgorithmConfig(
            advantage=AdvantageConfig(estimator="branch", branch=BranchConfig(k=2))
        ),
        schedule=schedule,
        dispatcher=PipelineConfig(concurrency=32),
        eval=EvalConfig(holdout_every=4, samples=1),
        checkpoint=CheckpointConfig(every=0, keep=1),
        provider="local",
    )
    sampler = SimulatedSampler(reply, tokenizer(), LatencyModel(base_s=0.0005))
    trainer = Trainer(config, [load_task(TASK)], out, show_progress=False, sampler=sampler)
    return cast(dict[str, Any], asyncio.run(trainer.run()))


@pytest.mark.parametrize(
    "schedule",
    [
        SyncSchedule(steps=2, prompts_per_step=2, n_samples_per_prompt=2),
        AsyncSchedule(
            type="async",
            steps=2,
            prompts_per_step=2,
            n_samples_per_prompt=2,
            max_staleness_steps=1,
            filter_zero_variance=False,
        ),  # fmt: skip
    ],
    ids=["sync", "async"],
)
def test_training_with_branch_credit_end_to_end(
    tmp_path: Path, tiny_dir: Path, schedule: Any
) -> None:
    before = snapshot_dirs()
    summary = trainer_run(tmp_path, tiny_dir, schedule)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    trajs = list(TrajectoryStore(tmp_path / "trajectories.jsonl"))
    fresh = [t for t in trajs if t.branch_of is None]
    conts = [t for t in trajs if t.branch_of is not None]
    assert len(fresh) == 2 * 2 * 2 and all(t.consumed_step is not None for t in trajs)
    # Two continuations from before turns 1 and 2 of each episode, stored with provenance.
    assert len(conts) == len(fresh) * 2 * 2
    assert {c.branch_of.trajectory_id for c in conts if c.branch_of} == {
        t.trajectory_id for t in fresh
    }
    for r in train:
        assert r["episodes"] == 4  # the fresh episodes: continuations are not the batch
        assert r["branch_episodes"] == 4 * 2 * 2 and r["branch_infra_failures"] == 0
        mine = [c for c in conts if c.consumed_step == r["step"] - 1]
        assert r["branch_sampled_tokens"] == sum(branch_sampled_tokens(c) for c in mine) > 0
        assert r["branch_states"] == 8 and set(r["branch_values"]) == {"1", "2"}
        assert r["branch_restore_p50_s"] is not None
        assert r["turn_adv_pos_frac"] is not None and r["turn_adv_neg_frac"] is not None
    assert any(r.get("skipped") == 0.0 and r["grad_norm"] > 0 for r in train)  # trained
    assert snapshot_dirs() <= before  # every held snapshot reclaimed
