"""A task author's first day with `agentrl check` and `agentrl replay` (issue 39): a failed
grade reads at 80 columns (short cells, the lines that explain it below the table, the
whole log in a file, a fix that says what to look at); a replay goes on through a
timestamp, always grades again, and its exit status says what differed; `--shell`
without a terminal says so in one line. Real Docker, real graders, the real tokenizer."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl import replay
from agentrl.check import explain
from agentrl.trajectory import Trajectory, TrajectoryStore

ROOT = Path(__file__).parents[1]
WORDFREQ = ROOT / "tasks" / "terminal" / "fix-wordfreq"
NOTES_TASK = Path(__file__).parent / "data" / "replay" / "task.yaml"


def _cli(
    *args: str, timeout: float = 300, stdin: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=stdin,
        env={**os.environ, "COLUMNS": "80"},
    )


# ---------------------------------------------------------------- agentrl check


def test_explain_keeps_pytests_reasons_and_drops_the_rest(tmp_path: Path) -> None:
    (tmp_path / "test_it.py").write_text(
        "def test_ok():\n    assert True\n\n"
        "def test_word():\n    assert 'the 3' == 'cat 3'\n\n"
        "def test_count():\n    assert 2 + 2 == 5\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-n", "0", "test_it.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 1 and len(done.stdout.splitlines()) > 20
    lines = explain(done.stdout)
    assert len(lines) <= 10
    assert any(line.startswith("E ") and "cat 3" in line for line in lines)  # the assertion
    assert sum(line.startswith("FAILED") for line in lines) == 2  # each failed test
    assert "2 failed, 1 passed" in lines[-1]  # pytest's count ends it
    assert not any("platform linux" in line or "PASSED" in line for line in lines)
    # Without a pytest summary: the lines that name an error, and the last ones.
    log = "setting up\n" * 30 + "bash: line 4: pytest: command not found\nstep 9\ndone\n"
    assert explain(log) == ["bash: line 4: pytest: command not found", "step 9", "done"]


def _terminal_copy(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    """fix-wordfreq under another name, with `files` written over its own."""
    folder = tmp_path / name
    shutil.copytree(WORDFREQ, folder)
    for file, text in files.items():
        (folder / file).write_text(text)
    return folder


@pytest.mark.docker
def test_a_failed_grade_reads_at_80_columns_and_its_fix_says_what_to_look_at(
    tmp_path: Path,
) -> None:
    # One task whose tests cannot run (the runner is missing), one whose solution is wrong.
    tests = "for i in $(seq 40); do echo preparing step $i; done\npython3 -m pytest_missing -rA\n"
    no_runner = _terminal_copy(tmp_path, "no-runner", {"run-tests.sh": tests})
    wrong = _terminal_copy(tmp_path, "wrong-solution", {"solution.sh": "true\n"})
    out = tmp_path / "check.json"
    done = _cli("check", str(no_runner), str(wrong), "--json", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # Readable at 80 columns: no line wider (the log paths are whole, for copying), and
    # a handful of lines per failure, not the grader's log squeezed into a table cell.
    wide = [ln for ln in lines if len(ln) > 80 and not ln.startswith("    whole log: ")]
    assert wide == [], done.stdout
    assert len(lines) < 45, done.stdout
    rows = {r["task"]: r for r in json.loads(out.read_text())}
    runner, solution = rows["no-runner"], rows["wrong-solution"]
    assert runner["verdict"] == "oracle: no tests ran"
    assert solution["verdict"] == "oracle earns 0"
    assert "FAIL no-runner: oracle: no tests ran" in done.stdout
    assert "FAIL wrong-solution: oracle earns 0" in done.stdout
    # Below the table, the lines that explain each, and the whole log's path.
    assert any("No module named pytest_missing" in ln for ln in lines)
    assert any(ln.startswith("    | FAILED") for ln in lines)
    for row in (runner, solution):
        assert f"    whole log: {row['oracle']['log']}" in lines
    assert "preparing step 1\n" in Path(runner["oracle"]["log"]).read_text()  # all of it
    assert "FAILED" in Path(solution["oracle"]["log"]).read_text()
    assert sum("preparing step" in ln for ln in lines) <= 2  # the noise stays in the log
    # Each fix says what to look at, never to run the command just run.
    fixes = [ln for ln in lines if ln.strip().startswith("fix:")]
    assert len(fixes) == 2 and not any("agentrl check" in f for f in fixes), fixes
    assert runner["fix"].startswith("the test command did not run")
    assert solution["fix"].startswith("the reference solution does not pass")


# ---------------------------------------------------------------- agentrl replay


@pytest.fixture(scope="module")
def tokenizer():
    from agentrl.inference.embedded import load_tokenizer

    return load_tokenizer()


def _scripted_run(task: Path, commands: list[str], out: Path, tokenizer) -> Trajectory:
    """One episode of `task` whose replies run `commands`, in Docker."""
    from agentrl.inference.scripted import ScriptedSampler
    from agentrl.runner import run_task
    from agentrl.sandbox.docker import DockerProvider
    from agentrl.tasks.formats import load_any

    replies = [f"```bash\n{c}\n```\n" for c in commands]
    sampler = ScriptedSampler(replies, tokenizer)
    asyncio.run(
        run_task(load_any(task), sampler, tokenizer, DockerProvider(), out, show_progress=False)
    )
    (traj,) = TrajectoryStore(out / "trajectories.jsonl")
    return traj


@pytest.fixture(scope="module")
def stamped(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> tuple[Path, Trajectory]:
    """Turn 0 lists the workdir with its files' times; the episode earns 1.0, so its
    snapshots are dropped and a replay runs INIT again: every time listed differs."""
    root = tmp_path_factory.mktemp("stamped")
    task = root / "task.yaml"
    shutil.copy(NOTES_TASK, task)
    commands = ["ls -la --full-time", "touch notes.txt", "ls notes.txt"]
    traj = _scripted_run(task, commands, root / "run", tokenizer)
    assert traj.reward == 1.0 and len(traj.turns) == 3
    return root / "run", traj


@pytest.mark.docker
@pytest.mark.model
def test_a_timestamp_is_reported_and_replay_goes_on_to_the_grade(stamped) -> None:
    out, traj = stamped
    report = asyncio.run(replay.replay(out, traj.trajectory_id, 0))
    assert report.matched and report.divergence is None
    assert report.replayed_turns == [0, 1, 2]
    (note,) = report.volatile
    assert (note.turn, note.volatile) == (0, ["timestamps"]) and note.diff
    assert report.reward_replayed == report.reward_recorded == 1.0
    done = _cli("replay", str(out), traj.trajectory_id)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "turn 0 differs only in timestamps; replayed on" in done.stdout
    assert "matched:" in done.stdout and "re-graded reward 1 (recorded 1)" in done.stdout


@pytest.mark.docker
@pytest.mark.model
def test_a_real_divergence_stops_the_replies_and_is_still_graded(tmp_path: Path, tokenizer) -> None:
    task = tmp_path / "task.yaml"
    shutil.copy(NOTES_TASK, task)
    commands = ["ls -la --full-time", "touch notes.txt", "echo roll $RANDOM$RANDOM"]
    traj = _scripted_run(task, commands, tmp_path / "run", tokenizer)
    report = asyncio.run(replay.replay(tmp_path / "run", traj.trajectory_id, 0))
    assert not report.matched and [d.turn for d in report.volatile] == [0]
    assert report.divergence is not None and report.divergence.turn == 2
    assert report.divergence.volatile == []  # a random number is not a volatile detail
    assert report.reward_replayed == 1.0  # graded after the divergence all the same
    done = _cli("replay", str(tmp_path / "run"), traj.trajectory_id)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "diverged at turn 2 (bash)" in done.stdout
    assert "re-graded reward 1 (recorded 1), in the sandbox as turn 2 left it" in done.stdout


@pytest.mark.docker
@pytest.mark.model
def test_a_reward_that_differs_alone_exits_4(stamped) -> None:
    out, traj = stamped
    task = out.parent / "task.yaml"
    original = task.read_text()
    spec = yaml.safe_load(original)
    spec["grader"]["command"] = "test -f other.txt"  # the grader changed since the run
    task.write_text(yaml.safe_dump(spec))
    try:
        done = _cli("replay", str(out), traj.trajectory_id)
    finally:
        task.write_text(original)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "reward differs: every replayed observation matched" in done.stdout
    assert "re-graded reward 0 (recorded 1)" in done.stdout


@pytest.mark.docker
@pytest.mark.model
def test_shell_without_a_terminal_says_so_in_one_line(stamped) -> None:
    out, traj = stamped
    done = _cli(
        "replay", str(out), traj.trajectory_id, "--from-turn", "1", "--shell",
        stdin=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "the input device is not a TTY" not in done.stderr + done.stdout
    error, fix = done.stderr.strip().splitlines()[-2:]
    assert error.startswith("error: --shell opens an interactive bash")
    assert fix == (
        "fix: run it in a terminal; without one, act on the recorded replies again: "
        f"agentrl replay {out} {traj.trajectory_id} --from-turn 1"
    )
