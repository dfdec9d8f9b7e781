# Over 400 lines: the journal's writer and its reader keep one format; apart, each restates it.
"""The journal of episodes in flight: what a killed run needs to go on with each one at its
last replay point, instead of starting it again.

An episode with replay points (`snapshots.every`) appends to its run's journal (one
JSONL file, each line written whole) as it goes:

  open     at INIT's end: which task, instance and sample; its scheduled step; the image
  reached  as a snapshot of the state after n turns starts: the turn records and the token
           ledger up to there (only what earlier lines did not hold) and each segment's
           length there
  landed   as that commit lands: the snapshot's id
  dropped  that snapshot was removed (`keep_every`: a newer one superseded it)
  ended    RUN is over (finished, max_turns): EVAL is all that is left
  resumed  a later process went on from state n: what earlier lines said after n is void
  done     (training) the episode's trajectory, as the rollout got it, with its evidence

A killed process (`kill -9`) leaves every line written before the kill; a line torn by
it is skipped. Lines are fsynced by a thread of the journal's own, a batch at a time
(group commit), so no episode waits for the disk: the machine losing power loses at
most the lines of the last few milliseconds, as if it had lost power that much earlier.
What must not outrun the lines (removing a snapshot a newer landed one supersedes)
waits for them first (`synced`). The next run over the same folder reads, for
each episode it still owes, the newest state both reached and landed (`InFlight`), and
the episode factory goes on from there (`Episode.resumed`): its sandbox restored from
that snapshot, its chat rebuilt from the recorded turns and checked against the recorded
tokens, and only the turns after it sampled again. So a kill loses at most the turns
since the last snapshot (with `every: 1`, the turn in progress), and the trajectory is
the one an uninterrupted run records, with the resume points in `resumed_at`. An episode
whose RUN had ended at its last snapshot is graded without sampling anything.

A training step keeps its finished episodes here too until a checkpoint holds the step
(`agentrl run` and `eval` keep theirs in their trajectory file): its rerun takes them as
they were. Going on with the episodes in flight while running the finished ones again
would favour long episodes (those still running at the kill keep what they had, the
short ones are drawn anew), so a step resumes whole or not at all. With `version` (a
resumed training run's: the checkpoint's), only what versions up to it sampled is
offered, the weights a resumed run still has: an episode in flight goes on from its
newest such state, and a finished one sampled in part by a later version (one the kill
lost) runs again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl import atomic
from agentrl.sandbox.base import record_resumable
from agentrl.trajectory import EnvInfo, Segment, StopReason, Trajectory, Turn

if TYPE_CHECKING:
    from agentrl.chat import ChatSegment

log = logging.getLogger(__name__)

JOURNAL = "inflight.jsonl"
COMPACT_BYTES = 8 * 2**20
"""Appended past this since the last rewrite, the journal drops the lines of the episodes
recorded meanwhile (`closed`): it stays about as large as what is in flight."""
FLUSHER_IDLE_S = 2.0
"""The journal's fsync thread ends after this long with no line to sync."""
ENDED = (StopReason.finished, StopReason.max_turns)
"""RUN's ends after which nothing is sampled again: a resume at the last turn only grades."""


@dataclass
class InFlight:
    """What the journal holds of one episode: the state it goes on from (`turns` done,
    the sandbox in `snapshot`), recorded as a partial trajectory whose ledger ends there."""

    partial: Trajectory
    turns: int
    snapshot: str | None
    sample: int
    made: list[str]
    """Every snapshot the episode made up to `turns` (its retention removes them)."""
    ended: StopReason | None
    """RUN had ended there: EVAL is all that is left."""
    final: Trajectory | None = None
    """The episode had finished (a training step's): its trajectory, as recorded."""


class Journal:
    """One run's journal (`path`), shared by its episodes."""

    def __init__(self, path: Path, version: int | None = None, run_id: str | None = None) -> None:
        self.path, self.version = path, version
        self.run_id = run_id
        """The run whose snapshots the lines name: recorded as resumable at the first
        write, so `gc --snapshots` leaves a killed run's snapshots while this file is here."""
        self._recorded = False
        self._found: dict[tuple[str, str], InFlight] | None = None  # read once, then taken
        self.started: set[tuple[str, str]] = set()  # episodes a killed process had begun
        self._appended = 0  # bytes written since the last rewrite
        self._closed: set[tuple[str, str]] = set()  # recorded since then
        self._written = self._synced = 0  # lines written; of them, fsynced
        self._dirty = threading.Condition()
        self._sync_lock = threading.Lock()  # one fsync at a time: the others ride on it
        self._flusher: threading.Thread | None = None
        self._failed: OSError | None = None  # the flusher's fsync failed: writes stop

    def episode(self, task: str, trajectory_id: str) -> EpisodeJournal:
        """The writer of one episode's lines."""
        return EpisodeJournal(self, task, trajectory_id)

    def write(self, line: dict[str, Any]) -> None:
        """Append one line, whole: a kill after this keeps it. The fsync that keeps it
        through a power loss follows on the journal's thread (`synced` waits for it)."""
        if self._failed is not None:
            raise self._failed
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.run_id is not None and not self._recorded:
            record_resumable(self.run_id, self.path)
            self._recorded = True
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self._appended += len(data)
        with self._dirty:
            self._written += 1
            if self._flusher is None:  # it ends once idle: a run's journals leave no thread
                self._flusher = threading.Thread(target=self._flush, name="journal", daemon=True)
                self._flusher.start()
            self._dirty.notify()

    async def synced(self) -> None:
        """Return once every line written so far is fsynced."""
        if self._synced < self._written:
            await asyncio.to_thread(self._sync, self._written)

    def _sync(self, upto: int) -> None:
        """fsync the file if lines up to `upto` are not yet: one fsync covers every line
        written before it began, so callers waiting meanwhile share the next one."""
        with self._sync_lock:
            if self._synced >= upto:
                return
            target = self._written
            try:
                fd = os.open(self.path, os.O_RDONLY)  # fsync syncs the file, by any descriptor
            except FileNotFoundError:  # cleared or dropped to nothing: no line to keep
                self._synced = target
                return
            try:
                os.fsync(fd)
            except OSError as e:
                self._failed = e
                log.warning("journal %s: fsync failed: %s (writes stop)", self.path, e)
            finally:
                os.close(fd)
            self._synced = target

    def _flush(self) -> None:
        """The journal's thread: fsync whenever lines were written since the last; it
        ends after FLUSHER_IDLE_S with nothing to do (the next write starts another)."""
        while True:
            with self._dirty:
                while self._synced >= self._written:
                    if not self._dirty.wait(FLUSHER_IDLE_S) and self._synced >= self._written:
                        self._flusher = None
                        return
                upto = self._written
            self._sync(upto)

    def closed(self, task: str, trajectory_id: str) -> None:
        """The episode's trajectory is recorded where the run keeps it: its lines are
        dropped at the next rewrite, due once COMPACT_BYTES were appended since the last."""
        self._closed.add((task, trajectory_id))
        if self._appended > COMPACT_BYTES:
            self.drop(self._closed)
            self._closed.clear()
            self._appended = 0

    def in_flight(self) -> dict[tuple[str, str], InFlight]:
        """(task, trajectory id) -> where each journaled episode can go on from; those
        with no landed snapshot are not here (they start again)."""
        states: dict[tuple[str, str], _State] = {}
        done: dict[tuple[str, str], InFlight] = {}
        for line in self._lines():
            key = (line["task"], line["t"])
            if "open" in line:
                states[key] = _State(line["open"])
            elif "done" in line:
                done[key] = _finished(line)
            elif (state := states.get(key)) is not None:
                state.read(line)
        self.started = set(states)
        out = {}
        for key, state in states.items():
            if (found := state.in_flight(*key, self.version)) is not None:
                out[key] = found
        for key, found in done.items():
            assert found.final is not None
            if self.version is None or _newest_version(found.final.ledgers()) <= self.version:
                out[key] = found
        return out

    def finished(self, traj: Trajectory) -> None:
        """A training step's episode is back: kept until a checkpoint holds its step."""
        evidence = traj._grade.model_dump(mode="json") if traj._grade is not None else None
        self.write(
            {
                "task": traj.task,
                "t": traj.trajectory_id,
                "done": json.loads(traj.to_json()),
                "evidence": evidence,
            }
        )

    def pending(self) -> dict[tuple[str, str], InFlight]:
        """What the journal offers, read whole once, when first asked."""
        if self._found is None:
            self._found = self.in_flight()
        return self._found

    def take(self, task: str, trajectory_id: str) -> InFlight | None:
        """The offer for one episode, once: the episode made from it owns it."""
        return self.pending().pop((task, trajectory_id), None)

    def drop(self, keys: Container[tuple[str, str]]) -> None:
        """Rewrite the journal (atomically) without the lines of the episodes `keys`
        (task, trajectory id): those recorded, whose journal is done."""
        if not self.path.is_file():
            return
        kept = [
            json.dumps(line, separators=(",", ":")) + "\n"
            for line in self._lines()
            if (line["task"], line["t"]) not in keys
        ]
        if kept:
            atomic.write_text(self.path, "".join(kept))
        else:
            self.path.unlink(missing_ok=True)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def _lines(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        lines = []
        with self.path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    line = json.loads(raw)
                    if not (isinstance(line, dict) and "t" in line and "task" in line):
                        raise ValueError("not a journal line")
                except ValueError:  # a line torn by the kill: what it said is lost
                    if raw.endswith(b"\n"):
                        log.warning("%s:%d: not a journal line, skipped", self.path, n)
                    continue
                lines.append(line)
        return lines


class EpisodeJournal:
    """What one episode writes to its run's journal; it remembers how much of the ledger
    earlier lines hold, so each line carries only what is new."""

    def __init__(self, journal: Journal, task: str, trajectory_id: str) -> None:
        self.journal, self.task, self.trajectory_id = journal, task, trajectory_id
        self.turns_written = 0
        self.lengths: list[int] = []  # each segment's response length the journal holds
        self.stopped = False  # a write failed: later lines would not follow from the file

    def _write(self, **fields: Any) -> None:
        """One line; a write that fails (a full disk) stops this episode's journal, so a
        resume finds it as it was before, never with a line missing: the episode goes on
        and only its resumability is lost."""
        if self.stopped:
            return
        try:
            self.journal.write({"task": self.task, "t": self.trajectory_id, **fields})
        except OSError as e:
            self.stopped = True
            log.warning(
                "%s: journal %s: %s (a kill now restarts it)",
                self.trajectory_id,
                self.journal.path,
                e,
            )

    def opened(self, instance: str, sample: int, scheduled_step: int, env: EnvInfo) -> None:
        self._write(
            open={
                "instance": instance,
                "sample": sample,
                "scheduled_step": scheduled_step,
                "env": env.model_dump(mode="json"),
            }
        )

    def reached(self, n: int, turns: list[Turn], segments: list[ChatSegment]) -> None:
        """The state after `n` turns, as its snapshot starts: the turns and tokens new
        since the last line."""
        ledger = []
        for k, seg in enumerate(segments):
            start = self.lengths[k] if k < len(self.lengths) else 0
            if k < len(self.lengths) and start == len(seg.response_ids):
                continue
            part: dict[str, Any] = {"k": k, "from": start}
            if k >= len(self.lengths):
                part |= {"reason": seg.reason, "prompt_ids": seg.prompt_ids}
            ledger.append(part | _compact(seg, start))
        self.lengths = [len(s.response_ids) for s in segments]
        new = [t.model_dump(mode="json") for t in turns[self.turns_written : n]]
        self.turns_written = n
        self._write(reached=n, turns=new, ledger=ledger, lengths=self.lengths)

    async def synced(self) -> None:
        """Once every line written so far (this episode's and others') is fsynced."""
        await self.journal.synced()

    def landed(self, n: int, snapshot_id: str) -> None:
        self._write(landed=n, snapshot=snapshot_id)

    def dropped(self, n: int) -> None:
        """The snapshot of state n was removed (a newer one superseded it)."""
        self._write(dropped=n)

    def ended(self, n: int, stop: StopReason) -> None:
        if stop in ENDED:
            self._write(ended=n, stop=stop.value)

    def resumed(self, n: int, lengths: list[int]) -> None:
        """A new process goes on from state `n`, whose segments had `lengths`."""
        self.turns_written, self.lengths = n, list(lengths)
        self._write(resumed=n)


@dataclass
class _State:
    """One episode's lines, read in order."""

    open: dict[str, Any]
    turns: list[dict[str, Any]] = field(default_factory=list)
    segments: list[dict[str, Any]] = field(default_factory=list)
    reached: dict[int, list[int]] = field(default_factory=dict)  # n -> segment lengths
    landed: dict[int, str] = field(default_factory=dict)
    ended: tuple[int, str] | None = None
    resumed_at: list[int] = field(default_factory=list)

    def read(self, line: dict[str, Any]) -> None:
        if "reached" in line:
            n = line["reached"]
            self.turns = self.turns[: n - len(line["turns"])] + line["turns"]
            for part in line["ledger"]:
                k = part["k"]
                if k == len(self.segments):
                    self.segments.append(
                        {"reason": part["reason"], "prompt_ids": part["prompt_ids"]}
                        | {name: [] for name in _TOKENS}
                    )
                seg = self.segments[k]
                for name, values in _expanded(part).items():
                    seg[name] = seg[name][: part["from"]] + values
            self.reached[n] = line["lengths"]
        elif "landed" in line:
            self.landed[line["landed"]] = line["snapshot"]
        elif "dropped" in line:
            self.landed.pop(line["dropped"], None)
        elif "ended" in line:
            self.ended = (line["ended"], line["stop"])
        elif "resumed" in line:  # what was written after state n before the kill is void
            n = line["resumed"]
            lengths = self.reached[n]
            self.turns = self.turns[:n]
            self.segments = self.segments[: len(lengths)]
            for seg, length in zip(self.segments, lengths, strict=True):
                for name in _TOKENS:
                    seg[name] = seg[name][:length]
            self.reached = {k: v for k, v in self.reached.items() if k <= n}
            self.landed = {k: v for k, v in self.landed.items() if k <= n}
            self.ended = None
            self.resumed_at = [k for k in self.resumed_at if k <= n] + [n]

    def in_flight(
        self, task: str, trajectory_id: str, version: int | None = None
    ) -> InFlight | None:
        """The newest state reached and landed (with `version`: sampled by versions up to
        it only), as an InFlight; None when there is none."""
        points = [n for n in self.reached if n in self.landed and n <= len(self.turns)]
        candidates = ((n, self._ledgers(self.reached[n])) for n in sorted(points, reverse=True))
        found = next(
            (c for c in candidates if version is None or _newest_version(c[1]) <= version), None
        )
        if found is None:
            return None
        n, ledgers = found
        turns = [Turn.model_validate(t) for t in self.turns[:n]]
        for done, snapshot_id in self.landed.items():
            if 0 < done <= n:
                turns[done - 1].snapshot_id = snapshot_id
        env = EnvInfo.model_validate(self.open["env"])
        env.init_snapshot = self.landed.get(0)
        partial = Trajectory.from_ledgers(
            ledgers,
            trajectory_id=trajectory_id,
            group_id=self.open["instance"],
            task=task,
            stop_reason=StopReason.aborted,  # not a record: what the episode goes on from
            turns=turns,
            scheduled_step=self.open["scheduled_step"],
            env=env,
            resumed_at=self.resumed_at,
        )
        ended = None
        if self.ended is not None and self.ended[0] == n:
            ended = StopReason(self.ended[1])
        return InFlight(
            partial=partial,
            turns=n,
            snapshot=self.landed[n],
            sample=self.open["sample"],
            made=[sid for done, sid in sorted(self.landed.items()) if done <= n],
            ended=ended,
        )

    def _ledgers(self, lengths: list[int]) -> list[Segment]:
        """The ledger as it stood where each segment had `lengths`."""
        return [
            Segment(
                reason=seg["reason"],
                prompt_ids=seg["prompt_ids"],
                response_ids=seg["response_ids"][:length],
                loss_mask=seg["loss_mask"][:length],
                logprobs=seg["logprobs"][:length],
                token_versions=seg["versions"][:length],
            )
            for seg, length in zip(self.segments, lengths, strict=False)
        ]


def _compact(seg: ChatSegment, start: int) -> dict[str, Any]:
    """A segment's tokens from `start`, as a line holds them: the mask as runs, and the
    logprobs and versions of sampled tokens only (the others are always 0.0 and -1)."""
    mask = seg.loss_mask[start:]
    runs: list[list[int]] = []
    for m in mask:
        if runs and runs[-1][0] == m:
            runs[-1][1] += 1
        else:
            runs.append([m, 1])
    sampled = [i for i, m in enumerate(mask, start) if m]
    return {
        "response_ids": seg.response_ids[start:],
        "mask_runs": runs,
        "logprobs": [seg.logprobs[i] for i in sampled],
        "versions": [seg.versions[i] for i in sampled],
    }


def _expanded(part: dict[str, Any]) -> dict[str, list[Any]]:
    """`_compact`'s fields back as the segment's lists."""
    mask = [m for m, n in part["mask_runs"] for _ in range(n)]
    logprobs, versions = iter(part["logprobs"]), iter(part["versions"])
    return {
        "response_ids": part["response_ids"],
        "loss_mask": mask,
        "logprobs": [next(logprobs) if m else 0.0 for m in mask],
        "versions": [next(versions) if m else -1 for m in mask],
    }


def _newest_version(ledgers: list[Segment]) -> int:
    """The newest policy version that sampled a token of `ledgers` (-1: none sampled)."""
    return max(
        (v for s in ledgers for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m),
        default=-1,
    )


_TOKENS = ("response_ids", "loss_mask", "logprobs", "versions")


def _finished(line: dict[str, Any]) -> InFlight:
    from agentrl.tasks.evidence import Evidence

    traj = Trajectory.model_validate(line["done"])
    if line.get("evidence") is not None:
        traj = traj.with_grade(Evidence.model_validate(line["evidence"]))
    return InFlight(
        partial=traj,
        turns=len(traj.turns),
        snapshot=None,
        sample=int(traj.trajectory_id.rpartition("_")[2]),
        made=[],
        ended=None,
        final=traj,
    )
