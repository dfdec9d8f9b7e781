"""`agentrl check`: a shipped task's reference solution earns 1.0 and doing nothing less,
through the sandbox and grader training uses; and a grader that cannot tell them apart,
or a task without a solution, fails the check.

The check runs one shipped task of each format (Terminal-Bench, Harbor, a SWE-bench row)
and the whole shell-basics training task. Every other shipped folder and row is played
oracle and no-op through the same environment, with more of the evidence asserted, by
test_terminal_tasks.py and test_swe_bench.py: grading them twice here proved nothing new.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from clirun import agentrl

REPO = Path(__file__).resolve().parents[1]
TERMINAL = REPO / "tasks" / "terminal"
SWE_ROWS = REPO / "tasks" / "swe_bench" / "instances.jsonl"
SHELL_BASICS = REPO / "tasks" / "train" / "shell-basics" / "task.yaml"


def _check(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return agentrl("check", *args, timeout=timeout, cwd=REPO)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.conformance  # CI's conformance stage: `agentrl check` on shipped tasks
def test_one_shipped_task_of_each_format_passes_check(tmp_path: Path) -> None:
    swe = tmp_path / "swe.jsonl"  # one shipped row: the same instance, the same image
    swe.write_text(SWE_ROWS.read_text().splitlines(keepends=True)[0])
    tasks = [TERMINAL / "access-log-report", TERMINAL / "cron-next-runs", swe, SHELL_BASICS]
    # shell-basics: one instance of each of its three kinds (file, dir, gone), not all 72
    ids = "access-log-report,cron-next-runs,jpvanhal__inflection-6,touch-00,mkdir-00,rm-00"
    done = _check(*map(str, tasks), "--instances", ids, "--json", str(tmp_path / "check.json"))
    rows = json.loads((tmp_path / "check.json").read_text())
    failed = [r for r in rows if not r["ok"]]
    assert done.returncode == 0 and not failed, done.stdout[-3000:] + done.stderr[-2000:]
    formats = {r["format"] for r in rows}
    assert formats == {"terminal-bench", "harbor", "swe-bench", "agentrl"}
    assert len(rows) == 1 + 1 + 1 + 3
    assert all(r["oracle"]["reward"] == 1.0 and r["noop"]["reward"] == 0.0 for r in rows)
    assert f"{len(rows)} of {len(rows)} instances pass" in done.stdout


@pytest.mark.docker
def test_a_check_that_cannot_tell_solution_from_nothing_fails(tmp_path: Path) -> None:
    task = {
        "name": "lenient",
        "instances": [{"id": "a", "word": "hi"}, {"id": "b", "word": "yo"}],
        "prompt": {"system": "s", "instance": "write {word}"},
        "grader": {"type": "command", "command": "true"},  # passes whatever the agent did
        "oracle": ["echo {word} > /workspace/out.txt"],
    }
    (tmp_path / "lenient.yaml").write_text(yaml.safe_dump(task))
    no_solution = {**task, "name": "unsolved", "grader": {"type": "command", "command": "false"}}
    del no_solution["oracle"]
    (tmp_path / "unsolved.yaml").write_text(yaml.safe_dump(no_solution))
    out = tmp_path / "check.json"
    done = _check(
        str(tmp_path / "lenient.yaml"),
        str(tmp_path / "unsolved.yaml"),
        "--instances",
        "a",
        "--json",
        str(out),
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {r["task"]: r for r in json.loads(out.read_text())}
    assert [r["instance"] for r in rows.values()] == ["a", "a"]  # --instances kept only a
    lenient, unsolved = rows["lenient"], rows["unsolved"]
    assert lenient["oracle"]["reward"] == 1.0 and lenient["noop"]["reward"] == 1.0
    assert not lenient["ok"]  # the no-op earned full reward: this grader rewards nothing
    assert unsolved["oracle"]["error"].startswith("reference solution: ")
    assert "oracle:" in unsolved["oracle"]["fix"]
    assert "0 of 2 instances pass" in done.stdout
