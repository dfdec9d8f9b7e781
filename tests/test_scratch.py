"""Temporary folders of a killed process (`agentrl/scratch.py`): a `kill -9` runs no
cleanup, so the next agentrl command removes what a dead owner left, and never what a
live one holds. Real processes, a real SIGKILL, the real CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl import scratch

MAKER = (
    "from agentrl import scratch; import time; "
    "p = scratch.make('publish'); (p / 'weights.bin').write_bytes(b'0' * 4096); "
    "print(p, flush=True); time.sleep(120)"
)


def owner(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_owners_folders_go_and_a_live_ones_stay(tmp_path: Path) -> None:
    live, kept = owner(tmp_path)
    dead, left = owner(tmp_path)
    mine = scratch.make("local")  # this process's: alive
    try:
        assert kept.is_dir() and left.is_dir() and kept.parent == tmp_path
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        (tmp_path / "agentrl-notes-1").mkdir()  # not named by scratch: never touched
        assert scratch.reap(tmp_path) == 1
        assert not left.exists() and kept.is_dir() and (tmp_path / "agentrl-notes-1").is_dir()
        assert scratch.reap(tmp_path) == 0
    finally:
        live.kill()
        live.wait(timeout=30)
        mine.rmdir()
    assert scratch.reap(tmp_path) == 1 and not kept.exists()


@pytest.mark.docker
def test_agentrl_gc_says_what_it_removed(tmp_path: Path) -> None:
    dead, left = owner(tmp_path)
    dead.send_signal(signal.SIGKILL)
    dead.wait(timeout=30)
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "gc"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert not left.exists()  # the command's start reaped it before gc looked
