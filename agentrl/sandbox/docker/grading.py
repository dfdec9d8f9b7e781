"""The grading copy of a container (`DockerSandbox.seal`): a new container from the task's
image, holding the agent's changes under the outputs and nothing else it changed
(`agentrl.sandbox.seal` says which and why).

The copy shares the agent's container's network namespace while that one runs, so a
service the agent left listening stays reachable on 127.0.0.1 as the harnesses grade it;
no agent process exists in the copy, and none can reach its files or processes.

Blocking engine calls; `DockerSandbox` runs them in a thread.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import stat
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from docker.errors import NotFound

from agentrl.errors import SandboxError
from agentrl.sandbox.base import Sealed
from agentrl.sandbox.docker.engine import ORIGIN, top
from agentrl.sandbox.docker.shell import PIDFILES
from agentrl.sandbox.seal import (
    GradeScope,
    drop_reason,
    executable_pth_lines,
    shadowed_module,
    within,
)

_KINDS = {0: "changed", 1: "added", 2: "deleted"}  # the engine's diff kinds
LISTED = 200
"""Paths listed by kind in the evidence; past that, a count."""
_SHADOWABLE = (
    "import sys, pkgutil; names = {m.name for m in pkgutil.iter_modules()}; "
    "print('\\n'.join(sorted(names | set(sys.stdlib_module_names))))"
)


ENGINE_PATHS = (
    *("/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/.dockerenv", "/sbin/docker-init"),
    *("/usr/sbin/docker-init", "/etc/mtab", "/dev", "/proc", "/sys"),
)
"""What the engine itself puts in every container (mount points): never the agent's."""


@dataclass(frozen=True)
class Change:
    path: str
    kind: str  # added, changed, deleted, replaced (a folder deleted and made again)
    is_dir: bool


def origin_and_changes(api: Any, container_id: str) -> tuple[str, list[Change], str | None]:
    """(the image the container's snapshot chain started from, what the container and its
    snapshots changed since that image, a note when only the engine's own diff could be
    read). Read from the overlay layers on this machine; elsewhere from `docker diff`."""
    info = api.inspect_container(container_id)
    engine = (*ENGINE_PATHS, *(m["Destination"] for m in info.get("Mounts") or []))
    origin, changes, note = _changes(api, info)
    mine = [
        c
        for c in changes
        if not any(within(c.path, p) for p in engine) and not c.path.startswith(PIDFILES)
    ]
    return origin, mine, note


def _changes(api: Any, info: dict[str, Any]) -> tuple[str, list[Change], str | None]:
    image = api.inspect_image(info["Image"])
    labels = image.get("Config", {}).get("Labels") or {}
    origin = labels.get(ORIGIN) or str(image["Id"])
    data = (info.get("GraphDriver") or {}).get("Data") or {}
    upper = str(data.get("UpperDir") or "")
    lowers = [d for d in str(data.get("LowerDir") or "").split(":") if d]
    overlay = "overlay" in str((info.get("GraphDriver") or {}).get("Name"))
    if overlay and upper and Path(upper).is_dir():
        own = len(image.get("RootFS", {}).get("Layers") or [])
        base = len(api.inspect_image(origin).get("RootFS", {}).get("Layers") or [])
        snapshot_layers = max(0, own - base) if origin != image["Id"] else 0
        # The engine's "-init" layer (mount points) sits right below the container's own.
        ours = snapshot_layers + (1 if lowers and lowers[0].endswith("-init/diff") else 0)
        layers = [Path(upper), *map(Path, lowers[:ours])]
        return origin, _layer_changes(layers, [Path(d) for d in lowers[ours:]]), None
    found = [
        Change(e["Path"], _KINDS.get(e["Kind"], "changed"), False)
        for e in api.diff(info["Id"]) or []
    ]
    note = "the engine's overlay layers are not readable here: changes read with `docker diff`"
    if origin != image["Id"]:
        note += ", those of earlier snapshots counted as the image's"
        origin = str(image["Id"])
    return origin, found, note


def _layer_changes(layers: list[Path], base: list[Path]) -> list[Change]:
    """What `layers` (the topmost first) change over the `base` layers, as one diff."""
    seen: dict[str, Change] = {}
    whited: set[str] = set()  # deleted by a higher layer: what lower layers say is moot
    hidden: list[str] = []  # folders a higher layer deleted or replaced whole
    for layer in layers:
        this_layer_hides: list[str] = []
        for folder, dirs, files in os.walk(layer):  # never follows a link the agent made
            for name in [*dirs, *files]:
                entry = Path(folder) / name
                path = "/" + entry.relative_to(layer).as_posix()
                if path in seen or path in whited or any(path.startswith(h + "/") for h in hidden):
                    continue
                st = entry.lstat()
                in_base = any(os.path.lexists(b / path[1:]) for b in base)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
                    this_layer_hides.append(path)
                    whited.add(path)
                    if in_base:
                        seen[path] = Change(path, "deleted", False)
                    continue
                is_dir = stat.S_ISDIR(st.st_mode)
                opaque = is_dir and _opaque(entry)
                if opaque:
                    this_layer_hides.append(path)
                kind = "replaced" if opaque and in_base else "changed" if in_base else "added"
                seen[path] = Change(path, kind, is_dir)
        hidden += this_layer_hides
    return sorted(seen.values(), key=lambda c: c.path)


def _opaque(entry: Path) -> bool:
    for attribute in ("trusted.overlay.opaque", "user.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(entry, attribute, follow_symlinks=False) == b"y":
                return True
    return False


@dataclass
class Carried:
    """The agent's changes under the outputs, read out of its container (a tar named from
    the root, not yet filtered), and what `deliver` needs to know of them."""

    archive: IO[bytes]
    changes: list[Change]
    roots: list[Change]

    def close(self) -> None:
        self.archive.close()


def collect(api: Any, agent_id: str, changes: list[Change], scope: GradeScope) -> Carried:
    """Read the agent's changes under the outputs out of its container (running or not).
    A folder that is new (or made again) is read whole; one that only holds changes is
    not read itself, its changed entries are."""
    whole: list[str] = []
    roots: list[Change] = []
    for change in changes:
        if not scope.covers(change.path) or any(change.path.startswith(w + "/") for w in whole):
            continue
        if change.is_dir and change.kind == "changed":
            continue
        roots.append(change)
        if change.is_dir:
            whole.append(change.path)
    buffer = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 (Carried owns it)
    with tarfile.open(fileobj=buffer, mode="w") as out:
        for change in roots:
            if change.kind != "deleted":
                _read(api, agent_id, change.path, out)
    buffer.seek(0)
    return Carried(buffer, changes, roots)


def collect_whole(api: Any, agent_id: str, changes: list[Change], paths: Iterable[str]) -> Carried:
    """Read each of `paths` whole out of the agent's container, changed or not (a separate
    verifier's artifacts: its image need not hold what the agent's did); one the
    container does not have is not carried, and the verifier's own stays."""
    roots: list[Change] = []
    buffer = tempfile.SpooledTemporaryFile(max_size=64 << 20)  # noqa: SIM115 (Carried owns it)
    with tarfile.open(fileobj=buffer, mode="w") as out:
        for path in paths:
            before = len(out.getmembers())
            _read(api, agent_id, path, out)
            if len(out.getmembers()) > before:
                roots.append(Change(path, "added", out.getmembers()[before].isdir()))
    buffer.seek(0)
    return Carried(buffer, changes, roots)


def deliver(
    api: Any, grader_id: str, carried: Carried, scope: GradeScope, notes: list[str]
) -> Sealed:
    """Put what `collect` read into the grading copy, less what `drop_reason` refuses; what
    was carried, left out and dropped, and why, as the evidence says it."""
    inside = [c for c in carried.changes if scope.covers(c.path)]
    outside = [c for c in carried.changes if not scope.covers(c.path)]
    shadowable = _shadowable(api, grader_id, scope, inside)
    existed = {c.path for c in carried.changes if c.kind in ("changed", "deleted")}
    dropped: list[str] = []
    with tempfile.SpooledTemporaryFile(max_size=64 << 20) as buffer:
        with (
            tarfile.open(fileobj=buffer, mode="w") as out,
            tarfile.open(fileobj=carried.archive, mode="r|") as archive,
        ):
            _filter(archive, out, scope, shadowable, existed, dropped)
        doomed = [c.path for c in carried.roots]
        if doomed:
            _exec(api, grader_id, ["rm", "-rf", "--", *doomed])
        buffer.seek(0)
        if any(c.kind != "deleted" for c in carried.roots):
            api.put_archive(grader_id, "/", buffer)
    cwd = posixpath.normpath(scope.cwd)  # the copy's workdir: the engine made it at create
    replaced = any(within(cwd, c.path) for c in carried.roots)  # removed above, maybe for good
    if replaced and _exec(api, grader_id, ["test", "-d", cwd], check=False)[0] != 0:
        # The agent deleted it (or made it a file): every exec starts there, so grading
        # could not run at all and the agent's damage would pass for the engine's.
        _exec(api, grader_id, ["rm", "-f", "--", cwd], check=False)
        _exec(api, grader_id, ["mkdir", "-p", "--", cwd])
        notes.append(f"the agent removed the working directory {cwd}: made again, empty")
    return Sealed(
        kept=_listed(inside),
        restored=_listed(outside),
        dropped=dropped[:LISTED] + _more(len(dropped)),
        notes=notes,
    )


def _read(api: Any, agent_id: str, path: str, out: tarfile.TarFile) -> None:
    """Add the agent's `path` (a file, link or folder) to `out`, named from the root."""
    try:
        stream, _ = api.get_archive(agent_id, path)
    except NotFound:  # gone since the diff was read (a process still writes)
        return
    with tempfile.SpooledTemporaryFile(max_size=16 << 20) as raw:
        for chunk in stream:
            raw.write(chunk)
        raw.seek(0)
        with tarfile.open(fileobj=raw, mode="r|") as archive:
            parent = posixpath.dirname(path)
            for member in archive:
                data = archive.extractfile(member) if member.isfile() else None
                member.name = posixpath.normpath(posixpath.join(parent, member.name)).lstrip("/")
                out.addfile(member, data)


def _filter(
    archive: tarfile.TarFile,
    out: tarfile.TarFile,
    scope: GradeScope,
    shadowable: list[str],
    existed: set[str],
    dropped: list[str],
) -> None:
    """Copy `archive` to `out` less what `drop_reason` refuses; an agent-written `.pth`
    loses its executable lines."""
    skipped: list[str] = []
    for member in archive:
        where = "/" + member.name
        if any(where.startswith(s + "/") for s in skipped):
            continue
        if scope.image is not None and (why := _unsafe(member, where, scope)):
            dropped.append(f"{where}: {why}")  # Harbor's verifier: tarfile's `data` filter
            continue
        why = drop_reason(
            where, scope, shadowable=shadowable, is_dir=member.isdir(), added=where not in existed
        )
        if why is not None:
            dropped.append(f"{where}: {why}")
            if member.isdir():
                skipped.append(where)
            continue
        data = archive.extractfile(member) if member.isfile() else None
        body = data.read() if data is not None else None
        if body is not None and where.endswith(".pth"):
            kept, lines = executable_pth_lines(body.decode(errors="surrogateescape"))
            if lines:
                dropped.append(f"{where}: executable .pth lines {lines[:3]}")
                body = kept.encode(errors="surrogateescape")
                member.size = len(body)
        out.addfile(member, io.BytesIO(body) if body is not None else None)


def _unsafe(member: tarfile.TarInfo, where: str, scope: GradeScope) -> str | None:
    """Why an artifact's entry does not reach a separate verifier, as tarfile's `data`
    filter decides for Harbor's: a device or pipe, a link out of its artifact; setuid and
    setgid bits are cleared on what does."""
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        return "not a file, folder or link"
    if member.issym() or member.islnk():
        base = posixpath.dirname(where) if member.issym() else "/"
        target = posixpath.normpath(posixpath.join(base, member.linkname))
        root = next((o for o in scope.outputs if within(where, o)), None)
        if root is None or not within(target, root):
            return f"a link out of its artifact (to {member.linkname})"
    member.mode &= ~0o6000
    return None


def leftovers(api: Any, container_id: str, spare: set[int]) -> list[str]:
    """Command lines of the processes the agent left running in its (running) container,
    not in `spare`: docker-init, the keep-alive, its tools' shells."""
    return [args for pid, _, args in top(api, container_id) if pid not in spare]


def _shadowable(api: Any, grader_id: str, scope: GradeScope, changes: list[Change]) -> list[str]:
    """The image's top-level module names, if the agent added a module to the cwd."""
    cwd = posixpath.normpath(scope.cwd)
    if not any(
        shadowed_module(posixpath.dirname(c.path), posixpath.basename(c.path), cwd, c.is_dir)
        for c in changes
        if c.kind in ("added", "replaced")
    ):
        return []
    code, output = _exec(api, grader_id, ["python3", "-I", "-c", _SHADOWABLE], check=False)
    return output.split() if code == 0 else []


def _exec(api: Any, container_id: str, argv: list[str], *, check: bool = True) -> tuple[int, str]:
    made = api.exec_create(container_id, argv, user="root", workdir="/")
    output = api.exec_start(made["Id"]).decode(errors="replace")
    code = int(api.exec_inspect(made["Id"])["ExitCode"] or 0)
    if check and code != 0:
        raise SandboxError(f"grading copy {container_id[:12]}: {argv[:3]} failed: {output[:200]}")
    return code, output


def _listed(changes: list[Change]) -> list[str]:
    """'path (kind)' of each change, less folders that only hold changes."""
    listed = [c for c in changes if not (c.is_dir and c.kind == "changed")]
    return [f"{c.path} ({c.kind})" for c in listed[:LISTED]] + _more(len(listed))


def _more(count: int) -> list[str]:
    return [f"... and {count - LISTED} more"] if count > LISTED else []
