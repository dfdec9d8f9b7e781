"""Harbor's verifier as task.toml sets it (issue 43): `[[verifier.collect]]` commands in the
agent's container, the task's `artifacts` (and `/logs/artifacts`), and tests run in a
verifier container of their own (`environment_mode = "separate"`, or a
`[verifier.environment]`) started from its `docker_image`, else `tests/Dockerfile`, else
the task's image, once the agent's container is gone.

No published task graded this way can be built here (datacurve-ai/deep-swe's images are
on public.ecr.aws), so these folders are written the way Harbor's schema 1.4 reads them;
tests/redteam/test_harbor_separate.py runs the red team's hacks against one."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import docker
import pytest
from redteam.hacking import attempt

from agentrl.episode import make_env
from agentrl.errors import ConfigError, GraderError
from agentrl.sandbox.base import ExecRequest
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.evidence import Grade
from agentrl.tasks.formats import load_any
from agentrl.tasks.spec import Task
from agentrl.tasks.terminal.verifier import ARTIFACTS_DIR

# Reward 1 only where the answer came through the artifact, the collect command's copy of
# the agent's state came through /logs/artifacts, and nothing else of the agent's did.
TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
ok=1
[ "$(cat /app/out/answer.txt 2>/dev/null)" = 42 ] || ok=0
[ "$(cat /logs/artifacts/state.txt 2>/dev/null)" = ready ] || ok=0
loose=0; [ -e /app/loose.txt ] && loose=1
baked=0; [ -e /tests/baked ] && baked=1
echo "{\\"reward\\": $ok, \\"loose\\": $loose, \\"baked\\": $baked}" > /logs/verifier/reward.json
"""
SOLVE = "mkdir -p /app/out && echo 42 > /app/out/answer.txt && echo ready > /app/state.txt"
TOML = """version = "1.0"
artifacts = ["/app/out"]
[verifier]
timeout_sec = 60.0
{verifier}
[[verifier.collect]]
command = "cp /app/state.txt {artifacts}/state.txt"
[agent]
timeout_sec = 120.0
"""
SEPARATE = 'environment_mode = "separate"'


def _task(folder: Path, verifier: str = SEPARATE, toml: str = TOML) -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text("FROM agentrl/base:bookworm\nWORKDIR /app\n")
    (folder / "tests").mkdir()
    (folder / "tests" / "test.sh").write_text(TEST_SH)
    (folder / "solution").mkdir()
    (folder / "solution" / "solve.sh").write_text(SOLVE + "\n")
    (folder / "instruction.md").write_text("Write 42 to /app/out/answer.txt.\n")
    (folder / "task.toml").write_text(toml.format(verifier=verifier, artifacts=ARTIFACTS_DIR))
    return folder


def _grades(task: Task, run_id: str, *scripts: str) -> list[Grade]:
    async def go() -> list[Grade | GraderError]:
        return await asyncio.gather(*(attempt(task, run_id, s) for s in scripts))

    done = asyncio.run(go())
    assert all(isinstance(g, Grade) for g in done), done
    return [g for g in done if isinstance(g, Grade)]


# -- reading task.toml ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verifier", "separate", "bundled"),
    [
        ("", False, False),
        ('environment_mode = "shared"', False, False),
        (SEPARATE, True, False),
        ('[verifier.environment]\ndocker_image = "verifier:1"', True, True),
    ],
)
def test_the_mode_is_read_as_harbor_reads_it(
    tmp_path: Path, verifier: str, separate: bool, bundled: bool
) -> None:
    """Shared by default; `separate`, or implied by a verifier environment; a verifier
    image brings its tests (none are copied in); the artifacts are outputs either way."""
    task = load_any(_task(tmp_path / "t", verifier))
    env = make_env(task, DockerProvider(reap_at_start=False), "load-only")
    checks = env.verifier  # type: ignore[attr-defined]
    assert checks.separate is separate and checks.bundled_tests is bundled
    assert checks.artifacts == (ARTIFACTS_DIR, "/app/out")
    assert task.spec.grader.files == ({} if bundled else {"/tests": "tests"})
    assert {ARTIFACTS_DIR, "/app/out"} <= set(task.spec.grader.outputs)
    assert [h.command for h in checks.hooks] == [f"cp /app/state.txt {ARTIFACTS_DIR}/state.txt"]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            '[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 1\n',
            "'shared' with a",
        ),
        ('[verifier]\nenvironment_mode = "elsewhere"\n', "neither shared nor separate"),
        ('[[verifier.collect]]\ncommand = "x"\nservice = "db"\n', "compose services"),
        ('[[verifier.collect]]\ncommand = "x"\nuser = "nobody"\n', "user is not supported"),
        ('artifacts = [{source = "/app", exclude = ["*.log"]}]\n', "exclude patterns"),
        ('artifacts = ["app/out"]\n', "not an absolute path"),
        ('artifacts = ["/app/../etc"]\n', "not an absolute path"),
    ],
)
def test_what_agentrl_cannot_do_as_harbor_does_is_refused(
    tmp_path: Path, extra: str, said: str
) -> None:
    folder = _task(tmp_path / "t")
    (folder / "task.toml").write_text('version = "1.0"\n' + extra)
    with pytest.raises(ConfigError, match=said) as e:
        load_any(folder)
    assert "\n" not in e.value.message and e.value.fix


# -- grading ----------------------------------------------------------------------------------


@pytest.mark.docker
def test_a_separate_verifier_sees_the_artifacts_and_nothing_else_of_the_agents(
    tmp_path: Path, run_id: str
) -> None:
    """From the task's own image: the solution's artifact and the collect command's copy
    reach the tests (1.0); what the agent left outside them does not, nor does a process
    it left writing the reward file; doing nothing is 0."""
    task = load_any(_task(tmp_path / "t"))
    loose = "echo x > /app/loose.txt"
    forger = (
        "nohup bash -c 'while :; do mkdir -p /logs/verifier; "
        "echo 1 > /logs/verifier/reward.txt; sleep 0.05; done' >/dev/null 2>&1 &"
    )
    solved, noop, forged = _grades(task, run_id, f"{SOLVE} && {loose}", "", f"{loose}; {forger}")
    assert solved.reward == 1.0 and solved.components["loose"] == 0, solved.evidence.output
    assert any("verifier container of its own" in n for n in solved.evidence.sealed.notes)
    assert any("verifier.collect" in n and "exited 0" in n for n in solved.evidence.notes)
    assert noop.reward == 0.0 and forged.reward == 0.0
    assert any("exited 1" in n for n in noop.evidence.notes)  # the hook found no state: noted


@pytest.mark.docker
def test_a_verifier_image_from_tests_dockerfile_or_docker_image_brings_its_tests(
    tmp_path: Path, run_id: str
) -> None:
    """`tests/Dockerfile` is built with tests/ as its context; a named `docker_image` is
    used as it is. Either holds its own tests (none copied in): a marker only the image
    has is there, and the solution earns 1.0 in both."""
    dockerfile = "FROM agentrl/base:bookworm\nCOPY . /tests\nRUN touch /tests/baked\nWORKDIR /\n"
    built = _task(tmp_path / "built")
    (built / "tests" / "Dockerfile").write_text(dockerfile)
    (built / "task.toml").write_text(TOML.format(verifier=SEPARATE, artifacts=ARTIFACTS_DIR))
    client = docker.from_env()
    name = f"agentrl-test/verifier-{run_id.lower()[-8:]}:1"
    context = tmp_path / "context"
    shutil.copytree(built / "tests", context)
    client.images.build(path=str(context), tag=name, network_mode="none", rm=True)
    try:
        named = _task(tmp_path / "named", f'[verifier.environment]\ndocker_image = "{name}"')
        for folder in (built, named):
            (graded,) = _grades(load_any(folder), run_id, SOLVE)
            assert graded.reward == 1.0, graded.evidence.output
            assert graded.components["baked"] == 1, folder.name
    finally:
        client.images.remove(name, force=True)
        client.close()


@pytest.mark.docker
def test_a_missing_verifier_image_is_infrastructure_with_its_fix(
    tmp_path: Path, run_id: str
) -> None:
    from agentrl.errors import SandboxError

    task = load_any(
        _task(tmp_path / "t", '[verifier.environment]\ndocker_image = "nowhere/verifier:0"')
    )
    with pytest.raises(SandboxError, match="nowhere/verifier:0 is not on this machine") as e:
        asyncio.run(attempt(task, run_id, SOLVE))
    assert e.value.fix


@pytest.mark.docker
def test_shared_mode_runs_the_collect_commands_before_its_tests(
    tmp_path: Path, run_id: str
) -> None:
    """Harbor runs `[[verifier.collect]]` before the verifier in shared mode too: the
    tests see what the command left in /logs/artifacts (an output, carried to grading)."""
    task = load_any(_task(tmp_path / "t", ""))
    solved, noop = _grades(task, run_id, SOLVE, "")
    assert solved.reward == 1.0, solved.evidence.output
    assert noop.reward == 0.0


def test_what_an_artifact_carries_is_filtered_as_harbors_data_filter_would() -> None:
    """Device nodes and pipes are left out, so is a link out of its artifact; setuid and
    setgid bits are cleared; a link within its artifact and plain files stay."""
    import tarfile

    from agentrl.sandbox.docker.grading import _unsafe
    from agentrl.sandbox.seal import GradeScope

    scope = GradeScope(outputs=("/app/out", ARTIFACTS_DIR), image="verifier:1")

    def member(name: str, kind: bytes, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.linkname, info.mode = kind, link, mode
        return info

    device = member("app/out/null", tarfile.CHRTYPE)
    fifo = member("app/out/pipe", tarfile.FIFOTYPE)
    out = member("app/out/t.py", tarfile.SYMTYPE, "/tests/test_outputs.py")
    up = member("app/out/up", tarfile.SYMTYPE, "../../tests")
    hard = member("app/out/h", tarfile.LNKTYPE, "etc/passwd")
    inside = member("app/out/a", tarfile.SYMTYPE, "answer.txt")
    setuid = member("app/out/sh", tarfile.REGTYPE, mode=0o4755)
    for bad in (device, fifo, out, up, hard):
        assert _unsafe(bad, "/" + bad.name, scope) is not None, bad.name
    assert _unsafe(inside, "/app/out/a", scope) is None
    assert _unsafe(setuid, "/app/out/sh", scope) is None and setuid.mode == 0o755


@pytest.mark.docker
def test_a_restored_sandbox_is_graded_by_a_verifier_from_the_tasks_image(
    tmp_path: Path, run_id: str
) -> None:
    """Replay and resume grade restored sandboxes: the verifier still starts from the
    task's image, never the snapshot's (which holds everything the agent left), so a file
    outside the artifacts stays out."""
    task = load_any(_task(tmp_path / "t"))

    async def go() -> Grade:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        instance = task.instances[0]
        first = await env.init(instance, "first")
        try:
            done = await first.exec(ExecRequest(command=f"{SOLVE} && echo x > /app/loose.txt"))
            assert done.exit_code == 0, done.output
            snapshot = await first.snapshot("solved")
        finally:
            await first.close()
        restored = await env.restore(instance, snapshot, "restored")
        try:
            return await env.evaluate(restored, instance)
        finally:
            await restored.close()
            await env.remove_snapshot(snapshot)

    graded = asyncio.run(go())
    assert graded.reward == 1.0 and graded.components["loose"] == 0, graded.evidence.output
