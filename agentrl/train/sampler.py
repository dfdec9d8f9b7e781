"""The sampler a run trains through, and the meter that counts its idle time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agentrl.backends.base import WeightSink
from agentrl.inference.base import Sampler

if TYPE_CHECKING:
    from agentrl.backends.base import TrainerBackend
    from agentrl.inference.base import Completion, SamplingParams
    from agentrl.train_config import TrainConfig


class TrainSampler(Sampler, WeightSink, Protocol):
    """What the trainer samples with and publishes to."""


def train_sampler(
    cfg: TrainConfig, out: Path, backend: TrainerBackend, replicas: Sequence[str] = ()
) -> TrainSampler:
    """The configured sampler; `replicas`: URLs of sampler actors to route to as well."""
    from agentrl.backends.tinker import TinkerBackend

    if isinstance(backend, TinkerBackend):  # samples what the service publishes
        return backend.sampler()
    return cfg.sampler_config(replicas).build(publish_dir=out / "published")


class MeteredSampler:
    """A sampler that counts the seconds no request was in it (idle), for the metrics."""

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.in_flight = 0
        self._idle_s = 0.0
        self._idle_since: float | None = time.monotonic()

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def idle_s(self) -> float:
        """Idle seconds so far (the current idle stretch included)."""
        current = 0.0 if self._idle_since is None else time.monotonic() - self._idle_since
        return self._idle_s + current

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        if self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None
        self.in_flight += 1
        try:
            return await self.inner.generate(prompt_ids, params, session_id=session_id)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle_since = time.monotonic()

    async def close(self) -> None:
        await self.inner.close()
