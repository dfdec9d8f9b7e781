# Over 400 lines: the ledger contract (records, check(), the store) is one thing to keep.
"""The trajectory ledger: the one record that crosses every seam.

Invariant (token-in-token-out): `prompt_ids + response_ids` is exactly the token
sequence the sampler saw and produced, in order. Tokens the sampler produced are
appended verbatim with `loss_mask` 1, their sampler log-probability and the policy
version that sampled them; everything else (observations, chat-template glue) has
mask 0, logprob 0.0 and version -1. Nothing is ever decoded and re-encoded.

An episode whose history was rewritten (a chat template that drops earlier reasoning,
a context manager that dropped or summarized turns) continues in `segments`: each one
holds its own prompt (exactly what the sampler was then given) and keeps the same
invariant. The top-level fields are the first segment, so a prefix-stable episode is
one segment at no extra cost; `ledgers()` lists them all.

`Trajectory.check()` enforces that contract at runtime and raises a
`TrajectoryError` naming the trajectory and the field; `TrajectoryStore` appends
validated records to JSONL with fsync and reads them back identical.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from agentrl import atomic
from agentrl.errors import ConfigError, TrajectoryError, first_line
from agentrl.textfile import regular_file

SCHEMA_VERSION = 1


class StopReason(StrEnum):
    """Why an episode ended."""

    finished = "finished"
    max_turns = "max_turns"
    context_limit = "context_limit"
    sampler_length = "sampler_length"
    episode_timeout = "episode_timeout"
    sandbox_broken = "sandbox_broken"
    """The agent stopped its own sandbox; what it left is graded (its failure, trained on)."""
    sandbox_error = "sandbox_error"
    eval_error = "eval_error"
    aborted = "aborted"


# Infrastructure failures are counted and reported, never trained on as agent failures.
INFRA_STOP_REASONS = frozenset(
    {StopReason.sandbox_error, StopReason.eval_error, StopReason.aborted}
)


SegmentReason = Literal["start", "template", "drop_oldest", "summary", "client"]
"""Why a segment began: the episode's start, a chat template that rewrote history, a
context manager that dropped old turns or replaced them with the policy's summary, or an
external agent's harness that sent a history other than the one it was given (it edited,
truncated or summarized earlier messages, or changed its tools)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCall(_Strict):
    """A parsed tool call."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Turn(_Strict):
    """One ReAct turn: what the agent said, what it called, what came back."""

    action: str = Field(description="decoded text of the sampled tokens of this turn")
    tool_call: ToolCall | None = Field(default=None, description="parsed call, if any")
    observation: str = Field(default="", description="observation text (truncated)")
    exit_code: int | None = Field(default=None, description="tool exit code, if any")
    tool_error: bool = Field(
        default=False,
        description="the call failed: no call parsed, an unknown tool, bad arguments, or the "
        "tool's own error (a nonzero exit code alone is not one)",
    )
    span: tuple[int, int] = Field(
        description="[start, end) into response_ids of this turn's sampled tokens"
    )
    finish_reason: Literal["stop", "length", "abort"] | None = Field(
        default=None, description="why the sampler ended this turn's reply"
    )
    gen_seconds: float = 0.0
    tool_seconds: float = 0.0
    replica: str | None = Field(default=None, description="server that sampled the reply")
    snapshot_id: str | None = Field(default=None, description="sandbox snapshot after turn")
    segment: int = Field(default=0, ge=0, description="the ledger its span indexes (0: the first)")
    kind: Literal["action", "summary"] = Field(
        default="action", description="summary: the policy summarized history (no tool call)"
    )

    @property
    def tool_name(self) -> str | None:
        """The tool this turn called (None: no call was parsed)."""
        return self.tool_call.name if self.tool_call else None


class EnvInfo(_Strict):
    """Enough about the environment to replay the episode."""

    image: str | None = None
    image_digest: str | None = None
    provider: str | None = None
    node: str | None = Field(
        default=None, description="the cluster node that hosted the sandbox (null: this machine)"
    )
    task_hash: str | None = None
    init_attempts: int = Field(default=1, ge=1, description="INIT tries (infra errors retried)")
    init_snapshot: str | None = Field(
        default=None, description="sandbox snapshot after INIT, before the first turn"
    )


class AgentInfo(_Strict):
    """The external agent harness that produced an episode through the gateway
    (`agentrl.gateway`); a trajectory without one came from agentrl's own loop."""

    name: str = Field(description="the task's name for the harness")
    command: str = Field(description="the command that started it")
    where: Literal["beside", "sandbox"] = Field(description="where it ran")
    exit_code: int | None = Field(default=None, description="None: it was stopped, or never ran")
    calls: int = Field(default=0, ge=0, description="model calls it made through the gateway")
    edits: int = Field(
        default=0,
        ge=0,
        description="calls whose history differed from what the harness had been given (each "
        "began a segment, reason client)",
    )
    drift: int = Field(
        default=0,
        ge=0,
        description="calls whose messages, rendered as the harness sent them, tokenize to ids "
        "other than the ledger's (re-tokenization drift the recorder kept out of the ledger)",
    )
    overridden: dict[str, int] = Field(
        default_factory=dict,
        description="sampling parameters the harness asked for that the task's replaced "
        "(temperature, top_p), by how many calls",
    )
    log_tail: str = Field(default="", description="the end of what the harness printed")


class BranchOf(_Strict):
    """Where a continuation came from: its turns before `turn` (and their tokens) are
    `trajectory_id`'s, and its sandbox started as `snapshot`, the state before that turn."""

    trajectory_id: str
    turn: int = Field(ge=1, description="the first turn this episode sampled itself")
    snapshot: str | None = Field(default=None, description="the snapshot it was restored from")
    purpose: Literal["value", "replay"] = Field(
        description="value: estimating the state's value in training (`estimator: branch`); "
        "replay: `agentrl replay --policy`"
    )


class Segment(_Strict):
    """A continuation of the episode after its history was rewritten: a token ledger of
    its own, with the same invariant as the trajectory's first one."""

    reason: SegmentReason = Field(description="template, drop_oldest, summary or client")
    prompt_ids: list[int] = Field(description="exactly the tokens the sampler was given")
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    token_versions: list[int] = Field(default_factory=list)


class Trajectory(_Strict):
    """One episode as a validated, token-exact ledger (see module docstring)."""

    schema_version: int = SCHEMA_VERSION
    trajectory_id: str = Field(description="unique per episode, e.g. 'query-42_0'")
    group_id: str = Field(description="episodes sharing a prompt, e.g. 'query-42'")
    task: str = Field(description="task name")
    prompt_ids: list[int] = Field(description="exactly the tokens the sampler was first given")
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    token_versions: list[int] = Field(default_factory=list)
    reward: float | None = Field(default=None, description="scalar return; None if ungraded")
    turn_rewards: list[float] = Field(
        default_factory=list, description="per turn, stamped on its last sampled token"
    )
    reward_components: dict[str, Any] = Field(default_factory=dict)
    stop_reason: StopReason
    turns: list[Turn] = Field(default_factory=list)
    segments: list[Segment] = Field(
        default_factory=list, description="continuations after history was rewritten"
    )
    scheduled_step: int = 0
    consumed_step: int | None = None
    seconds: dict[str, float] = Field(
        default_factory=dict, description="wall seconds of each stage: init, run, eval"
    )
    env: EnvInfo = Field(default_factory=EnvInfo)
    agent: AgentInfo | None = Field(
        default=None, description="the external harness that produced it (None: agentrl's loop)"
    )
    branch_of: BranchOf | None = Field(
        default=None, description="a continuation of another episode (None: a fresh one)"
    )
    resumed_at: list[int] = Field(
        default_factory=list,
        description="where a killed run's episode went on (turns done): the sandbox restored "
        "from the snapshot after that many turns, the turns before it as recorded then",
    )
    error: str | None = Field(default=None, description="what went wrong, for infra failures")
    fix: str | None = Field(default=None, description="how to fix that error, when known")
    grade_file: str | None = Field(
        default=None,
        description="the grade's evidence (test command, exit code, per-test statuses, output), "
        "relative to the trajectory file's folder: <file stem>.grades/<trajectory_id>.json",
    )
    _grade: BaseModel | None = PrivateAttr(default=None)

    def with_grade(self, evidence: BaseModel | None) -> Trajectory:
        """This trajectory, carrying the grader's evidence until a store writes it beside
        the trajectory file (and links it in `grade_file`)."""
        self._grade = evidence
        return self

    @property
    def trainable(self) -> bool:
        """Whether this episode's outcome is the agent's (not an infrastructure failure)."""
        return self.stop_reason not in INFRA_STOP_REASONS

    @classmethod
    def from_ledgers(cls, ledgers: Sequence[Segment], **fields: Any) -> Trajectory:
        """A trajectory whose token ledgers are `ledgers`: the first one's are the
        top-level fields, the rest its `segments` (`ledgers()` is the inverse)."""
        first, *rest = ledgers
        return cls(
            prompt_ids=first.prompt_ids,
            response_ids=first.response_ids,
            loss_mask=first.loss_mask,
            logprobs=first.logprobs,
            token_versions=first.token_versions,
            segments=rest,
            **fields,
        )

    def ledgers(self) -> list[Segment]:
        """Every token ledger of the episode in order: the first (the top-level fields)
        and its `segments`."""
        first = Segment.model_construct(
            reason="start",
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            token_versions=self.token_versions,
        )
        return [first, *self.segments]

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask) + sum(sum(s.loss_mask) for s in self.segments)

    def _fail(self, field: str, message: str) -> TrajectoryError:
        return TrajectoryError(f"trajectory {self.trajectory_id!r}: {field}: {message}")

    def check(self) -> Trajectory:
        """Enforce the ledger contract; raise TrajectoryError naming the field. Returns self."""
        if self.schema_version != SCHEMA_VERSION:
            raise self._fail(
                "schema_version",
                f"{self.schema_version} is not {SCHEMA_VERSION} (written by another agentrl?)",
            )
        if not self.trajectory_id:
            raise TrajectoryError("trajectory with an empty trajectory_id")
        ledgers = self.ledgers()
        for k, ledger in enumerate(ledgers):
            self._check_ledger(ledger, "" if k == 0 else f"segments[{k - 1}].")
        self._check_turns(ledgers)
        self._check_reward()
        return self

    def _check_ledger(self, ledger: Segment, at: str) -> None:
        if not ledger.prompt_ids:
            raise self._fail(f"{at}prompt_ids", "empty: the sampler was given no tokens")
        n = len(ledger.response_ids)
        for name in ("loss_mask", "logprobs", "token_versions"):
            got = len(getattr(ledger, name))
            if got != n:
                raise self._fail(f"{at}{name}", f"length {got} != response_ids length {n}")
        for name in ("prompt_ids", "response_ids"):
            bad = next((i for i, t in enumerate(getattr(ledger, name)) if t < 0), None)
            if bad is not None:
                raise self._fail(f"{at}{name}[{bad}]", "negative token id")
        for i, (m, lp, v) in enumerate(
            zip(ledger.loss_mask, ledger.logprobs, ledger.token_versions, strict=True)
        ):
            if m not in (0, 1):
                raise self._fail(f"{at}loss_mask[{i}]", f"{m} is not 0 or 1")
            if m == 1:
                if not math.isfinite(lp) or lp > 0.0:
                    raise self._fail(
                        f"{at}logprobs[{i}]", f"{lp} on a sampled token (must be finite and <= 0)"
                    )
                if v < 0:
                    raise self._fail(
                        f"{at}token_versions[{i}]", f"{v}: a sampled token needs its policy version"
                    )
            else:
                if lp != 0.0:
                    raise self._fail(
                        f"{at}logprobs[{i}]", f"{lp} on a non-sampled token (must be 0.0)"
                    )
                if v != -1:
                    raise self._fail(
                        f"{at}token_versions[{i}]", f"{v} on a non-sampled token (must be -1)"
                    )

    def _check_turns(self, ledgers: list[Segment]) -> None:
        at = (0, 0)  # (segment, end of the previous span in it)
        for k, turn in enumerate(self.turns):
            start, end = turn.span
            if turn.segment >= len(ledgers):
                raise self._fail(
                    f"turns[{k}].segment", f"{turn.segment}: the episode has {len(ledgers)}"
                )
            n = len(ledgers[turn.segment].response_ids)
            prev_end = at[1] if turn.segment == at[0] else 0
            if turn.segment < at[0] or not prev_end <= start <= end <= n:
                raise self._fail(
                    f"turns[{k}].span",
                    f"{turn.span} in segment {turn.segment} is out of order or outside its "
                    f"response_ids (length {n})",
                )
            mask = ledgers[turn.segment].loss_mask[start:end]
            # An infrastructure failure zeroes the mask on purpose; spans still say where.
            if self.trainable and any(m != 1 for m in mask):
                raise self._fail(f"turns[{k}].span", f"{turn.span} covers non-sampled tokens")
            at = (turn.segment, end)
        if self.turn_rewards and len(self.turn_rewards) != len(self.turns):
            raise self._fail(
                "turn_rewards", f"{len(self.turn_rewards)} rewards for {len(self.turns)} turns"
            )
        for k, r in enumerate(self.turn_rewards):
            if not math.isfinite(r):
                raise self._fail(f"turn_rewards[{k}]", f"{r} is not finite")

    def _check_reward(self) -> None:
        if self.trainable:
            if self.num_sampled == 0:
                raise self._fail(
                    "loss_mask",
                    f"no sampled tokens, but stop_reason {self.stop_reason.value!r} claims "
                    "a trainable episode",
                )
            if self.reward is None or not math.isfinite(self.reward):
                raise self._fail("reward", f"{self.reward} on a trainable episode (must be finite)")
        else:
            if self.num_sampled:
                raise self._fail(
                    "loss_mask",
                    f"infrastructure failure ({self.stop_reason.value}) must carry a zero "
                    "loss mask",
                )
            if self.reward is not None and not math.isfinite(self.reward):
                raise self._fail("reward", f"{self.reward} is not finite")

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, line: str | bytes, *, where: str = "") -> Trajectory:
        """Parse and check one JSON record (bytes must be UTF-8); errors name `where`
        (file:line) and the field."""
        prefix = f"{where}: " if where else ""
        try:
            raw = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
        except UnicodeDecodeError as e:
            raise TrajectoryError(f"{prefix}not UTF-8 (offset {e.start})") from None
        except json.JSONDecodeError as e:
            raise TrajectoryError(f"{prefix}not valid JSON ({e.msg} at column {e.colno})") from e
        except RecursionError:
            raise TrajectoryError(f"{prefix}not a trajectory: JSON nested too deeply") from None
        except ValueError as e:  # e.g. an integer of more digits than Python reads
            raise TrajectoryError(f"{prefix}not valid JSON ({first_line(e)})") from None
        if not isinstance(raw, dict):
            raise TrajectoryError(f"{prefix}a trajectory must be a JSON object")
        tid = raw.get("trajectory_id", "?")
        version = raw.get("schema_version", SCHEMA_VERSION)
        if isinstance(version, int) and version > SCHEMA_VERSION:
            raise TrajectoryError(
                f"{prefix}trajectory {tid!r}: schema_version {version} is newer than this "
                f"agentrl understands ({SCHEMA_VERSION})",
                fix="upgrade agentrl: pip install -U agentrl",
            )
        try:
            traj = cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "(record)"
            raise TrajectoryError(f"{prefix}trajectory {tid!r}: {loc}: {err['msg']}") from e
        try:
            return traj.check()
        except TrajectoryError as e:
            raise TrajectoryError(f"{prefix}{e.message}") from e


BRANCHES = "branches.jsonl"
"""Where `agentrl replay --policy` appends the branches of a run folder's episodes."""


def run_files(run_dir: Path) -> list[Path]:
    """The trajectory files of a run folder: training/run episodes, evaluations, branches."""
    evals = sorted((run_dir / "eval").glob("step-*/trajectories.jsonl"))
    files = [run_dir / "trajectories.jsonl", *evals]
    return [f for f in [*files, run_dir / BRANCHES] if f.is_file()]


def agent_counts(trajs: Sequence[Trajectory]) -> dict[str, int]:
    """Calls, edits and drift summed over the episodes external harnesses played."""
    played = [t.agent for t in trajs if t.agent is not None]
    if not played:
        return {}
    return {
        "episodes": len(played),
        "calls": sum(a.calls for a in played),
        "edits": sum(a.edits for a in played),
        "drift": sum(a.drift for a in played),
    }


class TrajectoryStore:
    """Append-only JSONL file of validated trajectories; each append is fsynced.

    A record is written with a single `write` to a file opened with O_APPEND, so
    concurrent appenders never interleave and a killed writer leaves at most one
    torn last line (one without its newline): `read` reports it by line number, the
    next `append` puts it on a line of its own, `cut_torn_tail` removes it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    @property
    def grades_dir(self) -> Path:
        """Where the grades of this file's trajectories go: `<stem>.grades/` beside it."""
        return self.path.with_name(f"{self.path.stem}.grades")

    def append(self, trajectory: Trajectory) -> None:
        """Append one trajectory; its grader's evidence (if it carries one) goes to
        `grades_dir`, written whole before the line that links it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if trajectory._grade is not None:
            name = re.sub(r"[^\w.-]+", "_", trajectory.trajectory_id) + ".json"
            self.grades_dir.mkdir(exist_ok=True)
            atomic.write_text(self.grades_dir / name, trajectory._grade.model_dump_json(indent=1))
            trajectory.grade_file = f"{self.grades_dir.name}/{name}"
            trajectory._grade = None  # written: the record now links it, as a reader sees it
        line = trajectory.check().to_json().encode() + b"\n"
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if _ends_torn(fd):
                    os.write(fd, b"\n")  # isolate a torn tail so it stays one bad line
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)

    def cut_torn_tail(self) -> None:
        """Remove a torn last line (left by a writer killed mid-append), if there is one."""
        with self.path.open("rb+") as f:
            if not _ends_torn(f.fileno()):
                return
            end = f.seek(0, os.SEEK_END)
            while end:  # back from the end to the last newline, a block at a time
                start = max(0, end - 65536)
                f.seek(start)
                block = f.read(end - start)
                if (n := block.rfind(b"\n")) >= 0 or start == 0:
                    f.truncate(start + n + 1)  # n = -1: no whole line at all
                    return
                end = start

    def __iter__(self) -> Iterator[Trajectory]:
        return self.read()

    def read(self) -> Iterator[Trajectory]:
        """Yield every trajectory; a bad line raises TrajectoryError naming file:line."""
        if not self.path.exists():
            raise TrajectoryError(
                f"{self.path}: no such trajectory file", fix="check the path or the run directory"
            )
        try:
            regular_file(self.path, what="trajectory file")
        except ConfigError as e:
            raise TrajectoryError(e.message, fix="check the path or the run directory") from None
        with self.path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                where = f"{self.path}:{lineno}"
                try:
                    yield Trajectory.from_json(raw, where=where)
                except TrajectoryError as e:
                    if raw.endswith(b"\n"):
                        raise
                    torn = f"{e.message} (the last line, torn: was its writer killed?)"
                    raise TrajectoryError(torn, fix=e.fix) from e


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
