"""LoRA for the native backend: y = W x + (alpha / rank) * B(A x) on chosen nn.Linear layers.

Each adapted Linear becomes a `LoraLinear` that shares the original weight and bias (the
same Parameter objects) and adds `lora_A` [rank, in] and `lora_B` [out, rank]. So every
base parameter keeps its name, the adapters are `<name>.lora_A` and `<name>.lora_B`, and
a tied lm_head stays tied to the input embedding: its adapter adds to the output
projection only, while the shared weight is frozen. B starts at zero, so a fresh
adapter computes exactly the base model.

Samplers are plain models: `merged_state_dict` folds each adapter into its weight under
the original names. A tied model whose lm_head is adapted no longer has one output
weight equal to its input embedding; the model receiving those weights must be untied
first (`untie_output`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from agentrl.errors import ConfigError
from agentrl.weights.config import LoraSpec

log = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ADAPTERS = (".lora_A", ".lora_B")


class LoraLinear(nn.Linear):
    """An nn.Linear plus a low-rank adapter; the base weight and bias are the original's."""

    def __init__(
        self, base: nn.Linear, rank: int, scale: float, generator: torch.Generator
    ) -> None:
        # Not nn.Linear.__init__: it would allocate a fresh weight; this one reuses base's.
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = w = base.weight
        self.register_parameter("bias", base.bias)
        self.scale = scale
        self.enabled = True  # off: the base Linear alone (the reference policy)
        a = torch.empty(rank, self.in_features)  # drawn on CPU: the same on every device
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # as in PEFT
        self.lora_A = nn.Parameter(a.to(w.device, w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank).to(w.device, w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        return y + self.scale * nn.functional.linear(
            nn.functional.linear(x, self.lora_A), self.lora_B
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scale={self.scale:g}"


def apply_lora(model: PreTrainedModel, spec: LoraSpec, default_seed: int = 0) -> list[str]:
    """Freeze `model` and adapt the Linears `spec` selects, in place; returns their names.

    `default_seed` seeds the adapters when `spec.seed` is None (the backend's seed). The
    draws come from a private generator, so the global RNG streams are left as they were.
    """
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ConfigError(f"{type(model).__name__} already has LoRA adapters")
    names = (ATTENTION if spec.train_attn else ()) + (MLP if spec.train_mlp else ())
    head = model.get_output_embeddings() if spec.train_unembed else None
    if spec.train_unembed and not isinstance(head, nn.Linear):
        raise ConfigError(
            f"lora train_unembed: {type(model).__name__} has no nn.Linear output projection",
            fix="set lora.train_unembed: false",
        )
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(spec.seed if spec.seed is not None else default_seed)
    adapted = []
    for name, module in list(model.named_modules()):
        parent, _, leaf = name.rpartition(".")
        if isinstance(module, nn.Linear) and (leaf in names or module is head):
            lora = LoraLinear(module, spec.rank, spec.scale, generator)
            model.get_submodule(parent).register_module(leaf, lora)
            adapted.append(name)
    for flag, group in (("train_attn", ATTENTION), ("train_mlp", MLP)):
        if getattr(spec, flag) and not any(n.rpartition(".")[2] in group for n in adapted):
            raise ConfigError(
                f"lora {flag}: {type(model).__name__} has no Linear named {', '.join(group)}",
                fix=f"set lora.{flag}: false",
            )
    return adapted


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict key names an adapter (not a base weight)."""
    return name.endswith(ADAPTERS)


def adapters_differ(saved: Mapping[str, torch.Tensor], model: nn.Module) -> str | None:
    """How saved adapters fail to fit `model`'s (names or shapes); None when they fit."""
    mine = {n: tuple(p.shape) for n, p in model.named_parameters() if is_adapter(n)}
    theirs = {n: tuple(t.shape) for n, t in saved.items()}
    wrong = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if not wrong:
        return None
    k = wrong[0]
    return (
        f"{len(wrong)} adapters do not fit this model's, e.g. {k}: saved "
        f"{theirs.get(k, 'none')}, here {mine.get(k, 'none')}"
    )


def merged_state_dict(state: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The plain model's state dict: each adapted W becomes W + (alpha/r) B A, adapters go.

    New tensors are made; `state` is left as it was.
    """
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for key, a in state.items():
        if key.endswith(".lora_A"):
            prefix = key.removesuffix(".lora_A")
            w, b = merged[f"{prefix}.weight"], state[f"{prefix}.lora_B"]
            delta = spec.scale * (b.float() @ a.float())
            merged[f"{prefix}.weight"] = (w.float() + delta).to(w.dtype)
    return merged


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block `model` computes its base (frozen) weights alone."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def output_is_tied(model: PreTrainedModel) -> bool:
    """Whether lm_head's weight is the input embedding (one Parameter under two names)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and getattr(head, "weight", None) is embed.weight


def untie_output(model: PreTrainedModel) -> None:
    """Give lm_head its own copy of a tied input embedding, in place.

    A sampler needs this to receive the weights of a tied model trained with
    `train_unembed`: its merged lm_head differs from its input embedding.
    """
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and output_is_tied(model):
        head.weight = nn.Parameter(head.weight.detach().clone(), head.weight.requires_grad)
    model.config.tie_word_embeddings = False  # a later tie_weights() must not re-tie them


def check_untied(sampler: object) -> None:
    """Refuse a local sampler whose model ties lm_head to its input embedding: the merged
    lm_head of a tied model trained with `train_unembed` would overwrite its embedding too.
    A sampler whose model is out of sight (a server) gets a warning instead."""
    receiver = getattr(sampler, "model", None)
    if isinstance(receiver, PreTrainedModel):
        if output_is_tied(receiver):
            raise ConfigError(
                "publish: lora train_unembed adapts lm_head, which this model ties to its "
                "input embedding, but the sampler's model ties them too: loading the merged "
                "lm_head would change its input embedding",
                fix="untie the sampler's model first (agentrl.weights.lora.untie_output), "
                "or set lora.train_unembed: false",
            )
    elif sampler is not None:
        log.warning(
            "publish: lm_head's adapter makes it differ from the tied input embedding; a "
            "sampler that ties them (e.g. vLLM serving a tied model) drops it: watch "
            "logprob_mismatch, or set lora.train_unembed: false"
        )


def check_checkpoint(saved: dict[str, Any] | None, spec: LoraSpec | None, where: str) -> None:
    """Refuse a checkpoint whose adapters (or full weights) this backend cannot take.

    `saved` is the LoRA spec recorded in the checkpoint (None: full weights); the
    initialisation seed need not match, since the saved adapters replace the drawn ones.
    """
    theirs = None if saved is None else LoraSpec.model_validate(saved)
    if theirs is None and spec is None:
        return
    if theirs is not None and spec is not None:
        ignore = {"seed"}
        if theirs.model_dump(exclude=ignore) == spec.model_dump(exclude=ignore):
            return
    has = "full weights" if theirs is None else theirs.describe()
    wants = "full weights" if spec is None else spec.describe()
    fix = "set backend lora: null" if saved is None else f"set backend lora: {json.dumps(saved)}"
    raise ConfigError(f"checkpoint {where} holds {has}, but this backend trains {wants}", fix=fix)
