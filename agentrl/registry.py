"""Name -> implementation lookup shared by every seam (STYLE rule 10).

A registry is a dict from short name to `module:attr`; a full `module:attr` path also
works; an unknown name lists the choices. Imports happen only on lookup.
"""

from __future__ import annotations

import importlib

from agentrl.errors import ConfigError


def resolve(registry: dict[str, str], name: str, kind: str) -> object:
    """The object registered as `name` (or at the path `name`), imported lazily."""
    path = registry.get(name, name)
    module_name, _, attr = path.partition(":")
    if not attr:
        choices = ", ".join(sorted(registry))
        raise ConfigError(f"unknown {kind} {name!r}", fix=f"use one of: {choices}, or module:Class")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{kind} {name!r}: cannot import {path}: {e}") from e
