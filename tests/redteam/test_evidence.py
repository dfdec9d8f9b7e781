"""Every grade says what the agent changed outside its outputs, what was dropped from them
and why; `agentrl failures` shows it (the viewer shows the same evidence file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.docker, pytest.mark.redteam]

HOOK = "import pytest\\n@pytest.hookimpl(tryfirst=True)\\ndef pytest_runtest_call(item): pass\\n"
COMMAND = (
    f"printf '{HOOK}' > /work/conftest.py; echo x > /usr/local/bin/pytest; "
    "mkdir -p /root/.cache && echo y > /root/.cache/z; echo no > /work/answer.txt"
)


def test_agentrl_failures_shows_what_the_grader_left_out_and_dropped(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    test = "def test_answer():\n    assert open('/work/answer.txt').read() == '42\\n'\n"
    (tmp_path / "tests" / "test_answer.py").write_text(test)
    spec = {
        "name": "evidence",
        "instances": [{"id": "one"}],
        "prompt": {"system": "s", "instance": "Write 42 to /work/answer.txt."},
        "sandbox": {"workdir": "/work"},
        "tools": ["bash", "finish"],
        "grader": {
            "type": "pytest",
            "fail_to_pass": ["tests/test_answer.py::test_answer"],
            "pass_to_pass": [],
            "files": {"tests": "tests"},
        },
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(spec))
    call = {"name": "bash", "arguments": {"command": COMMAND}}
    replies = [
        f"<tool_call>{json.dumps(call)}</tool_call>",
        '<tool_call>{"name": "finish"}</tool_call>',
    ]
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(replies))
    agentrl = [sys.executable, "-m", "agentrl.cli"]
    out = tmp_path / "run"
    ran = subprocess.run(
        [
            *agentrl,
            "run",
            str(tmp_path / "task.yaml"),
            "--policy",
            f"scripted:{tmp_path / 'policy.yaml'}",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    record = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    assert record["reward"] == 0.0 and record["stop_reason"] == "finished"
    evidence = json.loads((out / record["grade_file"]).read_text())
    sealed = evidence["sealed"]
    assert "/usr/local/bin/pytest (added)" in sealed["restored"]
    assert any(r.startswith("/root/.cache") for r in sealed["restored"])
    assert any(
        d.startswith("/work/conftest.py: pytest reads conftest.py") for d in sealed["dropped"]
    )
    assert "/work/answer.txt (added)" in sealed["kept"]
    shown = subprocess.run(
        [*agentrl, "failures", str(out)], capture_output=True, text=True, timeout=120, check=False
    )
    assert shown.returncode == 0, shown.stderr
    assert "left out (outside the outputs): " in shown.stdout, shown.stdout
    assert "/usr/local/bin/pytest (added)" in shown.stdout
    assert "dropped from the outputs: /work/conftest.py: pytest reads" in shown.stdout
