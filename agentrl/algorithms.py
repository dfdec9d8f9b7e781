"""Advantages and policy losses: what the trainer makes of a batch of trajectories.

Advantages, one scalar per trajectory (broadcast over its sampled tokens), compare
rewards within a group (the episodes of one prompt, `group_id`):

- grpo (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean r) / (std r + eps), std the
  sample standard deviation (n - 1, as verl and TRL); A_i = r_i - mean r without
  `normalize_std`.
- dr_grpo (Liu et al. 2025, "Understanding R1-Zero-like training"): A_i = r_i - mean r;
  dividing by the std over-weights prompts that are almost always solved or failed.
- rloo (Ahmadian et al. 2024): A_i = r_i - mean of the other n - 1 rewards.
- reinforce: A_i = r_i - b, with b the mean reward over the whole batch.

- branch (turn-level credit from sandbox branches, `branch_credit`): GRPO's outcome
  advantage split over an episode's turns by values estimated from restored sandboxes.

Rewards that are all equal carry no signal: their advantages are exactly 0.0 (never
rounding noise amplified by 1 / eps), and so is a group of one. An infrastructure
failure (`not trajectory.trainable`) is not the agent's outcome: it enters no statistic
and gets 0.0 (its loss mask is zero anyway).

Losses, per sampled token, with ratio rho = exp(logprob - old_logprob) against the
sampler's rollout logprobs:

- ppo: max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)) with asymmetric bounds
  (DAPO's clip-higher); where A < 0 it is also capped at -A * dual_clip (dual-clip PPO,
  Ye et al. 2020), so a token the policy has made very likely cannot dominate the batch.
- tis: -w A logprob with w = min(rho, tis_cap) held constant, so the gradient is
  w A grad(logprob): truncated importance sampling corrects the mismatch between sampler
  and trainer probabilities (Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"). Its value is a surrogate; only its gradient means
  something.
- importance_sampling: -rho A, whose gradient is rho A grad(logprob): the untruncated
  correction (Tinker's `importance_sampling`).
- cross_entropy: -logprob (supervised warm-up; advantages are ignored).

Optionally + kl_coef * KL(policy || reference) per token, estimated (Schulman 2020) by
k1 = logprob - ref or k3 = exp(ref - logprob) - (ref - logprob) - 1.

`aggregate` divides by denominators of the whole batch (`loss_denominators`), never of
a micro-batch, so micro-batches (split along B) sum exactly to the full-batch loss.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentrl.algorithm_config import AdvantageConfig, Aggregation, LossConfig
from agentrl.errors import TrajectoryError
from agentrl.trajectory import Trajectory


@dataclass(frozen=True)
class GroupStats:
    """Counts worth logging for a batch."""

    groups: int  # groups with at least one trainable episode
    zero_variance_groups: int  # of those, groups whose rewards are all equal (one included)
    trainable: int
    infra_failed: int


def _rewards_by_group(trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """group_id -> trajectory_id -> reward of the trainable episodes; rejects bad rewards."""
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    seen: set[str] = set()
    for t in trajectories:
        if t.trajectory_id in seen:
            raise TrajectoryError(
                f"trajectory {t.trajectory_id!r}: appears twice in one batch",
                fix="give every episode its own trajectory_id (e.g. '<instance>_<sample>')",
            )
        seen.add(t.trajectory_id)
        if not t.trainable:
            continue
        if t.reward is None or not math.isfinite(t.reward):
            raise TrajectoryError(
                f"trajectory {t.trajectory_id!r}: reward {t.reward} is not finite",
                fix="make the grader return a finite number, or end the episode with "
                "stop_reason eval_error when grading failed",
            )
        groups[t.group_id][t.trajectory_id] = t.reward
    return groups


def sample_std(rewards: Sequence[float]) -> float:
    """The sample standard deviation (n - 1); 0.0 for fewer than two."""
    n = len(rewards)
    if n < 2:
        return 0.0
    mean = math.fsum(rewards) / n
    return math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / (n - 1))


def _centered(rewards: list[float], config: AdvantageConfig) -> list[float]:
    n = len(rewards)
    if n < 2 or min(rewards) == max(rewards):  # no signal: exactly zero, not eps-scaled noise
        return [0.0] * n
    total = math.fsum(rewards)
    mean = total / n
    if config.estimator == "rloo":
        return [r - (total - r) / (n - 1) for r in rewards]
    if config.estimator in ("grpo", "branch") and config.normalize_std:
        return [(r - mean) / (sample_std(rewards) + config.eps) for r in rewards]
    return [r - mean for r in rewards]


def compute_advantages(
    trajectories: Sequence[Trajectory], config: AdvantageConfig
) -> dict[str, float]:
    """Advantage of every trajectory, keyed by trajectory_id (0.0 for infra failures).

    Continuations (`branch_of`) enter no group: the outcome advantage is the fresh
    episodes'; `branch_credit` gives continuations theirs."""
    groups = _rewards_by_group([t for t in trajectories if t.branch_of is None])
    if config.estimator == "reinforce":
        pools = [{tid: r for group in groups.values() for tid, r in group.items()}]
    else:
        pools = list(groups.values())
    advantages = {t.trajectory_id: 0.0 for t in trajectories}
    for pool in pools:
        advantages.update(zip(pool, _centered(list(pool.values()), config), strict=True))
    return advantages


def group_stats(trajectories: Sequence[Trajectory]) -> GroupStats:
    """How many groups the batch has, and how many of them carry no signal (its fresh
    episodes; continuations belong to no group)."""
    trajectories = [t for t in trajectories if t.branch_of is None]
    groups = _rewards_by_group(trajectories)
    trainable = sum(len(group) for group in groups.values())
    return GroupStats(
        groups=len(groups),
        zero_variance_groups=sum(min(g.values()) == max(g.values()) for g in groups.values()),
        trainable=trainable,
        infra_failed=len(trajectories) - trainable,
    )


@dataclass(frozen=True)
class BranchCredit:
    """What the branch estimator makes of a batch."""

    outcome: dict[str, float]  # GRPO's advantage per trajectory (continuations: 0.0)
    per_turn: dict[str, list[float]]  # the advantage of each turn, per trajectory
    values: dict[tuple[str, int], tuple[float, int]]  # (state, turn) -> (V of the state, n)


def state_keys(traj: Trajectory, pool: bool) -> list[tuple[str, int]]:
    """keys[t] names the state before turn t of `traj` (t = 0 .. its turns - 1), as the
    branch estimator pools samples of its value. Without `pool` a state is one episode's
    (its trajectory id and t; a continuation's are its parent's, which it shares up to its
    branch point). With `pool` it is the group's and the exact history before it: the
    sampled token ids of every earlier turn, with what each observed, so siblings that
    sampled the same tokens and saw the same observations share their states (each a
    free sample of the others' values). That assumes, as branching from a snapshot does,
    that a state is what its history made it."""
    if not pool:
        owner = traj.branch_of.trajectory_id if traj.branch_of is not None else traj.trajectory_id
        return [(owner, t) for t in range(len(traj.turns))]
    ledgers = traj.ledgers()
    digest = hashlib.sha256(traj.group_id.encode())
    keys = []
    for t, turn in enumerate(traj.turns):
        keys.append((digest.hexdigest()[:32], t))
        ids = ledgers[turn.segment].response_ids[turn.span[0] : turn.span[1]]
        digest.update(json.dumps([turn.kind, ids, turn.observation]).encode())
    return keys


def branch_credit(trajectories: Sequence[Trajectory], config: AdvantageConfig) -> BranchCredit:
    """Per-turn advantages from the values of restored states (VinePPO's Monte-Carlo
    estimate, with turns as its steps).

    The value of the state before turn t of an episode, V(s_t), is the mean reward of its
    continuations (`branch_of`: restored from the snapshot before turn t, sampled on by
    the policy); V(s_0) is the group's mean reward (GRPO's baseline: every episode of a
    group starts from the same state) and the state after the last turn is worth the
    episode's reward r. With the branched turns b_1 < ... < b_m, a turn u in
    [b_j, b_j+1) gets A_u = (V(s_b_j+1) - V(s_b_j)) / sigma, sigma the group's reward
    std + eps (GRPO's scale; 1 when the group's rewards are all equal, or without
    `normalize_std`: such a group has no spread to normalize by, and a batch-wide std,
    which shrinks as the policy converges, would amplify the continuations' Monte-Carlo
    noise most where there is least to learn). The differences telescope: with every
    turn branched they sum to (r - mean) / sigma, GRPO's advantage, which an episode
    without a branched state gets on every turn. A state's value never includes the
    episode's own reward (which depends on the turn it baselines). Continuations enter no
    group statistic; with `branch.train` each gets (R - V(s_t)) / sigma on its own turns,
    RLOO-like at the restored state.

    With `branch.pool` (`state_keys`), every episode that passes through a state is a
    sample of its value: a fresh episode of every state it passed, a continuation of its
    branch point's and every later one; an episode's own reward is left out of the values
    it is credited against (a continuation's too, with `train`), so a state its siblings
    also passed has a value without any branch.
    """
    cfg = config.branch
    train = cfg is not None and cfg.train
    pool = cfg is not None and cfg.pool
    fresh = [t for t in trajectories if t.branch_of is None]
    outcome = compute_advantages(trajectories, config)
    groups = _rewards_by_group(fresh)
    scale: dict[str, float] = {}
    mean: dict[str, float] = {}
    for gid, group in groups.items():
        rewards = list(group.values())
        mean[gid] = math.fsum(rewards) / len(rewards)
        spread = sample_std(rewards) if config.normalize_std else 0.0
        scale[gid] = spread + config.eps if spread > 0 else 1.0
    keys = {t.trajectory_id: state_keys(t, pool) for t in trajectories}
    samples: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    for t in trajectories:
        if not t.trainable or t.reward is None:
            continue
        if t.branch_of is not None:
            start = t.branch_of.turn
            passed = range(start, len(t.turns)) if pool else [start]
        else:
            passed = range(1, len(t.turns)) if pool else []
        for u in passed:
            samples[keys[t.trajectory_id][u]][t.trajectory_id] = t.reward

    def value(key: tuple[str, int], without: str) -> float | None:
        rs = [r for tid, r in samples.get(key, {}).items() if not (pool and tid == without)]
        return math.fsum(rs) / len(rs) if rs else None

    values = {key: (math.fsum(rs.values()) / len(rs), len(rs)) for key, rs in samples.items()}
    parents = {t.trajectory_id: t for t in fresh}
    per_turn: dict[str, list[float]] = {}
    for t in trajectories:
        n, tid = len(t.turns), t.trajectory_id
        per_turn[tid] = [0.0] * n
        if not t.trainable or t.reward is None:
            continue
        if t.branch_of is not None:
            parent = parents.get(t.branch_of.trajectory_id)
            b = t.branch_of.turn
            v_start = value(keys[tid][b], tid)
            if train and parent is not None and parent.trainable and v_start is not None:
                a = (t.reward - v_start) / scale[parent.group_id]
                per_turn[tid] = [0.0] * b + [a] * (n - b)
            continue
        v = {0: mean[t.group_id], n: t.reward}
        for u in range(1, n):
            vu = value(keys[tid][u], tid)
            if vu is not None:
                v[u] = vu
        if len(v) == 2:
            per_turn[tid] = [outcome[tid]] * n
            continue
        bounds = sorted(v)
        advs: list[float] = []
        for a, b in zip(bounds, bounds[1:], strict=False):
            advs += [(v[b] - v[a]) / scale[t.group_id]] * (b - a)
        per_turn[tid] = advs
    return BranchCredit(outcome, per_turn, values)


def loss_denominators(mask_B_T: torch.Tensor) -> tuple[float, float]:
    """(sampled tokens, sequences with a sampled token) of the whole batch, for `aggregate`."""
    on_B_T = mask_B_T > 0
    return float(on_B_T.sum()), float(on_B_T.any(dim=1).sum())


def aggregate(
    loss_B_T: torch.Tensor,
    mask_B_T: torch.Tensor,
    aggregation: Aggregation,
    *,
    total_tokens: float,
    total_seqs: float,
) -> torch.Tensor:
    """Reduce per-token losses to a scalar with the whole batch's denominators."""
    if total_tokens <= 0 or total_seqs <= 0:
        raise ValueError(
            f"total_tokens ({total_tokens}) and total_seqs ({total_seqs}) must be > 0: "
            "a batch without sampled tokens has nothing to train on; skip the step"
        )
    on_B_T = mask_B_T > 0
    # where, not multiply: padding may hold inf or nan, and nan * 0 is nan.
    masked_B_T = torch.where(on_B_T, loss_B_T, 0.0)
    if aggregation == "token-mean":
        return masked_B_T.sum() / total_tokens
    per_seq_B = masked_B_T.sum(dim=1)
    if aggregation == "seq-mean-token-mean":
        per_seq_B = per_seq_B / on_B_T.sum(dim=1).clamp(min=1)
    return per_seq_B.sum() / total_seqs


def _local_mean(x_B_T: torch.Tensor, on_B_T: torch.Tensor) -> float:
    """Mean over this micro-batch's sampled tokens (0.0 when it has none), for metrics."""
    picked = x_B_T.detach().expand(on_B_T.shape)[on_B_T]
    return float(picked.float().mean()) if picked.numel() else 0.0


def policy_loss(
    logprobs_B_T: torch.Tensor,
    old_logprobs_B_T: torch.Tensor,
    advantages: torch.Tensor,
    mask_B_T: torch.Tensor,
    config: LossConfig,
    *,
    total_tokens: float,
    total_seqs: float,
    ref_logprobs_B_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss of one (micro-)batch and its metrics. `advantages` is [B] (one per
    sequence) or [B, T] (one per token: turn-level credit).

    Metrics: `loss`, `pg_loss` and `kl_loss` use the batch denominators (they sum over
    micro-batches); `ratio_mean`, `kl_mean` and the `*_frac` values are means over this
    micro-batch's `tokens` sampled tokens.
    """
    shapes = [old_logprobs_B_T.shape, mask_B_T.shape]
    if ref_logprobs_B_T is not None:
        shapes.append(ref_logprobs_B_T.shape)
    if logprobs_B_T.dim() != 2 or any(s != logprobs_B_T.shape for s in shapes):
        raise ValueError(
            f"logprobs, old/ref logprobs and mask must share one [B, T] shape: {shapes}"
        )
    if advantages.shape not in (logprobs_B_T.shape[:1], logprobs_B_T.shape):
        raise ValueError(f"advantages must be [B] or [B, T]: {tuple(advantages.shape)}")
    if config.kl_coef > 0 and ref_logprobs_B_T is None:
        raise ValueError(f"kl_coef {config.kl_coef} needs ref_logprobs_B_T (reference logprobs)")

    on_B_T = mask_B_T > 0
    # Padding values are never read, so inf or nan there reaches neither loss nor gradient.
    lp_B_T = torch.where(on_B_T, logprobs_B_T, 0.0)
    ratio_B_T = torch.exp(torch.where(on_B_T, lp_B_T - old_logprobs_B_T.detach(), 0.0))
    adv_B_T = advantages.detach().to(lp_B_T.dtype)  # [B, 1] or [B, T]: broadcast alike
    if adv_B_T.dim() == 1:
        adv_B_T = adv_B_T[:, None]
    metrics = {"tokens": float(on_B_T.sum()), "ratio_mean": _local_mean(ratio_B_T, on_B_T)}

    if config.type == "ppo":
        unclipped_B_T = -adv_B_T * ratio_B_T
        clipped_B_T = -adv_B_T * ratio_B_T.clamp(1 - config.clip_low, 1 + config.clip_high)
        pg_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
        was_clipped_B_T = clipped_B_T > unclipped_B_T
        metrics["clip_high_frac"] = _local_mean(was_clipped_B_T & (adv_B_T > 0), on_B_T)
        metrics["clip_low_frac"] = _local_mean(was_clipped_B_T & (adv_B_T < 0), on_B_T)
        if config.dual_clip is not None:
            cap_B_T = -adv_B_T * config.dual_clip
            dual_B_T = (adv_B_T < 0) & (pg_B_T > cap_B_T)
            pg_B_T = torch.where(dual_B_T, cap_B_T, pg_B_T)
            metrics["dual_clip_frac"] = _local_mean(dual_B_T, on_B_T)
    elif config.type == "tis":
        weight_B_T = ratio_B_T.detach().clamp(max=config.tis_cap)
        pg_B_T = -weight_B_T * adv_B_T * lp_B_T
        metrics["tis_capped_frac"] = _local_mean(ratio_B_T > config.tis_cap, on_B_T)
    elif config.type == "importance_sampling":
        pg_B_T = -ratio_B_T * adv_B_T
    else:
        pg_B_T = -lp_B_T

    def reduce(x_B_T: torch.Tensor) -> torch.Tensor:
        return aggregate(
            x_B_T, on_B_T, config.aggregation, total_tokens=total_tokens, total_seqs=total_seqs
        )

    loss = reduce(pg_B_T)
    metrics["pg_loss"] = float(loss.detach())
    if ref_logprobs_B_T is not None:
        log_ref_ratio_B_T = torch.where(on_B_T, ref_logprobs_B_T.detach() - lp_B_T, 0.0)
        if config.kl_estimator == "k1":
            kl_B_T = -log_ref_ratio_B_T
        else:
            kl_B_T = torch.exp(log_ref_ratio_B_T) - log_ref_ratio_B_T - 1
        metrics["kl_mean"] = _local_mean(kl_B_T, on_B_T)
        if config.kl_coef > 0:
            kl_loss = config.kl_coef * reduce(kl_B_T)
            metrics["kl_loss"] = float(kl_loss.detach())
            loss = loss + kl_loss
    metrics["loss"] = float(loss.detach())
    return loss, metrics
