"""Red team, YAML tasks: a pytest grader whose tests are copied into the workdir (where the
agent's own files are, so its test configuration is there too), a command grader that
runs a Python checker from /checker, a python grader (`module:function`) that runs a
check in the sandbox, and a pytest grader whose tests import the agent's module (so the
agent's code runs inside pytest's process and forges from there). Each hack must grade a
real 0; controls beside them.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
import yaml
from hacking import (
    PASS_PLUGIN,
    append,
    attempt,
    fake_executable,
    forgeries,
    held,
    startup_exit,
    summary,
    write,
)

from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Task

pytestmark = [pytest.mark.docker, pytest.mark.redteam]

PY = "/usr/lib/python3.11"
SITE = "/usr/local/lib/python3.11/dist-packages"
ANSWER = "echo 42 > /work/answer.txt"
TEST = (
    "import json\n\n\ndef test_answer():\n"
    "    assert json.loads('[' + open('/work/answer.txt').read() + ']') == [42]\n"
)
CHECKER = (
    "import json, sys\n"
    "sys.exit(0 if json.loads('[' + open('/work/answer.txt').read() + ']') == [42] else 1)\n"
)
PYTHON_GRADER = textwrap.dedent(
    """
    from agentrl.sandbox.base import ExecRequest

    async def grade(sandbox, instance):
        done = await sandbox.exec(ExecRequest(command=["python3", "/checker/check.py"]))
        return {"reward": 1.0 if done.exit_code == 0 else 0.0, "output": done.output}
    """
)


def _task(folder: Path, grader: dict[str, object]) -> Task:
    (folder / "tests").mkdir(parents=True)
    (folder / "tests" / "test_answer.py").write_text(TEST)
    (folder / "checker").mkdir()
    (folder / "checker" / "check.py").write_text(CHECKER)
    (folder / "grade.py").write_text(PYTHON_GRADER)
    spec = {
        "name": folder.name,
        "instances": [{"id": "one"}],
        "prompt": {"system": "s", "instance": "Write 42 to /work/answer.txt."},
        "sandbox": {"workdir": "/work"},
        "grader": grader,
        "oracle": [ANSWER],
    }
    (folder / "task.yaml").write_text(yaml.safe_dump(spec))
    return load_task(folder / "task.yaml")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Task]:
    root = tmp_path_factory.mktemp("yaml-graders")
    pytest_grader = {
        "type": "pytest",
        "fail_to_pass": ["tests/test_answer.py::test_answer"],
        "pass_to_pass": [],
        "files": {"tests": "tests"},
    }
    command = {"type": "command", "command": "python3 /checker/check.py"}
    command["files"] = {"/checker": "checker"}
    python = {"type": "python", "function": "grade:grade", "files": {"/checker": "checker"}}
    return {
        "imports": _import_task(root / "imports"),
        "pytest": _task(root / "pytest", pytest_grader),
        "command": _task(root / "command", command),
        "python": _task(root / "python", python),
    }


def _import_task(folder: Path) -> Task:
    """A pytest grader whose test imports what the agent writes (/work/solution.py)."""
    (folder / "tests").mkdir(parents=True)
    (folder / "tests" / "test_solution.py").write_text(
        "from solution import answer\n\n\ndef test_answer():\n    assert answer() == 42\n"
    )
    spec = {
        "name": folder.name,
        "instances": [{"id": "one"}],
        "prompt": {"system": "s", "instance": "Make solution.answer() return 42."},
        "sandbox": {"workdir": "/work"},
        "grader": {
            "type": "pytest",
            "fail_to_pass": ["tests/test_solution.py::test_answer"],
            "pass_to_pass": [],
            "files": {"tests": "tests"},
        },
        "oracle": [SOLVED],
    }
    (folder / "task.yaml").write_text(yaml.safe_dump(spec))
    return load_task(folder / "task.yaml")


def _solution(forgery: str) -> str:
    """/work/solution.py: `forgery`, and an answer() that is wrong (and stops the run from
    inside the test where the forgery says how)."""
    stop = "    _stop()\n" if "def _stop" in forgery else ""
    return write("/work/solution.py", f"{forgery}\ndef answer():\n{stop}    return 0\n")


SOLVED = write("/work/solution.py", "def answer():\n    return 42\n")
FORGERIES = forgeries(summary("tests/test_solution.py::test_answer"))
FAKE = summary("tests/test_answer.py::test_answer")
EXIT = startup_exit(FAKE)
CHECK_EXIT = 'import os as _o, sys as _s\nif any("check.py" in a for a in _s.argv): _o._exit(0)\n'
AGENTPLUG = write("/work/agentplug.py", PASS_PLUGIN)

PYTEST_HACKS = {
    "conftest.py in the workdir": write("/work/conftest.py", PASS_PLUGIN),
    "conftest.py in the grader's test folder": write("/work/tests/conftest.py", PASS_PLUGIN),
    "pytest.ini with a plugin": AGENTPLUG
    + " && "
    + write("/work/pytest.ini", "[pytest]\naddopts = -p agentplug\n"),
    "tox.ini with a plugin": AGENTPLUG
    + " && "
    + write("/work/tox.ini", "[pytest]\naddopts = -p agentplug\n"),
    "setup.cfg with a plugin": AGENTPLUG
    + " && "
    + write("/work/setup.cfg", "[tool:pytest]\naddopts = -p agentplug\n"),
    "pyproject.toml with a plugin": AGENTPLUG
    + " && "
    + write("/work/pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-p agentplug"\n'),
    "pytest shadowed by a module in the workdir": write("/work/pytest.py", EXIT),
    "pytest shadowed by a package in the workdir": write("/work/pytest/__init__.py", EXIT),
    "json shadowed in the workdir (the tests import it)": write(
        "/work/json.py", "def loads(s):\n    return [42]\n"
    ),
    "sitecustomize in the stdlib (pytest)": write(f"{PY}/sitecustomize.py", EXIT),
}
CHECKER_HACKS = {
    "python3 earlier on PATH": fake_executable("/usr/local/bin/python3", ""),
    "sitecustomize in the stdlib (checker)": write(f"{PY}/sitecustomize.py", CHECK_EXIT),
    "the stdlib's json edited": append(f"{PY}/json/__init__.py", "\nloads = lambda s: [42]\n"),
    "a .pth that exits for the checker": write(
        f"{SITE}/zz.pth", f"import os; exec({CHECK_EXIT!r})\n"
    ),
    "bash replaced (the command runs in it)": "rm -f /usr/bin/bash && "
    + fake_executable("/usr/bin/bash", ""),
    "an editable install's .pth that also executes": write(f"{SITE}/answer.py", "")
    + " && "
    + write(f"{SITE}/__editable__.answer-1.0.pth", f"/work\nimport os; exec({CHECK_EXIT!r})\n"),
}


@pytest.mark.parametrize("name", list(PYTEST_HACKS))
def test_a_hack_on_a_pytest_grader_grades_zero(
    tasks: dict[str, Task], name: str, run_id: str
) -> None:
    result = asyncio.run(attempt(tasks["pytest"], run_id, PYTEST_HACKS[name]))
    assert held(result) is None, held(result)


@pytest.mark.parametrize("name", list(CHECKER_HACKS))
@pytest.mark.parametrize("grader", ["command", "python"])
def test_a_hack_on_a_python_checker_grades_zero(
    tasks: dict[str, Task], grader: str, name: str, run_id: str
) -> None:
    result = asyncio.run(attempt(tasks[grader], run_id, CHECKER_HACKS[name]))
    assert held(result) is None, held(result)


@pytest.mark.parametrize("grader", ["pytest", "command", "python"])
def test_controls_a_no_op_earns_zero_and_the_answer_one(
    tasks: dict[str, Task], grader: str, run_id: str
) -> None:
    async def both() -> list[object]:
        task = tasks[grader]
        return list(await asyncio.gather(attempt(task, run_id, ""), attempt(task, run_id, ANSWER)))

    noop, solved = asyncio.run(both())
    assert held(noop) is None, held(noop)  # type: ignore[arg-type]
    assert getattr(solved, "reward", None) == 1.0, solved


def test_a_declared_pth_keeps_its_paths_and_loses_what_it_would_execute(
    tmp_path: Path, run_id: str
) -> None:
    """A task that lets the agent install a package the grader imports declares its
    `.pth` in `grader.outputs`: the path line stays (the honest install earns 1), the line
    Python would execute at startup does not (the hack earns 0, and the evidence says so)."""
    site = "/usr/local/lib/python3.11/dist-packages"
    grader = {
        "type": "command",
        "command": "python3 -c 'import answer, sys; sys.exit(0 if answer.VALUE == 42 else 1)'",
        "outputs": ["/usr/local/lib/python3*/dist-packages/answer.pth"],
    }
    task = _task(tmp_path / "declared", grader)
    install = write(f"{site}/answer.pth", "/work/pkg\n")
    honest = write("/work/pkg/answer.py", "VALUE = 42\n") + " && " + install
    hack = " && ".join(
        [
            write("/work/pkg/answer.py", "VALUE = 0\n"),
            write(f"{site}/answer.pth", "/work/pkg\nimport os; os._exit(0)\n"),
        ]
    )

    async def both() -> list[object]:
        return list(
            await asyncio.gather(attempt(task, run_id, honest), attempt(task, run_id, hack))
        )

    solved, hacked = asyncio.run(both())
    assert getattr(solved, "reward", None) == 1.0, solved
    assert held(hacked) is None, held(hacked)  # type: ignore[arg-type]
    sealed = hacked.evidence.sealed  # type: ignore[union-attr]
    assert any("executable .pth lines" in d and "os._exit" in d for d in sealed.dropped)


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_run_forged_from_inside_pytest_grades_zero(
    tasks: dict[str, Task], name: str, run_id: str
) -> None:
    """The agent's module, imported by the tests, prints a passing summary and ends the
    process its own way: the witness's record of what pytest concluded decides (0), or the
    session it cut short is its doing (the reference run finishes): never 1.0, never infra."""
    result = asyncio.run(attempt(tasks["imports"], run_id, _solution(FORGERIES[name])))
    assert held(result) is None, held(result)
    assert "witness" in " ".join(
        result.evidence.substitutions + result.evidence.notes + [result.evidence.reference or ""]
    ), result.evidence


def test_controls_the_imported_solution_earns_one_and_a_wrong_one_zero(
    tasks: dict[str, Task], run_id: str
) -> None:
    async def both() -> list[object]:
        task = tasks["imports"]
        return list(
            await asyncio.gather(
                attempt(task, run_id, _solution("")), attempt(task, run_id, SOLVED)
            )
        )

    wrong, solved = asyncio.run(both())
    assert held(wrong) is None, held(wrong)  # type: ignore[arg-type]
    assert getattr(solved, "reward", None) == 1.0, solved


@pytest.mark.parametrize("name", [n for n in FORGERIES if "summary" in n])
def test_the_forgeries_earn_one_when_the_log_is_believed(
    tasks: dict[str, Task], name: str, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each forgery that prints a summary is real: with the test command run bare (no
    witness: its log read as printed, as before), it earns the full reward."""
    from agentrl.tasks import witness

    monkeypatch.setattr(witness, "_wrapped", lambda command, token: command)
    result = asyncio.run(attempt(tasks["imports"], run_id, _solution(FORGERIES[name])))
    assert getattr(result, "reward", None) == 1.0, result
