"""The sampler seam: one request in (token ids + params), one Completion out."""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "wait", "keep"]
"""What a pause does to requests in flight: abort them, let them finish first, or keep
them parked and resume them under the new weights."""
Transfer = Literal["checkpoint", "gloo", "nccl"]
"""How published weights reach servers."""


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
    policy_version: int = Field(ge=0, description="weights version when sampling started")
    token_versions: list[int] = Field(
        default_factory=list,
        description="weights version that sampled each token (default: policy_version for "
        "all); a completion paused across a weight update holds two versions",
    )
    replica: str | None = Field(default=None, description="which server sampled it, if several")

    @model_validator(mode="before")
    @classmethod
    def _one_version(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("token_versions") is None:
            ids, version = data.get("token_ids"), data.get("policy_version")
            if isinstance(ids, list) and isinstance(version, int):
                data = {**data, "token_versions": [version] * len(ids)}
        return data

    @model_validator(mode="after")
    def _aligned(self) -> Completion:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.token_versions) != n:
            raise ValueError(
                f"{n} token ids, {len(self.logprobs)} logprobs, {len(self.token_versions)} "
                "token versions: they must align"
            )
        versions = [self.policy_version, *self.token_versions]
        if any(b < a for a, b in zip(versions, versions[1:], strict=False)):
            raise ValueError(f"token versions must not go back: {self.token_versions}")
        return self


class Sampler(Protocol):
    """Generates from token ids. Implementations: local (in-process), openai (HTTP)."""

    @property
    def policy_version(self) -> int: ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion: ...

    async def close(self) -> None: ...


@runtime_checkable
class Answering(Protocol):
    """A sampler that can say before a run whether it answers (one behind HTTP):
    `check` raises a SamplerError with its fix when it does not."""

    async def check(self) -> None: ...


@runtime_checkable
class Replicated(Protocol):
    """A sampler over several replicas (the router): which replica serves which version."""

    def status(self) -> list[dict[str, Any]]: ...
