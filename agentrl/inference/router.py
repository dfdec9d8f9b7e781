"""Router: several vLLM-compatible servers behind one Sampler, and the control plane over them.

Data plane. Every request names its session (the trajectory id); the first request of
a session goes to the usable replica with the fewest requests in flight (then the
fewest sessions), and every later turn of that session goes to the same replica, so
its prefix cache holds the conversation. A replica that refuses connections, times out
or answers 5xx is marked down and the request is sent again to another one: nothing
sampled was seen, so the resend is safe, and the new replica is recorded on the
completion (`Completion.replica`, `Turn.replica`) and counted (`stats.failovers`). A
background health check (`GET /health`) brings a replica back, but only if it still
serves the run's weights version; a replica that restarted with other weights stays
out (quarantined) until the next publication reaches it.

Control plane. vLLM's dev-mode routes (`VLLM_SERVER_DEV_MODE=1`), fanned out to every
replica: pause (abort / wait / keep), resume, sleep / wake_up, the weights version
(`/weight_info`), and publication (`update_weights`, the WeightSink the trainer's
backend calls): stop new requests, pause, move the weights (`transfer: checkpoint`:
write a safetensors folder and `reload_weights` from it; `gloo` / `nccl`: vLLM's
weight-transfer protocol, init once, then start, update in chunks, finish), confirm
each replica's version, quarantine the ones that do not confirm, resume.

Exact versions. A request sent after a publication is stamped with the new version.
Pause mode `abort` (the default) returns in-flight requests cut short; the router
sends the rest of each one again (prompt + tokens so far) once the new weights are in,
so the first part carries the old version and the rest the new one, on any server.
Mode `keep` leaves requests parked on the server across the update, so only a server
that reports each token's version can stamp them (agentrl serve does, vLLM does not):
the router refuses `keep` otherwise. Mode `wait` drains them first.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx2
import torch

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.openai import OpenAISampler, ServerUnavailable, normalize_base_url
from agentrl.inference.weight_transfer import (
    CHUNK_BYTES,
    TrainerTransport,
    chunks,
    make_transport,
    save_weights,
    update_info,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
PauseMode = Literal["abort", "wait", "keep"]
Transfer = Literal["checkpoint", "gloo", "nccl"]


@dataclass
class Replica:
    """One server as the router sees it."""

    name: str  # http://host:port
    client: OpenAISampler = field(repr=False)
    version: int = 0
    healthy: bool = True
    quarantined: str | None = None  # why it gets no requests, until a publication reaches it
    token_versions: bool = False  # reports each token's version (agentrl serve)
    world_size: int = 1
    inflight: int = 0
    served: int = 0
    sessions: int = 0

    @property
    def usable(self) -> bool:
        return self.healthy and self.quarantined is None

    def report(self) -> dict[str, Any]:
        return {
            "replica": self.name,
            "version": self.version,
            "healthy": self.healthy,
            "quarantined": self.quarantined,
            "inflight": self.inflight,
            "served": self.served,
            "sessions": self.sessions,
        }


@dataclass
class RouterStats:
    requests: int = 0  # generate() calls
    failovers: int = 0  # requests sent again to another replica after one went down
    continuations: int = 0  # replies cut by a publication's pause and finished afterwards
    publishes: int = 0
    quarantines: int = 0  # replicas put out of service for missing a version
    cache_resets: int = 0  # replicas whose prefix cache a publication cleared
    publish_seconds: list[float] = field(default_factory=list)


class _ControlError(Exception):
    pass


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
        self.publish_dir = Path(publish_dir) if publish_dir else None
        self.control_timeout = control_timeout
        self.health_interval = health_interval
        self.master_address = master_address
        self.chunk_bytes = chunk_bytes
        self.max_sessions = max_sessions
        self.clear_kv_cache = clear_kv_cache
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
        self._version = 0
        self._epoch = 0  # bumped when a publication starts: tells our aborts from others
        self._sessions: collections.OrderedDict[str, Replica] = collections.OrderedDict()
        self._transport: TrainerTransport | None = None
        self._group: tuple[str, ...] = ()  # replicas in the transfer group
        self._published: list[Path] = []
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="agentrl-router", daemon=True
        )
        self._thread.start()
        self._open = self._call(self._make_event())  # set: requests may go out
        self._publishing = self._call(self._make_lock())
        self._health_task = self._call(self._start_health())

    # ---- the Sampler protocol ------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

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
            await asyncio.gather(*(self._check(r) for r in self.replicas))

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
        for folder in self._published:  # weights the servers no longer need
            shutil.rmtree(folder, ignore_errors=True)
        if self._own_dir and self.publish_dir is not None:
            shutil.rmtree(self.publish_dir, ignore_errors=True)

    # ---- the WeightSink protocol and the control plane (blocking) -------------------

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish `state_dict` as `version` to every replica (see the module doc)."""
        self._call(self._publish(version, state_dict))

    def pause(self, mode: PauseMode | None = None) -> None:
        """Pause every replica (default: the router's pause mode); new requests wait."""
        self._call(self._pause(mode or self.pause_mode))

    def resume(self) -> None:
        self._call(self._resume())

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep (needs --enable-sleep-mode there); new requests wait for wake_up."""
        self._call(self._sleep(level))

    def wake_up(self) -> None:
        self._call(self._wake_up())

    def versions(self) -> dict[str, int | str]:
        """What every replica says it serves (`GET /weight_info`), or why it did not say."""
        return self._call(self._versions())

    def status(self) -> list[dict[str, Any]]:
        """Per replica: version, health, quarantine, load."""
        return [r.report() for r in self.replicas]

    # ---- internals (all on the router's loop) --------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking router call from the router's own loop")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _make_event(self) -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _make_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    async def _start_health(self) -> asyncio.Task[None]:
        self._http = httpx2.AsyncClient(timeout=self.control_timeout)
        # Start from what the servers serve; one that serves other weights gets no requests.
        found = await self._versions()
        known = [v for v in found.values() if isinstance(v, int)]
        self._version = max(known, default=0)
        for replica in self.replicas:
            seen = found[replica.name]
            if isinstance(seen, int):
                replica.version = seen
                replica.client.set_policy_version(self._version)
            if isinstance(seen, str):
                self._quarantine(
                    replica,
                    f"its weights version is {seen} (a vLLM server needs "
                    "VLLM_SERVER_DEV_MODE=1 for the control routes)",
                )
            elif seen != self._version:
                self._quarantine(replica, f"serves version {seen}, the others {self._version}")
        return asyncio.create_task(self._health_loop())

    async def _shutdown(self) -> None:
        self._health_task.cancel()
        await asyncio.gather(self._health_task, return_exceptions=True)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self.replicas:
            await replica.client.close()
        await self._http.aclose()
        if self._transport is not None:
            self._transport.close()

    async def _generate(
        self, prompt: list[int], params: SamplingParams, session: str | None
    ) -> Completion:
        self.stats.requests += 1
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        first_version: int | None = None
        request = params
        while True:
            await self._open.wait()  # no request goes out while a publication runs
            replica = self._pick(session)
            epoch = self._epoch
            replica.inflight += 1
            try:
                c = await replica.client.generate(prompt + ids, request, session)
            except ServerUnavailable as e:
                if epoch != self._epoch or not self._open.is_set():
                    continue  # vLLM answers 503 while paused: send it after the publication
                self._mark_down(replica, str(e))
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
                epoch != self._epoch or not self._open.is_set()
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

    def _mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("replica %s is down: %s", replica.name, why)
        replica.healthy = False

    def _quarantine(self, replica: Replica, why: str) -> None:
        if replica.quarantined is None:
            self.stats.quarantines += 1
            log.warning("replica %s quarantined: %s", replica.name, why)
        replica.quarantined = why
        for session in [s for s, r in self._sessions.items() if r is replica]:
            self._unbind(session)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._check(r) for r in self.replicas))

    async def _check(self, replica: Replica) -> None:
        try:
            response = await self._http.get(f"{replica.name}/health", timeout=5.0)
            up = response.status_code == 200
        except httpx2.HTTPError:
            up = False
        if not up:
            self._mark_down(replica, "GET /health failed")
            return
        if replica.healthy:
            return
        # Back up: it may have restarted with other weights.
        try:
            version = await self._weight_info(replica, timeout=5.0)
        except (_ControlError, ValueError) as e:
            self._quarantine(replica, f"came back but its version is unknown ({e})")
        else:
            replica.version = version
            if version != self._version and replica.quarantined is None:
                self._quarantine(
                    replica, f"came back serving version {version}, the run is at {self._version}"
                )
        replica.healthy = True
        log.info("replica %s is up again", replica.name)

    async def _weight_info(self, replica: Replica, timeout: float) -> int:
        """GET /weight_info: the version it serves; notes whether it stamps each token."""
        try:
            info = await self._request(replica, "GET", "/weight_info", timeout=timeout)
        except _ControlError:
            replica.token_versions = False
            raise
        replica.token_versions = bool(info.get("token_versions"))
        return int(str(info.get("weight_version")).removeprefix("v"))

    async def _request(
        self,
        replica: Replica,
        method: str,
        path: str,
        *,
        json: object = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        try:
            response = await self._http.request(
                method,
                f"{replica.name}{path}",
                json=json,
                params=params,
                timeout=timeout or self.control_timeout,
            )
        except httpx2.HTTPError as e:
            raise _ControlError(f"{method} {path}: {type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            raise _ControlError(
                f"{method} {path}: HTTP {response.status_code} {response.text[:300]}"
            )
        try:
            body = response.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    async def _fan(
        self,
        replicas: list[Replica],
        method: str,
        path: str,
        *,
        json: object = None,
        params: Mapping[str, str] | None = None,
    ) -> dict[str, str]:
        """Call every replica at once; returns the failures (name -> why)."""
        results = await asyncio.gather(
            *(self._request(r, method, path, json=json, params=params) for r in replicas),
            return_exceptions=True,
        )
        failed: dict[str, str] = {}
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, _ControlError):
                    raise result
                failed[replica.name] = str(result)
        return failed

    async def _pause(self, mode: PauseMode) -> dict[str, str]:
        if mode == "keep":
            await self._versions()  # refreshes which replicas stamp each token
            blind = [r.name for r in self.replicas if r.healthy and not r.token_versions]
            if blind:
                raise ConfigError(
                    f"pause mode keep needs servers that report each token's version; "
                    f"{', '.join(blind)} do not (vLLM does not)",
                    fix="use pause mode abort (the router finishes cut replies under the new "
                    "weights) or wait",
                )
        self._epoch += 1
        self._open.clear()
        return await self._fan(
            [r for r in self.replicas if r.healthy], "POST", "/pause", params={"mode": mode}
        )

    async def _resume(self) -> None:
        failed = await self._fan([r for r in self.replicas if r.healthy], "POST", "/resume")
        for name, why in failed.items():
            self._mark_down(self._by_name(name), why)
        self._open.set()

    async def _sleep(self, level: int) -> None:
        self._epoch += 1
        self._open.clear()
        failed = await self._fan(
            [r for r in self.replicas if r.healthy], "POST", "/sleep", params={"level": str(level)}
        )
        for name, why in failed.items():
            self._mark_down(self._by_name(name), why)

    async def _wake_up(self) -> None:
        failed = await self._fan([r for r in self.replicas if r.healthy], "POST", "/wake_up")
        for name, why in failed.items():
            self._mark_down(self._by_name(name), why)
        self._open.set()

    async def _versions(self) -> dict[str, int | str]:
        """Every replica's version (or why it is unknown); refreshes its capabilities."""

        async def one(replica: Replica) -> int | str:
            try:
                return await self._weight_info(replica, timeout=10.0)
            except (_ControlError, ValueError) as e:
                return f"unknown: {e}"

        found = await asyncio.gather(*(one(r) for r in self.replicas))
        return dict(zip([r.name for r in self.replicas], found, strict=True))

    def _by_name(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    async def _publish(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        if version <= self._version:
            raise SamplerError(
                f"cannot publish version {version}: the replicas already serve {self._version}"
            )
        async with self._publishing:
            start = time.monotonic()
            # Every replica that answers takes part (one that was down is asked first): a
            # quarantined one that confirms this version is back in service.
            await asyncio.gather(*(self._check(r) for r in self.replicas if not r.healthy))
            targets = [r for r in self.replicas if r.healthy]
            failed: dict[str, str] = {}
            # Written before the pause: generation stops only while the replicas reload.
            folder = await self._write(version, state) if self.transfer == "checkpoint" else None
            try:
                failed |= await self._pause(self.pause_mode)
                live = [r for r in targets if r.name not in failed]
                if folder is not None:
                    failed |= await self._reload(live, version, folder)
                else:
                    failed |= await self._by_collective(live, version, state)
                confirmed = await self._versions()
                if self.clear_kv_cache:  # a failure here costs reuse, never correctness
                    ok = [r for r in live if r.name not in failed]
                    missed = await self._fan(ok, "POST", "/reset_prefix_cache")
                    self.stats.cache_resets += len(ok) - len(missed)
            finally:
                await self._resume()
            for replica in targets:
                seen = confirmed.get(replica.name)
                if isinstance(seen, int):
                    replica.version = seen
                if replica.name in failed:
                    self._quarantine(replica, f"missed version {version}: {failed[replica.name]}")
                elif seen != version:
                    self._quarantine(replica, f"reports version {seen} after publishing {version}")
                else:
                    replica.quarantined = None
            self._version = version
            for replica in self.replicas:
                replica.client.set_policy_version(version)
            self.stats.publishes += 1
            self.stats.publish_seconds.append(round(time.monotonic() - start, 3))
            if not any(r.usable for r in self.replicas):
                raise SamplerError(
                    f"no replica confirmed weights version {version}: "
                    + "; ".join(f"{r.name}: {r.quarantined or 'down'}" for r in self.replicas),
                    fix="look at the servers' logs; restart them and publish again",
                )

    async def _write(self, version: int, state: Mapping[str, torch.Tensor]) -> Path:
        if self.publish_dir is None:
            self.publish_dir = Path(tempfile.mkdtemp(prefix="agentrl-publish-"))
        folder = self.publish_dir / f"v{version:06d}"
        await asyncio.to_thread(save_weights, state, folder)
        self._published.append(folder)
        for old in self._published[:-2]:  # a replica reloads only the newest
            shutil.rmtree(old, ignore_errors=True)
        del self._published[:-2]
        return folder

    async def _reload(self, live: list[Replica], version: int, folder: Path) -> dict[str, str]:
        failed = await self._fan(
            live,
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}},
        )
        ok = [r for r in live if r.name not in failed]
        return failed | await self._fan(
            ok, "POST", "/update_weight_version", json={"new_version": str(version)}
        )

    async def _by_collective(
        self, live: list[Replica], version: int, state: Mapping[str, torch.Tensor]
    ) -> dict[str, str]:
        failed: dict[str, str] = {}
        members = tuple(r.name for r in live)
        if self._transport is None or self._group != members:
            failed |= await self._init_group(live)
            live = [r for r in live if r.name not in failed]
        assert self._transport is not None
        transport = self._transport
        failed |= await self._fan(live, "POST", "/start_weight_update")
        live = [r for r in live if r.name not in failed]
        try:
            for names in chunks(state, self.chunk_bytes):
                info = update_info(state, names)
                send = asyncio.to_thread(transport.send, [state[n] for n in names])
                calls = self._fan(live, "POST", "/update_weights", json={"update_info": info})
                _, chunk_failed = await asyncio.gather(send, calls)
                failed |= chunk_failed
                if chunk_failed:
                    raise _ControlError(f"update_weights failed on {sorted(chunk_failed)}")
        except Exception as e:  # a broken collective: every member must set it up again
            self._transport, self._group = None, ()
            transport.close()
            return failed | {r.name: f"weight transfer failed: {e}" for r in live}
        return failed | await self._fan(
            live, "POST", "/finish_weight_update", json={"weight_version": str(version)}
        )

    async def _init_group(self, live: list[Replica]) -> dict[str, str]:
        if self._transport is not None:
            self._transport.close()
        self._transport, self._group = None, ()
        sizes = await asyncio.gather(
            *(self._request(r, "GET", "/get_world_size", timeout=10.0) for r in live),
            return_exceptions=True,
        )
        failed = {
            r.name: str(s) for r, s in zip(live, sizes, strict=True) if isinstance(s, Exception)
        }
        members = [r for r in live if r.name not in failed]
        offsets, world = [], 1
        for replica, size in zip(live, sizes, strict=True):
            if replica in members:
                assert isinstance(size, dict)
                replica.world_size = int(size.get("world_size", 1))
                offsets.append(world)
                world += replica.world_size
        transport = make_transport(self.transfer)
        port = _free_port(self.master_address)
        calls = [
            self._request(
                r,
                "POST",
                "/init_weight_transfer_engine",
                json={
                    "init_info": {
                        "master_address": self.master_address,
                        "master_port": port,
                        "rank_offset": offset,
                        "world_size": world,
                        **transport.init_extras,
                    }
                },
            )
            for r, offset in zip(members, offsets, strict=True)
        ]
        joined = asyncio.to_thread(transport.init, self.master_address, port, world)
        results = await asyncio.gather(joined, *calls, return_exceptions=True)
        for replica, result in zip(members, results[1:], strict=True):
            if isinstance(result, Exception):
                failed[replica.name] = f"init_weight_transfer_engine: {result}"
        if isinstance(results[0], Exception) or len(failed) > len(live) - len(members):
            transport.close()
            why = f"the transfer group did not form: {results[0]!r}"
            return failed | {r.name: why for r in members if r.name not in failed}
        self._transport, self._group = transport, tuple(r.name for r in members)
        return failed


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


__all__ = ["PauseMode", "Replica", "Router", "RouterStats", "Transfer"]
