"""Grading a Terminal-Bench or Harbor task as its harness does. Terminal-Bench: run
`/tests/run-tests.sh`, parse pytest's `-rA` summary with its PytestParser's rules.
Harbor: run `/tests/test.sh`, read `/logs/verifier/reward.txt` (or `reward.json`).
Either way, a run whose tests never ran is a DidNotRun, not a zero, and each pytest the
scripts start is witnessed (`agentrl.tasks.witness`): the tests' outcomes are pytest's, and
the exit status `test.sh` computes a reward from is pytest's own.
"""

from __future__ import annotations

import re
import shlex

from agentrl.errors import SandboxFileNotFound
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.tasks.evidence import DidNotRun, Grade, parse_reward, tail
from agentrl.tasks.pytest_log import check_collected, count_tests
from agentrl.tasks.spec import Instance
from agentrl.tasks.terminal import DEFAULT_TEST_TIMEOUT_S, TESTS_DIR
from agentrl.tasks.terminal.offline import ENV_FILE
from agentrl.tasks.witness import run_tests

REWARD_DIR = "/logs/verifier"
TB_PASSING = ("PASSED", "XFAIL", "SKIPPED")
TB_STATUSES = ("PASSED", "FAILED", "SKIPPED", "XFAIL", "XPASS", "ERROR")
RUNTIME = f"if [ -f {ENV_FILE} ]; then . {ENV_FILE}; fi; "
"""Prefix of every test command: the offline test runtime, where EVAL installed it."""
_SUMMARY = re.compile(r"=+\s*short test summary info\s*=+", re.IGNORECASE)
# Harbor clears the verifier folder, runs test.sh as an executable and keeps its output.
HARBOR_VERIFY = (
    f"rm -rf {REWARD_DIR} && mkdir -p {REWARD_DIR} && chmod +x {TESTS_DIR}/test.sh && "
    f"{TESTS_DIR}/test.sh 2>&1 | tee {REWARD_DIR}/test-stdout.txt; "
    f"if [ ! -e {REWARD_DIR}/reward.txt ] && [ -e {REWARD_DIR}/reward.json ]; then "
    f"cp {REWARD_DIR}/reward.json {REWARD_DIR}/reward.txt; fi"
)


async def grade_terminal_bench(sandbox: Sandbox, instance: Instance) -> Grade:
    """Terminal-Bench's grading: run /tests/run-tests.sh, parse pytest's summary from it."""
    timeout = float(instance.fields.get("test_timeout_sec", DEFAULT_TEST_TIMEOUT_S))
    command = f"bash {TESTS_DIR}/run-tests.sh"
    request = ExecRequest(command=RUNTIME + command, timeout=timeout, env={"TEST_DIR": TESTS_DIR})
    result, evidence, witnessed = await run_tests(
        sandbox, request, "run-tests.sh", "terminal-bench", command
    )
    log = witnessed.log(result.output)
    tests = parse_tb_pytest(log)
    evidence.tests = tests
    check_collected(log, evidence)
    if not tests:
        found = "no pytest summary" if not _SUMMARY.search(log) else "no test in it"
        raise DidNotRun(
            f"run-tests.sh (exit {result.exit_code}): {found}: {tail(result.output)}", evidence
        )
    resolved = all(status in TB_PASSING for status in tests.values())
    components = {"resolved": resolved, "exit_code": result.exit_code}
    components |= count_tests(tests, TB_PASSING)
    return Grade(
        reward=1.0 if resolved else 0.0, components=components, evidence=evidence, seconds=0.0
    )


def parse_tb_pytest(output: str) -> dict[str, str]:
    """Test name -> status as Terminal-Bench's PytestParser reads a `pytest -rA` run: what
    follows the first `short test summary info` line, a name after its first `::`, a
    FAILED line's ` - message` cut off."""
    parts = _SUMMARY.split(output, maxsplit=1)
    if len(parts) < 2:
        return {}
    tests: dict[str, str] = {}
    for line in parts[1].splitlines():
        if line.startswith("FAILED") and " - " in line:
            line = " - ".join(line.split(" - ")[:-1])
        words = line.split(maxsplit=1)
        if len(words) < 2 or words[0].strip(":") not in TB_STATUSES:
            continue
        name = words[1].strip().split("::", maxsplit=1)[-1]
        if name:
            tests[name] = words[0].strip(":")
    return tests


async def grade_harbor(sandbox: Sandbox, instance: Instance) -> Grade:
    """Harbor's verifier: run /tests/test.sh, read /logs/verifier/reward.txt (or .json)."""
    exports = "".join(
        f"export {k}={shlex.quote(str(v))}; " for k, v in instance.fields["verifier_env"].items()
    )
    timeout = float(instance.fields.get("test_timeout_sec", DEFAULT_TEST_TIMEOUT_S))
    request = ExecRequest(command=RUNTIME + exports + HARBOR_VERIFY, timeout=timeout)
    result, evidence, witnessed = await run_tests(
        sandbox, request, "tests/test.sh", "harbor", f"{TESTS_DIR}/test.sh"
    )
    log = witnessed.log(result.output)
    tests = parse_tb_pytest(log)
    evidence.tests = tests
    check_collected(log, evidence)
    try:
        data = await sandbox.read_file(f"{REWARD_DIR}/reward.txt")
    except SandboxFileNotFound:
        raise DidNotRun(
            f"tests/test.sh exited {result.exit_code} and wrote no {REWARD_DIR}/reward.txt: "
            f"{tail(result.output)}",
            evidence,
        ) from None
    reward, extra = parse_reward(data.decode(errors="replace"), f"{REWARD_DIR}/reward.txt")
    if instance.fields.get("pytest") and not tests:  # reward 0 because pytest never ran
        raise DidNotRun(
            f"tests/test.sh wrote reward {reward:g} but pytest reported no test: "
            f"{tail(result.output)}",
            evidence,
        )
    components = {"exit_code": result.exit_code, **extra}
    if tests:
        components |= count_tests(tests, TB_PASSING)
    return Grade(reward=reward, components=components, evidence=evidence, seconds=0.0)
