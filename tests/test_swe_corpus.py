"""Genuine SWE-bench rows graded in instance images built here from the repository.

tests/corpus-swe.json records, for every SWE-bench Lite and Verified row it lists, the
repository archive its image is built from (a depth-1 git repository at base_commit,
made by tests/make_swe_archive.py; its sha256) and the environment recipe
(agentrl/tasks/swe/testbed.py builds the image). The docker tests build each image
(once per recipe hash; PyPI and Debian must be reachable the first time) and run
`agentrl check` on the row: the gold patch must earn 1.0 and no patch 0.0, graded with
no network as the harness grades. They are CI's conformance stage (`-m conformance`).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from build_swe_images import Row, build, rows

from agentrl import corpus
from agentrl.check import check_paths
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.swe.testbed import archive_name

HERE = Path(__file__).resolve().parent
MANIFEST = corpus.manifest("corpus-swe.json")
ROWS = rows(MANIFEST)


def test_every_row_names_its_archive_and_environment() -> None:
    assert len(ROWS) >= 10 and len({r.repo for r in ROWS}) >= 4
    rows_files = {f["local_path"] for f in MANIFEST["row_files"]}
    for row in ROWS:
        archive = row.archive
        assert archive["local_path"] == f"swe-repos/{archive_name(row.repo, row.base_commit)}"
        assert re.fullmatch(r"[0-9a-f]{64}", archive["sha256"]) and archive["size"] > 0
        assert archive["base_commit"] == row.base_commit and archive["repository"] == row.repo
        assert row.environment.install and row.environment.wheels, row.instance_id
        assert all("==" in p for p in row.environment.pip + row.environment.wheels)
        assert row.rows_file in rows_files
    assert {a["local_path"] for a in MANIFEST["archives"]} == {
        r.archive["local_path"] for r in ROWS
    }


def test_the_archive_script_is_deterministic(tmp_path: Path) -> None:
    """Two runs on a tiny repository give the same bytes: a depth-1 repository at the commit."""
    repo = tmp_path / "mirror"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@localhost"]
    dates = {
        "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    }
    subprocess.run([*git, "init", "-q"], check=True)
    for n in range(2):  # two commits, so the archive must leave the parent out
        (repo / "calc.py").write_text(f"# {n}\n" + (repo / "calc.py").read_text())
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", f"c{n}"], check=True, env={**os.environ, **dates})
    commit = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    digests = []
    for out in ("a", "b"):
        script = [sys.executable, str(HERE / "make_swe_archive.py"), str(repo), "o/calc", commit]
        subprocess.run([*script, "--out", str(tmp_path / out)], check=True, capture_output=True)
        digests.append(
            hashlib.sha256((tmp_path / out / archive_name("o/calc", commit)).read_bytes())
        )
    assert digests[0].hexdigest() == digests[1].hexdigest()
    checkout = tmp_path / "checkout"
    with tarfile.open(tmp_path / "a" / archive_name("o/calc", commit)) as tar:
        tar.extractall(checkout, filter="data")
    subprocess.run(["git", "-C", str(checkout), "reset", "-q", "--hard"], check=True)
    log = subprocess.run(
        ["git", "-C", str(checkout), "log", "--format=%H"], capture_output=True, text=True
    )
    assert log.stdout.split() == [commit]
    assert (checkout / "calc.py").read_text().startswith("# 1\n# 0\n")


@pytest.mark.conformance
@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            r, marks=pytest.mark.corpus(r.rows_file, r.archive["local_path"]), id=r.instance_id
        )
        for r in ROWS
    ],
)
def test_the_gold_patch_resolves_and_no_patch_does_not(row: Row) -> None:
    """The image built from the archive and recipe; `agentrl check` on the published row."""
    build(row)
    rows_file = corpus.find(row.rows_file)
    assert rows_file is not None
    (result,) = check_paths([rows_file], DockerProvider(), instances=[row.instance_id])
    corpus.record(f"{row.rows_file}/{row.instance_id}", result.model_dump())
    assert result.oracle.reward == 1.0, result.oracle.model_dump(exclude_none=True)
    assert result.noop.reward == 0.0, result.noop.model_dump(exclude_none=True)
