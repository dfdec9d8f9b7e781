"""What a run trains on: the prompts (train and held out), their order, their temperature.

Each instance of each task is a prompt; every `eval.holdout_every`-th one is held out,
or, when the config names `eval.tasks`, every instance of those and none of the others.
The training prompts are taken epoch after epoch, each epoch a permutation seeded by
(seed, epoch), so the order is a function of the seed and the position alone: a resumed
run takes exactly the prompts an uninterrupted one would.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.tasks.spec import Instance, Task


@dataclass(frozen=True)
class Prompt:
    task: int  # index into the config's tasks
    instance: Instance

    @property
    def id(self) -> str:
        return f"{self.task}:{self.instance.id}"


def split(
    tasks: Sequence[Task], holdout_every: int, held_tasks: int = 0
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval): the last `held_tasks` tasks (eval.tasks) are eval whole and the others
    train whole; without them every `holdout_every`-th instance of each task (from the
    first) is eval."""
    train: list[Prompt] = []
    held: list[Prompt] = []
    first_held = len(tasks) - held_tasks
    for t, task in enumerate(tasks):
        for i, inst in enumerate(task.instances):
            is_held = t >= first_held if held_tasks else i % holdout_every == 0
            (held if is_held else train).append(Prompt(t, inst))
    return train, held


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The prompts of one epoch: a permutation of range(n) seeded by (seed, epoch)."""
    perm = list(range(n))
    random.Random(f"{seed}/{epoch}").shuffle(perm)
    return perm


def data_order(n: int, seed: int, start: int, count: int) -> list[int]:
    """Indices of the prompts at positions [start, start + count) of the run's stream:
    epoch after epoch, each a permutation seeded by (seed, epoch)."""
    out = []
    for pos in range(start, start + count):
        epoch, k = divmod(pos, n)
        out.append(epoch_order(n, seed, epoch)[k])
    return out


def run_temperature(tasks: Sequence[Task]) -> float:
    """The one sampling temperature of the run (the learner divides its logits by it);
    ConfigError when the tasks' sampling cannot be learned from (`sampling_problems`)."""
    from agentrl.train_config import sampling_problems

    problems = sampling_problems(tasks)
    if problems:
        raise ConfigError(problems[0].message, fix=problems[0].fix)
    return tasks[0].spec.sampling.temperature
