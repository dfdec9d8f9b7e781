"""Sandboxes: where an agent's tools run (Docker containers, or a local temp dir)."""

from __future__ import annotations

import importlib
from typing import cast

from agentrl.errors import ConfigError
from agentrl.sandbox.base import SandboxProvider

PROVIDERS: dict[str, str] = {
    "docker": "agentrl.sandbox.docker:DockerProvider",
    "local": "agentrl.sandbox.local:LocalProvider",
}


def provider(name: str, **options: object) -> SandboxProvider:
    """Build the provider registered as `name` (or a `module:Class` path) with `options`."""
    path = PROVIDERS.get(name, name)
    module_name, _, attr = path.partition(":")
    if not attr:
        choices = ", ".join(sorted(PROVIDERS))
        raise ConfigError(
            f"unknown sandbox provider {name!r}", fix=f"use one of: {choices}, or module:Class"
        )
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"sandbox provider {name!r}: cannot import {path}: {exc}") from exc
    try:
        return cast(SandboxProvider, cls(**options))
    except TypeError as exc:
        raise ConfigError(f"sandbox provider {name!r}: bad options: {exc}") from exc
