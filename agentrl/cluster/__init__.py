"""Beyond one machine: Ray places sandbox workers, sampler replicas and trainer ranks.

Imported only when a run config has a `cluster:` section (or for `agentrl cluster`);
`ray` itself is imported inside the functions that need it.
"""

from __future__ import annotations

import logging
import os
import socket

from agentrl.cluster.local import ClusterError, driver_ip
from agentrl.errors import first_line

log = logging.getLogger(__name__)


def connect(address: str, namespace: str = "agentrl") -> None:
    """Join the Ray cluster at `address` as a driver (once per process)."""
    try:
        import ray
    except ImportError as e:
        raise ClusterError(
            "a cluster: section needs Ray, which is not installed", fix="pip install 'agentrl[ray]'"
        ) from e
    if ray.is_initialized():
        return
    _reachable(address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=False,  # actors' errors come back as exceptions; logs stay on nodes
            logging_level=logging.WARNING,
            _node_ip_address=driver_ip(address),
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterError(
            f"cannot join the Ray cluster at {address}: {first_line(e, limit=200)}",
            fix="start it (agentrl cluster up, or ray start --head) and check cluster.address",
        ) from e
    log.info("joined the Ray cluster at %s", address)


def _reachable(address: str, timeout: float = 10.0) -> None:
    """Fail at once when nothing listens at the head's address (ray.init would retry for
    minutes before it gives up)."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ClusterError(
            f"cannot join the Ray cluster at {address}: nothing answers there ({e.strerror or e})",
            fix="start it (agentrl cluster up, or ray start --head) and check cluster.address",
        ) from e


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
