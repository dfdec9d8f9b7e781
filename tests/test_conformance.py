"""Genuine published tasks, unchanged, graded as their harnesses grade them.

The corpus (tests/corpus/, git-ignored: third-party material is collected locally, not
committed) holds Terminal-Bench 1.x and Harbor task folders and SWE-bench Lite rows;
tests/corpus.json and tests/corpus-swe.json (committed) say where each comes from
(repository, commit, path) and hold the sha256 of every file. Without the corpus these
tests skip and say why; `benchmarks/conformance.py` runs the same check and records it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agentrl.check import check_paths
from agentrl.sandbox.docker import DockerProvider

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
MANIFEST = json.loads((HERE / "corpus.json").read_text())
SWE_MANIFEST = json.loads((HERE / "corpus-swe.json").read_text())

needs_corpus = pytest.mark.skipif(
    not (CORPUS / "terminal-bench").is_dir(),
    reason="no local corpus in tests/corpus (collect it as tests/corpus.json lists)",
)


def test_the_manifests_name_a_source_for_every_task() -> None:
    tasks = MANIFEST["tasks"]
    assert sum(t["kind"] in ("terminal-bench", "harbor") for t in tasks) >= 10
    for task in tasks:
        assert task["repository"] and len(task["commit"]) == 40 and task["source_path"]
        assert task["files"], task["name"]
    instances = SWE_MANIFEST["instances"]
    assert len(instances) >= 5 and len({i["repo"] for i in instances}) >= 3
    for instance in instances:
        assert instance["rows_source"]["repository"] and instance["rows_source"]["commit"]


@needs_corpus
def test_the_corpus_is_unchanged() -> None:
    """Every file of every task is byte for byte what its source published."""
    for task in MANIFEST["tasks"]:
        folder = CORPUS / task["local_path"]
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        assert on_disk == set(task["files"]), task["name"]
        for name, meta in task["files"].items():
            digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
            assert digest == meta["sha256"], f"{task['name']}/{name} was changed"


@needs_corpus
@pytest.mark.docker
@pytest.mark.slow
def test_every_oracle_earns_one_and_every_no_op_less() -> None:
    """`agentrl check` over the whole corpus, on this offline machine."""
    folders = [CORPUS / t["local_path"] for t in MANIFEST["tasks"]]
    rows_files = sorted((CORPUS / "swe-bench").glob("*.jsonl"))
    rows = check_paths([*folders, *rows_files], DockerProvider(), concurrency=2)
    failed = [r for r in rows if not r.ok]
    assert not failed, "\n".join(
        f"{r.task}/{r.instance}: oracle {r.oracle}, no-op {r.noop}" for r in failed
    )
    assert all(r.oracle.reward == 1.0 and r.noop.reward == 0.0 for r in rows)
    assert len({r.instance for r in rows if r.format == "swe-bench"}) >= 5
