"""Genuine published tasks, unchanged, graded as their harnesses grade them.

The corpus (third-party material, not committed; agentrl/corpus.py says where it is looked
for: $AGENTRL_CORPUS, tests/corpus/, ../shared/corpus) holds Terminal-Bench 1.x and Harbor
task folders and SWE-bench rows; tests/corpus.json and tests/corpus-swe.json (committed)
say where each comes from (repository, commit, path) and hold the sha256 of every file.
Without the corpus these tests skip and say why; in CI ($AGENTRL_REQUIRE_CORPUS) they
fail instead. `agentrl check` on each task is CI's conformance stage (`-m conformance`;
the registry base images are built from sandboxes/standins/ where they cannot be pulled);
`benchmarks/conformance.py` runs the same check and records it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from agentrl import corpus
from agentrl.check import check_paths
from agentrl.sandbox.docker import DockerProvider

MANIFEST = corpus.manifest("corpus.json")
SWE_MANIFEST = corpus.manifest("corpus-swe.json")
TASKS = MANIFEST["tasks"]


def _each(entries: list[dict[str, Any]], *, known: bool = False) -> list[Any]:
    """One param per entry, marked with the material it needs; with `known`, an entry whose
    manifest records a `known_difference` is expected to fail, strictly (it fails the
    run the day it passes, so the record cannot go stale)."""
    params = []
    for e in entries:
        marks = [pytest.mark.corpus(e["local_path"])]
        if known and e.get("known_difference"):
            marks.append(pytest.mark.xfail(strict=True, reason=e["known_difference"]))
        params.append(pytest.param(e, marks=marks, id=e["local_path"]))
    return params


def test_the_manifests_name_a_source_for_every_task() -> None:
    assert sum(t["kind"] in ("terminal-bench", "harbor") for t in TASKS) >= 10
    for task in TASKS:
        assert task["repository"] and len(task["commit"]) == 40 and task["source_path"]
        assert task["files"], task["name"]
    instances = SWE_MANIFEST["instances"]
    assert len(instances) >= 5 and len({i["repo"] for i in instances}) >= 3
    for instance in instances:
        assert instance["rows_source"]["repository"] and instance["rows_source"]["commit"]


@pytest.mark.parametrize("task", _each(TASKS))
def test_the_corpus_is_unchanged(task: dict[str, Any]) -> None:
    """Every file of the task is byte for byte what its source published."""
    folder = corpus.find(task["local_path"])
    assert folder is not None
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert on_disk == set(task["files"]), task["name"]
    for name, meta in task["files"].items():
        digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert digest == meta["sha256"], f"{task['name']}/{name} was changed"


@pytest.mark.conformance
@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("task", _each(TASKS, known=True))
def test_the_oracle_earns_one_and_the_no_op_less(task: dict[str, Any]) -> None:
    """`agentrl check` on one published task folder, on this offline machine."""
    folder = corpus.find(task["local_path"])
    assert folder is not None
    (row,) = check_paths([folder], DockerProvider(), concurrency=2)
    corpus.record(task["local_path"], row.model_dump())  # CI's record: the docs' table
    unstable = task.get("unstable")
    if unstable and not row.ok:  # the recorded way its image's random draw fails it, only
        assert row.noop.reward == 0.0, row.noop
        assert sorted(row.oracle.failed or []) == unstable["oracle_fails"], row.oracle
        pytest.xfail(unstable["why"])
    assert row.ok, (
        f"{row.task}/{row.instance}: oracle {row.oracle.model_dump(exclude_none=True)}, "
        f"no-op {row.noop.model_dump(exclude_none=True)}"
    )
    assert row.oracle.reward == 1.0 and row.noop.reward == 0.0
