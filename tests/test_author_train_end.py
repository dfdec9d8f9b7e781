"""`agentrl train`'s last table says when no update was made (issue 39): a run whose every
step was skipped (no group had a reward spread) must not end looking like a run that
trained. The real CLI on the tiny model in `local` sandboxes (tests/data/train, with a
grader that never passes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data" / "train"


def test_a_run_whose_every_step_was_skipped_says_no_update_was_made(
    tmp_path: Path, tiny_dir: Path
) -> None:
    never = "test -f /never/{name}"  # no episode passes: no group has a reward spread
    task = (DATA / "task.yaml").read_text().replace("test -f /workspace/{name}", never)
    (tmp_path / "task.yaml").write_text(task)
    config = (DATA / "train.yaml").read_text() + f"model: {tiny_dir}\nprovider: local\n"
    (tmp_path / "train.yaml").write_text(config)
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(tmp_path / "train.yaml")]
        + ["--out", str(out), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in rows if r["kind"] == "train"]
    assert step["skipped"] == "no group had a reward spread"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == {"no group had a reward spread": 1}
    text = " ".join(done.stdout.split())  # the table's caption may wrap
    assert (
        "no update was made: every step (1) was skipped (no group had a reward spread)" in text
    ), done.stdout
