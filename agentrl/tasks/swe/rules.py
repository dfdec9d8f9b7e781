"""What a SWE patch may change: the code under test, nothing that decides how the tests
are configured, collected, installed or reported. The rules only: `grade.py` applies
them to the paths git lists in the grading container, `patch.py` to the agent's diff.
"""

from __future__ import annotations

import configparser
import posixpath
import re
import shlex
import tomllib

from agentrl.tasks.graders import listed_tests
from agentrl.tasks.spec import Instance

TEST_FILE = "a test file of the row"
"""The reason of the row's own test files: listed as the bare path in `tampered`."""
PYTEST_CONFIGS = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini"})


def row_test_files(instance: Instance) -> set[str]:
    """The row's own test files: test_patch's and those of the listed tests."""
    test_patch = str(instance.fields.get("test_patch", ""))
    return set(files_of_tests(instance)) | set(patch_files(test_patch))


def how_tests_run_reason(path: str, instance: Instance | None = None) -> str | None:
    """Why a changed path decides how the tests are configured, collected, installed or
    reported, rather than being code under test (None). pyproject.toml and setup.cfg are
    judged by what changed in them (`config_file_reason`), not here."""
    parts = path.split("/")
    name = parts[-1]
    if instance is not None and path in row_test_files(instance):
        return TEST_FILE
    if parts[0] == "r2e_tests":
        return "R2E-Gym's hidden tests"
    if name == "conftest.py":
        return "a conftest.py (pytest loads it)"
    if name in PYTEST_CONFIGS:
        return "pytest's configuration"
    if name == "setup.py":
        return "setup.py (it runs when the package is installed)"
    if name.endswith(".pth") or name in ("sitecustomize.py", "usercustomize.py"):
        return "runs when Python starts"
    if any(p.endswith((".egg-info", ".dist-info")) for p in parts):
        return "package metadata (its entry points load pytest plugins)"
    return None


_CFG_SECTIONS = re.compile(
    r"pytest|entry|^options|^build|^install|^develop|^egg_info|^easy_install|^aliases|^global"
)
_TOML_KEYS = (
    ("tool", "pytest"),
    ("build-system",),
    ("project", "entry-points"),
    ("project", "scripts"),
    ("project", "gui-scripts"),
    ("project", "dependencies"),
    ("project", "optional-dependencies"),
    ("project", "dynamic"),
    *(("tool", t) for t in ("setuptools", "hatch", "poetry", "flit", "pdm", "maturin")),
    *(("tool", t) for t in ("scikit-build", "meson-python", "tox")),
)


def config_file_reason(name: str, old: bytes | None, new: bytes | None) -> str | None:
    """Why a change of pyproject.toml or setup.cfg (`name`) is put back: a part about
    pytest, entry points, building or installing changed, or a version cannot be read
    (None: only other tools' parts changed)."""
    texts = []
    for data in (old, new):
        try:
            texts.append((data or b"").decode())
        except UnicodeDecodeError:
            return "not UTF-8"
    if name == "pyproject.toml":
        try:
            tables = [tomllib.loads(t) for t in texts]
        except tomllib.TOMLDecodeError as exc:
            return f"does not parse ({exc})"
        for key in _TOML_KEYS:
            if _dig(tables[0], key) != _dig(tables[1], key):
                return f"its [{'.'.join(key)}] table changed"
        return None
    parsed = []
    for text in texts:
        config = configparser.RawConfigParser(strict=False)
        try:
            config.read_string(text)
        except configparser.Error as exc:
            return f"does not parse ({type(exc).__name__})"
        parsed.append({s.strip().lower(): dict(config[s]) for s in config.sections()})
    for section in sorted(parsed[0].keys() | parsed[1].keys()):
        if _CFG_SECTIONS.search(section) and parsed[0].get(section) != parsed[1].get(section):
            return f"its [{section}] section changed"
    # pytest reads setup.cfg with another parser (iniconfig): any changed line that reads
    # as a header of such a section, or names pytest, counts however configparser took it
    lines = [set(t.splitlines()) for t in texts]
    for line in lines[0] ^ lines[1]:
        stripped = line.strip().lower()
        header = re.fullmatch(r"\[(.*)\]", stripped)
        if "pytest" in stripped or (header and _CFG_SECTIONS.search(header[1].strip())):
            return "a line about pytest or installing changed"
    return None


def _dig(table: dict[str, object], key: tuple[str, ...]) -> object:
    value: object = table
    for part in key:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def runner_files(command: str) -> list[str]:
    """The repository's own files a test command runs: its scripts (`./tests/runtests.py`,
    `bin/test`) and, beside a script, a Django `--settings` module."""
    try:
        words = shlex.split(command)
    except ValueError:
        return []
    scripts = [
        posixpath.normpath(w)
        for w in words
        if "/" in w and not w.startswith(("-", "/")) and "=" not in w.split("/", 1)[0]
    ]
    files = list(scripts)
    for word in words:
        if word.startswith("--settings=") and scripts:
            module = word.split("=", 1)[1].replace(".", "/")
            files.append(
                posixpath.normpath(posixpath.join(posixpath.dirname(scripts[0]), module + ".py"))
            )
    return [f for f in dict.fromkeys(files) if not f.startswith("..")]


def files_of_tests(instance: Instance, *, fail_only: bool = False) -> list[str]:
    """The files that hold the instance's FAIL_TO_PASS (and PASS_TO_PASS) tests."""
    ids = listed_tests("FAIL_TO_PASS", instance)
    if not fail_only:
        ids += listed_tests("PASS_TO_PASS", instance)
    files = (t.split("::", 1)[0] for t in ids if "::" in t)
    return list(dict.fromkeys(f for f in files if f.endswith(".py")))


def patch_files(diff: str, *, old: bool = False) -> list[str]:
    """The paths a diff touches: from its `diff --git` headers, else its `---`/`+++` pairs.

    `old`: only the `--- a/` side, as the harness's reset of test files reads them."""
    if old:
        return list(dict.fromkeys(re.findall(r"^--- a/(\S+)", diff, flags=re.MULTILINE)))
    paths = [p for pair in _GIT_HEADER.findall(diff) for p in pair]
    lines = diff.splitlines()
    if not paths:  # a plain unified diff: `---`, `+++`, then `@@` is a file header
        for old_line, new_line, hunk in zip(lines, lines[1:], lines[2:], strict=False):
            if (
                old_line.startswith("--- ")
                and new_line.startswith("+++ ")
                and hunk.startswith("@@")
            ):
                paths += [_strip_prefix(old_line[4:]), _strip_prefix(new_line[4:])]
    return list(dict.fromkeys(p for p in paths if p != "/dev/null"))


_GIT_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    return path[2:] if path.startswith(("a/", "b/")) else path
