"""Where agentrl keeps what it makes once and reuses: converted models, built images'
artefacts, exported checkpoints, snapshot records (`$AGENTRL_CACHE`, default
~/.cache/agentrl)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where agentrl keeps converted models and built artefacts."""
    return Path(os.environ.get("AGENTRL_CACHE") or Path.home() / ".cache" / "agentrl")
