"""OpenAISampler: the Sampler protocol over a vLLM-compatible `/v1/completions` server.

Token ids go in as `prompt` and come back as `choices[0].token_ids` (vLLM's
`return_token_ids`), with `logprobs.token_logprobs` for each one; text is never
re-tokenized. Every request spells out the whole sampling distribution (`top_k=-1`,
`min_p=0`, `repetition_penalty=1`) so a server's generation_config defaults cannot
change it behind the ledger's back. vLLM reports logprobs *before* temperature/top-p
unless started with `--logprobs-mode processed_logprobs`; use that flag (or T=1, top_p=1)
so the logprobs describe the distribution actually sampled from.

Retries happen only where no completion came back (connection refused, timeout, HTTP
5xx) and are counted in `stats`; a 4xx or a malformed answer is a SamplerError at once.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import openai
from pydantic import BaseModel, ConfigDict, ValidationError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from tenacity.wait import wait_exponential

from agentrl.errors import ConfigError, SamplerError, one_line
from agentrl.inference.base import Completion, FinishReason, SamplingParams

T = TypeVar("T")

POLICY_VERSION_HEADER = "x-agentrl-policy-version"
SESSION_HEADER = "x-agentrl-session-id"
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class ServerUnavailable(SamplerError):
    """No completion came back: connection refused or reset, timeout, or HTTP 5xx.

    Nothing sampled was seen, so sending the same request elsewhere is safe.
    """


@dataclass
class OpenAISamplerStats:
    """Counters of what went over the wire."""

    requests: int = 0  # completions asked for
    completions: int = 0  # completions returned
    retries: int = 0  # attempts repeated after a connection error, timeout or 5xx
    failures: int = 0  # requests that ended in a SamplerError


def normalize_base_url(url: str) -> str:
    """`http://host:port`, `.../v1`, `.../v1/` or `host:port` -> `http://host:port/v1`."""
    url = url.strip()
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{url!r} is not an http(s) URL of an OpenAI-compatible server",
            fix="pass e.g. openai:http://127.0.0.1:8000 (or .../v1)",
        )
    path = parts.path.rstrip("/")
    if path.endswith("/completions"):  # someone pasted the endpoint itself
        path = path.removesuffix("/completions")
    if not path.endswith("/v1"):
        path += "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class _WireLogprobs(BaseModel):
    model_config = ConfigDict(extra="ignore")

    token_logprobs: list[float | None] | None = None


class _WireChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    token_ids: list[int] | None = None
    logprobs: _WireLogprobs | None = None
    finish_reason: str | None = None
    token_versions: list[int] | None = None  # agentrl serve's extension


class _WireCompletion(BaseModel):
    model_config = ConfigDict(extra="ignore")

    choices: list[_WireChoice]


class OpenAISampler:
    """Samples over HTTP from a vLLM-compatible server, token ids in and out (Sampler protocol)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        timeout: float = 120.0,
        max_retries: int = 3,
        api_key: str = "EMPTY",
        backoff: float = 0.5,
        cache_salt: bool = False,
    ) -> None:
        """`cache_salt`: send vLLM's `cache_salt` (the weights version), see the router."""
        if max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {max_retries}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.cache_salt = cache_salt
        self.stats = OpenAISamplerStats()
        self._policy_version = 0
        self._model_lock = asyncio.Lock()
        # Our own retries (tenacity) replace the client's, so every one is counted.
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=api_key, timeout=timeout, max_retries=0
        )

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def set_policy_version(self, version: int) -> None:
        """The version stamped on completions whose server sends no version header."""
        self._policy_version = version

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        """POST /v1/completions with `prompt_ids`; `session_id` travels as a header only."""
        if not prompt_ids:
            raise SamplerError("the prompt is empty", fix="pass at least one token id")
        self.stats.requests += 1
        # A server that reports no version sampled under the one published when we sent:
        # the router gates requests while it publishes, so that is exact.
        sent_version = self._policy_version
        headers = {SESSION_HEADER: session_id} if session_id else None
        # vLLM keys prefix-cache blocks by the salt too: blocks of older weights are not reused.
        salt = {"cache_salt": f"agentrl-v{sent_version}"} if self.cache_salt else {}
        try:
            model = await self._model_name()
            raw = await self._with_retries(
                "POST /completions",
                lambda: self._client.completions.with_raw_response.create(
                    model=model,
                    prompt=list(prompt_ids),
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    seed=params.seed,  # null: the server draws fresh entropy
                    stop=list(params.stop) or None,
                    n=1,
                    logprobs=0,
                    extra_headers=headers,
                    extra_body={
                        "return_token_ids": True,
                        "stop_token_ids": list(params.stop_token_ids),
                        "skip_special_tokens": False,
                        "include_stop_str_in_output": True,
                        # Pin what a server's generation_config could otherwise default.
                        "top_k": -1,
                        "min_p": 0.0,
                        "repetition_penalty": 1.0,
                        **salt,
                    },
                ),
            )
            completion = self._parse(
                raw.content, raw.headers.get(POLICY_VERSION_HEADER), sent_version
            )
        except SamplerError:
            self.stats.failures += 1
            raise
        self.stats.completions += 1
        return completion

    async def check(self) -> None:
        """Raise SamplerError (with its fix) unless the server answers and names a model."""
        await self._model_name()

    async def close(self) -> None:
        """Close the HTTP client; safe to call twice."""
        await self._client.close()

    async def _model_name(self) -> str:
        if self.model is not None:
            return self.model
        async with self._model_lock:  # discover once, however many requests wait
            if self.model is None:
                page = await self._with_retries("GET /models", self._client.models.list)
                if not page.data:
                    raise SamplerError(
                        f"{self.base_url}/models lists no model",
                        fix="start the server with a model, or pass model= explicitly",
                    )
                self.model = page.data[0].id
        return self.model

    async def _with_retries(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        def count(state: RetryCallState) -> None:
            self.stats.retries += 1

        attempts = self.max_retries + 1
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(attempts),
                wait=wait_exponential(multiplier=self.backoff, max=30),
                retry=retry_if_exception(_retryable),
                before_sleep=count,
                reraise=True,
            ):
                with attempt:
                    return await call()
        except openai.APIStatusError as e:
            if e.status_code >= 500:
                raise ServerUnavailable(
                    f"{self.base_url} answered {what} with HTTP {e.status_code} "
                    f"{attempts} time(s): {_server_message(e)}",
                    fix="look at the server's log; it failed while serving the request",
                ) from e
            raise SamplerError(
                f"{self.base_url} rejected {what} (HTTP {e.status_code}): {_server_message(e)}",
                fix=_fix_for(e.status_code),
            ) from e
        except openai.APIConnectionError as e:
            reason = (
                f"timed out after {self.timeout:g} s"
                if isinstance(e, openai.APITimeoutError)
                else one_line(str(e.__cause__ or e.message), 400)
            )
            raise ServerUnavailable(
                f"no answer from {self.base_url} to {what} after {attempts} attempt(s): {reason}",
                fix="start the server (agentrl serve, or vllm serve MODEL) and check the URL",
            ) from e
        raise AssertionError("unreachable: tenacity either returns or reraises")

    def _parse(self, body: bytes, version_header: str | None, sent_version: int) -> Completion:
        try:
            wire = _WireCompletion.model_validate_json(body)
        except ValidationError as e:
            raise _malformed(self.base_url, str(e)) from e
        if len(wire.choices) != 1:
            raise _malformed(self.base_url, f"{len(wire.choices)} choices for n=1")
        choice = wire.choices[0]
        if choice.token_ids is None:
            raise _malformed(
                self.base_url,
                "no choices[0].token_ids (the server must support return_token_ids: "
                "vLLM >= 0.10.2)",
            )
        if choice.logprobs is None or choice.logprobs.token_logprobs is None:
            raise _malformed(self.base_url, "no choices[0].logprobs.token_logprobs")
        logprobs = choice.logprobs.token_logprobs
        if len(logprobs) != len(choice.token_ids):
            raise _malformed(
                self.base_url,
                f"{len(choice.token_ids)} token ids but {len(logprobs)} logprobs",
            )
        if any(lp is None or math.isnan(lp) or lp > 0 for lp in logprobs):
            raise _malformed(self.base_url, f"logprobs must be numbers <= 0, got {logprobs}")
        finish = _FINISH_REASONS.get(choice.finish_reason or "")
        if finish is None:
            raise _malformed(
                self.base_url,
                f"finish_reason {choice.finish_reason!r} is not one of stop, length, abort",
            )
        version = self._version_from(version_header, sent_version)
        versions = choice.token_versions
        if versions is not None and (
            len(versions) != len(choice.token_ids)
            or any(b < a for a, b in zip([version, *versions], versions, strict=False))
        ):
            raise _malformed(
                self.base_url,
                f"token_versions {versions[:8]} must align with the token ids and never go "
                f"below the policy version {version} or back",
            )
        return Completion(
            token_ids=choice.token_ids,
            logprobs=[float(lp) for lp in logprobs if lp is not None],
            finish_reason=finish,
            policy_version=version,
            token_versions=versions or [version] * len(choice.token_ids),
        )

    def _version_from(self, header: str | None, sent_version: int) -> int:
        if header is None:
            return sent_version
        try:
            version = int(header)
        except ValueError:
            version = -1
        if version < 0:
            raise _malformed(self.base_url, f"header {POLICY_VERSION_HEADER}: {header!r}")
        return version


def _retryable(exc: BaseException) -> bool:
    # Only failures that returned no completion: nothing sampled was seen, so nothing is lost.
    if isinstance(exc, openai.APIConnectionError):  # includes APITimeoutError
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500


def _server_message(e: openai.APIStatusError) -> str:
    body = e.body
    message: object = body
    if isinstance(body, dict):
        message = body.get("message", body)
    if not isinstance(message, str):
        message = json.dumps(message) if message is not None else e.message
    return one_line(message, 400)


def _fix_for(status: int) -> str:
    if status == 404:
        return "check the URL and the model name (GET /v1/models lists the served ones)"
    if status in (401, 403):
        return "pass the server's API key"
    return "the server refused these parameters; check its version and the request above"


def _malformed(url: str, what: str) -> SamplerError:
    return SamplerError(
        one_line(f"{url} returned an unusable completion: {what}", 400),
        fix="use a vLLM-compatible server that returns token ids and logprobs",
    )
