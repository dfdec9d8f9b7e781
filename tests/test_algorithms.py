"""Advantages and losses against values worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from agentrl.algorithms import (
    AdvantageConfig,
    GroupStats,
    LossConfig,
    aggregate,
    compute_advantages,
    group_stats,
    loss_denominators,
    policy_loss,
)
from agentrl.errors import TrajectoryError
from agentrl.trajectory import StopReason, Trajectory

F64 = torch.float64


def traj(tid: str, reward: float | None, group: str = "g", *, failed: bool = False) -> Trajectory:
    """One sampled token; an infra failure has a zero mask and no reward."""
    if failed:
        return Trajectory(
            trajectory_id=tid,
            group_id=group,
            task="t",
            prompt_ids=[1],
            response_ids=[5],
            loss_mask=[0],
            logprobs=[0.0],
            token_versions=[-1],
            reward=None,
            stop_reason=StopReason.sandbox_error,
        )
    return Trajectory(
        trajectory_id=tid,
        group_id=group,
        task="t",
        prompt_ids=[1],
        response_ids=[5],
        loss_mask=[1],
        logprobs=[-0.5],
        token_versions=[0],
        reward=reward,
        stop_reason=StopReason.finished,
    )


def assert_grad(leaf: torch.Tensor, expected: list[list[float]]) -> None:
    assert leaf.grad is not None
    torch.testing.assert_close(leaf.grad, torch.tensor(expected, dtype=F64))


def group(name: str, rewards: list[float]) -> list[Trajectory]:
    return [traj(f"{name}_{i}", r, name) for i, r in enumerate(rewards)]


def advantages(trajectories: list[Trajectory], **config: object) -> list[float]:
    adv = compute_advantages(trajectories, AdvantageConfig.model_validate(config))
    return [adv[t.trajectory_id] for t in trajectories]


# --- advantages ---------------------------------------------------------------------------


def test_grpo_divides_by_the_sample_std_per_group():
    batch = group("a", [1, 0, 0, 1]) + group("b", [2, 0, 1])
    # a: mean 0.5, deviations +-0.5, sample var 4 * 0.25 / 3 = 1/3, std 1/sqrt(3)
    #    -> +-0.5 * sqrt(3) = +-sqrt(3)/2.  (population std would give +-1.)
    # b: mean 1, deviations 1, -1, 0, sample var 2 / 2 = 1 -> 1, -1, 0.
    h = math.sqrt(3) / 2
    assert advantages(batch, eps=0.0) == pytest.approx([h, -h, -h, h, 1, -1, 0])
    # eps=1e-6 only nudges: 0.5 / (0.57735 + 1e-6)
    assert advantages(batch)[0] == pytest.approx(0.5 / (1 / math.sqrt(3) + 1e-6), rel=1e-12)


def test_grpo_without_std_and_dr_grpo_only_subtract_the_group_mean():
    batch = group("a", [1, 0, 0, 1]) + group("b", [2, 0, 1])
    expected = [0.5, -0.5, -0.5, 0.5, 1, -1, 0]
    assert advantages(batch, normalize_std=False) == pytest.approx(expected)
    assert advantages(batch, estimator="dr_grpo") == pytest.approx(expected)


def test_rloo_subtracts_the_mean_of_the_others():
    batch = group("a", [1, 0, 0, 1]) + group("b", [2, 0, 1])
    # a: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3
    # b: 2 - (0+1)/2 = 1.5 ; 0 - (2+1)/2 = -1.5 ; 1 - (2+0)/2 = 0
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0]
    assert advantages(batch, estimator="rloo") == pytest.approx(expected)


def test_reinforce_uses_one_baseline_for_the_whole_batch():
    batch = group("a", [1, 0]) + group("b", [1, 1])
    # baseline (1+0+1+1)/4 = 0.75; group b has no variance but still gets 1 - 0.75
    assert advantages(batch, estimator="reinforce") == pytest.approx([0.25, -0.75, 0.25, 0.25])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("rewards", [[0, 0, 0, 0], [1, 1, 1], [0.1, 0.1, 0.1], [7]])
def test_groups_without_signal_get_exactly_zero(estimator, rewards):
    # [0.1]*3 has a float mean of 0.10000000000000002: without the exact rule, eps=0 would
    # divide rounding noise by ~0.
    eps = {"eps": 0.0} if estimator == "grpo" else {}
    got = advantages(group("a", rewards), estimator=estimator, **eps)
    assert got == [0.0] * len(rewards)
    assert all(not math.isnan(a) for a in got)


def test_a_single_trainable_episode_under_reinforce_gets_zero():
    batch = [traj("a_0", 0.3, "a"), traj("a_1", None, "a", failed=True)]
    assert advantages(batch, estimator="reinforce") == [0.0, 0.0]


def test_infra_failures_enter_no_statistic_and_get_zero():
    batch = [traj("a_0", 1.0, "a"), traj("a_1", 0.0, "a"), traj("a_2", None, "a", failed=True)]
    # trainable [1, 0]: mean 0.5, sample var (0.25+0.25)/1 = 0.5, std sqrt(0.5)
    # -> +-0.5/sqrt(0.5) = +-sqrt(0.5). (Counting the failure as reward 0 would give 2/sqrt(3)...)
    s = math.sqrt(0.5)
    assert advantages(batch, eps=0.0) == pytest.approx([s, -s, 0.0])
    assert advantages(batch, estimator="dr_grpo") == pytest.approx([0.5, -0.5, 0.0])
    assert advantages(batch, estimator="rloo") == pytest.approx([1.0, -1.0, 0.0])
    assert advantages(batch, estimator="reinforce") == pytest.approx([0.5, -0.5, 0.0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_a_non_finite_reward_names_the_trajectory(bad):
    batch = [traj("q-7_0", 1.0, "q-7"), traj("q-7_1", bad, "q-7")]
    with pytest.raises(TrajectoryError, match=r"'q-7_1': reward .* is not finite") as info:
        compute_advantages(batch, AdvantageConfig())
    assert "\n" not in info.value.message and info.value.fix


def test_a_repeated_trajectory_id_is_rejected():
    with pytest.raises(TrajectoryError, match="'a_0': appears twice"):
        compute_advantages([traj("a_0", 1.0), traj("a_0", 0.0)], AdvantageConfig())


def test_group_stats_counts_groups_without_signal_and_failures():
    batch = (
        [traj("a_0", 1.0, "a"), traj("a_1", 0.0, "a"), traj("a_2", None, "a", failed=True)]
        + group("b", [1, 1])
        + group("c", [0.5])
        + [traj("d_0", None, "d", failed=True)]
    )
    # a varies; b all equal; c is a group of one; d has no trainable episode
    assert group_stats(batch) == GroupStats(
        groups=3, zero_variance_groups=2, trainable=5, infra_failed=2
    )


@pytest.mark.parametrize(
    "config",
    [
        {"estimator": "rloo", "normalize_std": False},
        {"estimator": "dr_grpo", "eps": 0.1},
        {"estimator": "ppo"},
        {"eps": -1.0},
        {"normalise_std": False},
    ],
)
def test_bad_advantage_configs_are_rejected(config):
    with pytest.raises(ValidationError):
        AdvantageConfig.model_validate(config)


@pytest.mark.parametrize(
    "config",
    [
        {"dual_clip": 1.0},
        {"clip_low": 0.0},
        {"clip_low": 1.0},
        {"clip_high": -0.1},
        {"type": "tis", "tis_cap": 0.0},
        {"kl_coef": -0.01},
        {"type": "tis", "clip_low": 0.1},
        {"type": "cross_entropy", "dual_clip": 2.0},
        {"tis_cap": 3.0},
        {"aggregation": "seq-mean"},
        {"clip": 0.2},
    ],
)
def test_bad_loss_configs_are_rejected(config):
    with pytest.raises(ValidationError):
        LossConfig.model_validate(config)


# --- losses -------------------------------------------------------------------------------


def with_ratios(ratios: list[list[float]], old: float = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A leaf `logprobs` and `old_logprobs` such that exp(logprobs - old) == ratios."""
    old_B_T = torch.full((len(ratios), len(ratios[0])), old, dtype=F64)
    lp_B_T = (old_B_T + torch.tensor(ratios, dtype=F64).log()).requires_grad_()
    return lp_B_T, old_B_T


def test_ppo_clips_both_sides_and_dual_clips_negative_advantages():
    lp, old = with_ratios([[1.0, 1.5, 0.5, 1.1], [1.0, 1.5, 0.5, 4.0]])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    mask = torch.ones(2, 4, dtype=F64)
    loss, m = policy_loss(lp, old, adv, mask, LossConfig(), total_tokens=8, total_seqs=2)
    # bounds [0.8, 1.28].  A=+1: max(-r, -clip r) = -min(r, clip r)
    #   r=1 -> -1 ; r=1.5 -> -1.28 (clipped) ; r=0.5 -> -0.5 ; r=1.1 -> -1.1    sum -3.88
    # A=-1: max(r, clip r), then min(., 3)
    #   r=1 -> 1 ; r=1.5 -> 1.5 ; r=0.5 -> 0.8 (clipped) ; r=4 -> 4 -> 3 (dual)  sum 6.3
    assert loss.item() == pytest.approx((-3.88 + 6.3) / 8)
    assert m["pg_loss"] == m["loss"] == pytest.approx(0.3025)
    assert m["clip_high_frac"] == m["clip_low_frac"] == m["dual_clip_frac"] == 1 / 8
    assert m["ratio_mean"] == pytest.approx((1 + 1.5 + 0.5 + 1.1 + 1 + 1.5 + 0.5 + 4) / 8)
    assert m["tokens"] == 8.0 and all(type(v) is float for v in m.values())
    loss.backward()
    # unclipped tokens: d(-A r)/d logprob = -A r, over 8 tokens; clipped ones: 0
    expected = [[-1.0, 0.0, -0.5, -1.1], [1.0, 1.5, 0.0, 0.0]]
    assert_grad(lp, [[g / 8 for g in row] for row in expected])


def test_ppo_without_dual_clip_lets_negative_advantages_grow():
    lp, old = with_ratios([[1.0, 4.0]])
    adv = torch.tensor([-2.0], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    loss, m = policy_loss(
        lp, old, adv, mask, LossConfig(dual_clip=None), total_tokens=2, total_seqs=1
    )
    # -A r = 2 * 1 and 2 * 4 -> (2 + 8) / 2
    assert loss.item() == pytest.approx(5.0)
    assert "dual_clip_frac" not in m
    loss.backward()
    assert_grad(lp, [[2 * 1.0 / 2, 2 * 4.0 / 2]])


def test_tis_weights_are_truncated_and_held_constant():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0 + math.log(2), -2.0, -0.5 - math.log(3)]], dtype=F64)
    adv = torch.tensor([2.0], dtype=F64)
    config = LossConfig(type="tis", tis_cap=2.0)
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 3), config, total_tokens=3, total_seqs=1)
    # ratios 0.5, 1, 3 -> w 0.5, 1, 2 (capped); -w*A*lp = 1.0, 4.0, 2.0 -> 7/3
    assert loss.item() == pytest.approx(7 / 3)
    assert m["tis_capped_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # gradient -w*A / 3: no term from differentiating w
    assert_grad(lp, [[-1 / 3, -2 / 3, -4 / 3]])


def test_importance_sampling_weights_are_not_truncated():
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0 + math.log(2), -2.0, -0.5 - math.log(3)]], dtype=F64)
    adv = torch.tensor([2.0], dtype=F64)
    config = LossConfig(type="importance_sampling")
    loss, _ = policy_loss(lp, old, adv, torch.ones(1, 3), config, total_tokens=3, total_seqs=1)
    # ratios 0.5, 1, 3 (not capped); -rho*A = -1, -2, -6 -> -9/3
    assert loss.item() == pytest.approx(-3.0)
    loss.backward()
    # d(-rho A)/d lp = -rho A / 3
    assert_grad(lp, [[-1 / 3, -2 / 3, -6 / 3]])


def test_cross_entropy_ignores_advantages_and_padding():
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([100.0, -100.0], dtype=F64)
    config = LossConfig(type="cross_entropy")
    loss, _ = policy_loss(lp, lp.detach(), adv, mask, config, total_tokens=3, total_seqs=2)
    assert loss.item() == pytest.approx((1 + 2 + 3) / 3)
    loss.backward()
    assert_grad(lp, [[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]])


def test_kl_k1_and_k3_are_added_with_their_coefficient():
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    mask = torch.ones(1, 2)
    adv = torch.zeros(1, dtype=F64)
    common = {"total_tokens": 2, "total_seqs": 1, "ref_logprobs_B_T": ref}
    # cross-entropy part: (1 + 2) / 2 = 1.5
    k1 = LossConfig(type="cross_entropy", kl_coef=0.5, kl_estimator="k1")
    loss, m = policy_loss(lp, lp.detach(), adv, mask, k1, **common)
    # k1 = lp - ref = 0.5, -1.0 -> mean -0.25, times 0.5
    assert m["kl_mean"] == pytest.approx(-0.25)
    assert m["kl_loss"] == pytest.approx(-0.125)
    assert loss.item() == pytest.approx(1.375)

    k3 = LossConfig(type="cross_entropy", kl_coef=0.5)
    loss, m = policy_loss(lp, lp.detach(), adv, mask, k3, **common)
    # ref - lp = -0.5, 1.0; k3 = e^x - x - 1
    kl = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]  # 0.10653, 0.71828
    assert m["kl_mean"] == pytest.approx((kl[0] + kl[1]) / 2)
    assert loss.item() == pytest.approx(1.5 + 0.5 * (kl[0] + kl[1]) / 2)
    loss.backward()
    # d/dlp: -1 (cross-entropy) + 0.5 * (1 - e^(ref - lp)), over 2 tokens
    expected = [(-1 + 0.5 * (1 - math.exp(-0.5))) / 2, (-1 + 0.5 * (1 - math.exp(1.0))) / 2]
    assert_grad(lp, [expected])


def test_kl_needs_reference_logprobs_and_is_only_reported_at_coef_zero():
    lp, old = with_ratios([[1.0]])
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, 1)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(lp, old, adv, mask, LossConfig(kl_coef=0.1), total_tokens=1, total_seqs=1)
    loss, m = policy_loss(
        lp, old, adv, mask, LossConfig(), total_tokens=1, total_seqs=1, ref_logprobs_B_T=old - 1
    )
    assert loss.item() == pytest.approx(-1.0)  # -A * ratio, nothing added
    assert m["kl_mean"] == pytest.approx(math.exp(-1) + 1 - 1) and "kl_loss" not in m


def test_shapes_are_checked():
    lp, old = with_ratios([[1.0, 1.0]])
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(
            lp, old, torch.ones(1), torch.ones(1, 3), LossConfig(), total_tokens=1, total_seqs=1
        )
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        policy_loss(
            lp, old, torch.ones(2), torch.ones(1, 2), LossConfig(), total_tokens=1, total_seqs=1
        )


# --- aggregation and masks ----------------------------------------------------------------


def test_aggregations_count_only_sampled_tokens():
    nan = float("nan")
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, nan, 100.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # 4 sampled tokens; 2 sequences have any (the fully masked third contributes nothing)
    assert loss_denominators(mask) == (4.0, 2.0)
    d = {"total_tokens": 4.0, "total_seqs": 2.0}
    assert aggregate(loss, mask, "token-mean", **d).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum", **d).item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-mean", **d).item() == pytest.approx(
        (6 / 3 + 4 / 1) / 2
    )
    with pytest.raises(ValueError, match="skip the step"):
        aggregate(loss, mask, "token-mean", total_tokens=0.0, total_seqs=0.0)


def test_padding_values_never_reach_loss_or_gradient():
    inf, nan = float("inf"), float("nan")
    lp = torch.tensor([[-1.0, -inf, nan], [-0.5, -2.0, -inf]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0, nan, 0.0], [-0.5, -2.0, -inf]], dtype=F64)
    ref = torch.tensor([[-1.0, nan, inf], [-0.5, -2.0, nan]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    config = LossConfig(kl_coef=0.1)
    loss, m = policy_loss(
        lp, old, adv, mask, config, total_tokens=3, total_seqs=2, ref_logprobs_B_T=ref
    )
    # all ratios 1, KL 0 on sampled tokens: (-1 + 1 + 1) / 3
    assert loss.item() == pytest.approx(1 / 3)
    assert all(math.isfinite(v) for v in m.values())
    loss.backward()
    assert_grad(lp, [[-1 / 3, 0.0, 0.0], [1 / 3, 1 / 3, 0.0]])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_type", ["ppo", "tis", "importance_sampling", "cross_entropy"])
def test_micro_batches_sum_to_the_full_batch(aggregation, loss_type):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 6, generator=g, dtype=F64) * 3).requires_grad_()
    old = lp.detach() + (torch.rand(4, 6, generator=g, dtype=F64) - 0.5)
    ref = lp.detach() + (torch.rand(4, 6, generator=g, dtype=F64) - 0.5)
    adv = torch.tensor([1.5, -0.5, -2.0, 0.7], dtype=F64)
    lengths = torch.tensor([[6], [2], [0], [4]])  # ragged; the third sequence is fully masked
    mask = (torch.arange(6) < lengths).to(F64)
    config = LossConfig(type=loss_type, aggregation=aggregation, kl_coef=0.05)
    tokens, seqs = loss_denominators(mask)
    assert (tokens, seqs) == (12.0, 3.0)

    full, _ = policy_loss(
        lp, old, adv, mask, config, total_tokens=tokens, total_seqs=seqs, ref_logprobs_B_T=ref
    )
    (full_grad,) = torch.autograd.grad(full, lp)
    parts = [
        policy_loss(
            lp[s], old[s], adv[s], mask[s], config,
            total_tokens=tokens, total_seqs=seqs, ref_logprobs_B_T=ref[s],
        )[0]
        for s in (slice(0, 2), slice(2, 4))
    ]  # fmt: skip
    (parts_grad,) = torch.autograd.grad(parts[0] + parts[1], lp)
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)
    assert torch.allclose(parts_grad, full_grad, rtol=1e-12, atol=1e-15)
