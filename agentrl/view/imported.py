"""Trajectories another tool wrote, as a folder the viewer opens: `agentrl view FILE.json`
(or a folder of them) reads each ATIF document (`agentrl.atif.viewed`) into a folder of
its own under `$AGENTRL_CACHE/view/`, made again at each call and renamed into place
whole, with `imported.json` saying where it came from and each episode's opening text.
Nothing but the viewer reads that folder: its records are for looking at (another tool's
episodes have no loss mask or policy versions), so the viewer does not check them as a
run's ledgers are checked."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from agentrl import atomic
from agentrl.atif import viewed
from agentrl.cache import cache_root
from agentrl.errors import ConfigError, TrajectoryError

IMPORTED = "imported.json"
RUN_FILES = ("run.json", "trajectories.jsonl", "metrics.jsonl")


def is_foreign(path: Path) -> bool:
    """Whether `agentrl view PATH` is to import `path`: a .json file, or a folder holding
    .json files and none of a run folder's files."""
    if path.is_file():
        return path.suffix == ".json"
    if not path.is_dir() or any((path / n).exists() for n in RUN_FILES):
        return False
    return any(path.rglob("*.json"))


def import_atif(path: Path) -> Path:
    """The view folder of the ATIF documents at `path`; a ConfigError naming the first
    file that is not one."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.json") if p.is_file())
    records: list[str] = []
    prompts: dict[str, str] = {}
    for file in files:
        try:
            doc: Any = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConfigError(
                f"{file}: not a JSON document ({str(e).splitlines()[0]})",
                fix="pass an ATIF trajectory (.json) or a folder of them",
            ) from None
        try:
            traj, opening = viewed(doc, fallback_id=file.stem)
        except TrajectoryError as e:
            raise ConfigError(f"{file}: {e.message}", fix="pass an ATIF trajectory") from None
        tid, n = traj.trajectory_id, 1
        while tid in prompts:  # another document of the same id: told apart
            n += 1
            tid = f"{traj.trajectory_id}#{n}"
        traj = traj.model_copy(update={"trajectory_id": tid})
        prompts[tid] = opening
        records.append(traj.model_dump_json() + "\n")
    if not records:
        raise ConfigError(f"{path}: no .json files", fix="pass an ATIF trajectory or a folder")
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    folder = cache_root() / "view" / f"atif-{key}"
    meta = {"format": "atif", "source": str(path.resolve()), "prompts": prompts}
    with atomic.atomic_folder(folder, replace=True) as tmp:
        (tmp / "trajectories.jsonl").write_text("".join(records), encoding="utf-8")
        (tmp / IMPORTED).write_text(json.dumps(meta), encoding="utf-8")
    return folder


def imported(root: Path) -> dict[str, Any] | None:
    """What `import_atif` recorded of a view folder (None: a run's own folder)."""
    try:
        data = json.loads((root / IMPORTED).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
