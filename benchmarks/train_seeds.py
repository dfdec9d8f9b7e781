"""The shipped training example, once per seed: does held-out reward rise every time?

    .venv/bin/python benchmarks/train_seeds.py [--seeds 0 1 2] [--parallel 1] [--servers 2]

Runs `agentrl train examples/train/shell-basics.yaml --seed S` for each seed (each
~13 min on 2 CPU cores), reads each run's summary.json and writes
benchmarks/results/train_seeds.json: held-out reward before and after training with
95% normal intervals, and the improvement with its interval (independent samples:
half-width 1.96 * sqrt(se_before^2 + se_after^2)). `--parallel 2` runs two seeds at
once (slower each, faster in all on 2 cores). `--servers N` starts N `agentrl serve`
replicas and samples on them through the router (`agentrl train --servers`), for
comparison with the in-process sampler; results then go to train_seeds_served.json.
Each run's per-step train reward is kept (`curve`), to compare learning curves.
`--async S` trains the same config under the fully-async schedule with
max_staleness_steps S (same steps, prompts per step and samples); results then go to
train_seeds_async.json. `--tinker` trains examples/train/shell-basics-tinker.yaml (the
same job on the tinker backend, sampling at temperature 1) against an `agentrl
serve-tinker` it starts on a free loopback port; results go to train_seeds_tinker.json.
`--temperature T` overrides the sampling temperature of the in-process run (e.g. 1.0, to
compare with the tinker run on equal terms). `--config PATH` trains another config: the
multi-turn main job is

    .venv/bin/python benchmarks/train_seeds.py --config examples/train/look-then-act.yaml

whose results go to train_seeds_multiturn.json; the long-horizon job
(`--config examples/train/trail.yaml`) to train_seeds_long.json (any other config:
train_seeds_<stem>.json). Each run also reports, from the evaluations before and after,
tool calls per solved episode and segments per episode, and per training step the
segments per episode and the learner's logprob mismatch (all tokens, and the rewritten
segments' alone).
Each run also reports, per training step, the mean turns and tool calls per episode (its
metrics.jsonl's turns_mean and tool_calls_mean), and a plot beside the JSON shows
held-out reward before and after per seed and those per-step means.
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

from agentrl.http import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "train" / "shell-basics.yaml"
TINKER_CONFIG = CONFIG.with_name("shell-basics-tinker.yaml")
RESULTS = Path(__file__).parent / "results"
MULTITURN = CONFIG.with_name("look-then-act.yaml")
LONG = CONFIG.with_name("trail.yaml")


def variant(base: Path, tag: str, changes: dict[str, Any]) -> Path:
    """`base` with `changes` (mappings merged into the config's), written beside it: its
    task paths are relative to it."""
    import yaml

    config = yaml.safe_load(base.read_text())
    for key, value in changes.items():
        config[key] = config.get(key, {}) | value if isinstance(value, dict) else value
    path = base.with_name(f".{base.stem}-{tag}.yaml")
    path.write_text(yaml.safe_dump(config))
    return path


def start_tinker(logs: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`agentrl serve-tinker` (the embedded model) on a free loopback port, healthy."""
    import httpx2

    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "agentrl.cli", "serve-tinker", "--port", str(port)]
    cmd += ["--state-dir", str(logs / "tinker-state")]
    with (logs / "serve-tinker.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"serve-tinker exited; see {logs}")
        try:
            if httpx2.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx2.HTTPError:
            time.sleep(0.5)


def run(seed: int, out: Path, servers: list[str], config: Path = CONFIG) -> dict[str, Any]:
    started = time.monotonic()
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(config), "--seed", str(seed)]
    cmd += ["--out", str(out), "--overwrite"]
    if servers:
        cmd += ["--servers", ",".join(servers)]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {proc.returncode}); see {log}")
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r["step"] for r in rows if r["kind"] == "eval"]
    half = math.hypot(before["reward_ci95"], after["reward_ci95"])
    return {
        "seed": seed,
        "before": before,
        "after": after,
        "improvement": round(after["reward_mean"] - before["reward_mean"], 4),
        "improvement_ci95": round(half, 4),
        "improved_beyond_ci": after["reward_mean"] - before["reward_mean"] > half,
        "wall_s": round(time.monotonic() - started, 1),
        "curve": [round(r["reward_mean"], 4) for r in train],
        "turns_per_episode": [round(r["turns_mean"], 3) for r in train],
        "tool_calls_per_episode": [round(r["tool_calls_mean"], 3) for r in train],
        # segments per episode (1 + those a rewrite of history began), and the learner's
        # logprob mismatch on all sampled tokens and on those of the rewritten segments
        "segments_per_episode": [round(1 + r["segments"] / r["episodes"], 3) for r in train],
        "logprob_mismatch": [r.get("logprob_mismatch") for r in train],
        "logprob_mismatch_rewritten": [r.get("logprob_mismatch_rewritten") for r in train],
        "eval_before": episode_shape(out, min(evals)),
        "eval_after": episode_shape(out, max(evals)),
    }


def episode_shape(out: Path, step: int) -> dict[str, Any]:
    """Of one evaluation's episodes: tool calls per solved (reward 1) episode, and
    segments per episode."""
    from agentrl.trajectory import TrajectoryStore

    trajs = list(TrajectoryStore(out / "eval" / f"step-{step:06d}" / "trajectories.jsonl"))
    solved = [t for t in trajs if t.reward == 1.0]
    calls = [sum(u.tool_call is not None for u in t.turns) for t in solved]
    return {
        "episodes": len(trajs),
        "solved": len(solved),
        "tool_calls_per_solved": round(sum(calls) / len(calls), 3) if calls else None,
        "fewest_tool_calls_solved": min(calls) if calls else None,
        "segments_per_episode": round(sum(1 + len(t.segments) for t in trajs) / len(trajs), 3),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """Held-out reward before and after per seed (95% intervals), and turns and tool calls
    per episode over training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = report["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for k, (when, color) in enumerate((("before", "tab:gray"), ("after", "tab:blue"))):
        xs = [i + (k - 0.5) * 0.35 for i in range(len(runs))]
        ys = [r[when]["reward_mean"] for r in runs]
        errs = [r[when]["reward_ci95"] for r in runs]
        left.bar(xs, ys, 0.35, yerr=errs, capsize=4, color=color, label=when)
    left.set_xticks(range(len(runs)), [f"seed {r['seed']}" for r in runs])
    left.set_ylabel("held-out reward (95% interval)")
    left.set_title(report["config"])
    left.legend()
    for r in runs:
        steps = range(1, len(r["turns_per_episode"]) + 1)
        right.plot(steps, r["turns_per_episode"], "-o", label=f"turns, seed {r['seed']}")
        right.plot(steps, r["tool_calls_per_episode"], "--x", label=f"tool calls, seed {r['seed']}")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_xlabel("training step")
    right.set_ylabel("per episode")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def start_servers(n: int, logs: Path) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """`n` agentrl serve processes on free loopback ports, up and healthy."""
    import httpx2

    procs, urls = [], []
    logs.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        port = free_port()
        with (logs / f"serve-{i}.log").open("wb") as log:
            cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--port", str(port)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    for proc, url in zip(procs, urls, strict=True):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{url} exited; see {logs}")
            try:
                if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx2.HTTPError:
                time.sleep(0.5)
    return procs, urls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "train-seeds")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--servers", type=int, default=0, help="sample on N agentrl serve")
    parser.add_argument(
        "--async", dest="staleness", type=int, help="the async schedule with this S"
    )
    parser.add_argument("--tinker", action="store_true", help="the tinker backend example")
    parser.add_argument("--temperature", type=float, help="sample the in-process run at T")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the train config to run")
    args = parser.parse_args()
    base, changes, tags = args.config.resolve(), {}, []
    name, suffix = "train_seeds", ""
    if base != CONFIG:
        tag = {MULTITURN: "multiturn", LONG: "long"}.get(base, base.stem)
        name, suffix = f"train_seeds_{tag}", f"-{tag}"
    if args.servers:
        name, suffix = name + "_served", suffix + "-served"
    if args.staleness is not None:
        name, suffix = name + "_async", suffix + "-async"
        changes["schedule"] = {"type": "async", "max_staleness_steps": args.staleness}
        tags.append(f"async-s{args.staleness}")
    if args.temperature is not None:
        name, suffix = name + f"_t{args.temperature:g}", suffix + f"-t{args.temperature:g}"
        changes["temperature"] = args.temperature
        tags.append(f"t{args.temperature:g}")
    procs, urls = [], []
    if args.tinker:
        name, suffix, base = "train_seeds_tinker", "-tinker", TINKER_CONFIG
        proc, url = start_tinker(args.runs.with_name(args.runs.name + suffix) / "serve-logs")
        procs.append(proc)
        changes["backend"] = {"base_url": url}
        tags.append("local")
    config = variant(base, "-".join(tags), changes) if changes else base
    out = args.out or RESULTS / f"{name}.json"
    runs = args.runs.with_name(args.runs.name + suffix)
    if args.servers:
        procs, urls = start_servers(args.servers, runs / "serve-logs")
    try:
        with ThreadPoolExecutor(args.parallel) as pool:
            rows = list(pool.map(lambda s: run(s, runs / f"seed-{s}", urls, config), args.seeds))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        if config != base:
            config.unlink(missing_ok=True)
    report = {
        "config": str(base.relative_to(ROOT)),
        "temperature": args.temperature,
        "parallel": args.parallel,
        "servers": args.servers,
        "max_staleness_steps": args.staleness,
        "runs": rows,
    }
    report["all_improved_beyond_ci"] = all(r["improved_beyond_ci"] for r in rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    for r in rows:
        print(
            f"seed {r['seed']}: held-out {r['before']['reward_mean']:.3f} -> "
            f"{r['after']['reward_mean']:.3f} (+{r['improvement']:.3f} +- "
            f"{r['improvement_ci95']:.3f}, {r['after']['episodes']} episodes)"
            f" in {r['wall_s']:.0f} s"
        )


if __name__ == "__main__":
    main()
