"""Dispatchers: how episodes' INIT / RUN / EVAL stages share sandboxes and the sampler.

`batch` (bounded async batch), `pipeline` (stage workers, generation slots held only
while generating) and `sync` (lock-step turns) run the same `Episode` code.
"""

from __future__ import annotations

from typing import Any

from agentrl.dispatch.base import BatchConfig, Dispatcher, PipelineConfig, SyncConfig
from agentrl.dispatch.core import Feed
from agentrl.errors import ConfigError
from agentrl.registry import resolve

DISPATCHERS = {
    "batch": "agentrl.dispatch.base:BatchConfig",
    "pipeline": "agentrl.dispatch.base:PipelineConfig",
    "sync": "agentrl.dispatch.base:SyncConfig",
}


def make_dispatcher(name: str = "pipeline", **options: Any) -> Dispatcher:
    """The dispatcher registered as `name` (or at `module:ConfigClass`), built from options."""
    config = resolve(DISPATCHERS, name, "dispatcher")
    if not (
        isinstance(config, type) and issubclass(config, BatchConfig | PipelineConfig | SyncConfig)
    ):
        raise ConfigError(f"dispatcher {name!r} is not a dispatcher config class")
    return config(**options).build()


__all__ = [
    "DISPATCHERS",
    "BatchConfig",
    "Dispatcher",
    "Feed",
    "PipelineConfig",
    "SyncConfig",
    "make_dispatcher",
]
