"""/app/summary.json summarises the non-cancelled orders per normalised region."""

import json
from pathlib import Path

import pytest

SUMMARY = Path("/app/summary.json")
EXPECTED = {
    "east": (3, 13, 119.98),
    "north": (2, 15, 34.95),
    "south": (1, 4, 4.40),
    "west": (3, 8, 360.50),
}


@pytest.fixture
def summary() -> dict:
    assert SUMMARY.is_file(), "no /app/summary.json"
    return json.loads(SUMMARY.read_text())


def test_regions_are_normalised(summary: dict) -> None:
    assert sorted(summary["regions"]) == sorted(EXPECTED)


@pytest.mark.parametrize("region", sorted(EXPECTED))
def test_region_figures(summary: dict, region: str) -> None:
    orders, units, revenue = EXPECTED[region]
    got = summary["regions"][region]
    assert (got["orders"], got["units"]) == (orders, units)
    assert got["revenue"] == pytest.approx(revenue, abs=0.005)


def test_total_revenue(summary: dict) -> None:
    assert summary["total_revenue"] == pytest.approx(519.83, abs=0.005)
