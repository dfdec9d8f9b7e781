"""Outcome-only GRPO against branch credit on the multi-turn main job, by sampled tokens.

    .venv/bin/python benchmarks/branch_credit.py [--arms outcome branch] [--seeds 0 1 2]

Trains `examples/train/look-then-act.yaml` once per arm and seed, evaluating the held-out
instances after every step (`eval.every: 1`, 2 episodes each: 36 per point):

- outcome: the config as shipped (grpo: every token of an episode gets its advantage);
- branch: `algorithm.advantage.estimator: branch` (docs/training.md): for every episode,
  the states before its turns 1 and 2 are restored from their snapshots and continued
  `k: 2` times; per-turn advantages are differences of the values those continuations
  estimate. The continuations are not trained on.
- branch-train: the same, and the continuations are trained on too (their own turns,
  against the value of the state they started from), so their tokens are not only spent.

The x-axis is sampled tokens: the training episodes' own plus, for the branch arm, the
tokens the continuations sampled after their branch point (`branch_sampled_tokens`).
For each seed and threshold (held-out reward 0.8 and 0.9) it finds the tokens needed to
first reach it (linear between evaluated steps) and reports branch / outcome per seed
and their geometric mean (each branch arm against outcome); the same at equal training
wall time (rollout, branches and
optimizer steps; evaluations excluded). Results go to benchmarks/results/branch_credit.json
and a plot beside it (held-out reward against tokens and against wall time, mean and
95% interval over seeds). Arms run one after another; `--arms` runs some and merges
them into an existing report (each run records the commit it ran).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_seeds import variant  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "train" / "look-then-act.yaml"
RESULTS = Path(__file__).parent / "results"
THRESHOLDS = (0.8, 0.9)
COMMON: dict[str, Any] = {"eval": {"every": 1, "samples": 2}, "checkpoint": {"every": 0}}


def branch_arm(train: bool) -> dict[str, Any]:
    branch = {"k": 2, "select": "every", "every": 1, "train": train}
    return {
        "schedule": {"steps": 3},
        "algorithm": {"advantage": {"estimator": "branch", "branch": branch}},
    }


ARMS: dict[str, dict[str, Any]] = {
    "outcome": {"schedule": {"steps": 4}},
    "branch": branch_arm(train=False),
    "branch-train": branch_arm(train=True),
}
COLORS = {"outcome": "tab:gray", "branch": "tab:blue", "branch-train": "tab:orange"}


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout

    dirty = git("status", "--porcelain", "agentrl").strip()
    return git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if dirty else "")


def train(arm: str, seed: int, runs: Path) -> dict[str, Any]:
    """One `agentrl train` of `arm`; its curve read back from metrics.jsonl."""
    import yaml

    changes = merged(COMMON, ARMS[arm])
    base = yaml.safe_load(CONFIG.read_text())
    config = variant(CONFIG, f"branch-credit-{arm}", merged(base, changes))
    out = runs / f"{arm}-seed-{seed}"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config), "--seed", str(seed)]
    cmd += ["--out", str(out), "--overwrite"]
    started = time.monotonic()
    try:
        with out.with_suffix(".log").open("w") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    finally:
        config.unlink(missing_ok=True)
    if code != 0:
        raise SystemExit(f"{arm} seed {seed} failed (exit {code}); see {out.with_suffix('.log')}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train"]
    evals = {r["step"]: r for r in rows if r["kind"] == "eval"}
    tokens, wall, curve = 0, 0.0, []
    for step in [0] + [r["step"] for r in steps]:
        if step:
            r = steps[step - 1]
            tokens += r["sampled_tokens"] + (r.get("branch_sampled_tokens") or 0)
            wall += r["step_s"]
        e = evals[step]
        curve.append(
            {
                "step": step,
                "tokens": tokens,
                "wall_s": round(wall, 1),
                "heldout": round(e["reward_mean"], 4),
                "heldout_ci95": round(e["reward_ci95"], 4),
                "episodes": e["episodes"],
            }
        )
    prefixes = ("branch_", "turn_adv_", "failed_first_turn")
    branch_keys = [k for k in steps[0] if k.startswith(prefixes)]
    return {
        "arm": arm,
        "seed": seed,
        "commit": commit(),
        "total_s": round(time.monotonic() - started, 1),
        "curve": curve,
        "train_reward": [round(r["reward_mean"], 4) for r in steps],
        "sampled_tokens": [r["sampled_tokens"] for r in steps],
        "branch": [{k: r.get(k) for k in branch_keys} for r in steps] if branch_keys else None,
    }


def first_reach(curve: list[dict[str, Any]], x: str, level: float) -> float | None:
    """Where held-out reward first reaches `level`, linear between points (None: never)."""
    for a, b in zip(curve, curve[1:], strict=False):
        if a["heldout"] >= level:
            return float(a[x])
        if b["heldout"] >= level:
            f = (level - a["heldout"]) / (b["heldout"] - a["heldout"])
            return a[x] + f * (b[x] - a[x])
    return float(curve[0][x]) if curve and curve[0]["heldout"] >= level else None


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """arm / outcome of tokens (and wall) to first reach each threshold, per seed."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    out: dict[str, Any] = {}
    for arm in [a for a in ARMS if a != "outcome"]:
        seeds = sorted({s for a, s in by if a == arm} & {s for a, s in by if a == "outcome"})
        for x in ("tokens", "wall_s"):
            for level in THRESHOLDS:
                rows = []
                for s in seeds:
                    b = first_reach(by[arm, s]["curve"], x, level)
                    o = first_reach(by["outcome", s]["curve"], x, level)
                    ratio = round(b / o, 3) if b and o else None
                    rows.append({"seed": s, arm: b, "outcome": o, "ratio": ratio})
                ratios = [r["ratio"] for r in rows if r["ratio"]]
                geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
                out[f"{arm}/outcome {x} to {level}"] = {
                    "per_seed": rows,
                    "geomean_ratio": round(geo, 3) if geo else None,
                    "range": [min(ratios), max(ratios)] if ratios else None,
                }
    return out


def mean_curve(runs: list[dict[str, Any]], x: str) -> tuple[list[float], list[float], list[float]]:
    """Per step: mean x, mean held-out and the 95% interval of that mean over seeds."""
    xs, ys, cis = [], [], []
    for i in range(min(len(r["curve"]) for r in runs)):
        pts = [r["curve"][i] for r in runs]
        vals = [p["heldout"] for p in pts]
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0
        xs.append(sum(p[x] for p in pts) / len(pts))
        ys.append(m)
        cis.append(1.96 * sd / math.sqrt(len(vals)))
    return xs, ys, cis


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = ((axes[0], "tokens", "sampled tokens"), (axes[1], "wall_s", "train wall s"))
    for ax, x, label in panels:
        for arm, color in COLORS.items():
            runs = [r for r in report["runs"] if r["arm"] == arm]
            if not runs:
                continue
            for r in runs:
                ax.plot([p[x] for p in r["curve"]], [p["heldout"] for p in r["curve"]],
                        color=color, alpha=0.25, lw=1)  # fmt: skip
            xs, ys, cis = mean_curve(runs, x)
            ax.errorbar(xs, ys, yerr=cis, color=color, marker="o", capsize=3,
                        label=f"{arm} (mean of {len(runs)} seeds, 95% CI)")  # fmt: skip
        ax.set_xlabel(label + " (cumulative, training only)")
        ax.set_ylabel("held-out reward")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    fig.suptitle("look-then-act: outcome GRPO vs branch credit (k=2, before turns 1 and 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "branch-credit")
    parser.add_argument("--out", type=Path, default=RESULTS / "branch_credit.json")
    args = parser.parse_args()
    old = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    fresh = []
    for seed in args.seeds:  # arms alternate, so a load change hits both alike
        for arm in args.arms:
            fresh.append(train(arm, seed, args.runs))
            print(json.dumps({k: fresh[-1][k] for k in ("arm", "seed", "total_s", "curve")}))
    done = {(r["arm"], r["seed"]) for r in fresh}
    runs = [r for r in old if (r["arm"], r["seed"]) not in done] + fresh
    runs.sort(key=lambda r: (r["arm"], r["seed"]))
    report = {
        "config": str(CONFIG.relative_to(ROOT)),
        "arms": {arm: merged(COMMON, ARMS[arm]) for arm in ARMS},
        "machine": f"{os.cpu_count()} CPUs, shared",
        "runs": runs,
        "compare": compare(runs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    print(json.dumps(report["compare"], indent=1))


if __name__ == "__main__":
    main()
