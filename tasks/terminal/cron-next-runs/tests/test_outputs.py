"""cronnext.py lists the next run times of cron expressions, cron's day rule included."""

import subprocess

import pytest

SCRIPT = "/app/cronnext.py"

CASES = {
    "weekday-office-hours": (
        "*/15 9-17 * * 1-5",
        "2024-03-08 16:50",
        6,
        [
            "2024-03-08 17:00",
            "2024-03-08 17:15",
            "2024-03-08 17:30",
            "2024-03-08 17:45",
            "2024-03-11 09:00",
            "2024-03-11 09:15",
        ],
    ),
    "leap-day": ("0 0 29 2 *", "2024-03-01 00:00", 2, ["2028-02-29 00:00", "2032-02-29 00:00"]),
    "day-of-month-or-sunday": (
        "30 8 1,15 * 0",
        "2024-09-01 08:30",
        6,
        [
            "2024-09-08 08:30",
            "2024-09-15 08:30",
            "2024-09-22 08:30",
            "2024-09-29 08:30",
            "2024-10-01 08:30",
            "2024-10-06 08:30",
        ],
    ),
    "range-steps-and-sunday-as-7": (
        "5-20/5 */6 * 1,7 7",
        "2024-06-30 23:00",
        5,
        [
            "2024-07-07 00:05",
            "2024-07-07 00:10",
            "2024-07-07 00:15",
            "2024-07-07 00:20",
            "2024-07-07 06:05",
        ],
    ),
    "31st-of-odd-months": (
        "59 23 31 */2 *",
        "2024-01-31 23:59",
        4,
        ["2024-03-31 23:59", "2024-05-31 23:59", "2024-07-31 23:59", "2025-01-31 23:59"],
    ),
    "friday-or-13th": (
        "10,40 3 13 * 5",
        "2024-09-12 00:00",
        4,
        ["2024-09-13 03:10", "2024-09-13 03:40", "2024-09-20 03:10", "2024-09-20 03:40"],
    ),
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["python3", SCRIPT, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", sorted(CASES))
def test_next_runs(name: str) -> None:
    expr, start, count, expected = CASES[name]
    done = run(expr, start, str(count))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == expected


def test_five_by_default() -> None:
    done = run("0 12 * * *", "2023-12-31 12:00")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"2024-01-0{d} 12:00" for d in range(1, 6)]


@pytest.mark.parametrize(
    "expr", ["60 * * * *", "* * *", "*/0 * * * *", "5-1 * * * *", "* * 0 * *", "a * * * *"]
)
def test_invalid_expressions(expr: str) -> None:
    done = run(expr, "2024-01-01 00:00")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip()
