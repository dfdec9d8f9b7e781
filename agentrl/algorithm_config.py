"""The algorithm section of a train config: advantages and the policy loss, as configs.

Apart from `agentrl.algorithms` (which applies them with torch), so a train config is
validated without importing torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Estimator = Literal["grpo", "dr_grpo", "rloo", "reinforce"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


class AdvantageConfig(BaseModel):
    """How rewards become advantages."""

    model_config = ConfigDict(extra="forbid")

    estimator: Estimator = Field(default="grpo", description="grpo, dr_grpo, rloo or reinforce")
    normalize_std: bool = Field(default=True, description="grpo only: divide by the group std")
    eps: float = Field(default=1e-6, ge=0, description="grpo only: added to the std")

    @model_validator(mode="after")
    def _grpo_options(self) -> AdvantageConfig:
        given = sorted(self.model_fields_set & {"normalize_std", "eps"})
        if given and self.estimator != "grpo":
            raise ValueError(
                f"{', '.join(given)}: only read by estimator grpo, not {self.estimator}"
            )
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
