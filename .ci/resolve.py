"""CI: every documented install sequence still resolves (`pip install --dry-run`, nothing
installed). A sequence is the `pip install` lines of one code block in README.md or
docs/*.md, resolved together as a user would end up with them. An `--index-url` of
PyTorch's CUDA wheels is dropped (no such index is reachable here): PyPI's torch of the
same version stands in, with the same dependencies. Exits 1 naming what does not resolve.

    .venv/bin/python .ci/resolve.py
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIP_LINE = re.compile(r"^\s*(?:\S*/)?pip3? install (.+)$")
OPTIONS_WITH_VALUE = {"--index-url", "--extra-index-url", "-i", "-r", "-c"}


def sequences() -> list[tuple[str, list[str]]]:
    """(where, requirements) for each code block that installs something."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _shell_blocks(path.read_text(encoding="utf-8")):
            wanted: list[str] = []
            for line in block:
                match = PIP_LINE.match(line.split("#", 1)[0].split("&&", 1)[0])
                if match:
                    wanted += _requirements(shlex.split(match.group(1)))
            if wanted:
                found.append((str(path.relative_to(ROOT)), wanted))
    return found


def _shell_blocks(text: str) -> list[list[str]]:
    """The lines of each fenced code block marked bash or sh (or unmarked)."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    shell = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if current is None:
                current, shell = [], line.strip()[3:].strip() in ("", "bash", "sh", "shell")
            else:
                if shell:
                    blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _requirements(words: list[str]) -> list[str]:
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in OPTIONS_WITH_VALUE:
            skip = True
        elif word in ("-e", "--editable") or word.startswith("-"):
            continue
        else:
            kept.append(word)
    return kept


EVERY_EXTRA = [
    (
        "every extra, GPU (vllm 0.33 needs torch 2.14)",
        ["torch==2.14.0", ".[vllm,swebench,ray,tensorboard,dev]"],
    ),
    ("the CPU install bootstrap.sh makes", ["torch==2.13.0", ".[dev]"]),
]


def main() -> int:
    failed = []
    for where, wanted in [*EVERY_EXTRA, *sequences()]:
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
            + ["--quiet", "--disable-pip-version-check", *wanted],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        seconds = time.monotonic() - started
        status = "resolves" if done.returncode == 0 else "DOES NOT RESOLVE"
        print(f"[resolve] {where}: {' '.join(wanted)}: {status} ({seconds:.0f} s)")
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "ERROR" in ln or "conflict" in ln]
            print("\n".join(errors[-5:]))
            failed.append(where)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
