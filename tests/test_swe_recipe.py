"""The SWE recipe (examples/train/swe-*.yaml) cannot rot: every variant validates as
shipped, and its CPU rehearsal runs one training step end to end.

The rehearsal is swe-fsdp.yaml itself with what a CPU without the GPU node's files needs
changed, and nothing else: the embedded SmolLM2 for Qwen3-8B, the in-process sampler
for the vLLM servers, float32 for bfloat16, two SWE-smith instances of a tiny local
repository for the SWE-Gym and SWE-bench Verified rows (one trains, one is held out
through `eval.tasks`), and small limits (one step, one group of two, two turns of 32
tokens; the zero-variance filter off, since SmolLM2 fixes no bug and a run with one
prompt whose groups are all filtered would never reach its step). The schedule (async,
S = 1), algorithm, dispatcher, snapshots and checkpoint are the recipe's. SmolLM2 resolves
neither instance, so the step's group is tied and makes no update: the learner's side of
a step is covered by the trainer tests (tests/test_trainer.py, test_async_training.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import labelled_containers
from swe_fixtures import BUG, SUB_BUG, remove_images, swe_smith_calc, swe_smith_row, write_rows

from agentrl.errors import ConfigError
from agentrl.sandbox.docker import remove_run
from agentrl.sandbox.images import docker_client
from agentrl.tasks.spec import Task
from agentrl.tasks.swe.rows import load_swe_bench
from agentrl.train import Trainer
from agentrl.train.data import split
from agentrl.train_config import EvalConfig, TrainConfig
from agentrl.trajectory import TrajectoryStore

EXAMPLES = Path(__file__).parents[1] / "examples" / "train"
RECIPES = sorted(EXAMPLES.glob("swe-*.yaml"))
TAG = "agentrl-test/swesmith.x86_64.calc-recipe:latest"
TRAIN_ID = "calc__calc.5678abcd.func_pm_op_swap__add"
HELD_ID = "calc__calc.5678abcd.func_pm_op_swap__sub"


def test_there_is_a_recipe_per_backend() -> None:
    names = [p.name for p in RECIPES]
    assert names == ["swe-fsdp.yaml", "swe-tinker.yaml"]
    for path in RECIPES:
        data = yaml.safe_load(path.read_text())
        assert data["schedule"]["type"] == "async"
        assert data["schedule"]["max_staleness_steps"] == 1
        assert data["eval"]["tasks"] and "holdout_every" not in data["eval"]
        assert data["snapshots"]["every"] > 0 and data["snapshots"]["keep_successful"] == 0.0


def test_every_variant_validates_as_shipped(tmp_path: Path) -> None:
    """`agentrl validate` on each recipe, byte for byte, beside what it names on disk (the
    node has them, this machine does not): the model folder's files and the rows files,
    with enough training rows for the recipe's first mini-batch. Without the rows it
    does not validate: `train` would fail on them."""
    copies = tmp_path / "examples" / "train"
    copies.mkdir(parents=True)
    for path in RECIPES:
        shutil.copy(path, copies / path.name)
        data = yaml.safe_load(path.read_text())
        model = copies / data["model"]
        model.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            (model / name).write_text("{}")
        for name, count in ((data["tasks"][0], 16), (data["eval"]["tasks"][0], 1)):
            rows = [
                swe_smith_row(f"calc__calc.0.x__{i}", TAG, BUG, "t.py::a", "t.py::b")
                for i in range(count)
            ]
            (copies / name).parent.mkdir(parents=True, exist_ok=True)
            write_rows((copies / name).parent, rows, Path(name).name)
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "validate", *map(str, sorted(copies.iterdir()))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for path in RECIPES:
        assert f"{path.name}: ok (train config {path.stem})" in proc.stdout


def test_eval_tasks_are_held_out_whole_and_exclude_holdout_every(tmp_path: Path) -> None:
    rows = [swe_smith_row(f"calc__calc.0.x__{i}", TAG, BUG, "t.py::a", "t.py::b") for i in range(3)]
    train = load_swe_bench(write_rows(tmp_path, rows, "train.jsonl"))
    held = load_swe_bench(write_rows(tmp_path, rows[:2], "held.jsonl"))
    train_prompts, held_prompts = split([train, held], holdout_every=2, held_tasks=1)
    assert [(p.task, p.instance.id) for p in train_prompts] == [(0, r["instance_id"]) for r in rows]
    assert [(p.task, p.instance.id) for p in held_prompts] == [
        (1, r["instance_id"]) for r in rows[:2]
    ]
    every_other = split([train], holdout_every=2)[1]  # without eval.tasks: as before
    assert [p.instance.id for p in every_other] == [rows[0]["instance_id"], rows[2]["instance_id"]]
    with pytest.raises(ValueError, match="holdout_every and tasks both name"):
        EvalConfig(tasks=["held.jsonl"], holdout_every=4)
    config = TrainConfig.model_validate(
        {**_rehearsal_config(RECIPES[0], tmp_path, tmp_path), "eval": {"tasks": []}}
    )
    with pytest.raises(ValueError, match="eval_tasks: 1 loaded, eval.tasks names 0"):
        Trainer(config, [train], tmp_path / "run", eval_tasks=[held])
    one = load_swe_bench(write_rows(tmp_path, rows[:1], "one.jsonl"))
    with pytest.raises(ConfigError, match="0 training and 1 held-out"):
        Trainer(config, [one], tmp_path / "run")


def test_agentrl_train_loads_eval_tasks_beside_the_config(tmp_path: Path) -> None:
    """The CLI reads `eval.tasks` as it reads `tasks` (beside the file), before any model."""
    task = Path(__file__).parent / "data" / "train" / "task.yaml"
    config = tmp_path / "held.yaml"
    config.write_text(
        f"name: held\ntasks: [{task}]\neval: {{tasks: [verified.jsonl]}}\n"
        "schedule: {type: sync, steps: 1, prompts_per_step: 1, n_samples_per_prompt: 2}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(config), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    # Found where the config names it, as `agentrl validate` finds it (tasks/load_train).
    want = f"{config}:3: eval.tasks[0]: 'verified.jsonl' not found (looked for {tmp_path}"
    assert want in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def _rehearsal_config(recipe: Path, train_rows: Path, held_rows: Path) -> dict[str, Any]:
    """swe-fsdp.yaml as a CPU runs it: see the module docstring for what changes."""
    data = yaml.safe_load(recipe.read_text())
    data.pop("servers")  # the model in this process
    data["model"] = "embedded"
    data["tasks"] = [str(train_rows)]
    data["eval"] |= {"tasks": [str(held_rows)], "samples": 1, "every": 0}
    data["backend"] |= {"dtype": "float32"}  # bfloat16 needs CUDA
    data["schedule"] |= {
        "steps": 1,
        "prompts_per_step": 1,
        "n_samples_per_prompt": 2,
        "filter_zero_variance": False,
    }
    data["dispatcher"] |= {"concurrency": 4, "max_sandboxes": 6, "eval_workers": 2}
    return data


def _small(task: Task) -> Task:
    """The rows' task with rehearsal limits: two turns of 32 tokens in SmolLM2's context."""
    limits = task.spec.limits.model_copy(
        update={"max_turns": 2, "max_new_tokens": 32, "context_length": 8192}
    )
    return task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})


@pytest.mark.docker
@pytest.mark.model
@pytest.mark.slow
def test_the_cpu_rehearsal_of_swe_fsdp_runs_one_step(tmp_path: Path) -> None:
    swe_smith_calc(tmp_path, TAG)
    train_row = swe_smith_row(
        TRAIN_ID, TAG, BUG, "test_calc.py::test_add", "test_calc.py::TestCalc::test_sub"
    )
    held_row = swe_smith_row(
        HELD_ID, TAG, SUB_BUG, "test_calc.py::TestCalc::test_sub", "test_calc.py::test_add"
    )
    train_rows = write_rows(tmp_path, [train_row], "swe-train.jsonl")
    held_rows = write_rows(tmp_path, [held_row], "swe-held.jsonl")
    recipe = EXAMPLES / "swe-fsdp.yaml"
    config = TrainConfig.model_validate(_rehearsal_config(recipe, train_rows, held_rows))
    out = tmp_path / "run"
    tasks = [_small(load_swe_bench(train_rows))]
    trainer = Trainer(
        config, tasks, out, show_progress=False, eval_tasks=[_small(load_swe_bench(held_rows))]
    )
    try:
        summary = asyncio.run(trainer.run())
        left = labelled_containers(trainer.run_id)
        trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
        files = sorted((out / "eval").glob("step-*/trajectories.jsonl"))
        evals = [t for f in files for t in TrajectoryStore(f)]
    finally:
        client = docker_client()
        try:
            remove_run(client, trainer.run_id, snapshots=True)
        finally:
            client.close()
        remove_images(f"agentrl/swe-start-{TRAIN_ID}", f"agentrl/swe-start-{HELD_ID}", TAG)
    assert left == []  # every sandbox and grading container closed
    assert summary["steps"] == 1 and summary["schedule"] == "async"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (step,) = [r for r in records if r["kind"] == "train"]
    assert step["step"] == 1 and step["prompts"] == [f"0:{TRAIN_ID}"]
    assert step["episodes"] == 2 and step["infra_failures"] == 0, step.get("infra_error")
    # SmolLM2 resolves neither issue, so the group is tied and no update is made; a spread
    # would train (loss and logprob mismatch in the row)
    assert "loss" in step or step["skipped"] == "no group had a reward spread"
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 1]
    # held out through eval.tasks: the held row is only evaluated, the train row only trained
    assert {t.group_id for t in trajs if t.consumed_step is not None} == {TRAIN_ID}
    assert len(evals) == 2 and {t.group_id for t in evals} == {HELD_ID}
    for t in [*trajs, *evals]:
        t.check()  # token-exact ledger (each segment)
        assert t.reward is not None and len(t.turns) <= 2
        if t.reward < 1.0:  # a failed episode keeps its replay points
            assert t.env.init_snapshot
    assert any((out / "checkpoints").glob("step-*"))  # the recipe checkpoints at the end
