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
    """The one sampling temperature of the run; the learner divides its logits by it."""
    temps = {t.spec.sampling.temperature for t in tasks}
    if len(temps) != 1:
        raise ConfigError(
            f"the tasks sample at different temperatures {sorted(temps)}",
            fix="give every task of a train config the same sampling.temperature",
        )
    for t in tasks:
        if t.spec.sampling.top_p < 1.0:
            raise ConfigError(
                f"task {t.spec.name}: sampling.top_p {t.spec.sampling.top_p} < 1: the learner "
                "cannot reproduce the logprobs of a truncated distribution",
                fix="set sampling.top_p: 1.0 in tasks you train on",
            )
    temp = temps.pop()
    if temp <= 0:
        raise ConfigError(
            "sampling.temperature 0 (greedy) has no logprobs to learn from",
            fix="train with a temperature > 0 (e.g. 0.7 or 1.0)",
        )
    return temp
