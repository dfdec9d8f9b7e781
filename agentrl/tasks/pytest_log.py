"""pytest's text output as the graders read it: the `-rA` short test summary, test ids as
pytest prints them (a file's path from where pytest started), collection and usage errors.
What a run printed is trusted only where no pytest session was witnessed
(`agentrl.tasks.witness`, whose rendering these parsers read the same way).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable

from agentrl.tasks.evidence import DidNotRun, Evidence

PYTEST_STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")

PASSING = ("PASSED", "XFAIL")
"""Statuses a listed test may have for the pytest grader to pass it (as SWE-bench grades)."""

_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")

_COLLECTION_ERROR = re.compile(r"^ERROR (\S+?)(?: - .*)?$|errors? during collection", re.M)

_NODE_ID = re.compile(r"[^\s\[]+(?:\[.*?\])?(?=\s|$)")


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
