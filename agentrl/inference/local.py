"""LocalSampler: the embedded, in-process sampler (a transformers causal LM on local torch).

The Sampler API over the continuous-batching engine (engine.py) and its decoding step
(decode.py): requests are checked here, then queued to the engine's worker thread.
`update_weights` swaps in a trainer's new weights between two steps; how running
requests meet it is `publish_pause` (see there). Every sampled token is stamped with
the version of the weights that produced it (`Completion.token_versions`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.decode import Decoder, Request
from agentrl.inference.embedded import model_tokenizer
from agentrl.inference.engine import BatchEngine, PauseMode, SamplerStats

SEED_RANGE = range(-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts


class LocalSampler:
    """Continuously batched sampling from a transformers causal LM in this process
    (Sampler protocol)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 16,
        tokenizer: PreTrainedTokenizerBase | None = None,
        batch_window_s: float = 0.02,
        continuous: bool = True,
    ) -> None:
        """`tokenizer` (the model's) is needed only by requests with stop strings.

        An idle worker starts with every request that arrives within `batch_window_s` of
        the one before it. `continuous=False` is static batching: a started batch takes
        no one in until its last row ends (also what a model whose cache is not plain
        full attention, e.g. sliding windows, gets).
        """
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_window_s < 0:
            raise ConfigError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        gen_config = model.generation_config
        eos = eos_token_ids if eos_token_ids is not None else _ids(gen_config.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        pad = pad_token_id if pad_token_id is not None else gen_config.pad_token_id
        # Any id works for padding (it is masked out); fall back to an EOS id or 0.
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)
        self.context_length = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        self.tokenizer = tokenizer
        decoder = Decoder(
            model, self.eos_token_ids, self.pad_token_id, self.context_length, tokenizer
        )
        self._engine = BatchEngine(
            decoder,
            max_batch_size=max_batch_size,
            batch_window_s=batch_window_s,
            continuous=continuous,
        )
        self.continuous = self._engine.continuous
        # How update_weights meets running requests (see there); the async schedule: keep.
        self.publish_pause: PauseMode | None = None

    @classmethod
    def for_model(cls, model: str) -> LocalSampler:
        """A sampler over `model`: 'embedded' (SmolLM2-135M) or a model folder."""
        if model == "embedded":
            return cls.embedded()
        from transformers import AutoModelForCausalLM

        return cls(
            AutoModelForCausalLM.from_pretrained(model, dtype="float32").eval(),
            tokenizer=model_tokenizer(model),
        )

    @classmethod
    def embedded(cls, *, max_batch_size: int = 16) -> LocalSampler:
        """A sampler over the embedded SmolLM2 model (converted once, then cached)."""
        from agentrl.inference import embedded

        tokenizer = embedded.load_tokenizer()
        eos = tokenizer.eos_token_id
        return cls(
            embedded.load_model(),
            eos_token_ids=None if eos is None else [int(eos)],
            pad_token_id=tokenizer.pad_token_id,
            max_batch_size=max_batch_size,
            tokenizer=tokenizer,
        )

    @property
    def policy_version(self) -> int:
        return self._engine.policy_version

    def set_policy_version(self, version: int) -> None:
        """Stamp `version` on every request whose generation starts from now on."""
        self._engine.set_policy_version(version)

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the model, then stamp `version`.

        How running requests meet the update is `publish_pause`: None waits for the
        running rows to finish (no request joins them meanwhile; the waiting ones start
        after the update); "keep" parks them between two steps and lets them decode on
        under the new weights; "abort" ends them. A sampler
        someone already paused is updated as it stands. Values are copied, so the caller
        may keep training its tensors. Every key of the model must be present and no
        other: a partial update would silently mix two policies.
        """
        if version < 0:
            raise SamplerError(f"policy version must be >= 0, got {version}")
        pause = self.publish_pause if not self.is_paused else None
        if pause is not None:
            self.pause(pause)
        try:
            with self._engine.updating():  # no request joins: the running rows drain
                self._copy_in(state_dict)
                self.set_policy_version(version)
        finally:
            if pause is not None:
                self.resume()

    def _copy_in(self, state_dict: dict[str, torch.Tensor]) -> None:
        # Checked before copying: load_state_dict would copy the good keys, then raise.
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        missing, unexpected = shapes.keys() - state_dict, state_dict.keys() - shapes
        reshaped = [
            k for k in shapes.keys() & state_dict if tuple(state_dict[k].shape) != shapes[k]
        ]
        if missing or unexpected or reshaped:
            raise SamplerError(
                "update_weights: the state dict does not fit the sampler's model (missing "
                f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}, other shape "
                f"{sorted(reshaped)[:3]})",
                fix="publish weights of the same architecture the sampler was built with",
            )
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)

    def load_weights(self, path: str | Path, version: int) -> None:
        """`update_weights` from a folder of safetensors files with the model's names.

        A tied weight (one tensor under two names) may be saved under either name.
        """
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise SamplerError(
                f"{path} holds no .safetensors file",
                fix="publish the weights there first (a checkpoint folder of the same model)",
            )
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file))
        by_storage: dict[int, list[str]] = {}
        for name, tensor in self.model.state_dict().items():
            by_storage.setdefault(tensor.data_ptr(), []).append(name)
        for names in by_storage.values():
            saved = [n for n in names if n in state]
            for name in names:
                if name not in state and saved:
                    state[name] = state[saved[0]]
        self.update_weights(state, version)

    def pause(self, mode: PauseMode = "abort") -> None:
        """Stop generating until `resume()`; returns once no forward pass is running.

        abort: the running rows end at the next step with finish_reason "abort".
        wait: the running rows finish first. keep: they park between two steps and
        continue after resume(), under whatever weights are loaded then. Requests that
        have not started wait for resume() in every mode.
        """
        self._engine.pause(mode)

    def resume(self) -> None:
        """Undo `pause`: parked and waiting requests go on."""
        self._engine.resume()

    @property
    def is_paused(self) -> bool:
        return self._engine.is_paused

    @property
    def stats(self) -> SamplerStats:
        """A snapshot of the counters."""
        return self._engine.stats

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        """Sample a completion of `prompt_ids`; `session_id` is unused (one replica).

        Cancelling the call frees its row at the next decode step.
        """
        self._check_prompt(prompt_ids)
        if params.seed is not None and params.seed not in SEED_RANGE:
            raise SamplerError(
                f"seed {params.seed} does not fit in 64 bits", fix="pick a smaller seed"
            )
        if params.stop and self.tokenizer is None:
            raise SamplerError(
                "this request has stop strings but the local sampler has no tokenizer to "
                "decode with",
                fix="build the LocalSampler with tokenizer=",
            )
        loop = asyncio.get_running_loop()
        request = Request(list(prompt_ids), params, loop, loop.create_future())
        self._engine.submit(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled.set()  # the worker drops the row at its next step
            raise

    async def close(self) -> None:
        """Stop the worker and fail every unfinished request; safe to call twice."""
        await asyncio.to_thread(self._engine.shutdown)

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise SamplerError("the prompt is empty", fix="pass at least one token id")
        if len(prompt_ids) >= self.context_length:
            raise SamplerError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{self.context_length} (max_position_embeddings): no room to generate",
                fix="shorten the prompt or end the episode with context_limit",
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise SamplerError(
                f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})",
                fix="tokenize with the tokenizer that belongs to this model",
            )


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
