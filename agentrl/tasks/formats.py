"""One door for every task format: `load_any(path)` decides what `path` holds, once, and
hands it to its reader.

- a folder with `task.toml` (Harbor), or a `task.yaml` that is a Terminal-Bench task (an
  `instruction:`): `tasks.terminal`;
- a folder with `openenv.yaml` (an OpenEnv environment): `tasks.openenv`;
- `.json` / `.jsonl` rows (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym): `tasks.swe`;
- a `.yaml` / `.yml` task file, or a folder whose `task.yaml` is one: `tasks.load`;
- a dataset folder (a folder of Harbor, Terminal-Bench or OpenEnv folders): `expand` turns
  it into its tasks wherever a command takes several, and `load_any` refuses it.

`task_yaml_kind(folder)` is the one place a folder's `task.yaml` is told apart: by its
top-level keys, read from its lines (no YAML parse: the reader that follows reports
what is wrong inside it).

`kind_of(path)` says which, and also names the two other files a person passes to the
CLI: a train config (a `.yaml` with a top-level `schedule:`) and trajectories (a
`.jsonl` whose rows carry `trajectory_id`). It reads at most a file's head, refuses a
FIFO or device before reading it, and imports nothing heavy, so `agentrl validate` of a
train config never loads torch.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from agentrl.errors import ConfigError
from agentrl.tasks.spec import Task, TaskSpec
from agentrl.textfile import MAX_BYTES, regular_file

Kind = Literal["task", "task-folder", "openenv", "dataset", "rows", "train-config", "trajectories"]

TASK_SUFFIXES = (".yaml", ".yml")
ROWS_SUFFIXES = (".json", ".jsonl")
HEAD_BYTES = 4096
ROW_KEYS = ('"instance_id"', '"repo_name"', '"docker_image"')
"""A key that opens every dataset's rows (R2E-Gym's have no instance_id)."""


def dataset_tasks(folder: str | Path) -> list[Path]:
    """The task folders of a dataset folder, sorted: a folder that is no task itself (no
    task.toml, no task.yaml) whose subfolders are Harbor or Terminal-Bench tasks, as
    Harbor's `harbor run --path` takes a local dataset (`terminal-bench@2.0` downloaded is
    one). Empty when `folder` is not one."""
    from agentrl.tasks.openenv.load import MANIFEST, is_environment

    p = Path(folder)
    if not p.is_dir() or any((p / f).exists() for f in ("task.toml", "task.yaml", MANIFEST)):
        return []
    found = []
    for child in sorted(p.iterdir()):
        if not child.is_dir():
            continue
        if (child / "task.toml").is_file() or is_environment(child):
            found.append(child)
        elif (child / "task.yaml").is_file():
            with contextlib.suppress(ConfigError):
                if task_yaml_kind(child) == "task-folder":
                    found.append(child)
    return found


def expand(paths: Sequence[str | Path]) -> list[Path]:
    """`paths` with each dataset folder replaced by its task folders (in order)."""
    out: list[Path] = []
    for path in paths:
        out.extend(dataset_tasks(path) or [Path(path)])
    return out


def kind_of(path: str | Path) -> Kind:
    """What `path` holds, from its name and, where the name does not settle it, its head.

    A missing file is classified by its name (its reader says it is missing), a missing
    path whose name says nothing is not found; a path that is none of the kinds is a
    ConfigError with the fix.
    """
    p = Path(path)
    if p.is_dir():
        if (p / "task.toml").is_file():
            return "task-folder"
        from agentrl.tasks.openenv.load import is_environment

        if is_environment(p):
            return "openenv"
        return "dataset" if dataset_tasks(p) else task_yaml_kind(p)
    if p.exists():
        regular_file(p)  # a FIFO or a device is refused before its head is read
    if p.suffix in TASK_SUFFIXES:
        return "train-config" if _is_train_config(p) else "task"
    if p.suffix == ".jsonl" and _holds_trajectories(p):
        return "trajectories"
    if p.suffix in ROWS_SUFFIXES:
        return "rows"
    if not p.exists():
        raise ConfigError(f"{p}: not found", fix="check the path (a task folder or file)")
    raise ConfigError(
        f"{p}: neither a task (.yaml/.yml, a folder with task.yaml) nor trajectories (.jsonl)",
        fix="name a task file or folder, a train config, rows or trajectories",
    )


TERMINAL_BENCH_KEYS = frozenset({"instruction", "descriptions", "author_email", "parser_name"})
"""Top-level keys only a Terminal-Bench task.yaml has (`instruction`, or the older
`descriptions`, is required there)."""
FOLDER_FIX = (
    "name a folder holding an agentrl task.yaml (name:, prompt:, grader:), a Terminal-Bench "
    "task (task.yaml with instruction:) or a Harbor task (task.toml), or a task file"
)


def task_yaml_kind(folder: Path) -> Literal["task", "task-folder"]:
    """Whether `folder`'s task.yaml is an agentrl task ("task": `TaskSpec`'s keys) or a
    Terminal-Bench one ("task-folder": its `instruction:`); a ConfigError that says what
    was expected when it has none, or is neither."""
    path = folder / "task.yaml"
    if not path.is_file():
        raise ConfigError(f"{folder}: no task.yaml or task.toml in this folder", fix=FOLDER_FIX)
    regular_file(path)
    keys = set(_top_level_keys(path))
    if keys & TERMINAL_BENCH_KEYS:
        return "task-folder"
    if keys & set(TaskSpec.model_fields):
        return "task"
    shown = ", ".join(sorted(keys)[:6]) or "none"
    raise ConfigError(
        f"{path}: neither an agentrl task (name:, prompt:, grader:) nor a Terminal-Bench "
        f"task (instruction:); its top-level keys: {shown}",
        fix=FOLDER_FIX,
    )


def task_file(path: str | Path) -> Path:
    """The YAML task file `path` names: itself, or a folder's task.yaml."""
    p = Path(path)
    return p / "task.yaml" if p.is_dir() else p


def load_any(path: str | Path) -> Task:
    """The task at `path`, in whichever format it is (see `kind_of`)."""
    kind = kind_of(path)
    if kind == "task-folder":
        from agentrl.tasks.terminal.load import load_terminal_task

        return load_terminal_task(path)
    if kind == "openenv":
        from agentrl.tasks.openenv.load import load_openenv

        return load_openenv(path)
    if kind == "rows" or (kind == "trajectories" and not Path(path).exists()):
        from agentrl.tasks.swe.rows import load_swe_bench  # it says the file is missing

        return load_swe_bench(path)
    if kind == "task":
        from agentrl.tasks.load import load_task

        return load_task(task_file(path))
    if kind == "dataset":
        tasks = dataset_tasks(path)
        raise ConfigError(
            f"{path} is a dataset of {len(tasks)} tasks ({', '.join(t.name for t in tasks[:3])}"
            f"{', ...' if len(tasks) > 3 else ''}), not one task",
            fix=f"name one of its task folders, e.g. {tasks[0]}",
        )
    if kind == "train-config":
        raise ConfigError(f"{path} is a train config, not a task", fix=f"agentrl train {path}")
    raise ConfigError(
        f"{path} holds trajectories, not a task",
        fix="name the task they came from (run.json in their run folder lists it)",
    )


def _is_train_config(path: Path) -> bool:
    """Train configs have a top-level `schedule:`; tasks never do."""
    if not path.is_file() or path.stat().st_size > MAX_BYTES:
        return False  # the task loader says what is wrong with it
    return any(line.startswith(b"schedule:") for line in path.read_bytes().splitlines())


def _top_level_keys(path: Path) -> list[str]:
    """The keys written at the start of a line of `path` (a block mapping's top level)."""
    if path.stat().st_size > MAX_BYTES:
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    return [m.group(1) for line in lines if (m := _TOP_KEY.match(line))]


_TOP_KEY = re.compile(r"""^["']?([A-Za-z_][\w-]*)["']?\s*:(?:\s|$)""")


def _holds_trajectories(path: Path) -> bool:
    """Trajectories carry `trajectory_id`; rows open with a dataset's key. A missing .jsonl
    counts as trajectories (what `agentrl validate` reads a .jsonl as); `load_any` reads
    it as rows, whose reader says it is missing."""
    if not path.is_file():
        return True
    with path.open("rb") as f:
        head = f.read(HEAD_BYTES).decode("utf-8", errors="replace")
    return '"trajectory_id"' in head or not any(key in head for key in ROW_KEYS)
