"""`agentrl` as a person runs it: the CLI in a fresh process, its output captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def agentrl(
    *args: str | Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`agentrl ARGS` (`python -m agentrl.cli`), with `env` added to this environment."""
    return subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        check=False,
    )
