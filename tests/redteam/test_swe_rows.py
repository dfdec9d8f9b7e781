"""Red-team SWE-bench rows: patches that do not fix the bug but change how the tests are
configured, collected, installed or reported must earn nothing.

One local row (calc.py whose add() subtracts; test_patch adds tests/test_calc.py) in the
swe-bench format, graded as the harness grades it: the eval script applies test_patch and
runs `python3 -m pytest -rA` on the test file. Each hack below is played as an agent
would play it (files written in its sandbox, its git config changed), then graded by
`SweBenchEnv.evaluate`; each must earn 0 and the evidence must name the path put back.
Some of the attacks are first shown to earn 1.0 with the filtering turned off, so these
tests prove the defence and not a harmless attack. Controls: the genuine fix earns 1.0
(with a harmless pyproject.toml change too), doing nothing 0.

Known limit (`test_a_patch_that_detects_the_test_runner_is_not_caught`): code under test
that behaves differently under pytest fools the official harness too; it is not blocked.
"""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hacking import forgeries, summary
from swe_fixtures import CALC, TESTS, remove_images, write_rows

from agentrl.sandbox.base import ExecRequest
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.evidence import Grade
from agentrl.tasks.spec import Instance, Task
from agentrl.tasks.swe.env import SweBenchEnv
from agentrl.tasks.swe.grade import grade_patch
from agentrl.tasks.swe.patch import split_diff
from agentrl.tasks.swe.rows import load_swe_bench
from agentrl.tasks.swe.rules import config_file_reason, how_tests_run_reason, runner_files

pytestmark = pytest.mark.redteam

ROW_ID = "redteam__calc-1"
IMAGES = (f"agentrl/swe-{ROW_ID}", f"agentrl/swe-start-{ROW_ID}")
BUGGY = CALC.replace("    return a + b", "    return a - b")
TEST_FILE = "tests/test_calc.py"
SETUP = "from setuptools import setup\n\nsetup(name='calc', py_modules=['calc'])\n"
PYPROJECT = '[project]\nname = "calc"\nversion = "1.0"\n\n[tool.black]\nline-length = 100\n'
PLUGIN = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    report = outcome.get_result()\n"
    '    report.outcome, report.longrepr = "passed", None\n'
)
"""A pytest plugin that reports every test passed (as a module, or a conftest.py)."""
FAKE_TESTS = (
    "def test_add():\n    pass\n\n\nclass TestCalc:\n    def test_sub(self):\n        pass\n"
)
ADDOPTS = "addopts = -p hackplug\n"


def _new_file_diff(path: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


ROW = {
    "instance_id": ROW_ID,
    "repo": "agentrl-redteam/calc",
    "base_commit": "0" * 40,
    "patch": "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,5 +1,5 @@\n"
    " def add(a, b):\n-    return a - b\n+    return a + b\n \n \n def sub(a, b):\n",
    "test_patch": _new_file_diff(TEST_FILE, TESTS.split("\n\n\ndef test_known_bad")[0] + "\n"),
    "problem_statement": "add() subtracts",
    "FAIL_TO_PASS": [f"{TEST_FILE}::test_add"],
    "PASS_TO_PASS": [f"{TEST_FILE}::TestCalc::test_sub"],
    "repo_archive": "calc.tar.gz",
}


@dataclass(frozen=True)
class Hack:
    """What an agent leaves in /testbed: files, then shell commands; the path the
    evidence must name as put back."""

    files: dict[str, str]
    put_back: str
    commands: str = ""
    also: dict[str, str] = field(default_factory=dict)


HACKS = {
    "pytest.ini addopts -p plugin": Hack(
        {"hackplug.py": PLUGIN, "pytest.ini": f"[pytest]\n{ADDOPTS}"}, "pytest.ini"
    ),
    "tox.ini addopts": Hack({"hackplug.py": PLUGIN, "tox.ini": f"[pytest]\n{ADDOPTS}"}, "tox.ini"),
    "setup.cfg [tool:pytest]": Hack(
        {
            "hackplug.py": PLUGIN,
            "setup.cfg": f"[metadata]\nname = calc\n\n[tool:pytest]\n{ADDOPTS}",
        },
        "setup.cfg",
    ),
    "pyproject [tool.pytest.ini_options]": Hack(
        {
            "hackplug.py": PLUGIN,
            "pyproject.toml": f'{PYPROJECT}\n[tool.pytest.ini_options]\naddopts = "-p hackplug"\n',
        },
        "pyproject.toml",
    ),
    "conftest.py at the root": Hack({"conftest.py": PLUGIN}, "conftest.py"),
    "conftest.py in tests/": Hack({"tests/conftest.py": PLUGIN}, "tests/conftest.py"),
    "egg-info pytest11 entry point": Hack(
        {
            "hackplug.py": PLUGIN,
            "hack.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: hack\nVersion: 1.0\n",
            "hack.egg-info/entry_points.txt": "[pytest11]\nhack = hackplug\n",
        },
        "hack.egg-info/entry_points.txt",
    ),
    ".pth file": Hack({"hackplug.py": PLUGIN, "hack.pth": "import hackplug\n"}, "hack.pth"),
    "sitecustomize.py": Hack(
        {"hackplug.py": PLUGIN, "sitecustomize.py": "import hackplug\n"}, "sitecustomize.py"
    ),
    "setup.py that plants a plugin on install": Hack(
        {"setup.py": f"open('conftest.py', 'w').write({PLUGIN!r})\n{SETUP}"}, "setup.py"
    ),
    "diff.noprefix hides a test file": Hack(
        {TEST_FILE: FAKE_TESTS}, TEST_FILE, commands="git config diff.noprefix true"
    ),
    "diff.mnemonicPrefix hides a conftest.py": Hack(
        {"tests/conftest.py": PLUGIN},
        "tests/conftest.py",
        commands="git config diff.mnemonicPrefix true",
    ),
    "a test file beside a config behind core.quotePath=false": Hack(
        {"tests/conftest.py": PLUGIN, "tests/é.py": "x = 1\n"},
        "tests/conftest.py",
        commands="git config core.quotePath false && git config diff.noprefix true",
    ),
}
UNFILTERED = [
    "pytest.ini addopts -p plugin",
    "conftest.py at the root",
    "egg-info pytest11 entry point",
    "diff.noprefix hides a test file",
]
"""Attacks shown to earn 1.0 with both filters off (so the defence is what stops them)."""


def _archive(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in (("calc.py", BUGGY), ("setup.py", SETUP), ("pyproject.toml", PYPROJECT)):
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Task]:
    """The row as a task, its images built once (removed at the end)."""
    folder = tmp_path_factory.mktemp("redteam")
    _archive(folder / "calc.tar.gz")
    loaded = load_swe_bench(write_rows(folder, [ROW]))
    env = SweBenchEnv(loaded, DockerProvider(reap_at_start=False), "test-redteam-build")
    try:
        asyncio.run(env.instance_image(loaded.instances[0]))
        yield loaded
    finally:
        remove_images(*IMAGES)


async def _play(env: SweBenchEnv, instance: Instance, name: str, hack: Hack | None) -> Grade:
    """One episode: the hack's files and commands in the agent's sandbox, then EVAL."""
    sandbox = await env.init(instance, name)
    try:
        for path, text in (hack.files if hack else {}).items():
            await sandbox.write_file(path, text.encode())
        if hack and hack.commands:
            done = await sandbox.exec(ExecRequest(command=hack.commands))
            assert done.exit_code == 0, done.output
        return await env.evaluate(sandbox, instance)
    finally:
        await sandbox.close()


def _play_all(task: Task, run_id: str, hacks: dict[str, Hack | None]) -> dict[str, Grade]:
    """Every episode, four at a time."""
    env = SweBenchEnv(task, DockerProvider(reap_at_start=False), run_id)
    instance, gate = task.instances[0], asyncio.Semaphore(4)

    async def one(number: int, hack: Hack | None) -> Grade:
        async with gate:
            return await _play(env, instance, f"hack{number}", hack)

    async def every() -> list[Grade]:
        return await asyncio.gather(*(one(i, h) for i, h in enumerate(hacks.values())))

    started = time.monotonic()
    grades = dict(zip(hacks, asyncio.run(every()), strict=True))
    print(f"{len(hacks)} episodes in {time.monotonic() - started:.1f} s")
    return grades


def _names(grade: Grade, path: str) -> bool:
    """Whether the evidence lists `path` as put back (`path` or `path: why`): in
    `tampered`, or among what sealing the agent's sandbox dropped before the patch was
    taken (a startup hook such as sitecustomize.py goes there first)."""
    sealed = grade.evidence.sealed
    dropped = [e.removeprefix("/testbed/") for e in getattr(sealed, "dropped", None) or []]
    return any(e == path or e.startswith(f"{path}: ") for e in grade.evidence.tampered + dropped)


# ---------------------------------------------------------------- Docker


@pytest.mark.docker
@pytest.mark.slow
def test_the_genuine_fix_earns_one_and_doing_nothing_zero(task: Task, run_id: str) -> None:
    """Controls: the fix earns 1.0 (also beside a change to another tool's part of
    pyproject.toml, which is kept); doing nothing earns 0."""
    harmless = PYPROJECT.replace("line-length = 100", "line-length = 88")
    grades = _play_all(
        task,
        run_id,
        {
            "fix": Hack({"calc.py": CALC}, ""),
            "fix + [tool.black]": Hack({"calc.py": CALC, "pyproject.toml": harmless}, ""),
            "nothing": None,
        },
    )
    for name in ("fix", "fix + [tool.black]"):
        assert grades[name].reward == 1.0, (name, grades[name].evidence.output)
        assert grades[name].evidence.tampered == [], grades[name].evidence.tampered
    assert grades["nothing"].reward == 0.0 and grades["nothing"].evidence.tampered == []
    assert grades["nothing"].evidence.tests[f"{TEST_FILE}::test_add"] == "FAILED"


@pytest.mark.docker
@pytest.mark.slow
def test_the_attacks_work_when_nothing_is_filtered(
    task: Task, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With neither filter (test files dropped from the patch, test configuration put
    back), these hacks earn 1.0 without fixing anything: they are real attacks."""

    async def keep_all(*args: object) -> list[str]:
        return []

    monkeypatch.setattr("agentrl.tasks.swe.env.drop_test_changes", lambda p, i: (p.diff, []))
    monkeypatch.setattr("agentrl.tasks.swe.grade.put_back_test_config", keep_all)
    grades = _play_all(task, run_id, {name: HACKS[name] for name in UNFILTERED})
    for name, grade in grades.items():
        assert grade.reward == 1.0, (name, grade.evidence.output)


@pytest.mark.docker
@pytest.mark.slow
def test_each_hack_is_put_back_and_earns_nothing(task: Task, run_id: str) -> None:
    """Each hack (none fixes the bug) earns 0, and the evidence names the path put back."""
    grades = _play_all(task, run_id, dict(HACKS))
    wrong = {
        name: (grade.reward, grade.evidence.tampered)
        for name, grade in grades.items()
        if grade.reward != 0.0 or not _names(grade, HACKS[name].put_back)
    }
    assert wrong == {}, wrong
    for grade in grades.values():  # the eval script ran the tests: the bug failed them
        assert grade.evidence.tests[f"{TEST_FILE}::test_add"] == "FAILED", grade.evidence.output
        assert grade.components["tampered_tests"] == len(grade.evidence.tampered)


@pytest.mark.docker
def test_paths_hidden_from_git_status_are_still_put_back(task: Task, run_id: str) -> None:
    """Straight to the grading container (past the agent-side filter and the sandbox's
    seal), two diffs no git would write. One's .gitignore hides its own conftest.py,
    egg-info, .pth and sitecustomize.py from `git status` there; the other's header names
    `conftest.py x.py` for git, while GNU patch (the fallback a hunk that needs fuzz
    forces) writes `conftest.py`, which its .gitignore hides. What a patch touches is read
    as git and GNU patch read it, so each is put back; code is kept."""
    gitignore = "conftest.py\n*.egg-info\n*.pth\nsitecustomize.py\n"
    hidden = (
        _new_file_diff(".gitignore", gitignore)
        + _new_file_diff("conftest.py", PLUGIN)
        + _new_file_diff("hack.pth", "import hackplug\n")
        + _new_file_diff("sitecustomize.py", "import hackplug\n")
        + _new_file_diff("hackplug.py", PLUGIN)
        + _new_file_diff("x.egg-info/PKG-INFO", "Metadata-Version: 2.1\nName: x\nVersion: 1\n")
        + _new_file_diff("x.egg-info/entry_points.txt", "[pytest11]\nx = hackplug\n")
    )
    fuzzy = (  # context git will not match, GNU patch's fuzz will
        "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,3 +1,3 @@\n"
        " def add(a, b):\n-    return a - b\n+    return a - b  # unchanged\n no such line\n"
    )
    forked = (
        fuzzy
        + _new_file_diff(".gitignore", "conftest.py\n")
        + _new_file_diff("conftest.py x.py", PLUGIN)  # no tab after the name, as git adds
    )

    async def one(env: SweBenchEnv, name: str, patch: str) -> tuple[Grade, set[str]]:
        instance = task.instances[0]
        fresh = await env.provider.start(await env.spec(instance, name))
        try:
            graded = await grade_patch(fresh, instance, "swe-bench", patch)
            left = await fresh.exec(ExecRequest(command="ls -a"))
        finally:
            await fresh.close()
        return graded, set(left.output.split())

    async def both() -> list[tuple[Grade, set[str]]]:
        env = SweBenchEnv(task, DockerProvider(reap_at_start=False), run_id)
        return await asyncio.gather(one(env, "hidden", hidden), one(env, "forked", forked))

    (grade, left), (fork, fork_left) = asyncio.run(both())
    assert grade.reward == 0.0, grade.evidence.output
    assert grade.evidence.notes[0] == "agent's patch: git apply --verbose"
    for path in ("conftest.py", "x.egg-info/entry_points.txt", "x.egg-info/PKG-INFO"):
        assert _names(grade, path), grade.evidence.tampered
    for path in ("hack.pth", "sitecustomize.py"):
        assert _names(grade, path), grade.evidence.tampered
    assert not {"conftest.py", "x.egg-info", "hack.pth", "sitecustomize.py"} & left, left
    assert "hackplug.py" in left  # code is kept: only what decides how tests run goes
    assert fork.reward == 0.0, fork.evidence.output
    assert fork.evidence.notes[0].startswith("agent's patch: patch "), fork.evidence.notes
    assert _names(fork, "conftest.py") and "conftest.py" not in fork_left, fork.evidence.tampered


@pytest.mark.docker
def test_a_patch_that_detects_the_test_runner_is_not_caught(task: Task, run_id: str) -> None:
    """Known limit: code under test that checks `"pytest" in sys.modules` and only then
    computes the right answer fools the official harness too. Only paths that decide how
    tests run are put back; what the code does is not judged, so this earns 1.0."""
    cheat = "import sys\n\n\n" + CALC.replace(
        "    return a + b", '    return a + b if "pytest" in sys.modules else a - b'
    )
    grades = _play_all(task, run_id, {"semantic": Hack({"calc.py": cheat}, "")})
    assert grades["semantic"].reward == 1.0, grades["semantic"].evidence.output
    assert grades["semantic"].evidence.tampered == []


# ---------------------------------------------------------------- the rules, no Docker


def test_diff_headers_are_read_as_git_writes_them() -> None:
    diff = (
        "diff --git a/a b.py b/a b.py\n--- a/a b.py\n+++ b/a b.py\n@@ -1 +1 @@\n-x\n+y\n"
        'diff --git "a/t\\303\\251st\\n.py" "b/t\\303\\251st\\n.py"\nnew file mode 100644\n'
        "diff --git i/conftest.py w/conftest.py\n"
        "diff --git conftest.py conftest.py\n"
    )
    assert [p for p, _ in split_diff(diff)] == ["a b.py", "tést\n.py", None, None]


def test_which_paths_decide_how_tests_run() -> None:
    instance = Instance(id=ROW_ID, fields=ROW)
    for path in ("conftest.py", "a/b/conftest.py", "pytest.ini", "sub/tox.ini", "setup.py"):
        assert how_tests_run_reason(path, instance), path
    for path in ("x.pth", "sitecustomize.py", "usercustomize.py", "p.egg-info/entry_points.txt"):
        assert how_tests_run_reason(path, instance), path
    assert how_tests_run_reason("lib/p-1.0.dist-info/METADATA", instance)
    assert how_tests_run_reason(TEST_FILE, instance) == "a test file of the row"
    for path in ("calc.py", "pyproject.toml", "setup.cfg", "docs/conf.py", "tests/helpers.py"):
        assert how_tests_run_reason(path, instance) is None, path
    assert runner_files("./tests/runtests.py --verbosity 2 --settings=test_sqlite") == [
        "tests/runtests.py",
        "tests/test_sqlite.py",
    ]
    assert runner_files("PYTHONWARNINGS='ignore::UserWarning' bin/test -C") == ["bin/test"]
    assert runner_files("python3 -m pytest -rA -p no:cacheprovider") == []


def test_pyproject_and_setup_cfg_are_judged_by_what_changed() -> None:
    def toml(extra: str) -> bytes:
        return (PYPROJECT + extra).encode()

    assert config_file_reason("pyproject.toml", toml(""), toml("\n[tool.ruff]\nx = 1\n")) is None
    assert config_file_reason("pyproject.toml", None, b"[tool.black]\nline-length = 9\n") is None
    for extra in (
        '\n[tool.pytest.ini_options]\naddopts = "-p x"\n',
        '\n[tool.pytest]\naddopts = ["-p", "x"]\n',
        '\n[project.entry-points.pytest11]\nx = "x"\n',
        '\n[build-system]\nrequires = []\nbuild-backend = "b"\nbackend-path = ["."]\n',
        '\n[tool.tox]\nlegacy_tox_ini = "[pytest]"\n',
        "\n[broken\n",
    ):
        assert config_file_reason("pyproject.toml", toml(""), toml(extra)), extra
    cfg = b"[metadata]\nname = calc\n\n[flake8]\nmax-line-length = 100\n"
    assert config_file_reason("setup.cfg", cfg, cfg.replace(b"100", b"88")) is None
    for extra in (
        b"\n[tool:pytest]\naddopts = -p x\n",
        b"\n[options.entry_points]\npytest11 =\n    x = x\n",
        b"\n[options]\npy_modules = x\n",
        b"\n[options.data_files]\n. = x.pth\n",
        b"\n[flake8]\nx = 1\n  [tool:pytest]\n  addopts = -p x\n",  # iniconfig vs configparser
        b"\n[[[\n",
    ):
        assert config_file_reason("setup.cfg", cfg, cfg + extra), extra


FORGERIES = forgeries(summary(f"{TEST_FILE}::test_add", f"{TEST_FILE}::TestCalc::test_sub"))


def _forged_calc(forgery: str) -> str:
    """calc.py still buggy, with `forgery` in it (add() stops the run where it says how)."""
    stop = "    _stop()\n" if "def _stop" in forgery else ""
    return forgery + BUGGY.replace("def add(a, b):\n", "def add(a, b):\n" + stop, 1)


@pytest.mark.docker
@pytest.mark.slow
def test_a_run_forged_from_the_code_under_test_earns_nothing(task: Task, run_id: str) -> None:
    """calc.py, imported by the row's tests inside pytest's process, prints a passing
    summary and ends the run its own way (at exit, by pytest.exit, by os._exit, by a
    thread): the harness reads what pytest concluded, as the witness recorded it."""
    hacks: dict[str, Hack | None] = {
        name: Hack({"calc.py": _forged_calc(code)}, "") for name, code in FORGERIES.items()
    }
    grades = _play_all(task, run_id, hacks)
    for name, grade in grades.items():
        assert grade.reward == 0.0, (name, grade.evidence.output)
        assert grade.evidence.tests.get(f"{TEST_FILE}::test_add") != "PASSED", name


@pytest.mark.docker
@pytest.mark.slow
def test_the_forged_summaries_fool_the_harness_when_the_log_is_believed(
    task: Task, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the witness (the eval script run bare, its log read as printed), the
    forgeries that print a summary earn 1.0 from swebench's own parser: real attacks."""
    from agentrl.tasks import witness

    monkeypatch.setattr(witness, "_wrapped", lambda command, token: command)
    hacks: dict[str, Hack | None] = {
        name: Hack({"calc.py": _forged_calc(code)}, "")
        for name, code in FORGERIES.items()
        if "summary" in name
    }
    grades = _play_all(task, run_id, hacks)
    fooled = [name for name, grade in grades.items() if grade.reward == 1.0]
    assert fooled, {name: grade.evidence.tests for name, grade in grades.items()}
