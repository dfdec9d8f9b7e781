"""Where save_state writes, and how its tinker:// path finds the checkpoint again.

`tinker://<model_id>/weights/<name>` is `<state-dir>/<model_id, ':' as '_'>/weights/
<name>/step-N`, written by the backend's atomic checkpoint helpers (a crash leaves no
half-written checkpoint behind). Its `extra` metadata records the base model and the
LoRA config, which a load needs to rebuild the model; a later server over the same
state dir loads it as well.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from agentrl.tinker_server.learner import TinkerLearner
from agentrl.tinker_server.wire import UserError
from agentrl.weights.checkpoint import latest_checkpoint

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_WEIGHTS_PATH = re.compile(r"tinker://([A-Za-z0-9][A-Za-z0-9_.:-]*)/weights/(.+)")


class StateDir:
    """The save_state checkpoints under one folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def save(
        self,
        learner: TinkerLearner,
        model_id: str,
        name: str,
        extra: dict[str, Any],
        *,
        overwrite: bool,
    ) -> tuple[str, Path]:
        """Save `learner` as `name`; returns its tinker:// path and its folder."""
        if not _NAME.fullmatch(name):
            raise UserError(f"checkpoint name {name!r}: use letters, digits, '.', '_', '-'")
        path = f"tinker://{model_id}/weights/{name}"
        folder = self._folder(model_id, name)
        if latest_checkpoint(folder) is not None and not overwrite:
            raise UserError(f"{path} exists: save under another name (or overwrite=True)")
        saved = learner.save(folder, {"tinker_path": path, **extra})
        for old in folder.glob("step-*"):  # an overwritten name keeps only the new one
            if old != saved:
                shutil.rmtree(old, ignore_errors=True)
        return path, saved

    def find(self, path: str) -> tuple[Path, dict[str, Any]]:
        """The complete checkpoint behind a save_state path, and the `extra` saved with it."""
        match = _WEIGHTS_PATH.fullmatch(path)
        if match is None or not _NAME.fullmatch(match[2]):
            raise UserError(
                f"{path!r} is not a save_state path of this server "
                "(tinker://<model_id>/weights/<name>)"
            )
        found = latest_checkpoint(self._folder(match[1], match[2]))
        if found is None:
            raise UserError(f"no checkpoint {path} under {self.root}")
        extra: dict[str, Any] = json.loads((found / "meta.json").read_text())["extra"]
        return found, extra

    def _folder(self, model_id: str, name: str) -> Path:
        return self.root / model_id.replace(":", "_") / "weights" / name
