"""The backend section of a train config: FSDP or Tinker, and LoRA, as configs.

Apart from the backends themselves (`fsdp.py` imports torch and transformers,
`tinker.py` the Tinker SDK), so a train config is validated without importing any of
them; `build()` imports its backend when a run starts.
"""

from __future__ import annotations

import os
from ipaddress import ip_address
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from pydantic import Field

from agentrl.algorithm_config import LossConfig
from agentrl.backends.optim import OptimizerConfig
from agentrl.errors import ConfigError
from agentrl.weights.config import LoraSpec

if TYPE_CHECKING:
    from agentrl.backends.fsdp import FSDPBackend
    from agentrl.backends.tinker import TinkerBackend


class FSDPConfig(OptimizerConfig):
    """Optimizer, schedule and batching of the FSDP backend."""

    type: Literal["fsdp"] = "fsdp"
    micro_batch_tokens: int = Field(
        default=4096, ge=1, description="padded tokens per forward pass (a longer sample: alone)"
    )
    temperature: float = Field(
        default=1.0, gt=0, description="the sampling temperature; logits are divided by it"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="compute dtype; bfloat16 (fp32 master weights) needs CUDA"
    )
    gradient_checkpointing: bool = Field(default=False, description="recompute activations")
    seed: int = Field(default=0, description="seeds torch, python and numpy at start")
    reference_model: bool = Field(
        default=False,
        description="a reference policy for KL: a frozen copy of the initial weights (with "
        "lora: the base model, adapters off, at no extra memory)",
    )
    lora: LoraSpec | None = Field(
        default=None, description="train LoRA adapters on frozen weights; null: full weights"
    )

    def check(self) -> FSDPConfig:
        """Reject what this machine cannot run (before any model is loaded)."""
        import torch

        if self.dtype == "bfloat16" and not torch.cuda.is_available():
            raise ConfigError(
                "fsdp: dtype bfloat16 needs CUDA, and no CUDA device is visible",
                fix="use dtype: float32 on CPU",
            )
        return self

    def validate_loss(self, loss: LossConfig) -> None:
        """Reject loss options this backend cannot honour instead of ignoring them."""
        if loss.kl_coef > 0 and not self.reference_model:
            raise ConfigError(
                f"loss kl_coef {loss.kl_coef} needs a reference model, but fsdp "
                "reference_model is false",
                fix="set reference_model: true in the fsdp config, or kl_coef: 0",
            )

    def build(self, model_path: str | os.PathLike[str] | None = None) -> FSDPBackend:
        from agentrl.backends.fsdp import FSDPBackend

        return FSDPBackend(self, model_path)


LOCAL_API_KEY = "tml-agentrl-local"  # what a loopback server is sent when no key is set


class TinkerConfig(OptimizerConfig):
    """Train on a Tinker service (hosted, or `agentrl serve-tinker`)."""

    type: Literal["tinker"] = "tinker"
    base_url: str | None = Field(
        default=None,
        description="the service; null: $TINKER_BASE_URL, else the hosted Tinker "
        "(whose key comes from $TINKER_API_KEY)",
    )
    base_model: str = Field(
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        description="the model the service trains, by its name there; its tokenizer must "
        "be the run's (model: in the train config)",
    )
    lora_rank: int = Field(
        default=32, ge=0, description="LoRA rank; 0: full weights (agentrl serve-tinker only)"
    )
    timeout: float = Field(default=900.0, gt=0, description="seconds to wait for one call")
    temperature: float = Field(
        default=1.0, gt=0, description="the sampling temperature (set from the tasks); must be 1"
    )
    seed: int = Field(default=0, description="seeds the LoRA initialisation")

    def check(self) -> TinkerConfig:
        """Reject what Tinker cannot do, before any connection is made."""
        if self.temperature != 1.0:
            raise ConfigError(
                f"the tinker backend scores tokens at temperature 1, but the tasks sample "
                f"at temperature {self.temperature}: the importance ratios would be wrong",
                fix="set temperature: 1.0 in the train config, or use backend type fsdp",
            )
        return self

    def validate_loss(self, loss: LossConfig) -> None:
        """Reject loss options Tinker's losses cannot express instead of ignoring them."""
        if loss.kl_coef > 0:
            raise ConfigError(
                f"loss kl_coef {loss.kl_coef}: Tinker's losses have no KL term",
                fix="set algorithm.loss.kl_coef: 0, or use backend type fsdp",
            )
        if loss.type == "ppo" and loss.dual_clip is not None:
            raise ConfigError(
                f"loss dual_clip {loss.dual_clip}: Tinker's ppo loss has no dual clip",
                fix="set algorithm.loss.dual_clip: null, or use backend type fsdp",
            )

    def api_key(self) -> str | None:
        """$TINKER_API_KEY; a loopback server without one gets a placeholder."""
        key = os.environ.get("TINKER_API_KEY")
        if key:
            return key
        url = self.base_url or os.environ.get("TINKER_BASE_URL")
        if url and _loopback(url):
            return LOCAL_API_KEY
        raise ConfigError(
            f"the tinker backend needs an API key for {url or 'the hosted Tinker service'}",
            fix="export TINKER_API_KEY=tml-... (or point base_url at agentrl serve-tinker)",
        )

    def build(self, model_path: str | os.PathLike[str] | None = None) -> TinkerBackend:
        from agentrl.backends.tinker import TinkerBackend

        del model_path  # the service holds the model: base_model names it
        return TinkerBackend(self)


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False
