"""Where the genuine test corpus is: published task folders, rows and chat templates that
nobody here wrote, described byte for byte by the committed manifests `tests/corpus*.json`.

The material itself is third-party and stays out of the repository. It is looked for in:
1. `$AGENTRL_CORPUS`: one folder, or several separated by `:` (a copy of `shared/corpus`
   and a folder of material collected but not yet added there);
2. else `tests/corpus/` in the checkout (a developer's link or copy), then
   `../shared/corpus` beside the checkout (where CI has it).

A manifest entry is found in the first root that holds its `local_path`. Entries marked
`pending` in a manifest were collected and recorded but are not in `shared/corpus` yet:
the tests use them where present and name them where not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "tests"
RECORDS_ENV = "AGENTRL_CONFORMANCE_OUT"
"""A folder: the conformance tests write each task's `agentrl check` row there (CI does;
benchmarks/conformance.py --records renders the table docs/tasks.md shows)."""
REQUIRE_ENV = "AGENTRL_REQUIRE_CORPUS"
"""Set (CI sets it): a corpus test whose material is missing fails instead of skipping."""


def corpus_roots() -> list[Path]:
    """The folders searched for corpus material, in order; only those that exist."""
    override = os.environ.get("AGENTRL_CORPUS")
    if override:
        candidates = [Path(p).expanduser() for p in override.split(os.pathsep) if p]
    else:
        candidates = [MANIFESTS / "corpus", REPO.parent / "shared" / "corpus"]
    return [p.resolve() for p in candidates if p.is_dir()]


def find(local_path: str) -> Path | None:
    """`local_path` (as a manifest names it) in the first root that holds it."""
    for root in corpus_roots():
        if (root / local_path).exists():
            return root / local_path
    return None


def manifest(name: str) -> dict[str, Any]:
    """A committed manifest, `tests/<name>` (corpus.json, corpus-swe.json, ...)."""
    data: dict[str, Any] = json.loads((MANIFESTS / name).read_text())
    return data


def pending() -> set[str]:
    """The local paths of every manifest entry marked `pending` (not in shared/corpus yet)."""
    found: set[str] = set()
    for path in sorted(MANIFESTS.glob("corpus*.json")):
        data = json.loads(path.read_text())
        for entries in data.values():
            if isinstance(entries, list):
                found |= {
                    e["local_path"]
                    for e in entries
                    if isinstance(e, dict) and e.get("pending") and "local_path" in e
                }
    return found


def missing(local_paths: list[str]) -> list[str]:
    """The paths no corpus root holds."""
    return [p for p in local_paths if find(p) is None]


def missing_reason(local_paths: list[str]) -> str | None:
    """Why corpus material is not usable here, or None when every path is found."""
    absent = missing(local_paths)
    if not absent:
        return None
    roots = ", ".join(str(r) for r in corpus_roots()) or "none of them exist"
    shown = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
    return (
        f"genuine corpus material not found: {shown} (searched: {roots}; set AGENTRL_CORPUS "
        "to a copy of shared/corpus, see tests/corpus.json)"
    )


def record(local_path: str, result: dict[str, Any]) -> None:
    """Write one conformance result where $AGENTRL_CONFORMANCE_OUT says (if set)."""
    out = os.environ.get(RECORDS_ENV)
    if not out:
        return
    target = Path(out) / (local_path.replace("/", "__") + ".json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"local_path": local_path, **result}, indent=1) + "\n")
