"""Grading the agent's patch in a fresh container, as each format's harness grades:

- swe-bench / swe-gym: the harness's eval script; its log parsed and graded by the
  official `swebench` package (`get_logs_eval`, `get_eval_tests_report`,
  `get_resolution_status`);
- swe-smith: the bug applied to the clean repository, then the patch; the profile's
  verbose pytest on the files of the listed tests;
- r2e-gym: the hidden tests where R2E-Gym's runtime puts them, `run_tests.sh`, every
  parsed status compared with `expected_output_json`.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import tempfile
import time
import tomllib

from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.tasks.evidence import DidNotRun, Evidence, Grade, ran, tail, truncate
from agentrl.tasks.graders import listed_tests
from agentrl.tasks.pytest_log import check_collected
from agentrl.tasks.spec import Instance
from agentrl.tasks.swe import R2E_RUNNER, R2E_TESTS, TEST_TIMEOUT_S, WORKDIR, Format
from agentrl.tasks.swe.harness import CONDA, END, START, _classic, eval_spec
from agentrl.tasks.swe.patch import (
    PATCH_TIMEOUT_S,
    apply_patch,
    blob,
    changed_paths,
    patch_paths,
    put_back,
    snapshot,
    tampered_entry,
)
from agentrl.tasks.swe.rules import (
    config_file_reason,
    files_of_tests,
    how_tests_run_reason,
    runner_files,
)
from agentrl.tasks.witness import Witnessed, run_tests

EVAL_SCRIPT = "/eval.sh"
SWE_SMITH_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
_SMITH_LINE = re.compile(r"^(\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL)\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


async def grade_patch(sandbox: Sandbox, instance: Instance, fmt: Format, patch: str) -> Grade:
    """Grade `patch` in `sandbox`, a fresh container from the instance's image."""
    started = time.monotonic()
    if fmt == "swe-smith":  # the clean repository plus the bug is what the patch fixes
        await sandbox.write_file("/tmp/agentrl-bug.diff", str(instance.fields["patch"]).encode())
        bug = await sandbox.exec(
            ExecRequest(command="git apply /tmp/agentrl-bug.diff", timeout=PATCH_TIMEOUT_S)
        )
        if bug.exit_code != 0:
            evidence = ran(bug, "applying the bug patch", fmt, "git apply")
            raise DidNotRun(f"the row's bug patch does not apply: {tail(bug.output)}", evidence)
    if fmt == "r2e-gym":  # where R2E-Gym's runtime puts the hidden tests
        setup = (
            f"mv {R2E_RUNNER} /root/run_tests.sh && mv {R2E_TESTS} /root/r2e_tests && "
            "ln -s /root/r2e_tests /testbed/r2e_tests"
        )
        done = await sandbox.exec(ExecRequest(command=setup, timeout=60))
        if done.exit_code != 0:
            evidence = ran(done, "moving R2E-Gym's tests", fmt, setup)
            raise DidNotRun(f"the image holds no R2E-Gym tests: {tail(done.output)}", evidence)
    before, paths = "", []
    if patch.strip():  # the tree the patch goes into, and the paths git says it touches
        paths = await patch_paths(sandbox, patch)
        before = await snapshot(sandbox, paths, "before")
    how = await apply_patch(sandbox, patch, before or None)
    if how is None:  # the agent's doing: unresolved, as every harness counts it
        evidence = Evidence(grader=fmt, notes=["the agent's patch does not apply"])
        evidence.output = truncate(patch)
        components = {"resolved": False, "patch_applied": False}
        return Grade(reward=0.0, components=components, evidence=evidence, seconds=0.0)
    tampered = await put_back_test_config(sandbox, instance, fmt, before, paths) if before else []
    try:
        if fmt == "r2e-gym":
            graded = await _grade_r2e(sandbox, instance)
        elif fmt == "swe-smith":
            graded = await _grade_smith(sandbox, instance)
        else:
            graded = await _grade_swebench(sandbox, instance)
    except DidNotRun as failed:
        failed.evidence.tampered += tampered
        raise
    graded.evidence.tampered += tampered
    graded.evidence.notes.insert(0, f"agent's patch: {how or 'empty'}")
    components = {**graded.components, "patch_applied": True}
    return graded.model_copy(
        update={"components": components, "seconds": time.monotonic() - started}
    )


async def put_back_test_config(
    sandbox: Sandbox, instance: Instance, fmt: Format, before: str, paths: list[str]
) -> list[str]:
    """Put back every path the applied patch changed that decides how the tests are
    configured, collected, installed or reported (`how_tests_run_reason`; pyproject.toml
    and setup.cfg when a part about pytest, entry points or installing changed; the test
    command's own scripts; files of an in-tree build backend); `path: why` for each.

    The changes are what git lists between the tree `before` the patch and the tree now,
    ignored files the patch touched (`paths`) included."""
    after = await snapshot(sandbox, paths, "after", start="before")
    changes = await changed_paths(sandbox, before, after)
    if not changes:
        return []
    runners = set(runner_files(_test_command(instance, fmt)))
    backend = await _backend_files(sandbox, before)
    doomed, entries = [], []
    for change in changes:
        name = change.path.rsplit("/", 1)[-1]
        reason = how_tests_run_reason(change.path, instance)
        if reason is None and change.path in runners:
            reason = "a script of the test command"
        if reason is None and any(
            change.path == b or change.path.startswith(f"{b}/") for b in backend
        ):
            reason = "the in-tree build backend (it runs when the package is installed)"
        if reason is None and name in ("pyproject.toml", "setup.cfg"):
            if {change.old_mode, change.new_mode} - {"000000", "100644", "100755"}:
                reason = "not a regular file"
            else:
                old, new = (
                    await blob(sandbox, change.old_blob),
                    await blob(sandbox, change.new_blob),
                )
                reason = config_file_reason(name, old, new)
        if reason is not None:
            doomed.append(change)
            entries.append(tampered_entry(change.path, reason))
    await put_back(sandbox, before, doomed)
    return entries


def _test_command(instance: Instance, fmt: Format) -> str:
    """The test command a format's harness runs for the row (R2E-Gym: none in the tree)."""
    if fmt == "swe-smith":
        return str(instance.fields.get("test_cmd") or SWE_SMITH_TEST_CMD)
    return "" if fmt == "r2e-gym" else _classic(instance.fields)[0]


async def _backend_files(sandbox: Sandbox, tree: str) -> list[str]:
    """An in-tree build backend's files and folders (pyproject's build-system.backend-path:
    each folder but the root whole, and the backend's module in each)."""
    data = await blob(sandbox, f"{tree}:pyproject.toml")
    try:
        build = tomllib.loads((data or b"").decode()).get("build-system", {})
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    folders = build.get("backend-path", []) if isinstance(build, dict) else []
    backend = str(build.get("build-backend", "")) if isinstance(build, dict) else ""
    top = backend.split(":", 1)[0].split(".", 1)[0].strip()
    found = []
    for folder in folders if isinstance(folders, list) else []:
        folder = posixpath.normpath(str(folder))
        if folder.startswith(("..", "/")):
            continue
        found += [] if folder == "." else [folder]
        if top:
            module = posixpath.normpath(posixpath.join(folder, top))
            found += [module, f"{module}.py"]
    return found


async def _grade_swebench(sandbox: Sandbox, instance: Instance) -> Grade:
    """The harness's eval script; its log parsed and graded by the swebench package."""
    from swebench.harness.grading import get_logs_eval

    spec = eval_spec(instance)
    await sandbox.write_file(EVAL_SCRIPT, spec.eval_script.encode())
    command = f"/bin/bash {EVAL_SCRIPT}"
    request = ExecRequest(command=command, timeout=TEST_TIMEOUT_S)
    result, evidence, witnessed = await run_tests(
        sandbox, request, "the eval script", "swe-bench", command
    )
    with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8") as log:
        log.write(_between_markers(result.output, witnessed))
        log.flush()
        status_map, found = get_logs_eval(spec, log.name)
    if not found:
        evidence.tests = {t: "MISSING" for t in spec.FAIL_TO_PASS + spec.PASS_TO_PASS}
        raise DidNotRun(
            f"the eval script's log (exit {result.exit_code}) holds no gradable test results "
            f"({spec.log_parser})",
            evidence,
        )
    graded = resolution(spec.FAIL_TO_PASS, spec.PASS_TO_PASS, status_map, evidence, spec.eval_type)
    if "MISSING" in evidence.tests.values():  # tests that never ran: were they uncollectable?
        check_collected(witnessed.log(result.output), evidence)
    return graded


def _between_markers(output: str, witnessed: Witnessed) -> str:
    """The eval script's log with its test output (between the harness's start and end
    markers, which the script prints before and after the test command) replaced by what
    the witness saw, where it saw a pytest session: the harness reads it as it would."""
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT

    if not witnessed.seen or START_TEST_OUTPUT not in output or END_TEST_OUTPUT not in output:
        return witnessed.log(output)
    before = output.split(START_TEST_OUTPUT, 1)[0]
    after = output.rsplit(END_TEST_OUTPUT, 1)[1]
    return f"{before}{START_TEST_OUTPUT}\n{witnessed.render()}{END_TEST_OUTPUT}{after}"


def _statuses(
    report: dict[str, dict[str, list[str]]], status_map: dict[str, str]
) -> dict[str, str]:
    """Each listed test's status as the parser read it (MISSING: not in the log)."""
    statuses: dict[str, str] = {}
    for outcome in report.values():
        for key, verdict in (("success", "PASSED"), ("failure", "FAILED")):
            for test in outcome.get(key, []):
                statuses[test] = status_map.get(test, verdict if key == "success" else "MISSING")
    return statuses


async def _grade_smith(sandbox: Sandbox, instance: Instance) -> Grade:
    """SWE-smith: the listed tests' files restored, the profile's verbose pytest on them."""
    files = files_of_tests(instance)
    restore = f"git checkout HEAD -- {' '.join(shlex.quote(f) for f in files)}" if files else "true"
    command = str(instance.fields.get("test_cmd") or SWE_SMITH_TEST_CMD)
    script = "\n".join(
        [
            CONDA.strip(),
            f"cd {WORKDIR}",
            restore,
            f": '{START}'",
            " ".join([command, *map(shlex.quote, files)]),
            f": '{END}'",
        ]
    )
    await sandbox.write_file(EVAL_SCRIPT, script.encode())
    run = f"/bin/bash {EVAL_SCRIPT}"
    request = ExecRequest(command=run, timeout=TEST_TIMEOUT_S)
    result, evidence, witnessed = await run_tests(
        sandbox, request, "the tests", "swe-smith", command
    )
    between = witnessed.log(result.output.split(START, 1)[-1].split(END, 1)[0])
    status_map = {}
    for line in between.splitlines():
        match = _SMITH_LINE.match(line)
        if match:
            status_map[match.group(1)] = match.group(2)
    f2p, p2p = listed_tests("FAIL_TO_PASS", instance), listed_tests("PASS_TO_PASS", instance)
    if not status_map:
        evidence.tests = {t: "MISSING" for t in f2p + p2p}
        raise DidNotRun(f"the tests (exit {result.exit_code}) reported no results", evidence)
    return resolution(f2p, p2p, status_map, evidence)


def resolution(
    f2p: list[str],
    p2p: list[str],
    status_map: dict[str, str],
    evidence: Evidence,
    eval_type: str = "pass_and_fail",
) -> Grade:
    """The harness's verdict on parsed statuses: resolved (1.0) when every FAIL_TO_PASS and
    PASS_TO_PASS test passed, by swebench's rules (truncated ids, skips, missing tests)."""
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, EvalType, ResolvedStatus
    from swebench.harness.grading import get_eval_tests_report, get_resolution_status

    wanted = {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p}
    report = get_eval_tests_report(status_map, wanted, eval_type=EvalType(eval_type))
    resolved = get_resolution_status(report) == ResolvedStatus.FULL.value
    evidence.tests = _statuses(report, status_map)
    components = {
        "resolved": resolved,
        "fail_to_pass": f"{len(report[FAIL_TO_PASS]['success'])}/{len(f2p)}",
        "pass_to_pass": f"{len(report[PASS_TO_PASS]['success'])}/{len(p2p)}",
    }
    return Grade(
        reward=1.0 if resolved else 0.0, components=components, evidence=evidence, seconds=0.0
    )


async def _grade_r2e(sandbox: Sandbox, instance: Instance) -> Grade:
    """R2E-Gym: run_tests.sh; reward 1.0 when the parsed statuses equal the expected ones."""
    command = "cd /testbed && bash /root/run_tests.sh"
    path = "PATH=/root/.venv/bin:/root/.local/bin:/testbed/.venv/bin:$PATH; "
    request = ExecRequest(command=path + command, timeout=300)
    result, evidence, witnessed = await run_tests(
        sandbox, request, "run_tests.sh", "r2e-gym", command
    )
    parsed = parse_r2e_log(witnessed.log(result.output))
    expected = {
        k.split(" - ")[0]: v for k, v in json.loads(instance.fields["expected_output_json"]).items()
    }
    evidence.tests = parsed
    if not parsed:
        raise DidNotRun(f"run_tests.sh (exit {result.exit_code}) reported no results", evidence)
    matched = len(parsed) == len(expected) and all(parsed.get(k) == v for k, v in expected.items())
    differ = sorted(k for k in expected.keys() | parsed.keys() if parsed.get(k) != expected.get(k))
    if differ:
        evidence.notes.append(
            f"{len(differ)} tests differ from expected_output_json: {differ[:10]}"
        )
    components = {"resolved": matched, "tests_expected": len(expected), "tests_differ": len(differ)}
    return Grade(
        reward=1.0 if matched else 0.0, components=components, evidence=evidence, seconds=0.0
    )


def parse_r2e_log(log: str) -> dict[str, str]:
    """R2E-Gym's parse: after `short test summary info`, `Class.test` (no file) -> status."""
    text = _ANSI.sub("", log).replace("\r", "")
    if "short test summary info" not in text:
        return {}
    statuses: dict[str, str] = {}
    for line in text.split("short test summary info", 1)[1].splitlines():
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                key = ".".join(line.split("::")[1:]).split(" - ")[0].strip()
                if key:
                    statuses[key] = status
                break
    return statuses
