"""Rewards an agent cannot fake, and infrastructure failures that are never rewards.

Every attack here is what a no-op agent does during RUN (commands in its sandbox, as its
bash tool would run them) to earn reward without solving anything. Each is first shown
to work against grading *without* EVAL's sealing (so the test proves the defence, not a
harmless attack), then shown to score 0 through `env.evaluate`, the path training uses.

The Terminal-Bench task is the shipped `fix-wordfreq` (tests run with `python3 -m
pytest /tests/test_outputs.py` in the agent's own container); the SWE-bench instance is
the shipped `more-itertools` row (its grade comes from a fresh container and the patch).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import yaml

from agentrl.episode import make_env
from agentrl.errors import GraderError
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.sandbox.docker import DockerProvider
from agentrl.sandbox.images import docker_client
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.evidence import DidNotRun, Grade
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Instance, Task
from agentrl.tasks.swe import BASE_TAG
from agentrl.tasks.swe.images import prepare_image
from agentrl.tasks.swe.rows import load_swe_bench
from agentrl.tasks.terminal.load import load_terminal_task

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[1]
WORDFREQ = load_terminal_task(REPO / "tasks" / "terminal" / "fix-wordfreq")
SWE = load_swe_bench(REPO / "tasks" / "swe_bench" / "instances.jsonl")
ITERTOOLS = next(i for i in SWE.instances if i.id.startswith("more-itertools"))

FAKE_SUMMARY = (
    "=== short test summary info ===\\n"
    "PASSED /tests/test_outputs.py::test_sample_from_the_instructions\\n"
    "=== 1 passed in 0.01s ==="
)
PASSING_TESTS = "def test_sample_from_the_instructions():\n    pass\n"

Attack = Callable[[Sandbox], Awaitable[None]]


async def _sh(sandbox: Sandbox, command: str) -> None:
    done = await sandbox.exec(ExecRequest(command=command, timeout=60))
    assert done.exit_code == 0, done.output


async def setsid_rewriter(sandbox: Sandbox) -> None:
    """A loop in its own session that keeps rewriting the tests once they are copied in."""
    await sandbox.write_file("/tmp/fake_tests.py", PASSING_TESTS.encode())
    # Atomically (a rename), so pytest never reads a half-copied file: under load that
    # made the unsealed demonstration flaky ("collected 0 items").
    copy = "[ -d /tests ] && cp /tmp/fake_tests.py /tests/.t"
    copy += " && mv -f /tests/.t /tests/test_outputs.py"
    loop = f"while :; do {copy}; sleep 0.01; done"
    await _sh(sandbox, f"setsid sh -c '{loop}' >/dev/null 2>&1 < /dev/null &")


async def delayed_writer(sandbox: Sandbox) -> None:
    """A double-forked, disowned daemon that sleeps, then waits for the tests and swaps
    them (what a cron or at job would do, without cron)."""
    await sandbox.write_file("/tmp/fake_tests.py", PASSING_TESTS.encode())
    job = (
        "sleep 1; while [ ! -f /tests/test_outputs.py ]; do sleep 0.01; done; "
        "sleep 0.05; cp /tmp/fake_tests.py /tests/test_outputs.py"
    )
    await _sh(sandbox, f"( nohup sh -c '{job}' >/dev/null 2>&1 < /dev/null & ) ; disown -a || true")


async def root_conftest(sandbox: Sandbox) -> None:
    """pytest.ini and conftest.py at /, which a run of /tests/test_outputs.py would load."""
    hook = textwrap.dedent(
        """
        import pytest

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(item, call):
            outcome = yield
            report = outcome.get_result()
            report.outcome = "passed"
        """
    )
    await sandbox.write_file("/conftest.py", hook.encode())
    await sandbox.write_file("/pytest.ini", b"[pytest]\n")


async def sitecustomize(sandbox: Sandbox) -> None:
    """Python's startup hook (Debian's own, which the stdlib path finds first) rewritten to
    answer for pytest."""
    hook = (
        "import os, sys\n"
        "if '/tests/' in ' '.join(sys.argv):\n"
        f"    print('{FAKE_SUMMARY}', flush=True)\n"
        "    os._exit(0)\n"
    )
    await sandbox.write_file("/etc/python3.11/sitecustomize.py", hook.encode())


async def fake_python(sandbox: Sandbox) -> None:
    """A python3 earlier on PATH than the real one, that only prints a passing summary."""
    script = f"#!/bin/sh\nprintf '{FAKE_SUMMARY}\\n'\n"
    await sandbox.write_file("/usr/local/bin/python3", script.encode(), mode=0o755)


async def replaced_python(sandbox: Sandbox) -> None:
    """The image's own python3 replaced by the same fake."""
    script = f"#!/bin/sh\nprintf '{FAKE_SUMMARY}\\n'\n"
    await _sh(sandbox, "rm /usr/bin/python3")
    await sandbox.write_file("/usr/bin/python3", script.encode(), mode=0o755)


async def edited_tests(sandbox: Sandbox) -> None:
    """Tests planted where the grader will put its own."""
    await sandbox.write_file("/tests/test_outputs.py", PASSING_TESTS.encode())


ATTACKS = {
    "setsid rewriter": setsid_rewriter,
    "delayed writer": delayed_writer,
    "conftest.py and pytest.ini at /": root_conftest,
    "sitecustomize": sitecustomize,
    "python3 earlier on PATH": fake_python,
    "python3 replaced": replaced_python,
    "tests planted": edited_tests,
}
WORKS_UNSEALED = set(ATTACKS) - {"tests planted"}  # EVAL replaces /tests with or without seal


async def _graded(env: TaskEnv, instance: Instance, attack: Attack, *, sealed: bool) -> Grade:
    sandbox = await env.init(instance, "attack")
    try:
        await attack(sandbox)
        await asyncio.sleep(1.5)  # the delayed writer's first sleep is over
        if sealed:
            return await env.evaluate(sandbox, instance)
        return await env.grade(sandbox, instance)  # what EVAL did before sealing existed
    finally:
        await sandbox.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_no_op_agent_cannot_fake_terminal_bench_tests(name: str, run_id: str) -> None:
    attack = ATTACKS[name]
    instance = WORDFREQ.instances[0]

    async def go() -> tuple[Grade | None, Grade]:
        env = make_env(WORDFREQ, DockerProvider(reap_at_start=False), run_id)
        unsealed = (
            await _graded(env, instance, attack, sealed=False) if name in WORKS_UNSEALED else None
        )
        return unsealed, await _graded(env, instance, attack, sealed=True)

    unsealed, sealed = asyncio.run(go())
    if unsealed is not None:
        assert unsealed.reward == 1.0, f"the attack does not even work: {unsealed.evidence.output}"
    assert sealed.reward == 0.0, sealed.evidence.output
    assert sealed.evidence.tests  # the real tests ran, and failed
    assert sealed.evidence.sealed is not None
    if name in ("setsid rewriter", "delayed writer"):  # left in the agent's own container
        assert any("sh -c" in note for note in sealed.evidence.sealed.notes)
    if name in ("conftest.py and pytest.ini at /", "sitecustomize", "python3 replaced"):
        assert sealed.evidence.sealed.restored, "the agent's changes were left out"


@pytest.mark.slow
def test_a_no_op_agent_cannot_fake_swe_bench_tests(run_id: str) -> None:
    """Everything at once in the agent's sandbox: none of it crosses into the grade but
    the patch, and the patch's test-file changes are dropped."""
    f2p_file = json.loads(ITERTOOLS.fields["FAIL_TO_PASS"])[0].split("::")[0]

    async def attack(sandbox: Sandbox) -> None:
        await setsid_rewriter(sandbox)
        await sitecustomize(sandbox)
        await replaced_python(sandbox)
        hook = "import pytest\n\n@pytest.hookimpl(tryfirst=True)\n"
        hook += "def pytest_runtest_call(item):\n    pass\n"
        await sandbox.write_file("/testbed/conftest.py", hook.encode())
        await sandbox.write_file(f"/testbed/{f2p_file}", b"def test_nothing():\n    pass\n")

    async def go() -> Grade:
        env = make_env(SWE, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(ITERTOOLS, "attack")
        try:
            await attack(sandbox)
            return await env.evaluate(sandbox, ITERTOOLS)
        finally:
            await sandbox.close()

    graded = asyncio.run(go())
    assert graded.reward == 0.0, graded.evidence.output
    assert set(graded.evidence.tampered) == {"conftest.py", f2p_file}
    assert graded.components["tampered_tests"] == 2
    f2p = json.loads(ITERTOOLS.fields["FAIL_TO_PASS"])
    assert {graded.evidence.tests[t] for t in f2p} == {"FAILED"}


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b", "GIT_COMMITTER_NAME": "a"}
    env |= {"GIT_COMMITTER_EMAIL": "a@b", "PATH": "/usr/bin:/bin", "HOME": str(repo)}
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True
    )
    return done.stdout.strip()


@pytest.mark.slow
def test_the_fix_cannot_be_read_from_git_history(tmp_path: Path) -> None:
    """An instance image whose /testbed still holds the future (the fix commit on its
    branch, a later release tag, a remote-tracking branch, a stash, reflog entries):
    the image the agent starts from holds nothing after the base commit."""
    repo = tmp_path / "testbed"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    (repo / "lib.py").write_text("def f():\n    return 1  # bug\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "old", "--date=2001-01-01T00:00:00")
    _git(repo, "tag", "v0.1")
    (repo / "lib.py").write_text("def f():\n    return 2  # bug\n")
    _git(repo, "commit", "-qam", "base")
    base = _git(repo, "rev-parse", "HEAD")
    (repo / "lib.py").write_text("def f():\n    return 42  # THE FIX\n")
    _git(repo, "commit", "-qam", "the fix")
    fix = _git(repo, "rev-parse", "HEAD")
    fix_blob = _git(repo, "rev-parse", "HEAD:lib.py")
    _git(repo, "tag", "v1.0")
    _git(repo, "update-ref", "refs/remotes/origin/main", fix)
    _git(repo, "reset", "-q", "--hard", base)
    (repo / "lib.py").write_text("stashed\n")
    _git(repo, "stash", "-q")
    (tmp_path / "Dockerfile").write_text(
        "FROM agentrl/base:bookworm\nCOPY testbed /testbed\nWORKDIR /testbed\n"
    )
    tag = f"agentrl-test/leaky:{tmp_path.name[-8:].lower()}"
    client = docker_client()
    try:
        client.images.build(path=str(tmp_path), tag=tag, rm=True, network_mode="none")
        row = {"instance_id": "leaky__leaky-1", "repo": "leaky/leaky", "base_commit": base}
        prepared = prepare_image(tag, Instance(id="leaky__leaky-1", fields=row), "swe-bench")
        script = (
            "cd /testbed; git log --all --format=%H; echo ---; git tag; echo ---;"
            " git stash list; git reflog | wc -l; git branch -a;"
            f" git cat-file -e {fix} && echo FIX-COMMIT;"
            f" git cat-file -e {fix_blob} && echo FIX-BLOB;"
            " git rev-parse HEAD; git status --porcelain"
        )
        out = client.containers.run(
            prepared, ["bash", "-c", script], remove=True, network_disabled=True
        )
    finally:
        for image in (locals().get("prepared"), tag):
            if image:
                client.images.remove(image, force=True)
        client.close()
    text = out.decode()
    commits, tags, rest = text.split("---\n")
    assert commits.split() == [base, _git(repo, "rev-parse", "HEAD~1")]
    assert sorted(tags.split()) == sorted([BASE_TAG, "v0.1"])  # the old tag stays; v1.0 is gone
    assert "FIX" not in rest and "origin" not in rest and "stash" not in rest
    assert rest.split()[-1] == base  # HEAD: where the agent starts, clean
    assert rest.split()[0] == "0"  # no reflog


# ---------------------------------------------------------------- infrastructure vs agent


def _yaml_task(folder: Path, grader: dict[str, object]) -> Task:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "name": "t",
        "instances": [{"id": "one"}],
        "prompt": {"system": "s", "instance": "i"},
        "grader": grader,
        "sandbox": {"workdir": "/work"},
    }
    (folder / "task.yaml").write_text(yaml.safe_dump(spec))
    return load_task(folder / "task.yaml")


def test_a_grader_that_cannot_run_its_tests_is_never_a_reward(tmp_path: Path, run_id: str) -> None:
    """A missing test runner (127) is an eval_error: the untouched sandbox cannot run it
    either. The agent deleting pytest stops nothing: the grader runs the image's."""
    missing = _yaml_task(tmp_path / "missing", {"type": "command", "command": "no-such-runner"})
    (tmp_path / "runs" / "tests").mkdir(parents=True)
    test = "def test_x():\n    assert open('/work/done').read() == 'yes'\n"
    (tmp_path / "runs" / "tests" / "test_x.py").write_text(test)
    grader = {"type": "pytest", "fail_to_pass": ["tests/test_x.py::test_x"], "pass_to_pass": []}
    runs = _yaml_task(tmp_path / "runs", {**grader, "files": {"tests": "tests"}})

    async def go() -> tuple[BaseException, Grade, Grade]:
        provider = DockerProvider(reap_at_start=False)
        env = make_env(missing, provider, run_id)
        sandbox = await env.init(missing.instances[0], "missing")
        try:
            with pytest.raises(GraderError) as caught:
                await env.evaluate(sandbox, missing.instances[0])
        finally:
            await sandbox.close()
        env = make_env(runs, provider, run_id)
        broke = await env.init(runs.instances[0], "broke")
        honest = await env.init(runs.instances[0], "honest")
        try:
            await _sh(broke, "rm -rf /usr/lib/python3/dist-packages/_pytest")
            await _sh(honest, "printf yes > /work/done")
            return (
                caught.value,
                await env.evaluate(broke, runs.instances[0]),
                await env.evaluate(honest, runs.instances[0]),
            )
        finally:
            await broke.close()
            await honest.close()

    error, broke, honest = asyncio.run(go())
    assert isinstance(error, DidNotRun)
    assert "exit 127" in str(error) and "in an untouched sandbox too" in str(error)
    assert error.evidence.reference and error.evidence.exit_code == 127
    # pytest, deleted by the agent outside its outputs, is graded as the image has it.
    assert broke.reward == 0.0 and broke.evidence.tests == {"tests/test_x.py::test_x": "FAILED"}
    assert broke.evidence.sealed is not None
    assert "/usr/lib/python3/dist-packages/_pytest (deleted)" in broke.evidence.sealed.restored
    assert honest.reward == 1.0, honest.evidence.output


def test_agentrl_run_reports_infrastructure_failures_apart_and_fails(tmp_path: Path) -> None:
    """Every episode an eval_error: the reward is no mean of zeros, the first error and its
    fix are printed, the exit code is 1, and each episode's evidence is in the run folder."""
    broken = Path(__file__).parent / "data" / "broken-grader"  # its grader cannot run
    out = tmp_path / "run"
    policy = f"scripted:{broken / 'finish.yaml'}"
    command = ["run", str(broken / "task.yaml"), "--policy", policy, "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *command], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "infrastructure failures: 2 of 2 episodes" in done.stderr
    assert "first: the grader command did not run (exit 127)" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_mean"] is None and summary["infra_failures"] == 2
    lines = (out / "trajectories.jsonl").read_text().splitlines()
    for traj in map(json.loads, lines):
        assert traj["stop_reason"] == "eval_error" and traj["reward"] is None
        evidence = json.loads((out / traj["grade_file"]).read_text())
        assert evidence["command"] == "no-such-test-runner --all" and evidence["exit_code"] == 127
        assert "untouched sandbox" in evidence["reference"]
    shown = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "failures", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "grader command: no-such-test-runner --all -> exit 127" in shown.stdout, shown.stdout
    assert "evidence:" in shown.stdout


def test_grading_may_have_a_network_the_agent_never_had(
    tmp_path: Path, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$AGENTRL_EVAL_NETWORK names a Docker network (an internal one here: nothing leaves
    the machine); a grader that allows it has it at EVAL, after the agent's processes
    are stopped; the agent's turns, and a grader that does not allow it, have none."""
    online = "import socket, sys; sys.exit(0 if len(socket.if_nameindex()) > 1 else 1)"
    grader = {"type": "command", "command": f'python3 -c "{online}"'}
    allowed = _yaml_task(tmp_path / "allowed", {**grader, "network": True})
    denied = _yaml_task(tmp_path / "denied", grader)
    client = docker_client()
    network = client.networks.create(f"agentrl-test-{run_id[-8:]}", internal=True)
    monkeypatch.setenv("AGENTRL_EVAL_NETWORK", network.name)

    async def go(task: Task) -> tuple[str, Grade]:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "net")
        try:
            during = await sandbox.exec(ExecRequest(command=["python3", "-c", online]))
            return str(during.exit_code), await env.evaluate(sandbox, task.instances[0])
        finally:
            await sandbox.close()

    try:
        (run_allowed, graded_allowed), (run_denied, graded_denied) = (
            asyncio.run(go(allowed)),
            asyncio.run(go(denied)),
        )
    finally:
        network.remove()
        client.close()
    assert run_allowed == run_denied == "1"  # no network while the agent acts
    assert graded_allowed.reward == 1.0 and graded_denied.reward == 0.0
    assert graded_allowed.evidence.notes[0].startswith(f"grading had the network {network.name}")
    assert graded_denied.evidence.notes == []


def test_a_task_that_needs_a_network_gets_the_one_the_user_names(
    tmp_path: Path, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sandbox.network: true` (Harbor: `allow_internet = true`) asks for a network for the
    agent's turns: it gets the Docker network $AGENTRL_AGENT_NETWORK names (an internal one
    here), from INIT on; without one it has none and `agentrl check` says how to give it
    one. A task that does not ask never gets one."""
    from agentrl.check import check_task

    online = "import socket, sys; sys.exit(0 if len(socket.if_nameindex()) > 1 else 1)"
    grader = {"type": "command", "command": "true"}
    asks = _yaml_task(tmp_path / "asks", grader)
    asks = asks.model_copy(
        update={
            "spec": asks.spec.model_copy(
                update={
                    "sandbox": asks.spec.sandbox.model_copy(update={"network": True}),
                    "oracle": ["true"],
                }
            )
        }
    )
    plain = _yaml_task(tmp_path / "plain", grader)
    client = docker_client()
    network = client.networks.create(f"agentrl-test-{run_id[-8:]}", internal=True)

    async def online_during_run(task: Task) -> bool:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "net")
        try:
            done = await sandbox.exec(ExecRequest(command=["python3", "-c", online]))
            return done.exit_code == 0
        finally:
            await sandbox.close()

    async def notes(task: Task) -> list[str]:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        return (await check_task(task, env))[0].notes

    try:
        offline = asyncio.run(online_during_run(asks)), asyncio.run(notes(asks))
        monkeypatch.setenv("AGENTRL_AGENT_NETWORK", network.name)
        given = asyncio.run(online_during_run(asks)), asyncio.run(notes(asks))
        never = asyncio.run(online_during_run(plain))
    finally:
        network.remove()
        client.close()
    assert offline[0] is False and "AGENTRL_AGENT_NETWORK" in offline[1][0]
    assert given == (True, [])
    assert never is False


def test_a_sandbox_restored_from_a_snapshot_is_sealed_against_the_original_image(
    run_id: str,
) -> None:
    """A change made before a snapshot is still left out when a sandbox restored from that
    snapshot (a branch, a replay) is graded: the grading copy starts from the original
    image, and the snapshot's layers count as the agent's changes."""
    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.seal import GradeScope

    async def go() -> tuple[list[str], str]:
        provider = DockerProvider(reap_at_start=False)
        spec = SandboxSpec(run_id=run_id, name="chain")
        first = await provider.start(spec)
        try:
            await fake_python(first)  # before the snapshot
            snapshot = await first.snapshot("turn-000")
        finally:
            await first.close()
        restored = await provider.restore(snapshot, spec)
        try:
            await _sh(restored, "echo planted > /conftest.py; echo kept > /workspace/out")
            sealed = await restored.seal(GradeScope(outputs=("/workspace",)))
            ls = "ls /conftest.py /usr/local/bin; cat /workspace/out; true"
            shown = await restored.exec(ExecRequest(command=ls))
        finally:
            await restored.close()
            await provider.remove_snapshot(snapshot)
        return sealed.restored, shown.output

    restored, shown = asyncio.run(go())
    assert sorted(restored) == ["/conftest.py (added)", "/usr/local/bin/python3 (added)"]
    assert "python3" not in shown and "No such file" in shown and "kept" in shown


def test_a_pytest_earlier_on_path_cannot_pass_for_the_real_one(tmp_path: Path, run_id: str) -> None:
    """A grader that runs `pytest` from PATH: the agent's own pytest, put earlier on PATH,
    prints a passing summary; unsealed it earns 1.0, sealed it is gone and the real tests
    fail."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_f():\n    assert False\n")
    grader = {
        "type": "pytest",
        "command": "pytest -rA -p no:cacheprovider",
        "fail_to_pass": ["tests/test_x.py::test_f"],
        "pass_to_pass": [],
        "files": {"tests": "tests"},
    }
    task = _yaml_task(tmp_path, grader)
    summary = "=== short test summary info ===\\nPASSED tests/test_x.py::test_f\\n=== 1 passed ==="
    fake = f"#!/bin/sh\nprintf '{summary}\\n'\n"

    async def go(sealed: bool) -> Grade:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "pytest")
        try:
            await sandbox.write_file("/usr/local/bin/pytest", fake.encode(), mode=0o755)
            if sealed:
                return await env.evaluate(sandbox, task.instances[0])
            return await env.grade(sandbox, task.instances[0])
        finally:
            await sandbox.close()

    assert asyncio.run(go(sealed=False)).reward == 1.0
    graded = asyncio.run(go(sealed=True))
    assert graded.reward == 0.0 and graded.evidence.tests == {"tests/test_x.py::test_f": "FAILED"}
    assert graded.evidence.sealed and graded.evidence.sealed.restored == [
        "/usr/local/bin/pytest (added)"
    ]


def test_changes_read_from_the_overlay_layers_are_what_docker_diff_says(run_id: str) -> None:
    """EVAL reads the container's overlay layers on this machine (fast) instead of asking
    the engine for `docker diff` (0.4 s here): the same paths and kinds, less the engine's
    own mount points, and a link to / the agent made is not followed."""
    from agentrl.sandbox.base import SandboxSpec
    from agentrl.sandbox.docker.grading import ENGINE_PATHS, origin_and_changes

    kinds = {0: "changed", 1: "added", 2: "deleted"}

    async def go() -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
        sandbox = await DockerProvider(reap_at_start=False).start(SandboxSpec(run_id=run_id))
        try:
            script = (
                "echo x > /usr/local/bin/new; echo y >> /etc/hostname.bak; rm /usr/bin/cmp;"
                " ln -s / /root/everything; mkdir -p /opt/a/b; echo z > /opt/a/b/c"
            )
            await _sh(sandbox, script)
            api = sandbox._api  # the engine's view, to compare with
            engine = {(e["Path"], kinds[e["Kind"]]) for e in api.diff(sandbox.id)}
            _, ours, note = origin_and_changes(api, sandbox.id)
            assert note is None, "the overlay layers are readable on this machine"
            return engine, {(c.path, c.kind) for c in ours}
        finally:
            await sandbox.close()

    engine, ours = asyncio.run(go())
    mine = {
        (p, k) for p, k in engine if not any(p == e or p.startswith(e + "/") for e in ENGINE_PATHS)
    }
    assert ours == mine
    assert ("/usr/bin/cmp", "deleted") in ours and ("/root/everything", "added") in ours
