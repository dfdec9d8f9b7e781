"""What resuming a big evaluation costs: reading its recorded attempts back and scoring them.

    .venv/bin/python benchmarks/eval_resume.py [--attempts 400] [--tokens 16000]

A SWE-bench-sized evaluation (500 instances x 16 attempts, ~30k tokens an episode) is
thousands of long trajectories. `agentrl eval` resumes by reading its trajectories.jsonl
and scores with `agentrl.scores`; it keeps one `Outcome` (a few numbers) per attempt,
never the trajectories. This measures that against the alternative of holding every
trajectory (what reading the store into a list does), in the same run, each in a fresh
process: wall seconds and the peak resident memory above the process's baseline.

The file: `--attempts` trajectories of `--tokens` response tokens each (30 turns, half
the tokens sampled), 25 instances, written by the real TrajectoryStore.
Writes benchmarks/results/eval_resume.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "eval_resume.json"


def write(path: Path, attempts: int, tokens: int) -> None:
    from agentrl.trajectory import StopReason, Trajectory, TrajectoryStore, Turn

    store = TrajectoryStore(path)
    turns, per_turn = 30, tokens // 30
    mask = ([1] * (per_turn // 2) + [0] * (per_turn - per_turn // 2)) * turns
    n = len(mask)
    spans = [(k * per_turn, k * per_turn + per_turn // 2) for k in range(turns)]
    for a in range(attempts):
        store.append(
            Trajectory(
                trajectory_id=f"inst-{a % 25:02d}_{a // 25}",
                group_id=f"inst-{a % 25:02d}",
                task="swe-shaped",
                prompt_ids=list(range(1000, 3000)),
                response_ids=[(7 * i) % 49000 for i in range(n)],
                loss_mask=mask,
                logprobs=[-0.123456789 if m else 0.0 for m in mask],
                token_versions=[3 if m else -1 for m in mask],
                reward=float(a % 3 == 0),
                stop_reason=StopReason.finished,
                turns=[Turn(action="ls", span=s) for s in spans],
                seconds={"init": 1.0, "run": 100.0, "eval": 10.0},
            )
        )


def measure(path: Path, how: str) -> dict[str, float]:
    """Read and score `path` in a fresh process: `outcomes` (what agentrl eval does) or
    `trajectories` (every record held)."""
    code = f"""
import json, resource, time
from pathlib import Path
from agentrl.scores import score
from agentrl.evaluation import recorded
from agentrl.trajectory import TrajectoryStore
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.monotonic()
path = Path({str(path)!r})
held = recorded(path) if {how!r} == "outcomes" else list(TrajectoryStore(path))
scores = score(held)
seconds = time.monotonic() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"seconds": seconds, "peak_mb_above_base": (peak - base) / 1024,
                  "attempts": scores.overall.attempts, "pass_at_1": scores.overall.pass_at_1}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attempts", type=int, default=400)
    p.add_argument("--tokens", type=int, default=16000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trajectories.jsonl"
        t0 = time.monotonic()
        write(path, args.attempts, args.tokens)
        written_s = time.monotonic() - t0
        size_mb = path.stat().st_size / 2**20
        outcomes = measure(path, "outcomes")
        trajectories = measure(path, "trajectories")
    assert outcomes["attempts"] == trajectories["attempts"] == args.attempts
    assert outcomes["pass_at_1"] == trajectories["pass_at_1"]
    result = {
        "command": " ".join(["benchmarks/eval_resume.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "attempts": args.attempts,
        "response_tokens": args.tokens,
        "file_mb": round(size_mb, 1),
        "write_s": round(written_s, 1),
        "outcomes": {k: round(v, 2) for k, v in outcomes.items()},
        "trajectories": {k: round(v, 2) for k, v in trajectories.items()},
        "memory_ratio_trajectories_over_outcomes": round(
            trajectories["peak_mb_above_base"] / max(outcomes["peak_mb_above_base"], 0.1), 1
        ),
        "time_ratio_trajectories_over_outcomes": round(
            trajectories["seconds"] / outcomes["seconds"], 2
        ),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
