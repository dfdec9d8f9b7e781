"""A task author's first day with `agentrl run` (issue 39): a run folder is never appended
to by accident (refused, `--overwrite`, `--resume`), a Ctrl-C'd run writes its summary and
says how to continue, progress reaches a log when output is not a terminal, the Docker
quota probe stays out of the output, and the docs say how a scripted policy plays.

Real Docker, the real CLI in a subprocess, the scripted policy for deterministic replies."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from clirun import agentrl
from conftest import sigint_as_a_terminal_sends

from agentrl.trajectory import TrajectoryStore

ROOT = Path(__file__).parent.parent
TASK = ROOT / "tests" / "data" / "agent" / "echo_task.yaml"
ORACLE = ROOT / "tests" / "data" / "agent" / "oracle.yaml"
NOOP = ROOT / "tests" / "data" / "agent" / "noop.yaml"

pytestmark = [pytest.mark.docker, pytest.mark.model]


def ids(out: Path) -> list[str]:
    return [t.trajectory_id for t in TrajectoryStore(out / "trajectories.jsonl")]


def summary(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return data


def test_a_used_folder_is_refused_resumed_or_replaced(tmp_path: Path) -> None:
    """`agentrl run` keeps its folder as `eval` does: a used --out is refused with the
    way on; --resume runs only what is missing (the same run only); --overwrite replaces."""
    out = tmp_path / "run"
    nothing = agentrl("run", TASK, "--policy", f"scripted:{ORACLE}", "--out", out, "--resume")
    assert nothing.returncode == 1
    assert f"error: --resume: {out} holds no run to continue" in nothing.stderr
    first = agentrl("run", TASK, "--policy", f"scripted:{ORACLE}", "--out", out)
    assert first.returncode == 0, first.stderr
    # Output to a pipe: the progress is logged, and the quota probe is not said.
    assert "echo-file: 2 episodes to run" in first.stderr
    assert "echo-file: 2/2 episodes, reward mean 1.00" in first.stderr
    assert "quota" not in first.stdout + first.stderr
    before = (out / "trajectories.jsonl").read_bytes()

    again = agentrl("run", TASK, "--policy", f"scripted:{ORACLE}", "--out", out)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert f"error: {out} already holds a run\n" in again.stderr
    assert "fix: continue it with --resume, replace it with --overwrite, or pick --out DIR" in (
        again.stderr
    )
    assert (out / "trajectories.jsonl").read_bytes() == before

    more = agentrl(
        "run", TASK, "--policy", f"scripted:{ORACLE}", "--out", out, "--resume", "-n", "2"
    )
    assert more.returncode == 0, more.stderr
    assert "2 of 4 episodes already recorded (kept)" in more.stderr
    assert (out / "trajectories.jsonl").read_bytes().startswith(before)
    assert sorted(ids(out)) == ["farewell_0", "farewell_1", "greet_0", "greet_1"]
    assert len((out / "conversations.jsonl").read_text().splitlines()) == 4
    done = summary(out)
    assert done["episodes"] == 4 and done["complete"] is True and done["missing"] == 0

    other = agentrl("run", TASK, "--policy", f"scripted:{NOOP}", "--out", out, "--resume")
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert "holds a run of something else (policy" in other.stderr
    assert len(ids(out)) == 4

    fresh = agentrl("run", TASK, "--policy", f"scripted:{NOOP}", "--out", out, "--overwrite")
    assert fresh.returncode == 0, fresh.stderr
    assert sorted(ids(out)) == ["farewell_0", "greet_0"]
    lines = (out / "conversations.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert summary(out)["episodes"] == 2 and summary(out)["reward_mean"] == 0.0
    grades = sorted(p.name for p in (out / "trajectories.grades").iterdir())
    assert grades == ["farewell_0.json", "greet_0.json"]


def test_ctrl_c_writes_the_summary_and_resume_finishes_the_run(tmp_path: Path) -> None:
    """Progress reaches a pipe while the run goes on; Ctrl-C after the first episode
    leaves a summary of it, marked incomplete, and says how to go on; --resume runs only
    the other one and summarises both."""
    slow = json.dumps(
        "<tool_call>"
        + json.dumps(
            {
                "name": "bash",
                "arguments": {
                    "command": "sleep 3; printf hello > /workspace/greeting.txt; "
                    "printf goodbye > /workspace/bye.txt"
                },
            }
        )
        + "</tool_call>"
    )
    finish = json.dumps(
        '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>'
    )
    script = tmp_path / "slow.json"
    script.write_text(f"[{slow}, {finish}]")
    out = tmp_path / "run"
    command = [sys.executable, "-m", "agentrl.cli", "run", str(TASK), "--out", str(out)]
    command += ["--policy", f"scripted:{script}", "--concurrency", "1"]
    proc = subprocess.Popen(
        sigint_as_a_terminal_sends(command), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env=os.environ,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr or []], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 120
    try:
        while not any("echo-file: 1/2 episodes" in line for line in seen):
            assert time.monotonic() < deadline, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                assert proc.poll() is None, seen
        assert proc.poll() is None  # said while the run goes on, not at its end
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)  # the reader thread drains the rest
    while not lines.empty():
        seen.append(lines.get())
    stopped = summary(out)
    assert stopped["complete"] is False and stopped["missing"] == 1
    assert stopped["episodes"] == 1 and len(ids(out)) == 1
    told = "".join(seen)
    assert f"1 of 2 episodes are recorded in {out}" in told
    assert "the same command with --resume runs the other 1" in told

    resumed = agentrl(*command[3:], "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(ids(out)) == ["farewell_0", "greet_0"]
    done = summary(out)
    assert done["complete"] is True and done["episodes"] == 2 and done["missing"] == 0
    assert done["seconds"] > stopped["seconds"]


def test_the_quota_probe_is_not_said_at_info(run_id: str, caplog: pytest.LogCaptureFixture) -> None:
    """On an engine without a size quota (overlay2 on ext4, as here) every new client
    found that out again and said so at INFO, in every Docker command's output."""
    import asyncio

    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.docker import DockerProvider

    async def start_one() -> None:
        sandbox = await DockerProvider(reap_at_start=False).start(
            SandboxSpec(image="agentrl/base:bookworm", run_id=run_id)
        )
        await sandbox.close()

    with caplog.at_level(logging.INFO, logger="agentrl"):
        asyncio.run(start_one())
        asyncio.run(start_one())  # a second provider: a second client
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [m for m in said if "quota" in m], said


def test_the_docs_say_how_a_scripted_policy_plays(tmp_path: Path) -> None:
    """docs/tasks.md documents the scripted policy as it behaves: one list for every
    episode, each from its first reply (counted per trajectory id), the last repeated."""
    import asyncio

    from agentrl.inference.base import SamplingParams
    from agentrl.inference.embedded import load_tokenizer
    from agentrl.inference.scripted import ScriptedSampler, load_script

    docs = (ROOT / "docs" / "tasks.md").read_text(encoding="utf-8")
    section = docs.split("### Scripted policies", 1)[1].split("\n## ", 1)[0]
    for claim in (
        "One list for every episode",
        "per trajectory id",
        "After the last reply the last one repeats",
        "separated by lines holding only `---`",
        "`--instances ID`",
    ):
        assert claim in section, claim

    script = tmp_path / "script.txt"
    script.write_text("one\n---\ntwo\n")
    tokenizer = load_tokenizer()
    sampler = ScriptedSampler(load_script(script), tokenizer)
    params = SamplingParams(max_tokens=16)

    async def replies(session: str, n: int) -> list[str]:
        got = [await sampler.generate([1], params, session_id=session) for _ in range(n)]
        return [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in got]

    assert asyncio.run(replies("greet_0", 1)) == ["one"]
    assert asyncio.run(replies("farewell_0", 3)) == ["one", "two", "two"]
    assert asyncio.run(replies("greet_0", 1)) == ["two"]
