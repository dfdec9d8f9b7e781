"""Task files: every malformed one gives `file:line: field: message`, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import agentrl

from agentrl.errors import ConfigError
from agentrl.tasks.load import TaskError, check_task, load_task, parse_test_ids

DATA = Path(__file__).parent / "data"
GOOD = DATA / "tasks" / "hello.yaml"
BAD = DATA / "bad_tasks"

# Each malformed file -> its problems, in order, as `line: field: message substring`
# (`file:line: ...` when the problem is in a file the task names).
CASES: dict[str, list[str]] = {
    "yaml_syntax.yaml": ["16: yaml: expected <block end>, but found '<block mapping start>'"],
    "top_level_list.yaml": ["2: task: the top level should be a mapping"],
    "empty.yaml": ["1: task: the file is empty"],
    "unknown_key.yaml": ["18: toolz: unknown key 'toolz' (did you mean 'tools'?)"],
    "unknown_nested_key.yaml": ["5: sandbox.imgae: unknown key 'imgae' (did you mean 'image'?)"],
    "wrong_type.yaml": ["22: limits.max_turns: should be a valid integer, got 'ten'"],
    "negative_limit.yaml": ["22: limits.max_turns: should be greater than or equal to 1, got -3"],
    "tokens_over_context.yaml": [
        "21: limits: max_new_tokens (4096) must be below context_length (4096)"
    ],
    "tool_timeout_over_episode.yaml": [
        "21: limits: tool_timeout (600 s) is longer than episode_timeout (300 s)"
    ],
    "missing_prompt.yaml": ["2: prompt: required key 'prompt' is missing"],
    "missing_grader.yaml": ["2: grader: required key 'grader' is missing"],
    "unknown_grader_type.yaml": [
        "28: grader.type: unknown grader type 'comand' (did you mean 'command'?); "
        "valid: command, pytest, python"
    ],
    "grader_missing_command.yaml": ["27: grader.command: required key 'command' is missing"],
    "grader_not_mapping.yaml": ["27: grader: should be a mapping (key: value), got 'test -f"],
    "placeholder_no_field.yaml": [
        "17: prompt.instance: placeholder {filname}: no instance has a field 'filname' "
        "(did you mean 'filename'?)"
    ],
    "placeholder_one_instance.yaml": [
        "17: prompt.instance: placeholder {filename}: instance 'notes' has no field 'filename' "
        "(did you mean 'file_name'?)",
        "29: grader.command: placeholder {filename}: instance 'notes' has no field 'filename'",
    ],
    "placeholder_deep_in_block.yaml": [
        "16: prompt.system: placeholder {home}: no instance has a field 'home'"
    ],
    "shell_variable.yaml": [
        "17: prompt.instance: placeholder {HOME}: no instance has a field 'HOME'; "
        "fields: filename; for a shell variable write ${{HOME}}"
    ],
    "bash_block_without_bash.yaml": [
        "11: prompt.action_format: bash_block runs its blocks in the bash tool: list bash under"
    ],
    "bad_snapshots_and_stop.yaml": [
        "31: sampling.stop: stop strings must not be empty",
        "34: snapshots.keep_successful: should be less than or equal to 1, got 1.5",
    ],
    "duplicate_ids.yaml": ["10: instances[1].id: duplicate id 'readme' (first on line 8)"],
    "instance_without_id.yaml": ["10: instances[1]: instance has no 'id'"],
    "instances_wrong_type.yaml": ["7: instances: should be a list or a string, got 5"],
    "instances_file_missing.yaml": ["7: instances: 'no_such_file.jsonl' not found"],
    "instances_bad_line.yaml": [
        "bad_line.jsonl:3: instances[2]: invalid JSON: Expecting ',' delimiter"
    ],
    "instances_file_no_id.yaml": ["no_id.csv:3: instances[1].id: id is empty"],
    "unknown_tool.yaml": [
        "19: tools[0]: unknown tool 'bsh' (did you mean 'bash'?); registered: bash, browser"
    ],
    "tool_entry_typo.yaml": ["20: tools[1].nme: unknown key 'nme' (did you mean 'name'?)"],
    "bad_tool_option.yaml": [
        "21: tools[0].options.timout: BashTool has no option 'timout' (did you mean 'timeout'?)"
    ],
    "bad_tool_option_type.yaml": [
        "21: tools[0].options.timeout: should be a valid number, got 'soon'"
    ],
    "missing_grader_file.yaml": [
        "31: grader.files[\"/tests/check.sh\"]: 'check.sh' not found beside the task"
    ],
    "missing_recipe.yaml": ["5: sandbox.recipe: recipe folder 'recipes/hello' not found"],
    "image_and_recipe.yaml": ["4: sandbox: give either `image` or `recipe`, not both"],
    "python_grader_not_importable.yaml": [
        "29: grader.function: grader no_such_module.graders:grade: cannot import no_such_module"
    ],
    "pytest_field_missing.yaml": ["29: grader.fail_to_pass: no instance has a field 'FAIL_TO_PAS'"],
    "bad_task_name.yaml": ["2: name: 'hello world' does not match the pattern"],
    "duplicate_key.yaml": ["3: name: duplicate key (first on line 2)"],
    "several_problems.yaml": [
        "2: name: 'hello world' does not match",
        "5: sandbox.imgae: unknown key 'imgae' (did you mean 'image'?)",
        "22: limits.max_turns: should be a valid integer, got 'ten'",
        "28: grader.type: unknown grader type 'comand'",
    ],
}


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return agentrl("validate", *args, timeout=120)


def _write(tmp_path: Path, text: str, name: str = "task.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_bad_file_has_an_expectation():
    assert sorted(p.name for p in BAD.glob("*.yaml")) == sorted(CASES)
    assert len(CASES) >= 22


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_task_reports_line_field_and_message(name: str):
    problems = check_task(BAD / name)
    assert len(problems) == len(CASES[name]), "\n".join(map(str, problems))
    for problem, expected in zip(problems, CASES[name], strict=True):
        where, field, message = expected.split(": ", 2)
        file, _, line = where.rpartition(":")
        assert Path(problem.file).name == (file or name), problem
        assert (problem.line, problem.field) == (int(line), field), problem
        assert message in problem.message, problem
        assert str(problem) == f"{problem.file}:{problem.line}: {problem.field}: {problem.message}"


def test_cli_good_task_is_ok():
    res = _run(GOOD)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{GOOD}: ok (2 instances, agentrl task)"
    assert res.stderr == ""


def test_cli_bad_tasks_one_line_per_problem_and_no_traceback():
    files = sorted(BAD.glob("*.yaml"))
    res = _run(GOOD, *files)
    assert res.returncode == 1
    assert "Traceback" not in res.stdout + res.stderr
    *lines, fix = res.stderr.splitlines()
    assert len(lines) == sum(len(v) for v in CASES.values()), res.stderr
    assert all(line.startswith(str(BAD)) for line in lines), res.stderr
    assert fix.startswith("fix: "), res.stderr
    assert res.stdout.strip() == f"{GOOD}: ok (2 instances, agentrl task)"


def test_cli_reports_every_problem_of_one_file():
    path = BAD / "several_problems.yaml"
    res = _run(path)
    assert res.returncode == 1
    assert [ln.split(": ", 2)[:2] for ln in res.stderr.splitlines()] == [
        [f"{path}:2", "name"],
        [f"{path}:5", "sandbox.imgae"],
        [f"{path}:22", "limits.max_turns"],
        [f"{path}:28", "grader.type"],
        ["fix", "fix each problem above, then check again with"],
    ]


def test_cli_rejects_what_is_neither_task_nor_trajectories(tmp_path):
    res = _run(_write(tmp_path, "x", "notes.txt"), tmp_path / "missing.yaml")
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert res.stderr.splitlines() == [
        f"{tmp_path}/notes.txt: neither a task (.yaml/.yml, a folder with task.yaml) nor "
        "trajectories (.jsonl)",
        f"{tmp_path}/missing.yaml:1: task: file not found",
        "fix: name a task file or folder, a train config, rows or trajectories",
        "fix: fix each problem above, then check again with: agentrl validate FILE",
    ]


def test_load_good_task_has_instances_fields_and_a_stable_hash(tmp_path):
    task = load_task(GOOD)
    assert [(i.id, i.fields) for i in task.instances] == [
        ("readme", {"filename": "README.txt"}),
        ("notes", {"filename": "notes.md"}),
    ]
    assert task.instances[1].render(task.spec.grader.command) == "test -f /workspace/notes.md"
    assert task.base_dir == str(GOOD.parent.resolve())
    assert len(task.hash) == 16
    assert load_task(GOOD).hash == task.hash
    moved = shutil.copy(GOOD, tmp_path / "hello.yaml")
    assert load_task(moved).hash == task.hash  # where the task lives does not matter
    Path(moved).write_text(GOOD.read_text().replace("notes.md", "notes.txt"))
    assert load_task(moved).hash != task.hash


def test_load_bad_task_raises_task_error_with_all_problems():
    with pytest.raises(TaskError) as info:
        load_task(BAD / "several_problems.yaml")
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    assert len(info.value.problems) == 4
    assert str(info.value).splitlines() == [str(p) for p in info.value.problems]
    assert info.value.fix


TASK = """\
name: t
instances: {instances}
prompt:
  system: "Use {{{{braces}}}} literally; instance {{id}}."
  instance: "{{question}}"
tools: [bash]
grader:
  type: command
  command: test "$(cat /workspace/answer)" = "{{answer}}"
"""


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("rows.jsonl", '{"id": 1, "question": "q1", "answer": "a"}\n\n{"id": 2, "question": "q2", '
         '"answer": "b"}\n'),
        ("rows.json", json.dumps([{"id": 1, "question": "q1", "answer": "a"},
                                  {"id": 2, "question": "q2", "answer": "b"}], indent=1)),
        ("rows.yaml", "- {id: 1, question: q1, answer: a}\n- {id: 2, question: q2, answer: b}\n"),
        ("rows.csv", "id,question,answer\n1,q1,a\n2,q2,b\n"),
    ],
)  # fmt: skip
def test_instances_from_a_file_beside_the_task(tmp_path, name, text):
    _write(tmp_path, text, name)
    task = load_task(_write(tmp_path, TASK.format(instances=name)))
    assert [i.id for i in task.instances] == ["1", "2"]  # int ids become strings
    assert task.instances[0].fields == {"question": "q1", "answer": "a"}
    assert (
        task.instances[0].render(task.spec.prompt.system) == "Use {braces} literally; instance 1."
    )
    before = task.hash
    (tmp_path / name).write_text(text.replace("q2", "q3"))
    assert load_task(tmp_path / "task.yaml").hash != before  # the hash covers the instances file


def test_bad_entries_in_an_instances_file_point_into_it(tmp_path):
    _write(
        tmp_path, "- id: a\n  question: q\n  answer: x\n- [1, 2]\n- id: a\n  answer: y\n", "r.yaml"
    )
    problems = check_task(_write(tmp_path, TASK.format(instances="r.yaml")))
    shown = [(Path(p.file).name, p.line, p.field, p.message) for p in problems]
    assert shown == [
        ("r.yaml", 4, "instances[1]", "an instance should be a mapping of fields, got a list"),
        ("r.yaml", 5, "instances[2].id", "duplicate id 'a' (first on line 1)"),
    ]


def test_pytest_grader_takes_lists_or_json_strings_as_swe_bench_publishes(tmp_path):
    rows = [
        {"id": "ok", "FAIL_TO_PASS": '["t.py::test_a"]', "PASS_TO_PASS": ["t.py::test_b"]},
        {"id": "bad", "FAIL_TO_PASS": "t.py::test_a", "PASS_TO_PASS": []},
    ]
    _write(tmp_path, "\n".join(map(json.dumps, rows)), "rows.jsonl")
    text = TASK.format(instances="rows.jsonl").split("grader:")[0]
    text = text.replace("{question}", "fix it") + "grader:\n  type: pytest\n"
    problems = check_task(_write(tmp_path, text))
    assert [(p.line, p.field) for p in problems] == [(7, "grader.fail_to_pass")]  # the default
    assert "field 'FAIL_TO_PASS' of instance 'bad' is not a list of test ids" in problems[0].message
    assert parse_test_ids('["a", "b"]') == ["a", "b"]
    assert parse_test_ids(["a"]) == ["a"]
    assert parse_test_ids("a") is None
    assert parse_test_ids("") == []  # SWE-bench rows with no PASS_TO_PASS


def test_a_template_with_an_unmatched_brace_is_a_problem(tmp_path):
    inline = '[{id: 1, question: q, answer: "a"}]'
    text = TASK.format(instances=inline).replace('"{question}"', '"{question"')
    (problem,) = check_task(_write(tmp_path, text))
    assert (problem.line, problem.field) == (5, "prompt.instance")
    assert "expected '}'" in problem.message and "{{" in problem.message


def test_grader_command_leaves_shell_braces_alone(tmp_path):
    # The command grader fills only {field}: ${VAR} and awk's {...} go to the shell as written.
    inline = '[{id: 1, question: q, answer: "a"}]'
    command = 'test "$(awk \'{print $1}\' ${HOME}/answer)" = "{answer}"'
    text = TASK.format(instances=inline).split("  command:")[0] + f"  command: |\n    {command}\n"
    assert check_task(_write(tmp_path, text)) == []
    (problem,) = check_task(_write(tmp_path, text.replace("{answer}", "{anser}")))
    assert (problem.line, problem.field) == (10, "grader.command")  # inside the `|` block
    assert "placeholder {anser}: no instance has a field 'anser' (did you mean 'answer'?)" in str(
        problem
    )


def test_python_grader_module_beside_the_task(tmp_path):
    inline = '[{id: 1, question: q, answer: "a"}]'
    text = TASK.format(instances=inline).split("grader:")[0]
    text += "grader:\n  type: python\n  function: my_grade:grade\n"
    (tmp_path / "my_grade.py").write_text("async def grade(sandbox, instance):\n    return 1.0\n")
    before = load_task(_write(tmp_path, text)).hash
    (tmp_path / "my_grade.py").write_text("async def grade(sandbox, instance):\n    return 0.5\n")
    assert load_task(tmp_path / "task.yaml").hash != before  # the hash covers the module
    (problem,) = check_task(_write(tmp_path, text.replace(":grade", ":grad")))
    assert (problem.line, problem.field) == (9, "grader.function")
    assert "has no function grad" in problem.message


def test_check_task_never_raises_on_mangled_files(tmp_path):
    lines = GOOD.read_text().splitlines(keepends=True)
    variants = [lines[:i] + lines[i + 1 :] for i in range(len(lines))]  # each line dropped
    variants += [lines[:i] for i in range(len(lines))]  # truncated
    variants += [[ln.replace(":", "", 1) for ln in lines], [ln.lstrip() for ln in lines]]
    for i, variant in enumerate(variants):
        path = _write(tmp_path, "".join(variant), f"v{i}.yaml")
        for problem in check_task(path):
            assert problem.line >= 1 and problem.field and problem.message
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    assert check_task(tmp_path / "bin.yaml")[0].field == "task"
    (folder_problem,) = check_task(tmp_path)  # a folder as a task file: a problem, no crash
    assert folder_problem.message == "is a folder, not a file"


@pytest.mark.parametrize(
    "config",
    [
        "examples/train/shell-basics.yaml",
        "examples/train/shell-basics-tinker.yaml",
        "examples/train/look-then-act-branch.yaml",
    ],
)
def test_validating_a_train_config_imports_no_torch_transformers_tinker_or_ray(config):
    """Configs live apart from what they configure: `agentrl validate` of a train config
    (both backends) loads none of the heavy libraries, so it answers in well under a
    second instead of after importing torch."""
    root = Path(__file__).parents[1]
    code = (
        "import sys\n"
        "from agentrl.cli import main\n"
        f"assert main(['validate', {str(root / config)!r}]) == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'tinker', 'ray') if m in sys.modules]\n"
        "assert not heavy, f'imported: {heavy}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
