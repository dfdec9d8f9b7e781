"""The multi-turn main job (tasks/train/look-then-act): the name to act on is only in the
sandbox, so a policy must look before it acts.

Scripted policies play through the real tokenizer, chat template, bash tool and grader in
Docker: those that act blind earn nothing, one that looks and then acts earns 1, on every
sixth instance (12 of 72: instances differ only in the name, and the last test shows every
name is unique and absent from the prompt); the held-out names never appear among the
training ones.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from conftest import bash_block as bash

from agentrl.dispatch.base import PipelineConfig
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler
from agentrl.runner import run_task
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.load import load_task
from agentrl.train.data import split
from agentrl.train_config import load_train_config
from agentrl.trajectory import TrajectoryStore

ROOT = Path(__file__).parents[1]
TASK = ROOT / "tasks" / "train" / "look-then-act" / "task.yaml"
CONFIG = ROOT / "examples" / "train" / "look-then-act.yaml"


# Acts blind in every turn the task allows, never reading note.txt: guesses names (the worked
# example's, names a model might invent), uses the prompt's own words as names, and acts
# with no look (lists the folder, runs the note as a script).
BLIND = [
    bash("touch tovek5.txt file.txt notes.txt output.txt new.txt empty.txt name.txt"),
    bash("touch Run: cat note.txt run note; touch a.txt test.txt data.csv log.txt"),
    bash("ls; sh note.txt; bash note.txt; touch empty"),
]
# Looks, then acts on what it saw (a script cannot read the observation, so the command
# reads the note itself: the same file a model copies the name from).
LOOK_THEN_ACT = [bash("cat note.txt"), bash("touch \"$(awk '{print $NF}' note.txt)\"")]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def sampled_task():
    task = load_task(TASK)
    return task.model_copy(update={"instances": task.instances[::6]})


def rewards(script: list[str], out: Path, tokenizer) -> dict[str, float | None]:
    task = sampled_task()
    sampler = ScriptedSampler(script, tokenizer)
    dispatcher = PipelineConfig(concurrency=12)
    asyncio.run(
        run_task(
            task,
            sampler,
            tokenizer,
            DockerProvider(),
            out,
            dispatcher=dispatcher,
            show_progress=False,
        )
    )
    return {t.group_id: t.reward for t in TrajectoryStore(out / "trajectories.jsonl")}


@pytest.mark.docker
@pytest.mark.model
@pytest.mark.slow
def test_a_policy_that_acts_without_looking_earns_nothing(tmp_path: Path, tokenizer) -> None:
    got = rewards(BLIND, tmp_path, tokenizer)
    assert len(got) == len(sampled_task().instances) == 12
    assert set(got.values()) == {0.0}, {k: v for k, v in got.items() if v != 0.0}


@pytest.mark.docker
@pytest.mark.model
@pytest.mark.slow
def test_a_policy_that_looks_then_acts_earns_every_reward(tmp_path: Path, tokenizer) -> None:
    got = rewards(LOOK_THEN_ACT, tmp_path, tokenizer)
    assert len(got) == len(sampled_task().instances) == 12
    assert set(got.values()) == {1.0}, {k: v for k, v in got.items() if v != 1.0}


def test_held_out_names_never_appear_in_training() -> None:
    task = load_task(TASK)
    config = load_train_config(CONFIG)
    train, held = split([task], config.eval.holdout_every)
    assert train and held
    train_names = {p.instance.fields["name"] for p in train}
    held_names = {p.instance.fields["name"] for p in held}
    assert train_names.isdisjoint(held_names)
    assert len(train_names | held_names) == len(task.instances)  # no name repeats
    # nor does the worked example's name, nor any name appear in the prompt
    spec = yaml.safe_load(TASK.read_text())["prompt"]
    prompt = spec["system"] + spec["instance"]
    assert not [n for n in train_names | held_names if n in prompt]
