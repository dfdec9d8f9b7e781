"""The shipped training example, once per seed: does held-out reward rise every time?

    .venv/bin/python benchmarks/train_seeds.py [--seeds 0 1 2] [--parallel 1]

Runs `agentrl train examples/train/shell-basics.yaml --seed S` for each seed (each
~13 min on 2 CPU cores), reads each run's summary.json and writes
benchmarks/results/train_seeds.json: held-out reward before and after training with
95% normal intervals, and the improvement with its interval (independent samples:
half-width 1.96 * sqrt(se_before^2 + se_after^2)). `--parallel 2` runs two seeds at
once (slower each, faster in all on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "train" / "shell-basics.yaml"
RESULTS = Path(__file__).parent / "results"


def run(seed: int, out: Path) -> dict[str, Any]:
    started = time.monotonic()
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(CONFIG), "--seed", str(seed)]
    cmd += ["--out", str(out), "--overwrite"]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {proc.returncode}); see {log}")
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    half = math.hypot(before["reward_ci95"], after["reward_ci95"])
    return {
        "seed": seed,
        "before": before,
        "after": after,
        "improvement": round(after["reward_mean"] - before["reward_mean"], 4),
        "improvement_ci95": round(half, 4),
        "improved_beyond_ci": after["reward_mean"] - before["reward_mean"] > half,
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "train-seeds")
    parser.add_argument("--out", type=Path, default=RESULTS / "train_seeds.json")
    args = parser.parse_args()
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda s: run(s, args.runs / f"seed-{s}"), args.seeds))
    report = {"config": str(CONFIG.relative_to(ROOT)), "parallel": args.parallel, "runs": rows}
    report["all_improved_beyond_ci"] = all(r["improved_beyond_ci"] for r in rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for r in rows:
        print(
            f"seed {r['seed']}: held-out {r['before']['reward_mean']:.3f} -> "
            f"{r['after']['reward_mean']:.3f} (+{r['improvement']:.3f} +- "
            f"{r['improvement_ci95']:.3f}, {r['after']['episodes']} episodes)"
            f" in {r['wall_s']:.0f} s"
        )


if __name__ == "__main__":
    main()
