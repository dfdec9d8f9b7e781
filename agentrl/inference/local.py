"""LocalSampler: the embedded, in-process sampler (a transformers causal LM on local torch).

One worker thread decodes every running request together, one token per row and step
(continuous batching): between two steps, requests that arrived are prefilled (among
themselves) and join the running batch, and a row that finished, or whose caller
cancelled, leaves it at once with its completion. So a short request waits for at most
one step of a long one, not for the whole of it. When the worker is idle, the first
request waits up to `batch_window_s` for others, so a wave of concurrent requests shares
one prefill. Rows are left-padded into one KV cache (`_Batch`), each with its own
positions, params, stop ids and RNG: a request samples the same tokens, and up to float
noise the same logprobs, alone or in a batch. Callers stay on their own asyncio loops;
results come back through `loop.call_soon_threadsafe`.

Sampling, per row and step: `logits / temperature`, softmax, then top-p keeps the
smallest set of most likely tokens whose mass reaches `top_p` and renormalises it. The
reported logprob is that of the sampled token under exactly this distribution. With
temperature 0 (greedy) the distribution is a point mass, so the logprob is 0.0.

`update_weights` swaps in a trainer's new weights between steps: the worker holds
`_weights_lock` while any row decodes, and while an update waits for it no request joins,
so the running rows drain first. `pause(mode)` is vLLM's: `abort` ends the running rows
at the next step (finish_reason abort, the tokens so far returned), `wait` lets them
finish, `keep` parks them between two steps and lets go of the weights, so an update can
land mid-completion; they then decode on under the new weights. Every sampled token is
stamped with the version of the weights that produced it (`Completion.token_versions`).
Requests that arrive while paused wait for `resume()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import ValidationError
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, FinishReason, SamplingParams

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "wait", "keep"]
SEED_RANGE = range(-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplerStats:
    """Counters that show batching at work."""

    batches: int = 0  # prefills: groups of requests that started decoding together
    requests: int = 0  # requests that started decoding
    max_batch_size: int = 0  # the most rows that decoded together
    tokens: int = 0  # tokens sampled for requests that ended
    active: int = 0  # rows decoding now
    waiting: int = 0  # requests not started yet (queued, or held by a pause or an update)
    cancelled: int = 0  # requests dropped because their caller cancelled


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]
    cancelled: threading.Event = field(default_factory=threading.Event)  # the caller left


@dataclass
class _Row:
    """Decoding state of one request inside the batch."""

    request: _Request
    max_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    version: int  # weights version when it started (Completion.policy_version)
    position: int  # position id of the next token fed to the model
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: SamplerError | None = None  # sampling this row failed; the others go on
    searched: int = 0  # characters of decoded output already searched for stop strings
    settled: bool = False  # its caller has its answer (or error)

    @property
    def ended(self) -> bool:
        return (
            self.finish_reason is not None
            or self.error is not None
            or self.request.cancelled.is_set()
        )


@dataclass
class _Batch:
    """The running rows and their KV cache, left-padded: every row's last token sits in
    the last column, and `mask_B_T` marks the columns each row really has."""

    rows: list[_Row]
    cache: DynamicCache
    mask_B_T: torch.Tensor

    def join(self, other: _Batch) -> None:
        """Append `other`'s rows, left-padding the narrower of the two caches."""
        width = max(self.mask_B_T.shape[1], other.mask_B_T.shape[1])
        self.mask_B_T = torch.cat(
            [_left_pad(self.mask_B_T, width, 1), _left_pad(other.mask_B_T, width, 1)]
        )
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            (keys, values), (their_keys, their_values) = _kv(mine), _kv(theirs)
            mine.keys = torch.cat([_left_pad(keys, width, 2), _left_pad(their_keys, width, 2)])
            mine.values = torch.cat(
                [_left_pad(values, width, 2), _left_pad(their_values, width, 2)]
            )
        self.rows += other.rows

    def keep(self, kept: list[int], trim: bool) -> None:
        """Keep rows `kept`; `trim` (plain caches only) also drops the leading columns
        none of them attends to, so a batch that never empties does not grow forever."""
        index = torch.tensor(kept, device=self.mask_B_T.device)
        self.rows = [self.rows[i] for i in kept]
        self.mask_B_T = self.mask_B_T[index]
        if not trim:
            self.cache.batch_select_indices(index)
            return
        start = int(self.mask_B_T.any(dim=0).int().argmax())  # the first column in use
        self.mask_B_T = self.mask_B_T[:, start:]
        for layer in _layers(self.cache):
            keys, values = _kv(layer)
            layer.keys, layer.values = keys[index, :, start:], values[index, :, start:]


class _Closed(Exception):
    """Raised inside the worker when close() interrupts a running batch."""


class LocalSampler:
    """Continuously batched sampling from a transformers causal LM in this process
    (Sampler protocol)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 16,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_window_s: float = 0.02,
        continuous: bool = True,
    ) -> None:
        """`tokenizer` (the model's) is needed only by requests with stop strings.

        An idle worker starts with every request that arrives within `batch_window_s` of
        the one before it. `continuous=False` is static batching: a started batch takes
        no one in until its last row ends (also what a model whose cache is not plain
        full attention, e.g. sliding windows, gets).
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
        # Joining pads caches by hand: only plain full-attention layers allow that.
        layers = DynamicCache(config=model.config).layers
        self._plain_cache = all(type(layer) is DynamicLayer for layer in layers)
        self.continuous = continuous and self._plain_cache

        self._lock = threading.Lock()
        # Notified on every change the worker or pause() waits for: arrival, pause,
        # resume, update wanted or done, run start and end, close.
        self._changed = threading.Condition(self._lock)
        # Held by the worker while rows decode (except while parked by pause "keep");
        # taken before _lock, never after it.
        self._weights_lock = threading.Lock()
        self._updates_waiting = 0  # update_weights calls waiting for the weights lock
        self._pause_mode: PauseMode | None = None  # None: not paused
        self._running = False  # the worker holds (or is taking) the weights lock
        self._parked = False  # the running rows wait between two steps (pause keep)
        self._policy_version = 0
        # How update_weights meets running requests (see there); the async schedule: keep.
        self.publish_pause: PauseMode | None = None
        self._stats = SamplerStats()
        self._closed = False
        self._stop = threading.Event()
        self._pending: deque[_Request] = deque()  # arrived, not yet decoding
        self._last_arrival = 0.0
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
        running rows to finish (no request joins them meanwhile; the waiting ones start
        after the update); "keep" parks them between two steps and lets them decode on
        under the new weights; "abort" ends them. A sampler
        someone already paused is updated as it stands. Values are copied, so the caller
        may keep training its tensors. Every key of the model must be present and no
        other: a partial update would silently mix two policies.
        """
        if version < 0:
            raise SamplerError(f"policy version must be >= 0, got {version}")
        pause = self.publish_pause if not self.is_paused else None
        if pause is not None:
            self.pause(pause)
        with self._changed:
            self._updates_waiting += 1  # no request joins: the running rows drain
        try:
            with self._weights_lock:
                self._copy_in(state_dict)
                self.set_policy_version(version)
        finally:
            with self._changed:
                self._updates_waiting -= 1
                self._changed.notify_all()
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

        abort: the running rows end at the next step with finish_reason "abort".
        wait: the running rows finish first. keep: they park between two steps and
        continue after resume(), under whatever weights are loaded then. Requests that
        have not started wait for resume() in every mode.
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
            return dataclasses.replace(self._stats, waiting=len(self._pending))

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        """Sample a completion of `prompt_ids`; `session_id` is unused (one replica).

        Cancelling the call frees its row at the next decode step.
        """
        self._check_prompt(prompt_ids)
        if params.seed is not None and params.seed not in SEED_RANGE:
            raise SamplerError(
                f"seed {params.seed} does not fit in 64 bits", fix="pick a smaller seed"
            )
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
            self._pending.append(request)
            self._last_arrival = time.monotonic()
            self._changed.notify_all()
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled.set()  # the worker drops the row at its next step
            raise

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
        with self._changed:
            self._closed = True
            thread = self._thread
            self._stop.set()
            self._changed.notify_all()  # wake an idle, paused or parked worker
        if thread is not None:
            thread.join()
        with self._lock:  # requests that never started
            pending, self._pending = list(self._pending), deque()
        for request in pending:
            _settle(request, _closed_error())

    def _worker(self) -> None:
        while True:
            with self._changed:
                while not self._stop.is_set() and not (self._pending and self._admitting()):
                    self._changed.wait()
                if self._stop.is_set():
                    return
                self._running = True
            try:
                self._await_wave()
                with self._weights_lock, torch.inference_mode():
                    self._run()
            except _Closed:
                return
            finally:
                with self._changed:
                    self._running = False
                    self._changed.notify_all()

    def _admitting(self) -> bool:
        """Whether waiting requests may start now (call under _lock)."""
        return self._pause_mode is None and self._updates_waiting == 0

    def _await_wave(self) -> None:
        """Let requests that arrive within the window of the one before join the first
        prefill: over HTTP a wave of concurrent requests lands spread over milliseconds."""
        with self._changed:
            while len(self._pending) < self.max_batch_size and not self._stop.is_set():
                left = self._last_arrival + self.batch_window_s - time.monotonic()
                if left <= 0:
                    return
                self._changed.wait(left)

    def _run(self) -> None:
        """Decode until no row is left and no request may join; holds the weights lock."""
        batch: _Batch | None = None
        newcomers: list[_Row] = []
        try:
            while True:
                if self._stop.is_set():
                    raise _Closed
                if batch is not None and self._pause_point(batch.rows):
                    batch = self._retire(batch)  # pause abort ended every row
                with self._lock:
                    version = self._policy_version
                newcomers = [self._new_row(r, version) for r in self._admit(batch)]
                if newcomers:
                    batch = self._join(batch, newcomers, version)
                    newcomers = []
                elif batch is None:
                    return
                if batch is not None:
                    batch = self._step(batch, version)
        except _Closed:
            self._end(_rows(batch) + newcomers, _closed_error())
            raise
        except Exception as exc:  # a bug, not a request: fail the rows, keep the worker
            self._end(_rows(batch) + newcomers, _failure(exc))

    def _admit(self, batch: _Batch | None) -> list[_Request]:
        """The waiting requests that start now: as many as fit, unless paused, an update
        waits, or (static batching) a batch is running."""
        running = len(_rows(batch))
        room = self.max_batch_size - running if (running == 0 or self.continuous) else 0
        taken: list[_Request] = []
        with self._lock:
            while self._pending and len(taken) < room and self._admitting():
                request = self._pending.popleft()
                if request.cancelled.is_set():
                    self._stats.cancelled += 1
                else:
                    taken.append(request)
            self._stats.requests += len(taken)
            self._stats.active += len(taken)
            self._stats.max_batch_size = max(self._stats.max_batch_size, self._stats.active)
        return taken

    def _join(self, batch: _Batch | None, rows: list[_Row], version: int) -> _Batch | None:
        """Prefill `rows`, sample their first tokens, and add those still going to
        `batch`. A failed prefill fails these rows only."""
        with self._lock:
            self._stats.batches += 1
        try:
            joined = self._prefill(rows, version)
        except Exception as exc:
            self._end(rows, _failure(exc))
            return batch
        going = self._retire(joined)
        if going is None or batch is None:
            return going or batch
        batch.join(going)
        return batch

    def _prefill(self, rows: list[_Row], version: int) -> _Batch:
        device = self.model.device
        # Left padding puts every row's last prompt token in the same column.
        width = max(len(row.request.prompt_ids) for row in rows)
        input_ids_B_T = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row.request.prompt_ids)
            input_ids_B_T[i, width - n :] = torch.tensor(row.request.prompt_ids)
            mask_B_T[i, width - n :] = 1
        input_ids_B_T, mask_B_T = input_ids_B_T.to(device), mask_B_T.to(device)
        cache = DynamicCache(config=self.model.config)  # filled in place by every forward
        out = self.model(
            input_ids=input_ids_B_T,
            attention_mask=mask_B_T,
            position_ids=(mask_B_T.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._sample_step(rows, out.logits[:, -1, :], version)
        return _Batch(rows, cache, mask_B_T)

    def _step(self, batch: _Batch, version: int) -> _Batch | None:
        """Feed every row its last token and sample the next; a failure fails them all."""
        device = self.model.device
        rows = batch.rows
        try:
            batch.mask_B_T = torch.cat(
                [batch.mask_B_T, batch.mask_B_T.new_ones((len(rows), 1))], dim=1
            )
            out = self.model(
                input_ids=torch.tensor([[row.token_ids[-1]] for row in rows], device=device),
                attention_mask=batch.mask_B_T,
                position_ids=torch.tensor([[row.position] for row in rows], device=device),
                cache=batch.cache,
                use_cache=True,
            )
        except Exception as exc:
            self._end(rows, _failure(exc))
            return None
        for row in rows:
            row.position += 1
        self._sample_step(rows, out.logits[:, -1, :], version)
        return self._retire(batch)

    def _retire(self, batch: _Batch) -> _Batch | None:
        """Settle the rows that ended and take them out of the batch."""
        ended = [row.ended for row in batch.rows]  # once: a cancel may land meanwhile
        if not any(ended):
            return batch
        self._end([row for row, gone in zip(batch.rows, ended, strict=True) if gone])
        kept = [i for i, gone in enumerate(ended) if not gone]
        if not kept:
            return None
        batch.keep(kept, trim=self._plain_cache)
        return batch

    def _end(self, rows: list[_Row], error: SamplerError | None = None) -> None:
        """Count `rows` out of the batch, then settle each: with `error`, or its result.
        A row already ended is skipped."""
        rows = [row for row in rows if not row.settled]
        for row in rows:
            row.settled = True
        with self._lock:
            self._stats.active -= len(rows)
            self._stats.tokens += sum(len(row.token_ids) for row in rows)
            self._stats.cancelled += sum(row.request.cancelled.is_set() for row in rows)
        for row in rows:
            _settle(row.request, error or self._result(row))

    def _result(self, row: _Row) -> Completion | SamplerError:
        if row.error is not None:
            return row.error
        try:
            return Completion(
                token_ids=row.token_ids,
                logprobs=row.logprobs,
                finish_reason=row.finish_reason or "length",
                policy_version=row.version,
                token_versions=row.versions,
            )
        except ValidationError as e:  # e.g. the version was set back while it ran
            return SamplerError(f"local sampler: an inconsistent completion: {e}")

    def _new_row(self, request: _Request, version: int) -> _Row:
        params = request.params
        generator = torch.Generator(device=self.model.device)
        if params.seed is None:
            generator.seed()  # fresh entropy per request
        else:
            generator.manual_seed(params.seed)
        n = len(request.prompt_ids)
        return _Row(
            request=request,
            # Generation also ends where the model's context does.
            max_tokens=min(params.max_tokens, self.context_length - n),
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            generator=generator,
            version=version,
            position=n,
        )

    def _pause_point(self, rows: list[_Row]) -> bool:
        """Between two steps: obey a pause. True when the rows must end now (abort)."""
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

    def _sample_step(self, rows: list[_Row], logits_B_V: torch.Tensor, version: int) -> None:
        """Sample one token for every row; a row whose sampling fails ends with an error."""
        # Greedy rows take the argmax; their 1.0 only avoids dividing by zero.
        temperatures_B = torch.tensor(
            [row.request.params.temperature or 1.0 for row in rows], device=logits_B_V.device
        )
        logprobs_B_V = torch.log_softmax(logits_B_V.float() / temperatures_B[:, None], dim=-1)
        for row, logprobs_V in zip(rows, logprobs_B_V, strict=True):
            try:
                token, logprob = _sample(logprobs_V, row.request.params, row.generator)
            except RuntimeError as e:  # e.g. a temperature so low the logits overflow
                row.error = SamplerError(
                    f"sampling token {len(row.token_ids) + 1} failed: {e}".splitlines()[0]
                )
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            if token in row.stop_ids or self._stopped_on_string(row):
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.max_tokens:
                row.finish_reason = "length"

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


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`x` with zeros prepended along `dim` up to `width` (masked columns)."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = list(cache.layers)
    assert all(isinstance(layer, DynamicLayer) for layer in layers)  # see `continuous`
    return layers  # type: ignore[return-value]


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None  # filled by the prefill
    return layer.keys, layer.values


def _rows(batch: _Batch | None) -> list[_Row]:
    return list(batch.rows) if batch is not None else []


def _failure(exc: Exception) -> SamplerError:
    log.error("local sampler: a forward pass failed", exc_info=exc)
    error = SamplerError(f"local sampler failed: {exc!r}")
    error.__cause__ = exc
    return error


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
