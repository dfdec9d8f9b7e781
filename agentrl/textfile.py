"""Reading a file a person named: refused at once unless it is a regular file of text.

Every reader of user-named inputs (task files, instances files, train configs, rows,
trajectories) opens them through here, so a FIFO or device never blocks a read, a
folder or a 5 GB file never reaches a parser, and a file that is not UTF-8 is one line
naming the file instead of a traceback.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agentrl.errors import ConfigError

MAX_BYTES = 256 << 20
"""The largest config or row file read whole (256 MiB): beyond, it is surely a mistake."""


class UnreadableFile(ConfigError):
    """A named input cannot be read as text; `reason` and `line` say why and where."""

    def __init__(self, path: Path, reason: str, *, fix: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {reason}", fix=fix)
        self.path, self.reason, self.line = path, reason, line or 1


def regular_file(path: str | os.PathLike[str], *, what: str = "file") -> Path:
    """`path` if it names a regular file (links followed); else ConfigError saying what it is."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise UnreadableFile(p, f"{what} not found", fix="check the path") from None
    except OSError as e:
        raise UnreadableFile(p, f"cannot read ({e.strerror})", fix="check the path") from None
    if stat.S_ISDIR(mode):
        raise UnreadableFile(p, f"is a folder, not a {what}", fix=f"name the {what} itself")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else None
        kind = kind or ("a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special")
        raise UnreadableFile(
            p,
            f"is {kind}, not a regular file (refused: reading it could block forever)",
            fix=f"give a regular {what}",
        )
    return p


def read_text(path: str | os.PathLike[str], *, what: str = "file", limit: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file at `path`, at most `limit` bytes; else ConfigError."""
    p = regular_file(path, what=what)
    try:
        size = p.stat().st_size
        if size > limit:
            raise UnreadableFile(
                p,
                f"{size:,} bytes, over the {limit:,} a {what} may have",
                fix="split it, or check that this is the file you meant",
            )
        data = p.read_bytes()
    except OSError as e:
        raise UnreadableFile(p, f"cannot read ({e.strerror})", fix="check the path") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UnreadableFile(
            p,
            f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})",
            fix=f"save the {what} as UTF-8",
            line=line,
        ) from None
