"""A sampler over a Tinker sampling client: the Tinker backend's publications, served.

Each publication (`TinkerBackend.publish`) hands over a new sampling client, a snapshot
of the weights just saved, and the version goes up by one. A request samples on the
client current when it is sent and carries that version for every token: a Tinker
snapshot never changes under a request, so the version is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrl.errors import SamplerError
from agentrl.inference.base import Completion, SamplingParams

if TYPE_CHECKING:
    import tinker


class TinkerSampler:
    """Sampler (and the tinker backend's weight sink) over Tinker sampling clients."""

    def __init__(self) -> None:
        self._client: tinker.SamplingClient | None = None
        self._version = 0

    @property
    def policy_version(self) -> int:
        return self._version

    def swap(self, client: tinker.SamplingClient, version: int) -> None:
        """Sample on `client` (weights `version`) from the next request on."""
        if version <= self._version and self._client is not None:
            raise ValueError(f"version {version} is not newer than {self._version}")
        self._client, self._version = client, version

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Tinker keeps the weights on the service: only the tinker backend publishes here."""
        del state_dict, version
        raise SamplerError(
            "a TinkerSampler samples the Tinker service's weights; publish with the tinker "
            "backend, not by sending a state dict"
        )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        del session_id  # the service routes requests itself
        import tinker

        client, version = self._client, self._version
        if client is None:
            raise SamplerError("nothing published yet: the tinker backend publishes first")
        if params.stop_token_ids:  # a list of ids would replace Tinker's EOS stop
            raise SamplerError("the Tinker sampler stops at EOS and on strings, not on extra ids")
        sampling = tinker.SamplingParams(
            max_tokens=params.max_tokens,
            seed=params.seed,
            stop=list(params.stop) or None,  # None: EOS only
            temperature=params.temperature,
            top_p=params.top_p,
        )
        prompt = tinker.ModelInput.from_ints(prompt_ids)
        try:
            response = await client.sample(prompt=prompt, num_samples=1, sampling_params=sampling)
        except tinker.TinkerError as e:
            raise SamplerError(f"tinker sample failed: {e}") from e
        seq = response.sequences[0]
        tokens = [int(t) for t in seq.tokens]
        if seq.logprobs is None or len(seq.logprobs) != len(tokens):
            raise SamplerError("the Tinker service returned no logprob for every sampled token")
        return Completion(
            token_ids=tokens,
            logprobs=[float(x) for x in seq.logprobs],
            finish_reason="length" if seq.stop_reason == "length" else "stop",
            policy_version=version,
        )

    async def close(self) -> None:
        self._client = None
