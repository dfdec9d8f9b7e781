"""What `agentrl validate` costs on a big task: it should cost what reading the file does.

    .venv/bin/python benchmarks/validate.py [--rows 200000 5000]

For each size, a YAML task whose instances file (JSON Lines, beside it) holds that many
rows, each with an issue-sized text (~0.5 KB) its prompt quotes, and a train config that
names the task, are generated in a temporary folder. Each is validated by the real
command in a fresh process (`agentrl validate FILE`: the task with its prompts counted
with the embedded tokenizer, the train config with every instance loaded and the split
checked), and timed: wall seconds and the CPU seconds of the process. Beside them, the
floor: reading the rows file and parsing every line as JSON, in a fresh process.
Target: under 30 s for 200,000 instances (issue 39; it was still running after 19 min).
Writes benchmarks/results/validate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "validate.json"
AGENTRL = [sys.executable, "-m", "agentrl.cli"]

TASK = """\
name: fix-issue
description: Resolve an issue in a small repository.
sandbox: {image: agentrl/base:bookworm, workdir: /workspace, setup: ["git init -q"]}
instances: rows.jsonl
prompt:
  system: |
    You are a careful software engineer working in a Linux shell.
    Call exactly one tool per turn; call finish when the issue is resolved.
  instance: |
    Repository: {repo} (file {path}).
    Issue #{number}: {title}

    {body}
tools: [bash, str_replace_editor, finish]
limits: {max_turns: 30, max_new_tokens: 1024, context_length: 8192}
grader: {type: command, command: "cd /workspace && test -s {path}"}
"""

TRAIN = """\
name: fix-issue
tasks: [task.yaml]
model: embedded
schedule: {type: sync, steps: 10, prompts_per_step: 4, n_samples_per_prompt: 4}
"""

WORDS = (  # noqa: SIM905  (a sentence reads better than a list of 25 strings)
    "the function returns wrong value when input list is empty and raises an error "
    "instead of handling it parser config option default missing after update"
).split()


def write(folder: Path, rows: int) -> Path:
    """The task (and its rows, and a train config naming it) in `folder`; the task's path."""
    rng = random.Random(0)
    with (folder / "rows.jsonl").open("w") as f:
        for k in range(rows):
            body = " ".join(rng.choice(WORDS) for _ in range(90))
            row = {
                "id": f"issue-{k}",
                "repo": f"org/project-{k % 97}",
                "path": f"src/module_{k % 13}.py",
                "number": k,
                "title": " ".join(rng.choice(WORDS) for _ in range(8)),
                "body": body,
            }
            f.write(json.dumps(row) + "\n")
    (folder / "task.yaml").write_text(TASK)
    (folder / "train.yaml").write_text(TRAIN)
    return folder / "task.yaml"


def timed(argv: list[str]) -> dict[str, float | int | str]:
    """Wall and CPU seconds of `argv` in a fresh process, its exit code and last line."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "exit_code": done.returncode,
        "said": lines[-1] if lines else "",
    }


def floor(rows: Path) -> dict[str, float | int | str]:
    """Reading the rows and parsing each line, as any reader must (a fresh process)."""
    code = (
        "import json, sys\n"
        f"n = sum(1 for line in open({str(rows)!r}) if json.loads(line))\n"
        "print(n)\n"
    )
    return timed([sys.executable, "-c", code])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[200_000, 5_000])
    args = p.parse_args()
    load = round(os.getloadavg()[0], 2)
    sizes = []
    for rows in args.rows:
        with tempfile.TemporaryDirectory() as tmp:
            task = write(Path(tmp), rows)
            size = {
                "instances": rows,
                "rows_mb": round((Path(tmp) / "rows.jsonl").stat().st_size / 2**20, 1),
                "read_and_parse_json": floor(Path(tmp) / "rows.jsonl"),
                "validate_task": timed([*AGENTRL, "validate", str(task)]),
                "validate_train_config": timed(
                    [*AGENTRL, "validate", str(task.parent / "train.yaml")]
                ),
            }
        for key in ("validate_task", "validate_train_config"):
            run = size[key]
            assert isinstance(run, dict) and run["exit_code"] == 0, run
            run["cpu_ms_per_instance"] = round(1000 * float(run["cpu_s"]) / rows, 3)
        sizes.append(size)
        print(json.dumps(size, indent=2), flush=True)
    result = {
        "command": " ".join(["benchmarks/validate.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_1min_at_start": load,  # other jobs on the cores stretch the wall times
        "target": "agentrl validate of a 200,000-instance task under 30 s",
        "sizes": sizes,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
