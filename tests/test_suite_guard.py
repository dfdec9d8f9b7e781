"""The suite's time guard (conftest.py): an unmarked test over the limit fails, a test
marked slow or e2e does not. Run in an inner pytest session with the limit at 0.5 s."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


def test_an_unmarked_test_over_the_limit_fails_and_a_marked_one_passes(
    pytester: pytest.Pytester,
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
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarked_and_slow*", "*over the 0.5 s allowed*"])
