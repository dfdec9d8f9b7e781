"""Temporary folders a process owns, and removing those whose owner is dead.

A `kill -9` (or the machine's OOM killer) runs no `finally`: what a driver made in the
temp dir stays, and some of it is large (a published copy of the weights, a local
sandbox's files). So every such folder is made here, named `agentrl-<kind>-<pid>-...`,
and each agentrl command starts by removing those whose pid is not alive on this host
(`reap`; `agentrl gc` reports it). A pid reused by another process keeps its folder
until that process is gone too: the safe side.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

_OWNED = re.compile(r"^agentrl-([a-z]+)-(\d+)-")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make(kind: str) -> Path:
    """A new folder in the temp dir that this process owns (`kind`: lowercase letters)."""
    return Path(tempfile.mkdtemp(prefix=f"agentrl-{kind}-{os.getpid()}-"))


def reap(root: Path | None = None) -> int:
    """Remove the folders `make` made for processes no longer alive; how many went."""
    removed = 0
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return 0
    for entry in entries:
        owned = _OWNED.match(entry.name)
        if owned is None or pid_alive(int(owned.group(2))):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += not os.path.lexists(entry.path)
    return removed
