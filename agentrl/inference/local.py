"""LocalSampler: the embedded, in-process sampler (a transformers causal LM on local torch).

It owns one worker thread that batches concurrent requests (static batching): the
pending requests are left-padded into one prefill, then decoded step by step with the
KV cache, each row with its own params, stop ids and RNG. Callers stay on their own
asyncio loops; results come back through `loop.call_soon_threadsafe`.

Sampling, per row and step: `logits / temperature`, softmax, then top-p keeps the
smallest set of most likely tokens whose mass reaches `top_p` and renormalises it. The
reported logprob is that of the sampled token under exactly this distribution. With
temperature 0 (greedy) the distribution is a point mass, so the logprob is 0.0.

`update_weights` swaps in a trainer's new weights between batches: the worker holds
`_weights_lock` for a whole batch. `pause(mode)` is vLLM's: `abort` ends the running batch
at the next step (finish_reason abort, the tokens so far returned), `wait` lets it finish,
`keep` parks it between two steps and lets go of the weights, so an update can land
mid-completion; the batch then decodes on under the new weights. Every sampled token is
stamped with the version of the weights that produced it (`Completion.token_versions`).
Requests that arrive while paused wait for `resume()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, FinishReason, SamplingParams

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]


@dataclass
class SamplerStats:
    """Counters that show batching at work."""

    batches: int = 0
    requests: int = 0
    max_batch_size: int = 0
    tokens: int = 0


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]


@dataclass
class _Row:
    """Decoding state of one request inside a batch."""

    request: _Request
    max_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    searched: int = 0  # characters of decoded output already searched for stop strings


class _Closed(Exception):
    """Raised inside the worker when close() interrupts a running batch."""


class LocalSampler:
    """Batched sampling from a transformers causal LM in this process (Sampler protocol)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 16,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_window_s: float = 0.02,
    ) -> None:
        """`tokenizer` (the model's) is needed only by requests with stop strings.

        A batch takes every request that arrives within `batch_window_s` of the one
        before it (static batching: a started batch takes no one in).
        """
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_window_s < 0:
            raise ConfigError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        gen_config = model.generation_config
        eos = eos_token_ids if eos_token_ids is not None else _ids(gen_config.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        pad = pad_token_id if pad_token_id is not None else gen_config.pad_token_id
        # Any id works for padding (it is masked out); fall back to an EOS id or 0.
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)
        self.context_length = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        self.tokenizer = tokenizer

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # pause, resume, batch start/end
        # Held by the worker for a whole batch (except while parked by pause "keep");
        # taken before _lock, never after it.
        self._weights_lock = threading.Lock()
        self._pause_mode: PauseMode | None = None  # None: not paused
        self._running = False  # a batch is decoding
        self._parked = False  # the running batch waits between two steps (pause keep)
        self._policy_version = 0
        # How update_weights meets running requests (see there); the async schedule: keep.
        self.publish_pause: PauseMode | None = None
        self._stats = SamplerStats()
        self._closed = False
        self._stop = threading.Event()
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_model(cls, model: str) -> LocalSampler:
        """A sampler over `model`: 'embedded' (SmolLM2-135M) or a model folder."""
        if model == "embedded":
            return cls.embedded()
        from transformers import AutoModelForCausalLM

        return cls(
            AutoModelForCausalLM.from_pretrained(model, dtype="float32").eval(),
            tokenizer=model_tokenizer(model),
        )

    @classmethod
    def embedded(cls, *, max_batch_size: int = 16) -> LocalSampler:
        """A sampler over the embedded SmolLM2 model (converted once, then cached)."""
        from agentrl.inference import embedded

        tokenizer = embedded.load_tokenizer()
        eos = tokenizer.eos_token_id
        return cls(
            embedded.load_model(),
            eos_token_ids=None if eos is None else [int(eos)],
            pad_token_id=tokenizer.pad_token_id,
            max_batch_size=max_batch_size,
            tokenizer=tokenizer,
        )

    @property
    def policy_version(self) -> int:
        with self._lock:
            return self._policy_version

    def set_policy_version(self, version: int) -> None:
        """Stamp `version` on every request whose generation starts from now on."""
        with self._lock:
            self._policy_version = version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the model, then stamp `version`.

        How running requests meet the update is `publish_pause`: None waits for the
        running batch to finish (not for the queue to drain); "keep" parks it between two
        steps and lets it decode on under the new weights; "abort" ends it. A sampler
        someone already paused is updated as it stands. Values are copied, so the caller
        may keep training its tensors. Every key of the model must be present and no
        other: a partial update would silently mix two policies.
        """
        if version < 0:
            raise SamplerError(f"policy version must be >= 0, got {version}")
        pause = self.publish_pause if not self.is_paused else None
        if pause is not None:
            self.pause(pause)
        try:
            with self._weights_lock:
                self._copy_in(state_dict)
                self.set_policy_version(version)
        finally:
            if pause is not None:
                self.resume()

    def _copy_in(self, state_dict: dict[str, torch.Tensor]) -> None:
        # Checked before copying: load_state_dict would copy the good keys, then raise.
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        missing, unexpected = shapes.keys() - state_dict, state_dict.keys() - shapes
        reshaped = [
            k for k in shapes.keys() & state_dict if tuple(state_dict[k].shape) != shapes[k]
        ]
        if missing or unexpected or reshaped:
            raise SamplerError(
                "update_weights: the state dict does not fit the sampler's model (missing "
                f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}, other shape "
                f"{sorted(reshaped)[:3]})",
                fix="publish weights of the same architecture the sampler was built with",
            )
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)

    def load_weights(self, path: str | Path, version: int) -> None:
        """`update_weights` from a folder of safetensors files with the model's names.

        A tied weight (one tensor under two names) may be saved under either name.
        """
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise SamplerError(
                f"{path} holds no .safetensors file",
                fix="publish the weights there first (a checkpoint folder of the same model)",
            )
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file))
        by_storage: dict[int, list[str]] = {}
        for name, tensor in self.model.state_dict().items():
            by_storage.setdefault(tensor.data_ptr(), []).append(name)
        for names in by_storage.values():
            saved = [n for n in names if n in state]
            for name in names:
                if name not in state and saved:
                    state[name] = state[saved[0]]
        self.update_weights(state, version)

    def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating until `resume()`; returns once no forward pass is running.

        abort: the running batch ends at its next step with finish_reason "abort".
        wait: the running batch finishes first. keep: it parks between two steps and
        continues after resume(), under whatever weights are loaded then.
        """
        if mode not in ("abort", "wait", "keep"):
            raise SamplerError(f"pause mode must be abort, wait or keep, not {mode!r}")
        with self._changed:
            self._pause_mode = mode
            self._changed.notify_all()
            while self._running and not self._parked and not self._stop.is_set():
                self._changed.wait()

    def resume(self) -> None:
        """Undo `pause`: parked and waiting requests go on."""
        with self._changed:
            self._pause_mode = None
            self._changed.notify_all()

    @property
    def is_paused(self) -> bool:
        with self._lock:
            return self._pause_mode is not None

    @property
    def stats(self) -> SamplerStats:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        """Sample a completion of `prompt_ids`; `session_id` is unused (one replica)."""
        self._check_prompt(prompt_ids)
        if params.stop and self.tokenizer is None:
            raise SamplerError(
                "this request has stop strings but the local sampler has no tokenizer to "
                "decode with",
                fix="build the LocalSampler with tokenizer=",
            )
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), params, loop, loop.create_future())
        with self._lock:
            if self._closed:
                raise SamplerError(
                    "the local sampler is closed", fix="create a new sampler to generate"
                )
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._worker, name="agentrl-local-sampler", daemon=True
                )
                self._thread.start()
            self._queue.put(request)
        return await request.future

    async def close(self) -> None:
        """Stop the worker and fail every unfinished request; safe to call twice."""
        await asyncio.to_thread(self._shutdown)

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise SamplerError("the prompt is empty", fix="pass at least one token id")
        if len(prompt_ids) >= self.context_length:
            raise SamplerError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{self.context_length} (max_position_embeddings): no room to generate",
                fix="shorten the prompt or end the episode with context_limit",
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise SamplerError(
                f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})",
                fix="tokenize with the tokenizer that belongs to this model",
            )

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._stop.set()
        with self._changed:
            self._changed.notify_all()  # wake a paused or parked worker
        self._queue.put(None)  # wake a worker blocked on an empty queue
        if thread is not None:
            thread.join()
        # Requests that never reached a batch.
        while True:
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                return
            if request is not None:
                _settle(request, _closed_error())

    def _worker(self) -> None:
        while not self._stop.is_set():
            batch = self._take_batch()
            if not batch:
                continue
            with self._changed:  # a paused sampler starts no batch
                while self._pause_mode is not None and not self._stop.is_set():
                    self._changed.wait()
                self._running = True
            try:
                if not self._run_or_settle(batch):
                    return
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()

    def _run_or_settle(self, batch: list[_Request]) -> bool:
        """Decode `batch` and settle every request; False once the sampler is closed."""
        if self._stop.is_set():
            for request in batch:
                _settle(request, _closed_error())
            return False
        try:
            completions = self._run_batch(batch)
        except _Closed:
            for request in batch:
                _settle(request, _closed_error())
            return False
        except Exception as exc:
            log.exception("local sampler batch of %d failed", len(batch))
            for request in batch:
                error = SamplerError(f"local sampler failed: {exc!r}")
                error.__cause__ = exc
                _settle(request, error)
            return True
        for request, completion in zip(batch, completions, strict=True):
            _settle(request, completion)
        return True

    def _take_batch(self) -> list[_Request]:
        first = self._queue.get()  # blocks until a request or the close() wake-up
        if first is None:
            return []
        batch = [first]
        # Requests that arrive within the window of the one before join this batch: over
        # HTTP a wave of concurrent requests lands spread over milliseconds.
        while len(batch) < self.max_batch_size:
            try:
                request = self._queue.get(timeout=self.batch_window_s)
            except queue.Empty:
                break
            if request is None:  # close() woke us
                break
            batch.append(request)
        return batch

    def _run_batch(self, batch: list[_Request]) -> list[Completion]:
        # The version is read under the weights lock: it names exactly the weights decoded.
        with self._weights_lock, torch.inference_mode():
            return self._decode(batch)

    def _decode(self, batch: list[_Request]) -> list[Completion]:
        with self._lock:
            first_version = self._policy_version
            self._stats.batches += 1
            self._stats.requests += len(batch)
            self._stats.max_batch_size = max(self._stats.max_batch_size, len(batch))
        rows = [self._new_row(request) for request in batch]
        device = self.model.device

        # Left padding puts every row's last prompt token in the same column.
        width = max(len(r.prompt_ids) for r in batch)
        input_ids_B_T = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(batch), width), dtype=torch.long)
        for i, request in enumerate(batch):
            n = len(request.prompt_ids)
            input_ids_B_T[i, width - n :] = torch.tensor(request.prompt_ids)
            mask_B_T[i, width - n :] = 1
        input_ids_B_T, mask_B_T = input_ids_B_T.to(device), mask_B_T.to(device)
        positions_B_T = (mask_B_T.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache(config=self.model.config)  # filled in place by every forward
        out = self.model(
            input_ids=input_ids_B_T,
            attention_mask=mask_B_T,
            position_ids=positions_B_T,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        next_position_B = positions_B_T[:, -1] + 1
        version = first_version
        while True:
            next_ids_B = self._sample_step(rows, out.logits[:, -1, :], version)
            if all(row.finish_reason is not None for row in rows):
                break
            if self._stop.is_set():
                raise _Closed
            if self._pause_point(rows):
                break
            with self._lock:
                version = self._policy_version
            # Finished rows keep decoding padding; their outputs are ignored.
            mask_B_T = torch.cat([mask_B_T, mask_B_T.new_ones((len(rows), 1))], dim=1)
            out = self.model(
                input_ids=next_ids_B[:, None],
                attention_mask=mask_B_T,
                position_ids=next_position_B[:, None],
                cache=cache,
                use_cache=True,
            )
            # Finished rows could run past the context; their positions are never read.
            next_position_B = (next_position_B + 1).clamp(max=self.context_length - 1)

        with self._lock:
            self._stats.tokens += sum(len(row.token_ids) for row in rows)
        return [
            Completion(
                token_ids=row.token_ids,
                logprobs=row.logprobs,
                finish_reason=row.finish_reason or "length",
                policy_version=first_version,
                token_versions=row.versions,
            )
            for row in rows
        ]

    def _new_row(self, request: _Request) -> _Row:
        params = request.params
        generator = torch.Generator(device=self.model.device)
        if params.seed is None:
            generator.seed()  # fresh entropy per request
        else:
            generator.manual_seed(params.seed)
        return _Row(
            request=request,
            # Generation also ends where the model's context does.
            max_tokens=min(params.max_tokens, self.context_length - len(request.prompt_ids)),
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            generator=generator,
        )

    def _pause_point(self, rows: list[_Row]) -> bool:
        """Between two steps: obey a pause. True when the batch must end now (abort)."""
        with self._changed:
            mode = self._pause_mode
            if mode is None or mode == "wait":
                return False
            if mode == "abort":
                for row in rows:
                    row.finish_reason = row.finish_reason or "abort"
                return True
            self._parked = True
            self._changed.notify_all()
        self._weights_lock.release()  # pause keep: an update may land now
        try:
            with self._changed:
                while self._pause_mode is not None and not self._stop.is_set():
                    self._changed.wait()
                self._parked = False
        finally:
            self._weights_lock.acquire()
        if self._stop.is_set():
            raise _Closed
        return False

    def _sample_step(
        self, rows: list[_Row], logits_B_V: torch.Tensor, version: int
    ) -> torch.Tensor:
        """Sample one token per unfinished row; returns the ids to feed next (pad if done)."""
        # Greedy rows take the argmax; their 1.0 only avoids dividing by zero.
        temperatures_B = torch.tensor(
            [row.request.params.temperature or 1.0 for row in rows], device=logits_B_V.device
        )
        logprobs_B_V = torch.log_softmax(logits_B_V.float() / temperatures_B[:, None], dim=-1)
        next_ids = []
        for row, logprobs_V in zip(rows, logprobs_B_V, strict=True):
            if row.finish_reason is not None:
                next_ids.append(self.pad_token_id)
                continue
            token, logprob = _sample(logprobs_V, row.request.params, row.generator)
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            if token in row.stop_ids or self._stopped_on_string(row):
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.max_tokens:
                row.finish_reason = "length"
            next_ids.append(token)
        return torch.tensor(next_ids, device=logits_B_V.device)

    def _stopped_on_string(self, row: _Row) -> bool:
        """Whether the row's decoded output now contains one of its stop strings."""
        stops = row.request.params.stop
        if not stops:
            return False
        assert self.tokenizer is not None  # generate() checks
        text = str(self.tokenizer.decode(row.token_ids))
        # A match must end in text not searched before; it may start up to len-1 earlier.
        start = max(0, row.searched - max(len(s) for s in stops) + 1)
        row.searched = len(text)
        return any(s in text[start:] for s in stops)


def _sample(
    logprobs_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Draw one token from tempered log-probs with top-p; return it and its logprob."""
    if params.temperature == 0:
        return int(logprobs_V.argmax()), 0.0  # greedy: a point mass
    if params.top_p >= 1.0:
        token = int(torch.multinomial(logprobs_V.exp(), 1, generator=generator))
        return token, float(logprobs_V[token])
    sorted_V, order_V = logprobs_V.sort(descending=True)
    probs_V = sorted_V.exp()
    # Keep a token while the mass before it is below top_p: the smallest set reaching top_p.
    kept = int(((probs_V.cumsum(0) - probs_V) < params.top_p).sum())
    nucleus = sorted_V[:kept] - torch.logsumexp(sorted_V[:kept], dim=0)
    index = int(torch.multinomial(nucleus.exp(), 1, generator=generator))
    return int(order_V[index]), float(nucleus[index])


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _closed_error() -> SamplerError:
    return SamplerError(
        "the local sampler was closed before this request finished",
        fix="close the sampler only after its requests are done",
    )


def _settle(request: _Request, result: Completion | SamplerError) -> None:
    # RuntimeError: the caller's loop is closed, so nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        request.loop.call_soon_threadsafe(_set_future, request.future, result)


def _set_future(future: asyncio.Future[Completion], result: Completion | SamplerError) -> None:
    if future.done():
        return  # the caller cancelled
    if isinstance(result, SamplerError):
        future.set_exception(result)
    else:
        future.set_result(result)


def model_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `model`: the embedded model's, or the one saved in its folder."""
    from agentrl.inference.embedded import load_tokenizer

    if model == "embedded":
        return load_tokenizer()
    from transformers import AutoTokenizer

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model {model}: no tokenizer could be loaded from it ({e})".splitlines()[0],
            fix="save the model's tokenizer in that folder (tokenizer.save_pretrained)",
        ) from e
    return tokenizer
