#!/bin/bash
set -euo pipefail
cat > /app/cronnext.py <<'PY'
#!/usr/bin/env python3
"""Print the next times a 5-field cron expression fires after a given time.

usage: cronnext.py EXPR "YYYY-MM-DD HH:MM" [N]
"""

import sys
from datetime import datetime, timedelta

BOUNDS = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 7)]


def parse_field(text, low, high):
    values = set()
    for part in text.split(","):
        body, _, step_text = part.partition("/")
        step = int(step_text) if step_text else 1
        if step_text and not step_text.isdigit() or step < 1:
            raise ValueError(f"bad step in {part!r}")
        if body == "*":
            start, end = low, high
        elif "-" in body:
            first, _, last = body.partition("-")
            if not (first.isdigit() and last.isdigit()):
                raise ValueError(f"bad range {body!r}")
            start, end = int(first), int(last)
        elif body.isdigit():
            start = int(body)
            end = high if step_text else start
        else:
            raise ValueError(f"bad field {part!r}")
        if not (low <= start <= end <= high):
            raise ValueError(f"{part!r} is out of range {low}-{high}")
        values.update(range(start, end + 1, step))
    return values


def parse(expr):
    fields = expr.split()
    if len(fields) != 5:
        raise ValueError("expected 5 fields")
    sets = [parse_field(f, lo, hi) for f, (lo, hi) in zip(fields, BOUNDS)]
    if 7 in sets[4]:
        sets[4] = (sets[4] - {7}) | {0}
    return sets, fields[2] != "*" and fields[4] != "*"


def day_matches(day, sets, either):
    in_dom = day.day in sets[2]
    in_dow = (day.isoweekday() % 7) in sets[4]
    return (in_dom or in_dow) if either else (in_dom and in_dow)


def next_runs(expr, start, count):
    sets, either = parse(expr)
    minutes, hours = sorted(sets[0]), sorted(sets[1])
    found = []
    day = start.replace(hour=0, minute=0)
    limit = start + timedelta(days=366 * 30)
    while len(found) < count and day <= limit:
        if day.month in sets[3] and day_matches(day, sets, either):
            for hour in hours:
                for minute in minutes:
                    when = day.replace(hour=hour, minute=minute)
                    if when > start and len(found) < count:
                        found.append(when)
        day += timedelta(days=1)
    return found


def main():
    args = sys.argv[1:]
    try:
        if len(args) not in (2, 3):
            raise ValueError("usage: cronnext.py EXPR 'YYYY-MM-DD HH:MM' [N]")
        start = datetime.strptime(args[1], "%Y-%m-%d %H:%M")
        count = int(args[2]) if len(args) == 3 else 5
        runs = next_runs(args[0], start, count)
    except ValueError as error:
        print(f"cronnext: {error}", file=sys.stderr)
        return 2
    for when in runs:
        print(when.strftime("%Y-%m-%d %H:%M"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
PY
