"""The tests the grader runs; copied in at EVAL only, so the agent never sees them."""

from stats import mean, median, mode


def test_mean():
    assert mean([1, 2, 3, 6]) == 3


def test_median():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5


def test_mode():
    assert mode([1, 2, 2, 3, 2, 3]) == 2
