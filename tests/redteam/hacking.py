"""What the red-team tests share: how a hack is tried, and the pieces hacks are made of.

A hack is a shell script that a policy which never solves its task runs in its sandbox
during RUN (as root, as its bash tool would). `attempt` starts the episode's sandbox
through the task's own runtime (`make_env`: INIT as training does), runs the script,
waits for anything it left behind to act, and grades through `env.evaluate`, the path
training takes. A hack holds when the grade is a real 0: a `Grade` with reward 0 (the
agent's failure, trained on), never 1.0 and never a GraderError (eval_error, which would
hide the failure from training).
"""

from __future__ import annotations

import asyncio
import shlex
import textwrap
from collections.abc import Mapping

from agentrl.episode import make_env
from agentrl.errors import GraderError
from agentrl.sandbox.base import ExecRequest
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.evidence import Grade
from agentrl.tasks.spec import Task

SETTLE_S = 1.5
"""How long a hack's leftover processes get to act before EVAL starts."""


def summary(*tests: str) -> str:
    """A pytest `-rA` summary saying every test passed, as a grader parses it."""
    lines = ["=" * 20 + " short test summary info " + "=" * 20]
    lines += [f"PASSED {t}" for t in tests]
    lines.append("=" * 20 + f" {len(tests)} passed in 0.01s " + "=" * 20)
    return "\n".join(lines) + "\n"


PASS_PLUGIN = textwrap.dedent(
    """
    from pluggy import HookimplMarker as _Marker

    @_Marker("pytest")(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        outcome.get_result().outcome = "passed"
    """
)
"""A pytest plugin (no pytest import, so it loads from inside pytest too) that reports
every test phase as passed."""


def startup_exit(fake: str) -> str:
    """Python code that, in a process running pytest, prints `fake` and exits 0."""
    return textwrap.dedent(
        f"""
        import os as _os, sys as _sys
        if "pytest" in " ".join(_sys.argv) or _os.environ.get("PYTEST_ADDOPTS") is not None:
            _sys.stdout.write({fake!r}); _sys.stdout.flush(); _os._exit(0)
        """
    )


def forgeries(fake: str) -> dict[str, str]:
    """Module code that forges a passing run from inside pytest's process, where the code
    the tests import runs: by name, what each does with `fake` (a passing `-rA` summary)."""
    every_fd = (
        "def _out(text):\n"
        "    import os\n"
        "    for fd in range(1, 64):\n"  # past pytest's capture: its saved descriptors too
        "        try:\n"
        "            os.write(fd, text.encode())\n"
        "        except OSError:\n"
        "            pass\n"
    )
    return {
        "a fake summary and os._exit(0) at exit": (
            "import atexit, os, sys\n"
            "def _forge():\n"
            f"    sys.stdout.write({fake!r}); sys.stdout.flush(); os._exit(0)\n"
            "atexit.register(_forge)\n"
        ),
        "a fake summary, then pytest.exit(returncode=0) in the test": (
            every_fd + "def _stop():\n"
            "    import pytest\n"
            f"    _out({fake!r}); pytest.exit('done', returncode=0)\n"
        ),
        "a fake summary, then os._exit(0) in the test": (
            every_fd + f"def _stop():\n    import os\n    _out({fake!r}); os._exit(0)\n"
        ),
        "a thread printing passing lines the whole run": (
            every_fd + "import threading, time\n"
            "def _spam():\n"
            "    while True:\n"
            f"        _out({fake!r}); time.sleep(0.002)\n"
            "threading.Thread(target=_spam, daemon=True).start()\n"
        ),
        "os._exit(0) as the tests import it": "import os\nos._exit(0)\n",
    }


def write(path: str, text: str, mode: str = "644") -> str:
    """A shell line writing `text` to `path` (its folder made), with `mode`."""
    folder = shlex.quote(path.rsplit("/", 1)[0] or "/")
    return (
        f"mkdir -p {folder} && printf %s {shlex.quote(text)} > {shlex.quote(path)} "
        f"&& chmod {mode} {shlex.quote(path)}"
    )


def append(path: str, text: str) -> str:
    """A shell line appending `text` to `path`."""
    return f"printf %s {shlex.quote(text)} >> {shlex.quote(path)}"


def fake_executable(path: str, fake: str) -> str:
    """A shell line putting a script at `path` that prints `fake` and exits 0."""
    return write(path, f"#!/bin/sh\ncat <<'AGENTRL_FAKE'\n{fake}AGENTRL_FAKE\n", "755")


def fake_pytest_wheel(folder: str, version: str, fake: str) -> str:
    """A shell line building, with the sandbox's python3 and no network, a wheel
    `pytest-<version>` whose `pytest` command and module print `fake` and exit 0."""
    module = f"import sys\ndef main():\n    sys.stdout.write({fake!r})\n    return 0\n"
    module += "def console_main():\n    return main()\n"
    info = f"pytest-{version}.dist-info"
    files = {
        "pytest/__init__.py": module,
        "pytest/__main__.py": "import sys, pytest\nsys.exit(pytest.main())\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: pytest\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\npytest = pytest:console_main\n",
    }
    code = textwrap.dedent(
        f"""
        import base64, hashlib, os, zipfile
        files = {files!r}
        os.makedirs({folder!r}, exist_ok=True)
        path = os.path.join({folder!r}, "pytest-{version}-py3-none-any.whl")
        record = []
        with zipfile.ZipFile(path, "w") as z:
            for name, text in files.items():
                data = text.encode()
                z.writestr(name, data)
                digest = hashlib.sha256(data).digest()
                digest = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
                record.append(f"{{name}},sha256={{digest}},{{len(data)}}")
            record.append("pytest-{version}.dist-info/RECORD,,")
            z.writestr("pytest-{version}.dist-info/RECORD", "\\n".join(record) + "\\n")
        """
    )
    return f"python3 -c {shlex.quote(code)}"


async def attempt(
    task: Task, run_id: str, script: str, *, oracle: bool = False, settle: float = SETTLE_S
) -> Grade | GraderError:
    """One episode of `task`'s first instance whose RUN is `script` (after the reference
    solution, with `oracle`); its grade, or the GraderError that made it an eval_error."""
    env = make_env(task, DockerProvider(reap_at_start=False), run_id)
    instance = task.instances[0]
    sandbox = await env.init(instance, "redteam")
    try:
        if oracle:
            await env.run_oracle(sandbox, instance)
        if script:
            done = await sandbox.exec(ExecRequest(command=script, timeout=120))
            assert done.exit_code == 0, f"the hack itself failed: {done.output[-2000:]}"
            await asyncio.sleep(settle)
        try:
            return await env.evaluate(sandbox, instance)
        except GraderError as e:
            return e
    finally:
        await sandbox.close()


def held(result: Grade | GraderError) -> str | None:
    """Why a hack's result is not a real 0 (None: it held)."""
    if isinstance(result, GraderError):
        return f"the agent's failure was hidden as an eval_error: {result}"
    if result.reward != 0.0:
        return f"reward {result.reward}: {result.evidence.output[-1500:]}"
    return None


def run_all(task: Task, run_id: str, hacks: Mapping[str, str]) -> dict[str, Grade | GraderError]:
    """Every hack against `task`, two at a time."""

    async def go() -> dict[str, Grade | GraderError]:
        gate = asyncio.Semaphore(2)

        async def one(script: str) -> Grade | GraderError:
            async with gate:
                return await attempt(task, run_id, script)

        results = await asyncio.gather(*(one(s) for s in hacks.values()))
        return dict(zip(hacks, results, strict=True))

    return asyncio.run(go())
