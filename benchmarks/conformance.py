"""Conformance: genuine published tasks, unchanged, through `agentrl check`.

Runs every task of the local corpus (tests/corpus/: Terminal-Bench 1.x and Harbor task
folders, SWE-bench Lite rows, as listed with their provenance in tests/corpus.json and
tests/corpus-swe.json) through the same sandbox and grader that training uses: the
reference solution must earn 1.0 and doing nothing less. The corpus is collected
locally and not committed (third-party material); its manifests say where each piece
comes from. Writes benchmarks/results/conformance.json.

    .venv/bin/python benchmarks/conformance.py [--corpus tests/corpus] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from agentrl.check import check_paths
from agentrl.sandbox.docker import DockerProvider

ROOT = Path(__file__).resolve().parents[1]


def corpus_paths(corpus: Path) -> list[Path]:
    """Every task folder and row file of the corpus, in a stable order."""
    folders = [
        p for kind in ("terminal-bench", "harbor") for p in sorted((corpus / kind).glob("*"))
    ]
    rows = sorted((corpus / "swe-bench").glob("*.jsonl"))
    return [p for p in folders if p.is_dir()] + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "tests" / "corpus")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/conformance.json")
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    paths = corpus_paths(args.corpus)
    if not paths:
        raise SystemExit(f"no corpus in {args.corpus}: see tests/corpus.json for what it holds")
    started = time.monotonic()
    rows = check_paths(paths, DockerProvider(), concurrency=args.concurrency)
    seconds = time.monotonic() - started
    by_format: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = by_format.setdefault(row.format, {"instances": 0, "pass": 0})
        counts["instances"] += 1
        counts["pass"] += row.ok
    result = {
        "command": "python benchmarks/conformance.py",
        "machine": f"{platform.machine()}, {platform.system()}",
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(seconds, 1),
        "summary": by_format,
        "rows": [r.model_dump() for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for fmt, counts in by_format.items():
        print(f"{fmt}: {counts['pass']} of {counts['instances']} pass")
    for row in rows:
        if not row.ok:
            print(f"FAIL {row.task} {row.instance}: oracle {row.oracle} no-op {row.noop}")
    print(f"{len(rows)} instances in {seconds:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
