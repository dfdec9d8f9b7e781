"""Score the agent's totals against the column sums of a CSV file: the fraction of the
columns whose sum is on its line (a missing file, or one with the wrong number of lines,
scores 0).

usage: python3 score.py DATA.csv TOTALS.txt REWARD.txt
"""

import csv
import sys
from pathlib import Path


def close(line: str, want: float) -> bool:
    try:
        return abs(float(line) - want) < 1e-6
    except ValueError:
        return False


data, totals, reward = map(Path, sys.argv[1:4])
rows = list(csv.reader(data.open()))[1:]
sums = [sum(float(row[i]) for row in rows) for i in range(len(rows[0]))]
lines = totals.read_text(errors="replace").split() if totals.is_file() else []
written = len(lines)
if written != len(sums):
    lines = [""] * len(sums)
right = sum(close(line, want) for line, want in zip(lines, sums, strict=True))
print(f"{right} of {len(sums)} columns right ({written} lines written)")
reward.write_text(f"{right / len(sums)}\n")
