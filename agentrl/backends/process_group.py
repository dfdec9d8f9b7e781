"""Process groups for the native backend: join torchrun's, or make a loopback-only one.

Under torchrun (RANK / WORLD_SIZE set) the group uses nccl on CUDA, else gloo, at the
address torchrun gives. Otherwise ranks meet through a FileStore in a temp dir and their
sockets bind to the loopback interface only: a lone trainer never listens on a
non-loopback address. A group this module created is reference-counted across the
backends of one process and destroyed when the last one closes.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from agentrl import scratch
from agentrl.errors import ConfigError


def init_loopback_group(store_file: Path, rank: int, world_size: int) -> None:
    """Start a process group whose ranks meet through a FileStore and talk over loopback.

    For processes of one machine (tests, a lone trainer); torchrun jobs use its env.
    """
    loopback = next((n for _, n in socket.if_nameindex() if n.startswith("lo")), None)
    if loopback is None:
        raise ConfigError("no loopback network interface: cannot start a local process group")
    store = dist.FileStore(str(store_file), world_size)
    _env_default(GLOO_SOCKET_IFNAME=loopback, NCCL_SOCKET_IFNAME=loopback)
    if torch.cuda.is_available():  # device_id: connect now
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=world_size, device_id=device
        )
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


@dataclass
class _Owned:
    """The group this process created (not one a caller or torchrun set up)."""

    users: int = 0
    store_dir: Path | None = None


_owned = _Owned()


def join_process_group() -> None:
    """Make sure a default process group exists; count this user if we created it."""
    if _owned.users:
        _owned.users += 1
    elif dist.is_initialized():
        return  # the caller's group: the caller tears it down
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        _owned.users = 1
    else:
        store_dir = scratch.make("pg")
        init_loopback_group(store_dir / "store", rank=0, world_size=1)
        _owned.users, _owned.store_dir = 1, store_dir


def leave_process_group() -> None:
    """Undo one join; the last user of a group we created destroys it."""
    if not _owned.users:
        return
    _owned.users -= 1
    if _owned.users == 0:
        dist.destroy_process_group()
        if _owned.store_dir is not None:
            shutil.rmtree(_owned.store_dir, ignore_errors=True)
        _owned.store_dir = None


def _env_default(**values: str) -> None:
    """Set env vars the user has not set, and keep them: the process environment is read
    by other threads (an HTTP client iterating it for proxies raised a KeyError when the
    vars were removed again under it), so it changes at most once, never back."""
    for key, value in values.items():
        os.environ.setdefault(key, value)
