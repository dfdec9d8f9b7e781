"""The router's data plane: which replica serves a request, failover, continuation.

Every request names its session (the trajectory id); the first request of a session
goes to the usable replica with the fewest requests in flight (then the fewest
sessions), and every later turn of that session goes to the same replica, so its
prefix cache holds the conversation. A replica that refuses connections, times out or
answers 5xx is marked down and the request is sent again to another one: nothing
sampled was seen, so the resend is safe, and the new replica is recorded on the
completion (`Completion.replica`, `Turn.replica`) and counted (`stats.failovers`). A
reply a publication's pause (mode abort) cut short is finished under the new weights:
prompt + tokens so far, sent again once the new weights are in (`stats.continuations`).

`Router` is also the blocking face of the control plane (`control.py`): the trainer's
WeightSink, pause, sleep, versions.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import threading
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, PauseMode, SamplingParams, Transfer
from agentrl.inference.openai import OpenAISampler, ServerUnavailable, normalize_base_url
from agentrl.inference.router.control import ControlPlane
from agentrl.inference.router.replica import Replica, RouterStats
from agentrl.inference.weight_transfer import CHUNK_BYTES

log = logging.getLogger(__name__)

T = TypeVar("T")


class Router:
    """A Sampler over several servers, and a WeightSink that publishes to all of them.

    Thread-safe: it runs its own event loop in a background thread, so it can be used
    from any loop (generate) and any thread (the control methods, which block).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        pause_mode: PauseMode = "abort",
        transfer: Transfer = "checkpoint",
        publish_dir: str | Path | None = None,
        request_timeout: float = 600.0,
        control_timeout: float = 300.0,
        health_interval: float = 2.0,
        master_address: str = "127.0.0.1",
        chunk_bytes: int = CHUNK_BYTES,
        max_sessions: int = 1 << 16,
        clear_kv_cache: bool = False,
        cache_salt: bool = True,
    ) -> None:
        """`clear_kv_cache`: reset every replica's prefix cache after each publication.
        `cache_salt`: salt each request's prefix cache by the weights version it was sent
        under, so no request reuses KV blocks computed by older weights."""
        if not urls:
            raise ConfigError("the router needs at least one server URL")
        if pause_mode not in ("abort", "wait", "keep"):
            raise ConfigError(f"pause mode must be abort, wait or keep, not {pause_mode!r}")
        if transfer not in ("checkpoint", "gloo", "nccl"):
            raise ConfigError(f"transfer must be checkpoint, gloo or nccl, not {transfer!r}")
        names = [normalize_base_url(u).removesuffix("/v1") for u in urls]
        if len(set(names)) != len(names):
            raise ConfigError(f"a server is listed twice: {names}")
        self.pause_mode: PauseMode = pause_mode
        self.transfer: Transfer = transfer
        self._own_dir = publish_dir is None
        self.health_interval = health_interval
        self.max_sessions = max_sessions
        self.stats = RouterStats()
        self.replicas = [
            Replica(
                name=name,
                # One quick retry; after that the router fails over instead of waiting.
                client=OpenAISampler(
                    name,
                    timeout=request_timeout,
                    max_retries=1,
                    backoff=0.1,
                    cache_salt=cache_salt,
                ),
            )
            for name in names
        ]
        self._sessions: collections.OrderedDict[str, Replica] = collections.OrderedDict()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="agentrl-router", daemon=True
        )
        self._thread.start()

        async def start() -> tuple[ControlPlane, asyncio.Task[None]]:
            control = ControlPlane(
                self.replicas,
                self.stats,
                self._forget,
                pause_mode=pause_mode,
                transfer=transfer,
                publish_dir=Path(publish_dir) if publish_dir else None,
                control_timeout=control_timeout,
                master_address=master_address,
                chunk_bytes=chunk_bytes,
                clear_kv_cache=clear_kv_cache,
            )
            await control.start()
            return control, asyncio.create_task(self._health_loop(control))

        self._control, self._health_task = self._call(start())

    # ---- the Sampler protocol ------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._control.version

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        """Sample on the session's replica (chosen on its first request)."""
        if self._closed:
            raise SamplerError("the router is closed", fix="create a new router")
        future = asyncio.run_coroutine_threadsafe(
            self._generate(list(prompt_ids), params, session_id), self._loop
        )
        return await asyncio.wrap_future(future)

    async def check(self) -> None:
        """Raise SamplerError unless some replica answers its health check now."""

        async def probe() -> None:
            await asyncio.gather(*(self._control.check(r) for r in self.replicas))

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(probe(), self._loop))
        if not any(r.usable for r in self.replicas):
            down = "; ".join(f"{r.name}: {r.quarantined or 'no answer'}" for r in self.replicas)
            raise SamplerError(
                f"no replica of the router can serve ({down})",
                fix="start the servers (agentrl serve, or vllm serve MODEL) and check the URLs",
            )

    async def close(self) -> None:
        """Stop health checks, close every connection, stop the loop; safe twice."""
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        for folder in self._control.published:  # weights the servers no longer need
            shutil.rmtree(folder, ignore_errors=True)
        if self._own_dir and self._control.publish_dir is not None:
            shutil.rmtree(self._control.publish_dir, ignore_errors=True)

    # ---- the WeightSink protocol and the control plane (blocking) -------------------

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish `state_dict` as `version` to every replica (see control.py)."""
        self._call(self._control.publish(version, state_dict))

    def pause(self, mode: PauseMode | None = None) -> None:
        """Pause every replica (default: the router's pause mode); new requests wait."""
        self._call(self._control.pause(mode or self.pause_mode))

    def resume(self) -> None:
        self._call(self._control.resume())

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep (needs --enable-sleep-mode there); new requests wait for wake_up."""
        self._call(self._control.sleep(level))

    def wake_up(self) -> None:
        self._call(self._control.wake_up())

    def versions(self) -> dict[str, int | str]:
        """What every replica says it serves (`GET /weight_info`), or why it did not say."""
        return self._call(self._control.versions())

    def status(self) -> list[dict[str, Any]]:
        """Per replica: version, health, quarantine, load."""
        return [r.report() for r in self.replicas]

    # ---- the data plane (all on the router's loop) ----------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking router call from the router's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _health_loop(self, control: ControlPlane) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(control.check(r) for r in self.replicas))

    async def _shutdown(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:  # the health loop, and any request still running
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self.replicas:
            await replica.client.close()
        await self._control.close()

    async def _generate(
        self, prompt: list[int], params: SamplingParams, session: str | None
    ) -> Completion:
        self.stats.requests += 1
        control = self._control
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        first_version: int | None = None
        request = params
        while True:
            await control.open.wait()  # no request goes out while a publication runs
            replica = self._pick(session)
            epoch = control.epoch
            replica.inflight += 1
            try:
                c = await replica.client.generate(prompt + ids, request, session)
            except ServerUnavailable as e:
                if epoch != control.epoch or not control.open.is_set():
                    continue  # vLLM answers 503 while paused: send it after the publication
                control.mark_down(replica, str(e))
                self.stats.failovers += 1
                if session is not None:
                    self._unbind(session)
                continue
            finally:
                replica.inflight -= 1
            replica.served += 1
            first_version = c.policy_version if first_version is None else first_version
            ids += c.token_ids
            logprobs += c.logprobs
            versions += c.token_versions
            cut_by_us = c.finish_reason == "abort" and (
                epoch != control.epoch or not control.open.is_set()
            )
            left = params.max_tokens - len(ids)
            if cut_by_us and left > 0:
                # Our publication aborted it: sample the rest under the new weights.
                self.stats.continuations += 1
                seed = None if params.seed is None else params.seed + len(ids)
                request = params.model_copy(update={"max_tokens": left, "seed": seed})
                continue
            finish = "length" if cut_by_us else c.finish_reason
            return Completion(
                token_ids=ids,
                logprobs=logprobs,
                finish_reason=finish,
                policy_version=first_version,
                token_versions=versions,
                replica=replica.name,
            )

    def _pick(self, session: str | None) -> Replica:
        if session is not None:
            bound = self._sessions.get(session)
            if bound is not None and bound.usable:
                self._sessions.move_to_end(session)
                return bound
            if bound is not None:
                self._unbind(session)
        usable = [r for r in self.replicas if r.usable]
        if not usable:
            raise SamplerError(
                "no replica can serve: "
                + "; ".join(
                    f"{r.name} {'quarantined: ' + r.quarantined if r.quarantined else 'down'}"
                    for r in self.replicas
                ),
                fix="restart the servers (they rejoin at the next publication), or check "
                "their logs",
            )
        best = min(usable, key=lambda r: (r.inflight, r.sessions))
        if session is not None:
            self._sessions[session] = best
            best.sessions += 1
            while len(self._sessions) > self.max_sessions:
                _, old = self._sessions.popitem(last=False)
                old.sessions -= 1
        return best

    def _unbind(self, session: str) -> None:
        replica = self._sessions.pop(session, None)
        if replica is not None:
            replica.sessions -= 1

    def _forget(self, replica: Replica) -> None:
        """Unbind every session of `replica` (it left service: quarantined)."""
        for session in [s for s, r in self._sessions.items() if r is replica]:
            self._unbind(session)
