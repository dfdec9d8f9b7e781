"""Sandboxes: where an agent's tools run (Docker containers, a local temp dir, or a
provider of your own named `module:Class`). `config.py` chooses one; `base.py` is the seam."""

from __future__ import annotations

from typing import Any

from agentrl.sandbox.base import SandboxProvider
from agentrl.sandbox.config import parse_provider


def provider(name: str, **options: Any) -> SandboxProvider:
    """Build the provider `name` names (`docker`, `local` or `module:Class`) with `options`
    (`agentrl.sandbox.config.parse_provider`)."""
    return parse_provider(name, **options).build()
