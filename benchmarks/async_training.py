"""Sync vs fully async (S = 0, 1, 2, 4) on a long-tailed agentic workload, one run.

    .venv/bin/python benchmarks/async_training.py [--steps 12] [--staleness 0 1 2 4]

Every arm trains the same number of steps with the real trainer: the real pipeline
dispatcher, real sandboxes (the `local` provider: a shell per episode, real `sleep`
tool calls, a real grader command) and the native FSDP backend training a small
randomly initialised Llama (2 layers, hidden 32, the SmolLM2 vocabulary) on the
episodes' real tokens. Only generation is simulated (`agentrl.inference.simulated`, no
GPU here), with a continuous-batching latency model; a publication pauses it with
in-flight requests kept for `TRANSFER_S` (the weights' transfer), like a vLLM server
under pause "keep".

Workload, per episode (seeded by prompt and sample slot, so every arm sees the same
episodes for the same prompt): round(lognormal(median 3, sigma 0.6)) turns clipped to
[1, 12] (agent trajectories vary most in their number of turns: SWE-agent runs take
~18-24 turns with a maximum of 50, ../shared/reference/skyrl-agent-notes.md); each turn
decodes lognormal(median 100 tokens, sigma 1.0) clipped [16, 2500] tokens and runs
`sleep` for lognormal(median 0.15 s, sigma 1.0) clipped [0.02, 3] s; the last command
wins (creates the file the grader looks for) with probability 1/2. Decode steps take
2.5 ms + 0.0325 ms per request in flight (the dispatch benchmark's vLLM fit at half
scale). The tail is long: a step's slowest episode typically takes several times its
median one. `--fixed-turns 3` gives every episode 3 turns (a milder tail).

Sync: generate B groups, wait for the slowest episode, train, publish, repeat. Async:
groups are admitted while accepted + running <= (S + s) * B; the trainer takes any B
finished groups. Zero-variance groups (all 4 samples won or lost, ~1 in 8) are filtered
in the async arms (the default) and trained as no-ops in sync.

The trainer runs with one torch thread (`torch.set_num_threads(1)`): on a real node it
trains on GPUs while the CPUs run sandboxes and the dispatcher; on this 2-core machine the
rollout machinery (event loop, shells, graders) gets the other core instead of competing
with two intra-op threads for both. The model is sized so that a training step takes
about a quarter of a sync step, as generation dominates agentic RL steps.

`--learner tinker` runs the learner out of this process: the arms use the tinker backend
against an `agentrl serve-tinker` (one torch thread) on the same tiny model, generation
still simulated; results go to async_training_tinker.json. On this 2-core machine that
gives the learner a core of its own instead of a thread sharing the interpreter with the
event loop, shells and graders: the situation of a learner on a GPU.

Reported per arm: training wall time (the sum of step times, evaluations excluded), the
ratio sync / arm, the trainer's idle fraction (waiting for a batch), the sampler's idle
fraction (no request in flight), the lag distribution (consumed - scheduled step),
sampled tokens by version age, and the largest number of groups buffered + running
seen at any moment against the bound B * (S + 1). Writes
benchmarks/results/async_training.json and async_training.png.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agentrl.backends.fsdp import FSDPConfig
from agentrl.backends.tinker import TinkerConfig
from agentrl.dispatch.base import PipelineConfig
from agentrl.http import free_port
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler
from agentrl.inference.tinker import TinkerSampler
from agentrl.tasks.load import load_task
from agentrl.train import Trainer
from agentrl.train_config import (
    AsyncSchedule,
    CheckpointConfig,
    EvalConfig,
    SyncSchedule,
    TrainConfig,
)

RESULTS = Path(__file__).parent / "results"
LATENCY = LatencyModel(base_s=0.0025, per_request_s=0.0000325)
TRANSFER_S = 0.2
GROUPS, SAMPLES, MAX_TURNS = 4, 4, 12
FIXED_TURNS: int | None = None  # --fixed-turns
TRAIN_PROMPTS = 256

TASK_YAML = """\
name: long-tail
description: Run the commands, maybe win.
sandbox:
  image: agentrl/base:bookworm
  workdir: /workspace
instances:
{instances}
prompt:
  system: You run shell commands.
  instance: Go.
tools: [bash, finish]
limits:
  max_turns: {turns}
  max_new_tokens: 96
  context_length: 4096
  tool_timeout: 30
  episode_timeout: 600
sampling:
  temperature: 1.0
grader:
  type: command
  command: test -f ok
"""


def lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def script(session: str) -> Script:
    """The episode of `session` ('<prompt>_<sample>'): the same per prompt and sample
    slot in every arm (sample ids differ between schedules; their slot k does not)."""
    prompt, sample = session.rsplit("_", 1)
    key = f"{prompt}/{int(sample) % SAMPLES}"
    rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
    turns = FIXED_TURNS or round(lognormal(rng, 3, 0.6, 1, MAX_TURNS))
    win = rng.random() < 0.5
    replies, tokens = [], []
    for turn in range(turns):  # the last turn's command decides the reward
        sleep = lognormal(rng, 0.15, 1.0, 0.02, 3.0)
        command = f"sleep {sleep:.3f}" + ("; touch ok" if turn == turns - 1 and win else "")
        replies.append(_call("bash", command=command))
        tokens.append(round(lognormal(rng, 100, 1.0, 16, 2500)))
    replies.append(_call("finish", message="done"))
    tokens.append(16)
    return Script(replies=replies, tokens=tokens)


def _call(name: str, **arguments: str) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def tiny_model(folder: Path) -> Path:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)  # the embedded tokenizer: the same vocabulary
    return folder


class SimulatedTinkerSampler(TinkerSampler):
    """Generation simulated as in the other arms; publication is the Tinker service's
    real save_weights_and_get_sampling_client, whose version the engine then stamps (no
    pause: a Tinker snapshot is saved while sampling goes on)."""

    def __init__(self, simulated: SimulatedSampler) -> None:
        super().__init__()
        self.simulated = simulated

    def swap(self, client: Any, version: int) -> None:
        super().swap(client, version)
        self.simulated.update_weights({}, version)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        return await self.simulated.generate(prompt_ids, params, session_id)

    async def close(self) -> None:
        await self.simulated.close()


def start_tinker(model: Path, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`agentrl serve-tinker` on the tiny model, one torch thread, on a free port."""
    port = free_port()
    cmd = [sys.executable, "-m", "agentrl.cli", "serve-tinker", "--model", str(model)]
    cmd += ["--name", "bench-tiny", "--port", str(port), "--state-dir", str(work / "state")]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    with (work / "serve-tinker.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"serve-tinker exited; see {work / 'serve-tinker.log'}")
        try:
            with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit("serve-tinker did not come up in 5 minutes")


def arm(
    name: str,
    staleness: int | None,
    steps: int,
    work: Path,
    model: Path,
    tinker_url: str | None = None,
) -> dict[str, Any]:
    task_file = work / "task.yaml"
    out = work / name
    schedule: SyncSchedule | AsyncSchedule
    if staleness is None:
        schedule = SyncSchedule(
            type="sync", steps=steps, prompts_per_step=GROUPS, n_samples_per_prompt=SAMPLES
        )
    else:
        schedule = AsyncSchedule(
            type="async",
            steps=steps,
            prompts_per_step=GROUPS,
            n_samples_per_prompt=SAMPLES,
            max_staleness_steps=staleness,
        )
    config = TrainConfig(
        name=name,
        tasks=[str(task_file)],
        model=str(model),
        backend=(
            FSDPConfig(lr=1e-4, micro_batch_tokens=8192)
            if tinker_url is None
            else TinkerConfig(base_url=tinker_url, base_model="bench-tiny", lora_rank=0, lr=1e-4)
        ),
        # Tinker's ppo has no dual clip; off in the tinker arms (both of them).
        algorithm={"loss": {"dual_clip": None}} if tinker_url else {},
        schedule=schedule,
        dispatcher=PipelineConfig(concurrency=96, max_sandboxes=96, init_workers=8),
        eval=EvalConfig(holdout_every=64, samples=1),
        checkpoint=CheckpointConfig(every=0, keep=1),
        provider="local",
    )
    sampler: SimulatedSampler | SimulatedTinkerSampler
    if tinker_url is None:
        sampler = SimulatedSampler(script, load_tokenizer(), LATENCY, transfer_s=TRANSFER_S)
    else:
        sampler = SimulatedTinkerSampler(SimulatedSampler(script, load_tokenizer(), LATENCY))
    trainer = Trainer(config, [load_task(task_file)], out, show_progress=False, sampler=sampler)
    started = time.monotonic()
    asyncio.run(trainer.run())
    total = time.monotonic() - started
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    wall = sum(r["step_s"] for r in rows)
    waited = sum(r["wait_s"] for r in rows)
    lags: Counter[int] = Counter()
    ages: Counter[int] = Counter()
    for r in rows:
        lags.update({int(k): v for k, v in r.get("lag", {}).items()})
        ages.update({int(k): v for k, v in r.get("tokens_by_age", {}).items()})
    result: dict[str, Any] = {
        "arm": name,
        "max_staleness_steps": staleness,
        "steps": len(rows),
        "train_wall_s": round(wall, 2),
        "run_wall_s": round(total, 2),
        "trainer_idle_frac": round(waited / wall, 4),
        "sampler_idle_frac": round(
            sum(r["sampler_idle_frac"] * r["step_s"] for r in rows) / wall, 4
        ),
        "step_s": [r["step_s"] for r in rows],
        "lag": {str(k): lags[k] for k in sorted(lags)},
        "tokens_by_version_age": {str(k): ages[k] for k in sorted(ages)},
        "reward_mean": round(sum(r["reward_mean"] for r in rows) / len(rows), 4),
    }
    timeline_file = out / "admission.jsonl"
    if staleness is not None:
        timeline = [json.loads(x) for x in timeline_file.read_text().splitlines()]
        bound = GROUPS * (staleness + 1)
        peak = max(r["buffered"] + r["running"] for r in timeline)
        result.update(
            bound_groups=bound,
            peak_buffered_plus_running=peak,
            bound_held=peak <= bound,
            filtered_groups=timeline[-1]["filtered"],
            stale_groups=sum(r["stale_groups"] for r in rows),
            timeline=[[round(r["t"], 2), r["running"], r["buffered"]] for r in timeline],
        )
    return result


def plot(results: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_lag) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["arm"] for r in results]
    walls = [r["train_wall_s"] for r in results]
    idle = [r["trainer_idle_frac"] * r["train_wall_s"] for r in results]
    ax.bar(names, walls, label="training wall time")
    ax.bar(names, idle, label="of which the trainer waited", alpha=0.7)
    for k, r in enumerate(results):
        ax.text(k, walls[k], f"{results[0]['train_wall_s'] / r['train_wall_s']:.2f}x", ha="center")
    ax.set_ylabel("seconds")
    ax.set_title(f"{results[0]['steps']} steps, long-tailed episodes (ratio: sync / arm)")
    ax.legend()
    width = 0.8 / max(1, len(results) - 1)
    for k, r in enumerate(r for r in results if r["max_staleness_steps"] is not None):
        lags = {int(a): b for a, b in r["lag"].items()}
        ax_lag.bar([x + k * width for x in lags], list(lags.values()), width, label=r["arm"])
    ax_lag.set_xlabel("lag (consumed - scheduled step)")
    ax_lag.set_ylabel("groups")
    ax_lag.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--out", type=Path, default=RESULTS / "async_training.json")
    parser.add_argument("--fixed-turns", type=int, help="every episode this many turns")
    parser.add_argument(
        "--learner",
        choices=["in-process", "tinker"],
        default="in-process",
        help="tinker: the learner runs in an agentrl serve-tinker process (the tinker backend)",
    )
    args = parser.parse_args()
    if args.learner == "tinker" and args.out == RESULTS / "async_training.json":
        args.out = RESULTS / "async_training_tinker.json"
    global FIXED_TURNS
    FIXED_TURNS = args.fixed_turns
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    arms: list[tuple[str, int | None]] = [("sync", None)]
    arms += [(f"async S={s}", s) for s in args.staleness]
    results = []
    with tempfile.TemporaryDirectory(prefix="agentrl-async-bench-") as tmp:
        work = Path(tmp)
        n = TRAIN_PROMPTS + TRAIN_PROMPTS // 63 + 1  # every 64th is held out
        instances = "\n".join(f"  - {{id: q{i:03d}}}" for i in range(n))
        (work / "task.yaml").write_text(TASK_YAML.format(instances=instances, turns=MAX_TURNS + 1))
        model = tiny_model(work / "model")
        server, url = start_tinker(model, work) if args.learner == "tinker" else (None, None)
        try:
            for name, staleness in arms:
                print(f"[async_training] {name} ...", flush=True)
                slug = name.replace(" ", "_").replace("=", "")
                results.append(arm(slug, staleness, args.steps, work, model, url))
                r = results[-1]
                print(
                    f"[async_training] {name}: {r['train_wall_s']} s, trainer idle "
                    f"{r['trainer_idle_frac']:.0%}, lag {r['lag']}",
                    flush=True,
                )
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
    sync_wall = results[0]["train_wall_s"]
    for r in results:
        r["speedup_vs_sync"] = round(sync_wall / r["train_wall_s"], 3)
    report = {
        "benchmark": "async_training",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "learner": args.learner,
        "workload": {
            "groups_per_step": GROUPS,
            "samples_per_group": SAMPLES,
            "turns": FIXED_TURNS or f"lognormal(median 3, sigma 0.6) in [1, {MAX_TURNS}]",
            "latency": LATENCY.model_dump(),
            "transfer_s": TRANSFER_S,
        },
        "arms": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    for r in results:
        bound = (
            f", peak {r.get('peak_buffered_plus_running')}/{r.get('bound_groups')}"
            if r["max_staleness_steps"] is not None
            else ""
        )
        print(f"{r['arm']:>12}: {r['train_wall_s']:7.1f} s  x{r['speedup_vs_sync']:.2f}{bound}")


if __name__ == "__main__":
    main()
