"""What running a Harbor dataset side by side saves: `agentrl run DATASET` (its tasks
through one dispatcher, their first INITs four at a time) against the same tasks run one
after another, `agentrl run TASK` each in turn (what `run DATASET` did before).

    .venv/bin/python benchmarks/dataset_run.py [--tasks 8] [--build-s 4] [--test-s 2]

The dataset: `--tasks` Harbor folders on agentrl's base image whose Dockerfile takes
`--build-s` seconds to build (a `sleep`, as a download would) and whose test.sh takes
`--test-s`; a one-command scripted policy. Each arm builds its images cold (a fresh
nonce in every Dockerfile), then both are removed. Wall seconds of each arm and their
ratio, in the same run. Writes benchmarks/results/dataset_run.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "dataset_run.json"
NOOP = '<tool_call>{"name": "bash", "arguments": {"command": "true"}}</tool_call>'


def dataset(folder: Path, tasks: int, build_s: float, test_s: float) -> list[Path]:
    nonce = uuid.uuid4().hex[:12]
    made = []
    for n in range(tasks):
        task = folder / f"task-{n:02d}"
        (task / "environment").mkdir(parents=True)
        (task / "environment" / "Dockerfile").write_text(
            f"FROM agentrl/base:bookworm\nRUN sleep {build_s} && echo {nonce}-{n} > /built\n"
            "WORKDIR /app\n"
        )
        (task / "tests").mkdir()
        (task / "tests" / "test.sh").write_text(
            f"#!/bin/bash\nsleep {test_s}\necho 0 > /logs/verifier/reward.txt\n"
        )
        (task / "instruction.md").write_text("Do nothing.\n")
        (task / "task.toml").write_text('version = "1.0"\n')
        made.append(task)
    return made


def play(tasks: list[Path], out: Path, *, side_by_side: bool) -> float:
    """Wall seconds of one scripted episode of each task, in this process: through
    `run_tasks` at once, or `run_task` for each in turn (what `run DATASET` did)."""
    import asyncio

    from agentrl.dispatch.base import PipelineConfig
    from agentrl.inference.embedded import load_tokenizer
    from agentrl.inference.scripted import ScriptedSampler
    from agentrl.runner import RunJob, run_task, run_tasks
    from agentrl.sandbox.docker import DockerProvider
    from agentrl.tasks.formats import load_any
    from agentrl.tasks.select import with_overrides

    tokenizer = load_tokenizer()
    loaded = [with_overrides(load_any(t), {"max_turns": 1}) for t in tasks]
    options = {"dispatcher": PipelineConfig(concurrency=4), "show_progress": False}

    async def go() -> None:
        sampler = ScriptedSampler([NOOP] * len(tasks), tokenizer)
        provider = DockerProvider(reap_at_start=False)
        if side_by_side:
            jobs = [RunJob(task, out / task.spec.name) for task in loaded]
            await run_tasks(jobs, sampler, tokenizer, provider, **options)
        else:
            for task in loaded:
                await run_task(task, sampler, tokenizer, provider, out / task.spec.name, **options)

    start = time.monotonic()
    asyncio.run(go())
    return time.monotonic() - start


def remove_images(prefix: str) -> None:
    names = subprocess.run(
        ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", prefix],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if names:
        subprocess.run(["docker", "rmi", "-f", *names], capture_output=True, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--build-s", type=float, default=4.0)
    parser.add_argument("--test-s", type=float, default=2.0)
    args = parser.parse_args()
    result: dict[str, object] = {"tasks": args.tasks, "build_s": args.build_s}
    result["test_s"] = args.test_s
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            tasks = dataset(root / "one-by-one", args.tasks, args.build_s, args.test_s)
            result["one_by_one_s"] = round(play(tasks, root / "a", side_by_side=False), 1)
            tasks = dataset(root / "side-by-side", args.tasks, args.build_s, args.test_s)
            result["side_by_side_s"] = round(play(tasks, root / "b", side_by_side=True), 1)
        finally:
            remove_images("agentrl/task-task-*")
    result["speedup"] = round(result["one_by_one_s"] / result["side_by_side_s"], 2)  # type: ignore[operator]
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
