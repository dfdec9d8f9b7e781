"""A simulated sampler: scripted replies, timed by a continuous-batching latency model.

For benchmarks and tests of scheduling, where what matters is *when* a completion
comes back, not what it says. Each session plays its own script (reply text plus the
number of tokens the model would decode for it). The engine decodes every active
request together, one step at a time, as vLLM-style continuous batching does: a step
takes `step_s(b) = base_s + per_request_s * b` for `b` requests in flight, so a
fuller batch is slower per step but faster per token; a request joins at the next
step boundary and leaves when its tokens are done. Returned ids are the reply's real
tokens (so the episode parses and runs the tool call); logprobs are 0.0.

It is also a weight sink (`update_weights`), as a vLLM server behind the router is under
pause "keep": the engine stops at the next step boundary, in-flight requests are kept,
the weights "move" for `transfer_s`, and decoding resumes under the new version. Each
returned token carries the version of the step that decoded it (the modelled steps are
spread over the reply's real tokens in proportion), so a reply that spans a publication
shows both versions, exactly as `agentrl serve` reports them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import SamplerError
from agentrl.inference.base import Completion, FinishReason, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class LatencyModel(BaseModel):
    """Seconds per decode step as a function of the requests decoded together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Defaults: a straight-line fit to a measured vLLM concurrency sweep (v0.23, Qwen2.5-0.5B,
    # one L4; inter-token latency p50 5.1/5.2/5.3/5.5/6.0/7.1 ms at 1/2/4/8/16/32 requests):
    # memory-bound decode, where batching more requests costs little per step.
    base_s: float = Field(default=0.005, gt=0, description="step time of a batch of one")
    per_request_s: float = Field(default=0.000065, ge=0, description="added per request in flight")
    chunk_steps: int = Field(
        default=8, ge=1, description="steps simulated per tick (join/leave granularity)"
    )

    def step_s(self, batch: int) -> float:
        return self.base_s + self.per_request_s * batch


_MAX_LAG_S = 0.05


@dataclass
class Script:
    """One session's replies and the tokens each costs to decode."""

    replies: list[str]
    tokens: list[int]
    calls: int = 0


@dataclass
class _Request:
    remaining: int
    done: asyncio.Future[None] = field(repr=False)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (version, steps)


class SimulatedSampler:
    """A Sampler whose sessions play `scripts[session_id]` under `latency`.

    `scripts` maps session ids to scripts, or is a function that makes the script of a
    session on its first request (sessions that are not known in advance).
    """

    def __init__(
        self,
        scripts: Mapping[str, Script] | Callable[[str], Script],
        tokenizer: PreTrainedTokenizerBase,
        latency: LatencyModel | None = None,
        *,
        transfer_s: float = 0.0,
    ) -> None:
        self._make = scripts if callable(scripts) else None
        self.scripts: dict[str, Script] = {} if callable(scripts) else dict(scripts)
        self.tokenizer = tokenizer
        self.latency = latency or LatencyModel()
        self.transfer_s = transfer_s
        self.eos = int(tokenizer.eos_token_id)
        self._active: list[_Request] = []
        self._engine: asyncio.Task[None] | None = None
        self._closed = False
        self.decoded_tokens = 0
        self._version = 0
        self._paused = threading.Event()  # set by update_weights (any thread)
        self.paused_s = 0.0  # seconds the engine stood still for publications
        self.publishes = 0

    @property
    def policy_version(self) -> int:
        return self._version

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Publish `version`: pause (keep), wait `transfer_s`, stamp the version, resume.

        Blocking; call it from a thread other than the event loop's while requests are
        in flight (the engine runs on the loop). The tensors themselves are not kept.
        """
        started = time.monotonic()
        self._paused.set()
        try:
            if self.transfer_s:
                time.sleep(self.transfer_s)
            self._version = version
            self.publishes += 1
        finally:
            self._paused.clear()
            self.paused_s += time.monotonic() - started

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        if self._closed:
            raise SamplerError("the simulated sampler is closed")
        script = self.scripts.get(session_id or "")
        if script is None and self._make is not None and session_id:
            script = self.scripts[session_id] = self._make(session_id)
        if script is None:
            raise SamplerError(f"no script for session {session_id!r}")
        k = min(script.calls, len(script.replies) - 1)
        script.calls += 1
        request = _Request(script.tokens[k], asyncio.get_running_loop().create_future())
        self._active.append(request)
        if self._engine is None or self._engine.done():
            self._engine = asyncio.create_task(self._run())
        try:
            await request.done
        finally:
            if request in self._active:  # cancelled (a timeout): leave the batch
                self._active.remove(request)
        ids = [*self.tokenizer.encode(script.replies[k], add_special_tokens=False), self.eos]
        ids = ids[: params.max_tokens]
        finish: FinishReason = "stop" if ids[-1] == self.eos else "length"
        versions = _spread(request.versions, len(ids)) or [self._version] * len(ids)
        return Completion(
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason=finish,
            policy_version=versions[0],
            token_versions=versions,
        )

    async def _run(self) -> None:
        """The engine: decode all active requests together until none is left.

        Time is kept on the engine's own clock, as a GPU keeps it: a chunk ends at the
        previous chunk's end plus its modelled time, so the event loop's late wake-ups
        do not add up (they would slow the modelled GPU by several percent). A loop
        stalled for longer than `_MAX_LAG_S` loses that time, as a stalled host would.
        """
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while self._active:
            while self._paused.is_set():  # a publication: in-flight requests are kept
                await asyncio.sleep(0.002)
                clock = loop.time()
            batch = list(self._active)  # newcomers join at the next step boundary
            steps = min(self.latency.chunk_steps, min(r.remaining for r in batch))
            version = self._version
            clock = max(clock, loop.time() - _MAX_LAG_S) + steps * self.latency.step_s(len(batch))
            await asyncio.sleep(max(0.0, clock - loop.time()))
            self.decoded_tokens += steps * len(batch)
            for request in batch:
                if request.versions and request.versions[-1][0] == version:
                    request.versions[-1] = (version, request.versions[-1][1] + steps)
                else:
                    request.versions.append((version, steps))
                request.remaining -= steps
                if request.remaining <= 0 and request in self._active:
                    self._active.remove(request)
                    if not request.done.done():
                        request.done.set_result(None)

    async def close(self) -> None:
        self._closed = True
        if self._engine is not None:
            self._engine.cancel()


def _spread(segments: list[tuple[int, int]], n: int) -> list[int]:
    """`n` token versions from (version, modelled steps) segments, in proportion."""
    total = sum(steps for _, steps in segments)
    if not total or not n:
        return []
    out: list[int] = []
    done = 0
    for version, steps in segments:
        done += steps
        out += [version] * (round(n * done / total) - len(out))
    return out
