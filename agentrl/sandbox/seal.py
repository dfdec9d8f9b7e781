"""What an agent may not leave behind for its grader: the protected paths.

Terminal-Bench-style tests grade the sandbox the agent worked in (they check the state
it left), so whatever those tests execute implicitly must be as the image had it, or
the agent could grade itself. `Sandbox.seal()` first stops every process the agent
left, then puts each protected path the agent added, changed or deleted back as the
image has it. Protected are:

- the interpreters, test runners, shells and the few tools a test command runs, by
  name, in the directories of the image's PATH (`python3`, `pytest`, `uv`, `bash`, ...);
- Python's startup hooks anywhere (`sitecustomize.py`, `usercustomize.py`, their `.pyc`);
- pytest configuration at the filesystem root, where a test run in `/tests` would
  find it (`/conftest.py`, `/pytest.ini`, ...);
- `/etc/ld.so.preload`, which would load a library into every process.

What is not protected, and why: packages the agent installs (site-packages; tasks ask
for that), `.pth` files (pip writes them for editable installs), and a Python project
the agent creates in its workdir, which a test bootstrap such as `uv init; uv run` then
installs. A grader that must not trust any of that grades a copy of the work in a fresh
sandbox instead, as the SWE-bench grader does with the agent's patch.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from fnmatch import fnmatchcase

DEFAULT_PATH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
RUNNER_NAMES = (
    *("python", "python[0-9]*", "pip", "pip[0-9]*", "pytest", "pytest-[0-9]*", "py.test"),
    *("uv", "uvx", "bash", "sh", "dash", "env", "timeout", "tee", "cat", "rm", "cp", "mv"),
    *("mkdir", "chmod", "chown", "ls", "git", "patch", "kill", "ps"),
)
"""Names, in the image's PATH directories, that test commands run."""
HOOK_NAMES = ("sitecustomize.py", "usercustomize.py", "sitecustomize.pyc", "usercustomize.pyc")
"""Modules Python imports at startup from anywhere on its path."""
ROOT_FILES = (
    *("/conftest.py", "/pytest.ini", "/.pytest.ini", "/pyproject.toml", "/tox.ini"),
    *("/setup.cfg", "/etc/ld.so.preload"),
)


def is_protected(path: str, path_dirs: Sequence[str] = DEFAULT_PATH_DIRS) -> bool:
    """Whether the grader needs `path` (absolute, in the sandbox) as the image had it."""
    path = posixpath.normpath(path)
    parent, name = posixpath.split(path)
    if path in ROOT_FILES or name in HOOK_NAMES:
        return True
    return parent in path_dirs and any(fnmatchcase(name, pattern) for pattern in RUNNER_NAMES)


def path_dirs(env: Sequence[str] | None) -> tuple[str, ...]:
    """The directories of PATH in an image's `Env` list (the usual ones when unset)."""
    for entry in env or ():
        if entry.startswith("PATH="):
            dirs = [posixpath.normpath(d) for d in entry[5:].split(":") if d.startswith("/")]
            return tuple(dict.fromkeys([*dirs, *DEFAULT_PATH_DIRS]))
    return DEFAULT_PATH_DIRS
