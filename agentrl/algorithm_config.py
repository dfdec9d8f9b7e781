"""The algorithm section of a train config: advantages and the policy loss, as configs.

Apart from `agentrl.algorithms` (which applies them with torch), so a train config is
validated without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce", "branch"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


class BranchConfig(BaseModel):
    """Where the branch estimator restores an episode's sandbox and continues it, and how
    often (`agentrl.algorithms.branch_credit`)."""

    model_config = ConfigDict(extra="forbid")

    k: int = Field(default=2, ge=1, le=64, description="continuations per branched state")
    select: Literal["every", "count", "uncertain"] = Field(
        default="every",
        description="every: the states before turns every, 2*every, ...; count: `count` "
        "states per episode, evenly spread; uncertain: before and after the `count` turns "
        "whose replies had the lowest mean sampler logprob",
    )
    every: int = Field(default=1, ge=1, description="select every: branch before every k-th turn")
    count: int = Field(default=1, ge=1, description="select count or uncertain: how many")
    train: bool = Field(
        default=False,
        description="also train on the continuations (their own turns only, against the "
        "value of the state they started from); default: they only estimate values",
    )

    pool: bool = Field(
        default=False,
        description="pool the samples of identical states: siblings that sampled the same "
        "tokens and saw the same observations share the states they passed, each a free "
        "sample of the others' values, and a state is branched once for the group, only "
        "for the continuations its siblings do not already give (for tasks whose state is "
        "what its history made it)",
    )

    @model_validator(mode="after")
    def _options_of_select(self) -> BranchConfig:
        owner = {"every": "every", "count": "count"}
        foreign = [
            f
            for f in sorted(self.model_fields_set & set(owner))
            if not (f == "every" and self.select == "every")
            and not (f == "count" and self.select in ("count", "uncertain"))
        ]
        if foreign:
            raise ValueError(f"{', '.join(foreign)}: not read by select {self.select}")
        return self

    def snapshot_every(self) -> int:
        """Which turns' states the episodes must commit so they can be branched."""
        return self.every if self.select == "every" else 1


class AdvantageConfig(BaseModel):
    """How rewards become advantages."""

    model_config = ConfigDict(extra="forbid")

    estimator: Estimator = Field(
        default="grpo", description="grpo, dr_grpo, rloo, reinforce or branch"
    )
    normalize_std: bool = Field(
        default=True, description="grpo and branch: divide by the group's reward std"
    )
    eps: float = Field(default=1e-6, ge=0, description="grpo and branch: added to the std")
    branch: BranchConfig | None = Field(
        default=None, description="estimator branch: where to branch (default: BranchConfig())"
    )

    @model_validator(mode="after")
    def _grpo_options(self) -> AdvantageConfig:
        given = sorted(self.model_fields_set & {"normalize_std", "eps"})
        if given and self.estimator not in ("grpo", "branch"):
            raise ValueError(
                f"{', '.join(given)}: only read by estimators grpo and branch, not {self.estimator}"
            )
        if self.branch is not None and self.estimator != "branch":
            raise ValueError(f"branch: only read by estimator branch, not {self.estimator}")
        if self.estimator == "branch" and self.branch is None:
            self.branch = BranchConfig()
        return self


# Options read by one loss type only; setting one for another type is a config mistake.
_OPTION_OWNER = {"clip_low": "ppo", "clip_high": "ppo", "dual_clip": "ppo", "tis_cap": "tis"}


class LossConfig(BaseModel):
    """The policy loss and how its per-token values are aggregated."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ppo", "tis", "importance_sampling", "cross_entropy"] = Field(
        default="ppo",
        description="ppo (clipped), tis (truncated IS), importance_sampling (untruncated), "
        "cross_entropy (warm-up)",
    )
    clip_low: float = Field(default=0.2, gt=0, lt=1, description="ppo: ratio floor 1 - clip_low")
    clip_high: float = Field(default=0.28, gt=0, description="ppo: ratio ceiling 1 + clip_high")
    dual_clip: float | None = Field(
        default=3.0, gt=1, description="ppo: where A < 0, loss <= -A * dual_clip; null: off"
    )
    tis_cap: float = Field(default=2.0, gt=0, description="tis: importance weights cap")
    aggregation: Aggregation = Field(
        default="token-mean", description="token-mean, seq-mean-token-sum, seq-mean-token-mean"
    )
    kl_coef: float = Field(
        default=0.0, ge=0, description="weight of KL(policy || reference); > 0 needs ref logprobs"
    )
    kl_estimator: Literal["k1", "k3"] = Field(default="k3", description="per-token KL estimate")

    @model_validator(mode="after")
    def _options_of_type(self) -> LossConfig:
        foreign = sorted(
            f for f in self.model_fields_set if _OPTION_OWNER.get(f, self.type) != self.type
        )
        if foreign:
            raise ValueError(f"{', '.join(foreign)}: not read by loss type {self.type}")
        return self
