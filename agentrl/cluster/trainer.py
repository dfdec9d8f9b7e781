"""The FSDP trainer's ranks 1..N-1 as Ray actors in a placement group.

This process is rank 0: it runs the rollouts and leads (agentrl.backends.ranks). Each
follower actor does what a torchrun follower does — builds the same backend, joins the
process group at rank 0's address, and mirrors every backend call rank 0 broadcasts —
so the two launchers share one mechanism and cannot drift apart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from agentrl.cluster.local import ClusterError
from agentrl.errors import first_line
from agentrl.http import free_port

if TYPE_CHECKING:
    from agentrl.backends.fsdp import FSDPConfig
    from agentrl.cluster.config import TrainerRanks

log = logging.getLogger(__name__)


def rank_env(rank: int, world: int, address: str, port: int) -> dict[str, str]:
    """The variables torchrun would set for `rank` (one device per rank: LOCAL_RANK 0,
    since Ray gives each actor its own CUDA_VISIBLE_DEVICES)."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": "0",
        "MASTER_ADDR": address,
        "MASTER_PORT": str(port),
    }
    if address.startswith("127."):  # a cluster on one machine: gloo stays on loopback
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block; the old values back afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class FollowerRank:
    """Ray actor: one follower rank; `run` returns the number of calls it mirrored."""

    def run(self, config: FSDPConfig, model_path: str | None, env: dict[str, str]) -> int:
        from agentrl.backends.ranks import control_group, follow

        os.environ.update(env)
        backend = config.build(model_path)
        try:
            return follow(backend, control_group())
        finally:
            backend.close()


class TrainerGroup:
    """Rank 0's view of its follower actors: start them, then wait for them at the end."""

    def __init__(self, config: TrainerRanks) -> None:
        self.config = config
        self.world = config.ranks
        self.placement: Any = None
        self.runs: list[Any] = []
        self.env: dict[str, str] = {}

    def start(self, backend: FSDPConfig, model_path: str | None, timeout: float = 300.0) -> None:
        """Reserve the placement group and start the followers; `self.env` is rank 0's."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.config
        bundle = {"CPU": cfg.num_cpus, "GPU": cfg.num_gpus, **cfg.resources}
        bundle = {k: v for k, v in bundle.items() if v > 0}
        self.placement = placement_group([bundle] * (self.world - 1), strategy=cfg.strategy)
        ready, _ = ray.wait([self.placement.ready()], timeout=timeout)
        if not ready:
            self.close()
            raise ClusterError(
                f"no room for {self.world - 1} trainer rank(s) of {bundle} ({cfg.strategy}) "
                f"in {timeout:.0f} s",
                fix="check the cluster's free resources with `ray status`, or lower "
                "cluster.trainer.ranks",
            )
        address = cfg.master_address or ray.util.get_node_ip_address()
        port = free_port(address if address.startswith("127.") else "")
        self.env = rank_env(0, self.world, address, port)
        remote = ray.remote(FollowerRank)
        for rank in range(1, self.world):
            actor = remote.options(  # type: ignore[attr-defined]
                num_cpus=cfg.num_cpus,
                num_gpus=cfg.num_gpus,
                resources=cfg.resources or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement, placement_group_bundle_index=rank - 1
                ),
            ).remote()
            env = rank_env(rank, self.world, address, port)
            self.runs.append(actor.run.remote(backend, model_path, env))  # type: ignore[attr-defined]
        log.info("trainer: rank 0 here, ranks 1..%d as Ray actors", self.world - 1)

    def close(self, timeout: float = 120.0) -> None:
        """Wait for the followers (rank 0's Leader.close told them to stop); free the group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        deadline = time.monotonic() + timeout
        for ref in self.runs:
            try:
                calls = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                log.info("a follower rank mirrored %d backend calls", calls)
            except Exception as e:  # a follower that died or hung must not hang rank 0
                log.warning("a follower rank did not end cleanly: %s", first_line(e))
                ray.cancel(ref, force=True)
        self.runs = []
        if self.placement is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)
            self.placement = None
