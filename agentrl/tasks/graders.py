"""Graders: the sandbox after RUN becomes a reward (EVAL), with the evidence behind it.

Three kinds, declared in `spec.py`: a command (exit code 0 gives 1.0, or the number it
wrote to a reward file), pytest (every FAIL_TO_PASS and PASS_TO_PASS test must pass, as
pytest reported them to the witness: `witness.py`; the ids matched as pytest names them:
`pytest_log.py`), and a python `module:function`. Importers add their own
(Terminal-Bench, Harbor, SWE-bench) on the same models (`evidence.py`).

Every grade carries `Evidence`: the test command, its exit code, per-test statuses, the
head and tail of its output, and what EVAL did first (processes stopped, protected
paths restored, runtime substitutions). Three outcomes:
- a `Grade`: the tests ran and said something about the agent's work;
- `DidNotRun`: the test command could not run here (missing runner, crash by signal,
  timeout, a collection error, nothing parsed, no reward file, a pytest session cut
  short). The environment decides whose fault that was (`TaskEnv.evaluate` asks the
  reference solution's sandbox);
- `GraderError`: the grader itself is broken; the episode is eval_error, never a 0.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from agentrl.errors import ConfigError, GraderError, SandboxError, SandboxFileNotFound
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.tasks.evidence import (
    DidNotRun,
    Evidence,
    Grade,
    is_number,
    parse_reward,
    ran,
    tail,
)
from agentrl.tasks.pytest_log import (
    PASSING,
    check_collected,
    count_tests,
    match_tests,
    pytest_usage_errors,
)
from agentrl.tasks.spec import CommandGrader, Instance, PytestGrader, PythonGrader, Task
from agentrl.tasks.witness import run_tests


async def grade(task: Task, instance: Instance, sandbox: Sandbox) -> Grade:
    """Grade `sandbox` with the task's grader; DidNotRun / GraderError as above."""
    grader, started = task.spec.grader, time.monotonic()
    if isinstance(grader, CommandGrader):
        reward, components, evidence = await _command(grader, instance, sandbox)
    elif isinstance(grader, PytestGrader):
        reward, components, evidence = await _pytest(grader, instance, sandbox)
    elif isinstance(grader, PythonGrader):
        reward, components, evidence = await _python(grader, instance, sandbox, task.base_dir)
    else:
        raise ConfigError(
            f"{task.path}: grader type environment takes the rewards of an environment's "
            "steps, and this task's sandbox is no environment",
            fix="use it with an OpenEnv environment (docs/tasks.md#openenv-environments), or "
            "grade with a command, pytest or python grader",
        )
    return Grade(
        reward=reward,
        components=components,
        evidence=evidence,
        seconds=time.monotonic() - started,
    )


def fill(template: str, instance: Instance) -> str:
    """A shell template with instance fields (and `id`) in its `{name}` placeholders and
    `{{ }}` as literal braces; the shell's own braces (`${VAR}`, `{a,b}`) stay as written
    (`agentrl.tasks.placeholders`)."""
    return instance.render(template, "shell")


def listed_tests(value: list[str] | str, instance: Instance) -> list[str]:
    """Test ids given inline (their `{field}` placeholders filled), or named by an instance
    field (a list, or JSON text of one: data, taken as it is); always a new list, so a
    caller that extends it changes no instance."""
    if isinstance(value, list):  # the task's own: templates, like its commands
        return [fill(test, instance) for test in value]
    if value not in instance.fields:
        return []
    field = instance.fields[value]
    if isinstance(field, str):
        try:
            field = json.loads(field) if field.strip() else []
        except ValueError:
            raise GraderError(
                f"instance {instance.id}: field {value} is not a JSON list of test ids"
            ) from None
    if not isinstance(field, list) or not all(isinstance(t, str) for t in field):
        raise GraderError(f"instance {instance.id}: field {value} must list test ids (strings)")
    return list(field)


async def _command(
    grader: CommandGrader, instance: Instance, sandbox: Sandbox
) -> tuple[float, dict[str, Any], Evidence]:
    reward_file = fill(grader.reward_file, instance) if grader.reward_file else None
    if reward_file:  # a file the agent left there must not count
        await sandbox.exec(ExecRequest(command=["rm", "-f", reward_file], timeout=30))
    command = fill(grader.command, instance)
    result = await sandbox.exec(ExecRequest(command=command, timeout=grader.timeout))
    evidence = ran(result, "the grader command", "command", command)
    components: dict[str, Any] = {"exit_code": result.exit_code}
    if reward_file is None:
        return (1.0 if result.exit_code == 0 else 0.0), components, evidence
    try:
        data = await sandbox.read_file(reward_file)
    except SandboxFileNotFound:
        raise DidNotRun(
            f"the grader command exited {result.exit_code} and wrote no reward file "
            f"{reward_file}: {tail(result.output)}",
            evidence,
            fix=f"make grader.command write its reward to {reward_file}, or set "
            "grader.reward_file to the path it writes",
        ) from None
    reward, extra = parse_reward(data.decode(errors="replace"), reward_file)
    return reward, {**components, **extra}, evidence


async def _pytest(
    grader: PytestGrader, instance: Instance, sandbox: Sandbox
) -> tuple[float, dict[str, Any], Evidence]:
    fail_to_pass = listed_tests(grader.fail_to_pass, instance)
    pass_to_pass = listed_tests(grader.pass_to_pass, instance)
    wanted = list(dict.fromkeys(fail_to_pass + pass_to_pass))
    if not wanted:
        raise GraderError(f"instance {instance.id}: the pytest grader lists no tests to run")
    command = fill(grader.command, instance)
    if "-rA" not in command.split():
        command += " -rA"
    command += " " + " ".join(shlex.quote(t) for t in wanted)
    request = ExecRequest(command=command, timeout=grader.timeout)
    result, evidence, witnessed = await run_tests(sandbox, request, "pytest", "pytest", command)
    log = witnessed.log(result.output)
    tests = match_tests(wanted, log, sandbox.spec.workdir)
    evidence.tests = tests
    missing = [t for t, status in tests.items() if status == "MISSING"]
    usage = pytest_usage_errors(result.output)  # `ERROR: not found: <id>`: the ids are wrong
    if missing and not (usage and len(missing) == len(wanted)):
        check_collected(log, evidence)
    if len(missing) == len(wanted):
        why = "; ".join(usage[:3]) or tail(result.output)
        raise DidNotRun(
            f"pytest (exit {result.exit_code}) reported none of the {len(wanted)} listed "
            f"tests: {why}",
            evidence,
        )
    if missing:
        note = f"pytest reported no result for {len(missing)} listed tests"
        evidence.notes.append(f"{note}: {', '.join(missing[:5])}")
    reward = 1.0 if all(s in PASSING for s in tests.values()) else 0.0
    return reward, {"exit_code": result.exit_code, **count_tests(tests)}, evidence


async def _python(
    grader: PythonGrader, instance: Instance, sandbox: Sandbox, base_dir: str
) -> tuple[float, dict[str, Any], Evidence]:
    fn = load_function(grader.function, Path(base_dir))
    try:
        value = fn(sandbox, instance)
        if inspect.isawaitable(value):
            value = await asyncio.wait_for(value, grader.timeout)
    except TimeoutError:
        raise GraderError(
            f"grader {grader.function} timed out after {grader.timeout:g} s"
        ) from None
    except (GraderError, SandboxError):
        raise
    except Exception as exc:
        raise GraderError(f"grader {grader.function} crashed: {type(exc).__name__}: {exc}") from exc
    if isinstance(value, Grade):  # an importer's grader, with its own evidence
        return value.reward, value.components, value.evidence
    if is_number(value):
        reward, components, output = float(value), {}, ""
    elif isinstance(value, dict) and is_number(value.get("reward")):
        reward, output = float(value["reward"]), str(value.get("output", ""))
        components = {k: v for k, v in value.items() if k not in ("reward", "output")}
    else:
        raise GraderError(
            f"grader {grader.function} returned {type(value).__name__}: "
            'expected a number or a dict with a numeric "reward"'
        )
    if not math.isfinite(reward):
        raise GraderError(f"grader {grader.function} returned a reward of {reward}")
    return reward, components, Evidence(grader="python", command=grader.function, output=output)


def load_function(path: str, base_dir: Path) -> Callable[..., Any]:
    """`module:function`, importable, or a module file beside the task (`grade.py` for `grade`)."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        file = base_dir.joinpath(*module_name.split(".")).with_suffix(".py")
        if exc.name is None or not module_name.startswith(exc.name) or not file.is_file():
            raise ConfigError(f"grader {path}: cannot import {module_name}: {exc}") from exc
        module = _load_file(file, module_name)
    except Exception as exc:  # importing user code may raise anything
        raise ConfigError(f"grader {path}: importing {module_name} failed: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"grader {path}: {module_name} has no function {attr}")
    return cast(Callable[..., Any], fn)


def _load_file(file: Path, module_name: str) -> Any:
    key = f"agentrl_task_graders.{module_name}.{abs(hash(str(file.resolve())))}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load grader module {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[key]
        raise ConfigError(f"grader module {file} fails to import: {exc}") from exc
    return module
