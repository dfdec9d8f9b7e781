"""Tinker's training operations on agentrl's native learner (FSDPBackend).

Tinker's losses are not agentrl's (`agentrl.algorithms`): per token i, with the
learner's logprob lp_i = log softmax(logits at position i of model_input)[target_i]
at temperature 1, the sampler's logprob q_i, advantage A_i and ratio r_i =
exp(lp_i - q_i), the loss is the plain SUM over tokens and datums (no normalisation):

- cross_entropy:       -w_i lp_i                       (weights w, default 1)
- importance_sampling: -r_i A_i
- ppo:                 -min(r_i A_i, clip(r_i, lo, hi) A_i)        lo, hi = 0.8, 1.2
- cispo:               -stopgrad(clip(r_i, lo, hi)) lp_i A_i       lo, hi = 0.0, 4.0

(lo, hi: loss_fn_config clip_low_threshold, clip_high_threshold). Gradients add up over
forward_backward calls until optim_step, which takes its AdamW hyperparameters from
the call: the backend's own LR schedule is never stepped.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import ValidationError
from torch.distributed.tensor import DTensor

from agentrl.backends.fsdp import FSDPBackend, FSDPConfig
from agentrl.tinker_server.wire import Datum, UserError

if TYPE_CHECKING:
    from tinker.types import AdamParams, LoraConfig

    from agentrl.backends.base import WeightSink


@dataclass(frozen=True)
class _LossKind:
    inputs: tuple[str, ...]  # loss_fn_inputs it reads; target_tokens always first
    clip: tuple[float, float] | None  # default (clip_low, clip_high); None: no config


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
LOSSES = {
    "cross_entropy": _LossKind(("target_tokens", "weights"), None),
    "importance_sampling": _LossKind(_RL_INPUTS, None),
    "ppo": _LossKind(_RL_INPUTS, (0.8, 1.2)),
    "cispo": _LossKind(_RL_INPUTS, (0.0, 4.0)),
}
_OPTIONAL = frozenset({"weights"})  # cross_entropy without weights: every token counts


@dataclass(frozen=True)
class Loss:
    """A loss_fn with its config resolved."""

    name: str
    clip_low: float = 0.0
    clip_high: float = 0.0


def parse_loss(name: str, config: dict[str, float | str]) -> Loss:
    """Resolve loss_fn and loss_fn_config; UserError for anything this server lacks."""
    kind = LOSSES.get(name)
    if kind is None:
        raise UserError(
            f"loss_fn {name!r} is not supported by agentrl serve-tinker "
            f"(supported: {', '.join(LOSSES)})"
        )
    known = {"clip_low_threshold", "clip_high_threshold"} if kind.clip else set()
    unknown = sorted(set(config) - known)
    if unknown:
        takes = f"takes only {', '.join(sorted(known))}" if known else "takes no loss_fn_config"
        raise UserError(f"loss_fn {name} {takes}; got {', '.join(unknown)}")
    if kind.clip is None:
        return Loss(name)
    low = config.get("clip_low_threshold", kind.clip[0])
    high = config.get("clip_high_threshold", kind.clip[1])
    if not isinstance(low, float | int) or not isinstance(high, float | int) or low > high:
        raise UserError(f"loss_fn {name}: clip thresholds must be numbers, low <= high")
    return Loss(name, float(low), float(high))


def elementwise_loss(
    loss: Loss, lp_B_T: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The per-token loss of the module docstring, shaped like `lp_B_T`."""
    if loss.name == "cross_entropy":
        return -inputs["weights"] * lp_B_T
    adv_B_T = inputs["advantages"]
    ratio_B_T = torch.exp(lp_B_T - inputs["logprobs"])
    if loss.name == "importance_sampling":
        return -ratio_B_T * adv_B_T
    clipped_B_T = ratio_B_T.clamp(loss.clip_low, loss.clip_high)
    if loss.name == "ppo":
        return -torch.minimum(ratio_B_T * adv_B_T, clipped_B_T * adv_B_T)
    return -clipped_B_T.detach() * lp_B_T * adv_B_T  # cispo


@dataclass(frozen=True)
class FwdBwdResult:
    logprobs_D: list[np.ndarray]  # per datum, float32 [T]
    losses_D: list[np.ndarray]
    loss_sum: float


@dataclass(frozen=True)
class _Row:
    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]  # target_tokens int64, the rest float32


class TinkerLearner:
    """One Tinker training model: full weights, or LoRA when `lora` is given."""

    def __init__(self, model_dir: Path, lora: LoraConfig | None) -> None:
        self.lora = lora
        self.backend = FSDPBackend(_fsdp_config(lora), model_dir)

    @property
    def step(self) -> int:
        return self.backend.step

    def forward_backward(self, data: list[Datum], loss: Loss, *, backward: bool) -> FwdBwdResult:
        """Score `data`; with `backward`, add the gradient of the summed loss."""
        rows = [self._row(i, d, loss) for i, d in enumerate(data)]  # all checked up front
        logprobs_D: list[np.ndarray] = [np.empty(0, np.float32)] * len(rows)
        losses_D = list(logprobs_D)
        total = 0.0
        budget = self.backend.config.micro_batch_tokens
        for batch in _micro_batches([len(r.tokens) for r in rows], budget):
            with contextlib.nullcontext() if backward else torch.no_grad():
                lp_B_T, loss_B_T = self._micro_batch([rows[i] for i in batch], loss)
                value = loss_B_T.sum()
                if backward:
                    value.backward()
            total += float(value.detach())
            for j, i in enumerate(batch):
                n = len(rows[i].tokens)
                logprobs_D[i] = lp_B_T[j, :n].detach().cpu().numpy().astype(np.float32)
                losses_D[i] = loss_B_T[j, :n].detach().cpu().numpy().astype(np.float32)
        return FwdBwdResult(logprobs_D, losses_D, total)

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """Set AdamW's hyperparameters from `params`, clip, step, zero the gradients."""
        b1, b2 = params.beta1, params.beta2
        if params.learning_rate < 0 or params.eps < 0 or params.weight_decay < 0:
            raise UserError("AdamParams: learning_rate, eps and weight_decay must be >= 0")
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise UserError(f"AdamParams: beta1 and beta2 must be in [0, 1), got {b1}, {b2}")
        backend = self.backend
        for group in backend.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(b1, b2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(backend.model.parameters(), max_norm)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        finite = math.isfinite(grad_norm)
        if finite:  # a non-finite gradient would ruin the weights: skip, and say so
            backend.optimizer.step()
            backend.step += 1
        backend.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": grad_norm, "step_skipped:sum": 0.0 if finite else 1.0}

    def save(self, root: Path, extra: dict[str, Any]) -> Path:
        """Weights, optimizer state and RNGs, atomically, as root/step-N."""
        return self.backend.save_checkpoint(root, extra)

    def load(self, path: Path, *, optimizer: bool) -> None:
        """Restore a `save`; without `optimizer`, AdamW starts afresh on those weights."""
        self.backend.load_checkpoint(path)
        if not optimizer:
            self.backend.optimizer.state.clear()
        self.backend.optimizer.zero_grad(set_to_none=True)

    def publish(self, sampler: WeightSink) -> int:
        """Copy the full weights (LoRA merged) into `sampler`."""
        return self.backend.publish(sampler)

    def close(self) -> None:
        self.backend.close()

    def _row(self, i: int, d: Datum, loss: Loss) -> _Row:
        n, where = len(d.tokens), f"datum {i}"
        backend = self.backend
        if not 0 < n <= backend.context_length:
            raise UserError(f"{where} has {n} tokens; 1 to {backend.context_length} fit")
        wanted = LOSSES[loss.name].inputs
        missing = [k for k in wanted if k not in d.inputs and k not in _OPTIONAL]
        extra = sorted(set(d.inputs) - set(wanted))
        if missing or extra:
            raise UserError(
                f"{where}: loss_fn {loss.name} reads loss_fn_inputs {', '.join(wanted)}; "
                f"missing {missing or 'none'}, unexpected {extra or 'none'}"
            )
        inputs: dict[str, torch.Tensor] = {}
        for key in wanted:
            values = d.inputs.get(key, np.ones(n, np.float32))
            if len(values) != n:
                raise UserError(f"{where}: {key} has {len(values)} values for {n} tokens")
            dtype = np.int64 if key == "target_tokens" else np.float32
            inputs[key] = torch.from_numpy(values.astype(dtype))  # astype copies: writable
        ids = torch.tensor(d.tokens, dtype=torch.long)
        for name, t in (("model_input", ids), ("target_tokens", inputs["target_tokens"])):
            if int(t.min()) < 0 or int(t.max()) >= backend.vocab_size:
                raise UserError(f"{where}: {name} holds ids outside [0, {backend.vocab_size})")
        return _Row(ids, inputs)

    def _micro_batch(self, rows: list[_Row], loss: Loss) -> tuple[torch.Tensor, torch.Tensor]:
        """Learner logprobs and masked per-token losses of right-padded rows, [B, T]."""
        device, width = self.backend.device, max(len(r.tokens) for r in rows)
        ids_B_T = torch.full((len(rows), width), self.backend.pad_id, dtype=torch.long)
        valid_B_T = torch.zeros((len(rows), width), dtype=torch.bool)
        inputs = {
            k: torch.zeros((len(rows), width), dtype=v.dtype) for k, v in rows[0].inputs.items()
        }
        for j, r in enumerate(rows):
            n = len(r.tokens)
            ids_B_T[j, :n], valid_B_T[j, :n] = r.tokens, True
            for k, v in r.inputs.items():
                inputs[k][j, :n] = v
        ids_B_T, valid_B_T = ids_B_T.to(device), valid_B_T.to(device)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        logits_B_T_V = self.backend.model(
            input_ids=ids_B_T, attention_mask=valid_B_T.long(), use_cache=False
        ).logits.float()
        picked_B_T = logits_B_T_V.gather(-1, inputs["target_tokens"][..., None]).squeeze(-1)
        lp_B_T = torch.where(valid_B_T, picked_B_T - logits_B_T_V.logsumexp(-1), 0.0)
        # where, not multiply: a padded position must reach neither the loss nor the gradient
        loss_B_T = torch.where(valid_B_T, elementwise_loss(loss, lp_B_T, inputs), 0.0)
        return lp_B_T, loss_B_T


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped so each right-padded batch holds at most `budget` tokens (longest
    first; a datum longer than the budget goes alone)."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _fsdp_config(lora: LoraConfig | None) -> FSDPConfig:
    """Temperature 1 (Tinker's logprobs), no clipping of its own (optim_step clips)."""
    fields: dict[str, object] = {"temperature": 1.0, "max_grad_norm": None}
    if lora is not None:
        from agentrl.weights.config import LoraSpec

        fields["lora"] = LoraSpec(
            rank=lora.rank,
            train_attn=lora.train_attn,
            train_mlp=lora.train_mlp,
            train_unembed=lora.train_unembed,
            seed=lora.seed,
        )
    try:
        return FSDPConfig.model_validate(fields)
    except ValidationError as e:
        raise UserError(f"lora_config: {e.errors(include_url=False)[0]['msg']}") from e
