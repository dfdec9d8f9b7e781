"""What the router knows about each server, and how it calls a server's control routes.

`Replica` is one server as both planes see it (health, quarantine, version, load);
`ReplicaHTTP` is the control plane's HTTP client: one call to one replica
(`request`), the same call to many at once (`fan`), and `GET /weight_info`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx2

from agentrl.inference.openai import OpenAISampler


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


class ControlError(Exception):
    """A control call a replica did not carry out (no answer, or an HTTP error)."""


class ReplicaHTTP:
    """Calls to the replicas' control routes, each bounded by `timeout` unless told."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._http = httpx2.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def healthy(self, replica: Replica) -> bool:
        try:
            response = await self._http.get(f"{replica.name}/health", timeout=5.0)
        except httpx2.HTTPError:
            return False
        return response.status_code == 200

    async def request(
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
                timeout=timeout or self.timeout,
            )
        except httpx2.HTTPError as e:
            raise ControlError(f"{method} {path}: {type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            status, text = response.status_code, response.text[:300]
            raise ControlError(f"{method} {path}: HTTP {status} {text}")
        try:
            body = response.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    async def fan(
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
            *(self.request(r, method, path, json=json, params=params) for r in replicas),
            return_exceptions=True,
        )
        failed: dict[str, str] = {}
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, ControlError):
                    raise result
                failed[replica.name] = str(result)
        return failed

    async def weight_info(self, replica: Replica, timeout: float) -> int:
        """GET /weight_info: the version it serves; notes whether it stamps each token."""
        try:
            info = await self.request(replica, "GET", "/weight_info", timeout=timeout)
        except ControlError:
            replica.token_versions = False
            raise
        replica.token_versions = bool(info.get("token_versions"))
        return parse_version(info.get("weight_version"))


def parse_version(reported: object) -> int:
    """A server's weights version as a number. A vLLM server that was never told one
    reports "default": the weights it started with, version 0 (as `agentrl serve`'s "0")."""
    text = str(reported)
    return 0 if text == "default" else int(text.removeprefix("v"))
