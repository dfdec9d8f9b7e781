# ruff: noqa: UP031, UP032, PTH100, PTH118, PTH119, PTH120, PTH122
"""agentrl's pytest witness, the plugin half (the grader's half: `agentrl.tasks.witness`).

EVAL writes this file, under a name and into a folder only that grade knows, into the
sandbox it grades, and starts the test command with `PYTEST_PLUGINS` naming it: pytest
imports it before any conftest, test module or code under test. It records what pytest
itself concluded about each test, and once pytest's session has finished it ends the
process with pytest's own exit status, so nothing the code under test registered to run
at exit (`atexit`, a fake summary, `os._exit(0)`) runs. Its records, one JSON line per
event in `sessions.jsonl` beside it:
  {"session": ID, "event": "start", "argv": [...]}      at import, before any test code
  {"session": ID, "event": "end", "exitstatus": N, "interrupted": bool,
   "results": [[STATUS, TEST, DETAIL], ...], "not_run": [TEST, ...]}
"not_run" are the tests a session stopped early (`pytest.exit()`, Ctrl-C) collected and
never decided; such a session never exits 0.
A session with a start and no end was ended from inside (by the code under test) or
killed; a pytest that ran no session (`--version`) ends with `"configured": false`.
Test names are as pytest's `-rA` summary prints them (paths from where pytest started);
DETAIL is a skip's "path:line: reason".

It runs on whatever Python 3 and pytest a task image holds: no f-strings, no annotations.
"""

import atexit
import binascii
import contextlib
import json
import os
import sys

try:
    from pytest import hookimpl as _hookimpl

    _last = _hookimpl(trylast=True)
except ImportError:  # a pytest older than hookimpl (2.8) reads the attribute

    def _last(function):
        function.trylast = True
        return function


_HERE = os.path.dirname(os.path.abspath(__file__))
_RECORDS = os.path.join(_HERE, "sessions.jsonl")
_MODULE = os.path.splitext(os.path.basename(__file__))[0]
_SESSION = "%d-%s" % (os.getpid(), binascii.hexlify(os.urandom(4)).decode())
_state = {
    "config": None,
    "ended": False,
    "results": [],
    "collected": None,
    "decided": set(),
    "interrupted": False,
    "exitstatus": None,
}


def _write(record):
    record["session"] = _SESSION
    line = (json.dumps(record) + "\n").encode("utf-8")
    try:
        fd = os.open(_RECORDS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError:
        return
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _unexport():
    """Leave nothing for a process this one starts: a test's own pytest run (pytester, a
    subprocess) is its business, not a session of the grade."""
    plugins = [p for p in os.environ.get("PYTEST_PLUGINS", "").split(",") if p.strip()]
    plugins = [p for p in plugins if p.strip() != _MODULE]
    if plugins:
        os.environ["PYTEST_PLUGINS"] = ",".join(plugins)
    else:
        os.environ.pop("PYTEST_PLUGINS", None)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths = [p for p in paths if os.path.abspath(p) != _HERE]
    if paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        os.environ.pop("PYTHONPATH", None)


def _unconfigured_exit():
    """A pytest that exits without running a session (`--version`, `--help`, a usage
    error) ends here, after every exit handler registered later. A session that began
    never reaches this: it ends in `pytest_unconfigure`, or, cut short, has no end."""
    if _state["config"] is None and not _state["ended"]:
        _write({"event": "end", "configured": False})


_unexport()
_write({"event": "start", "argv": [str(a) for a in sys.argv[:50]]})
atexit.register(_unconfigured_exit)


def _mine(config):
    return _state["config"] is config


def _name(config, nodeid):
    try:
        return config.cwd_relative_nodeid(nodeid)
    except Exception:
        return nodeid


def pytest_configure(config):
    if _state["config"] is None:  # the outermost session; an in-process nested run is not
        _state["config"] = config


def pytest_collectreport(report):
    config = _state["config"]
    if config is not None and report.failed:
        _state["results"].append(["ERROR", _name(config, report.nodeid), ""])


def pytest_collection_finish(session):
    if _mine(session.config):
        _state["collected"] = [_name(session.config, item.nodeid) for item in session.items]


def pytest_runtest_logreport(report):
    config = _state["config"]
    if config is None:
        return
    name = _name(config, report.nodeid)
    xfail = hasattr(report, "wasxfail")
    status, detail = None, ""
    if report.when == "call":
        if report.passed:
            status = "XPASS" if xfail else "PASSED"
        elif report.failed:
            status = "FAILED"
        elif report.skipped:
            status = "XFAIL" if xfail else "SKIPPED"
    elif report.failed:
        status = "ERROR"
    elif report.skipped:
        status = "XFAIL" if xfail else "SKIPPED"
    if status == "SKIPPED":
        detail = _skip_detail(report)
    if status is not None:
        _state["results"].append([status, name, detail])
        _state["decided"].add(name)


def _skip_detail(report):
    """A skip as `-rA` prints it: "path:line: reason" (the path from where pytest started)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, line, reason = longrepr
        try:
            path = os.path.relpath(str(path))
        except ValueError:
            path = str(path)
        reason = str(reason)
        if reason.startswith("Skipped: "):
            reason = reason[len("Skipped: ") :]
        return "%s:%s: %s" % (path, line, reason)
    return "%s: skipped" % report.nodeid


def pytest_keyboard_interrupt(excinfo):
    _state["interrupted"] = True  # KeyboardInterrupt or pytest.exit(): the run stopped early


def pytest_sessionfinish(session, exitstatus):
    if _mine(session.config):
        _state["exitstatus"] = int(exitstatus)


@_last  # after every other plugin's unconfigure
def pytest_unconfigure(config):
    if not _mine(config):
        return
    status = _state["exitstatus"]
    status = 1 if status is None else status
    collected = _state["collected"] or []
    not_run = [t for t in collected if t not in _state["decided"]] if _state["interrupted"] else []
    if not_run and status == 0:  # `pytest.exit(returncode=0)` with tests left: not a pass
        status = 2
    pending = sys.exc_info()[1]  # what pytest's main would print once this hook returned
    if pending is not None and type(pending).__name__ == "UsageError":
        for message in pending.args:
            sys.stderr.write("ERROR: %s\n\n" % message)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    _state["ended"] = True
    _write(
        {
            "event": "end",
            "configured": True,
            "exitstatus": status,
            "interrupted": _state["interrupted"],
            "results": _state["results"],
            "not_run": not_run,
        }
    )
    os._exit(status)
