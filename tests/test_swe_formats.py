"""SWE-Gym, SWE-smith and R2E-Gym rows: read as published, their images named as each
harness names them, and graded by each harness's rules.

The SWE-smith row is genuine (a fixture of the SWE-smith repository, kept in the local
corpus when present). No genuine SWE-Gym or R2E-Gym row was found in any public
repository reachable here: those rows are written after the datasets' cards (column
names and types), and say so. The grading tests use small images built here in each
dataset's layout: a clean repository whose SWE-smith bug is a patch, and an R2E-Gym
repository with hidden tests in /r2e_tests and a run_tests.sh.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from swe_fixtures import BUG, CALC, TESTS
from swe_fixtures import build_image as _image
from swe_fixtures import git_init as _git_init
from swe_fixtures import remove_images as _remove
from swe_fixtures import write_rows as _write

from agentrl import corpus
from agentrl.check import check_task
from agentrl.episode import make_env
from agentrl.sandbox.base import ExecRequest
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.evidence import Grade
from agentrl.tasks.swe.grade import parse_r2e_log
from agentrl.tasks.swe.images import image_names
from agentrl.tasks.swe.rows import load_swe_bench

SWE_GYM_ROW = {  # columns as the SWE-Gym dataset card lists them; test lists are lists
    "instance_id": "getmoto__moto-7365",
    "repo": "getmoto/moto",
    "base_commit": "0" * 40,
    "patch": "",
    "test_patch": "diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n",
    "problem_statement": "p",
    "hints_text": "",
    "created_at": "2024-01-01",
    "version": "5.0",
    "FAIL_TO_PASS": ["tests/test_x.py::test_a"],
    "PASS_TO_PASS": [],
}
R2E_ROW = {  # columns as the R2E-Gym-Subset card lists them (JSON strings where it says so)
    "repo_name": "calc",
    "docker_image": "agentrl-test/r2e-calc:latest",
    "commit_hash": "1234567890abcdef",
    "parsed_commit_content": "{}",
    "execution_result_content": "{}",
    "modified_files": ["calc.py"],
    "modified_entity_summaries": [],
    "relevant_files": ["calc.py"],
    "num_non_test_files": 1,
    "num_non_test_func_methods": 1,
    "num_non_test_lines": 1,
    "prompt": "p",
    "problem_statement": "[ISSUE]add() subtracts[/ISSUE]",
    "expected_output_json": json.dumps(
        {"test_add": "PASSED", "TestCalc.test_sub": "PASSED", "test_known_bad": "FAILED"}
    ),
}


def test_each_dataset_is_told_by_its_columns(tmp_path: Path) -> None:
    gym = load_swe_bench(_write(tmp_path, [SWE_GYM_ROW]))
    assert gym.format == "swe-gym" and gym.instances[0].id == "getmoto__moto-7365"
    assert image_names(gym.instances[0], "swe-gym") == [
        "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest",  # OpenHands' rule
        "swebench/sweb.eval.x86_64.getmoto_1776_moto-7365:latest",
        "sweb.eval.x86_64.getmoto__moto-7365:latest",
    ]
    r2e = load_swe_bench(_write(tmp_path, [R2E_ROW], "r2e.jsonl"))
    assert r2e.format == "r2e-gym" and r2e.instances[0].id == "calc__1234567890ab"
    assert image_names(r2e.instances[0], "r2e-gym") == ["agentrl-test/r2e-calc:latest"]
    assert "{repo_name}" in r2e.spec.prompt.instance
    mixed = _write(tmp_path, [SWE_GYM_ROW, R2E_ROW], "mixed.jsonl")
    with pytest.raises(Exception, match="rows of several datasets in one file"):
        load_swe_bench(mixed)


SWE_SMITH_ROW = "swe-smith/pandas-dev__pandas.95280573.pr_53652.json"


@pytest.mark.corpus(SWE_SMITH_ROW)
def test_a_genuine_swe_smith_row_loads_as_published(tmp_path: Path) -> None:
    """SWE-smith's own test fixture of a task instance (tests/corpus-swe.json), one row as
    its harness publishes it, written as the one-line JSONL a dataset file holds."""
    published = corpus.find(SWE_SMITH_ROW)
    assert published is not None
    row = json.loads(published.read_text())
    task = load_swe_bench(_write(tmp_path, [row], "swe-smith.jsonl"))
    (instance,) = task.instances
    assert task.format == "swe-smith" and instance.id == "pandas-dev__pandas.95280573.pr_53652"
    assert image_names(instance, "swe-smith") == [
        "swesmith.x86_64.pandas-dev__pandas.95280573:latest"
    ]


def test_r2e_gym_log_parse_drops_the_file_and_the_message() -> None:
    log = (
        "\x1b[1m=== short test summary info ===\x1b[0m\r\n"
        "PASSED r2e_tests/test_1.py::test_add\n"
        "FAILED r2e_tests/test_1.py::TestCalc::test_sub - assert 1 == 2\n"
        "ERROR r2e_tests/test_2.py::test_setup\n"
    )
    assert parse_r2e_log(log) == {
        "test_add": "PASSED",
        "TestCalc.test_sub": "FAILED",
        "test_setup": "ERROR",
    }
    assert parse_r2e_log("PASSED r2e_tests/test_1.py::test_add") == {}  # no summary, no result


# ---------------------------------------------------------------- Docker, layouts built here


@pytest.mark.docker
@pytest.mark.slow
def test_swe_smith_start_state_oracle_and_no_op(tmp_path: Path, run_id: str) -> None:
    """The agent starts from the bug with its failing tests' file gone and no history that
    holds the clean code; the reversed bug patch earns 1.0, nothing earns 0."""
    tag = _image(
        tmp_path,
        "agentrl-test/swesmith.x86_64.calc:latest",
        {"calc.py": CALC, "test_calc.py": TESTS.replace("def test_known_bad", "def _x")},
        _git_init(),
    )
    row = {
        "instance_id": "calc__calc.1234abcd.func_pm_op_swap__x1",
        "repo": "swesmith/calc__calc.1234abcd",
        "patch": BUG,
        "FAIL_TO_PASS": ["test_calc.py::test_add"],
        "PASS_TO_PASS": ["test_calc.py::TestCalc::test_sub"],
        "image_name": tag,
        "problem_statement": "add() subtracts",
    }
    task = load_swe_bench(_write(tmp_path, [row]))
    assert task.format == "swe-smith"

    async def go() -> tuple[str, list[Any]]:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "look")
        try:
            seen = await sandbox.exec(
                ExecRequest(
                    command="git log --all --oneline | wc -l; ls test_calc.py 2>&1;"
                    " grep -c 'a - b' calc.py; git status --porcelain | wc -l"
                )
            )
        finally:
            await sandbox.close()
        return seen.output, await check_task(task, env)

    try:
        seen, (row_result,) = asyncio.run(go())
    finally:
        _remove("agentrl/swe-start-calc__calc.1234abcd.func_pm_op_swap__x1", tag)
    # one commit, the failing tests' file gone, the bug in (both functions subtract), clean
    lines = seen.splitlines()
    assert lines[0] == "1" and "No such file" in lines[1] and lines[2:] == ["2", "0"]
    assert row_result.ok, row_result
    assert row_result.oracle.tests == "F2P 1/1, P2P 1/1"
    assert row_result.noop.tests == "F2P 0/1, P2P 1/1"


@pytest.mark.docker
@pytest.mark.slow
def test_r2e_gym_hidden_tests_and_exact_expected_statuses(tmp_path: Path, run_id: str) -> None:
    """The hidden tests are not in the agent's image; grading runs run_tests.sh where
    R2E-Gym's runtime puts it and wants every status exactly as expected (a test expected
    to fail must still fail)."""
    run_tests = "python3 -m pytest -rA r2e_tests\n"
    tag = _image(
        tmp_path,
        "agentrl-test/r2e-calc:latest",
        {
            "calc.py": CALC.replace("a + b", "a - b"),
            "run_tests.sh": run_tests,
            "r2e_tests/test_1.py": TESTS,
        },
        # as in R2E-Gym's images: the tests and runner are copied in after the clone
        f"mv r2e_tests /r2e_tests && mv run_tests.sh /tmp && {_git_init()}"
        " && mv /tmp/run_tests.sh .",
    )
    task = load_swe_bench(_write(tmp_path, [R2E_ROW]))
    instance = task.instances[0]

    async def go() -> tuple[str, Grade, Grade]:
        env = make_env(task, DockerProvider(reap_at_start=False), run_id)
        fixed, idle = await env.init(instance, "fixed"), await env.init(instance, "idle")
        try:
            hidden = await fixed.exec(
                ExecRequest(command="ls /r2e_tests /testbed/run_tests.sh /root 2>&1; true")
            )
            await fixed.write_file("/testbed/calc.py", CALC.encode())
            return (
                hidden.output,
                await env.evaluate(fixed, instance),
                await env.evaluate(idle, instance),
            )
        finally:
            await fixed.close()
            await idle.close()

    try:
        hidden, fixed, idle = asyncio.run(go())
    finally:
        _remove("agentrl/swe-start-calc__1234567890ab", tag)
    assert "test_1.py" not in hidden and "No such file" in hidden
    assert fixed.reward == 1.0, fixed.evidence.output
    assert fixed.evidence.tests["test_known_bad"] == "FAILED"  # as expected: still a match
    assert idle.reward == 0.0 and idle.components["tests_differ"] == 1
