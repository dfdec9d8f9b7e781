"""Graders: the sandbox after RUN becomes a reward (EVAL), with the evidence behind it.

Three kinds, declared in `spec.py`: a command (exit code 0 gives 1.0, or the number it
wrote to a reward file), pytest (every FAIL_TO_PASS and PASS_TO_PASS test must pass,
read from the `-rA` summary, where pytest names each test by its path from where it
started), and a python `module:function`. Importers add their own
(Terminal-Bench, Harbor, SWE-bench) on the same models.

Every grade carries `Evidence`: the test command, its exit code, per-test statuses, the
head and tail of its output, and what EVAL did first (processes stopped, protected
paths restored, runtime substitutions). Three outcomes:
- a `Grade`: the tests ran and said something about the agent's work;
- `DidNotRun`: the test command could not run here (missing runner, crash by signal,
  timeout, a collection error, nothing parsed, no reward file). The environment decides
  whose fault that was (`TaskEnv.evaluate` asks the reference solution's sandbox);
- `GraderError`: the grader itself is broken; the episode is eval_error, never a 0.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import posixpath
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ConfigError, GraderError, SandboxError, SandboxFileNotFound
from agentrl.sandbox.base import ExecRequest, ExecResult, Sandbox, Sealed
from agentrl.tasks.spec import CommandGrader, Instance, PytestGrader, PythonGrader, Task

OUTPUT_KEEP_CHARS = 8000
"""Evidence keeps this many characters of output: a quarter from the start, the rest from
the end."""
PYTEST_STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
PASSING = ("PASSED", "XFAIL")
"""Statuses a listed test may have for the pytest grader to pass it (as SWE-bench grades)."""
SIGNAL_EXITS = {132: "SIGILL", 133: "SIGTRAP", 134: "SIGABRT", 135: "SIGBUS", 136: "SIGFPE"}
SIGNAL_EXITS |= {137: "SIGKILL (out of memory?)", 139: "SIGSEGV"}
"""Exit codes (128 + signal) of a test command that died rather than reported."""

_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")
_COLLECTION_ERROR = re.compile(r"^ERROR (\S+?)(?: - .*)?$|errors? during collection", re.M)
_NODE_ID = re.compile(r"[^\s\[]+(?:\[.*?\])?(?=\s|$)")


class Evidence(BaseModel):
    """What a person needs to trust or dispute a grade."""

    model_config = ConfigDict(extra="forbid")

    grader: str = Field(description="command, pytest, python, terminal-bench, harbor, swe-bench")
    command: str = Field(default="", description="the test command, as run")
    exit_code: int | None = Field(default=None, description="its exit code (None: killed)")
    tests: dict[str, str] = Field(
        default_factory=dict, description="test id -> status, as the harness's parser read them"
    )
    output: str = Field(default="", description="head and tail of the test command's output")
    substitutions: list[str] = Field(
        default_factory=list, description="runtime substitutions, e.g. the offline test runtime"
    )
    sealed: Sealed | None = Field(
        default=None, description="processes stopped and protected paths restored before grading"
    )
    tampered: list[str] = Field(
        default_factory=list,
        description="test files the agent changed (restored before the tests ran)",
    )
    notes: list[str] = Field(default_factory=list, description="anything else a person should know")
    reference: str | None = Field(
        default=None,
        description="the tests did not run after the agent's changes: what an untouched "
        "sandbox gave, which decided whether that is the agent's doing (reward 0) or not",
    )


class Grade(BaseModel):
    """What a grader made of one sandbox."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reward: float
    components: dict[str, Any]
    """The grader's raw outputs in brief (exit code, tests passed/failed, resolved, extra keys);
    the trajectory's `reward_components`."""
    evidence: Evidence
    seconds: float


class DidNotRun(GraderError):
    """The test command could not run in this sandbox; `evidence` shows how far it got."""

    def __init__(self, message: str, evidence: Evidence, *, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.evidence = evidence


async def grade(task: Task, instance: Instance, sandbox: Sandbox) -> Grade:
    """Grade `sandbox` with the task's grader; DidNotRun / GraderError as above."""
    grader, started = task.spec.grader, time.monotonic()
    if isinstance(grader, CommandGrader):
        reward, components, evidence = await _command(grader, instance, sandbox)
    elif isinstance(grader, PytestGrader):
        reward, components, evidence = await _pytest(grader, instance, sandbox)
    else:
        reward, components, evidence = await _python(grader, instance, sandbox, task.base_dir)
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


def truncate(text: str, keep: int = OUTPUT_KEEP_CHARS) -> str:
    if len(text) <= keep:
        return text
    head, tail = keep // 4, keep - keep // 4
    return f"{text[:head]}\n[... {len(text) - keep} chars elided ...]\n{text[-tail:]}"


def ran(result: ExecResult, what: str, grader: str, command: str) -> Evidence:
    """Evidence of one test command; DidNotRun if it timed out, was not found or died."""
    evidence = Evidence(
        grader=grader, command=command, exit_code=result.exit_code, output=truncate(result.output)
    )
    if result.timed_out:
        raise DidNotRun(f"{what} timed out after {result.seconds:.0f} s", evidence)
    code = result.exit_code
    if code in (126, 127):
        raise DidNotRun(f"{what} did not run (exit {code}): {tail(result.output)}", evidence)
    if code in SIGNAL_EXITS:
        raise DidNotRun(f"{what} died of {SIGNAL_EXITS[code]} (exit {code})", evidence)
    return evidence


def parse_reward(text: str, source: str) -> tuple[float, dict[str, Any]]:
    """A reward file's number, or a JSON object's `reward` (its other numbers become components)."""
    stripped = text.strip()
    extra: dict[str, Any] = {}
    try:
        reward = float(stripped)
    except ValueError:
        try:
            data = json.loads(stripped)
        except ValueError:
            data = None
        if not isinstance(data, dict) or not _is_number(data.get("reward")):
            raise GraderError(
                f"reward file {source} holds {stripped[:80]!r}: expected a number "
                'or a JSON object with a numeric "reward"'
            ) from None
        reward = float(data["reward"])
        extra = {k: v for k, v in data.items() if k != "reward"}
    if not math.isfinite(reward):
        raise GraderError(f"reward file {source} holds {reward}, not a finite number")
    return reward, extra


def parse_pytest_log(log: str, wanted: Iterable[str] = ()) -> dict[str, str]:
    """Test id -> status from the `short test summary info` sections of a `pytest -rA` log.

    Lines read `STATUS <node id>[ - message]`. A node id may hold spaces inside its
    parametrize brackets; ids in `wanted` are matched exactly first, so those parse
    however odd they are. With several pytest runs in one log, the later status wins.
    """
    known = sorted(set(wanted), key=len, reverse=True)
    statuses: dict[str, str] = {}
    inside = False
    for raw in log.splitlines():
        line = raw.rstrip()
        if _SUMMARY_HEADER.match(line):
            inside = True
            continue
        if not inside:
            continue
        if line.startswith("=") or not line:  # the closing "=== 3 passed in 0.1s ===" line
            inside = False
            continue
        status, _, rest = line.partition(" ")
        if status not in PYTEST_STATUSES or not rest:
            continue
        node = next((w for w in known if rest == w or rest.startswith(w + " ")), None)
        if node is None:
            match = _NODE_ID.match(rest)
            node = match.group(0) if match else rest.split()[0]
        statuses[node] = status
    return statuses


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


def collection_errors(log: str) -> list[str]:
    """What pytest could not collect (a test file that fails to import), from its summary's
    `ERROR path` lines (no `::`: no single test) and its "during collection" notice."""
    found = []
    for match in _COLLECTION_ERROR.finditer(log):
        where = match.group(1)
        if where is None:
            found.append("errors during collection")
        elif "::" not in where:
            found.append(where)
    return list(dict.fromkeys(found))


def check_collected(log: str, evidence: Evidence) -> None:
    """DidNotRun when pytest could not collect some tests (their file fails to import):
    the tests did not run; where they should, the reference decides whose fault it is."""
    errors = collection_errors(log)
    if errors:
        raise DidNotRun(f"pytest could not collect {', '.join(errors[:3])}", evidence)


def count_tests(tests: dict[str, str], passing: Iterable[str] = PASSING) -> dict[str, int]:
    """`tests_passed` / `tests_failed` of a status map, for a trajectory's reward components."""
    ok = set(passing)
    passed = sum(status in ok for status in tests.values())
    return {"tests_passed": passed, "tests_failed": len(tests) - passed}


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
    result = await sandbox.exec(ExecRequest(command=command, timeout=grader.timeout))
    evidence = ran(result, "pytest", "pytest", command)
    tests = match_tests(wanted, result.output, sandbox.spec.workdir)
    evidence.tests = tests
    missing = [t for t, status in tests.items() if status == "MISSING"]
    if missing:
        check_collected(result.output, evidence)
    if len(missing) == len(wanted):
        why = "; ".join(pytest_usage_errors(result.output)[:3]) or tail(result.output)
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


def as_reported(test_id: str, cwd: str) -> str:
    """`test_id` as pytest's summary names it: the file's path from `cwd`, the directory
    pytest started in (`/tests/t.py::x` from /workspace is `../tests/t.py::x`)."""
    path, sep, rest = test_id.partition("::")
    where = posixpath.normpath(posixpath.join(cwd, path))
    return posixpath.relpath(where, cwd) + sep + rest


def match_tests(wanted: list[str], log: str, cwd: str) -> dict[str, str]:
    """Each listed test id -> its status in a `pytest -rA` log ("MISSING": not reported).

    pytest names a test by its file's path from the directory it started in, whatever
    path it was given: an id matches only in that form (an absolute path made relative to
    `cwd`, a relative one normalized), the form no line but pytest's own has for it.
    """
    reported = {test: as_reported(test, cwd) for test in wanted}
    found = parse_pytest_log(log, list(reported.values()))
    return {test: found.get(at, "MISSING") for test, at in reported.items()}


def pytest_usage_errors(log: str) -> list[str]:
    """pytest's own `ERROR: ...` lines (`ERROR: not found: <id>` with the reason after it):
    why it ran nothing."""
    lines = log.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("ERROR: "):
            after = lines[i + 1].strip() if i + 1 < len(lines) else ""
            out.append(f"{line.strip()} {after}" if after.startswith("(") else line.strip())
    return list(dict.fromkeys(out))


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
    if _is_number(value):
        reward, components, output = float(value), {}, ""
    elif isinstance(value, dict) and _is_number(value.get("reward")):
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


def tail(output: str, chars: int = 300) -> str:
    """The end of some output on one line, for an error message."""
    text = " | ".join(line.strip() for line in output.strip().splitlines() if line.strip())
    return ("..." + text[-chars:]) if len(text) > chars else (text or "(no output)")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
