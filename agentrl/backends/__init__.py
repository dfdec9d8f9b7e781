"""Trainer backends: samples in, gradients and optimizer steps, weights out to samplers.

Each backend is built from its config (`agentrl.backends.config`: fsdp, tinker), which
imports its implementation lazily, so that `import agentrl.backends` loads no torch.
"""

from __future__ import annotations

from agentrl.backends.base import Sample, TrainerBackend, WeightSink, samples_from
from agentrl.weights.checkpoint import latest_checkpoint

__all__ = ["Sample", "TrainerBackend", "WeightSink", "latest_checkpoint", "samples_from"]
