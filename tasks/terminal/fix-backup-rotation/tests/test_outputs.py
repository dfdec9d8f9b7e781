"""rotate.sh keeps the newest KEEP backups by name, in any folder, and nothing else."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = "/app/rotate.sh"
STAMPS = [
    "20240101-000000",
    "20240102-120000",
    "20240102-120001",
    "20240215-083000",
    "20241231-235959",
]
OTHERS = ["backup-notes.txt", "notes.txt", "backup-20240301-000000.tar.gz.part"]


def backup(stamp: str) -> str:
    return f"backup-{stamp}.tar.gz"


def make(folder: Path) -> Path:
    folder.mkdir(parents=True)
    names = [backup(s) for s in STAMPS] + OTHERS
    for i, name in enumerate(names):
        (folder / name).write_text(name)
        # modification times run against the names, so sorting by mtime is wrong
        os.utime(folder / name, (1_700_000_000 - i * 3600, 1_700_000_000 - i * 3600))
    return folder


def rotate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("keep", [2, 0, 4])
def test_keeps_the_newest_by_name(tmp_path: Path, keep: int) -> None:
    folder = make(tmp_path / "backups")
    done = rotate(str(folder), str(keep))
    assert done.returncode == 0, done.stderr
    doomed = [backup(s) for s in STAMPS[: len(STAMPS) - keep]]
    assert done.stdout == "".join(f"deleted {name}\n" for name in doomed)
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted([backup(s) for s in STAMPS[len(STAMPS) - keep :]] + OTHERS)


def test_folder_with_spaces(tmp_path: Path) -> None:
    folder = make(tmp_path / "my backups $HOME")
    done = rotate(str(folder), "1")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == sorted([backup(STAMPS[-1])] + OTHERS)


def test_nothing_to_do(tmp_path: Path) -> None:
    folder = make(tmp_path / "few")
    done = rotate(str(folder), "5")
    assert (done.returncode, done.stdout) == (0, "")
    assert len(list(folder.iterdir())) == len(STAMPS) + len(OTHERS)


@pytest.mark.parametrize("args", [[], ["{dir}"], ["{dir}", "-1"], ["{dir}", "two"], ["{dir}/nope", "1"]])
def test_bad_usage(tmp_path: Path, args: list[str]) -> None:
    folder = make(tmp_path / "safe")
    done = rotate(*(a.format(dir=folder) for a in args))
    assert done.returncode == 2
    assert len(list(folder.iterdir())) == len(STAMPS) + len(OTHERS)
