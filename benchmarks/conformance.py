"""Conformance: genuine published tasks, unchanged, through `agentrl check`.

Runs every task folder and row file of the genuine corpus (found as agentrl/corpus.py
says: $AGENTRL_CORPUS, tests/corpus, ../shared/corpus; provenance in tests/corpus.json and
tests/corpus-swe.json) through the same sandbox and grader that training uses: the
reference solution must earn 1.0 and doing nothing less. Registry base images that cannot
be pulled are built from sandboxes/standins/. Writes benchmarks/results/conformance.json
and prints the table docs/tasks.md shows.

    .venv/bin/python benchmarks/conformance.py [--out FILE]
    .venv/bin/python benchmarks/conformance.py --records DIR   # CI's per-task records

`--records` reads what CI's conformance stage wrote (tests/test_conformance.py with
$AGENTRL_CONFORMANCE_OUT=DIR: one JSON per task) instead of running anything, so the
table in the docs is the one a CI run measured.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from agentrl import corpus

ROOT = Path(__file__).resolve().parents[1]
KINDS = {
    "terminal-bench": "Terminal-Bench 1.x folders",
    "harbor": "Harbor / Terminal-Bench 2.0 folders",
    "swe-bench": "SWE-bench rows",
}


def corpus_paths() -> list[Path]:
    """Every task folder and row file of the corpus that is here, in manifest order."""
    folders = [corpus.find(t["local_path"]) for t in corpus.manifest("corpus.json")["tasks"]]
    rows = sorted({p for root in corpus.corpus_roots() for p in root.glob("swe-bench/*.jsonl")})
    return [p for p in folders if p is not None] + rows


def run_check(concurrency: int) -> tuple[list[dict[str, Any]], float]:
    from agentrl.check import check_paths
    from agentrl.sandbox.docker import DockerProvider

    paths = corpus_paths()
    if not paths:
        raise SystemExit(f"no corpus found ({corpus.missing_reason(['terminal-bench'])})")
    started = time.monotonic()
    rows = check_paths(paths, DockerProvider(), concurrency=concurrency)
    return [r.model_dump() for r in rows], time.monotonic() - started


def read_records(folder: Path) -> tuple[list[dict[str, Any]], float]:
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    if not records:
        raise SystemExit(f"no conformance records in {folder}")
    seconds = sum(r["oracle"]["seconds"] + r["noop"]["seconds"] for r in records) / 2
    return records, seconds


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of docs/tasks.md#conformance."""
    lines = ["| corpus | instances | oracle 1.0 and no-op 0.0 |", "|---|---|---|"]
    for kind, title in KINDS.items():
        mine = [r for r in rows if r["format"] == kind]
        if mine:
            lines.append(f"| {title} | {len(mine)} | **{sum(r['ok'] for r in mine)}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/conformance.json")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--records", type=Path, help="read CI's records instead of running")
    args = parser.parse_args()
    if args.records:
        rows, seconds = read_records(args.records)
        command = f"python benchmarks/conformance.py --records {args.records}"
    else:
        rows, seconds = run_check(args.concurrency)
        command = "python benchmarks/conformance.py"
    by_format: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = by_format.setdefault(row["format"], {"instances": 0, "pass": 0})
        counts["instances"] += 1
        counts["pass"] += row["ok"]
    result = {
        "command": command,
        "machine": f"{platform.machine()}, {platform.system()}",
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(seconds, 1),
        "summary": by_format,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    for row in rows:
        if not row["ok"]:
            print(f"FAIL {row['task']} {row['instance']}: {row['oracle']} / {row['noop']}")
    print(f"{len(rows)} instances, {seconds:.0f} s of episodes -> {args.out}")


if __name__ == "__main__":
    main()
