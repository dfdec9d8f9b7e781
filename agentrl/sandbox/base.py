"""The sandbox seam: a provider starts sandboxes, a sandbox runs things, and a shell is
one interactive process inside a sandbox.

Every sandbox can `exec`, `read_file`, `write_file` and `close`; the rest are abilities
its provider declares in `Capabilities` (an image, a shell, snapshots, a grading copy, a
network, usage read from the host, mounts), and callers ask those, never a provider's
name. A sandbox or provider class that subclasses `Sandbox` or `SandboxProvider` and
lacks an ability inherits its answer here: a refusal that says so (`Unsupported`), or,
where grading goes on without it, a no-op. Everything that crosses this seam is a
pydantic model (picklable config and request/response records) or bytes; live objects
(containers, sockets, ptys) stay inside the implementation. Implementations: `docker`,
`local`, and any `module:Class` (`agentrl.sandbox.config`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from agentrl.cache import cache_root
from agentrl.errors import Unsupported
from agentrl.sandbox.seal import GradeScope

log = logging.getLogger(__name__)


def snapshots_root() -> Path:
    """Where snapshots' files and records live: `$AGENTRL_CACHE/snapshots`."""
    return cache_root() / "snapshots"


def _resumable_record(run_id: str) -> Path:
    name = hashlib.sha256(run_id.encode()).hexdigest()[:32]
    return snapshots_root() / "resumable-runs" / name


def record_resumable(run_id: str, journal: Path) -> None:
    """Record that `run_id`, killed, can go on from its snapshots (`--resume`) as long as
    its journal of episodes in flight is there: `gc --snapshots` keeps them until then."""
    record = _resumable_record(run_id)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"run": run_id, "journal": str(journal.resolve())}))
    except OSError as exc:
        log.warning("could not record %s as resumable in %s: %s", run_id, record, exc)


def resumable(run_id: str) -> bool:
    """Whether a journal `run_id` recorded still offers its episodes in flight a resume
    from its snapshots (the run finished, or its folder was removed: no longer)."""
    record = _resumable_record(run_id)
    try:
        journal = Path(json.loads(record.read_text())["journal"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if journal.is_file():
        return True
    record.unlink(missing_ok=True)
    return False


OUTPUT_KEEP_BYTES = 1 << 20
"""`exec` keeps this many bytes of output from the start and as many from the end."""
ELISION = "\n[... {n} bytes elided ...]\n"
FORCED_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "GIT_EDITOR": "true"}
"""Set in every sandbox (over `SandboxSpec.env`), so no command waits in a pager or editor."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxSpec(_Model):
    """How to start one sandbox (picklable; crosses process boundaries)."""

    image: str = Field(default="agentrl/base:bookworm", description="image (docker) to start")
    workdir: str = Field(default="/workspace", description="working directory inside")
    cpus: float = Field(default=1.0, gt=0, description="CPU limit (cores)")
    memory_mb: int = Field(default=1024, ge=16, description="memory limit (MiB), swap included")
    pids: int = Field(default=256, ge=8, description="process limit (stops fork bombs)")
    disk_mb: int = Field(
        default=10240,
        ge=16,
        description="disk limit (MiB) on what the sandbox writes; the engine's quota where its "
        "storage driver has one, else a watchdog (see docs/sandboxes.md)",
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment")
    ttl_seconds: int = Field(
        default=4 * 3600, ge=10, description="the sandbox ends itself after this, driver or not"
    )
    run_id: str = Field(default="adhoc", description="labels the sandbox agentrl.run=<run_id>")
    name: str | None = Field(default=None, description="e.g. the trajectory id, for labels")
    node: str | None = Field(
        default=None, description="the cluster node it runs on (null: this machine); a label"
    )
    mounts: dict[str, str] = Field(
        default_factory=dict,
        description="host folder -> sandbox path, mounted read-only (docker): how a harness "
        "inside a sandbox with no network reaches the agent gateway's Unix socket",
    )


class ExecRequest(_Model):
    """One command to run to completion (not through the persistent shell)."""

    command: str | list[str] = Field(description="a shell string (run by bash -c) or argv")
    timeout: float = Field(default=60.0, gt=0, description="seconds before it is killed")
    workdir: str | None = Field(default=None, description="default: the sandbox workdir")
    env: dict[str, str] = Field(default_factory=dict)


class ExecResult(_Model):
    exit_code: int | None = Field(description="None when killed by the timeout")
    output: str = Field(description="stdout and stderr interleaved, decoded as UTF-8")
    timed_out: bool = False
    seconds: float = 0.0


class Sealed(_Model):
    """What `Sandbox.seal` did so that nothing the agent left behind but its outputs can
    touch the grade (`agentrl.sandbox.seal`)."""

    stopped: list[str] = Field(
        default_factory=list, description="processes stopped, as 'pid command line'"
    )
    restored: list[str] = Field(
        default_factory=list,
        description="what the agent changed outside the task's outputs, graded as the image "
        "has it, as 'path (added|changed|deleted|replaced)'",
    )
    kept: list[str] = Field(
        default_factory=list,
        description="what the agent changed inside the outputs, carried into grading as it "
        "left it, as 'path (kind)'",
    )
    dropped: list[str] = Field(
        default_factory=list,
        description="changes inside the outputs not carried, because the grader's own process "
        "would run or read them, as 'path: why'",
    )
    notes: list[str] = Field(default_factory=list, description="anything a person should know")


class Usage(_Model):
    """How much of its limits a sandbox uses, read from the host (nothing runs inside it,
    so it can be read even when a fork bomb holds every pid); None: not known here."""

    processes: int | None = Field(
        default=None, description="processes and threads now, as the pids limit counts them"
    )
    pids_refused: int | None = Field(
        default=None, description="forks refused at the pids limit so far (a counter)"
    )
    oom_kills: int | None = Field(
        default=None, description="processes the OOM killer stopped so far (a counter)"
    )
    disk_bytes: int | None = Field(
        default=None, description="bytes of the files the sandbox wrote (its writable layer)"
    )


class HeadTail:
    """Keeps the first and last `keep` bytes of a stream, so huge output costs bounded memory."""

    def __init__(self, keep: int = OUTPUT_KEEP_BYTES) -> None:
        self.keep = keep
        self.total = 0
        self._head = bytearray()
        self._tail = bytearray()

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        self._tail += data
        if len(self._tail) > 2 * self.keep:  # trim in batches: amortized O(1) per byte
            del self._tail[: len(self._tail) - self.keep]

    def text(self) -> str:
        """Decoded as UTF-8 (errors replaced), with a marker where bytes were dropped."""
        tail = bytes(self._tail[-self.keep :]) if self._tail else b""
        elided = self.total - len(self._head) - len(tail)
        if elided <= 0:
            return (bytes(self._head) + tail).decode(errors="replace")
        marker = ELISION.format(n=elided)
        return bytes(self._head).decode(errors="replace") + marker + tail.decode(errors="replace")


class Shell(Protocol):
    """An interactive process in a sandbox, on a pty (echo on, 200 columns): bytes in, bytes
    out. `send` and `read` block (call them from a thread); `close` is idempotent."""

    def send(self, data: bytes) -> None: ...

    def read(self, timeout: float) -> bytes:
        """What it wrote next (up to 64 KiB), waiting up to `timeout` s: b"" if nothing came.
        Raises EOFError once it has exited and everything it wrote was read."""
        ...

    def alive(self) -> bool: ...

    async def close(self) -> None:
        """Kill it and every process it started (its session); a wedged shell is replaced
        by `close()` then `Sandbox.shell(argv)`."""
        ...


class Capabilities(BaseModel):
    """What a provider's sandboxes can do besides exec, read, write and close. Callers ask
    these, never the provider's name; each ability left False is refused (`Unsupported`)
    or skipped, as the member it names says."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    images: bool = Field(
        default=False,
        description="starts each sandbox from `spec.image`: INIT builds a task's recipe "
        "into one, importers start an instance's own image, an image's working directory "
        "is the task's; False: the image is ignored (the local provider)",
    )
    shell: bool = Field(
        default=False,
        description="`Sandbox.shell`: an interactive process on a pty (the bash tool's "
        "persistent shell)",
    )
    snapshots: bool = Field(
        default=False,
        description="`Sandbox.snapshot` and the provider's `restore`, `snapshot_bytes`, "
        "`remove_snapshot`: replay points, branch credit, agentrl replay",
    )
    grading_copy: bool = Field(
        default=False,
        description="`keep_init` and `seal` make the sandbox its grading copy (the image or "
        "INIT's commit plus the agent's outputs, no agent process); False: the grader sees "
        "the sandbox as the agent left it",
    )
    network: bool = Field(
        default=False,
        description="`connect_network` gives it a named network, for the agent's turns (a "
        "task's `sandbox.network`) or for grading (`grader.network`)",
    )
    metered: bool = Field(
        default=False,
        description="its sandboxes are `Metered`: the host reads their usage and stops their "
        "processes (the bash tool's watchdog)",
    )
    mounts: bool = Field(
        default=False,
        description="honours `spec.mounts` (host folders, read-only): how a harness inside "
        "the sandbox reaches the agent gateway's socket",
    )


class Sandbox(Protocol):
    """A running sandbox. `id`, `spec`, `exec`, `read_file`, `write_file` and `close`
    (idempotent; it always removes the sandbox) are what every sandbox does; the members
    after them are abilities its provider's `Capabilities` name, and a class subclassing
    `Sandbox` inherits the answer below for each one it lacks."""

    @property
    def id(self) -> str: ...

    @property
    def spec(self) -> SandboxSpec: ...

    async def exec(self, request: ExecRequest) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    async def close(self) -> None: ...

    async def shell(self, argv: list[str]) -> Shell:
        """Start `argv` as an interactive process in the workdir; closing the sandbox closes
        it (capability `shell`)."""
        raise Unsupported(
            f"sandbox {self.id}: its provider has no interactive shell (capability `shell`)",
            fix="give the task tools that need none (str_replace_editor, finish), or use a "
            "provider that has one (docker, local)",
        )

    async def snapshot(self, label: str) -> str:
        """Freeze the sandbox's filesystem; returns an id that `provider.restore` takes
        (capability `snapshots`)."""
        raise Unsupported(
            f"sandbox {self.id}: its provider cannot snapshot (capability `snapshots`)",
            fix="set the task's snapshots.every to 0, or use a provider that can (docker, local)",
        )

    async def keep_init(self, scope: GradeScope) -> None:
        """At the end of INIT: what the sandbox holds now outside `scope`'s outputs (the
        task's files, its setup's work) is what the grading copy holds there, whatever the
        agent does to it (capability `grading_copy`; without one, nothing to keep)."""
        return

    async def seal(self, scope: GradeScope) -> Sealed:
        """Before grading: from now on the sandbox is its grading copy, holding only the
        agent's changes under `scope`'s outputs (`agentrl.sandbox.seal`); no agent process
        can act on the copy's files or processes (capability `grading_copy`; without one,
        a note that the grader saw the sandbox as the agent left it)."""
        return Sealed(
            notes=[
                "the sandbox provider makes no grading copy: the grader saw the sandbox as "
                "the agent left it, its processes included"
            ]
        )

    async def connect_network(self, name: str) -> None:
        """Give the sandbox the network `name` (Docker's), from now on (capability
        `network`)."""
        raise Unsupported(
            f"sandbox {self.id}: its provider cannot connect the network {name!r} "
            "(capability `network`)",
            fix="unset $AGENTRL_AGENT_NETWORK and $AGENTRL_EVAL_NETWORK, or use the docker "
            "provider",
        )


@runtime_checkable
class Metered(Protocol):
    """A sandbox whose use of its limits the host can read and whose processes it can stop
    (capability `metered`: docker and local; the bash tool uses it to keep one command
    from starving the next)."""

    async def usage(self) -> Usage: ...

    async def stop_processes(self) -> list[str]:
        """Stop every process but the sandbox's own (init, keep-alive), as `seal` does
        first; 'pid command line' of each."""
        ...


class SandboxProvider(Protocol):
    """Starts sandboxes of one kind and says what they can do. `start` is what every
    provider does; the members after it follow its `Capabilities`, and a class
    subclassing `SandboxProvider` inherits the answer below for each one it lacks."""

    name: str
    """How trajectories record it (`env.provider`) and what builds it again: `docker`,
    `local` or its `module:Class` (set by its config's `build`)."""
    capabilities: Capabilities

    async def start(self, spec: SandboxSpec) -> Sandbox: ...

    async def restore(self, snapshot_id: str, spec: SandboxSpec) -> Sandbox:
        """A new sandbox from a snapshot id (capability `snapshots`)."""
        raise Unsupported(
            f"sandbox provider {self.name!r} cannot restore snapshot {snapshot_id!r} "
            "(capability `snapshots`)",
            fix="replay and branch credit need a provider that snapshots (docker, local)",
        )

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        """Disk a snapshot takes beyond what it was made from (0 if it is gone)."""
        return 0

    async def remove_snapshot(self, snapshot_id: str) -> int:
        """Delete a snapshot; returns the bytes freed (0 if it was already gone)."""
        return 0

    async def snapshots_named(self, run_id: str, name: str) -> list[str]:
        """The snapshots of run `run_id` that sandboxes named `name` committed and that are
        still here, newest first: how a resumed episode finds a commit that landed after
        its process was killed, unrecorded ([] where the provider cannot tell)."""
        return []

    def end_run(self, run_id: str) -> None:
        """At the end of run `run_id`: remove whatever of it a crash may have left (docker:
        the run's containers); blocking, idempotent."""
        return
