"""The continuous-batching engine behind LocalSampler: one worker thread, many requests.

One worker thread decodes every running request together, one token per row and step
(continuous batching): between two steps, requests that arrived are prefilled (among
themselves) and join the running batch, and a row that finished, or whose caller
cancelled, leaves it at once with its completion. So a short request waits for at most
one step of a long one, not for the whole of it. When the worker is idle, the first
request waits up to `batch_window_s` for others, so a wave of concurrent requests shares
one prefill. Callers stay on their own asyncio loops; results come back through
`loop.call_soon_threadsafe`.

Weights: the worker holds the weights lock while any row decodes, and while an update
waits for it (`updating()`) no request joins, so the running rows drain first. `pause`
is vLLM's: `abort` ends the running rows at the next step (finish_reason abort, the
tokens so far returned), `wait` lets them finish, `keep` parks them between two steps
and lets go of the weights, so an update can land mid-completion; they then decode on
under the new weights. Requests that arrive while paused wait for `resume()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agentrl.errors import SamplerError
from agentrl.inference.base import Completion, PauseMode
from agentrl.inference.decode import Batch, Decoder, Request, Row

log = logging.getLogger(__name__)


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


class _Closed(Exception):
    """Raised inside the worker when close() interrupts a running batch."""


class BatchEngine:
    """The worker thread, the waiting requests, pauses and the weights lock of one
    in-process model."""

    def __init__(
        self, decoder: Decoder, *, max_batch_size: int, batch_window_s: float, continuous: bool
    ) -> None:
        """`continuous=False` is static batching: a started batch takes no one in until
        its last row ends (also what a model whose cache is not plain full attention,
        e.g. sliding windows, gets)."""
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        # Joining pads caches by hand: only plain full-attention layers allow that.
        layers = DynamicCache(config=decoder.model.config).layers
        self._plain_cache = all(type(layer) is DynamicLayer for layer in layers)
        self.continuous = continuous and self._plain_cache

        self._lock = threading.Lock()
        # Notified on every change the worker or pause() waits for: arrival, pause,
        # resume, update wanted or done, run start and end, close.
        self._changed = threading.Condition(self._lock)
        # Held by the worker while rows decode (except while parked by pause "keep");
        # taken before _lock, never after it.
        self._weights_lock = threading.Lock()
        self._updates_waiting = 0  # updates waiting for the weights lock
        self._pause_mode: PauseMode | None = None  # None: not paused
        self._running = False  # the worker holds (or is taking) the weights lock
        self._parked = False  # the running rows wait between two steps (pause keep)
        self._policy_version = 0
        self._stats = SamplerStats()
        self._closed = False
        self._stop = threading.Event()
        self._pending: deque[Request] = deque()  # arrived, not yet decoding
        self._last_arrival = 0.0
        self._thread: threading.Thread | None = None

    @property
    def policy_version(self) -> int:
        with self._lock:
            return self._policy_version

    def set_policy_version(self, version: int) -> None:
        """Stamp `version` on every request whose generation starts from now on."""
        with self._lock:
            self._policy_version = version

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

    def submit(self, request: Request) -> None:
        """Queue `request`; the worker settles its future (started on first use)."""
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

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold the weights while the caller swaps them: the running rows drain first (no
        request joins them meanwhile) unless they are parked by a pause."""
        with self._changed:
            self._updates_waiting += 1
        try:
            with self._weights_lock:
                yield
        finally:
            with self._changed:
                self._updates_waiting -= 1
                self._changed.notify_all()

    def shutdown(self) -> None:
        """Stop the worker and fail every unfinished request; safe to call twice."""
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
        batch: Batch | None = None
        newcomers: list[Row] = []
        try:
            while True:
                if self._stop.is_set():
                    raise _Closed
                if batch is not None and self._pause_point(batch.rows):
                    batch = self._retire(batch)  # pause abort ended every row
                with self._lock:
                    version = self._policy_version
                newcomers = [self.decoder.new_row(r, version) for r in self._admit(batch)]
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

    def _admit(self, batch: Batch | None) -> list[Request]:
        """The waiting requests that start now: as many as fit, unless paused, an update
        waits, or (static batching) a batch is running."""
        running = len(_rows(batch))
        room = self.max_batch_size - running if (running == 0 or self.continuous) else 0
        taken: list[Request] = []
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

    def _join(self, batch: Batch | None, rows: list[Row], version: int) -> Batch | None:
        """Prefill `rows`, sample their first tokens, and add those still going to
        `batch`. A failed prefill fails these rows only."""
        with self._lock:
            self._stats.batches += 1
        try:
            joined = self.decoder.prefill(rows, version)
        except Exception as exc:
            self._end(rows, _failure(exc))
            return batch
        going = self._retire(joined)
        if going is None or batch is None:
            return going or batch
        batch.join(going)
        return batch

    def _step(self, batch: Batch, version: int) -> Batch | None:
        """Feed every row its last token and sample the next; a failure fails them all."""
        try:
            logits_B_V = self.decoder.forward(batch)
        except Exception as exc:
            self._end(batch.rows, _failure(exc))
            return None
        self.decoder.sample(batch.rows, logits_B_V, version)
        return self._retire(batch)

    def _retire(self, batch: Batch) -> Batch | None:
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

    def _end(self, rows: list[Row], error: SamplerError | None = None) -> None:
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
            _settle(row.request, error or self.decoder.result(row))

    def _pause_point(self, rows: list[Row]) -> bool:
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


def _rows(batch: Batch | None) -> list[Row]:
    return list(batch.rows) if batch is not None else []


def _failure(exc: Exception) -> SamplerError:
    log.error("local sampler: a forward pass failed", exc_info=exc)
    error = SamplerError(f"local sampler failed: {exc!r}")
    error.__cause__ = exc
    return error


def _closed_error() -> SamplerError:
    return SamplerError(
        "the local sampler was closed before this request finished",
        fix="close the sampler only after its requests are done",
    )


def _settle(request: Request, result: Completion | SamplerError) -> None:
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
