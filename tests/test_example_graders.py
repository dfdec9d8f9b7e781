"""One complete example task per grader type (docs/tasks.md#graders): each passes
`agentrl check` (its reference solution earns 1.0, doing nothing 0.0), and the docs
name every grader type and every key a grader takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from agentrl.tasks.formats import load_any
from agentrl.tasks.load import check_task, load_task
from agentrl.tasks.spec import Grader

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "tasks"
BY_TYPE = {"command": "sum-columns", "pytest": "fix-stats", "python": "primes-script"}
ENVIRONMENT = REPO / "examples" / "openenv" / "countdown_env"
"""The environment grader's example: an OpenEnv folder (its steps' rewards; no oracle)."""
MODELS = get_args(get_args(Grader)[0])  # CommandGrader | PytestGrader | ... | EnvironmentGrader


def test_every_grader_type_has_a_valid_example_with_a_reference_solution() -> None:
    types = {get_args(model.model_fields["type"].annotation)[0] for model in MODELS}
    assert set(BY_TYPE) | {"environment"} == types
    for kind, name in BY_TYPE.items():
        path = EXAMPLES / name / "task.yaml"
        assert check_task(path) == [], name
        task = load_task(path)
        assert task.spec.grader.type == kind and task.spec.oracle, name
    assert load_any(ENVIRONMENT).spec.grader.type == "environment"


def test_the_docs_name_every_grader_key_and_example() -> None:
    text = (REPO / "docs" / "tasks.md").read_text(encoding="utf-8")
    section = text.split("\n## Graders\n", 1)[1].split("\n## ", 1)[0]
    missing = [
        f"{model.__name__}.{key}"
        for model in MODELS
        for key in model.model_fields
        if key != "type" and f"| `{key}` |" not in section
    ]
    assert missing == []
    assert all(f"`examples/tasks/{name}/`" in section for name in BY_TYPE.values())


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.conformance  # CI's conformance stage: `agentrl check` on shipped tasks
def test_every_grader_example_passes_check(tmp_path: Path) -> None:
    paths = [str(EXAMPLES / name / "task.yaml") for name in BY_TYPE.values()]
    out = tmp_path / "check.json"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "check", *paths, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    rows = json.loads(out.read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert {r["task"] for r in rows} == set(BY_TYPE.values())
    assert len(rows) == 6  # two instances each
    assert all(r["ok"] for r in rows)
    assert all(r["oracle"]["reward"] == 1.0 and r["noop"]["reward"] == 0.0 for r in rows)
