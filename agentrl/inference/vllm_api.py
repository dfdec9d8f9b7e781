"""The part of vLLM's HTTP API `agentrl serve` speaks: each route's request model, and
the `/v1/completions` answer.

`CompletionRequest` is the completion body it accepts (vLLM's names and defaults; unlike vLLM,
which logs and ignores unknown fields, an unknown field is a 400: a misspelled
parameter must not sample silently under defaults). `sampling_params` turns it into
the sampler's `SamplingParams` under vLLM's limits; `completion_body` turns the
sampler's `Completion` into vLLM's answer, with each sampled token's policy version in
`choices[0].token_versions` (an agentrl extension). The control routes' models ignore
unknown fields, as vLLM's do.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StrictInt,
    ValidationError,
    field_validator,
)

from agentrl.http import HTTPError, validation_message
from agentrl.inference.base import Completion, PauseMode, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class CompletionRequest(BaseModel):
    """The /v1/completions body this server accepts (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[int]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    echo: bool | None = False
    user: str | None = None
    cache_salt: str | None = None  # accepted: this server keeps no prefix cache to salt

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, prompt: object) -> object:
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and any(isinstance(p, str) for p in prompt)
        ):
            raise ValueError("text is not accepted: send token ids (a list of ints)")
        if isinstance(prompt, list) and any(isinstance(p, list) for p in prompt):
            raise ValueError("a batch is not accepted: send one list of token ids per request")
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("must be a non-empty list of token ids")
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in prompt):
            raise ValueError("token ids must be non-negative integers")
        return prompt


def _version(value: object) -> int | None:
    if value is None:
        return None
    try:
        version = int(str(value).removeprefix("v"))
    except ValueError:
        version = -1
    if version < 0:
        raise ValueError(f"must be a non-negative integer, got {value!r}")
    return version


Version = Annotated[int | None, BeforeValidator(_version)]  # 3, "3" or "v3"


class _Control(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's control routes ignore the rest


class PauseQuery(_Control):
    mode: PauseMode = "abort"  # vLLM's default


class SleepQuery(_Control):
    level: str = "1"
    mode: PauseMode = "abort"


class NewVersion(_Control):
    new_version: Version


class FinishUpdate(_Control):
    weight_version: Version = None  # default: one past the version served


class CollectiveRPC(_Control):
    method: str
    kwargs: dict[str, Any] | None = None


class InitTransfer(_Control):
    init_info: dict[str, Any]


class UpdateWeights(_Control):
    update_info: dict[str, Any]


class Tokenize(_Control):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class Detokenize(_Control):
    tokens: list[StrictInt]


def sampling_params(r: CompletionRequest, context_length: int) -> SamplingParams:
    """What to sample; HTTPError 400 for what this server does not do, or cannot fit."""
    unsupported = {
        "n": r.n != 1,
        "stream": bool(r.stream),
        "echo": bool(r.echo),
        "logprobs": r.logprobs not in (None, 0),
        "top_k": r.top_k not in (None, -1, 0),
        "min_p": r.min_p not in (None, 0.0),
        "repetition_penalty": r.repetition_penalty not in (None, 1.0),
    }
    bad = [name for name, is_bad in unsupported.items() if is_bad]
    if bad:
        raise HTTPError(
            400,
            f"unsupported values for {', '.join(bad)} (this server does n=1, no stream, "
            "no echo, logprobs 0, and no top_k/min_p/repetition_penalty)",
        )
    # vLLM's rule: null means the room the context leaves; more than that is a 400.
    room = context_length - len(r.prompt)
    max_tokens = room if r.max_tokens is None else r.max_tokens
    if room < 1 or max_tokens > room:
        asked = max(max_tokens, 0)
        raise HTTPError(
            400,
            f"This model's maximum context length is {context_length} tokens. "
            f"However, you requested {len(r.prompt) + asked} tokens ({len(r.prompt)} in "
            f"the prompt, {asked} in the completion). Please reduce the length of the "
            "prompt or completion.",
        )
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=r.temperature if r.temperature is not None else 1.0,
            top_p=r.top_p if r.top_p is not None else 1.0,
            stop_token_ids=tuple(r.stop_token_ids or ()),
            stop=(r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ()),
            seed=r.seed,
        )
    except ValidationError as e:
        raise HTTPError(400, validation_message(e)) from e


def completion_body(
    r: CompletionRequest, c: Completion, tokenizer: PreTrainedTokenizerBase, model_name: str
) -> dict[str, Any]:
    """vLLM's answer to `r`; the caller holds the tokenizer (not thread-safe)."""
    ids = c.token_ids
    stop_ids = set(r.stop_token_ids or ())
    stop_strings = [r.stop] if isinstance(r.stop, str) else list(r.stop or ())
    stopped_on: int | str | None = None
    text_ids = ids
    if c.finish_reason == "stop" and ids:
        stopped_on = ids[-1]
        # vLLM leaves the stop token out of the text (never out of token_ids) unless asked.
        if not r.include_stop_str_in_output:
            text_ids = ids[:-1]
    text = str(tokenizer.decode(text_ids, skip_special_tokens=r.skip_special_tokens))
    tokens = tokenizer.convert_ids_to_tokens(ids) if r.logprobs is not None else []
    full = (
        str(tokenizer.decode(ids, skip_special_tokens=r.skip_special_tokens))
        if stop_strings and c.finish_reason == "stop"
        else ""
    )
    matches = [(full.find(stop), stop) for stop in stop_strings if stop in full]
    if matches:
        # It stopped on a string: vLLM cuts the text there (after it if asked to include
        # it); token_ids keep every sampled id, including the one that completed it.
        at, stopped_on = min(matches)
        text = full[: at + (len(stopped_on) if r.include_stop_str_in_output else 0)]
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": (
            {"tokens": tokens, "token_logprobs": c.logprobs} if r.logprobs is not None else None
        ),
        "finish_reason": c.finish_reason,
        # A string, or a requested stop id; EOS is null as in vLLM.
        "stop_reason": stopped_on
        if isinstance(stopped_on, str) or stopped_on in stop_ids
        else None,
        "token_ids": ids if r.return_token_ids else None,
        "prompt_token_ids": r.prompt if r.return_token_ids else None,
        "token_versions": c.token_versions,  # agentrl's extension
    }
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(r.prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(r.prompt) + len(ids),
        },
    }
