"""Sampler replicas as Ray actors: each serves an in-process sampler over HTTP.

A replica is `agentrl serve` inside an actor: it loads the model on its node and serves
the vLLM-compatible API at the node's address. The driver registers the replicas' URLs
(beside any external vLLM servers in `servers.urls`) with the router, so publication,
version confirmation and quarantine are the router's, whatever runs the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from agentrl.cluster.local import ClusterError
from agentrl.errors import first_line

if TYPE_CHECKING:
    from agentrl.cluster.config import SamplerReplicas
    from agentrl.inference.config import LocalSamplerConfig

log = logging.getLogger(__name__)


class SamplerReplica:
    """Ray actor: one in-process sampler served at this node's address."""

    def __init__(self, local: LocalSamplerConfig) -> None:
        import ray

        from agentrl.inference.embedded import model_tokenizer
        from agentrl.inference.serve import serve

        self.sampler = local.build()
        host = ray.util.get_node_ip_address()
        self.server, self._url = serve(self.sampler, model_tokenizer(local.model), host=host)

    def url(self) -> str:
        return self._url.removesuffix("/v1")

    def close(self) -> None:
        self.server.close()


class SamplerFleet:
    """The replicas of one run: started together, their URLs handed to the router."""

    def __init__(self, config: SamplerReplicas, local: LocalSamplerConfig) -> None:
        """`local`: the sampler each replica builds on its node (config crosses to Ray)."""
        self.config, self.local = config, local
        self.actors: list[Any] = []

    async def start(self, timeout: float = 600.0) -> list[str]:
        """Start every replica; their base URLs once all of them serve."""
        import ray

        cfg = self.config
        remote = ray.remote(SamplerReplica).options(  # type: ignore[attr-defined]
            num_gpus=cfg.num_gpus, num_cpus=cfg.num_cpus, resources=cfg.resources or None
        )
        self.actors = [remote.remote(self.local) for _ in range(cfg.replicas)]
        try:
            urls: list[str] = await asyncio.wait_for(
                asyncio.gather(*(a.url.remote() for a in self.actors)), timeout
            )
        except TimeoutError as e:
            await self.close()
            raise ClusterError(
                f"{cfg.replicas} sampler replica(s) did not start in {timeout:.0f} s",
                fix="check that the cluster has the resources they ask for "
                f"(num_gpus={cfg.num_gpus}, num_cpus={cfg.num_cpus}, {cfg.resources}): "
                "ray status",
            ) from e
        except Exception as e:
            await self.close()
            raise ClusterError(f"a sampler replica failed to start: {first_line(e)}") from e
        log.info("sampler replicas: %s", ", ".join(urls))
        return urls

    async def close(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
