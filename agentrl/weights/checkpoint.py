"""The checkpoint layout every backend shares, and how it stays whole through a crash.

`root/step-000012/` is complete by construction: it is written as
`root/step-000012.tmp-<pid>/`, every file and the directory are fsynced, and only then is
it renamed in one `os.rename` (and `root` fsynced). A writer killed mid-way leaves only a
`*.tmp-*` directory, which `latest_checkpoint` ignores and the next `begin_checkpoint`
removes. RNG state (torch, CUDA, python, numpy) is saved per rank, so a resumed run
draws the same numbers it would have drawn.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

from agentrl.atomic import publish_folder
from agentrl.errors import ConfigError

# Fault injection for crash tests: seconds to sleep after each checkpoint file is written.
PAUSE_ENV = "AGENTRL_FAULT_CHECKPOINT_PAUSE_S"
_STEP_DIR = re.compile(r"step-(\d+)")


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under `root`, if any."""
    if not root.is_dir():
        return None
    found = [
        (int(m[1]), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()  # `*.tmp-*` never matches
    ]
    return max(found)[1] if found else None


def begin_checkpoint(root: Path, step: int) -> tuple[Path, Path]:
    """Remove torn leftovers and create a fresh temporary directory; returns (tmp, final)."""
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob("*.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    return tmp, final


def commit_checkpoint(tmp: Path, final: Path) -> Path:
    """Make `tmp` durable, then publish it as `final` in one rename (saved twice at one
    step: the old one is moved aside first, named as torn)."""
    publish_folder(tmp, final, replace=True, durable=True)
    return final


def encode_json(obj: object, what: str) -> bytes:
    """JSON for checkpoint metadata; refused before anything is written, not half-way."""
    try:
        return json.dumps(obj, indent=1).encode()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"checkpoint {what} must be JSON-serialisable: {e}") from e


def write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        synced(f.fileno())


def synced(fd: int) -> None:
    """fsync a file just written into a checkpoint (then the fault-injection pause)."""
    os.fsync(fd)
    pause = float(os.environ.get(PAUSE_ENV) or 0)
    if pause > 0:
        time.sleep(pause)


def save_torch(obj: object, path: Path) -> None:
    import torch  # here, so reading the layout (latest_checkpoint) needs no torch

    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        synced(f.fileno())


def seed_rngs(seed: int) -> None:
    """Seed torch (CPU and CUDA), python and numpy."""
    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types `torch.load(weights_only=True)` accepts."""
    import numpy as np
    import torch

    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()  # weights_only loads
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,
        "python": random.getstate(),
        "numpy": numpy_state,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    numpy_state["state"]["key"] = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
