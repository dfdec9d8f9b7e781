"""`agentrl eval` as a user runs it: the shipped multi-turn task in real Docker sandboxes,
scripted policies (deterministic, through the real tokenizer and chat template), the CLI
in a subprocess. Resume after SIGKILL, more attempts, a comparison with a known
difference, and an evaluation that only ever failed for infrastructure reasons."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from clirun import agentrl

pytestmark = [pytest.mark.docker, pytest.mark.e2e]

TASK = Path(__file__).parent.parent / "tasks" / "train" / "look-then-act" / "task.yaml"
BROKEN = Path(__file__).parent / "data" / "broken-grader"  # every episode an eval_error
SIX = "note-00,note-01,note-02,note-03,note-04,note-05"  # .md names: note-01, -02, -04


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


# Reads the note and does what it says, in one turn.
ORACLE = bash("touch \"$(awk '{print $NF}' note.txt)\"")
# The same, only where the name ends in .md (3 of the six instances).
MD_ONLY = bash("grep -q 'md$' note.txt && touch \"$(awk '{print $NF}' note.txt)\"")
BLIND = bash("touch note.md")


def script(tmp_path: Path, name: str, reply: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump([reply]))
    return f"scripted:{path}"


def attempts(out: Path) -> list[tuple[str, str]]:
    """(instance, trajectory id) of every line of the evaluation's trajectories.jsonl."""
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    return [(r["group_id"], r["trajectory_id"]) for r in map(json.loads, lines)]


@pytest.mark.slow
def test_resume_after_sigkill_records_every_attempt_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    policy = script(tmp_path, "oracle", ORACLE)
    common = ["--instances", SIX, "--policy", policy, "--out", str(out), "--max-turns", "1"]
    command = [sys.executable, "-m", "agentrl.cli", "eval", str(TASK), "-k", "3", *common]
    proc = subprocess.Popen(
        [*command, "--concurrency", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    trajs = out / "trajectories.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if trajs.is_file() and len(trajs.read_bytes().splitlines()) >= 4:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the evaluation ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    before = attempts(out)
    assert 4 <= len(before) < 18
    with trajs.open("ab") as f:  # as a kill in the middle of an append leaves it
        f.write(b'{"schema_version": 1, "trajectory_id": "note-0')
    gc = agentrl("gc")  # what the killed run left behind: its sandboxes
    assert gc.returncode == 0, gc.stdout + gc.stderr

    done = agentrl("eval", str(TASK), "-k", "3", *common)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(before)} of 18 attempts already recorded" in done.stdout
    after = attempts(out)
    expected = {(f"note-0{i}", f"note-0{i}_{a}") for i in range(6) for a in range(3)}
    assert Counter(after) == Counter(expected)  # every attempt, each exactly once
    assert after[: len(before)] == before  # the recorded ones were kept, not re-run
    results = json.loads((out / "results.json").read_text())
    overall = results["scores"]["overall"]
    assert overall["attempts"] == 18 and overall["pass_at_1"] == 1.0
    assert overall["pass_at_k"] == {"1": 1.0, "2": 1.0, "3": 1.0}

    more = agentrl("eval", str(TASK), "-k", "4", *common)  # a 4th attempt: only those run
    assert more.returncode == 0, more.stdout + more.stderr
    assert "18 of 24 attempts already recorded" in more.stdout
    grown = attempts(out)
    assert grown[:18] == after and len(set(grown)) == 24
    assert {t for _, t in grown[18:]} == {f"note-0{i}_3" for i in range(6)}
    assert json.loads((out / "results.json").read_text())["scores"]["overall"]["attempts"] == 24

    again = agentrl("eval", str(TASK), "-k", "4", *common)  # nothing left: no sampler, no run
    assert again.returncode == 0 and "24 of 24 attempts already recorded" in again.stdout
    assert attempts(out) == grown

    other = agentrl("eval", str(TASK), "-k", "4", *common[:-1], "2")  # other limits: refused
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert "holds an evaluation of something else (limits" in other.stderr
    assert "fix: pick another --out, or add --overwrite" in other.stderr
    assert attempts(out) == grown


@pytest.mark.slow
def test_compare_two_recorded_evaluations_with_a_known_difference(tmp_path: Path) -> None:
    runs = {}
    for name, reply in (("blind", BLIND), ("md-only", MD_ONLY)):
        runs[name] = tmp_path / name
        done = agentrl(
            "eval", str(TASK), "--instances", SIX, "--max-turns", "1", "--max-new-tokens", "64",
            "--policy", script(tmp_path, name, reply), "--out", str(runs[name]),
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    md = json.loads((runs["md-only"] / "results.json").read_text())["scores"]
    assert [i["solved"] for i in md["instances"]] == [0, 1, 1, 0, 1, 0]
    assert md["overall"]["pass_at_1"] == 0.5
    report = tmp_path / "comparison.json"
    shown = agentrl(
        "eval", "--compare", str(runs["blind"]), str(runs["md-only"]), "--json", str(report)
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    c = json.loads(report.read_text())
    assert c["instances"] == 6 and (c["pass_at_1_a"], c["pass_at_1_b"]) == (0.0, 0.5)
    assert c["difference"] == 0.5 and 0.0 < c["ci95"][0] < 0.5 < c["ci95"][1] <= 1.0
    assert [g["instance"] for g in c["gained"]] == ["note-01", "note-02", "note-04"]
    assert c["lost"] == []
    assert "+50.0" in shown.stdout and "significant" in shown.stdout
    assert "better in B: 3: note-01 0.00->1.00" in shown.stdout


def test_an_evaluation_of_infrastructure_failures_only_fails_and_says_why(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    command = [
        "eval", str(BROKEN / "task.yaml"), "-k", "2", "--out", str(out),
        "--policy", f"scripted:{BROKEN / 'finish.yaml'}",
    ]  # fmt: skip
    done = agentrl(*command)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert "no attempt was graded: all 4 failed for infrastructure reasons" in done.stderr
    assert "the grader command did not run (exit 127)" in done.stderr
    assert "fix:" in done.stderr
    overall = json.loads((out / "results.json").read_text())["scores"]["overall"]
    assert overall["infra_failures"] == 4 and overall["pass_at_1"] is None
    assert overall["stop_reasons"] == {"eval_error": 4}
    failures = agentrl("failures", str(out))  # an evaluation folder reads as a run folder
    assert "agentrl replay" in failures.stdout and "eval_error" in failures.stdout

    kept = agentrl(*command)  # recorded infrastructure failures are attempts: kept
    assert kept.returncode == 1 and "4 of 4 attempts already recorded" in kept.stdout
    retried = agentrl(*command, "--retry-infra")  # run again, in their place
    assert retried.returncode == 1 and "already recorded" not in retried.stdout
    assert sorted(t for _, t in attempts(out)) == ["a_0", "a_1", "b_0", "b_1"]
    fresh = agentrl(*command[:2], "-k", "1", *command[4:], "--overwrite")  # started again
    assert fresh.returncode == 1 and "already recorded" not in fresh.stdout
    assert sorted(t for _, t in attempts(out)) == ["a_0", "b_0"]
    assert sorted(p.name for p in (out / "trajectories.grades").iterdir()) == [
        "a_0.json",
        "b_0.json",
    ]


def test_bad_input_is_one_line_and_a_fix(tmp_path: Path) -> None:
    cases = [
        (["eval"], "no tasks given"),
        (["eval", str(TASK), "--instances", "nope"], "no instance nope in the tasks given"),
        (["eval", str(TASK), "--compare", "a", "b"], "--compare takes two evaluation folders"),
        (["eval", "--compare", str(tmp_path / "x"), str(tmp_path)], "no such folder or file"),
        (["eval", str(TASK), str(TASK)], "two tasks are named look-then-act"),
        (["eval", str(TASK), "--model", str(tmp_path / "nope")], "no such folder"),
    ]
    for args, message in cases:
        done = agentrl(*args, "--out", str(tmp_path / "never"))
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert message in done.stderr and "fix:" in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "never").exists()
