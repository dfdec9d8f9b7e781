"""/app/report.txt holds the five statistics of /app/logs/access.log."""

from pathlib import Path

REPORT = Path("/app/report.txt")
EXPECTED = [
    "total_requests: 240",
    "unique_ips: 12",
    "server_errors: 19",
    "top_paths: /api/items=46,/static/app.js=43,/=35",
    "bytes_2xx: 841283",
]


def _lines() -> list[str]:
    assert REPORT.is_file(), "no /app/report.txt"
    return [line.strip() for line in REPORT.read_text().strip().splitlines()]


def test_report_has_five_lines_in_order() -> None:
    assert [line.split(":")[0] for line in _lines()] == [e.split(":")[0] for e in EXPECTED]


def test_counts() -> None:
    assert _lines()[:3] == EXPECTED[:3]


def test_top_paths_ignore_query_strings() -> None:
    assert _lines()[3] == EXPECTED[3]


def test_bytes_of_successful_responses() -> None:
    assert _lines()[4] == EXPECTED[4]
