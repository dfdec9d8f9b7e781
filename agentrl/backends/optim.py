"""The optimizer settings every trainer backend shares: AdamW, clipping, the LR schedule.

The native backend applies them with torch; the Tinker backend sends them with each
`optim_step` (Tinker's AdamParams, the learning rate already scheduled), so the same
config trains the same way on either.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OptimizerConfig(BaseModel):
    """AdamW with decoupled weight decay, gradient clipping and a warm-up + decay schedule."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-5, gt=0, description="peak learning rate (AdamW)")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW decoupled weight decay")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="after warm-up: hold, or decay to 0 at total_steps"
    )
    warmup_steps: int = Field(default=0, ge=0, description="linear warm-up: step s uses (s+1)/w")
    total_steps: int | None = Field(default=None, ge=1, description="needed by linear and cosine")
    max_grad_norm: float | None = Field(default=1.0, gt=0, description="clip; null: no clipping")

    @model_validator(mode="after")
    def _schedule(self) -> OptimizerConfig:
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"schedule {self.schedule} needs total_steps")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} > total_steps {self.total_steps}")
        return self

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` for optimizer step `step` (0 is the first)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant" or self.total_steps is None:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))
