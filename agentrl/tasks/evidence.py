"""What a grade is and what backs it: `Grade` (a reward with its components), `Evidence`
(what a person needs to trust or dispute it) and the two ways a grade does not happen,
`DidNotRun` (the tests could not run here; the reference decides whose doing that was) and
`GraderError` (the grader itself is broken: eval_error, never a 0). Every grader, the YAML
ones (`graders`) and the importers' (Terminal-Bench, Harbor, SWE-bench), builds on these.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import GraderError
from agentrl.sandbox.base import ExecResult, Sealed

OUTPUT_KEEP_CHARS = 8000
"""Evidence keeps this many characters of output: a quarter from the start, the rest from
the end."""

SIGNAL_EXITS = {132: "SIGILL", 133: "SIGTRAP", 134: "SIGABRT", 135: "SIGBUS", 136: "SIGFPE"}

SIGNAL_EXITS |= {137: "SIGKILL (out of memory?)", 139: "SIGSEGV"}
"""Exit codes (128 + signal) of a test command that died rather than reported."""


class Evidence(BaseModel):
    """What a person needs to trust or dispute a grade."""

    model_config = ConfigDict(extra="forbid")

    grader: str = Field(description="command, pytest, python, terminal-bench, harbor, swe-bench")
    command: str = Field(default="", description="the test command, as run")
    exit_code: int | None = Field(default=None, description="its exit code (None: killed)")
    tests: dict[str, str] = Field(
        default_factory=dict, description="test id -> status, as the harness's parser read them"
    )
    output: str = Field(default="", description="head and tail of the test command's output")
    substitutions: list[str] = Field(
        default_factory=list, description="runtime substitutions, e.g. the offline test runtime"
    )
    sealed: Sealed | None = Field(
        default=None, description="processes stopped and protected paths restored before grading"
    )
    tampered: list[str] = Field(
        default_factory=list,
        description="test files the agent changed (restored before the tests ran)",
    )
    notes: list[str] = Field(default_factory=list, description="anything else a person should know")
    reference: str | None = Field(
        default=None,
        description="the tests did not run after the agent's changes: what an untouched "
        "sandbox gave, which decided whether that is the agent's doing (reward 0) or not",
    )


class Grade(BaseModel):
    """What a grader made of one sandbox."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reward: float
    components: dict[str, Any]
    """The grader's raw outputs in brief (exit code, tests passed/failed, resolved, extra keys);
    the trajectory's `reward_components`."""
    evidence: Evidence
    seconds: float


class DidNotRun(GraderError):
    """The test command could not run in this sandbox; `evidence` shows how far it got."""

    def __init__(self, message: str, evidence: Evidence, *, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.evidence = evidence


def truncate(text: str, keep: int = OUTPUT_KEEP_CHARS) -> str:
    if len(text) <= keep:
        return text
    head, tail = keep // 4, keep - keep // 4
    return f"{text[:head]}\n[... {len(text) - keep} chars elided ...]\n{text[-tail:]}"


def ran(result: ExecResult, what: str, grader: str, command: str) -> Evidence:
    """Evidence of one test command; DidNotRun if it timed out, was not found or died."""
    evidence = Evidence(
        grader=grader, command=command, exit_code=result.exit_code, output=truncate(result.output)
    )
    if result.timed_out:
        raise DidNotRun(f"{what} timed out after {result.seconds:.0f} s", evidence)
    code = result.exit_code
    if code in (126, 127):
        raise DidNotRun(f"{what} did not run (exit {code}): {tail(result.output)}", evidence)
    if code in SIGNAL_EXITS:
        raise DidNotRun(f"{what} died of {SIGNAL_EXITS[code]} (exit {code})", evidence)
    return evidence


def parse_reward(text: str, source: str) -> tuple[float, dict[str, Any]]:
    """A reward file's number, or a JSON object's `reward` (its other numbers become components)."""
    stripped = text.strip()
    extra: dict[str, Any] = {}
    try:
        reward = float(stripped)
    except ValueError:
        try:
            data = json.loads(stripped)
        except ValueError:
            data = None
        if not isinstance(data, dict) or not is_number(data.get("reward")):
            raise GraderError(
                f"reward file {source} holds {stripped[:80]!r}: expected a number "
                'or a JSON object with a numeric "reward"'
            ) from None
        reward = float(data["reward"])
        extra = {k: v for k, v in data.items() if k != "reward"}
    if not math.isfinite(reward):
        raise GraderError(f"reward file {source} holds {reward}, not a finite number")
    return reward, extra


def tail(output: str, chars: int = 300) -> str:
    """The end of some output on one line, for an error message."""
    text = " | ".join(line.strip() for line in output.strip().splitlines() if line.strip())
    return ("..." + text[-chars:]) if len(text) > chars else (text or "(no output)")


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
