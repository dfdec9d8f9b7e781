"""Beyond one machine: Ray places sandbox workers, sampler replicas and trainer ranks.

Imported only when a run config has a `cluster:` section (or for `agentrl cluster`);
`ray` itself is imported inside the functions that need it.
"""

from __future__ import annotations

import logging
import os

from agentrl.cluster.local import ClusterError, driver_ip

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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterError(
            f"cannot join the Ray cluster at {address}: {first[:200]}",
            fix="start it (agentrl cluster up, or ray start --head) and check cluster.address",
        ) from e
    log.info("joined the Ray cluster at %s", address)


def disconnect() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
