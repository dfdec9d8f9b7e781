"""The sampler seam: one request in (token ids + params), one Completion out."""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(BaseModel):
    """How to sample one completion."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=256, ge=1, description="new tokens at most")
    temperature: float = Field(default=1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus mass kept")
    stop_token_ids: tuple[int, ...] = Field(
        default=(), description="extra ids that end the completion (EOS always does)"
    )
    stop: tuple[str, ...] = Field(
        default=(),
        description="strings that end the completion once its decoded text contains one "
        "(vLLM's `stop`); the token that completes the string is kept, finish_reason stop",
    )
    seed: int | None = Field(default=None, description="per-request RNG seed")


class Completion(BaseModel):
    """What the sampler produced for one request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_ids: list[int] = Field(description="sampled ids, verbatim, stop token included")
    logprobs: list[float] = Field(
        description="log-prob of each sampled id under the distribution actually sampled from"
    )
    finish_reason: FinishReason
    policy_version: int = Field(description="weights version that sampled every token here")


class Sampler(Protocol):
    """Generates from token ids. Implementations: local (in-process), openai (HTTP)."""

    @property
    def policy_version(self) -> int: ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion: ...

    async def close(self) -> None: ...
