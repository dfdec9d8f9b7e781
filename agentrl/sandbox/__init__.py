"""Sandboxes: where an agent's tools run (Docker containers, or a local temp dir)."""

from __future__ import annotations

from typing import cast

from agentrl.errors import ConfigError
from agentrl.registry import resolve
from agentrl.sandbox.base import SandboxProvider

PROVIDERS: dict[str, str] = {
    "docker": "agentrl.sandbox.docker:DockerProvider",
    "local": "agentrl.sandbox.local:LocalProvider",
}


def provider(name: str, **options: object) -> SandboxProvider:
    """Build the provider registered as `name` (or a `module:Class` path) with `options`."""
    cls = resolve(PROVIDERS, name, "sandbox provider")
    if not callable(cls):
        raise ConfigError(f"sandbox provider {name!r} is not a class")
    try:
        return cast(SandboxProvider, cls(**options))
    except TypeError as exc:
        raise ConfigError(f"sandbox provider {name!r}: bad options: {exc}") from exc
