"""Writing a file or a folder whole or not at all.

Everything is written beside its destination under a temporary name and renamed onto
it in one `rename`, so a reader sees the old version or the new one, never half of
either; a writer that fails removes what it wrote. `durable` adds the fsyncs that make
the new version survive a power cut too (the files, the folder, then its parent).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


def write_bytes(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Replace `path` with `data` in one rename."""
    with atomic_file(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace `path` with the UTF-8 `text` in one rename."""
    write_bytes(path, text.encode("utf-8"), durable=durable)


@contextlib.contextmanager
def atomic_file(path: Path, *, durable: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` to write (its name ends in no suffix a reader
    globs for); renamed onto `path` when the block ends, removed if it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield tmp
        if durable:
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_folder(out: Path, *, replace: bool = False, durable: bool = False) -> Iterator[Path]:
    """A fresh temporary folder beside `out` to fill; published as `out` when the block
    ends (see `publish_folder`), removed if it raises. `durable`: every file in it is
    fsynced first."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if durable:
            for folder, _, files in os.walk(tmp):
                for name in files:
                    with (Path(folder) / name).open("rb") as f:
                        os.fsync(f.fileno())
                fsync_dir(Path(folder))
        publish_folder(tmp, out, replace=replace, durable=durable)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once published


def publish_folder(tmp: Path, out: Path, *, replace: bool = False, durable: bool = False) -> None:
    """Rename the complete folder `tmp` to `out`: onto nothing or an empty folder, or,
    with `replace`, onto an old `out` (moved aside as `<out>.tmp-old-<pid>`, then
    removed). `durable`: `tmp` is fsynced before the rename and the parent after; its
    files must already be."""
    if durable:
        fsync_dir(tmp)
    if replace and out.exists():
        old = out.with_name(f"{out.name}.tmp-old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
    if durable:
        fsync_dir(out.parent)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
