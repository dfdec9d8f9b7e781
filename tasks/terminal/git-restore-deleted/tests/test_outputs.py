"""config/settings.ini is back, in one new commit, with the history untouched."""

import subprocess
from pathlib import Path

REPO = Path("/app/project")
SETTINGS = (
    "[server]\nport = 8080\nhost = 127.0.0.1\n\n[cache]\nenabled = true\nttl_seconds = 300\n"
)
HISTORY = [
    "Restore config/settings.ini",
    "Add changelog",
    "Clean up old files",
    "Tune server and cache settings",
    "Initial commit",
]


def git(*args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    )
    return done.stdout


def test_file_has_its_last_content() -> None:
    assert (REPO / "config/settings.ini").read_text() == SETTINGS


def test_one_new_commit_on_the_old_history() -> None:
    assert git("log", "--format=%s").splitlines() == HISTORY
    # the old commits keep their dates: none was rewritten
    dates = git("log", "--skip=1", "--format=%cI").split()
    assert dates == [f"2024-01-0{n}T10:00:00+00:00" for n in (4, 3, 2, 1)]


def test_new_commit_only_restores_the_file() -> None:
    changed = git("show", "--name-status", "--format=", "HEAD").split("\n")
    assert [c for c in changed if c] == ["A\tconfig/settings.ini"]
    assert git("show", "HEAD:config/settings.ini") == SETTINGS


def test_working_tree_is_clean() -> None:
    assert git("status", "--porcelain") == ""
