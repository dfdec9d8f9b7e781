"""The suite's time guard (conftest.py): an unmarked test over the limit fails, a test
marked slow or e2e does not, in one process and in pytest-xdist workers (the suite's
default, pyproject.toml addopts). Run in an inner pytest session with the limit at 0.5 s."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_an_unmarked_test_over_the_limit_fails_and_a_marked_one_passes(
    pytester: pytest.Pytester, workers: str
) -> None:
    conftest = (Path(__file__).parent / "conftest.py").read_text(encoding="utf-8")
    assert "UNMARKED_LIMIT_S = 60.0" in conftest
    pytester.makeconftest(conftest.replace("UNMARKED_LIMIT_S = 60.0", "UNMARKED_LIMIT_S = 0.5"))
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    e2e: end to end\n")
    pytester.makepyfile(
        """
        import time, pytest

        def test_quick():
            pass

        def test_unmarked_and_slow():
            time.sleep(0.8)

        @pytest.mark.slow
        def test_marked_slow():
            time.sleep(0.8)

        @pytest.mark.e2e
        def test_marked_e2e():
            time.sleep(0.8)
        """
    )
    # -n 2: the guard runs in the workers; their verdict is what the controller reports.
    result = pytester.runpytest_subprocess("-n", workers, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked_and_slow*", "*over the 0.5 s allowed*"])
    if workers != "0":
        result.stdout.fnmatch_lines(["*2 workers*"])
