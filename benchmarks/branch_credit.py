"""Outcome-only GRPO against branch credit, by sampled tokens and sandbox seconds.

    .venv/bin/python benchmarks/branch_credit.py [--job look-then-act|trail]
        [--arms outcome branch ...] [--seeds 0 1 2]

`--job look-then-act` (the default) trains `examples/train/look-then-act.yaml`, the
3-turn job, once per arm and seed, evaluating the held-out instances after every step
(`eval.every: 1`, 2 episodes each: 36 per point):

- outcome: the config as shipped (grpo: every token of an episode gets its advantage);
- branch: `algorithm.advantage.estimator: branch` (docs/training.md): for every episode,
  the states before its turns 1 and 2 are restored from their snapshots and continued
  `k: 2` times; per-turn advantages are differences of the values those continuations
  estimate. The continuations are not trained on.
- branch-train: the same, and the continuations are trained on too (their own turns,
  against the value of the state they started from), so their tokens are not only spent.

`--job trail` trains `examples/train/trail.yaml`, the long-horizon job (9 tool calls a
solved episode), with the arms that analysis says should pay there (results in
branch_credit_long.json), 2 prompts x 8 samples a step (half the shipped batch, so that
3 seeds of two arms fit an afternoon here), evaluating 24 held-out episodes after every
step: outcome (6 steps); branch (`k: 2` from 2 states per episode, evenly spread; 4
steps, as each costs several outcome steps' tokens); branch-pool (the same with `pool:
true`: siblings with identical histories are free samples of each other's states, and a
state is branched once for the group); and two ablations of branch-pool:
branch-uncertain (`select: uncertain`: the states before and after the least certain
reply, `k: 3` each) and branch-train (its continuations trained on).

The x-axes are sampled tokens (the training episodes' own plus, for branch arms, what
the continuations sampled after their branch point, `branch_sampled_tokens`) and sandbox
seconds (the seconds every training episode and continuation held a sandbox: INIT or
restore, turns, EVAL). For each seed and threshold it finds the tokens (and sandbox
seconds, and training wall time) needed to first reach it (linear between evaluated
steps) and reports arm / outcome per seed and their geometric mean; a seed where one arm
never reached the level gives a bound instead (`ratio_at_least`, `ratio_at_most`, from
that arm's whole run) and is counted in `seeds_not_reached`. Results go to the
job's JSON and a plot beside it (held-out reward against each axis, mean and 95%
interval over seeds). Seeds are the outer loop and arms alternate within each, so a
change of machine load hits every arm alike; `--arms` runs some and merges them into an
existing report (each run records the commit it ran); `--report` trains nothing and
recomputes the report and plot from the runs it holds.
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
RESULTS = Path(__file__).parent / "results"


def branch_arm(steps: int, train: bool = False, **branch: Any) -> dict[str, Any]:
    return {
        "schedule": {"steps": steps},
        "algorithm": {
            "advantage": {"estimator": "branch", "branch": {"k": 2, "train": train} | branch}
        },
    }


JOBS: dict[str, dict[str, Any]] = {
    "look-then-act": {
        "config": ROOT / "examples" / "train" / "look-then-act.yaml",
        "out": RESULTS / "branch_credit.json",
        "thresholds": (0.8, 0.9),
        "common": {"eval": {"every": 1, "samples": 2}, "checkpoint": {"every": 0}},
        "arms": {
            "outcome": {"schedule": {"steps": 4}},
            "branch": branch_arm(3, select="every", every=1),
            "branch-train": branch_arm(3, train=True, select="every", every=1),
        },
    },
    "trail": {
        "config": ROOT / "examples" / "train" / "trail.yaml",
        "out": RESULTS / "branch_credit_long.json",
        "thresholds": (0.5, 0.8),
        "common": {
            "schedule": {"prompts_per_step": 2},
            "eval": {"every": 1, "samples": 1},
            "checkpoint": {"every": 0},
        },
        "arms": {
            "outcome": {"schedule": {"steps": 6}},
            "branch": branch_arm(4, select="count", count=2),
            "branch-pool": branch_arm(4, select="count", count=2, pool=True),
            "branch-uncertain": branch_arm(4, k=3, select="uncertain", count=1, pool=True),
            "branch-train": branch_arm(4, train=True, select="count", count=2, pool=True),
        },
    },
}
COLORS = {
    "outcome": "tab:gray",
    "branch": "tab:blue",
    "branch-train": "tab:orange",
    "branch-pool": "tab:green",
    "branch-uncertain": "tab:purple",
}
AXES = (
    ("tokens", "sampled tokens"),
    ("sandbox_s", "sandbox seconds"),
    ("wall_s", "train wall s"),
    ("step", "training steps"),
)


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


def train(job: dict[str, Any], arm: str, seed: int, runs: Path) -> dict[str, Any]:
    """One `agentrl train` of `arm`; its curve read back from metrics.jsonl."""
    import yaml

    changes = merged(job["common"], job["arms"][arm])
    base = yaml.safe_load(job["config"].read_text())
    config = variant(job["config"], f"branch-credit-{arm}", merged(base, changes))
    out = runs / f"{arm}-seed-{seed}"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config), "--seed", str(seed)]
    cmd += ["--out", str(out), "--overwrite"]
    started, ran = time.monotonic(), commit()  # the code the run starts from
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
    tokens, sandbox, wall, curve = 0, 0.0, 0.0, []
    for step in [0] + [r["step"] for r in steps]:
        if step:
            r = steps[step - 1]
            tokens += r["sampled_tokens"] + (r.get("branch_sampled_tokens") or 0)
            sandbox += r["sandbox_seconds"] + (r.get("branch_sandbox_seconds") or 0.0)
            wall += r["step_s"]
        if step not in evals:  # evaluated every few steps only
            continue
        e = evals[step]
        curve.append(
            {
                "step": step,
                "tokens": tokens,
                "sandbox_s": round(sandbox, 1),
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
        "commit": ran,
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


def compare(job: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """arm / outcome of tokens (sandbox seconds, wall) to first reach each threshold, per
    seed."""
    by = {(r["arm"], r["seed"]): r for r in runs}
    out: dict[str, Any] = {}
    for arm in [a for a in job["arms"] if a != "outcome"]:
        seeds = sorted({s for a, s in by if a == arm} & {s for a, s in by if a == "outcome"})
        if not seeds:
            continue
        for x, _ in AXES:
            for level in job["thresholds"]:
                b = [first_reach(by[arm, s]["curve"], x, level) for s in seeds]
                o = [first_reach(by["outcome", s]["curve"], x, level) for s in seeds]
                rows = [
                    {"seed": s, arm: bs, "outcome": os_}
                    | _ratio(by[arm, s], by["outcome", s], x, bs, os_)
                    for s, bs, os_ in zip(seeds, b, o, strict=True)
                    if x in by[arm, s]["curve"][0]  # a run from before the axis
                ]
                ratios = [r["ratio"] for r in rows if r["ratio"]]
                geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
                out[f"{arm}/outcome {x} to {level}"] = {
                    "per_seed": rows,
                    "geomean_ratio": round(geo, 3) if geo else None,
                    "range": [min(ratios), max(ratios)] if ratios else None,
                    "seeds_not_reached": {
                        arm: [r["seed"] for r in rows if r[arm] is None],
                        "outcome": [r["seed"] for r in rows if r["outcome"] is None],
                    },
                }
    return out


def _ratio(
    arm: dict[str, Any], outcome: dict[str, Any], x: str, b: float | None, o: float | None
) -> dict[str, Any]:
    """arm / outcome; when one of them never reached the level, the bound its whole run
    gives (`ratio_at_least`: the arm did not reach it within its run; `ratio_at_most`: the
    outcome arm did not), so a seed that fails to reach is not silently dropped."""
    if b and o:
        return {"ratio": round(b / o, 3)}
    if b is None and o:
        return {"ratio": None, "ratio_at_least": round(arm["curve"][-1][x] / o, 3)}
    if o is None and b:
        return {"ratio": None, "ratio_at_most": round(b / outcome["curve"][-1][x], 3)}
    return {"ratio": None}


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


def plot(report: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (x, label) in zip(axes.flat, AXES, strict=True):
        for arm, color in COLORS.items():
            runs = [r for r in report["runs"] if r["arm"] == arm and x in r["curve"][0]]
            if not runs:
                continue
            for r in runs:
                ax.plot([p[x] for p in r["curve"]], [p["heldout"] for p in r["curve"]],
                        color=color, alpha=0.25, lw=1)  # fmt: skip
            xs, ys, cis = mean_curve(runs, x)
            ax.errorbar(xs, ys, yerr=cis, color=color, marker="o", capsize=3,
                        label=f"{arm} (mean of {len(runs)} seeds, 95% CI)")  # fmt: skip
        ax.set_xlabel(label if x == "step" else label + " (cumulative, training only)")
        ax.set_ylabel("held-out reward")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


TITLES = {
    "look-then-act": "look-then-act: outcome GRPO vs branch credit (k=2, before turns 1 and 2)",
    "trail": "trail (9 tool calls, 2 prompts x 8 a step): outcome GRPO vs branch credit",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=list(JOBS), default="look-then-act")
    parser.add_argument("--arms", nargs="+", help="default: every arm of the job")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, help="default: runs/branch-credit[-JOB]")
    parser.add_argument("--out", type=Path, help="default: the job's results JSON")
    parser.add_argument(
        "--report", action="store_true", help="train nothing: recompute the report and plot"
    )
    args = parser.parse_args()
    job = JOBS[args.job]
    arms = args.arms or list(job["arms"])
    if unknown := sorted(set(arms) - set(job["arms"])):
        parser.error(f"{', '.join(unknown)}: not an arm of {args.job} ({', '.join(job['arms'])})")
    out = args.out or job["out"]
    runs_dir = args.runs or ROOT / "runs" / (
        "branch-credit" if args.job == "look-then-act" else f"branch-credit-{args.job}"
    )
    runs = json.loads(out.read_text())["runs"] if out.exists() else []
    if args.report:
        report = write_report(job, args.job, runs, out)
        print(json.dumps(report["compare"], indent=1))
        return
    for seed in args.seeds:  # arms alternate, so a load change hits them alike
        for arm in arms:
            run = train(job, arm, seed, runs_dir)
            print(json.dumps({k: run[k] for k in ("arm", "seed", "total_s", "curve")}))
            runs = [r for r in runs if (r["arm"], r["seed"]) != (arm, seed)] + [run]
            report = write_report(job, args.job, runs, out)  # after every run: hours of work
    print(json.dumps(report["compare"], indent=1))


def write_report(
    job: dict[str, Any], name: str, runs: list[dict[str, Any]], out: Path
) -> dict[str, Any]:
    runs = sorted(runs, key=lambda r: (r["arm"], r["seed"]))
    report = {
        "config": str(job["config"].relative_to(ROOT)),
        "arms": {arm: merged(job["common"], job["arms"][arm]) for arm in job["arms"]},
        "thresholds": list(job["thresholds"]),
        "machine": f"{os.cpu_count()} CPUs, shared",
        "runs": runs,
        "compare": compare(job, runs),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)
    plot(report, out.with_suffix(".png"), TITLES[name])
    return report


if __name__ == "__main__":
    main()
