"""A newcomer's tasks, written from the docs alone, and the traps they hit: a task folder
read as the wrong format, a resume refused over a path's spelling, a broken grader
blamed on the image, a bad script's multi-line parser error, shell braces refused, a
plain `def` grader passing validate, and smaller ones (a missing file without a guess,
an unquoted `: `, a python grader's "exit None", the editor's arguments undocumented).
Real files, the real CLI in a subprocess, real Docker where a sandbox is involved."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from clirun import agentrl

from agentrl.errors import ConfigError
from agentrl.tasks.formats import kind_of, load_any
from agentrl.tasks.load import check_task, load_task
from agentrl.tasks.placeholders import fill, names
from agentrl.yamlfile import ConfigFileError

ROOT = Path(__file__).resolve().parents[1]
ECHO = ROOT / "examples" / "tasks" / "echo-file"
AGENT_DATA = ROOT / "tests" / "data" / "agent"

TASK = """\
name: {name}
sandbox:
  image: agentrl/base:bookworm
  workdir: /workspace
  setup:
{setup}
instances:
  - {{id: one, word: hello}}
prompt:
  system: s
  instance: "Write {{word}} to out.txt, then call finish."
tools: [bash, finish]
limits: {{max_turns: 2, max_new_tokens: 64, context_length: 2048}}
grader:
{grader}
oracle: ["true"]
"""


def _task(folder: Path, grader: str, setup: str = '    - "true"', name: str = "t") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "task.yaml"
    path.write_text(TASK.format(name=name, setup=setup, grader=grader))
    return path


def _cli(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return agentrl(*args, cwd=cwd, env={"COLUMNS": "80"})


# ------------------------------------------------------------- A: a task folder


def test_a_folder_whose_task_yaml_is_an_agentrl_task_loads_as_that_task(tmp_path: Path) -> None:
    done = _cli("validate", ECHO)
    assert done.returncode == 0, done.stderr
    assert "echo-file: ok (2 instances" in done.stdout
    assert kind_of(ECHO) == "task"
    assert load_any(ECHO).hash == load_task(ECHO / "task.yaml").hash  # run, check, eval too
    # Terminal-Bench's task.yaml (instruction:) and Harbor's task.toml are still theirs.
    assert kind_of(ROOT / "tests" / "data" / "terminal" / "uv-bootstrap") == "task-folder"
    assert kind_of(ROOT / "tests" / "data" / "terminal" / "no-python") == "task-folder"
    # A folder that is neither says what it expected, in one line and a fix.
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "task.yaml").write_text("title: nothing I know\n")
    odd = _cli("validate", tmp_path / "odd")
    assert odd.returncode == 1
    lines = odd.stderr.splitlines()
    assert len(lines) == 2 and "instruction: missing" not in odd.stderr, odd.stderr
    assert "neither an agentrl task (name:, prompt:, grader:) nor a Terminal-Bench" in lines[0]
    assert "title" in lines[0] and lines[1].startswith("fix: name a folder holding")


# ------------------------------------------------------------- B: a resume, spelled otherwise


@pytest.mark.docker
@pytest.mark.model
def test_b_a_resume_compares_the_policy_file_not_its_spelling(tmp_path: Path) -> None:
    task = tmp_path / "echo"
    task.mkdir()
    for name in ("echo_task.yaml", "oracle.yaml", "noop.yaml"):
        (task / name).write_text((AGENT_DATA / name).read_text())
    out = tmp_path / "run"
    first = _cli(
        "run",
        "echo/echo_task.yaml",
        "--policy",
        "scripted:echo/oracle.yaml",
        "--out",
        out,
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    again = _cli(
        "run",
        "echo_task.yaml",
        "--policy",
        "scripted:oracle.yaml",
        "--out",
        out,
        "--resume",
        cwd=task,
    )
    assert again.returncode == 0, again.stderr
    assert "2 of 2 episodes already recorded (kept)" in again.stderr
    other = _cli(
        "run",
        "echo_task.yaml",
        "--policy",
        "scripted:noop.yaml",
        "--out",
        out,
        "--resume",
        cwd=task,
    )
    assert other.returncode == 1
    assert f"{out} holds a run of something else (policy" in other.stderr  # not "an evaluation"
    fix = next(ln for ln in other.stderr.splitlines() if ln.startswith("fix:"))
    assert "--out" in fix and "--overwrite" in fix and "same task with the same policy" in fix


# ------------------------------------------------------------- C: a broken grader


@pytest.mark.docker
def test_c_check_reports_a_broken_grader_as_the_graders_fault(tmp_path: Path) -> None:
    python = _task(
        tmp_path / "crashes",
        "  type: python\n  function: grade:score",
        name="crashes",
    )
    (python.parent / "grade.py").write_text(
        "async def score(sandbox, instance):\n"
        "    done = await sandbox.read_file('/etc/hostname')\n"
        "    return float(bool(done) and instance.fields['wrod'] == 'hello')\n"
    )
    command = _task(
        tmp_path / "no-reward-file-written-where-it-is-read",
        "  type: command\n  command: echo 1 > /tmp/reward.txt\n"
        "  reward_file: /tmp/a-long-folder-name/of-rewards/rewards.txt",
        name="misplaced",
    )
    report = tmp_path / "check.json"
    done = _cli("check", python.parent, command, "--json", report)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "agentrl check: the oracle must earn 1.0, doing nothing less"  # unwrapped
    assert [ln for ln in lines if len(ln) > 80 and not ln.startswith("    whole log:")] == []
    rows = {r["task"]: r for r in json.loads(report.read_text())}
    crash, misplaced = rows["crashes"], rows["misplaced"]
    assert crash["verdict"] == misplaced["verdict"] == "oracle: grader broken"
    assert "no tests ran" not in done.stdout and "the image" not in done.stdout
    assert crash["fix"].startswith(
        f"the python grader itself failed at {python.parent / 'grade.py'}:3"
    )
    assert "KeyError: 'wrod'" in done.stdout
    assert "reward_file (/tmp/a-long-folder-name/of-rewards/rewards.txt)" in misplaced["fix"]
    # The detail is below the table, wrapped, never cut off at the edge.
    assert "/tmp/a-long-folder-name/of-rewards/rewards.txt" in " ".join(
        ln.strip() for ln in lines if not ln.strip().startswith("fix:")
    )


# ------------------------------------------------------------- D: a malformed script


def test_d_a_malformed_script_is_one_located_line_and_a_fix(tmp_path: Path) -> None:
    from agentrl.inference.scripted import load_script

    bad = tmp_path / "bad.yaml"
    bad.write_text("- ls\n  - pwd: here\n")
    with pytest.raises(ConfigFileError) as caught:
        load_script(bad)
    (problem,) = caught.value.problems
    assert (problem.file, problem.line, problem.field) == (str(bad), 2, "yaml")
    assert "<unicode string>" not in str(caught.value) and "\n" not in str(caught.value)
    assert caught.value.fix.startswith("write the script as a list of replies")
    colon = tmp_path / "colon.yaml"
    colon.write_text("- ls\n- echo key: value\n")
    with pytest.raises(ConfigFileError) as caught:
        load_script(colon)
    (problem,) = caught.value.problems
    assert (problem.line, problem.field) == (2, "script[1]")
    assert "unquoted `: `" in problem.message and "quote the whole string" in problem.message
    empty = tmp_path / "empty.json"
    empty.write_text("{")
    with pytest.raises(ConfigError) as json_error:
        load_script(empty)
    assert str(json_error.value).startswith(f"{empty}:1: json:") and json_error.value.fix


@pytest.mark.model
def test_d_the_cli_prints_a_bad_script_as_one_line_and_a_fix(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("not a list: {\n")
    done = _cli(
        "run", ECHO, "--policy", "scripted:bad.yaml", "--out", tmp_path / "out", cwd=tmp_path
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith("error: bad.yaml:2: yaml: ") and lines[1].startswith("fix: ")


# ------------------------------------------------------------- E: shell braces


def test_e_a_shell_template_leaves_every_brace_that_is_no_name_as_written(tmp_path: Path) -> None:
    setup = "\n".join(
        f"    - {json.dumps(c)}"
        for c in ['python3 -c "s = {1}"', "echo { } {a-b} {1,2} {1..3}", "echo {word}"]
    )
    path = _task(tmp_path, "  type: command\n  command: test -s out.txt", setup=setup)
    assert check_task(path) == []
    task = load_task(path)
    filled = [task.instances[0].render(c, "shell") for c in task.spec.sandbox.setup]
    assert filled == ['python3 -c "s = {1}"', "echo { } {a-b} {1,2} {1..3}", "echo hello"]
    assert fill("{1} {x}", {"x": "X"}, "shell") == "{1} X"
    # A prompt writes every literal brace doubled: a pair around no name is reported.
    assert [p.name for p in names("a {1} b { } c", "prompt")] == ["1", " "]
    text = path.read_text().replace("Write {word}", "Write {1} {word}")
    (problem,) = check_task(_write(tmp_path / "p.yaml", text))
    assert problem.field == "prompt.instance"
    assert "placeholder {1} names no field: use {field}, or {{ }}" in problem.message


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ------------------------------------------------------------- F: a plain-def grader


def test_f_validate_refuses_a_grader_that_is_not_async_at_its_def_line(tmp_path: Path) -> None:
    path = _task(tmp_path, "  type: python\n  function: grade:score")
    (tmp_path / "grade.py").write_text(
        '"""A grader."""\n\n\ndef score(sandbox, instance):\n    return 1.0\n'
    )
    (problem,) = check_task(path)
    assert (problem.file, problem.line) == (str(tmp_path / "grade.py"), 4)
    assert problem.field == "grader.function"
    assert "write `async def score(sandbox, instance)`" in problem.message
    (tmp_path / "agrade.py").write_text("async def score(sandbox, instance):\n    return 1.0\n")
    assert check_task(_write(path, path.read_text().replace("grade:", "agrade:"))) == []


# ------------------------------------------------------------- G: the smaller ones


def test_g_a_missing_file_names_the_closest_one_in_its_folder(tmp_path: Path) -> None:
    path = _task(tmp_path, "  type: command\n  command: test -s out.txt")
    (tmp_path / "instances.jsonl").write_text('{"id": "a", "word": "x"}\n')
    text = path.read_text().replace(
        "instances:\n  - {id: one, word: hello}", "instances: instance.jsonl"
    )
    text = text.replace(
        "workdir: /workspace", "workdir: /workspace\n  files: {/workspace/app.py: ap.py}"
    )
    (tmp_path / "app.py").write_text("print(1)\n")
    messages = " ".join(p.message for p in check_task(_write(path, text)))
    assert "'instance.jsonl' not found (did you mean 'instances.jsonl'?)" in messages
    assert "'ap.py' not found beside the task (did you mean 'app.py'?)" in messages


def test_g_an_unquoted_colon_in_a_command_gets_the_hint_to_quote_it(tmp_path: Path) -> None:
    path = _task(
        tmp_path, "  type: command\n  command: test -s out.txt", setup="    - echo port: 80"
    )
    (problem,) = check_task(path)
    assert problem.field == "sandbox.setup[0]"
    assert "got a mapping: YAML reads an unquoted `: `" in problem.message


def test_g_failures_says_a_python_grader_has_no_exit_code(tmp_path: Path) -> None:
    from agentrl.cli.episodes import _print_evidence
    from agentrl.cli.output import console
    from agentrl.tasks.evidence import Evidence

    path = tmp_path / "one.json"
    path.write_text(Evidence(grader="python", command="grade:score", output="").model_dump_json())
    with console.capture() as captured:
        _print_evidence(path)
    text = captured.get()
    assert "exit None" not in text
    assert "grader python: grade:score (a function: it has no exit code)" in text


def test_g_the_docs_name_every_argument_of_the_shipped_tools_and_check_json() -> None:
    from agentrl.tools.bash import BashArgs
    from agentrl.tools.editor import EditorArgs
    from agentrl.tools.finish import FinishArgs, SubmitArgs

    doc = (ROOT / "docs" / "tasks.md").read_text()
    for model in (BashArgs, EditorArgs, FinishArgs, SubmitArgs):
        for name in model.model_fields:
            assert f"`{name}`" in doc, (model.__name__, name)
    assert "`--json` keeps all of it" not in doc and "`--json FILE`" in doc
