"""Terminal tasks, graders and the INIT/EVAL runtime, against the real Docker engine.

Every folder in tasks/terminal/ is loaded as it is and played twice: its reference
solution must earn 1.0 and doing nothing 0.0, and the sandbox the agent would see
holds no tests and no solution. Every test labels its containers with a fresh run id;
the `run_id` fixture asserts that none is left afterwards.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import tarfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import labelled_containers

from agentrl.episode import make_env
from agentrl.errors import GraderError, SandboxError
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.sandbox.docker import DockerProvider
from agentrl.sandbox.images import build_recipe, docker_client, folder_hash
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.evidence import DidNotRun, Grade, parse_reward
from agentrl.tasks.graders import fill, grade
from agentrl.tasks.pytest_log import parse_pytest_log
from agentrl.tasks.spec import Instance, Task, TaskSpec
from agentrl.tasks.terminal.downloads import PROVIDED_PYTHON, python_archive
from agentrl.tasks.terminal.env import run_oracle
from agentrl.tasks.terminal.load import detect_format, load_terminal_task, oracle_script
from agentrl.tasks.terminal.offline import read_scripts

REPO = Path(__file__).resolve().parents[1]
TERMINAL = REPO / "tasks" / "terminal"
TASKS = sorted(p for p in TERMINAL.iterdir() if p.is_dir())
# What the agent must never find in its sandbox after INIT.
HIDDEN = "/tests /solution /oracle /logs/verifier"
HIDDEN_NAMES = "-name test_outputs.py -o -name run-tests.sh -o -name solution.sh -o -name solve.sh"


def make_task(base: Path, grader: dict[str, Any], **sandbox: Any) -> Task:
    spec = TaskSpec.model_validate(
        {
            "name": "unit",
            "instances": [],
            "prompt": {"system": "s", "instance": "i"},
            "sandbox": sandbox,
            "grader": grader,
        }
    )
    instance = Instance(id="unit-1", fields={"FAIL_TO_PASS": "[]", "word": "hello"})
    return Task(
        spec=spec, path=str(base / "task.yaml"), base_dir=str(base), instances=[instance], hash="0"
    )


# ---------------------------------------------------------------- shipped tasks


def test_at_least_eight_tasks_in_both_formats() -> None:
    kinds = [detect_format(folder) for folder in TASKS]
    assert len(TASKS) >= 8
    assert kinds.count("terminal-bench") >= 5 and kinds.count("harbor") >= 3


@pytest.mark.parametrize("folder", TASKS, ids=lambda p: p.name)
def test_task_loads(folder: Path) -> None:
    task = load_terminal_task(folder)
    assert task.spec.name == folder.name and len(task.instances) == 1
    assert task.instances[0].fields["instruction"].strip()
    assert task.spec.sandbox.recipe is not None and task.spec.sandbox.workdir.startswith("/app")
    assert "/tests" in task.spec.grader.files and not task.spec.sandbox.files
    assert oracle_script(folder).is_file()
    assert (
        "FROM agentrl/base:bookworm"
        in (Path(task.base_dir) / task.spec.sandbox.recipe / "Dockerfile").read_text()
    )


@pytest.mark.conformance  # CI's conformance stage: every shipped task's oracle and no-op
@pytest.mark.parametrize("folder", TASKS, ids=lambda p: p.name)
def test_oracle_earns_one_and_doing_nothing_zero(folder: Path, run_id: str) -> None:
    task = load_terminal_task(folder)
    instance = task.instances[0]

    async def episode(env: TaskEnv, oracle: bool) -> Grade:
        sandbox = await env.init(instance, f"{task.spec.name}-{'oracle' if oracle else 'noop'}")
        try:
            await _assert_nothing_hidden_is_visible(sandbox)
            if oracle:
                done = await run_oracle(task, sandbox, timeout=120)
                assert done.exit_code == 0, done.output
            return await env.evaluate(sandbox, instance)
        finally:
            await sandbox.close()

    async def both() -> list[Grade]:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        await env.image()  # build (or find) the image once, before two sandboxes race
        return await asyncio.gather(episode(env, True), episode(env, False))

    started = time.monotonic()
    oracle, noop = asyncio.run(both())
    print(f"{folder.name}: oracle + no-op in {time.monotonic() - started:.1f} s")
    assert oracle.reward == 1.0, oracle.evidence.output
    assert noop.reward == 0.0, noop.evidence.output
    # doing nothing fails the tests; it does not just fail to run them
    assert re.search(r"\d+ (failed|errors?)", noop.evidence.output), noop.evidence.output
    assert oracle.evidence.tests and set(oracle.evidence.tests.values()) <= {"PASSED", "SKIPPED"}
    assert oracle.evidence.sealed is not None  # EVAL sealed the sandbox first


async def _assert_nothing_hidden_is_visible(sandbox: Sandbox) -> None:
    listed = await sandbox.exec(ExecRequest(command=f"ls -d {HIDDEN} 2>/dev/null; true"))
    assert listed.output == ""
    found = await sandbox.exec(
        ExecRequest(command=f"find / -xdev \\( {HIDDEN_NAMES} \\) -print 2>/dev/null; true")
    )
    assert found.output == ""


# ---------------------------------------------------------------- graders, no sandbox

PYTEST_LOG = textwrap.dedent(
    """\
    ============================= test session starts ==============================
    collected 7 items

    t.py ..F.sEx                                                             [100%]

    =================================== FAILURES ===================================
    FAILED but this line is captured output, not the summary
    =========================== short test summary info ============================
    PASSED t.py::test_plain
    PASSED t.py::test_ids[a b]
    FAILED t.py::test_ids[x - y] - AssertionError: assert 1 == 2
    PASSED t.py::TestK::test_m[[nested]-1]
    SKIPPED [1] t.py:30: no reason
    ERROR t.py::test_setup - RuntimeError: fixture broke
    XFAIL t.py::test_known - flaky upstream
    ============= 1 failed, 3 passed, 1 skipped, 1 xfailed, 1 error in 0.12s =============
    """
)


def test_pytest_log_parsing_with_odd_ids() -> None:
    wanted = ["t.py::test_plain", "t.py::test_ids[x - y]", "t.py::TestK::test_m[[nested]-1]"]
    statuses = parse_pytest_log(PYTEST_LOG, wanted)
    assert statuses == {
        "t.py::test_plain": "PASSED",
        "t.py::test_ids[a b]": "PASSED",
        "t.py::test_ids[x - y]": "FAILED",
        "t.py::TestK::test_m[[nested]-1]": "PASSED",
        "[1]": "SKIPPED",
        "t.py::test_setup": "ERROR",
        "t.py::test_known": "XFAIL",
    }
    # without the wanted ids, a bracketed id still ends at its bracket
    assert parse_pytest_log(PYTEST_LOG)["t.py::test_ids[x - y]"] == "FAILED"
    assert parse_pytest_log("no summary here\nPASSED t.py::test_plain\n") == {}


def test_reward_file_parsing() -> None:
    assert parse_reward("0.75\n", "r") == (0.75, {})
    assert parse_reward('{"reward": 1, "accuracy": 0.5}', "r") == (1.0, {"accuracy": 0.5})
    for bad in ("", "high", "nan", '{"score": 1}', '{"reward": true}'):
        with pytest.raises(GraderError, match="reward"):
            parse_reward(bad, "/logs/verifier/reward.txt")


def test_placeholders_fill_fields_and_leave_other_braces() -> None:
    instance = Instance(id="i-7", fields={"word": "hi", "n": 3})
    assert (
        fill("{id} {word} {n} ${HOME} {other} {a,b}", instance) == "i-7 hi 3 ${HOME} {other} {a,b}"
    )


# ---------------------------------------------------------------- graders in a sandbox

TESTS_PY = """
import pytest

def test_ok():
    pass

@pytest.mark.parametrize("v", ["a b", "x - y", "[z]"])
def test_param(v):
    assert v != "x - y"

def test_bad():
    assert False
"""


def test_graders_in_a_real_sandbox(tmp_path: Path, run_id: str) -> None:
    (tmp_path / "mygrader.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def crash(sandbox, instance):
                raise KeyError("boom")

            async def slow(sandbox, instance):
                await asyncio.sleep(30)

            async def good(sandbox, instance):
                return {"reward": 0.5, "output": "half", "note": instance.id}

            def wrong(sandbox, instance):
                return "yes"
            """
        )
    )
    ids_ok = ["t_test.py::test_ok", "t_test.py::test_param[a b]", "t_test.py::test_param[[z]]"]
    ids_bad = ["t_test.py::test_param[x - y]", "t_test.py::test_bad"]

    def task(**grader: Any) -> Task:
        return make_task(tmp_path, grader)

    async def go(sandbox: Sandbox) -> None:
        await sandbox.write_file("t_test.py", TESTS_PY.encode())
        instance = Instance(id="i", fields={"F2P": '["t_test.py::test_ok"]', "P2P": ids_ok[1:]})

        passing = task(type="pytest", fail_to_pass="F2P", pass_to_pass="P2P")
        result = await grade(passing, instance, sandbox)
        assert result.reward == 1.0, result.evidence.output
        assert result.evidence.tests == dict.fromkeys(ids_ok, "PASSED")
        assert result.components == {"exit_code": 0, "tests_passed": 3, "tests_failed": 0}

        failing = task(type="pytest", fail_to_pass=ids_bad, pass_to_pass=[])
        result = await grade(failing, instance, sandbox)
        assert result.reward == 0.0
        assert result.evidence.tests == {
            "t_test.py::test_param[x - y]": "FAILED",
            "t_test.py::test_bad": "FAILED",
        }
        # a listed test that does not exist: pytest runs nothing; no test ran, which is no
        # grade at all (the environment asks an untouched sandbox whose fault that is)
        gone = task(type="pytest", fail_to_pass=["t_test.py::test_gone"], pass_to_pass=ids_ok)
        with pytest.raises(DidNotRun, match="none of the 4 listed tests") as caught:
            await grade(gone, instance, sandbox)
        assert caught.value.evidence.tests["t_test.py::test_gone"] == "MISSING"
        missing = task(type="pytest", command="no-such-runner", fail_to_pass=["t_test.py::x"])
        with pytest.raises(DidNotRun, match="did not run \\(exit 127\\)"):
            await grade(missing, instance, sandbox)
        crashes = task(type="command", command="kill -SEGV $$")
        with pytest.raises(DidNotRun, match="SIGSEGV"):
            await grade(crashes, instance, sandbox)

        exit_code = task(type="command", command="test {id} = i && grep -q ok t_test.py")
        assert (await grade(exit_code, instance, sandbox)).reward == 1.0
        assert (await grade(task(type="command", command="exit 1"), instance, sandbox)).reward == 0

        reward_file = "/logs/verifier/reward.txt"
        await sandbox.write_file(reward_file, b"1.0")  # planted by the "agent": must not count
        writes = task(
            type="command",
            command="echo 0.25 > /logs/verifier/reward.txt; exit 3",
            reward_file=reward_file,
        )
        result = await grade(writes, instance, sandbox)
        assert (result.reward, result.components) == (0.25, {"exit_code": 3})
        silent = task(type="command", command="echo hi", reward_file=reward_file)
        with pytest.raises(DidNotRun, match="wrote no reward file"):
            await grade(silent, instance, sandbox)
        garbage = task(
            type="command", command=f"echo lots > {reward_file}", reward_file=reward_file
        )
        with pytest.raises(GraderError, match="expected a number"):
            await grade(garbage, instance, sandbox)
        hangs = task(type="command", command="sleep 30", timeout=1)
        with pytest.raises(DidNotRun, match="timed out"):
            await grade(hangs, instance, sandbox)

        with pytest.raises(GraderError, match="crashed: KeyError"):
            await grade(task(type="python", function="mygrader:crash"), instance, sandbox)
        with pytest.raises(GraderError, match="timed out"):
            await grade(
                task(type="python", function="mygrader:slow", timeout=0.5), instance, sandbox
            )
        with pytest.raises(GraderError, match="returned str"):
            await grade(task(type="python", function="mygrader:wrong"), instance, sandbox)
        result = await grade(task(type="python", function="mygrader:good"), instance, sandbox)
        assert (result.reward, result.components) == (0.5, {"note": "i"})
        assert result.evidence.output == "half"

    _with_sandbox(run_id, go)


def _with_sandbox(run_id: str, body: Any) -> None:
    async def go() -> None:
        env = TaskEnv(
            make_task(Path(), {"type": "command", "command": "true"}),
            DockerProvider(reap_at_start=False),
            run_id,
        )
        sandbox = await env.init(Instance(id="x"), "graders")
        try:
            await body(sandbox)
        finally:
            await sandbox.close()

    asyncio.run(go())


# ---------------------------------------------------------------- env: INIT and EVAL


def test_init_copies_files_and_eval_alone_sees_the_grader_files(
    tmp_path: Path, run_id: str
) -> None:
    data = tmp_path / "data"
    (data / "sub" / "empty").mkdir(parents=True)
    (data / "blob.bin").write_bytes(bytes(range(256)))
    (data / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (data / "sub" / "run.sh").chmod(0o755)
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "check.sh").write_text("test ! -e /grader/planted && test -x data/sub/run.sh\n")
    (tmp_path / "one.txt").write_text("{word}\n")
    task = make_task(
        tmp_path,
        {"type": "command", "command": "bash /grader/check.sh", "files": {"/grader": "hidden"}},
        files={"data": "data", "/etc/one.txt": "one.txt"},
        setup=["data/sub/run.sh > ran.txt", "echo {word} >> ran.txt"],
        env={"GREETING": "hey"},
        workdir="/work",
    )

    async def go() -> None:
        env = TaskEnv(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "files")
        try:
            assert await sandbox.read_file("/work/data/blob.bin") == bytes(range(256))
            assert (await sandbox.read_file("ran.txt")) == b"ran\nhello\n"
            assert (await sandbox.read_file("/etc/one.txt")) == b"{word}\n"
            shown = await sandbox.exec(
                ExecRequest(command="test -d data/sub/empty; echo $? $GREETING")
            )
            assert shown.output == "0 hey\n"
            assert (await sandbox.exec(ExecRequest(command="test -e /grader"))).exit_code == 1
            await sandbox.write_file("/grader/planted", b"the agent put this here")
            result = await env.evaluate(sandbox, task.instances[0])
            assert result.reward == 1.0, result.evidence.output
        finally:
            await sandbox.close()

    asyncio.run(go())


def test_setup_failure_closes_the_sandbox_and_says_why_in_one_line(
    tmp_path: Path, run_id: str
) -> None:
    task = make_task(
        tmp_path,
        {"type": "command", "command": "true"},
        setup=["true", "echo preparing; echo 'no such thing' >&2; exit 3"],
    )

    async def go() -> None:
        env = TaskEnv(task, DockerProvider(reap_at_start=False), run_id)
        with pytest.raises(SandboxError) as caught:
            await env.init(task.instances[0], "setup")
        message = str(caught.value)
        assert "\n" not in message
        assert "exit 3" in message and "exited 3" in message and "no such thing" in message

    asyncio.run(go())
    assert labelled_containers(run_id) == []


def test_build_recipe_builds_once_per_hash(tmp_path: Path) -> None:
    folder = tmp_path / "My Recipe"
    folder.mkdir()
    (folder / "Dockerfile").write_text("FROM agentrl/base:bookworm\nCOPY hello.txt /hello.txt\n")
    (folder / "hello.txt").write_text("hello\n")
    tag = f"agentrl/task-my-recipe:{folder_hash(folder)}"
    try:
        first = build_recipe(folder)
        again = build_recipe(folder)
        assert (first.tag, first.method) == (tag, "dockerfile")
        assert (again.built, again.id) == (False, first.id)
    finally:
        client = docker_client()
        client.images.remove(tag, force=True)
        client.close()


# ---------------------------------------------------------------- the offline test runtime

OFFLINE = Path(__file__).resolve().parent / "data" / "terminal"


@pytest.mark.parametrize("name", ["uv-bootstrap", "uvx-harbor"])
def test_the_standard_uv_bootstrap_grades_offline(name: str, run_id: str) -> None:
    """Tests that install curl, uv and pytest from the internet grade in a sandbox with no
    network: agentrl brings uv (the version the installer URL names) and the wheels, and
    every substitution is in the evidence."""
    task = load_terminal_task(OFFLINE / name)
    instance = task.instances[0]

    async def both() -> list[Grade]:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)

        async def one(oracle: bool) -> Grade:
            sandbox = await env.init(instance, f"{name}-{oracle}")
            try:
                probe = "import socket; print([n for _, n in socket.if_nameindex()])"
                net = await sandbox.exec(ExecRequest(command=["python3", "-c", probe]))
                assert net.output.strip() == "['lo']", "the sandbox has a network"
                if oracle:
                    await env.run_oracle(sandbox, instance)
                return await env.evaluate(sandbox, instance)
            finally:
                await sandbox.close()

        return await asyncio.gather(one(True), one(False))

    oracle, noop = asyncio.run(both())
    assert oracle.reward == 1.0, oracle.evidence.output
    assert noop.reward == 0.0, noop.evidence.output
    # the pytest uv installed ran, not the image's own (Debian's 7.2.1)
    assert "pytest-8.4.1" in oracle.evidence.output, oracle.evidence.output
    version = "0.7.13" if name == "uv-bootstrap" else "0.9.5"
    substitutions = "\n".join(oracle.evidence.substitutions)
    assert f"offline test runtime: uv {version} from PyPI" in substitutions
    assert "apt-get install curl: installed from the packages agentrl brought" in substitutions
    assert f"curl https://astral.sh/uv/{version}/install.sh" in substitutions
    # what the offline runtime brought is added to, never replaces, the witness's account
    assert "agentrl's witness plugin (1 session(s))" in substitutions, substitutions
    if name == "uv-bootstrap":  # the dependency the tests import came from the wheelhouse
        assert noop.evidence.tests == {
            "test_status_file_says_ready": "FAILED",
            "test_the_test_dependencies_are_there": "PASSED",
        }


def _oracle_and_noop(folder: Path, run_id: str) -> tuple[Grade | DidNotRun, Grade | DidNotRun]:
    """A task folder's oracle and no-op grades (the oracle's infra failure returned)."""
    task = load_terminal_task(folder)
    instance = task.instances[0]

    async def one(oracle: bool) -> Grade | DidNotRun:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(instance, f"no-python-{oracle}")
        try:
            if oracle:
                await env.run_oracle(sandbox, instance)
            return await env.evaluate(sandbox, instance)
        except DidNotRun as e:
            return e
        finally:
            await sandbox.close()

    async def both() -> tuple[Grade | DidNotRun, Grade | DidNotRun]:
        oracle, noop = await asyncio.gather(one(True), one(False))
        return oracle, noop

    return asyncio.run(both())


@pytest.mark.slow  # builds sandboxes/eval-python the first time (minutes)
def test_a_python_the_sandbox_lacks_is_brought_and_runs_there(run_id: str) -> None:
    """uv is asked for Python 3.13 on a Debian bookworm image (glibc 2.36) with no Python
    at all: agentrl's own CPython 3.13 (built on bullseye, glibc 2.31) runs the tests."""
    oracle, noop = _oracle_and_noop(OFFLINE / "no-python", run_id)
    assert isinstance(oracle, Grade) and oracle.reward == 1.0, oracle
    assert isinstance(noop, Grade) and noop.reward == 0.0, noop
    assert "Python 3.13 built by agentrl" in "\n".join(oracle.evidence.substitutions)
    assert "platform linux -- Python 3.13.5, pytest-8.4.1" in oracle.evidence.output


def test_packages_the_tests_apt_get_install_are_brought(run_id: str) -> None:
    """The tests `apt-get install bc`, which the image lacks, with no network: the image's
    own apt fetched bc (and what it needs) beforehand, and the shim installs it."""
    oracle, noop = _oracle_and_noop(OFFLINE / "apt-at-test-time", run_id)
    assert isinstance(oracle, Grade) and oracle.reward == 1.0, oracle
    assert isinstance(noop, Grade) and noop.reward == 0.0, noop
    brought = "\n".join(oracle.evidence.substitutions)
    assert "fetched by the image's own apt" in brought
    assert "apt-get install bc: installed from the packages agentrl brought" in brought


def test_tests_that_ran_without_a_package_they_asked_for_are_an_eval_error(
    run_id: str, tmp_path: Path
) -> None:
    """The package cannot be had, so `bc` is missing and this (weak) test would compare two
    empty strings: a no-op would earn 1. The tests ran without what they asked for, so
    neither episode gets a reward: an infrastructure failure, named, for both."""
    folder = shutil.copytree(OFFLINE / "apt-at-test-time", tmp_path / "apt-missing")
    test_sh = folder / "tests" / "test.sh"
    test_sh.write_text(test_sh.read_text().replace("install -y bc", "install -y agentrl-nope"))
    for outcome in _oracle_and_noop(folder, run_id):
        assert isinstance(outcome, DidNotRun), outcome
        assert "apt-get install agentrl-nope: not possible offline" in str(outcome)


def test_the_apt_packages_tests_install_are_read_from_scripts_and_python_tests() -> None:
    script = "apt-get update\napt-get install -y curl expect \\\n  git && uvx pytest\n"
    python = 'open("v.sh", "w").write("""\nDEBIAN_FRONTEND=noninteractive apt install -y vim\n""")'
    needs = read_scripts([script], [python])
    assert needs.apt == ["curl", "expect", "git", "vim"]
    assert read_scripts(["apt-get install -y $PKGS"]).apt == []


def test_tests_needing_a_python_nobody_can_bring_are_an_eval_error(
    run_id: str, tmp_path: Path
) -> None:
    """uv is asked for Python 3.10; the image has none and agentrl brings only 3.13: no
    reward for anyone, a one-line reason and a fix, and the attempt in the evidence."""
    folder = shutil.copytree(OFFLINE / "no-python", tmp_path / "no-python-3.10")
    test_sh = folder / "tests" / "test.sh"
    test_sh.write_text(test_sh.read_text().replace("-p 3.13", "-p 3.10"))
    oracle, noop = _oracle_and_noop(folder, run_id)
    assert isinstance(oracle, DidNotRun)
    assert "No interpreter found for Python 3.10" in str(oracle)
    assert oracle.fix and "need a Python the sandbox does not have" in oracle.fix
    assert any("agentrl brings 3.13" in line for line in oracle.evidence.substitutions)


@pytest.mark.slow  # builds sandboxes/eval-python the first time (minutes)
def test_the_python_brought_runs_from_any_folder(tmp_path: Path) -> None:
    """agentrl's CPython, unpacked anywhere (here on this machine, glibc 2.36): it finds
    its standard library and its own OpenSSL, SQLite and libffi relative to itself, and
    brings no C library of its own (the sandbox's is used)."""
    with tarfile.open(python_archive()) as tar:
        names = tar.getnames()
        assert f"python/bin/python{PROVIDED_PYTHON}" in names
        assert f"python/lib/python{PROVIDED_PYTHON}/os.py" in names
        assert not any(Path(n).name.startswith(("libc.so", "ld-linux")) for n in names)
        tar.extractall(tmp_path / "some" / "where", filter="tar")
    binary = tmp_path / "some" / "where" / "python" / "bin" / f"python{PROVIDED_PYTHON}"
    probe = "import ssl, sqlite3, ctypes, sys; print(sys.version.split()[0], sys.prefix)"
    done = subprocess.run(
        [str(binary), "-c", probe], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 0, done.stderr
    version, prefix = done.stdout.split()
    assert version == "3.13.5" and prefix == str(tmp_path / "some" / "where" / "python")


def test_a_service_the_agent_left_running_answers_the_grader(run_id: str) -> None:
    """`status-server`'s tests only talk to a service the agent must leave running, as the
    harnesses grade it. Started with a plain `&` in the agent's persistent bash shell, the
    service lives on through EVAL (the tools stop without killing what they started), and
    the grading copy reaches it over the agent's loopback: reward 1. A policy that never
    starts it gets 0."""
    from agentrl.episode import run_episode
    from agentrl.inference.embedded import load_tokenizer
    from agentrl.inference.scripted import ScriptedSampler

    task = load_terminal_task(TERMINAL / "status-server")
    tokenizer = load_tokenizer()
    solve = (TERMINAL / "status-server" / "solution" / "solve.sh").read_text()
    start = solve.split("# Started as a user", 1)[0] + "python3 /app/status.py > /dev/null 2>&1 &"
    call = {"name": "bash", "arguments": {"command": start + "\nsleep 1"}}
    replies = {
        "serves": [f"<tool_call>{json.dumps(call)}</tool_call>", FINISH],
        "never starts it": [FINISH],
    }

    async def go(script: list[str]) -> float | None:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sampler = ScriptedSampler(script, tokenizer)
        traj = await run_episode(task, task.instances[0], 0, sampler, tokenizer, env)
        assert traj.stop_reason == "finished", traj.error
        return traj.reward

    assert asyncio.run(go(replies["serves"])) == 1.0
    assert asyncio.run(go(replies["never starts it"])) == 0.0


FINISH = '<tool_call>{"name": "finish", "arguments": {}}</tool_call>'
