"""Writes the instances of tasks/train/trail/task.yaml (run it from anywhere; it rewrites
the block between the `instances:` marker lines). Every key and file name is drawn once
with random.Random(41), so no two instances share one and held-out names are never seen
in training."""

from __future__ import annotations

import random
import re
from pathlib import Path

HOPS = 7  # keys per trail: `clue start` and 7 more clues, then `touch FINAL`: 9 tool calls
INSTANCES = 96
TASK = Path(__file__).with_name("task.yaml")


def main() -> None:
    rng = random.Random(41)
    seen: set[str] = {"start"}

    def word() -> str:
        while True:
            w = "".join(
                rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") for _ in range(2)
            ) + rng.choice("bcdfghjklmnprstvz") + str(rng.randint(2, 9))
            if w not in seen:
                seen.add(w)
                return w

    rows = []
    for i in range(INSTANCES):
        keys = " ".join(word() for _ in range(HOPS))
        final = word() + rng.choice([".txt", ".md", ".dat", ".log", ".cfg", ".csv"])
        rows.append(f"  - {{id: trail-{i:02d}, keys: {keys}, final: {final}}}")
    text = TASK.read_text()
    block = "instances:  # make_instances.py\n" + "\n".join(rows) + "\n# end of instances\n"
    text = re.sub(r"instances:  # make_instances.py\n.*?# end of instances\n", block, text,
                  flags=re.S)
    TASK.write_text(text)


if __name__ == "__main__":
    main()
