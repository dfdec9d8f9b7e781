"""A task author's first day (issue 39): every template is filled and escaped one way, and
the pytest grader matches the test ids an author writes the way pytest reports them.

The grading tests run the real pytest of agentrl/base:bookworm in real sandboxes, through
the same INIT and EVAL (grading copy, reference rule) that training uses.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from agentrl.errors import GraderError
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.evidence import Grade
from agentrl.tasks.graders import fill, listed_tests
from agentrl.tasks.load import check_task, load_task
from agentrl.tasks.spec import Instance

HEAD = """\
name: t
sandbox: {{image: agentrl/base:bookworm, workdir: /workspace, setup: {setup}}}
instances: [{{id: one, name: fixed, word: hi}}]
prompt:
  system: You work in a shell.
  instance: Say {{word}}.
tools: [bash]
"""


def _task(tmp_path: Path, grader: str, *, setup: str = "[]", oracle: str = "") -> Path:
    path = tmp_path / "task.yaml"
    path.write_text(HEAD.format(setup=setup) + grader + oracle)
    return path


# ---------------------------------------------------------------- one way to fill


def test_a_literal_brace_in_a_shell_command_is_written_twice(tmp_path: Path) -> None:
    setup = """["awk '{{print}}' /etc/hostname", "echo ${HOME} {a,b} {1..3}"]"""
    oracle = """oracle: ["python3 -c \\"x = 1; print(f'{{x}}')\\" > out.txt"]\n"""
    command = "grader: {type: command, command: 'test \"$(cat out.txt)\" = 1'}\n"
    path = _task(tmp_path, command, setup=setup, oracle=oracle)
    assert check_task(path) == []
    task = load_task(path)
    instance = task.instances[0]
    assert fill(task.spec.sandbox.setup[0], instance) == "awk '{print}' /etc/hostname"
    assert fill(task.spec.sandbox.setup[1], instance) == "echo ${HOME} {a,b} {1..3}"
    assert fill(task.spec.oracle[0], instance) == "python3 -c \"x = 1; print(f'{x}')\" > out.txt"
    # unescaped, awk's {print} reads as a placeholder: refused at its line, not run as `print`
    bare = _task(tmp_path, command, setup="""["awk '{print}' /etc/hostname"]""")
    (problem,) = check_task(bare)
    assert (problem.line, problem.field) == (2, "sandbox.setup[0]")
    assert "placeholder {print}: no instance has a field 'print'" in problem.message


def test_prompts_and_commands_fill_and_escape_one_way() -> None:
    instance = Instance(id="one", fields={"name": "fixed", "n": 3})
    text = "{{literal}} {name}-{id} }}{{"
    assert instance.render(text) == fill(text, instance) == "{literal} fixed-one }{"
    for refused in ("{n:d}", "{n!r}", "{name.upper}", "{name[0]}"):
        for filled in (instance.render, lambda t: fill(t, instance)):
            with pytest.raises(ValueError, match="only plain"):
                filled(refused)
    # the shell keeps its own braces; a prompt says a literal brace with {{ }} only
    shell = "${HOME} {a,b} {1..3} {a..z} {print $1} find -exec rm {} ; {nope}"
    assert fill(shell, instance) == shell
    assert instance.render("costs ${n}") == "costs $3"
    with pytest.raises(ValueError, match="expected '}'"):
        instance.render("{name")


def test_the_task_lists_every_template_it_holds(tmp_path: Path) -> None:
    grader = textwrap.dedent("""\
        grader:
          type: pytest
          command: python3 -m pytest -x {word}
          fail_to_pass: ["/tests/test_x.py::test_{name}"]
          pass_to_pass: []
        """)
    spec = load_task(_task(tmp_path, grader, setup='["echo {word}"]')).spec
    where = {loc: kind for loc, _text, kind in spec.templates()}
    assert where == {
        ("prompt", "system"): "prompt",
        ("prompt", "instance"): "prompt",
        ("sandbox", "setup", 0): "shell",
        ("grader", "command"): "shell",
        ("grader", "fail_to_pass", 0): "shell",
    }


def test_validate_checks_the_placeholders_of_test_ids(tmp_path: Path) -> None:
    ids = 'fail_to_pass: ["/tests/test_x.py::test_{name}"]\n  pass_to_pass: []\n'
    grader = f"grader:\n  type: pytest\n  {ids}"
    assert check_task(_task(tmp_path, grader)) == []
    (problem,) = check_task(_task(tmp_path, grader.replace("{name}", "{nmae}")))
    assert (problem.line, problem.field) == (10, "grader.fail_to_pass[0]")
    assert "placeholder {nmae}: no instance has a field 'nmae' (did you mean 'name'?)" in (
        problem.message
    )


def test_validate_suggests_an_empty_pass_to_pass(tmp_path: Path) -> None:
    grader = 'grader:\n  type: pytest\n  fail_to_pass: ["/tests/test_x.py::test_a"]\n'
    (problem,) = check_task(_task(tmp_path, grader))
    assert problem.field == "grader.pass_to_pass"
    assert "no instance has a field 'PASS_TO_PASS'" in problem.message
    assert "pass_to_pass: []" in problem.message


# ---------------------------------------------------------------- pytest ids, graded

TESTS = """\
import pytest
from answer import answer


def test_fixed():
    assert answer() == 42


def test_keep():
    assert True


@pytest.mark.parametrize("n", range(40))
def test_many(n):
    assert n >= 0
"""
FAKE = """\
def answer():
    # a summary of its own, in its captured output: the real one comes later and wins
    print("=" * 20 + " short test summary info " + "=" * 20)
    for name in ("../tests/test_x.py", "/tests/test_x.py", "test_x.py"):
        print(f"PASSED {name}::test_fixed")
    return 41
"""


def _grade(path: Path, run_id: str, files: dict[str, str]) -> Grade:
    """EVAL of a sandbox where the "agent" left `files` (path -> text)."""
    task = load_task(path)

    async def go() -> Grade:
        env = TaskEnv(task, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(task.instances[0], "author")
        try:
            for where, text in files.items():
                await sandbox.write_file(where, text.encode())
            return await env.evaluate(sandbox, task.instances[0])
        finally:
            await sandbox.close()

    return asyncio.run(go())


def _pytest_task(tmp_path: Path, dest: str, fail_to_pass: str, pass_to_pass: str) -> Path:
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_x.py").write_text(TESTS)
    grader = textwrap.dedent(f"""\
        grader:
          type: pytest
          files: {{{dest}: tests/}}
          fail_to_pass: {fail_to_pass}
          pass_to_pass: {pass_to_pass}
        """)
    return _task(tmp_path, grader)


@pytest.mark.docker
def test_the_pytest_grader_as_the_docs_write_it(tmp_path: Path, run_id: str) -> None:
    # tests copied to /tests, ids absolute: pytest, started in /workspace, reports
    # `../tests/test_x.py::test_fixed`; the grade is keyed by the ids the author wrote
    path = _pytest_task(
        tmp_path, "/tests", '["/tests/test_x.py::test_{name}"]', '["/tests/test_x.py::test_keep"]'
    )
    solved = _grade(path, run_id, {"/workspace/answer.py": "def answer():\n    return 42\n"})
    assert solved.reward == 1.0, solved.evidence.output
    assert solved.evidence.tests == {
        "/tests/test_x.py::test_fixed": "PASSED",
        "/tests/test_x.py::test_keep": "PASSED",
    }
    # the agent's own test of that name and a summary printed by its code match nothing:
    # pytest ran only the listed tests, and its own summary comes last
    planted = {"/workspace/answer.py": FAKE, "/workspace/test_x.py": TESTS.replace("42", "41")}
    wrong = _grade(path, run_id, planted)
    assert wrong.reward == 0.0
    assert wrong.evidence.tests == {
        "/tests/test_x.py::test_fixed": "FAILED",
        "/tests/test_x.py::test_keep": "PASSED",
    }


@pytest.mark.docker
def test_relative_ids_and_a_test_that_does_not_exist(tmp_path: Path, run_id: str) -> None:
    # tests inside the workdir, ids relative to it
    path = _pytest_task(tmp_path, "checks", '["checks/test_x.py::test_fixed"]', "[]")
    solved = _grade(path, run_id, {"/workspace/answer.py": "def answer():\n    return 42\n"})
    assert solved.reward == 1.0, solved.evidence.output
    assert solved.evidence.tests == {"checks/test_x.py::test_fixed": "PASSED"}
    # a listed test that is not there: pytest runs nothing, for the reference too, so the
    # episode cannot be graded (eval_error), and the error says what pytest said (before
    # the 40 tests pytest lists after it)
    gone = _pytest_task(tmp_path, "/tests", '["/tests/test_x.py::test_many[40]"]', "[]")
    with pytest.raises(GraderError) as caught:
        _grade(gone, run_id, {"/workspace/answer.py": "def answer():\n    return 42\n"})
    message = str(caught.value).splitlines()[0]
    assert "reported none of the 1 listed tests" in message
    assert "ERROR: not found: /tests/test_x.py::test_many[40]" in message


def test_an_instance_field_of_test_ids_is_data_not_a_template() -> None:
    instance = Instance(id="i", fields={"name": "a", "F2P": '["t.py::test_{name}"]'})
    assert listed_tests("F2P", instance) == ["t.py::test_{name}"]
    assert listed_tests(["t.py::test_{name}"], instance) == ["t.py::test_a"]
