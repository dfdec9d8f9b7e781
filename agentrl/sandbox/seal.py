"""What a grader may see of an agent's work: its outputs, and nothing else it changed.

The threat: a policy that cannot solve its task can still earn reward by changing what the
grader's own process executes or reads (the interpreter, its standard library and caches,
the test runner, its plugins and configuration, the shell, package managers' config,
agentrl's runtime), or by leaving a process that edits the tests once they are in. A list
of protected names always misses one path, so the grader is given the agent's work the
other way round: EVAL grades in a sandbox started fresh from the task's image (no agent
process exists there), into which only the agent's changes under the task's **outputs**
are carried. Outputs are the working directory, the paths the task's tests name, and the
paths the task declares (`grader.outputs`); everything else the agent added, changed or
deleted is simply not there, and the evidence lists it.

Inside the outputs, what the grader's process would still run implicitly is dropped too,
decided from what the agent changed (`drop_reason`):
- Python's startup code: `sitecustomize`/`usercustomize` modules, and the lines of an
  agent-written `.pth` file that Python executes (`import ...`); its path lines stay, so an
  editable install still imports;
- pytest's configuration and `conftest.py` where a run of the task's tests looks for them
  (the test folders and every folder above them);
- a module file (or a package's `__init__`) added to the test command's working directory
  under the name of a module the image's Python has (`python -m pytest` puts that
  directory first on the path);
- what the test scripts themselves make or read there (`scope.runtime`: a uv project or
  venv of a published bootstrap).

This module holds the rules (no engine); `docker/grading.py` applies them.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, Field

HOOK_NAMES = ("sitecustomize", "usercustomize")
"""Modules Python imports at startup from anywhere on its path."""
RUNNER_CONFIG = (
    *("conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml"),
    *("tox.ini", "setup.cfg", "pyproject.toml"),
)
"""Files pytest reads as configuration or plugins in the folders it looks in."""
RUNTIME_ROOTS = (
    *("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.preload"),
    *("/proc", "/sys", "/dev", "/tests", "/logs", "/opt/agentrl-eval"),
)
"""Where a path named by a task's tests is never taken as an output: the runtime itself
(a task that wants one of these judged declares it in `grader.outputs`)."""
_NAMED = re.compile(r"""["'`](/(?:[A-Za-z0-9_.@+-]+/?)+)["'`]""")
_HOME = re.compile(r"""["'`]~/([A-Za-z0-9_.@+/-]+)["'`]""")


class GradeScope(BaseModel):
    """What of a sandbox the grader is meant to examine (picklable; crosses to sandbox workers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    outputs: tuple[str, ...] = Field(
        description="absolute paths (or glob patterns) whose changes the grader sees as the "
        "agent left them; everything else the agent changed is put back as the image had it"
    )
    tests: tuple[str, ...] = Field(
        default=(), description="folders the grader's tests are copied into (absolute)"
    )
    lookup: tuple[str, ...] = Field(
        default=(),
        description="folders a test run starts looking for its configuration in (the test "
        "folders, and those holding single test files); default: `tests`",
    )
    cwd: str = Field(default="/", description="the test command's working directory")
    runtime: tuple[str, ...] = Field(
        default=(),
        description="paths inside the outputs that the test runtime itself makes or reads (a "
        "uv project or venv in the working directory): an agent's version is dropped",
    )
    network: str | None = Field(
        default=None,
        description="a Docker network the grading copy joins (grading online); None: it "
        "shares the agent's container's loopback, so the agent's services stay reachable",
    )
    image: str | None = Field(
        default=None,
        description="the image of a verifier of its own (Harbor's separate mode): the "
        "copy starts from it once the agent's container is gone, and gets each output "
        "whole as the agent's container held it; None: the copy starts as INIT left the "
        "sandbox and gets the agent's changes under the outputs",
    )
    env: dict[str, str] | None = Field(
        default=None, description="the copy's environment variables (None: the sandbox's)"
    )

    def covers(self, path: str) -> bool:
        """Whether `path` (absolute) lies in an output, and not in a test folder."""
        if any(within(path, folder) for folder in self.tests):
            return False
        return any(within(path, out) or _matches(path, out) for out in self.outputs)


def scope_for(
    workdir: str, declared: Iterable[str], test_texts: Iterable[str], tests: Iterable[str]
) -> GradeScope:
    """The scope of a task: its workdir, what it declares, and the paths its tests name."""
    named = [p for text in test_texts for p in named_paths(text)]
    outputs = dict.fromkeys([posixpath.normpath(workdir), *declared, *named])
    return GradeScope(
        outputs=tuple(outputs), tests=tuple(posixpath.normpath(t) for t in tests), cwd=workdir
    )


def named_paths(text: str, home: str = "/root") -> list[str]:
    """Absolute paths a test file or script names as string literals (`~/x` as home's),
    except the runtime's own (`RUNTIME_ROOTS`) and the root itself."""
    found = [m.group(1).rstrip("/") for m in _NAMED.finditer(text)]
    found += [posixpath.join(home, m.group(1).rstrip("/")) for m in _HOME.finditer(text)]
    kept = []
    for path in found:
        path = posixpath.normpath(path)
        if path == "/" or path.count("/") < 1 or path in ("/etc", "/root", "/home", "/tmp"):
            continue
        if any(within(path, root) for root in RUNTIME_ROOTS):
            continue
        kept.append(path)
    return list(dict.fromkeys(kept))


def drop_reason(
    path: str,
    scope: GradeScope,
    *,
    shadowable: Sequence[str] = (),
    is_dir: bool = False,
    added: bool = True,
) -> str | None:
    """Why an agent's change at `path`, inside the outputs, is not carried into grading
    (None: it is). `shadowable`: the top-level module names the image's Python has;
    `added`: the image had nothing at `path` (a module the image has there is the module
    itself, not a shadow of it)."""
    parent, name = posixpath.split(posixpath.normpath(path))
    stem = name.split(".", 1)[0]
    if any(within(path, r) for r in scope.runtime):
        return "the test runtime's own (its scripts make or read it in the working directory)"
    if stem in HOOK_NAMES and (name.endswith((".py", ".pyc")) or is_dir):
        return "a Python startup hook (runs in every interpreter, the grader's too)"
    if "__pycache__" in path.split("/") and posixpath.basename(parent) == "__pycache__":
        owner = stem.split(".", 1)[0]
        if owner in HOOK_NAMES:
            return "bytecode of a Python startup hook"
    if name in RUNNER_CONFIG and any(within(t, parent) for t in scope.lookup or scope.tests):
        return f"pytest reads {name} above the task's tests"
    module = shadowed_module(parent, name, posixpath.normpath(scope.cwd), is_dir)
    if added and module in shadowable:
        return (
            f"shadows the module {module} of the image's Python in the test command's "
            "working directory"
        )
    return None


def shadowed_module(parent: str, name: str, cwd: str, is_dir: bool) -> str | None:
    """The module a file makes importable from the cwd ahead of the image's: a module file
    there (`json.py`, `json.pyc`, `json.<abi>.so`) or a package's `__init__` there; a
    folder alone shadows nothing (a namespace portion loses to a module found later)."""
    if is_dir or not name.endswith((".py", ".pyc", ".so")):
        return None
    if parent == cwd:
        return name.split(".", 1)[0]
    if posixpath.dirname(parent) == cwd and name.split(".", 1)[0] == "__init__":
        return posixpath.basename(parent)
    return None


def executable_pth_lines(text: str) -> tuple[str, list[str]]:
    """A `.pth` file without the lines Python would execute at startup (those that begin
    with `import`); (what is kept, the lines dropped)."""
    kept: list[str] = []
    dropped: list[str] = []
    for line in text.splitlines(keepends=True):
        (dropped if line.lstrip().startswith(("import ", "import\t")) else kept).append(line)
    return "".join(kept), [line.rstrip("\n") for line in dropped]


def within(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it (everything lies under /)."""
    folder = folder.rstrip("/") or "/"
    return path == folder or path.startswith(folder + "/") or folder == "/"


def _matches(path: str, pattern: str) -> bool:
    if not any(ch in pattern for ch in "*?["):
        return False
    parts = path.split("/")
    # A pattern covers what it matches and everything below that.
    return any(fnmatchcase("/".join(parts[:n]), pattern) for n in range(2, len(parts) + 1))
