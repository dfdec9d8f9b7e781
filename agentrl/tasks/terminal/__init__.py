"""Terminal-Bench and Harbor task folders, loaded as they are (no conversion step).

Terminal-Bench (laude-institute/terminal-bench): `task.yaml` (`instruction`,
`max_agent_timeout_sec`, `max_test_timeout_sec`), a `Dockerfile` at the folder root,
`run-tests.sh`, `tests/`, `solution.sh`. The image is the one its harness would use if
present (`tb__<task>__client`), else the Dockerfile built with the network
(`AGENTRL_BUILD_NETWORK`, default host); the container has `TEST_DIR=/tests` as the
task's docker-compose.yaml sets. After the agent, its harness copies `run-tests.sh` and
`tests/` into `/tests`, runs `bash /tests/run-tests.sh` and parses pytest's `-rA` summary
with its PytestParser: the test name is what follows the first `::`, a FAILED line loses
its ` - message`, and the task is resolved when every parsed test passed (skipped and
xfail count as passed). agentrl does the same; a run whose output has no summary, or
none with a test in it, did not run (`DidNotRun`).

Harbor: `task.toml` (`[agent]`/`[verifier]` `timeout_sec`, `[environment]` `cpus`,
`memory_mb`, `docker_image`), `instruction.md`, `environment/Dockerfile`,
`tests/test.sh`, `solution/solve.sh`. Its verifier uploads `tests/` to `/tests`, runs
`/tests/test.sh` and reads the reward from `/logs/verifier/reward.txt` (or
`reward.json`). A missing reward file, or a pytest-based test.sh whose output has no
pytest summary, did not run. Its `[[verifier.collect]]` commands, `artifacts` and a
verifier container of its own (`environment_mode = "separate"`): `verifier`.

Without internet, the standard uv/pytest bootstrap of these tests runs on agentrl's
offline test runtime (`offline`), recorded in the grade's evidence.
Either way the result is a `Task` with one instance; tests reach the sandbox at EVAL.

The flow, one module each: `load` reads a folder into a Task; `env` is its runtime (the
harness's image, the reference solution); `grade` runs the tests as each harness does;
`offline` brings the tests' bootstrap into the sandbox, from what `downloads` fetched;
`verifier` reads where Harbor's tests run and what reaches them.
"""

from __future__ import annotations

from typing import Literal

Format = Literal["terminal-bench", "harbor"]

TESTS_DIR = "/tests"
DEFAULT_TEST_TIMEOUT_S = 120.0
