"""A simulated sampler: scripted replies, timed by a continuous-batching latency model.

For benchmarks and tests of scheduling, where what matters is *when* a completion
comes back, not what it says. Each session plays its own script (reply text plus the
number of tokens the model would decode for it). The engine decodes every active
request together, one step at a time, as vLLM-style continuous batching does: a step
takes `step_s(b) = base_s + per_request_s * b` for `b` requests in flight, so a
fuller batch is slower per step but faster per token; a request joins at the next
step boundary and leaves when its tokens are done. Returned ids are the reply's real
tokens (so the episode parses and runs the tool call); logprobs are 0.0.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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


class SimulatedSampler:
    """A Sampler whose sessions play `scripts[session_id]` under `latency`."""

    def __init__(
        self,
        scripts: dict[str, Script],
        tokenizer: PreTrainedTokenizerBase,
        latency: LatencyModel | None = None,
    ) -> None:
        self.scripts = scripts
        self.tokenizer = tokenizer
        self.latency = latency or LatencyModel()
        self.eos = int(tokenizer.eos_token_id)
        self._active: list[_Request] = []
        self._engine: asyncio.Task[None] | None = None
        self._closed = False
        self.decoded_tokens = 0

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        if self._closed:
            raise SamplerError("the simulated sampler is closed")
        script = self.scripts.get(session_id or "")
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
        return Completion(
            token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish, policy_version=0
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
            batch = list(self._active)  # newcomers join at the next step boundary
            steps = min(self.latency.chunk_steps, min(r.remaining for r in batch))
            clock = max(clock, loop.time() - _MAX_LAG_S) + steps * self.latency.step_s(len(batch))
            await asyncio.sleep(max(0.0, clock - loop.time()))
            self.decoded_tokens += steps * len(batch)
            for request in batch:
                request.remaining -= steps
                if request.remaining <= 0 and request in self._active:
                    self._active.remove(request)
                    if not request.done.done():
                        request.done.set_result(None)

    async def close(self) -> None:
        self._closed = True
        if self._engine is not None:
            self._engine.cancel()
