"""The trainer seam: samples in, gradients accumulated, weights out to the samplers.

A `Sample` is one token ledger of a trajectory (its first, or one of its segments)
flattened for a learner: `prompt_ids + response_ids` as `tokens`, with the loss mask,
the sampler's logprobs and the episode's advantage aligned to them. It holds tokens
only, never text, so the learner scores exactly what the sampler sampled. A segmented
episode is several samples with one advantage; each is a sequence for the loss's
seq-mean aggregations. With turn-level credit (the branch estimator) each sampled token
carries its turn's advantage (`token_advantages`), and a continuation's sample trains
only the tokens it sampled itself: its inherited prefix is the parent's, trained once.
The checkpoint layout every backend shares lives in `agentrl.weights.checkpoint`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.errors import ConfigError, TrajectoryError

if TYPE_CHECKING:
    import torch

    from agentrl.algorithms import LossConfig
    from agentrl.trajectory import Trajectory


class Sample(BaseModel):
    """One trajectory as a learner sees it; every list is aligned with `tokens`."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    segment: int = Field(default=0, ge=0, description="which ledger of the trajectory")
    tokens: list[int] = Field(description="prompt_ids + response_ids, verbatim")
    loss_mask: list[int] = Field(description="1 where the sampler produced that token")
    sampler_logprobs: list[float] = Field(description="sampler logprob of each token, 0.0 off-mask")
    advantage: float = Field(description="the episode's outcome advantage")
    token_advantages: list[float] | None = Field(
        default=None, description="per token (0.0 off-mask), when turns differ; else None"
    )

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        where = f"sample {self.trajectory_id!r}"
        where += f" segment {self.segment}" if self.segment else ""
        n = len(self.tokens)
        if n == 0:
            raise ValueError(f"{where}: no tokens")
        if len(self.loss_mask) != n or len(self.sampler_logprobs) != n:
            raise ValueError(
                f"{where}: loss_mask ({len(self.loss_mask)}) and sampler_logprobs "
                f"({len(self.sampler_logprobs)}) must have the length of tokens ({n})"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"{where}: loss_mask must hold only 0 and 1")
        if self.loss_mask[0]:
            raise ValueError(f"{where}: loss_mask[0] is 1, but nothing predicts the first token")
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.sampler_logprobs, strict=True)):
            if (m and (not math.isfinite(lp) or lp > 0.0)) or (not m and lp != 0.0):
                raise ValueError(f"{where}: sampler_logprobs[{i}] = {lp} with loss_mask {m}")
        if not math.isfinite(self.advantage):
            raise ValueError(f"{where}: advantage {self.advantage} is not finite")
        if self.token_advantages is not None:
            if len(self.token_advantages) != n:
                raise ValueError(
                    f"{where}: token_advantages ({len(self.token_advantages)}) must have the "
                    f"length of tokens ({n})"
                )
            for i, (m, a) in enumerate(zip(self.loss_mask, self.token_advantages, strict=True)):
                if not math.isfinite(a) or (not m and a != 0.0):
                    raise ValueError(f"{where}: token_advantages[{i}] = {a} with loss_mask {m}")
        return self

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def advantages_T(self) -> list[float]:
        """The advantage of every token (the episode's on every sampled one, unless the
        turns carry their own), 0.0 off-mask."""
        if self.token_advantages is not None:
            return self.token_advantages
        return [self.advantage if m else 0.0 for m in self.loss_mask]

    @property
    def has_signal(self) -> bool:
        """Whether some sampled token has a non-zero advantage."""
        return any(a != 0.0 for a in self.advantages_T())


def samples_from(
    trajectories: Iterable[Trajectory],
    advantages: Mapping[str, float],
    per_turn: Mapping[str, Sequence[float]] | None = None,
) -> list[Sample]:
    """Flatten checked trajectories into samples, one per ledger (segment) with a
    sampled token, each carrying its episode's advantage, up to its last sampled token
    (an episode ended `context_limit` may hold an observation past the context).

    `per_turn[id]` gives each turn's tokens their own advantage (tokens outside every
    turn keep the episode's). A continuation (`branch_of`) keeps only what it sampled
    itself: loss mask and logprobs are zero before its first turn, and earlier ledgers
    are dropped. Infrastructure failures carry a zero loss mask, so they never reach a
    learner.
    """
    samples = []
    for t in trajectories:
        t.check()
        if t.num_sampled == 0:
            continue
        if t.trajectory_id not in advantages:
            raise TrajectoryError(f"trajectory {t.trajectory_id!r}: no advantage computed for it")
        turn_advs = None if per_turn is None else per_turn.get(t.trajectory_id)
        if turn_advs is not None and len(turn_advs) != len(t.turns):
            raise TrajectoryError(
                f"trajectory {t.trajectory_id!r}: {len(turn_advs)} turn advantages for "
                f"{len(t.turns)} turns"
            )
        own = (0, 0)  # (ledger, position) where its own sampling starts
        if t.branch_of is not None and t.branch_of.turn < len(t.turns):
            first = t.turns[t.branch_of.turn]
            own = (first.segment, first.span[0])
        for k, ledger in enumerate(t.ledgers()):
            mask, logprobs = list(ledger.loss_mask), list(ledger.logprobs)
            if k < own[0]:
                continue
            if k == own[0]:
                mask[: own[1]] = [0] * own[1]
                logprobs[: own[1]] = [0.0] * own[1]
            if not any(mask):
                continue
            pad = len(ledger.prompt_ids)
            # Tokens after the last sampled one carry no loss: the learner never needs them.
            end = max(i for i, m in enumerate(mask) if m) + 1
            token_advs = None
            if turn_advs is not None:
                by_pos = [advantages[t.trajectory_id]] * end
                for turn, a in zip(t.turns, turn_advs, strict=True):
                    if turn.segment == k:
                        by_pos[turn.span[0] : turn.span[1]] = [a] * (turn.span[1] - turn.span[0])
                own_T = [a if m else 0.0 for a, m in zip(by_pos, mask[:end], strict=True)]
                token_advs = [0.0] * pad + own_T
            samples.append(
                Sample(
                    trajectory_id=t.trajectory_id,
                    segment=k,
                    tokens=ledger.prompt_ids + ledger.response_ids[:end],
                    loss_mask=[0] * pad + mask[:end],
                    sampler_logprobs=[0.0] * pad + logprobs[:end],
                    advantage=advantages[t.trajectory_id],
                    token_advantages=token_advs,
                )
            )
    return samples


def batch_denominators(samples: Sequence[Sample]) -> tuple[float, float]:
    """(sampled tokens, sequences with a sampled token) of a whole batch, for the loss."""
    tokens = sum(s.num_sampled for s in samples)
    if tokens == 0:
        raise ConfigError(
            f"a batch of {len(samples)} samples has no sampled token: nothing to train on",
            fix="skip the step (e.g. every episode of the batch was an infrastructure failure)",
        )
    return float(tokens), float(sum(1 for s in samples if s.num_sampled))


def rewritten_mismatch(gap: float, tokens: float) -> dict[str, float]:
    """`logprob_mismatch_rewritten`: the mean |learner - sampler| logprob over the sampled
    tokens of segments a rewrite of history began (none: no such key), from their sums."""
    return {"logprob_mismatch_rewritten": gap / tokens} if tokens else {}


def pack_micro_batches(samples: Sequence[Sample], budget: int) -> list[list[Sample]]:
    """Group samples so each right-padded micro-batch holds at most `budget` tokens.

    Longest first keeps padding small; a sample longer than the budget goes alone.
    """
    batches: list[list[Sample]] = []
    for s in sorted(samples, key=lambda s: len(s.tokens), reverse=True):
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].tokens) <= budget:
            batches[-1].append(s)
        else:
            batches.append([s])
    return batches


def check_fits(samples: Sequence[Sample], context_length: int, vocab_size: int) -> None:
    """Refuse samples the model cannot score, naming the sample, before any forward pass."""
    for s in samples:
        if len(s.tokens) > context_length:
            raise ConfigError(
                f"sample {s.trajectory_id!r} has {len(s.tokens)} tokens, more than the "
                f"model's context ({context_length})",
                fix="end episodes at the context limit (stop_reason context_limit)",
            )
        if max(s.tokens) >= vocab_size:
            raise ConfigError(
                f"sample {s.trajectory_id!r} holds token id {max(s.tokens)}, outside the "
                f"vocabulary ({vocab_size})",
                fix="train the model whose tokenizer produced the trajectories",
            )


class WeightSink(Protocol):
    """What `publish` hands weights to: a sampler that can swap them between batches."""

    @property
    def policy_version(self) -> int: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...


class TrainerBackend(Protocol):
    """Turns samples into an optimizer step; publishes weights to samplers. What the
    train loop calls, and nothing else: each backend builds `train_step` from its own
    forward_backward and optim_step (FSDP: gradients accumulate over calls, each call's
    loss normalised by its own batch's token and sequence counts; Tinker: both submitted
    before waiting for either)."""

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        ...

    def train_step(self, samples: Sequence[Sample], loss: LossConfig) -> dict[str, float]:
        """One update from `samples`: loss and metrics (among them `logprob_mismatch`, the
        mean |learner - sampler| logprob over sampled tokens), grad_norm and lr."""
        ...

    def save_checkpoint(
        self, root: Path, extra: dict[str, Any], *, step: int | None = None
    ) -> Path:
        """Save atomically as root/step-N (N: `step`, default the optimizer steps taken)."""
        ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore everything saved at `path`; returns the `extra` given to save."""
        ...

    def publish(self, sampler: WeightSink | None, version: int | None = None) -> int:
        """Hand the current weights to `sampler` under `version` (None: its next, +1; a
        resumed run republishes its checkpoint's weights under the version they had);
        returns the version."""
        ...

    def close(self) -> None: ...
