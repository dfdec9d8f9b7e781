"""The long-horizon main job (tasks/train/trail): the keys of the trail are only in the
sandbox, each behind the one before, so a policy must walk it turn by turn.

Scripted policies play through the real tokenizer, chat template, bash tool, `clue` and
the grader in Docker on every twelfth instance (8 of 96): policies that act blind, or look
for a shortcut through the sandbox's files, earn nothing; one that stops after three clues
earns exactly the three keys it proved (3/8); the walk earns 1 in 9 tool calls. The last
tests show every key and name is unique, absent from the prompt, and never shared between
training and held-out trails.
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
from agentrl.trajectory import Trajectory, TrajectoryStore

ROOT = Path(__file__).parents[1]
TASK = ROOT / "tasks" / "train" / "trail" / "task.yaml"
CONFIG = ROOT / "examples" / "train" / "trail.yaml"


# Never reads a note: opens the worked example's key, keys a model might invent, and
# creates files a model might guess.
BLIND = [
    bash("clue tovek5; clue next; clue key; clue 1; clue end"),
    bash("touch tovek5.txt file.txt output.txt start.txt final.txt done.txt"),
    bash("clue start start; clue 'start'x; clue START"),
]
# Looks for a way around the trail: every readable file that could hold a key or the final
# name, `clue` on whatever looks like a key, `touch` on whatever looks like a name.
SHORTCUT = [
    bash("ls -la /opt/trail; cat /usr/local/bin/clue; cat /opt/trail/* | head -5"),
    bash(
        "for f in /opt/trail/*; do base64 -d $f 2>/dev/null | strings; done | "
        "grep -o '[a-z]*[0-9]' | sort -u | xargs -r -n1 clue"
    ),
    bash(
        "grep -rhoa 'touch [a-z]*[0-9][.][a-z]*' /opt /usr/local /etc /root /tmp 2>/dev/null"
        " | awk '{print $2}' | xargs -r touch"
    ),
    bash("openssl enc -d -aes-256-cbc -pbkdf2 -iter 1000 -a -pass pass: -in /opt/trail/*"),
]
# Walks the trail: a script cannot read the observation, so each command reads the key it
# needs from the note the previous one saved, then shows the note it opened.
STEP = bash(
    "k=$(awk '{print $3}' /tmp/note 2>/dev/null); clue ${k:-start} > /tmp/next; "
    "mv /tmp/next /tmp/note; cat /tmp/note"
)
WALK = [STEP] * 8 + [bash("touch $(awk '{print $3}' /tmp/note)")]
SHORT = [STEP] * 4  # `clue start`, then three keys


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def sampled_task():
    task = load_task(TASK)
    return task.model_copy(update={"instances": task.instances[::12]})


def play(script: list[str], out: Path, tokenizer) -> dict[str, Trajectory]:
    """Every episode of `script` on the sampled instances. The scripts' commands are longer
    than the model's 24-token replies, so the limits are widened for them: as many turns as
    the script has, 160 tokens a reply, a 2048-token context."""
    task = sampled_task()
    limits = task.spec.limits.model_copy(
        update={"max_turns": len(script), "max_new_tokens": 160, "context_length": 2048}
    )
    task = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    asyncio.run(
        run_task(
            task,
            ScriptedSampler(script, tokenizer),
            tokenizer,
            DockerProvider(),
            out,
            dispatcher=PipelineConfig(concurrency=8),
            show_progress=False,
        )
    )
    got = {t.group_id: t for t in TrajectoryStore(out / "trajectories.jsonl")}
    assert len(got) == len(sampled_task().instances) == 8
    return got


@pytest.mark.docker
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("script", [BLIND, SHORTCUT], ids=["blind", "shortcut"])
def test_a_policy_that_does_not_walk_the_trail_earns_nothing(
    script: list[str], tmp_path: Path, tokenizer
) -> None:
    got = play(script, tmp_path, tokenizer)
    assert {i: t.reward for i, t in got.items() if t.reward != 0.0} == {}
    # what it tried did run: the commands reached the sandbox and `clue`
    assert all(len(t.turns) == len(script) for t in got.values())
    assert all(t.turns[0].exit_code is not None for t in got.values())


@pytest.mark.docker
@pytest.mark.model
@pytest.mark.slow
def test_the_walk_earns_1_in_9_tool_calls_and_stopping_early_its_share(
    tmp_path: Path, tokenizer
) -> None:
    walked = play(WALK, tmp_path / "walk", tokenizer)
    for t in walked.values():
        assert t.reward == 1.0, (t.group_id, t.reward_components, t.turns[-1].observation)
        assert (t.reward_components["keys"], t.reward_components["final"]) == (7, 1)
        assert sum(u.tool_call is not None for u in t.turns) == 9
        assert t.turns[0].observation.startswith("Run: clue ")
        assert t.turns[7].observation.startswith("Run: touch ")
    short = play(SHORT, tmp_path / "short", tokenizer)
    assert {t.reward for t in short.values()} == {3 / 8}
    assert {t.reward_components["keys"] for t in short.values()} == {3.0}


def test_keys_and_names_are_unique_and_held_out_ones_never_train() -> None:
    task = load_task(TASK)
    config = load_train_config(CONFIG)
    train, held = split([task], config.eval.holdout_every)
    assert len(train) == 72 and len(held) == 24

    def names(problems) -> set[str]:
        return {
            w
            for p in problems
            for w in [*p.instance.fields["keys"].split(), p.instance.fields["final"]]
        }

    train_names, held_names = names(train), names(held)
    assert train_names.isdisjoint(held_names)
    assert len(train_names | held_names) == len(task.instances) * 8  # none repeats
    assert all(len(p.instance.fields["keys"].split()) == 7 for p in train + held)
    spec = yaml.safe_load(TASK.read_text())["prompt"]
    prompt = spec["system"] + spec["instance"]
    assert not [n for n in train_names | held_names if n in prompt]
