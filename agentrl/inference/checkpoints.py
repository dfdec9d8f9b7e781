"""A train run's checkpoint as a policy: find it, and export it as a plain model folder.

`agentrl train` with the FSDP backend saves `RUN/checkpoints/step-N/`: `model.pt` (the
full state dict, or with LoRA the adapters alone), the optimizer and RNG state, and
`meta.json`, whose `extra.model` names the base model ("embedded" or a model folder).
Samplers load plain Hugging Face folders, so `export_model` writes one: the base model
with the checkpoint's weights, adapters merged, the base's tokenizer beside them, in a
temporary folder renamed into place (never half a folder). `checkpoint_model` exports
each checkpoint once into the cache and reuses it. Tinker checkpoints live on the
Tinker service and are refused. Reading the layout imports no torch; exporting does.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.atomic import atomic_folder
from agentrl.cache import cache_root
from agentrl.errors import ConfigError
from agentrl.weights.checkpoint import latest_checkpoint

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

CHECKPOINT_FIX = (
    "give a train run folder (agentrl train --out), its checkpoints/ folder, or one "
    "checkpoint in it (checkpoints/step-NNNNNN)"
)
EXPORT_NOTE = "agentrl_export.json"  # which checkpoint an exported folder holds
_STEP = re.compile(r"step-\d+")  # a `*.tmp-*` folder (a torn write) never matches


def holds_checkpoints(path: Path) -> bool:
    """Whether `path` is a train run folder, its checkpoints/ folder or a checkpoint."""
    return (
        (path / "checkpoints").is_dir()
        or (_STEP.fullmatch(path.name) is not None and (path / "meta.json").is_file())
        or latest_checkpoint(path) is not None
    )


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: a run folder's (or a checkpoints/ folder's) newest
    complete one, or a `step-N` folder itself; its meta.json is checked (see `read_meta`)."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such folder", fix=CHECKPOINT_FIX)
    if _STEP.fullmatch(path.name) and (path / "meta.json").is_file():
        read_meta(path)
        return path
    for root in (path / "checkpoints", path):
        if (found := latest_checkpoint(root)) is not None:
            read_meta(found)
            return found
    if (path / "checkpoints").is_dir():
        raise ConfigError(
            f"{path}: this train run has no complete checkpoint yet",
            fix="wait for its first checkpoint (train config checkpoint.every), or give "
            "another run",
        )
    raise ConfigError(f"{path}: neither a train run nor a checkpoint folder", fix=CHECKPOINT_FIX)


def read_meta(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's meta.json, refused unless it can be exported: its weights here
    (not on a Tinker service) and its base model named."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{checkpoint}/meta.json: unreadable ({e})".splitlines()[0],
            fix="give a complete checkpoint (the newest one of the run is found for you)",
        ) from e
    if not isinstance(meta, dict):
        raise ConfigError(f"{checkpoint}/meta.json: not a JSON object", fix=CHECKPOINT_FIX)
    if "tinker_path" in meta:
        raise ConfigError(
            f"{checkpoint}: a Tinker checkpoint; its weights live on the Tinker service "
            f"({meta['tinker_path']}), not in this folder",
            fix="sample it on that service: ServiceClient().create_training_client_from_state"
            f"({meta['tinker_path']!r}).save_weights_and_get_sampling_client()",
        )
    extra = meta.get("extra")
    if not isinstance(extra, dict) or not isinstance(extra.get("model"), str):
        raise ConfigError(
            f"{checkpoint}/meta.json: extra.model (the base model) is missing: the "
            "checkpoint was saved by an older agentrl",
            fix='add "model": "embedded" (or the train config\'s model folder, absolute) to '
            "the extra object of that meta.json",
        )
    if not (checkpoint / "model.pt").is_file():
        raise ConfigError(
            f"{checkpoint}: no model.pt in this checkpoint",
            fix="give a checkpoint of the fsdp backend",
        )
    return meta


def checkpoint_model(path: str | Path) -> Path:
    """The exported model folder of the checkpoint `path` names (see `find_checkpoint`),
    exported on first use into the cache, keyed by the checkpoint's absolute path, its
    meta.json and its model.pt's size and time; later calls return the same folder untouched."""
    checkpoint = find_checkpoint(path).resolve()
    weights = (checkpoint / "model.pt").stat()
    key = hashlib.sha256(
        f"{checkpoint}\0{weights.st_size}\0{weights.st_mtime_ns}\0".encode()
        + (checkpoint / "meta.json").read_bytes()
    )
    dest = cache_root() / "exports" / f"{checkpoint.name}-{key.hexdigest()[:16]}"
    if not (dest / "config.json").is_file():
        try:
            _export(checkpoint, read_meta(checkpoint), dest)
        except OSError as e:
            if not (dest / "config.json").is_file():  # not a lost race with another exporter
                raise ConfigError(
                    f"export of {checkpoint} to {dest}: {e}".splitlines()[0],
                    fix="free space there, or set AGENTRL_CACHE to a writable folder",
                ) from e
    return dest


def export_model(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the checkpoint `checkpoint` names as a model folder `out` that
    `AutoModelForCausalLM.from_pretrained` and `vllm serve` load; returns `out`.

    config.json, model.safetensors (float32, as trained), the tokenizer and
    generation_config of the base model, and agentrl_export.json (the source checkpoint).
    `checkpoint` "embedded" is the embedded model itself (what a run starts from), e.g.
    for a vLLM server to start on.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists", fix="name a new folder, or remove that one")
    try:
        if str(checkpoint) == "embedded":
            from agentrl.inference.embedded import model_dir

            with atomic_folder(out, durable=True) as tmp:
                shutil.copytree(model_dir(), tmp, dirs_exist_ok=True)
            return out
        found = find_checkpoint(checkpoint).resolve()
        return _export(found, read_meta(found), out)
    except OSError as e:
        raise ConfigError(
            f"export to {out}: {e}".splitlines()[0], fix="name a folder you can write to"
        ) from e


def _export(checkpoint: Path, meta: dict[str, Any], out: Path) -> Path:
    import torch

    from agentrl.inference.embedded import model_tokenizer

    base = str(meta["extra"]["model"])
    model = _base_model(base)
    saved = torch.load(checkpoint / "model.pt", map_location="cpu", weights_only=True)
    _load_weights(model, saved, meta.get("lora"), checkpoint)
    tokenizer = model_tokenizer(base)
    note = {  # the trainer step (the folder's name) and the optimizer steps behind the weights
        "checkpoint": str(checkpoint),
        "step": meta.get("extra", {}).get("step"),
        "optimizer_steps": meta.get("step"),
        "base_model": base,
    }
    with atomic_folder(out, durable=True) as tmp:  # onto nothing, or an empty folder
        model.save_pretrained(tmp)  # safetensors; a tied lm_head is stored once
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_NOTE).write_text(json.dumps(note, indent=1) + "\n")
    return out


def _base_model(base: str) -> PreTrainedModel:
    if base == "embedded":
        from agentrl.inference.embedded import load_model

        return load_model()
    from transformers import AutoModelForCausalLM

    fix = (
        "make extra.model in the checkpoint's meta.json name the model folder the run "
        "trained (it must exist here)"
    )
    if not Path(base).is_dir():  # never a hub id: nothing is downloaded
        raise ConfigError(f"base model {base}: no such folder", fix=fix)
    try:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(base, dtype="float32")
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"base model {base}: cannot be loaded ({e})".splitlines()[0], fix=fix
        ) from e
    return model.eval()


def _load_weights(
    model: PreTrainedModel,
    saved: dict[str, torch.Tensor],
    lora_spec: dict[str, Any] | None,
    checkpoint: Path,
) -> None:
    """Put the checkpoint's weights into `model` (adapters merged into the base), untying
    lm_head from the input embedding where the trained weights made them differ."""
    import torch

    from agentrl.weights import lora
    from agentrl.weights.config import LoraSpec

    state = model.state_dict()
    by_storage: dict[int, list[str]] = {}  # names of one tensor: a tied lm_head and embedding
    for name, tensor in state.items():
        if tensor.numel():
            by_storage.setdefault(tensor.data_ptr(), []).append(name)
    fix = "export against the base model the run trained (extra.model in its meta.json)"
    if lora_spec is None:
        new = dict(saved)
        for names in by_storage.values():  # a tied pair may have been saved under one name
            if kept := [n for n in names if n in saved]:
                new.update({n: saved[kept[0]] for n in names if n not in saved})
        wrong = new.keys() ^ state.keys()
    else:
        wrong = {
            k
            for k in saved
            if not lora.is_adapter(k) or f"{k.rpartition('.')[0]}.weight" not in state
        }
        new = dict(state) | saved
    wrong |= {k for k in new.keys() & state.keys() if new[k].shape != state[k].shape}
    if not wrong and lora_spec is not None:
        try:
            new = lora.merged_state_dict(new, LoraSpec.model_validate(lora_spec))
        except RuntimeError:  # an adapter's shape does not fit its weight
            wrong = {k for k in saved if k.endswith(".lora_A")}
    if wrong:
        raise ConfigError(
            f"{checkpoint}: the saved weights do not fit the base model ({len(wrong)} "
            f"names or shapes differ, e.g. {sorted(wrong)[0]})",
            fix=fix,
        )
    if any(
        not torch.equal(new[a], new[b])
        for names in by_storage.values()
        for a, b in zip(names, names[1:], strict=False)
    ):
        lora.untie_output(model)  # trained apart (an adapted lm_head): save both
    with torch.no_grad():
        model.load_state_dict(new, strict=True)
