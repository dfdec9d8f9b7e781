"""Talking to the Docker engine: the labels agentrl puts on what it makes, retries of
transient engine errors, one-line error messages, and the low-level calls the provider,
its sandboxes and the reaper share."""

from __future__ import annotations

import os
import re
import socket
import ssl
from typing import Any

import requests
from docker.errors import APIError
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_exponential

from agentrl import errors
from agentrl.errors import SandboxError

RUN, NAME, OWNER, EXPIRES = "agentrl.run", "agentrl.name", "agentrl.owner", "agentrl.expires"
SNAPSHOT_OF = "agentrl.snapshot"
ORIGIN = "agentrl.origin"  # on a snapshot: the image its chain of snapshots started from
INIT_STATE = "agentrl.init-state"  # on a snapshot: the image of its sandbox as INIT left it
INIT_ADDED = "agentrl.init-added"  # on that image: the output paths INIT added (JSON list)
NODE = "agentrl.node"  # the Ray node whose sandbox worker started it
SNAPSHOT_REPO = "agentrl-snapshot"
DIR_MODE, SYMLINK_MODE = 1 << 31, 1 << 27  # Go's os.ModeDir and os.ModeSymlink (get_archive)


def transient(exc: BaseException) -> bool:
    """An engine error worth retrying: a 5xx, a dropped connection, a read timeout."""
    if isinstance(exc, APIError):
        return bool(exc.is_server_error())
    return isinstance(exc, requests.ConnectionError | requests.ReadTimeout)


retry_transient = retry(
    retry=retry_if_exception(transient),
    stop=stop_after_attempt(3),
    wait=wait_exponential(multiplier=0.5, max=4),
    reraise=True,
)


def owner() -> str:
    """This process as the `agentrl.owner` label names it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def slug(text: str) -> str:
    """A lowercase form valid in image repository and container names."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "run"


def first_line(exc: BaseException) -> str:
    """One readable line: an engine that cannot be reached is named, not urllib3's tuple."""
    if isinstance(exc, requests.ConnectionError | requests.Timeout):
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        how = "did not answer in time" if isinstance(exc, requests.Timeout) else "is unreachable"
        return f"the Docker engine at {host} {how} (is it running, or restarting?)"
    explanation = getattr(exc, "explanation", None)  # docker's APIError: the engine's words
    return errors.first_line(str(explanation) if explanation else exc, limit=300)


def gone(container_id: str, why: str) -> SandboxError:
    return SandboxError(
        f"sandbox {container_id[:12]} is gone: {why}",
        fix="start a new sandbox (it was removed from outside, or its TTL passed)",
    )


def engine_error(container_id: str, exc: BaseException) -> SandboxError:
    first = first_line(exc)
    if isinstance(exc, APIError) and exc.status_code == 409 and "not running" in first:
        return gone(container_id, "its container is not running")
    return SandboxError(f"sandbox {container_id[:12]}: docker: {first}")


def top(api: Any, container_id: str) -> list[tuple[int, int, str]]:
    """(host pid, host parent pid, command line) of each process in the container."""
    listing = api.top(container_id, ps_args="-eo pid,ppid,args")
    return [(int(row[0]), int(row[1]), row[2]) for row in listing.get("Processes") or []]


def get_archive(api: Any, container_id: str, path: str) -> tuple[bytes, dict[str, Any]]:
    stream, stat = api.get_archive(container_id, path)
    return b"".join(stream), stat


def raw_socket(stream: Any) -> socket.socket:
    """The socket under docker-py's SocketIO (a local engine: unix socket or plain TCP)."""
    raw = getattr(stream, "_sock", stream)
    if not isinstance(raw, socket.socket) or isinstance(raw, ssl.SSLSocket):
        stream.close()
        raise SandboxError(
            f"exec streams over {type(raw).__name__} are not supported",
            fix="use a local engine (unix socket or plain TCP DOCKER_HOST)",
        )
    return raw
