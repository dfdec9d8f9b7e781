"""Futures: each operation is answered at once with a request id, and its result waits
here until the client's long poll (retrieve_future) takes it.

Training operations run on one learner thread (`Worker`), each model's in seq_id order
(`Sequencer`): the SDK submits the chunks of one forward_backward out of order (2, 3,
then 1) and the optim_step right behind them. A resubmitted (model, seq_id) gets the
future it got the first time, so a retried submit never runs twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from agentrl.errors import AgentRLError

log = logging.getLogger(__name__)

Result = bytes | dict[str, Any]  # bytes: a protobuf payload; a dict: JSON
Job = Callable[[], Result]
Category = Literal["user", "server"]
KEEP_DONE_S = 900.0  # a finished future's result is kept this long for (re)polls


class Future:
    """The result of one operation, or why it failed."""

    def __init__(self, kind: str) -> None:
        self.request_id = str(uuid.uuid4())
        self.kind = kind
        self.result: Result | None = None
        self.error: tuple[str, Category] | None = None
        self.finished_at: float | None = None
        self._done = threading.Event()

    def set_result(self, result: Result) -> None:
        self.result = result
        self._finish()

    def fail(self, message: str, category: Category = "user") -> None:
        self.error = (message, category)
        self._finish()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self) -> None:
        self.finished_at = time.monotonic()
        self._done.set()

    def settle(self, job: Job) -> None:
        """Run `job` and keep its result; an exception fails the future instead."""
        try:
            self.set_result(job())
        except AgentRLError as e:  # a request the client can fix: the SDK raises it
            log.warning("%s %s failed: %s", self.kind, self.request_id, e)
            self.fail(str(e), "user")
        except Exception as e:  # the operation boundary: one failed request, not a dead server
            log.exception("%s %s failed", self.kind, self.request_id)
            self.fail(f"{type(e).__name__}: {e}", "server")


class Futures:
    """request id -> Future, and (scope, seq_id) -> the future of that submit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Future] = {}
        self._by_key: dict[tuple[str, int], Future] = {}
        self._pruned_at = time.monotonic()

    def get(self, request_id: str) -> Future | None:
        with self._lock:
            return self._by_id.get(request_id)

    def create(self, kind: str, key: tuple[str, int] | None = None) -> tuple[Future, bool]:
        """A new future, or the one `key` already has; True when it is new."""
        with self._lock:
            self._prune()
            if key is not None and key in self._by_key:
                return self._by_key[key], False
            future = Future(kind)
            self._by_id[future.request_id] = future
            if key is not None:
                self._by_key[key] = future
            return future, True

    def fail_unfinished(self, message: str) -> None:
        with self._lock:
            pending = [f for f in self._by_id.values() if not f.done]
        for future in pending:
            future.fail(message, "server")

    def _prune(self) -> None:
        now = time.monotonic()
        if now - self._pruned_at < 60:
            return
        self._pruned_at = now

        def old(f: Future) -> bool:
            return f.finished_at is not None and now - f.finished_at > KEEP_DONE_S

        self._by_id = {k: f for k, f in self._by_id.items() if not old(f)}
        self._by_key = {k: f for k, f in self._by_key.items() if not old(f)}


class Worker:
    """The learner thread: runs jobs one at a time, in the order they are put."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Job] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tinker-learner", daemon=True)
        self._thread.start()

    def put(self, future: Future, job: Job) -> None:
        self._queue.put((future, job))

    def close(self, timeout: float) -> bool:
        """Finish the running job, fail the queued ones; False if it is still running."""
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, job = item
            if self._stopping.is_set():
                future.fail("the server is shutting down", "server")
            else:
                future.settle(job)


class Sequencer:
    """Hands one model's operations to the worker in seq_id order, from `first`."""

    def __init__(self, worker: Worker, first: int = 1) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._next = first
        self._waiting: dict[int, tuple[Future, Job]] = {}

    def submit(self, seq_id: int, future: Future, job: Job) -> None:
        with self._lock:
            if seq_id < self._next:
                future.fail(f"seq_id {seq_id} was already used by this model")
                return
            self._waiting[seq_id] = (future, job)
            while self._next in self._waiting:
                self._worker.put(*self._waiting.pop(self._next))
                self._next += 1

    def fail_waiting(self, message: str) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for future, _ in waiting.values():
            future.fail(message)
