"""Dispatchers on one SWE-shaped workload: batch vs sync vs pipeline, same generation slots.

    .venv/bin/python benchmarks/dispatch.py [--episodes 80] [--concurrency 8] [--seed 0]

Every episode is real: a Docker sandbox starts (INIT runs a setup command that sleeps
for the drawn setup time), each turn the policy's tool call is `sleep <d>` through the
persistent bash tool, and EVAL runs a grader command that sleeps for the drawn grading
time. Only generation is simulated (`agentrl.inference.simulated`), because no GPU
is here.

Workload model (per episode, all draws seeded; lognormal = median * exp(sigma * N(0,1))).
Shapes follow SWE-agent rollouts as described in ../shared/reference/skyrl-agent-notes.md
(section 2: ~18-24 turns per trajectory, max 50; container INIT with connection retries;
EVAL = a test harness run; 512 trajectories over 96 agents, ~5 per agent), with fewer
turns and every duration multiplied by TIME_SCALE so that the run takes minutes:
  setup_s   lognormal(median 2.0 s, sigma 0.6), clipped [0.2, 10]  (repo reset, env setup)
  turns     round(lognormal(median 6, sigma 0.5)), clipped [2, 16] (last turn calls finish)
  tokens    per turn lognormal(median 250, sigma 0.8), clipped [16, 2000]  (thinking is
            long-tailed: most turns are short, a few are long)
  tool_s    per turn lognormal(median 0.3 s, sigma 1.0), clipped [0.02, 6]  (ls/grep vs tests)
  grade_s   lognormal(median 3.0 s, sigma 0.5), clipped [0.5, 12]  (the test suite)
Sampler latency (continuous batching): a decode step of b requests takes
5.0 ms + 0.065 ms * b, a straight-line fit to a measured vLLM concurrency sweep (v0.23,
Qwen2.5-0.5B on one L4: inter-token latency p50 5.1, 5.2, 5.3, 5.5, 6.0, 7.1 ms at 1, 2,
4, 8, 16, 32 requests in flight). Decode is memory-bound: 8 requests together decode
~7x faster in total than one alone, so a slot left idle is throughput lost.
TIME_SCALE = 0.5 multiplies the step time and every sleep (the ratios are unchanged);
80 episodes over 8 slots (10 per slot) keep the start and the drain a small part.
The pipeline runs 2 x cores INITs at once (here 4): container starts are CPU work on
the Docker host, and 8 concurrent starts on 2 cores measured 1-3% slower end to end.

Lower bound on wall time (any dispatcher, generation concurrency C, S sandboxes):
  gen    = sum(tokens) * step_s(C) / C  + min(setup_s) + min(grade_s)
           (decoding at full concurrency is the most throughput C slots can give; the first
           request waits for some INIT, the last for nothing but one grading)
  sandbox= sum(setup_s + tool_s + grade_s) / S          (container work over sandbox slots)
  path   = max over episodes of setup_s + sum(tokens * step_s(1)) + sum(tool_s) + grade_s
  bound  = max(gen, sandbox, path); container start and exec overheads are not in it,
           so the bound is below what any real run can reach.
Generation-slot utilisation = requests inside sampler.generate / C, over time;
steady state = from the first moment all C slots are busy until fewer than C episodes
are left to RUN. `--slot-orders fair fifo` adds a pipeline arm per slot order.
Writes benchmarks/results/dispatch.json and dispatch.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import tempfile
import time
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from agentrl.dispatch import DispatchConfig
from agentrl.dispatch.metrics import DispatchMetrics
from agentrl.episode import Episode
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler
from agentrl.sandbox.docker import DockerProvider, remove_run
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Task

RESULTS = Path(__file__).parent / "results"
TIME_SCALE = 0.5
LATENCY = LatencyModel(base_s=0.005 * TIME_SCALE, per_request_s=0.000065 * TIME_SCALE)


def lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def draw(n: int, seed: int) -> list[dict[str, Any]]:
    """Per-episode plans: setup, turns (tokens and tool seconds), grading."""
    rng = random.Random(seed)
    k = TIME_SCALE
    plans = []
    for i in range(n):
        turns = int(round(lognormal(rng, 6, 0.5, 2, 16)))
        plans.append(
            {
                "id": f"ep{i:03d}",
                "setup_s": round(k * lognormal(rng, 2.0, 0.6, 0.2, 10), 3),
                "grade_s": round(k * lognormal(rng, 3.0, 0.5, 0.5, 12), 3),
                "tokens": [int(lognormal(rng, 250, 0.8, 16, 2000)) for _ in range(turns)],
                # The last turn calls finish: no tool time.
                "tool_s": [
                    round(k * lognormal(rng, 0.3, 1.0, 0.02, 6), 3) for _ in range(turns - 1)
                ],
            }
        )
    return plans


def make_task(plans: list[dict[str, Any]], folder: Path) -> Task:
    spec = {
        "name": "dispatch-bench",
        "description": "SWE-shaped timings: sleep at INIT, per tool call and at EVAL.",
        "sandbox": {
            "image": "agentrl/base:bookworm",
            "cpus": 0.25,
            "memory_mb": 128,
            "setup": ["sleep {setup_s}"],
        },
        "instances": [
            {"id": p["id"], "setup_s": p["setup_s"], "grade_s": p["grade_s"]} for p in plans
        ],
        "prompt": {"system": "You are a benchmark agent.", "instance": "Work, then finish."},
        "tools": ["bash", "finish"],
        "limits": {
            "max_turns": 32,
            "max_new_tokens": 256,
            "context_length": 16384,
            "tool_timeout": 60,
            "episode_timeout": 600,
        },
        "grader": {"type": "command", "command": "sleep {grade_s}"},
    }
    path = folder / "task.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return load_task(path)


def scripts(plans: list[dict[str, Any]]) -> dict[str, Script]:
    out = {}
    for p in plans:
        call = '<tool_call>{{"name": "bash", "arguments": {{"command": "sleep {}"}}}}</tool_call>'
        replies = [call.format(d) for d in p["tool_s"]]
        replies.append(
            '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>'
        )
        out[f"{p['id']}_0"] = Script(replies=replies, tokens=p["tokens"])
    return out


def lower_bound(plans: list[dict[str, Any]], slots: int, sandboxes: int) -> dict[str, float]:
    tokens = sum(sum(p["tokens"]) for p in plans)
    gen = tokens * LATENCY.step_s(slots) / slots
    gen += min(p["setup_s"] for p in plans) + min(p["grade_s"] for p in plans)
    work = sum(p["setup_s"] + sum(p["tool_s"]) + p["grade_s"] for p in plans)
    path = max(
        p["setup_s"] + sum(p["tokens"]) * LATENCY.step_s(1) + sum(p["tool_s"]) + p["grade_s"]
        for p in plans
    )
    bound = max(gen, work / sandboxes, path)
    return {
        "generation_s": round(gen, 2),
        "sandbox_s": round(work / sandboxes, 2),
        "critical_path_s": round(path, 2),
        "bound_s": round(bound, 2),
        "total_tokens": tokens,
        "container_work_s": round(work, 2),
    }


async def one(
    name: str,
    kind: str,
    task: Task,
    plans: list[dict[str, Any]],
    tokenizer: Any,
    provider: DockerProvider,
    options: dict[str, Any],
) -> DispatchMetrics:
    run_id = f"bench-dispatch-{name}-{uuid.uuid4().hex[:6]}"
    env = TaskEnv(task, provider, run_id)
    sampler = SimulatedSampler(scripts(plans), tokenizer, LATENCY)
    episodes = [Episode(task, inst, 0, sampler, tokenizer, env) for inst in task.instances]
    dispatcher = TypeAdapter(DispatchConfig).validate_python({"type": kind, **options}).build()
    bad = 0
    try:
        async with aclosing(dispatcher.run(episodes)) as stream:
            async for traj in stream:
                bad += traj.stop_reason.value != "finished" or traj.reward != 1.0
    finally:
        await sampler.close()
        remove_run(provider.client, run_id)
    if bad:
        print(f"warning: {name}: {bad} episode(s) did not finish with reward 1")
    assert dispatcher.metrics is not None
    return dispatcher.metrics


def plot(results: dict[str, DispatchMetrics], bound: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, m in results.items():
        xs = [t for t, _ in m.utilisation] + [m.wall_seconds]
        ys = [u * 100 for _, u in m.utilisation] + [0.0]
        ax.plot(xs, ys, label=f"{name} ({m.wall_seconds:.0f} s)", linewidth=1.6)
    ax.axvline(bound, color="grey", linestyle=":", label=f"lower bound ({bound:.0f} s)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("generation-slot utilisation (%)")
    ax.set_ylim(-2, 105)
    first = next(iter(results.values()))
    ax.set_title(f"{first.episodes} SWE-shaped episodes, {first.generation_slots} generation slots")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def arms(args: argparse.Namespace, sandboxes: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, dispatcher, options) per arm; one pipeline arm per slot order."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for kind in args.dispatchers:
        options: dict[str, Any] = {"concurrency": args.concurrency}
        if kind != "pipeline":
            out.append((kind, kind, options))
            continue
        for order in args.slot_orders:
            label = kind if order == "fair" else f"{kind}-{order}"
            pipeline = {"max_sandboxes": sandboxes, "init_workers": args.init_workers}
            out.append((label, kind, {**options, **pipeline, "slot_order": order}))
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    plans = draw(args.episodes, args.seed)
    tokenizer = load_tokenizer()
    provider = DockerProvider()
    sandboxes = args.max_sandboxes or 3 * args.concurrency
    bound = lower_bound(plans, args.concurrency, sandboxes)
    results: dict[str, DispatchMetrics] = {}
    with tempfile.TemporaryDirectory() as tmp:
        task = make_task(plans, Path(tmp))
        for name, kind, options in arms(args, sandboxes):
            started = time.monotonic()
            results[name] = await one(name, kind, task, plans, tokenizer, provider, options)
            m = results[name]
            print(
                f"{name:13s} wall {m.wall_seconds:7.1f} s  util mean {m.utilisation_mean:.0%}  "
                f"steady {m.utilisation_steady:.0%}  "
                f"/ bound {m.wall_seconds / bound['bound_s']:.2f}"
                f"  ({time.monotonic() - started:.0f} s)"
            )
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": {
            "episodes": args.episodes,
            "seed": args.seed,
            "generation_slots": args.concurrency,
            "pipeline_max_sandboxes": sandboxes,
            "pipeline_init_workers": args.init_workers,
            "time_scale": TIME_SCALE,
            "latency": LATENCY.model_dump(),
            "turns_total": sum(len(p["tokens"]) for p in plans),
        },
        "lower_bound": bound,
        "dispatchers": {
            name: {
                "wall_s": m.wall_seconds,
                "utilisation_mean": m.utilisation_mean,
                "utilisation_steady": m.utilisation_steady,
                "steady_window": m.steady_window,
                "ratio_to_lower_bound": round(m.wall_seconds / bound["bound_s"], 3),
                "peaks": m.peaks,
                "stage_mean_s": {
                    s: round(
                        sum(getattr(t, f"{s}_s") for t in m.timings) / max(len(m.timings), 1), 3
                    )
                    for s in ("init", "run", "eval")
                },
            }
            for name, m in results.items()
        },
    }
    if "batch" in results and "pipeline" in results:
        report["speedup_pipeline_over_batch"] = round(
            results["batch"].wall_seconds / results["pipeline"].wall_seconds, 3
        )
    if "sync" in results and "pipeline" in results:
        report["speedup_pipeline_over_sync"] = round(
            results["sync"].wall_seconds / results["pipeline"].wall_seconds, 3
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    (args.out.with_suffix(".metrics.json")).write_text(
        json.dumps({n: m.model_dump() for n, m in results.items()}) + "\n"
    )
    plot(results, bound["bound_s"], args.png)
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=80)
    parser.add_argument("--concurrency", type=int, default=8, help="generation slots, all arms")
    parser.add_argument("--max-sandboxes", type=int, help="pipeline's live sandboxes (3 x slots)")
    parser.add_argument(
        "--init-workers",
        type=int,
        default=2 * (os.cpu_count() or 1),
        help="pipeline's concurrent INITs (2 x cores: container starts are host CPU work)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dispatchers", nargs="+", default=["batch", "sync", "pipeline"])
    parser.add_argument(
        "--slot-orders",
        nargs="+",
        default=["fair"],
        choices=["fair", "fifo"],
        help="one pipeline arm per slot order",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "dispatch.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "dispatch.png")
    report = asyncio.run(main(parser.parse_args()))
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=2))
