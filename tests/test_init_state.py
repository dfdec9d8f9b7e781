"""What INIT makes outside the task's outputs (`sandbox.files`, setup commands) is the
task's: the grader sees it as INIT left it, whatever the agent does to it, and an output
file INIT made that the agent deletes is deleted for the grader too (`keep_init`).

A newcomer's task put its expected answer at /opt/app/answer.txt with `sandbox.files` and
its grader compared against it: before, the grading copy started from the bare image, so
even the reference solution earned 0 ("No such file or directory").
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import labelled_images

from agentrl.episode import make_env
from agentrl.sandbox.base import ExecRequest
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.evidence import Grade
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Task

pytestmark = pytest.mark.docker

SOLVE = "cp /opt/app/answer.txt /workspace/out.txt && rm /workspace/init.txt"


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    folder = tmp_path_factory.mktemp("init-state")
    (folder / "answer.txt").write_text("42\n")
    spec = {
        "name": "init-state",
        "instances": [{"id": "one"}],
        "prompt": {"system": "s", "instance": "Copy the answer; remove init.txt."},
        "sandbox": {
            "workdir": "/workspace",
            "files": {"/opt/app/answer.txt": "answer.txt"},
            "setup": ["echo seven > /srv/word.txt", "echo x > /workspace/init.txt"],
        },
        "grader": {
            "type": "command",
            "command": "cmp /opt/app/answer.txt /workspace/out.txt && "
            "test ! -e /workspace/init.txt && grep -qx seven /srv/word.txt",
        },
        "oracle": [SOLVE],
    }
    (folder / "task.yaml").write_text(yaml.safe_dump(spec))
    return load_task(folder / "task.yaml")


async def _play(task: Task, run_id: str, script: str, *, restore: bool = False) -> Grade:
    """INIT, `script` as the agent, EVAL (from a snapshot of the agent's sandbox with
    `restore`); the grade."""
    env = make_env(task, DockerProvider(reap_at_start=False), run_id)
    instance = task.instances[0]
    sandbox = await env.init(instance, "play")
    snapshot = None
    try:
        if script:
            done = await sandbox.exec(ExecRequest(command=script, timeout=60))
            assert done.exit_code == 0, done.output
        if restore:
            snapshot = await sandbox.snapshot("after")
            await sandbox.close()
            sandbox = await env.restore(instance, snapshot, "restored")
        return await env.evaluate(sandbox, instance)
    finally:
        await sandbox.close()
        if snapshot is not None:  # and with it the INIT state it names
            await env.remove_snapshot(snapshot)


def test_the_grader_sees_init_as_it_left_things_and_the_agents_deletions(
    task: Task, run_id: str
) -> None:
    forged = "echo 0 > /opt/app/answer.txt && echo 0 > /workspace/out.txt && rm /workspace/init.txt"
    forged += " && echo seven > /srv/word.txt"

    async def plays() -> list[Grade]:
        return list(
            await asyncio.gather(
                _play(task, run_id, SOLVE),
                _play(task, run_id, ""),
                _play(task, run_id, "cp /opt/app/answer.txt /workspace/out.txt"),
                _play(task, run_id, forged),
                _play(task, run_id, "rm /srv/word.txt && " + SOLVE),
            )
        )

    solved, noop, kept_init_file, forged_answer, broke_outside = asyncio.run(plays())
    assert solved.reward == 1.0, solved.evidence  # INIT's files outside the workdir are there
    assert noop.reward == 0.0
    assert kept_init_file.reward == 0.0  # init.txt is still there: no deletion to carry
    assert forged_answer.reward == 0.0  # graded against INIT's answer, not the agent's
    # What INIT made outside the outputs is not listed as the agent's change left out...
    restored = " ".join(solved.evidence.sealed.restored) if solved.evidence.sealed else ""
    assert "/opt/app/answer.txt" not in restored and "/srv/word.txt" not in restored
    # ...and what the agent changed there is left out, so deleting it changes nothing.
    assert broke_outside.reward == 1.0, broke_outside.evidence
    assert labelled_images(run_id) == []  # each sandbox removed the image of its INIT state


def test_a_restored_snapshot_is_graded_against_the_same_init_state(task: Task, run_id: str) -> None:
    async def both() -> list[Grade]:
        return list(
            await asyncio.gather(
                _play(task, run_id, SOLVE, restore=True), _play(task, run_id, "", restore=True)
            )
        )

    solved, noop = asyncio.run(both())
    assert solved.reward == 1.0, solved.evidence
    assert noop.reward == 0.0
    assert labelled_images(run_id) == []  # the snapshots removed, and their INIT states with them


def test_a_task_whose_init_stays_in_the_outputs_commits_nothing(
    tmp_path: Path, run_id: str
) -> None:
    spec = {
        "name": "workdir-only",
        "instances": [{"id": "one"}],
        "prompt": {"system": "s", "instance": "x"},
        "sandbox": {"workdir": "/workspace", "setup": ["echo x > /workspace/init.txt"]},
        "grader": {"type": "command", "command": "test ! -e /workspace/init.txt"},
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(spec))
    task = load_task(tmp_path / "task.yaml")

    async def main() -> tuple[bool, Grade]:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "plain")
        try:
            kept = getattr(sandbox, "init_state", None) is not None
            await sandbox.exec(ExecRequest(command="rm /workspace/init.txt"))
            return kept, await env.evaluate(sandbox, task.instances[0])
        finally:
            await sandbox.close()

    kept, grade = asyncio.run(main())
    assert not kept
    assert grade.reward == 1.0, grade.evidence


def test_the_init_state_goes_with_the_last_snapshot_that_names_it(task: Task, run_id: str) -> None:
    """A sandbox that took snapshots leaves its INIT state for them at close; removing the
    last of them (a success retention does not keep) removes it too: nothing of the run
    is left on the engine (before, every such episode left its INIT state behind)."""

    async def main() -> None:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "snapshotted")
        try:
            first = await sandbox.snapshot("one")
            second = await sandbox.snapshot("two")
        finally:
            await sandbox.close()
        assert len(labelled_images(run_id)) == 3, "two snapshots and the INIT state they name"
        await env.remove_snapshot(first)
        assert len(labelled_images(run_id)) == 2, "the other snapshot still names the INIT state"
        assert await env.remove_snapshot(second) > 0
        assert labelled_images(run_id) == []

    asyncio.run(main())


def test_an_init_state_committed_as_the_episode_is_cancelled_is_removed(
    task: Task, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while INIT's state is being committed: the engine finishes the commit it
    began, so the sandbox records it and its close removes it (before, the image was left
    on the engine: seen in the dispatcher's cancellation test under load). The engine's
    answer to the commit is held a second so the cancellation lands while it is on its
    way."""
    from docker.api.client import APIClient

    commit = APIClient.commit
    started = threading.Event()

    def slow_commit(self: APIClient, *args: Any, **kwargs: Any) -> Any:
        image = commit(self, *args, **kwargs)
        started.set()
        time.sleep(1.0)  # the answer is on its way
        return image

    monkeypatch.setattr(APIClient, "commit", slow_commit)

    async def main() -> None:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        init = asyncio.ensure_future(env.init(task.instances[0], "cut"))
        assert await asyncio.to_thread(started.wait, 60)
        init.cancel()
        with pytest.raises(asyncio.CancelledError):
            await init

    asyncio.run(main())
    assert labelled_images(run_id) == []


OWNER = """
import asyncio, sys
from agentrl.episode import make_env
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.load import load_task

async def main():
    task = load_task(sys.argv[1])
    env = make_env(task, DockerProvider(reap_at_start=False), sys.argv[2])
    sandbox = await env.init(task.instances[0], sys.argv[3])
    if sys.argv[3] == "snapshotted":
        await sandbox.snapshot("one")
    print("ready", flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_the_init_state_of_a_killed_owner_is_reaped_unless_a_snapshot_names_it(
    task: Task, run_id: str
) -> None:
    """A driver (or a cluster node) SIGKILLed after INIT leaves its sandbox's INIT state on
    the engine: the next provider's reap removes it with the container, since no restart,
    grading copy or replay can use it. Once a snapshot names it, it stays with that
    snapshot (for replay or a resume) until `gc --snapshots` takes both."""
    import signal
    import subprocess
    import sys

    from agentrl.sandbox.docker import gc

    for name in ("bare", "snapshotted"):
        proc = subprocess.Popen(
            [sys.executable, "-c", OWNER, task.path, run_id, name],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert len(labelled_images(run_id)) == 3, "two INIT states and one snapshot"
    DockerProvider()  # the owners are dead: their containers and the unnamed INIT state go
    assert len(labelled_images(run_id)) == 2, "the snapshot and the INIT state it names"
    gc(run_id=run_id, snapshots=True)
    assert labelled_images(run_id) == []
