"""`agentrl train` on a task played by an external harness (the openai-SDK client of
tests/data/gateway) through the gateway: one sync step with the tiny model in local
sandboxes. The learner scores every recorded token under the weights that sampled it:
its logprobs equal the sampler's only if the ledger is exactly what was sampled (the loss
is cross-entropy on the sampled tokens, so the step trains whatever the rewards)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agentrl.trajectory import TrajectoryStore

DATA = Path(__file__).parent / "data" / "gateway"


def test_an_external_harness_trains_on_exactly_what_was_sampled(
    tmp_path: Path, tiny_dir: Path
) -> None:
    (tmp_path / "task.yaml").write_text((DATA / "train_task.yaml").read_text())
    (tmp_path / "train.yaml").write_text(
        "name: gateway\ntasks: [task.yaml]\n"
        "backend: {type: fsdp, lr: 1.0e-5}\nalgorithm: {loss: {type: cross_entropy}}\n"
        "schedule: {type: sync, steps: 1, prompts_per_step: 2, n_samples_per_prompt: 4}\n"
        "dispatcher: {type: pipeline, concurrency: 4}\n"
        "eval: {holdout_every: 4, samples: 2}\n"
        "checkpoint: {every: 1, keep: 1}\n"
        f"seed: 1\nmodel: {tiny_dir}\nprovider: local\n"
    )
    out = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "AGENTRL_TEST_DATA": str(DATA)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl.cli",
            "train",
            str(tmp_path / "train.yaml"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert len(train) == 1 and train[0]["logprob_mismatch"] < 1e-3
    assert train[0]["agent"]["episodes"] == 8 and train[0]["agent"]["calls"] >= 8
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
    assert len(trajs) == 8 and all(t.trainable for t in trajs), [t.error for t in trajs]
    for traj in trajs:
        assert traj.agent is not None and traj.agent.name == "openai-client"
        assert traj.agent.calls == len(traj.turns) >= 1 and traj.agent.exit_code == 0
