"""Snapshot cost: time per `docker commit`, and what every-turn snapshots cost an episode.

    .venv/bin/python benchmarks/snapshot.py [--commits 20] [--reps 2] [--out FILE]

1. Time per snapshot: a sandbox of the base image and one of a shipped SWE-bench
   instance image (tasks/swe_bench, its repository checked out), each changed a little
   and committed `--commits` times; p50/p95. Target: <= 0.3 s on the base image.
2. Episode slowdown: each shipped terminal task (tasks/terminal) run by a scripted
   five-turn agent (look around, run the reference solution, look again, finish) with
   snapshots off and with a snapshot after INIT and every turn, arms interleaved,
   `--reps` times. Generation is modelled: each reply takes 5.1 ms per token (the p50
   inter-token latency of a published vLLM sweep at low concurrency; see
   benchmarks/dispatch.py), during which the previous turn's commit runs. Also
   reported with instant generation, where every commit is exposed. Target: <= 20%.
Writes JSON (default benchmarks/results/snapshot.json) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from agentrl.episode import Episode, make_env
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler
from agentrl.replay import snapshot_ids
from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.docker import DockerProvider, remove_run
from agentrl.tasks.formats import load_any
from agentrl.tasks.spec import SnapshotPolicy
from agentrl.tasks.terminal.load import oracle_script

ROOT = Path(__file__).resolve().parents[1]
SECONDS_PER_TOKEN = 0.0051


class Paced:
    """A sampler that takes as long as a GPU would to produce the inner sampler's reply."""

    def __init__(self, inner: ScriptedSampler, per_token: float) -> None:
        self.inner, self.per_token = inner, per_token
        self.policy_version = 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        completion = await self.inner.generate(prompt_ids, params, session_id)
        await asyncio.sleep(len(completion.token_ids) * self.per_token)
        return completion

    async def close(self) -> None:
        await self.inner.close()


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p95_ms": round(ordered[int(0.95 * (len(ordered) - 1))] * 1000, 1),
    }


async def commit_times(provider: DockerProvider, image: str, n: int, run_id: str) -> list[float]:
    box = await provider.start(SandboxSpec(image=image, run_id=run_id, name="bench"))
    times, ids = [], []
    try:
        for i in range(n):
            await box.exec(ExecRequest(command=f"echo {i} >> /tmp/changes && touch /tmp/f{i}"))
            start = time.perf_counter()
            ids.append(await box.snapshot(f"c{i}"))
            times.append(time.perf_counter() - start)
    finally:
        await box.close()
        for snapshot in reversed(ids):
            await provider.remove_snapshot(snapshot)
    return times


def agent_script(folder: Path) -> list[str]:
    """Five replies: two looks around, the reference solution, one more look, finish."""
    solution = oracle_script(folder).read_text()

    def call(name: str, **arguments: str) -> str:
        return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"

    return [
        call("bash", command="ls -la"),
        call("bash", command="find . -maxdepth 2 -type f | head -n 20"),
        call(
            "bash",
            command=f"cat > /tmp/solve.sh <<'AGENTRL_EOF'\n{solution}\nAGENTRL_EOF\n"
            "bash /tmp/solve.sh",
        ),  # fmt: skip
        call("bash", command="ls -la"),
        call("finish", message="done"),
    ]


async def episode_seconds(
    folder: Path, provider: DockerProvider, tokenizer: Any, every: int, per_token: float
) -> tuple[float, float | None, int]:
    task = load_any(folder)
    # Room for the longest reply (a reference solution inline); the limits are not measured.
    limits = task.spec.limits.model_copy(update={"max_new_tokens": 8192, "context_length": 32768})
    task = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    run_id = f"bench-snapshot-{uuid.uuid4().hex[:6]}"
    env = make_env(task, provider, run_id)
    sampler = Paced(ScriptedSampler(agent_script(folder), tokenizer), per_token)
    policy = SnapshotPolicy(every=every, keep_successful=1.0)
    ep = Episode(task, task.instances[0], 0, sampler, tokenizer, env, snapshots=policy)  # type: ignore[arg-type]
    start = time.perf_counter()
    try:
        await ep.init()
        await ep.run()
        await ep.evaluate()
        seconds = time.perf_counter() - start
    finally:
        await ep.close()
    traj = ep.result()
    ids = snapshot_ids([traj])
    for snapshot in reversed(ids):
        await provider.remove_snapshot(snapshot)
    remove_run(provider.client, run_id)
    return seconds, traj.reward, len(ids)


async def main(commits: int, reps: int) -> dict[str, Any]:
    provider = DockerProvider()
    tokenizer = load_tokenizer()
    run_id = f"bench-snapshot-{uuid.uuid4().hex[:6]}"
    swe = load_any(ROOT / "tasks" / "swe_bench" / "instances.jsonl")
    swe_env = make_env(swe, provider, run_id)
    swe_image = await swe_env.instance_image(swe.instances[0])
    out: dict[str, Any] = {"commit": {}}
    for name, image in (("base", "agentrl/base:bookworm"), ("swe_instance", swe_image)):
        await commit_times(provider, image, 2, run_id)  # warm-up
        out["commit"][name] = {
            "image": image,
            **_ms(await commit_times(provider, image, commits, run_id)),
        }
    folders = sorted(p for p in (ROOT / "tasks" / "terminal").iterdir() if p.is_dir())
    arms: dict[str, dict[str, list[float]]] = {}
    rewards: dict[str, list[float | None]] = {}
    for pace_name, per_token in (
        ("modelled_generation", SECONDS_PER_TOKEN),
        ("instant_generation", 0.0),
    ):
        arm = arms.setdefault(pace_name, {"off": [], "every_turn": []})
        for rep in range(reps):
            for folder in folders:
                order = [(0, "off"), (1, "every_turn")]
                for every, key in order if rep % 2 == 0 else order[::-1]:
                    seconds, reward, n = await episode_seconds(
                        folder, provider, tokenizer, every, per_token
                    )
                    arm[key].append(seconds)
                    rewards.setdefault(f"{folder.name}/{key}", []).append(reward)
                    print(
                        f"{pace_name} {folder.name} {key}: {seconds:.2f} s, "
                        f"{n} snapshots, reward {reward}"
                    )
    out["episodes"] = {
        name: {
            "episodes_per_arm": len(arm["off"]),
            "seconds_off": round(sum(arm["off"]), 2),
            "seconds_every_turn": round(sum(arm["every_turn"]), 2),
            "slowdown": round(sum(arm["every_turn"]) / sum(arm["off"]) - 1, 4),
        }
        for name, arm in arms.items()
    }
    out["rewards_all_one"] = all(r == 1.0 for rs in rewards.values() for r in rs)
    out["targets"] = {
        "commit_base_p50_le_0.3s": out["commit"]["base"]["p50_ms"] <= 300,
        "slowdown_modelled_le_20pct": out["episodes"]["modelled_generation"]["slowdown"] <= 0.20,
    }
    remove_run(provider.client, run_id, snapshots=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "snapshot.json"
    )
    args = parser.parse_args()
    started = time.time()
    result = asyncio.run(main(args.commits, args.reps))
    result["machine"] = {"cpus": __import__("os").cpu_count(), "python": platform.python_version()}
    result["wall_s"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
