"""The router's control plane: the replicas' weights version, and everything that
changes which replicas serve besides the requests themselves.

vLLM's dev-mode routes (`VLLM_SERVER_DEV_MODE=1`), fanned out to every replica: pause
(abort / wait / keep), resume, sleep / wake_up, the weights version (`/weight_info`),
and publication: stop new requests, pause, move the weights (`transfer: checkpoint`:
write a safetensors folder and `reload_weights` from it; `gloo` / `nccl`: vLLM's
weight-transfer protocol, init once, then start, update in chunks, finish), confirm
each replica's version, quarantine the ones that do not confirm, resume. The health
check brings a replica that was down back, quarantined if it now serves other weights.

Everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from agentrl import scratch
from agentrl.errors import ConfigError, SamplerError
from agentrl.http import free_port
from agentrl.inference.base import PauseMode, Transfer
from agentrl.inference.router.replica import (
    ControlError,
    Replica,
    ReplicaHTTP,
    RouterStats,
)
from agentrl.inference.weight_transfer import (
    TrainerTransport,
    chunks,
    make_transport,
    save_weights,
    update_info,
)

log = logging.getLogger(__name__)


class ControlPlane:
    """The fleet's version, its gate for new requests, and the calls that change both.

    `open` is set while requests may go out; `epoch` grows when a pause starts, so the
    data plane tells an abort of ours from a server's own. `forget` drops the sessions
    bound to a replica that leaves service.
    """

    def __init__(
        self,
        replicas: list[Replica],
        stats: RouterStats,
        forget: Callable[[Replica], None],
        *,
        pause_mode: PauseMode,
        transfer: Transfer,
        publish_dir: Path | None,
        control_timeout: float,
        master_address: str,
        chunk_bytes: int,
        clear_kv_cache: bool,
    ) -> None:
        self.replicas = replicas
        self.stats = stats
        self.pause_mode: PauseMode = pause_mode
        self.transfer: Transfer = transfer
        self.publish_dir = publish_dir
        self.master_address = master_address
        self.chunk_bytes = chunk_bytes
        self.clear_kv_cache = clear_kv_cache
        self.version = 0
        self.epoch = 0
        self.open = asyncio.Event()  # set: requests may go out
        self.open.set()
        self.http = ReplicaHTTP(control_timeout)
        self.published: list[Path] = []
        self._forget = forget
        self._publishing = asyncio.Lock()
        self._transport: TrainerTransport | None = None
        self._group: tuple[str, ...] = ()  # replicas in the transfer group

    async def start(self) -> None:
        """Start from what the servers serve; one that serves other weights gets no requests."""
        found = await self.versions()
        known = [v for v in found.values() if isinstance(v, int)]
        self.version = max(known, default=0)
        for replica in self.replicas:
            seen = found[replica.name]
            if isinstance(seen, int):
                replica.version = seen
                replica.client.set_policy_version(self.version)
            if isinstance(seen, str):
                hint = " (a vLLM server needs VLLM_SERVER_DEV_MODE=1 for them)" * ("404" in seen)
                self.quarantine(replica, f"its weights version is {seen}{hint}")
            elif seen != self.version:
                self.quarantine(replica, f"serves version {seen}, the others {self.version}")

    async def close(self) -> None:
        await self.http.aclose()
        if self._transport is not None:
            self._transport.close()

    # ---- who serves -------------------------------------------------------------------

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("replica %s is down: %s", replica.name, why)
        replica.healthy = False

    def quarantine(self, replica: Replica, why: str) -> None:
        if replica.quarantined is None:
            self.stats.quarantines += 1
            log.warning("replica %s quarantined: %s", replica.name, why)
        replica.quarantined = why
        self._forget(replica)

    async def check(self, replica: Replica) -> None:
        """The health check: down if /health fails; back up only with the run's version."""
        if not await self.http.healthy(replica):
            self.mark_down(replica, "GET /health failed")
            return
        if replica.healthy:
            return
        # Back up: it may have restarted with other weights.
        try:
            version = await self.http.weight_info(replica, timeout=5.0)
        except (ControlError, ValueError) as e:
            self.quarantine(replica, f"came back but its version is unknown ({e})")
        else:
            replica.version = version
            if version != self.version and replica.quarantined is None:
                self.quarantine(
                    replica, f"came back serving version {version}, the run is at {self.version}"
                )
        replica.healthy = True
        log.info("replica %s is up again", replica.name)

    async def versions(self) -> dict[str, int | str]:
        """Every replica's version (or why it is unknown); refreshes its capabilities."""

        timeout = min(10.0, self.http.timeout)

        async def one(replica: Replica) -> int | str:
            try:
                return await self.http.weight_info(replica, timeout=timeout)
            except (ControlError, ValueError) as e:
                return f"unknown: {e}"

        found = await asyncio.gather(*(one(r) for r in self.replicas))
        return dict(zip([r.name for r in self.replicas], found, strict=True))

    # ---- pause, sleep -----------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> dict[str, str]:
        if mode == "keep":
            await self.versions()  # refreshes which replicas stamp each token
            blind = [r.name for r in self.replicas if r.healthy and not r.token_versions]
            if blind:
                raise ConfigError(
                    f"pause mode keep needs servers that report each token's version; "
                    f"{', '.join(blind)} do not (vLLM does not)",
                    fix="use pause mode abort (the router finishes cut replies under the new "
                    "weights) or wait",
                )
        self.epoch += 1
        self.open.clear()
        return await self.http.fan(self._healthy(), "POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        self._mark_failed(await self.http.fan(self._healthy(), "POST", "/resume"))
        self.open.set()

    async def sleep(self, level: int) -> None:
        self.epoch += 1
        self.open.clear()
        params = {"level": str(level)}
        self._mark_failed(await self.http.fan(self._healthy(), "POST", "/sleep", params=params))

    async def wake_up(self) -> None:
        self._mark_failed(await self.http.fan(self._healthy(), "POST", "/wake_up"))
        self.open.set()

    def _healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def _mark_failed(self, failed: dict[str, str]) -> None:
        for name, why in failed.items():
            self.mark_down(next(r for r in self.replicas if r.name == name), why)

    # ---- publication ------------------------------------------------------------------

    async def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        if version <= self.version:
            raise SamplerError(
                f"cannot publish version {version}: the replicas already serve {self.version}"
            )
        async with self._publishing:
            start = time.monotonic()
            # Every replica that answers takes part (one that was down is asked first): a
            # quarantined one that confirms this version is back in service.
            await asyncio.gather(*(self.check(r) for r in self.replicas if not r.healthy))
            targets = self._healthy()
            failed: dict[str, str] = {}
            # Written before the pause: generation stops only while the replicas reload.
            folder = await self._write(version, state) if self.transfer == "checkpoint" else None
            try:
                failed |= await self.pause(self.pause_mode)
                live = [r for r in targets if r.name not in failed]
                if folder is not None:
                    failed |= await self._reload(live, version, folder)
                else:
                    failed |= await self._by_collective(live, version, state)
                confirmed = await self.versions()
                if self.clear_kv_cache:  # a failure here costs reuse, never correctness
                    ok = [r for r in live if r.name not in failed]
                    missed = await self.http.fan(ok, "POST", "/reset_prefix_cache")
                    self.stats.cache_resets += len(ok) - len(missed)
            finally:
                await self.resume()
            for replica in targets:
                seen = confirmed.get(replica.name)
                if isinstance(seen, int):
                    replica.version = seen
                if replica.name in failed:
                    self.quarantine(replica, f"missed version {version}: {failed[replica.name]}")
                elif seen != version:
                    self.quarantine(replica, f"reports version {seen} after publishing {version}")
                else:
                    replica.quarantined = None
            self.version = version
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
            self.publish_dir = scratch.make("publish")
        folder = self.publish_dir / f"v{version:06d}"
        await asyncio.to_thread(save_weights, state, folder)
        self.published.append(folder)
        for old in self.published[:-2]:  # a replica reloads only the newest
            shutil.rmtree(old, ignore_errors=True)
        del self.published[:-2]
        return folder

    async def _reload(self, live: list[Replica], version: int, folder: Path) -> dict[str, str]:
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}
        failed = await self.http.fan(live, "POST", "/collective_rpc", json=rpc)
        ok = [r for r in live if r.name not in failed]
        return failed | await self.http.fan(
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
        failed |= await self.http.fan(live, "POST", "/start_weight_update")
        live = [r for r in live if r.name not in failed]
        try:
            for names in chunks(state, self.chunk_bytes):
                info = update_info(state, names)
                send = asyncio.to_thread(transport.send, [state[n] for n in names])
                calls = self.http.fan(live, "POST", "/update_weights", json={"update_info": info})
                _, chunk_failed = await asyncio.gather(send, calls)
                failed |= chunk_failed
                if chunk_failed:
                    raise ControlError(f"update_weights failed on {sorted(chunk_failed)}")
        except Exception as e:  # a broken collective: every member must set it up again
            self._transport, self._group = None, ()
            transport.close()
            return failed | {r.name: f"weight transfer failed: {e}" for r in live}
        return failed | await self.http.fan(
            live, "POST", "/finish_weight_update", json={"weight_version": str(version)}
        )

    async def _init_group(self, live: list[Replica]) -> dict[str, str]:
        if self._transport is not None:
            self._transport.close()
        self._transport, self._group = None, ()
        sizes = await asyncio.gather(
            *(self.http.request(r, "GET", "/get_world_size", timeout=10.0) for r in live),
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
        port = free_port(self.master_address)
        calls = [
            self.http.request(
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
