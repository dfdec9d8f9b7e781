"""The offline test runtime: what a Terminal-Bench or Harbor test bootstrap downloads,
brought into the sandbox by agentrl at EVAL, so tests grade on a machine without internet.

The standard bootstrap (Terminal-Bench's run-tests.sh and setup-uv-pytest.sh, Harbor's
tests/test.sh) runs `apt-get install curl`, pipes `https://astral.sh/uv/<version>/install.sh`
into sh, sources `$HOME/.local/bin/env`, then `uv init; uv add pytest==8.4.1 ...; uv run
pytest ...` or `uvx -p 3.13 -w pytest==8.4.1 ... pytest ...`. Offline, each step fails.

Before the tests run, agentrl puts into `/opt/agentrl-eval`:
- `bin/uv`, `bin/uvx`: the uv the installer URL names, from its PyPI wheel;
- `wheels/`: every requirement the test scripts name (`uv add`, `uv pip install`,
  `uvx -w/--with`, `pip install`), with their dependencies, for the sandbox's Python,
  downloaded on this machine with pip from its package index (PyPI or a mirror);
- `debs/`: the Debian/Ubuntu packages the test files `apt-get install` (curl, expect, vim,
  ...) that the image lacks, with what they depend on, downloaded by the image's own apt in
  a throwaway container of the task's image (the build network, like an image build);
- shims first on PATH: `curl` serves the uv installer URL with a script that links uv into
  `$HOME/.local/bin` and writes its `env` file, and passes every other call to the real
  curl; `apt-get update` succeeds without doing anything; `apt-get install` installs the
  brought packages with dpkg, succeeds for packages already installed (and for curl, whose
  uv URL the shim serves) and fails, saying why, for any other;
- `env.sh`: `UV_OFFLINE`, `UV_NO_INDEX`, `UV_FIND_LINKS`, `UV_PYTHON_DOWNLOADS=never`,
  `PIP_NO_INDEX`, `PIP_FIND_LINKS`, the PATH with the shims; the grader sources it.

Every substitution is written to `substitutions` and lands in the grade's evidence. The
agent never sees any of it: it is copied in after the agent's processes are stopped.
What is brought is fetched on this machine, once, by `downloads`.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from agentrl.errors import GraderError
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.tasks.evidence import tail
from agentrl.tasks.terminal.downloads import (
    PROVIDED_PYTHON,
    PYTHON_GLIBC,
    apt_packages,
    python_archive,
    uv_binaries,
    wheelhouse,
)

ROOT = "/opt/agentrl-eval"
ENV_FILE = f"{ROOT}/env.sh"
LOG = f"{ROOT}/substitutions"
NO_PYTHON = "no Python for the tests"
UNMET = "not possible offline"
"""In a substitution line: the tests asked for something the runtime could not bring."""
DEFAULT_UV = "0.9.5"
"""The uv brought when a script installs uv without naming a version."""
_UV_URL = re.compile(r"https://astral\.sh/uv/(?:(\d+\.\d+\.\d+)/)?install\.sh")
_INSTALLS = re.compile(
    r"(?:\buv\s+add|\buv\s+pip\s+install|\bpip3?\s+install|\bpython3?\s+-m\s+pip\s+install)"
    r"\s+([^;&|#\n]*)"
)
_WITH = re.compile(r"(?:\s-w|\s--with)[\s=]+(\"[^\"]+\"|'[^']+'|\S+)")
_UVX = re.compile(r"\buvx\b([^;&|#\n]*)")
_PYTHON_ASKED = re.compile(r"\buvx?\b[^;&|#\n]*?(?:-p|--python)[ =](?:python)?(\d+\.\d+)")
_APT = re.compile(r"\bapt(?:-get)?\s+install\b([^;&|#\n\"')`]*)")
_UV_PROJECT = re.compile(r"\buv\s+(?:init|add|run|sync|lock|venv)\b")
_VENV = re.compile(r"\b(?:uv\s+venv|python3?\s+-m\s+venv|virtualenv)\s+(?:-\S+\s+)*([\w.-]+)")
UV_PROJECT = ("pyproject.toml", "uv.lock", ".venv", ".python-version", "uv.toml")
"""What uv's project commands read or make in their working directory."""
_OPTIONS_WITH_VALUE = {"-p", "--python", "--index", "--index-url", "--extra-index-url", "-r"}
_OPTIONS_WITH_VALUE |= {"--requirement", "-c", "--constraint", "--group", "--optional"}


class Runtime(BaseModel):
    """What the test scripts need, as read from them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    uv: str
    requirements: list[str]
    uses_bootstrap: bool
    """Whether the scripts install uv or packages at all (else nothing is brought)."""
    python: str | None = None
    """The Python version the scripts ask uv for (`-p 3.13`), if any."""
    apt: list[str] = []
    """Debian/Ubuntu packages the test files `apt-get install` (scripts, or scripts that
    the Python tests write and run)."""
    project: list[str] = []
    """What the scripts' uv or venv makes or reads in the working directory (`uv init`,
    `uv add`, `uv run`, `uv venv NAME`): the runtime's own, never the agent's output."""


def read_scripts(texts: Iterable[str], others: Iterable[str] = ()) -> Runtime:
    """The uv version and the requirements that test scripts install; the apt packages
    that they or the other test files (`others`: Python tests that write a script) name."""
    joined = "\n".join(t.replace("\\\n", " ") for t in texts)
    apt = [
        word
        for text in [joined, *others]
        for match in _APT.finditer(text.replace("\\\n", " "))
        for word in match.group(1).split()
        if not word.startswith("-") and re.fullmatch(r"[a-z0-9][a-z0-9+.:-]*", word)
    ]
    versions = [m.group(1) for m in _UV_URL.finditer(joined) if m.group(1)]
    requirements: list[str] = []
    for match in _INSTALLS.finditer(joined):
        requirements += _requirements(shlex.split(match.group(1), comments=True))
    for match in _UVX.finditer(joined):
        args = match.group(1)
        requirements += [_unquote(w) for w in _WITH.findall(" " + args)]
        requirements += [t for t in _uvx_tool(args) if _name(t) not in map(_name, requirements)]
    uses = bool(_UV_URL.search(joined) or requirements or re.search(r"\buvx?\b", joined))
    asked = _PYTHON_ASKED.findall(joined)
    if not any(_name(r) == "pytest" for r in requirements):
        requirements.append("pytest")
    project = list(UV_PROJECT) if _UV_PROJECT.search(joined) else []
    project += [m.group(1) for m in _VENV.finditer(joined) if not m.group(1).startswith("/")]
    return Runtime(
        uv=versions[0] if versions else DEFAULT_UV,
        requirements=list(dict.fromkeys(requirements)),
        uses_bootstrap=uses or bool(apt),
        apt=list(dict.fromkeys(apt)),
        python=asked[0] if asked else None,
        project=list(dict.fromkeys(project)),
    )


async def install(sandbox: Sandbox, needs: Runtime, image: str) -> list[str]:
    """Put the runtime into the sandbox (started from `image`); the substitutions it makes,
    for the evidence."""
    made = await sandbox.exec(
        ExecRequest(command=["mkdir", "-p", f"{ROOT}/wheels", f"{ROOT}/debs"], timeout=30)
    )
    if made.exit_code != 0:
        raise GraderError(f"cannot make {ROOT} in the sandbox: {tail(made.output)}")
    notes: list[str] = []
    have = await _sandbox_python(sandbox)
    wanted = needs.python or have or PROVIDED_PYTHON
    missing = needs.python is not None and not await _has(sandbox, f"python{needs.python}")
    if missing or have is None:
        notes.append(await _provide_python(sandbox, wanted))
    uv_dir = uv_binaries(needs.uv)
    wheels = wheelhouse(needs.requirements, wanted)
    files: dict[str, tuple[bytes, int]] = {
        f"{ROOT}/bin/uv": ((uv_dir / "uv").read_bytes(), 0o755),
        f"{ROOT}/bin/uvx": ((uv_dir / "uvx").read_bytes(), 0o755),
        f"{ROOT}/bin/curl": (CURL.encode(), 0o755),
        f"{ROOT}/bin/apt-get": (APT_GET.encode(), 0o755),
        f"{ROOT}/bin/apt": (APT_GET.encode(), 0o755),
        f"{ROOT}/uv-install.sh": (UV_INSTALL.encode(), 0o644),
        ENV_FILE: (ENV.encode(), 0o644),
        LOG: (b"", 0o666),
    }
    files |= {f"{ROOT}/wheels/{p.name}": (p.read_bytes(), 0o644) for p in wheels.glob("*.whl")}
    if needs.apt:
        debs, why = await asyncio.to_thread(apt_packages, image, needs.apt)
        files |= {f"{ROOT}/debs/{p.name}": (p.read_bytes(), 0o644) for p in debs}
        fetched = f"{len(debs)} packages for apt-get install {' '.join(needs.apt)}"
        notes.append(f"{fetched}, fetched by the image's own apt" + (f" ({why})" if why else ""))
    for path, (data, mode) in files.items():
        await sandbox.write_file(path, data, mode=mode)
    brought = f"{len(needs.requirements)} requirements ({', '.join(needs.requirements)})"
    brought += f" with their dependencies as wheels for Python {wanted}"
    return [f"offline test runtime: uv {needs.uv} from PyPI; {brought}; see {LOG}", *notes]


async def _provide_python(sandbox: Sandbox, version: str) -> str:
    """agentrl's CPython `version` (where the sandbox has none), on PATH after the sandbox's
    own interpreters, as uv would have downloaded one; what was done, for the evidence."""
    if version != PROVIDED_PYTHON:
        return f"{NO_PYTHON}: the sandbox has no Python {version}; agentrl brings {PROVIDED_PYTHON}"
    archive = python_archive()
    await sandbox.write_file(f"{ROOT}/python.tar.gz", archive.read_bytes())
    unpack = f"tar -xzf {ROOT}/python.tar.gz -C {ROOT} && rm {ROOT}/python.tar.gz && "
    unpack += f"{ROOT}/python/bin/python{version} -c 'import ssl, sqlite3, ctypes'"
    done = await sandbox.exec(ExecRequest(command=unpack, timeout=120))
    if done.exit_code != 0:  # e.g. a C library older than the one it was built on
        await sandbox.exec(ExecRequest(command=["rm", "-rf", f"{ROOT}/python"], timeout=60))
        glibc = await sandbox.exec(ExecRequest(command="ldd --version | head -1", timeout=30))
        return (
            f"{NO_PYTHON}: agentrl's Python {version} (built for glibc >= {PYTHON_GLIBC}) does "
            f"not run here ({tail(glibc.output, 80).strip()}): {tail(done.output)}"
        )
    return (
        f"Python {version} built by agentrl (sandboxes/eval-python, glibc >= {PYTHON_GLIBC}) "
        f"put on PATH after the sandbox's own (the tests ask for it, the sandbox has none): "
        f"{ROOT}/python"
    )


async def _has(sandbox: Sandbox, command: str) -> bool:
    done = await sandbox.exec(ExecRequest(command=f"command -v {command}", timeout=30))
    return done.exit_code == 0


async def substitutions(sandbox: Sandbox) -> list[str]:
    """What the shims did during the test run, one line each."""
    try:
        data = await sandbox.read_file(LOG)
    except Exception:  # the runtime is not installed, or the sandbox is gone
        return []
    return [line for line in data.decode(errors="replace").splitlines() if line.strip()]


async def _sandbox_python(sandbox: Sandbox) -> str | None:
    """X.Y of the sandbox's python3 (as the seal left it), or None if it has none."""
    probe = "import sys; print('%d.%d' % sys.version_info[:2])"
    for exe in ("python3", "python"):
        done = await sandbox.exec(ExecRequest(command=[exe, "-c", probe], timeout=30))
        if done.exit_code == 0 and re.fullmatch(r"\d+\.\d+\s*", done.output):
            return done.output.strip()
    return None


def _requirements(words: list[str]) -> list[str]:
    found, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in _OPTIONS_WITH_VALUE:
            skip = True
        elif word.startswith("-") or "/" in word or word.startswith("."):
            continue
        else:
            found.append(word)
    return found


def _uvx_tool(args: str) -> list[str]:
    """The tool uvx runs (its first word that is no option or option value), as a list."""
    skip = False
    for word in shlex.split(args, comments=True):
        if skip:
            skip = False
        elif word in ("-w", "--with", "--from", *_OPTIONS_WITH_VALUE):
            skip = True
        elif not word.startswith("-"):
            return [word]
    return []


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].strip().lower()


def _unquote(word: str) -> str:
    return word.strip("\"'")


CURL = f"""#!/bin/sh
# agentrl offline runtime: serves the uv installer; passes everything else to the real curl
for arg in "$@"; do
  case "$arg" in
    https://astral.sh/uv/*install.sh)
      echo "curl $arg: served agentrl's installer of its offline uv" >> {LOG}
      cat {ROOT}/uv-install.sh
      exit 0;;
  esac
done
PATH=$(printf %s "$PATH" | sed "s#{ROOT}/bin:##g")
if real=$(command -v curl); then exec "$real" "$@"; fi
echo "curl $*: {UNMET} (no curl in this sandbox, and none was brought)" >> {LOG}
echo "curl: not in this sandbox (agentrl's offline runtime serves only the uv installer)" >&2
exit 127
"""

UV_INSTALL = f"""# agentrl offline runtime: uv is already here; link it where uv's installer puts it
mkdir -p "$HOME/.local/bin"
ln -sf {ROOT}/bin/uv "$HOME/.local/bin/uv"
ln -sf {ROOT}/bin/uvx "$HOME/.local/bin/uvx"
cat > "$HOME/.local/bin/env" <<'AGENTRL_EOF'
case ":$PATH:" in *":$HOME/.local/bin:"*) ;; *) export PATH="$HOME/.local/bin:$PATH" ;; esac
AGENTRL_EOF
echo "installing to $HOME/.local/bin (agentrl offline runtime)"
"""

APT_GET = f"""#!/bin/sh
# agentrl offline runtime: apt-get without a network
case "$1" in
  update)
    echo "apt-get update: skipped (no network)" >> {LOG}
    exit 0;;
  install)
    shift
    missing=""
    for pkg in "$@"; do
      case "$pkg" in -*) continue;; esac
      dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
    done
    if [ -n "$missing" ] && ls {ROOT}/debs/*.deb >/dev/null 2>&1; then
      if DEBIAN_FRONTEND=noninteractive dpkg -i {ROOT}/debs/*.deb > {ROOT}/dpkg.log 2>&1; then
        echo "apt-get install$missing: installed from the packages agentrl brought" >> {LOG}
      else
        echo "apt-get install$missing: dpkg -i failed (see {ROOT}/dpkg.log)" >> {LOG}
      fi
      rm -f {ROOT}/debs/*.deb
      still=""
      for pkg in $missing; do dpkg -s "$pkg" >/dev/null 2>&1 || still="$still $pkg"; done
      missing="$still"
    fi
    for pkg in $missing; do
      if [ "$pkg" = curl ]; then
        echo "apt-get install curl: skipped (the offline runtime provides curl for uv)" >> {LOG}
        missing=$(printf %s "$missing" | sed 's/ curl\b//')
      fi
    done
    if [ -n "$missing" ]; then
      echo "apt-get install$missing: {UNMET}" >> {LOG}
      echo "E: agentrl offline runtime: cannot install$missing without a network" >&2
      exit 100
    fi
    exit 0;;
esac
PATH=$(printf %s "$PATH" | sed "s#{ROOT}/bin:##g")
exec "$(basename "$0")" "$@"
"""

ENV = f"""# agentrl offline runtime: sourced before the tests run
export PATH="{ROOT}/bin:$PATH:{ROOT}/python/bin"
export UV_OFFLINE=1 UV_NO_INDEX=1 UV_FIND_LINKS={ROOT}/wheels UV_PYTHON_DOWNLOADS=never
export UV_CACHE_DIR={ROOT}/cache UV_LINK_MODE=copy UV_NO_PROGRESS=1
export PIP_NO_INDEX=1 PIP_FIND_LINKS={ROOT}/wheels PIP_DISABLE_PIP_VERSION_CHECK=1
# Configuration files in the working directory (the agent's outputs) are not the runtime's.
export UV_NO_CONFIG=1 PIP_CONFIG_FILE=/dev/null
"""
