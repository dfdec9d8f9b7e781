"""Multi-rank training led by rank 0: the other ranks mirror its backend calls.

Under torchrun every rank builds the same backend, since its calls are collective, but
only rank 0 runs rollouts, holds the sampler and writes the run folder. Before each
backend call rank 0 broadcasts the call (method name and arguments: the whole batch of
samples, a checkpoint path) on a gloo group; every other rank runs `follow()`, which
receives each call and makes it on its own backend. One mechanism, so a follower can
never drift from the leader's sequence of collectives.

If rank 0 fails, closing its `Leader` tells the followers to stop; if a follower fails,
the next collective fails on rank 0 and torchrun tears the job down.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from agentrl.algorithms import LossConfig
from agentrl.backends.base import Sample, WeightSink
from agentrl.backends.fsdp import FSDPBackend

log = logging.getLogger(__name__)

_STOP = "stop"


def control_group() -> dist.ProcessGroup:
    """A gloo group for the call broadcasts (objects travel on CPU whatever the backend);
    every rank must call this, after the backend has joined the default group."""
    group = dist.new_group(backend="gloo")
    assert group is not None  # every rank is a member
    return group


def _broadcast(
    call: tuple[str, tuple[Any, ...], dict[str, Any]] | None, group: dist.ProcessGroup
) -> Any:
    box = [call]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Leader:
    """Rank 0's view of the backend: each call is announced to the followers, then made."""

    def __init__(self, backend: FSDPBackend, group: dist.ProcessGroup) -> None:
        self.backend, self.group = backend, group
        self._closed = False

    def _tell(self, name: str, *args: Any, **kwargs: Any) -> None:
        _broadcast((name, args, kwargs), self.group)

    @property
    def step(self) -> int:
        return self.backend.step

    def forward_backward(self, samples: Sequence[Sample], loss: LossConfig) -> dict[str, float]:
        self._tell("forward_backward", samples, loss)
        return self.backend.forward_backward(samples, loss)

    def optim_step(self) -> dict[str, float]:
        self._tell("optim_step")
        return self.backend.optim_step()

    def train_step(self, samples: Sequence[Sample], loss: LossConfig) -> dict[str, float]:
        return self.forward_backward(samples, loss) | self.optim_step()

    def publish(self, sampler: WeightSink | None, version: int | None = None) -> int:
        self._tell("publish", None)  # only rank 0 holds a sampler (its version is broadcast)
        return self.backend.publish(sampler, version)

    def save_checkpoint(
        self, root: Path, extra: dict[str, Any], *, step: int | None = None
    ) -> Path:
        self._tell("save_checkpoint", root, extra, step=step)
        return self.backend.save_checkpoint(root, extra, step=step)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        self._tell("load_checkpoint", path)
        return self.backend.load_checkpoint(path)

    def close(self) -> None:
        """Release the followers, then the backend; safe twice."""
        if not self._closed:
            self._closed = True
            self._tell(_STOP)
        self.backend.close()


def follow(backend: FSDPBackend, group: dist.ProcessGroup) -> int:
    """Make every call rank 0 announces, in order, until it says stop; returns how many."""
    calls = 0
    while True:
        name, args, kwargs = _broadcast(None, group)
        if name == _STOP:
            return calls
        getattr(backend, name)(*args, **kwargs)
        calls += 1
        log.debug("rank %d: %s", dist.get_rank(), name)
