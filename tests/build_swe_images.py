"""Build the SWE-bench instance images that tests/corpus-swe.json records, from the repository.

    AGENTRL_CORPUS=../shared/corpus python tests/build_swe_images.py [ID ...] [--check]

For each instance (all, or the ids given): its repository archive is found through
agentrl.corpus and checked against the recorded sha256, and its image is built from the
archive and the recorded environment recipe as `sweb.eval.x86_64.<id>:latest` (once per
recipe hash; agentrl/tasks/swe/testbed.py). Package registries must be reachable while
building (PyPI, Debian); grading needs no network. One JSON line per image: tag, whether
it was built, seconds. `--check` then runs `agentrl check` on each instance's rows file
(gold patch 1.0, no patch 0.0) and prints one JSON line per instance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from typing import Any

from agentrl import corpus
from agentrl.sandbox.images import ImageInfo, Progress
from agentrl.tasks.swe.testbed import Environment, build_testbed

MANIFEST = "corpus-swe.json"
LISTS = ("instances", "verified_instances")
"""The manifest's lists of instances: SWE-bench Lite rows, SWE-bench Verified rows."""


@dataclass(frozen=True)
class Row:
    """One instance of the manifest, with what its image is built from."""

    instance_id: str
    repo: str
    base_commit: str
    rows_file: str
    """local_path of the rows file it is checked with."""
    archive: dict[str, Any]
    """Its `archives` entry: local_path, sha256, size, ..."""
    environment: Environment


def rows(manifest: dict[str, Any] | None = None) -> list[Row]:
    """Every instance the manifest records, in its order."""
    data = manifest if manifest is not None else corpus.manifest(MANIFEST)
    archives = {a["local_path"]: a for a in data["archives"]}
    found = []
    for entry in (e for key in LISTS for e in data.get(key, [])):
        testbed = entry["testbed"]
        recipe = data["environments"][testbed["environment"]]["recipe"]
        env = {**recipe.get("env", {}), **testbed.get("env", {})}
        found.append(
            Row(
                instance_id=entry["instance_id"],
                repo=entry["repo"],
                base_commit=entry["base_commit"],
                rows_file=entry["rows_files"][0],
                archive=archives[testbed["archive"]],
                environment=Environment.model_validate({**recipe, "env": env}),
            )
        )
    return found


def build(row: Row, progress: Progress | None = None) -> ImageInfo:
    """The row's image, built unless up to date; the archive must have its recorded sha256."""
    path = corpus.find(row.archive["local_path"])
    if path is None:
        raise FileNotFoundError(corpus.missing_reason([row.archive["local_path"]]))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != row.archive["sha256"]:
        raise ValueError(f"{path}: sha256 {digest}, the manifest records {row.archive['sha256']}")
    return build_testbed(row.instance_id, row.base_commit, path, row.environment, progress=progress)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="instance ids (default: every one)")
    parser.add_argument("--check", action="store_true", help="then run agentrl check on each")
    args = parser.parse_args()
    chosen = [r for r in rows() if not args.ids or r.instance_id in args.ids]
    if unknown := set(args.ids) - {r.instance_id for r in chosen}:
        print(f"error: not in tests/{MANIFEST}: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    for row in chosen:
        info = build(row)
        print(json.dumps({"instance": row.instance_id, **info.model_dump()}), flush=True)
    if not args.check:
        return 0
    from agentrl.check import check_paths
    from agentrl.sandbox.docker import DockerProvider

    failed = 0
    for row in chosen:
        path = corpus.find(row.rows_file)
        if path is None:
            raise FileNotFoundError(corpus.missing_reason([row.rows_file]))
        (result,) = check_paths([path], DockerProvider(), instances=[row.instance_id])
        failed += not (result.oracle.reward == 1.0 and result.noop.reward == 0.0)
        print(json.dumps({"rows_file": row.rows_file, **result.model_dump()}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
