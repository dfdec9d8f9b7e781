"""One door for every task format: `load_any` reads each format with its own reader, and
says in one line with a fix what it cannot load; `kind_of` tells a train config or
trajectories from a task without reading more than a file's head. No Docker, no model.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from agentrl.cli import main
from agentrl.errors import ConfigError
from agentrl.tasks.formats import kind_of, load_any
from agentrl.textfile import UnreadableFile

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "tasks" / "swe_bench" / "instances.jsonl"
TERMINAL_BENCH = REPO / "tasks" / "terminal" / "fix-wordfreq"
HARBOR = REPO / "tests" / "data" / "terminal" / "uvx-harbor"
YAML_TASK = REPO / "tests" / "data" / "tasks" / "hello.yaml"
TRAIN = REPO / "examples" / "train" / "shell-basics.yaml"
R2E_ROW = {  # R2E-Gym rows have no instance_id: their first key is repo_name
    "repo_name": "calc",
    "docker_image": "agentrl-test/r2e-calc:latest",
    "commit_hash": "1234567890abcdef",
    "problem_statement": "p",
    "expected_output_json": json.dumps({"test_add": "PASSED"}),
}


@pytest.mark.parametrize(
    ("path", "kind", "fmt"),
    [
        (YAML_TASK, "task", "agentrl"),
        (TERMINAL_BENCH, "task-folder", "terminal-bench"),
        (HARBOR, "task-folder", "harbor"),
        (ROWS, "rows", "swe-bench"),
    ],
)
def test_each_format_is_read_by_its_own_reader(path: Path, kind: str, fmt: str) -> None:
    assert kind_of(path) == kind
    task = load_any(path)
    assert task.format == fmt and task.instances


def test_rows_are_told_from_trajectories_by_their_keys(tmp_path: Path) -> None:
    r2e = tmp_path / "r2e.jsonl"
    r2e.write_text(json.dumps(R2E_ROW) + "\n")
    assert kind_of(r2e) == "rows" and load_any(r2e).format == "r2e-gym"
    as_list = tmp_path / "rows.json"
    as_list.write_text(json.dumps([json.loads(line) for line in ROWS.read_text().splitlines()]))
    assert kind_of(as_list) == "rows"
    trajectories = tmp_path / "trajectories.jsonl"
    trajectories.write_text('{"trajectory_id": "t_0", "instance_id": "x"}\n')
    assert kind_of(trajectories) == "trajectories"
    (tmp_path / "empty.jsonl").write_text("")
    assert kind_of(tmp_path / "empty.jsonl") == "trajectories"  # none yet: valid, no rows
    with pytest.raises(ConfigError, match="holds trajectories, not a task") as info:
        load_any(trajectories)
    assert "run.json" in info.value.fix


def test_a_train_config_is_named_not_loaded_as_a_task(tmp_path: Path) -> None:
    assert kind_of(TRAIN) == "train-config"
    with pytest.raises(ConfigError, match="is a train config, not a task") as info:
        load_any(TRAIN)
    assert info.value.fix == f"agentrl train {TRAIN}"


def test_what_is_no_task_is_one_line_and_a_fix(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"notes.txt: neither a task") as info:
        load_any(tmp_path / "notes.txt")
    assert info.value.fix and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="no task.yaml or task.toml in this folder") as info:
        load_any(tmp_path)
    assert "task.toml" in info.value.fix
    os.mkfifo(tmp_path / "rows.jsonl")  # refused before its head is read (it would block)
    with pytest.raises(UnreadableFile, match="is a FIFO"):
        load_any(tmp_path / "rows.jsonl")


def test_validate_reads_every_format_through_the_same_door(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r2e = tmp_path / "r2e.jsonl"
    r2e.write_text(json.dumps(R2E_ROW) + "\n")
    harbor = shutil.copytree(HARBOR, tmp_path / "harbor")
    assert main(["validate", str(r2e), str(harbor), str(ROWS), str(TRAIN)]) == 0
    out = capsys.readouterr().out
    assert f"{r2e}: ok (1 instances, r2e-gym rows)" in out
    assert f"{harbor}: ok (1 instances, harbor task)" in out
    assert f"{ROWS}: ok (3 instances, swe-bench rows)" in out
    assert f"{TRAIN}: ok (train config" in out
