"""SWE-bench-style rows, loaded as published and graded as their official harnesses grade.

A file of rows (a JSON list, or JSONL) becomes one Task with an Instance per row. The
format is detected from the rows and said by `agentrl validate`:

- `swe-bench`: SWE-bench, Lite, Verified rows (FAIL_TO_PASS/PASS_TO_PASS as JSON text),
  with or without the `image`/`eval_script`/`log_parser`/`eval_type` columns the 2026
  datasets carry; agentrl's own rows add `source` (an sdist to build the image from).
- `swe-gym`: SWE-Gym rows (the same columns, test lists as lists, SWE-Gym's repositories).
- `swe-smith`: SWE-smith rows: `patch` introduces the bug; no test_patch; `image_name`.
- `r2e-gym`: R2E-Gym rows: `docker_image`, hidden tests in the image, `expected_output_json`.

The agent's sandbox starts from the instance's image, prepared once per image
(`prepare_image`): the repository at /testbed keeps no history after the state the
agent starts from (no later commits, branches, remotes, reflog or tags that leak the
fix), that state is tagged `agentrl-base`, and for SWE-smith the bug is applied and
its failing tests removed; for R2E-Gym the hidden tests are removed.

EVAL grades the agent's work the way each harness does: the agent's changes are taken
as a patch (`git diff agentrl-base`, binary-safe) from its sandbox, and applied in a
fresh container from the instance's image. Changes to test files (those of test_patch,
those that hold the FAIL_TO_PASS/PASS_TO_PASS tests, any conftest.py) are dropped
first and listed as `tampered` in the evidence. Then:

- swe-bench / swe-gym: the harness's eval script runs (the row's own `eval_script`, or
  the one the classic harness generates: reset the test files, apply test_patch, run the
  repository's test command on the test files between the output markers); the log is
  parsed and graded by the official `swebench` package (`get_logs_eval`,
  `get_eval_tests_report`, `get_resolution_status`): resolved is reward 1.0.
- swe-smith: the bug is applied to the clean repository, then the patch; the test files
  are restored; the profile's verbose pytest runs on the F2P and P2P files.
- r2e-gym: the hidden tests go where R2E-Gym's runtime puts them; `run_tests.sh` runs;
  reward 1.0 when every parsed status equals `expected_output_json`.

Instance images are looked up under the names each harness gives them (the row's own,
the hub name, the locally built name); agentrl's own rows can build theirs from a
PyPI sdist (`source`) or a local `repo_archive`.

The flow, one module each: `rows` reads and checks the rows; `images` finds, builds and
prepares each instance's image; `patch` takes the agent's changes out and applies them;
`harness` holds the classic harness's per-repository rules and eval script; `grade` runs
the tests and rules on them; `env` is the runtime that ties these together.
"""

from __future__ import annotations

from typing import Literal

Format = Literal["swe-bench", "swe-gym", "swe-smith", "r2e-gym"]

WORKDIR = "/testbed"
BASE_TAG = "agentrl-base"
"""Tags the state the agent starts from; its changes are `git diff agentrl-base`."""
TEST_TIMEOUT_S = 1800.0
R2E_TESTS, R2E_RUNNER = "/r2e_tests", "/testbed/run_tests.sh"
"""Where R2E-Gym's images hold the hidden tests and their runner."""
