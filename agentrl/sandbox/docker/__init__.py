"""The `docker` provider: each sandbox is one container on the local Docker engine.

A container starts with no network, CPU/memory/pids limits, Docker's default
capabilities less NET_RAW, and `no-new-privileges`. It is labelled with its run,
its owner (`host:pid`) and an expiry, and its main process is `sleep <ttl>` under
docker-init (which also reaps zombies), so it stops by itself when the TTL passes.

The flow, one module each: `provider` starts containers; `sandbox` drives one (exec,
files, snapshots, teardown), `shell` its interactive shell and `host` what the host
does to it from outside (usage, stopping processes, sealing); `reap` removes containers
and snapshots (a closed sandbox's, a dead run's: `agentrl gc`) and holds the atexit
backstop; `engine` holds the labels and engine-call helpers they share. The names below
are what the rest of agentrl uses.
"""

from agentrl.sandbox.docker.engine import NODE, RUN, SNAPSHOT_OF
from agentrl.sandbox.docker.provider import DockerProvider
from agentrl.sandbox.docker.reap import gc, reap, remove_run
from agentrl.sandbox.docker.sandbox import DockerSandbox

__all__ = [
    "NODE",
    "RUN",
    "SNAPSHOT_OF",
    "DockerProvider",
    "DockerSandbox",
    "gc",
    "reap",
    "remove_run",
]
