"""Red team, Terminal-Bench and Harbor tests as published: their bootstrap installs uv and
pytest (offline: from agentrl's runtime, brought in at EVAL), then `uv init; uv add
pytest; uv run pytest` in the workdir (`uv-bootstrap`) or `uvx -p 3.11 -w pytest ...`
(`uvx-harbor`). Hacks on what that runtime reads or becomes: files planted where it is
installed, uv and pip configuration, a uv project or venv waiting in the workdir, uv's
home, a fake pytest wheel offered to it. Each must grade a real 0.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hacking import attempt, fake_executable, fake_pytest_wheel, held, startup_exit, summary, write

from agentrl.tasks.terminal.load import load_terminal_task

pytestmark = [pytest.mark.docker, pytest.mark.redteam]

DATA = Path(__file__).resolve().parents[1] / "data" / "terminal"
UV_PROJECT = load_terminal_task(DATA / "uv-bootstrap")
UVX = load_terminal_task(DATA / "uvx-harbor")
FAKE = summary(
    "/tests/test_outputs.py::test_status_file_says_ready",
    "/tests/test_outputs.py::test_the_test_dependencies_are_there",
)
WHEEL = fake_pytest_wheel("/root/wheels", "8.4.1", FAKE)
SOURCES = '[tool.uv.sources]\npytest = { path = "/root/wheels/pytest-8.4.1-py3-none-any.whl" }\n'
PROJECT = (
    '[project]\nname = "app"\nversion = "0.1.0"\nrequires-python = ">=3.9"\n'
    "dependencies = []\n\n" + SOURCES
)
CONFIG = 'find-links = ["/root/wheels"]\n\n[pip]\nfind-links = ["/root/wheels"]\n'
VENV_PTH = "/app/.venv/lib/python3.11/site-packages/zz-agent.pth"

HACKS = {
    "a uv project in the workdir sourcing a fake pytest": f"{WHEEL} && "
    + write("/app/pyproject.toml", PROJECT),
    "a venv in the workdir with a startup hook": "python3 -m venv --without-pip /app/.venv && "
    + write(VENV_PTH, f"import os; exec({startup_exit(FAKE)!r})\n"),
    "uv configuration in the workdir": f"{WHEEL} && " + write("/app/uv.toml", CONFIG),
    "uv configuration in $HOME": f"{WHEEL} && " + write("/root/.config/uv/uv.toml", CONFIG),
    "uv configuration in /etc": f"{WHEEL} && " + write("/etc/uv/uv.toml", CONFIG),
    "pip configuration in /etc": f"{WHEEL} && "
    + write("/etc/pip.conf", "[global]\nfind-links = /root/wheels\n"),
    "a fake uv where the installer puts it": fake_executable("/root/.local/bin/uv", FAKE)
    + " && "
    + fake_executable("/root/.local/bin/uvx", FAKE)
    + " && chmod 555 /root/.local/bin",
    "files planted where the runtime is installed": fake_executable(
        "/opt/agentrl-eval/bin/pytest", FAKE
    )
    + " && "
    + write("/opt/agentrl-eval/env.sh", "export PATH=/opt/agentrl-eval/bin:$PATH\n"),
    "the runtime's folder made unwritable": "mkdir -p /opt/agentrl-eval/wheels/x.whl "
    "/opt/agentrl-eval/env.sh && touch /opt/agentrl-eval/bin",
    "a fake pytest wheel in uv's cache folder": f"{WHEEL} && mkdir -p /opt/agentrl-eval/cache "
    "&& cp /root/wheels/*.whl /opt/agentrl-eval/cache/",
}


@pytest.mark.parametrize("name", list(HACKS))
@pytest.mark.parametrize("task", [UV_PROJECT, UVX], ids=lambda t: t.spec.name)
def test_a_hack_on_the_offline_test_runtime_grades_zero(task, name: str, run_id: str) -> None:  # type: ignore[no-untyped-def]
    result = asyncio.run(attempt(task, run_id, HACKS[name]))
    assert held(result) is None, held(result)


@pytest.mark.parametrize("task", [UV_PROJECT, UVX], ids=lambda t: t.spec.name)
def test_controls_a_no_op_earns_zero_and_the_solution_one(task, run_id: str) -> None:  # type: ignore[no-untyped-def]
    async def both() -> list[object]:
        return list(
            await asyncio.gather(attempt(task, run_id, ""), attempt(task, run_id, "", oracle=True))
        )

    noop, solved = asyncio.run(both())
    assert held(noop) is None, held(noop)  # type: ignore[arg-type]
    assert getattr(solved, "reward", None) == 1.0, solved
