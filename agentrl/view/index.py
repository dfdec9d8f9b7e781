"""An index of a trajectory file: where each line starts, and what the table shows of it.

A run's trajectories.jsonl can hold 100,000 episodes and gigabytes of token ids; the
viewer never loads it whole. The index is built once, in one pass, and cached beside
the file (`<file>.index`); after that, opening the file reads only the index, and an
episode is one `pread` of its line. A file that grew (a run in progress) is indexed from
where the index ends; a file that was cut back (`agentrl train --resume` truncates to
its checkpoint) or replaced is indexed again: the index's last row must still be the
same bytes at the same offset (its CRC), which an append-only file that was only ever
truncated keeps exactly when every earlier row is still valid too.

The cache is JSON lines: a header, then one row per trajectory,
`[offset, length, crc32, *COLUMNS]`. It is appended as the file grows, under an
exclusive lock, so two viewers of one run never write a row twice; a folder that cannot
be written keeps the index in memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agentrl import atomic
from agentrl.trajectory import INFRA_STOP_REASONS

log = logging.getLogger(__name__)

INDEX_VERSION = 1

COLUMNS = (
    "row",
    "id",
    "task",
    "instance",
    "step",
    "consumed",
    "reward",
    "stop",
    "infra",
    "turns",
    "tool_errors",
    "tokens",
    "replicas",
    "node",
    "agent",
    "branch_of",
    "branch_turn",
    "purpose",
    "seconds",
)
"""What the episodes table shows of each trajectory (the viewer's contract: one list per
row, in this order)."""

_CHUNK = 1 << 22  # bytes read at a time while indexing


def record(line: bytes) -> dict[str, Any]:
    """A trajectory line as a dict, without decoding its token arrays where it can: a
    record written by `TrajectoryStore` holds only numbers between `"prompt_ids":[` and
    `"reward"`, so the text around them is parsed and `loss_mask` is counted as bytes.
    `sampled` is the count of mask-1 tokens of the first ledger. Any other layout is
    parsed whole."""
    start = line.find(b',"prompt_ids":[')
    end = line.find(b'],"reward":', start) if start > 0 else -1
    # Between them, exactly the five arrays' keys: 10 quotes, no string anywhere.
    if end < 0 or line.count(b'"', start, end) != 10:
        data: dict[str, Any] = json.loads(line)
        data["sampled"] = sum(data.get("loss_mask", ()))
        return data
    data = json.loads(line[:start] + b"}")
    data.update(json.loads(b"{" + line[end + 2 :]))
    mask_at = line.find(b'"loss_mask":[', start, end)
    mask_end = line.find(b"]", mask_at)
    data["sampled"] = line.count(b"1", mask_at + 13, mask_end) if mask_at > 0 else 0
    return data


def summarize(row: int, data: dict[str, Any]) -> list[Any]:
    """The table's row for one trajectory record (see COLUMNS)."""
    turns = data.get("turns") or []
    segments = data.get("segments") or []
    replicas = sorted({t["replica"] for t in turns if t.get("replica")})
    tool_errors = sum(1 for t in turns if t.get("tool_error") or (t.get("exit_code") or 0) != 0)
    env = data.get("env") or {}
    agent = data.get("agent") or {}
    branch = data.get("branch_of") or {}
    seconds = sum((data.get("seconds") or {}).values())
    sampled = data["sampled"] + sum(sum(s.get("loss_mask", ())) for s in segments)
    reward = data.get("reward")
    return [
        row,
        data.get("trajectory_id"),
        data.get("task"),
        data.get("group_id"),
        data.get("scheduled_step", 0),
        data.get("consumed_step"),
        reward,
        data.get("stop_reason"),
        data.get("stop_reason") in INFRA_STOP_REASONS,
        sum(1 for t in turns if t.get("kind", "action") == "action"),
        tool_errors,
        sampled,
        ",".join(replicas),
        env.get("node") or "",
        agent.get("name"),
        branch.get("trajectory_id"),
        branch.get("turn"),
        branch.get("purpose"),
        round(seconds, 2),
    ]


class EpisodeIndex:
    """Line offsets and table rows of one trajectory file (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cache = path.with_name(path.name + ".index")
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.crcs: list[int] = []
        self.rows: list[list[Any]] = []
        self.end = 0  # bytes of the trajectory file indexed (always at a line's end)
        self.bad: dict[int, str] = {}  # row -> why its line could not be read
        self.generation = 0  # counts the times the rows were dropped to be indexed again
        self._cached = 0  # bytes of the cache file read or written
        self._inode = 0  # the cache file they were read from
        self._writable = True

    def __len__(self) -> int:
        return len(self.rows)

    def refresh(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Bring the index up to the file: read the cache (first call), check it still
        describes the file, index what was appended. Returns the number of new rows."""
        size = self.path.stat().st_size if self.path.is_file() else 0
        if not self.rows and self._cached == 0:
            self._load_cache()
        if self.rows and not self._still_valid(size):
            log.info("%s was cut back or replaced: indexing it again", self.path)
            self._reset()
            self._remove_cache()
        if size == self.end and self._cache_size() == self._cached:
            return 0
        before = len(self.rows)
        with self._locked():
            self._load_cache()  # rows another viewer appended meanwhile
            new = list(self._scan(size, progress))
            self._append_cache(new)
        return len(self.rows) - before

    def line(self, row: int) -> bytes:
        """The bytes of row `row`'s line (one pread)."""
        with self.path.open("rb") as f:
            return os.pread(f.fileno(), self.lengths[row], self.offsets[row])

    def lines(self, rows: list[int] | None = None) -> Iterator[tuple[int, bytes]]:
        """(row, bytes) of every row (or of `rows`), read in file order."""
        wanted = range(len(self.rows)) if rows is None else sorted(rows)
        offsets, lengths = self.offsets, self.lengths  # a rebuild meanwhile makes new lists
        with self.path.open("rb") as f:
            fd = f.fileno()
            for row in wanted:
                yield row, os.pread(fd, lengths[row], offsets[row])

    # --- the file ------------------------------------------------------------------

    def _scan(self, size: int, progress: Callable[[int, int], None] | None) -> Iterator[list[Any]]:
        """Index the complete lines from `self.end` to `size` (a torn last line waits for
        its writer); yields the cache rows it adds."""
        with self.path.open("rb") as f:
            f.seek(self.end)
            pending = b""
            at = self.end
            while at + len(pending) < size:
                chunk = f.read(min(_CHUNK, size - at - len(pending)))
                if not chunk:
                    break
                pending += chunk
                lines = pending.split(b"\n")
                pending = lines.pop()
                for raw in lines:
                    entry = self._add(at, raw)
                    at += len(raw) + 1
                    if entry is not None:
                        yield entry
                self.end = at
                if progress:
                    progress(at, size)

    def _add(self, offset: int, raw: bytes) -> list[Any] | None:
        if not raw.strip():
            return None
        row = len(self.rows)
        try:
            summary = summarize(row, record(raw))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # Shown as a row that says so; opening it gives the store's own error.
            self.bad[row] = str(e).splitlines()[0] if str(e) else type(e).__name__
            summary = [row, f"(unreadable line {row + 1})", *[None] * (len(COLUMNS) - 2)]
        crc = zlib.crc32(raw)
        self.offsets.append(offset)
        self.lengths.append(len(raw))
        self.crcs.append(crc)
        self.rows.append(summary)
        return [offset, len(raw), crc, *summary]

    def _still_valid(self, size: int) -> bool:
        last = len(self.rows) - 1
        if self.offsets[last] + self.lengths[last] >= size:  # its newline is gone
            return False
        try:
            return zlib.crc32(self.line(last)) == self.crcs[last]
        except OSError:
            return False

    def _reset(self) -> None:
        self.generation += 1
        self.offsets, self.lengths, self.crcs, self.rows = [], [], [], []
        self.bad, self.end, self._cached = {}, 0, 0

    # --- the cache -----------------------------------------------------------------

    def _header(self) -> bytes:
        head = {"agentrl_view_index": INDEX_VERSION, "file": self.path.name, "columns": COLUMNS}
        return json.dumps(head).encode() + b"\n"

    def _cache_size(self) -> int:
        try:
            return self.cache.stat().st_size
        except OSError:
            return 0

    def _load_cache(self) -> None:
        """Read the cache rows after those already read (all of them on the first call,
        and again when another viewer wrote the cache anew)."""
        try:
            with self.cache.open("rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if self._cached and inode != self._inode:
                    self._reset()
                f.seek(self._cached)
                data = f.read()
        except OSError:
            return
        self._inode = inode
        if self._cached == 0:
            head, _, data = data.partition(b"\n")
            if head + b"\n" != self._header():
                self._remove_cache()  # another version's, or not ours
                return
            self._cached = len(head) + 1
        complete = data[: data.rfind(b"\n") + 1]
        for raw in complete.splitlines():
            try:
                offset, length, crc, *summary = json.loads(raw)
            except ValueError:
                break  # a torn row: the rest is indexed from the file again
            if offset < self.end:
                continue  # a row this viewer indexed itself
            self.offsets.append(offset)
            self.lengths.append(length)
            self.crcs.append(crc)
            self.rows.append(summary)
            self.end = offset + length + 1
        self._cached += len(complete)

    def _append_cache(self, entries: list[list[Any]]) -> None:
        if not entries or not self._writable:
            return
        body = b"".join(json.dumps(e).encode() + b"\n" for e in entries)
        try:
            if self._cached == 0:  # a new cache: written whole, then renamed into place
                atomic.write_bytes(self.cache, self._header() + body)
                self._cached = len(self._header()) + len(body)
                self._inode = self.cache.stat().st_ino
            else:
                with self.cache.open("ab") as f:
                    f.write(body)
                self._cached += len(body)
        except OSError as e:
            self._writable = False
            log.warning("cannot cache the index of %s beside it (%s): kept in memory", self.path, e)

    def _remove_cache(self) -> None:
        with contextlib.suppress(OSError):
            self.cache.unlink()
        self._cached = 0

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on the trajectory file itself (its writer takes none), so
        viewers of one run take turns at its cache."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
