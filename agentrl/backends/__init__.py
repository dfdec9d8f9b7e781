"""Trainer backends: samples in, gradients and optimizer steps, weights out to samplers.

`fsdp` (torch FSDP2, the native backend) is built from its config, imported lazily so
that `import agentrl.backends` loads no torch.
"""

from __future__ import annotations

from typing import Any

from agentrl.backends.base import Sample, TrainerBackend, WeightSink, samples_from
from agentrl.backends.checkpoint import latest_checkpoint
from agentrl.errors import ConfigError
from agentrl.registry import resolve

BACKENDS = {"fsdp": "agentrl.backends.fsdp:FSDPConfig"}


def make_backend(name: str = "fsdp", **options: Any) -> TrainerBackend:
    """The backend registered as `name` (or at `module:ConfigClass`), built from options.

    `model_path` (if given) is passed to `build`; every other option goes to the config.
    """
    config_cls = resolve(BACKENDS, name, "trainer backend")
    model_path = options.pop("model_path", None)
    if not isinstance(config_cls, type) or not callable(getattr(config_cls, "build", None)):
        raise ConfigError(f"trainer backend {name!r} is not a backend config class")
    backend: TrainerBackend = config_cls(**options).build(model_path)
    return backend


__all__ = [
    "BACKENDS",
    "Sample",
    "TrainerBackend",
    "WeightSink",
    "latest_checkpoint",
    "make_backend",
    "samples_from",
]
