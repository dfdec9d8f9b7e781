"""EVAL's cost: grading in a fresh copy of the sandbox (the image plus the agent's outputs)
against the in-place seal it replaced, in one run.

    .venv/bin/python benchmarks/eval_cost.py [--n 8] [--before a1ff054] [--out FILE]

For each target, `n` episodes are started through the task's runtime (INIT as training
does), given the reference solution and some realistic leftovers (a pip-style cache, a
scratch folder, a background process), and graded with `env.evaluate`; the seconds of
`evaluate` are kept. The same script runs the code of `--before` (a git worktree of that
commit, in a subprocess, alternating with this tree's so both see the same machine
load) and this tree's. Targets: the main job's task (`look-then-act`, a YAML command
grader), a Terminal-Bench task with its tests in the sandbox (`fix-wordfreq`), and a
SWE-bench row (`tasks/swe_bench`, graded from the agent's patch in a fresh container both
before and after). Writes JSON (default benchmarks/results/eval_cost.json) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGETS = {
    "look-then-act (main job, YAML command grader)": "tasks/train/look-then-act/task.yaml",
    "fix-wordfreq (Terminal-Bench, tests in the sandbox)": "tasks/terminal/fix-wordfreq",
    "SWE-bench row (patch graded in a fresh container)": "tasks/swe_bench/instances.jsonl",
}
LEFTOVERS = (
    "mkdir -p /root/.cache/pip/http && head -c 20000000 /dev/urandom > /root/.cache/pip/http/blob; "
    "mkdir -p /tmp/scratch && for i in $(seq 200); do echo $i > /tmp/scratch/f$i; done; "
    "(setsid sleep 600 >/dev/null 2>&1 < /dev/null &)"
)
"""What an agent typically leaves outside its outputs: 20 MB of cache, 200 scratch files,
a process."""


async def measure(target: str, n: int, run_id: str) -> list[float]:
    """Seconds of `env.evaluate` for `n` solved episodes of `target`'s first instance."""
    from agentrl.episode import make_env
    from agentrl.sandbox.base import ExecRequest
    from agentrl.sandbox.docker import DockerProvider
    from agentrl.tasks.formats import load_any

    task = load_any(REPO / target)
    instance = task.instances[0]
    env = make_env(task, DockerProvider(reap_at_start=False), run_id)
    seconds = []
    for k in range(n):
        sandbox = await env.init(instance, f"bench-{k}")
        try:
            await env.run_oracle(sandbox, instance)
            await sandbox.exec(ExecRequest(command=LEFTOVERS, timeout=120))
            start = time.perf_counter()
            grade = await env.evaluate(sandbox, instance)
            seconds.append(time.perf_counter() - start)
            assert grade.reward == 1.0, grade.evidence.output[-500:]
        finally:
            await sandbox.close()
    return seconds


def one(target: str, n: int, tree: Path | None) -> list[float]:
    """`measure` in this process (tree None) or in a subprocess on another tree's code."""
    run_id = f"bench-eval-{uuid.uuid4().hex[:6]}"
    if tree is None:
        return asyncio.run(measure(target, n, run_id))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (
        "import asyncio, json, sys; sys.path.insert(0, sys.argv[1]); "
        "from eval_cost import measure; "
        "print(json.dumps(asyncio.run(measure(sys.argv[2], int(sys.argv[3]), sys.argv[4]))))"
    )
    argv = [sys.executable, "-c", code, str(Path(__file__).parent), target, str(n), run_id]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the --before tree failed on {target}: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def stats(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "median_s": round(statistics.median(samples), 3),
        "mean_s": round(statistics.fmean(samples), 3),
        "min_s": round(min(samples), 3),
        "max_s": round(max(samples), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8, help="episodes per target and tree")
    parser.add_argument("--before", default="a1ff054", help="the commit to compare with")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/eval_cost.json")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "before": args.before,
        "after": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip(),
        "leftovers": LEFTOVERS,
        "targets": {},
    }
    with tempfile.TemporaryDirectory() as folder:
        tree = Path(folder) / "before"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), args.before],
            check=True,
        )
        try:
            for name, target in TARGETS.items():
                before: list[float] = []
                after: list[float] = []
                for _ in range(args.n // 2):  # alternate, so both see the same load
                    before += one(target, 2, tree)
                    after += one(target, 2, None)
                ratio = statistics.median(after) / statistics.median(before)
                results["targets"][name] = {
                    "before": stats(before),
                    "after": stats(after),
                    "after_over_before": round(ratio, 2),
                }
                print(name, json.dumps(results["targets"][name]), flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False
            )
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
