"""Sampling sessions: each samples one snapshot of a model's weights with a LocalSampler.

Tinker's sampling clients are snapshots: session k keeps sampling with the weights it
was created with, whatever is published later. So every session owns a LocalSampler
over its own copy of the model, filled by the learner's `publish` (LoRA merged) or, for
a base-model session, straight from disk. The newest `keep` sessions of each owner (a
training model; or a client session's base-model samplers) stay; an older one is
released, and a request to it fails with a message naming --keep-samplers.

Stops: Tinker's `stop=None` means EOS, `[]` means never stop (not even at EOS), token
ids replace EOS, and strings stop in addition to EOS. The samplers are built without
an implicit EOS and get the resolved stop ids with every request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from pydantic import ValidationError

from agentrl.errors import SamplerError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.local import LocalSampler
from agentrl.tinker_server.futures import Future
from agentrl.tinker_server.wire import SampledSequence, UserError, encode_sample_response

if TYPE_CHECKING:
    from tinker import types
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSession:
    id: str
    owner: str  # the training model it snapshots, or "<session>:base"
    sampler: LocalSampler


class Samplers:
    """The live sampling sessions, and the event loop their LocalSamplers answer on."""

    def __init__(
        self,
        model_dir: Path,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_ids: Sequence[int],
        pad_id: int,
        keep: int,
        device: torch.device,
    ) -> None:
        self.model_dir, self.tokenizer, self.keep = model_dir, tokenizer, keep
        self.eos_ids, self.pad_id, self.device = tuple(eos_ids), pad_id, device
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, SamplingSession] = OrderedDict()  # oldest first
        self._released: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tinker-sampling-loop", daemon=True
        )
        self._thread.start()

    def new_sampler(self, *, untie: bool = False) -> LocalSampler:
        """A sampler over a fresh copy of the model on disk (publish may overwrite it).

        `untie`: give lm_head its own weight, for a LoRA that adapts a tied lm_head.
        """
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        if untie:
            from agentrl.weights.lora import untie_output

            untie_output(model)
        torch.nn.Module.to(model.eval(), self.device)  # transformers' `to` confuses mypy
        return LocalSampler(
            model, eos_token_ids=(), pad_token_id=self.pad_id, tokenizer=self.tokenizer
        )

    def add(self, session_id: str, owner: str, sampler: LocalSampler) -> None:
        """Register a session; release the owner's oldest beyond the newest `keep`."""
        with self._lock:
            self._sessions[session_id] = SamplingSession(session_id, owner, sampler)
            mine = [s for s in self._sessions.values() if s.owner == owner]
            released = mine[: max(0, len(mine) - self.keep)]
            for s in released:
                del self._sessions[s.id]
                self._released.add(s.id)
        log.info("sampling session %s ready (weights of %s)", session_id, owner)
        self._close(released)

    def release_owner(self, owner: str) -> None:
        with self._lock:
            released = [s for s in self._sessions.values() if s.owner == owner]
            for s in released:
                del self._sessions[s.id]
                self._released.add(s.id)
        self._close(released)

    def owner(self, session_id: str) -> str:
        return self._get(session_id).owner

    def submit(self, future: Future, request: types.SampleRequest) -> None:
        """Sample on the session's LocalSampler; `future` gets the SampleResponse proto."""
        try:
            session = self._get(request.sampling_session_id)
            prompt = _prompt(request)
            params_N = self._params(request.sampling_params, request.num_samples)
        except UserError as e:
            future.fail(str(e))
            return
        work = asyncio.run_coroutine_threadsafe(
            self._sample(session, prompt, params_N, bool(request.prompt_logprobs)), self._loop
        )
        work.add_done_callback(lambda done: future.settle(done.result))

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), OrderedDict()
        for s in sessions:
            asyncio.run_coroutine_threadsafe(s.sampler.close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _sample(
        self,
        session: SamplingSession,
        prompt: list[int],
        params_N: list[SamplingParams],
        with_prompt_logprobs: bool,
    ) -> bytes:
        sampler = session.sampler
        try:
            completions = await asyncio.gather(*(sampler.generate(prompt, p) for p in params_N))
        except SamplerError as e:
            if session.id in self._released:  # closed under a running request
                raise self._released_error(session.id) from e
            raise UserError(str(e)) from e
        prompt_lp = None
        if with_prompt_logprobs:
            prompt_lp = await asyncio.to_thread(prompt_logprobs, sampler, prompt)
        return encode_sample_response([_sequence(c) for c in completions], prompt_lp)

    def _get(self, session_id: str | None) -> SamplingSession:
        with self._lock:
            session = self._sessions.get(session_id or "")
        if session is not None:
            return session
        if session_id in self._released:
            raise self._released_error(session_id)
        if session_id is None:
            raise UserError(
                "sample needs a sampling_session_id (save_weights_and_get_sampling_client, "
                "or create_sampling_client(base_model=...))"
            )
        raise UserError(f"unknown sampling session {session_id}")

    def _released_error(self, session_id: str) -> UserError:
        return UserError(
            f"sampling session {session_id} was released: this server keeps the newest "
            f"{self.keep} sampling sessions per model (raise --keep-samplers to keep more)"
        )

    def _params(self, p: types.SamplingParams, n: int) -> list[SamplingParams]:
        if n < 1:
            raise UserError(f"num_samples must be >= 1, got {n}")
        if p.top_k not in (-1, 0):
            raise UserError(f"top_k {p.top_k} is not supported by this server: send -1")
        stop = p.stop
        ids: tuple[int, ...] = self.eos_ids
        strings: tuple[str, ...] = ()
        if isinstance(stop, str):
            strings = (stop,)
        elif stop is not None and all(isinstance(s, int) for s in stop):
            ids = tuple(int(s) for s in stop)  # explicit ids replace EOS; [] never stops
        elif stop is not None:
            strings = tuple(str(s) for s in stop)
        # One seed for n samples: sample i uses seed + i, so they differ yet repeat.
        seeds = [None if p.seed is None else p.seed + i for i in range(n)]
        try:
            return [
                SamplingParams(
                    max_tokens=SamplingParams().max_tokens
                    if p.max_tokens is None
                    else p.max_tokens,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    stop_token_ids=ids,
                    stop=strings,
                    seed=seed,
                )
                for seed in seeds
            ]
        except ValidationError as e:
            err = e.errors(include_url=False)[0]
            raise UserError(f"sampling_params.{err['loc'][0]}: {err['msg']}") from e

    def _close(self, sessions: list[SamplingSession]) -> None:
        for s in sessions:
            log.info("sampling session %s released", s.id)
            asyncio.run_coroutine_threadsafe(s.sampler.close(), self._loop)


def prompt_logprobs(sampler: LocalSampler, prompt: list[int]) -> np.ndarray:
    """logprob of each prompt token given the ones before it (T=1); NaN for the first."""
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=sampler.model.device)
        logits_T_V = sampler.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        picked_T = logits_T_V.gather(-1, ids[0, 1:, None]).squeeze(-1)
        lp_T = (picked_T - logits_T_V.logsumexp(-1)).cpu().numpy()
    return np.concatenate([[math.nan], lp_T]).astype(np.float32)


def _prompt(request: types.SampleRequest) -> list[int]:
    unsupported = {
        "topk_prompt_logprobs": request.topk_prompt_logprobs > 0,
        "topk_sample_logprobs": request.topk_sample_logprobs > 0,
        "target_prompt_logprobs": request.target_prompt_logprobs is not None,
        "prompt_alt_tokens_k": request.prompt_alt_tokens_k > 0,
        "prompt_logprobs_last_n": request.prompt_logprobs_last_n is not None,
        "record_stability_info": bool(request.record_stability_info),
    }
    asked = [name for name, on in unsupported.items() if on]
    if asked:
        raise UserError(f"not supported by this server: {', '.join(asked)}")
    tokens: list[int] = []
    for chunk in request.prompt.chunks:
        if chunk.type != "encoded_text":
            raise UserError(f"the prompt has a {chunk.type} chunk; this server samples tokens only")
        tokens += chunk.tokens
    return tokens


def _sequence(c: Completion) -> SampledSequence:
    if c.finish_reason == "abort":  # nothing here pauses a sampler; a bug if it happens
        raise SamplerError("the sampler aborted a completion")
    return SampledSequence(c.token_ids, c.logprobs, c.finish_reason)
