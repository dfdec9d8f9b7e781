"""Dispatchers: how episodes' INIT / RUN / EVAL stages share sandboxes and the sampler.

`batch` (bounded async batch), `pipeline` (stage workers, generation slots held only
while generating) and `sync` (lock-step turns) run the same `Episode` code; each is
built from its config (`DispatchConfig`, discriminated by `type`) with `build()`.
"""

from __future__ import annotations

from agentrl.dispatch.base import (
    BatchConfig,
    DispatchConfig,
    Dispatcher,
    PipelineConfig,
    SyncConfig,
)
from agentrl.dispatch.core import Feed

__all__ = ["BatchConfig", "DispatchConfig", "Dispatcher", "Feed", "PipelineConfig", "SyncConfig"]
