"""Which layers a LoRA adapter trains, and how (no torch: configs load without it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LoraSpec(BaseModel):
    """Which Linears get a low-rank adapter, and its rank, scale and initialisation."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(gt=0, description="rank r of each adapter B A")
    alpha: float = Field(default=32.0, gt=0, description="the adapter output is scaled alpha / r")
    train_attn: bool = Field(default=True, description="adapt attention q, k, v, o projections")
    train_mlp: bool = Field(default=True, description="adapt MLP gate, up, down projections")
    train_unembed: bool = Field(
        default=True, description="adapt lm_head (the output projection only, even when tied)"
    )
    seed: int | None = Field(
        default=None, description="seeds the adapters' A; null: the backend's seed"
    )

    @model_validator(mode="after")
    def _adapts_something(self) -> LoraSpec:
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("lora adapts nothing: set train_attn, train_mlp or train_unembed")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> str:
        flags = {"attn": self.train_attn, "mlp": self.train_mlp, "unembed": self.train_unembed}
        on = "+".join(part for part, chosen in flags.items() if chosen)
        return f"LoRA rank {self.rank}, alpha {self.alpha:g} on {on}"
