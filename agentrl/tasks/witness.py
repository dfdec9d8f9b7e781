"""The pytest witness: what a grader reads about a pytest run comes from pytest itself,
not from the text the run printed.

Code the tests import (the agent's work) runs inside pytest's process, so it can write
anything to the log: a forged `short test summary info` printed at exit, lines spammed
from a thread, a `pytest.exit()` or `os._exit(0)` before the failing test. Every grader
that runs pytest therefore runs its test command through `run_tests`, which loads
`witness_plugin.py` into each pytest the command starts (`PYTEST_PLUGINS`, from a
folder whose name only this grade knows), before any code under test:
- the plugin records every test's outcome as pytest's own reports give it, and ends the
  process with pytest's exit status once the session is over: nothing registered by the
  code under test to run at exit runs;
- a session that started and never finished (the code under test ended the process,
  or it was killed) is a `DidNotRun`: the reference solution's sandbox decides whose
  doing that was, as for any run whose tests did not finish;
- the log a grader parses is the witness's, rendered as pytest prints it (`-v` lines and
  a `-rA` summary per session; a test an interrupted session collected and never ran is
  an ERROR), so each harness's own parser reads it unchanged.
A command that starts no pytest (Django's runtests, a bespoke runner) is read from its
log as before. Code that reaches into pytest's own objects to change what it reports is
beyond this (as writing code that behaves differently under test is).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.sandbox.base import ExecRequest, ExecResult, Sandbox
from agentrl.tasks.evidence import DidNotRun, Evidence, ran

_PLUGIN = Path(__file__).with_name("witness_plugin.py")
_MARK = "agentrl-witness-records-"
_SOURCE_ENV = "AGENTRL_WITNESS_SOURCE"


@dataclass
class Witnessed:
    """What the witness saw of one test command's pytest sessions."""

    sessions: list[dict[str, Any]] = field(default_factory=list)
    """finished sessions' end records, in the order they ended"""
    cut_short: list[str] = field(default_factory=list)
    """the command lines of sessions that started and never finished"""

    @property
    def seen(self) -> bool:
        """Whether any pytest session ran under the witness."""
        return any(s.get("configured") for s in self.sessions)

    def log(self, output: str) -> str:
        """The text a harness's parser reads: the witness's rendering of the sessions,
        or `output` itself where no pytest session ran."""
        return self.render() if self.seen else output

    def render(self) -> str:
        """Each session as `pytest -v -rA` would show it: one `TEST STATUS` line per
        outcome, then its short test summary."""
        blocks = []
        for session in self.sessions:
            if not session.get("configured"):
                continue
            results = [tuple(r) for r in session.get("results", [])]
            results += [("ERROR", test, "") for test in session.get("not_run", [])]
            verbose = [f"{test} {status}" for status, test, _ in results]
            summary = [
                f"SKIPPED [1] {detail}" if status == "SKIPPED" and detail else f"{status} {test}"
                for status, test, detail in results
            ]
            counts: dict[str, int] = {}
            for status, _, _ in results:
                counts[status.lower()] = counts.get(status.lower(), 0) + 1
            tally = ", ".join(f"{n} {word}" for word, n in counts.items()) or "no tests ran"
            rule = "=" * 20
            blocks.append(
                "\n".join(
                    [
                        *verbose,
                        f"{rule} short test summary info {rule}",
                        *summary,
                        f"{rule} {tally} (exit status {session.get('exitstatus')}) {rule}",
                    ]
                )
            )
        return "\n".join(blocks) + "\n"


async def run_tests(
    sandbox: Sandbox, request: ExecRequest, what: str, grader: str, shown: str
) -> tuple[ExecResult, Evidence, Witnessed]:
    """Run the test command `request` (a shell string) with the witness in every pytest it
    starts: its result (the output without the witness's records), the evidence (`ran`'s
    checks: DidNotRun when it timed out or died) and what the witness saw; DidNotRun when
    a pytest session was cut short. `shown` is the command as the evidence names it."""
    if not isinstance(request.command, str):
        raise TypeError("run_tests takes a shell command string")
    token = secrets.token_hex(8)
    wrapped = request.model_copy(
        update={
            "command": _wrapped(request.command, token),
            "env": {**request.env, _SOURCE_ENV: _PLUGIN.read_text()},
        }
    )
    result = await sandbox.exec(wrapped)
    output, mark, records = result.output.rpartition(f"\n{_MARK}{token}\n")
    if mark:
        result = result.model_copy(update={"output": output})
    evidence = ran(result, what, grader, shown)
    witnessed = _read(records if mark else "")
    if witnessed.seen:
        runs = len([s for s in witnessed.sessions if s.get("configured")])
        evidence.substitutions.append(
            f"test results as pytest reported them to agentrl's witness plugin ({runs} "
            "session(s)), not as the log printed them"
        )
    if witnessed.cut_short:
        raise DidNotRun(
            f"pytest ({witnessed.cut_short[0]}) started and never finished its session, "
            "as agentrl's witness saw it: the process ended inside the run (the code under "
            "test exited, or it was killed)",
            evidence,
        )
    return result, evidence, witnessed


def _wrapped(command: str, token: str) -> str:
    """`command` in a subshell with the plugin on PYTHONPATH and named in PYTEST_PLUGINS,
    then the plugin's records after a line only this grade knows. Where the plugin
    cannot be written, the command runs as it is."""
    folder = f"/tmp/agentrl-witness-{token}"
    module = f"agentrl_witness_{token}"
    return (
        f'if mkdir -p {folder} && printf "%s" "${_SOURCE_ENV}" > {folder}/{module}.py; then '
        f"export PYTHONPATH={folder}${{PYTHONPATH:+:$PYTHONPATH}} "
        f"PYTEST_PLUGINS={module}${{PYTEST_PLUGINS:+,$PYTEST_PLUGINS}}; fi; "
        f"unset {_SOURCE_ENV}; (\n{command}\n); __agentrl_rc=$?; "
        f"printf '\\n{_MARK}{token}\\n'; cat {folder}/sessions.jsonl 2>/dev/null; "
        f"rm -rf {folder}; exit $__agentrl_rc"
    )


def _read(records: str) -> Witnessed:
    """The sessions in the plugin's JSON lines (a line that does not parse is skipped)."""
    started: dict[str, list[str]] = {}
    ended: dict[str, dict[str, Any]] = {}
    for line in records.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("session"), str):
            continue
        if record.get("event") == "start":
            started[record["session"]] = [str(a) for a in record.get("argv", [])]
        elif record.get("event") == "end":
            ended[record["session"]] = record
    cut = [" ".join(argv) or "pytest" for sid, argv in started.items() if sid not in ended]
    return Witnessed(sessions=list(ended.values()), cut_short=cut)
