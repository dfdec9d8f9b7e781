"""Crash recovery at the turn (issue 42): `agentrl run` and `agentrl eval` killed with
SIGKILL at a point of the episode (INIT, a tool call, between turns, EVAL), then started
again over the same folder, go on with each episode in flight from its last snapshot:
the trajectory is token for token the one an uninterrupted run records (ids, masks,
logprobs, versions, turns, reward), apart from `resumed_at`, and no container is left.

The task makes a lost or wrong sandbox state visible: every turn appends a line to a log
and prints how many lines it holds, so an episode that went on in a fresh sandbox, or from
the wrong snapshot, prints other counts. The grader wants exactly one line per turn.

Real Docker, the real CLI in a subprocess killed by a real SIGKILL, the real tokenizer;
the scripted policy replies the same every turn, so its replies do not depend on how many
calls a process made before it was killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clirun import agentrl
from conftest import labelled_containers, labelled_images

from agentrl.run_info import read_run_info
from agentrl.trajectory import Trajectory, TrajectoryStore

pytestmark = [pytest.mark.docker, pytest.mark.model]

ROOT = Path(__file__).parents[1]

TURNS = 5
TASK = f"""\
name: counter
description: Append a line to a log every turn.
sandbox:
  image: agentrl/base:bookworm
  workdir: /workspace
instances:
  - {{id: c0}}
prompt:
  system: You are a careful assistant working in a Linux shell.
  instance: Append a line to /workspace/log every turn.
tools: [bash]
limits: {{max_turns: {TURNS}, max_new_tokens: 96, context_length: 2048, tool_timeout: 20}}
snapshots: {{every: 1, keep_every: 2}}
grader:
  type: command
  command: >-
    sleep "$(cat /workspace/.grade-wait 2>/dev/null || echo 0)";
    test "$(wc -l < /workspace/log)" = {TURNS}
"""
REPLY = (
    '<tool_call>{"name": "bash", "arguments": {"command": '
    '"echo step >> /workspace/log; echo count $(wc -l < /workspace/log); sleep 0.2"}}</tool_call>'
)


def counter_task(tmp_path: Path, *, grade_wait: float = 0) -> tuple[Path, Path]:
    """(the task file, the scripted policy's script)."""
    task = tmp_path / "counter" / "task.yaml"
    task.parent.mkdir(parents=True, exist_ok=True)
    text = TASK
    if grade_wait:  # the grader waits this long, so a kill lands in EVAL
        text = text.replace(
            "  workdir: /workspace\n",
            f"  workdir: /workspace\n  setup: ['echo {grade_wait} > /workspace/.grade-wait']\n",
        )
    task.write_text(text)
    script = tmp_path / "counter" / "policy.json"
    script.write_text(json.dumps([REPLY] * (TURNS + 2)))
    return task, script


def journal_lines(out: Path) -> list[dict[str, Any]]:
    path = out / "inflight.jsonl"
    if not path.is_file():
        return []
    lines = []
    for raw in path.read_bytes().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines


def killed_when(cmd: list[str], ready: Callable[[], bool], timeout: float = 90) -> None:
    """Run `cmd`, SIGKILL its whole process group the moment `ready()` holds."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, "it finished before the kill"
            assert time.monotonic() < deadline, "the kill point never came"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cli(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "agentrl.cli", *map(str, args)]


def only(out: Path) -> Trajectory:
    (traj,) = TrajectoryStore(out / "trajectories.jsonl")
    return traj.check()


def assert_same_episode(resumed: Trajectory, reference: Trajectory) -> None:
    """Token for token the uninterrupted episode, turns and reward included."""
    for name in ("prompt_ids", "response_ids", "loss_mask", "logprobs", "token_versions"):
        assert getattr(resumed, name) == getattr(reference, name), name
    assert resumed.segments == reference.segments
    assert [(t.action, t.observation, t.exit_code, t.span) for t in resumed.turns] == [
        (t.action, t.observation, t.exit_code, t.span) for t in reference.turns
    ]
    assert (resumed.reward, resumed.stop_reason) == (reference.reward, reference.stop_reason)
    assert reference.reward == 1.0 and reference.resumed_at == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Trajectory:
    """The episode run through once, nothing killed."""
    tmp = tmp_path_factory.mktemp("reference")
    task, script = counter_task(tmp)
    done = agentrl("run", task, "--policy", f"scripted:{script}", "--out", tmp / "run")
    assert done.returncode == 0, done.stderr
    traj = only(tmp / "run")
    assert [t.observation.splitlines()[0] for t in traj.turns] == [
        f"count {n}" for n in range(1, TURNS + 1)
    ]
    assert not (tmp / "run" / "inflight.jsonl").exists()  # a finished run keeps no journal
    return traj


def landed(out: Path, n: int) -> Callable[[], bool]:
    return lambda: any(line.get("landed") == n for line in journal_lines(out))


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [3])
def test_a_run_killed_mid_episode_goes_on_from_its_last_snapshot(
    tmp_path: Path, reference: Trajectory, kill_at: int
) -> None:
    """Killed the moment the snapshot after `kill_at` turns lands (the next turn's tool
    call under way), the rerun samples only the turns after it: one resume point, the
    same trajectory, nothing of either process left."""
    task, script = counter_task(tmp_path)
    out = tmp_path / "run"
    killed_when(
        cli("run", task, "--policy", f"scripted:{script}", "--out", out), landed(out, kill_at)
    )
    assert not (out / "trajectories.jsonl").exists() or only_lines(out) == 0
    with (out / "inflight.jsonl").open("a") as f:  # a line a kill tore mid-write
        f.write('{"task": "counter", "t": "c0_0", "landed": 4, "snaps')
    run_id = read_run_info(out).run_id
    # A `gc --snapshots` (another run's, a cron job) before the rerun leaves the killed
    # run's snapshots: its journal offers them a resume (before, they went, and the suite's
    # own gc made a resume begin afresh now and then).
    assert agentrl("gc", "--snapshots").returncode == 0
    again = agentrl("run", task, "--policy", f"scripted:{script}", "--out", out, "--resume")
    assert again.returncode == 0, again.stderr
    traj = only(out)
    assert traj.resumed_at == [kill_at], again.stderr
    assert_same_episode(traj, reference)
    assert read_run_info(out).run_id == run_id  # the same run: its snapshots are its own
    assert not (out / "inflight.jsonl").exists()
    assert labelled_containers(run_id) == []
    # a success's snapshots go at close (keep_successful 0), those made before the kill too
    assert labelled_images(run_id) == []


def only_lines(out: Path) -> int:
    return len((out / "trajectories.jsonl").read_bytes().splitlines())


@pytest.mark.slow
def test_killed_during_init_it_starts_again(tmp_path: Path, reference: Trajectory) -> None:
    """No snapshot landed yet: nothing to go on from, so the episode starts afresh."""
    task, script = counter_task(tmp_path)
    out = tmp_path / "run"
    killed_when(
        cli("run", task, "--policy", f"scripted:{script}", "--out", out),
        lambda: (out / "run.json").is_file(),
    )
    again = agentrl("run", task, "--policy", f"scripted:{script}", "--out", out, "--resume")
    assert again.returncode == 0, again.stderr
    traj = only(out)
    assert traj.resumed_at == []
    assert_same_episode(traj, reference)


@pytest.mark.slow
def test_an_eval_killed_during_eval_is_graded_without_sampling_again(
    tmp_path: Path, reference: Trajectory
) -> None:
    """`agentrl eval` killed while its grader runs: RUN had ended at the last snapshot, so
    the rerun restores it and grades; no turn is sampled again."""
    task, script = counter_task(tmp_path, grade_wait=3)
    out = tmp_path / "eval"
    args = ("eval", task, "--policy", f"scripted:{script}", "-k", "1", "--out", out)

    def grading() -> bool:  # RUN ended and its last snapshot landed: EVAL settled it
        lines = journal_lines(out)
        return any("ended" in x for x in lines) and any(x.get("landed") == TURNS for x in lines)

    killed_when(cli(*args), grading)
    again = agentrl(*args)
    assert again.returncode == 0, again.stderr
    traj = only(out)
    assert traj.resumed_at == [TURNS]
    assert_same_episode(traj, reference)
    assert traj.seconds["run"] < 1.0  # RUN was over: nothing ran again


@pytest.mark.slow
@pytest.mark.parametrize("delay", [1.5, 2.9])  # seconds after the start, spread over INIT and RUN
def test_killed_at_any_moment_it_loses_at_most_the_turn_in_progress(
    tmp_path: Path, reference: Trajectory, delay: float
) -> None:
    """Wherever the kill lands (INIT, a generation, a tool call, a commit in flight), the
    rerun's episode is the uninterrupted one and goes on from the last snapshot that
    landed: every turn whose snapshot landed before the kill is kept."""
    task, script = counter_task(tmp_path)
    out = tmp_path / "run"
    start = time.monotonic()
    killed_when(
        cli("run", task, "--policy", f"scripted:{script}", "--out", out),
        lambda: time.monotonic() - start >= delay,
    )
    kept = max((x["landed"] for x in journal_lines(out) if "landed" in x), default=None)
    started = out.is_dir() and any(out.iterdir())  # killed before it wrote: run it anew
    resume = ["--resume"] if started else []
    again = agentrl("run", task, "--policy", f"scripted:{script}", "--out", out, *resume)
    assert again.returncode == 0, again.stderr
    traj = only(out)
    assert traj.resumed_at == ([] if kept is None else [kept]), again.stderr
    assert_same_episode(traj, reference)
    run_id = read_run_info(out).run_id
    assert labelled_containers(run_id) == []
    # A commit in flight at the kill may have landed in the engine unrecorded: the resumed
    # episode found it by its labels and removed it with the rest (a success keeps none).
    assert labelled_images(run_id) == []


# The trail task (tasks/train/trail): each note names the next key, and its context drops
# the oldest turns, so an episode has several segments. One reply walks it whatever turn
# it is played at (the scripted policy's replies restart after a kill): it reads the key
# from the note the previous turn saved, or creates the file the last note names.
TRAIL_STEP = (
    '```bash\nset -- $(cat /tmp/note 2>/dev/null); if [ "$2" = touch ]; then touch "$3"; '
    "echo made; else clue ${3:-start} > /tmp/next; mv /tmp/next /tmp/note; cat /tmp/note; fi\n```\n"
)


def trail_variant(tmp_path: Path) -> tuple[Path, Path]:
    """The shipped trail task with room for the walking reply and a replay point per turn."""
    folder = tmp_path / "trail"
    shutil.copytree(ROOT / "tasks" / "train" / "trail", folder)
    task = folder / "task.yaml"
    text = task.read_text()
    for old, new in [
        ("  max_turns: 10\n", "  max_turns: 9\n"),
        ("  max_new_tokens: 24\n", "  max_new_tokens: 96\n"),
        ("  context_length: 256\n", "  context_length: 560\n"),
        ("context:\n", "snapshots: {every: 1}\ncontext:\n"),
    ]:
        assert old in text
        text = text.replace(old, new)
    task.write_text(text)
    script = folder / "walk.json"
    script.write_text(json.dumps([TRAIL_STEP] * 12))
    return task, script


@pytest.mark.slow
def test_a_multi_segment_episode_goes_on_token_exactly(tmp_path: Path) -> None:
    """Killed after its oldest turns were dropped (a second segment begun), the trail
    episode goes on from its last snapshot: every segment's prompt and tokens are the
    uninterrupted episode's, and it still walks the whole trail."""
    task, script = trail_variant(tmp_path)
    args = ("--policy", f"scripted:{script}", "--instances", "trail-00")
    done = agentrl("run", task, *args, "--out", tmp_path / "reference")
    assert done.returncode == 0, done.stderr
    reference = only(tmp_path / "reference")
    assert reference.reward == 1.0 and len(reference.segments) >= 2
    assert reference.turns[5].segment >= 1  # the 6 turns kept span two segments
    out = tmp_path / "run"
    killed_when(cli("run", task, *args, "--out", out), landed(out, 6))
    again = agentrl("run", task, *args, "--out", out, "--resume")
    assert again.returncode == 0, again.stderr
    traj = only(out)
    assert traj.resumed_at == [6], again.stderr
    assert_same_episode(traj, reference)


@pytest.mark.slow
def test_a_resume_whose_snapshots_are_gone_starts_the_episode_again(
    tmp_path: Path, reference: Trajectory
) -> None:
    """`agentrl gc` removed the killed run's snapshots before the rerun: the episode in
    flight cannot go on from one, so it starts again (never an infrastructure failure in
    its place) and is the uninterrupted episode, with no resume point."""
    task, script = counter_task(tmp_path)
    out = tmp_path / "run"
    killed_when(cli("run", task, "--policy", f"scripted:{script}", "--out", out), landed(out, 3))
    run_id = read_run_info(out).run_id
    gone = labelled_images(run_id)
    assert gone
    subprocess.run(["docker", "rmi", "-f", *gone], capture_output=True, check=True)
    again = agentrl("run", task, "--policy", f"scripted:{script}", "--out", out, "--resume")
    assert again.returncode == 0, again.stderr
    traj = only(out)
    assert traj.resumed_at == []
    assert "cannot go on from its snapshot" in again.stderr  # offered, and not restorable
    assert_same_episode(traj, reference)
    assert labelled_containers(run_id) == [] and labelled_images(run_id) == []


@pytest.mark.slow
@pytest.mark.parametrize(("label", "resumed_at"), [("turn-002", [2]), ("init", [])])
def test_a_commit_that_landed_unrecorded_at_the_kill_is_removed_by_the_resume(
    tmp_path: Path, reference: Trajectory, label: str, resumed_at: list[int]
) -> None:
    """Killed while a commit had landed in the engine and was not yet journaled (a
    provider of the tests' own stalls it there): the image is the run's but no record
    names it. The episode, gone on from turn 2's state or, when INIT's commit stalled,
    begun again, finds it by its name and removes it; the run leaves no image and no
    container."""
    task, script = counter_task(tmp_path)
    out, mark = tmp_path / "run", tmp_path / "landed"
    stall = {
        "PYTHONPATH": str(ROOT / "tests"),
        "AGENTRL_TEST_STALL_LABEL": label,
        "AGENTRL_TEST_STALL_MARK": str(mark),
    }
    provider = "stalled_commit_provider:StalledCommits"
    args = ("run", task, "--policy", f"scripted:{script}", "--out", out)
    os.environ.update(stall)
    try:
        killed_when(cli(*args, "--provider", provider), mark.is_file)
    finally:
        for name in stall:
            os.environ.pop(name)
    orphan = mark.read_text()
    run_id = read_run_info(out).run_id
    assert orphan in labelled_images(run_id)
    assert not any(x.get("snapshot") == orphan for x in journal_lines(out))  # unrecorded
    again = agentrl(*args, "--resume")
    assert again.returncode == 0, again.stderr
    traj = only(out)
    assert traj.resumed_at == resumed_at  # INIT's commit stalled: nothing to go on from
    assert_same_episode(traj, reference)
    assert labelled_images(run_id) == [] and labelled_containers(run_id) == []
