"""The sync trainer: data order, config errors, and whole runs of `agentrl train`.

Whole runs train on a 4-instance task (tests/data/train) whose training rewards are coin
flips, so every step has a gradient. One run is the real path end to end: the embedded
SmolLM2 in Docker sandboxes, 2 steps; a run writes metrics, trajectories, checkpoints, a
summary and a reward plot, and each step's learner logprobs equal the sampler's. What
depends on neither the model nor Docker runs on the tiny model in `local` sandboxes: a
run killed with SIGKILL while it writes a checkpoint resumes from the last complete one
and trains on exactly the prompts an uninterrupted run trains on; torchrun ranks mirror
rank 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.errors import ConfigError
from agentrl.scores import mean_interval
from agentrl.tasks.formats import load_any
from agentrl.tasks.load import load_task
from agentrl.train import Trainer
from agentrl.train.data import data_order, run_temperature, split
from agentrl.train_config import load_train_config
from agentrl.trajectory import TrajectoryStore
from agentrl.weights.checkpoint import PAUSE_ENV
from agentrl.yamlfile import ConfigFileError

DATA = Path(__file__).parent / "data" / "train"
EXAMPLE = Path(__file__).parents[1] / "examples" / "train" / "shell-basics.yaml"


def test_data_order_is_a_seeded_permutation_per_epoch_and_resumable() -> None:
    first = data_order(5, seed=1, start=0, count=10)
    assert sorted(first[:5]) == sorted(first[5:]) == [0, 1, 2, 3, 4]  # each epoch: all once
    assert first[:5] != first[5:] or first[:5] == list(range(5))  # epochs reshuffled
    assert first == data_order(5, seed=1, start=0, count=10)  # a function of seed and step
    assert first[3:8] == data_order(5, seed=1, start=3, count=5)  # resuming mid-epoch
    assert first != data_order(5, seed=2, start=0, count=10)


def test_every_kth_instance_is_held_out_and_never_trained_on() -> None:
    task = load_task(DATA / "task.yaml")
    train, held = split([task], holdout_every=4)
    assert [p.instance.id for p in held] == ["held"]
    assert [p.instance.id for p in train] == ["touch", "todo", "list"]


def test_mean_interval() -> None:
    mean, half = mean_interval([0.0, 1.0, 1.0, 0.0])
    # sd = sqrt(1/3) = 0.57735; 1.96 * 0.57735 / 2 = 0.56580
    assert mean == 0.5 and half == pytest.approx(0.56580, abs=1e-5)
    assert mean_interval([1.0]) == (1.0, 0.0)


def test_the_shipped_example_config_is_valid() -> None:
    config = load_train_config(EXAMPLE)
    assert config.schedule.n_samples_per_prompt >= 2 and config.backend.type == "fsdp"
    tasks = [load_any(EXAMPLE.parent / t) for t in config.tasks]
    train, held = split(tasks, config.eval.holdout_every)
    assert len(train) == 54 and len(held) == 18


def test_a_bad_train_config_names_each_line_and_field() -> None:
    with pytest.raises(ConfigFileError) as e:
        load_train_config(DATA / "bad_train.yaml")
    lines = str(e.value).splitlines()
    assert any(":5: schedule.steps: should be greater than or equal to 1" in x for x in lines)
    assert any(":8: dispatcher.type: unknown dispatcher type 'pipelin'" in x for x in lines)
    assert any(":11: algorithm.los: unknown key 'los' (did you mean 'loss'?)" in x for x in lines)


def test_group_estimators_need_groups(tmp_path: Path) -> None:
    text = (
        (DATA / "train.yaml")
        .read_text()
        .replace("n_samples_per_prompt: 4", "n_samples_per_prompt: 1")
    )
    (tmp_path / "task.yaml").write_text((DATA / "task.yaml").read_text())
    (tmp_path / "train.yaml").write_text(text)
    with pytest.raises(ConfigFileError, match="n_samples_per_prompt must be at least 2"):
        load_train_config(tmp_path / "train.yaml")


def test_the_learner_must_be_able_to_reproduce_the_sampling_distribution() -> None:
    task = load_task(DATA / "task.yaml")
    truncated = task.spec.model_copy(
        update={"sampling": task.spec.sampling.model_copy(update={"top_p": 0.9})}
    )
    with pytest.raises(ConfigError, match="top_p"):
        run_temperature([task.model_copy(update={"spec": truncated})])
    assert run_temperature([task]) == 0.7


def test_cli_train_reports_a_bad_config_in_one_line_per_problem() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(DATA / "bad_train.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "bad_train.yaml:11: algorithm.los: unknown key 'los'" in proc.stderr


def _train(
    config: Path, out: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", str(config), "--out", str(out), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def tiny_config(tmp_path: Path, tiny_dir: Path) -> Path:
    """tests/data/train with the tiny model in `local` sandboxes (files in the workdir):
    resume order, checkpoint atomicity and rank mirroring depend on neither SmolLM2 nor
    Docker. The tiny model never writes a bash block, so each reward is the coin flip."""
    folder = tmp_path / "config"
    folder.mkdir()
    task = (DATA / "task.yaml").read_text().replace("/workspace/{name}", "{name}")
    (folder / "task.yaml").write_text(task)
    config = (DATA / "train.yaml").read_text() + f"model: {tiny_dir}\nprovider: local\n"
    (folder / "train.yaml").write_text(config)
    return folder / "train.yaml"


def _check_a_whole_run(out: Path, config: Path, steps: int) -> list[dict[str, Any]]:
    """What every finished sync run of tests/data/train shows; returns its train rows."""
    rows = _rows(out)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))  # none repeated or skipped
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, steps]
    for row in (r for r in rows if r["kind"] == "eval"):  # recorded as `agentrl eval` records
        folder = out / "eval" / f"step-{row['step']:06d}"
        results = json.loads((folder / "results.json").read_text())
        overall = results["scores"]["overall"]
        assert results["attempts"] == 2 and overall["attempts"] == row["episodes"] == 2
        assert row["pass_at_k"] == overall["pass_at_k"] and set(row["pass_at_k"]) == {"1", "2"}
        assert row["pass_at_1"] == pytest.approx(overall["pass_at_1"]) == row["pass_rate"]
        assert len(list(TrajectoryStore(folder / "trajectories.jsonl"))) == 2
        assert (folder / "run.json").is_file() and (folder / "eval.json").is_file()
    # The prompts an uninterrupted run takes: the data order is a function of seed and step.
    cfg, task = load_train_config(config), load_task(config.parent / "task.yaml")
    prompts, _ = split([task], cfg.eval.holdout_every)
    n = cfg.schedule.prompts_per_step
    expected = [prompts[i].id for i in data_order(len(prompts), cfg.seed, 0, steps * n)]
    assert [p for r in train for p in r["prompts"]] == expected
    # Sync and on-policy: each step's learner scores what the same weights sampled, so its
    # logprobs equal the sampler's (the proof that no token was re-tokenized).
    trained = [r for r in train if "logprob_mismatch" in r]
    assert trained and all(r["logprob_mismatch"] < 1e-3 for r in trained)
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
    assert len(trajs) == steps * 2 * 4 and len({t.trajectory_id for t in trajs}) == steps * 8
    assert sorted({(t.scheduled_step, t.consumed_step) for t in trajs}) == [
        (s, s) for s in range(steps)
    ]
    # Each step samples with what the step before published (the first: version 1); a
    # resumed run republishes its checkpoint's weights under their version.
    published = [1] + [r["policy_version"] for r in train]
    for t in trajs:
        sampled = {v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m}
        assert sampled <= {published[t.scheduled_step]}, (t.trajectory_id, sampled)
    assert (out / "reward.png").stat().st_size > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))  # dev installs it
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["eval_before"]["episodes"] == 2  # 1 held x 2
    return train


@pytest.mark.e2e
@pytest.mark.docker
@pytest.mark.model
def test_smollm2_trains_on_what_it_sampled_in_docker(tmp_path: Path) -> None:
    """The real path end to end: `agentrl train` with the embedded SmolLM2 sampling in
    Docker sandboxes, two steps trained, published and evaluated, every file written."""
    out = tmp_path / "run"
    proc = _train(DATA / "train.yaml", out, "--steps", "2")
    output = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, output[-3000:]
    _check_a_whole_run(out, DATA / "train.yaml", steps=2)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000002"]  # keep: 1


@pytest.mark.slow
def test_a_run_killed_while_checkpointing_resumes_with_the_identical_data_order(
    tmp_path: Path, tiny_config: Path
) -> None:
    out = tmp_path / "run"
    # Kill -9 while step 2's checkpoint is being written (each file write pauses 0.3 s).
    proc = _train(tiny_config, out, "--steps", "2", env={PAUSE_ENV: "0.3"})
    root = out / "checkpoints"
    deadline = time.monotonic() + 600
    while not list(root.glob("step-000002.tmp-*")):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert [p.name for p in root.iterdir() if ".tmp" not in p.name] == ["step-000001"]

    proc = _train(tiny_config, out, "--steps", "2", "--resume")
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    _check_a_whole_run(out, tiny_config, steps=2)
    assert [p.name for p in root.iterdir()] == ["step-000002"]  # keep: 1, no torn folder


@pytest.mark.slow
def test_a_run_killed_mid_rollout_keeps_the_step_it_was_in(
    tmp_path: Path, tiny_config: Path
) -> None:
    """SIGKILL while step 2's episodes are out, some back and some in flight: the resumed
    run takes the step's finished episodes as they were and goes on with those in flight
    from their last snapshot (`snapshots: every 1`), sampled by the same weights (the
    learner's logprobs match), and the run reads as one uninterrupted run."""
    task = tiny_config.parent / "task.yaml"
    text = task.read_text().replace("max_turns: 1", "max_turns: 3")
    task.write_text(text.replace("context_length: 256", "context_length: 512"))
    tiny_config.write_text(tiny_config.read_text() + "snapshots: {every: 1}\n")
    out = tmp_path / "run"
    journal = out / "inflight.jsonl"

    def step_2(kind: str) -> list[dict[str, Any]]:
        lines = [json.loads(x) for x in journal.read_bytes().splitlines() if x.endswith(b"}")]
        return [
            x
            for x in lines
            if kind in x and (x.get("open") or x.get("done", {})).get("scheduled_step") == 1
        ]

    proc = _train(tiny_config, out, "--steps", "2")
    deadline = time.monotonic() + 600
    while not (journal.is_file() and len(step_2("done")) >= 2):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    done_before = {x["t"]: x["done"] for x in step_2("done")}
    opened = {x["t"] for x in step_2("open")} - set(done_before)
    assert opened, "nothing was in flight at the kill"

    proc = _train(tiny_config, out, "--steps", "2", "--resume")
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    _check_a_whole_run(out, tiny_config, steps=2)
    step2 = {
        t.trajectory_id: t
        for t in TrajectoryStore(out / "trajectories.jsonl")
        if t.scheduled_step == 1
    }
    for tid, before in done_before.items():  # back before the kill: taken as they were
        kept = json.loads(step2[tid].to_json())
        assert {k: v for k, v in kept.items() if k not in ("consumed_step", "grade_file")} == {
            k: v for k, v in before.items() if k not in ("consumed_step", "grade_file")
        }
    assert any(step2[tid].resumed_at for tid in opened)  # in flight: went on
    assert not journal.exists() or not step_2("open")  # the checkpoint holds the step
    # The same run: the snapshots its episodes made before the kill are its own.
    assert json.loads((out / "run.json").read_text())["run_id"] == run_id


def test_an_existing_run_is_not_overwritten_by_accident(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    proc = _train(DATA / "train.yaml", tmp_path)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode != 0 and "--resume" in output and "Traceback" not in output
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_trainer_refuses_tasks_without_held_out_instances(tmp_path: Path) -> None:
    task = load_task(DATA / "task.yaml")
    config = load_train_config(DATA / "train.yaml")
    few = task.model_copy(update={"instances": task.instances[1:2]})
    with pytest.raises(ConfigError, match="held-out"):
        Trainer(config, [few], tmp_path)


def test_agentrl_validate_checks_train_configs() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl.cli",
            "validate",
            str(EXAMPLE),
            str(DATA / "bad_train.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "shell-basics.yaml: ok (train config shell-basics)" in proc.stdout
    assert "bad_train.yaml:5: schedule.steps" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_torchrun_ranks_follow_rank_0_and_train_on_its_whole_batch(
    tmp_path: Path, tiny_config: Path
) -> None:
    """Two gloo ranks on this CPU (a GPU node runs the same code with nccl): rank 0 runs
    the rollouts and broadcasts each backend call; the step's loss and gradient norm must
    equal what one rank computes on the very trajectories rank 0 recorded. (8 samples a
    prompt: the step has a reward spread to train on but once in 16,384 runs.)"""
    text = tiny_config.read_text().replace("n_samples_per_prompt: 4", "n_samples_per_prompt: 8")
    tiny_config.write_text(text)
    from agentrl.algorithms import compute_advantages
    from agentrl.backends.base import samples_from
    from agentrl.http import free_port

    out = tmp_path / "run"
    port = free_port()  # for the rendezvous
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "-m", "agentrl.cli", "train", str(tiny_config), "--steps", "1",
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},  # loopback only
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("agentrl train tiny") == 1  # rank 0 reports, rank 1 does not
    (row,) = [r for r in _rows(out) if r["kind"] == "train"]
    assert row["policy_version"] == 2 and row["skipped"] == 0.0  # trained, published
    (ckpt,) = (out / "checkpoints").iterdir()
    assert {p.name for p in ckpt.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}

    config = load_train_config(tiny_config)
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
    samples = samples_from(trajs, compute_advantages(trajs, config.algorithm.advantage))
    task = load_task(tiny_config.parent / "task.yaml")
    one = config.backend.model_copy(
        update={"temperature": run_temperature([task]), "seed": config.seed}
    ).build(config.model)
    try:
        got = one.forward_backward(samples, config.algorithm.loss)
        got.update(one.optim_step())
    finally:
        one.close()
    assert got["loss"] == pytest.approx(row["loss"], rel=1e-4, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-3)
    assert got["sequences"] == row["sequences"] == 16


def test_a_model_folder_without_a_tokenizer_is_one_clear_error(tmp_path: Path) -> None:
    from agentrl.inference.embedded import model_tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match="no tokenizer could be loaded from it") as e:
        model_tokenizer(str(tmp_path))
    assert "\n" not in str(e.value) and "tokenizer.save_pretrained" in e.value.fix
