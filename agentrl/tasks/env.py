# Over 400 lines: the base every task format overrides; its hooks read beside their defaults.
"""A task's INIT and EVAL stages: start and prepare a sandbox; later, grade it.

INIT resolves the image (named, or built from the task's recipe folder once per recipe
hash), starts a sandbox with the task's limits, copies `sandbox.files` in and runs the
setup commands. EVAL first seals the sandbox (every process the agent left is stopped,
protected paths are put back as the image has them: `agentrl.sandbox.seal`), then
copies `grader.files` in (only then, so the agent never saw them; root's, not writable
by others) and grades. Tests that cannot run after the agent's changes (a missing runner,
a crash, a collection error, nothing parsed, a timeout) are referred to where they should
run: a sandbox of the same instance with the task's reference solution (an untouched one
if the task has none), once per instance. If they run there, the agent's changes stopped
them (reward 0); if not, the grader cannot run its tests here (eval_error). Paths in the
spec are relative to `task.base_dir`.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agentrl.errors import ConfigError, GraderError, SandboxError, one_line
from agentrl.sandbox.base import ExecRequest, Sandbox, SandboxProvider, SandboxSpec
from agentrl.sandbox.images import build_recipe, folder_hash, repo_slug
from agentrl.sandbox.seal import GradeScope, scope_for, within
from agentrl.tasks.evidence import DidNotRun, Grade
from agentrl.tasks.graders import fill, grade
from agentrl.tasks.spec import DEFAULT_IMAGE, Instance, Task
from agentrl.tools.base import Tool, tool_class

SETUP_TIMEOUT_S = 600.0
"""Seconds each setup command may take."""
EVAL_NETWORK = "AGENTRL_EVAL_NETWORK"
"""Names the Docker network that grading may use (tasks whose grader allows it)."""
AGENT_NETWORK = "AGENTRL_AGENT_NETWORK"
"""Names the Docker network the agent's turns may use (tasks whose sandbox asks for one)."""


@dataclass(frozen=True)
class Opening:
    """How an environment opens an episode after INIT: its first observation (after the
    instance prompt) and the tools its actions are."""

    text: str
    tools: dict[str, Tool]


class EpisodeEnv(Protocol):
    """Where one task's episodes get their sandboxes and tools, and are graded."""

    task: Task
    run_id: str

    @property
    def provider_name(self) -> str:
        """The sandbox provider, as a trajectory's `env.provider` records it."""
        ...

    @property
    def can_snapshot(self) -> bool:
        """Whether its sandboxes can be committed and restored (replay points, branches)."""
        ...

    def tools(self) -> dict[str, Tool]:
        """A fresh set of the task's tools for one episode (they act on its sandbox)."""
        ...

    async def image(self) -> str: ...

    async def init(self, instance: Instance, name: str) -> Sandbox: ...

    async def opening(self, sandbox: Sandbox, instance: Instance) -> Opening | None:
        """The episode's opening where the sandbox is an environment that gives one (the
        chat then starts from it); None: the task's prompt and tools as they are."""
        ...

    async def evaluate(self, sandbox: Sandbox, instance: Instance) -> Grade: ...

    async def restore(self, instance: Instance, snapshot_id: str, name: str) -> Sandbox: ...

    async def snapshot_bytes(self, snapshot_id: str) -> int: ...

    async def remove_snapshot(self, snapshot_id: str) -> int: ...

    async def snapshots_named(self, name: str) -> list[str]: ...


def build_tools(task: Task) -> dict[str, Tool]:
    """The task's tools, by name, with its options (bash takes the task's tool timeout)."""
    tools: dict[str, Tool] = {}
    for config in task.spec.tool_configs():
        options = dict(config.options)
        if config.name == "bash":
            options.setdefault("timeout", task.spec.limits.tool_timeout)
        tool = tool_class(config.name)(**options)
        tools[tool.name] = tool
    return tools


class TaskEnv:
    """Starts, prepares and grades the sandboxes of one task's episodes, in this process.

    The base class of every task format's runtime (a task's `env:` names one). A format
    overrides only these hooks, and the rest stays as it is: `resolve_image` (the task's
    image), `instance_image` (an image per instance), `spec` (the sandbox an instance
    starts in), `grade_scope` (what the grader examines of a workdir), `grade` (the
    grader, in the grading copy) and `run_oracle` (the reference solution)."""

    def __init__(self, task: Task, provider: SandboxProvider, run_id: str) -> None:
        self.task = task
        self.provider = provider
        self.run_id = run_id
        self._image: str | None = None
        self.standin: str | None = None
        """The registry image the task's image is built on an agentrl stand-in for."""
        self._image_lock = asyncio.Lock()
        self._references: dict[str, tuple[str, Grade | GraderError]] = {}
        self._reference_locks: dict[str, asyncio.Lock] = {}
        self._scopes: dict[str, GradeScope] = {}
        self.mounts: Callable[[], dict[str, str]] = dict
        """Host folders the episodes' player needs in the sandbox, host path -> path in
        it (the agent gateway's socket, for a harness inside): set by whoever plays
        (`agentrl.episode.factory.make_env`), read when a sandbox starts."""

    @property
    def provider_name(self) -> str:
        return self.provider.name

    @property
    def can_snapshot(self) -> bool:
        return self.provider.capabilities.snapshots

    def tools(self) -> dict[str, Tool]:
        return build_tools(self.task)

    async def snapshot_bytes(self, snapshot_id: str) -> int:
        return await self.provider.snapshot_bytes(snapshot_id)

    async def remove_snapshot(self, snapshot_id: str) -> int:
        return await self.provider.remove_snapshot(snapshot_id)

    async def snapshots_named(self, name: str) -> list[str]:
        """This run's snapshots of sandboxes named `name`, newest first (the provider's)."""
        return await self.provider.snapshots_named(self.run_id, name)

    async def opening(self, sandbox: Sandbox, instance: Instance) -> Opening | None:
        return None

    @property
    def has_reference(self) -> bool:
        """Whether the format has a reference solution (`run_oracle`) for `agentrl check`."""
        return True

    async def image(self) -> str:
        """The image to start: named by the spec, or built from its recipe (once)."""
        async with self._image_lock:
            if self._image is None:
                self._image = await self.resolve_image()
            return self._image

    async def instance_image(self, instance: Instance) -> str:
        """The image `instance` starts from; importers with an image per instance override it."""
        return await self.image()

    async def spec(self, instance: Instance, name: str) -> SandboxSpec:
        """The sandbox `instance`'s episodes start in: its image, the task's limits."""
        config = self.task.spec.sandbox
        return SandboxSpec(
            image=await self.instance_image(instance),
            workdir=config.workdir,
            cpus=config.cpus,
            memory_mb=config.memory_mb,
            pids=config.pids,
            disk_mb=config.disk_mb,
            env=config.env,
            run_id=self.run_id,
            name=name,
            mounts=self._mounts(),
        )

    def _mounts(self) -> dict[str, str]:
        """What the player asks the sandbox to mount (`mounts`), where the provider can."""
        if not self.provider.capabilities.mounts:
            return {}
        return self.mounts()

    async def restore(self, instance: Instance, snapshot_id: str, name: str) -> Sandbox:
        """A sandbox as a snapshot of one of `instance`'s episodes left it."""
        return await self.provider.restore(snapshot_id, await self.spec(instance, name))

    async def init(self, instance: Instance, name: str) -> Sandbox:
        """A started sandbox with the task's files and setup in place, tests nowhere in it."""
        config = self.task.spec.sandbox
        sandbox = await self.provider.start(await self.spec(instance, name))
        try:
            network = self.agent_network()
            if network is not None:  # before setup: the harnesses build with a network
                await sandbox.connect_network(network)
            for dest, source in config.files.items():
                await put_path(sandbox, self._local(source), dest)
            for template in config.setup:
                command = fill(template, instance)
                done = await sandbox.exec(ExecRequest(command=command, timeout=SETUP_TIMEOUT_S))
                if done.exit_code != 0:
                    how = "timed out" if done.timed_out else f"exited {done.exit_code}"
                    raise SandboxError(
                        f"setup command {_one_line(command, 120)!r} {how}: "
                        f"{_one_line(done.output, 300, tail=True)}",
                        fix=f"fix the setup commands of {self.task.path}",
                    )
            await sandbox.keep_init(self.scope(sandbox))  # the grader sees INIT's work
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    def scope(self, sandbox: Sandbox) -> GradeScope:
        """What the grader examines (`agentrl.sandbox.seal`), read from the task's files
        once per workdir; grading online if it may."""
        scope = self.scope_at(sandbox.spec.workdir)
        return scope.model_copy(update={"network": self.eval_network()})

    def scope_at(self, workdir: str) -> GradeScope:
        """`grade_scope(workdir)`, read once per workdir."""
        if workdir not in self._scopes:
            self._scopes[workdir] = self.grade_scope(workdir)
        return self._scopes[workdir]

    def grade_scope(self, workdir: str) -> GradeScope:
        """The workdir, the task's declared outputs and the paths its grader's files name."""
        grader = self.task.spec.grader
        texts: list[str] = [getattr(grader, "command", "") or ""]
        folders, starts = [], []
        for dest, source in grader.files.items():
            local, where = self._local(source), _absolute(dest, workdir)
            files = sorted(local.rglob("*")) if local.is_dir() else [local]
            texts += [_text(p) for p in files if p.is_file()]
            folders += [where] if local.is_dir() else []
            starts.append(where if local.is_dir() else posixpath.dirname(where))
        scope = scope_for(workdir, grader.outputs, texts, folders)
        return scope.model_copy(update={"lookup": tuple(starts)})

    async def evaluate(self, sandbox: Sandbox, instance: Instance) -> Grade:
        """Seal the sandbox, then grade it; GraderError (eval_error) if it cannot be graded."""
        sealed = await sandbox.seal(self.scope(sandbox))
        try:
            graded = await self.grade(sandbox, instance)
        except DidNotRun as failed:
            failed.evidence.sealed = sealed
            graded = await self._referred(instance, failed)
        graded.evidence.sealed = sealed
        return graded

    def agent_network(self) -> str | None:
        """The Docker network the agent's turns get ($AGENTRL_AGENT_NETWORK), if the task
        asks for one; None: they have none."""
        name = os.environ.get(AGENT_NETWORK)
        return name if name and self.task.spec.sandbox.network else None

    def image_notes(self) -> list[str]:
        """What a person should know about the image the task ran on."""
        if self.standin is None:
            return []
        return [
            f"built on agentrl's stand-in for {self.standin} (sandboxes/standins/: the "
            "registry image could not be pulled here); a result on the real image may differ"
        ]

    def missing_network(self) -> str | None:
        """What a person should know when the task asks for a network it does not get."""
        if not self.task.spec.sandbox.network or self.agent_network() is not None:
            return None
        return (
            "the task's agent needs a network (to install packages, say) and has none: name "
            f"a Docker network in ${AGENT_NETWORK} (e.g. one that reaches only your package "
            "registry) to give it one"
        )

    def eval_network(self) -> str | None:
        """The Docker network grading gets ($AGENTRL_EVAL_NETWORK), if the task's grader may
        use one; None: grading has no network, as the agent's turns never do."""
        name = os.environ.get(EVAL_NETWORK)
        return name if name and self.task.spec.grader.network else None

    async def go_online(self, sandbox: Sandbox) -> list[str]:
        """Connect the eval network, if any; the note that says so, for the evidence."""
        network = self.eval_network()
        if network is None:
            return []
        await sandbox.connect_network(network)
        return [f"grading had the network {network} (${EVAL_NETWORK}); the agent's turns had none"]

    async def grade(self, sandbox: Sandbox, instance: Instance) -> Grade:
        """Copy the grader's files in, then run the grader (no sealing: see `evaluate`)."""
        online = await self.go_online(sandbox)
        try:
            graded = await self._grade_here(sandbox, instance)
        except DidNotRun as failed:
            failed.evidence.notes[:0] = online
            raise
        graded.evidence.notes[:0] = online
        return graded

    async def _grade_here(self, sandbox: Sandbox, instance: Instance) -> Grade:
        grader = self.task.spec.grader
        folders = [d for d, s in grader.files.items() if self._local(s).is_dir()]
        workdir = sandbox.spec.workdir
        # A folder outside the workdir (/tests) replaces whatever the agent left there (a
        # planted conftest.py); inside the workdir it merges, so the project keeps its files.
        doomed = [
            path
            for path in (_absolute(d, workdir) for d in folders)
            if not within(workdir, path) and not within(path, workdir)
        ]
        if doomed:
            await sandbox.exec(ExecRequest(command=["rm", "-rf", "--", *doomed], timeout=60))
        for dest, source in grader.files.items():
            await put_path(sandbox, self._local(source), dest, readonly=True)
        return await grade(self.task, instance, sandbox)

    async def run_oracle(self, sandbox: Sandbox, instance: Instance) -> str:
        """Run the task's reference solution (`oracle:` commands) in the sandbox; its output."""
        if not self.task.spec.oracle:
            raise ConfigError(
                f"{self.task.path}: no reference solution",
                fix="add `oracle:` (shell commands that solve an instance) to the task",
            )
        outputs = []
        for template in self.task.spec.oracle:
            command = fill(template, instance)
            done = await sandbox.exec(ExecRequest(command=command, timeout=SETUP_TIMEOUT_S))
            outputs.append(done.output)
            if done.exit_code != 0:
                raise SandboxError(
                    f"oracle command {_one_line(command, 120)!r} exited {done.exit_code}: "
                    f"{_one_line(done.output, 300, tail=True)}",
                    fix=f"fix the oracle of {self.task.path}",
                )
        return "".join(outputs)

    async def reference(self, instance: Instance) -> tuple[str, Grade | GraderError]:
        """Where the tests of `instance` should run: a sandbox with the task's reference
        solution (a fresh one if the task has none), graded; or why it could not be.
        (where, result), made once per instance and kept."""
        async with self._reference_locks.setdefault(instance.id, asyncio.Lock()):
            if instance.id not in self._references:
                sandbox = await self.init(instance, name=f"{instance.id}-reference")
                where = "with the reference solution"
                try:
                    try:
                        await self.run_oracle(sandbox, instance)
                    except ConfigError:  # the task has no reference solution
                        where = "in an untouched sandbox"
                    result: Grade | GraderError = await self.grade(sandbox, instance)
                except GraderError as e:  # DidNotRun too
                    result = e
                except SandboxError as e:  # the reference solution itself failed
                    result = GraderError(f"the reference solution failed: {e}", fix=e.fix)
                finally:
                    await sandbox.close()
                self._references[instance.id] = (where, result)
            return self._references[instance.id]

    async def _referred(self, instance: Instance, failed: DidNotRun) -> Grade:
        """Decide whose fault `failed` is: if the tests run where they should (the reference
        solution's sandbox), the agent's changes stopped them (reward 0); if not, they
        cannot run here at all (DidNotRun, an eval_error)."""
        try:
            where, reference = await self.reference(instance)
        except SandboxError as e:  # not kept: the next failure asks again
            where, reference = "in a reference sandbox", GraderError(f"it did not start: {e}")
        evidence = failed.evidence
        if isinstance(reference, GraderError):
            evidence.reference = f"{where} the tests did not run either: {reference}"
            same = str(reference) == str(failed)
            raise DidNotRun(
                f"{failed} ({where} too{'' if same else f': {reference}'})",
                evidence,
                fix=failed.fix or reference.fix or f"run `agentrl check {self.task.path}`",
            )
        evidence.reference = (
            f"{where} the tests ran (reward {reference.reward:g}, {_brief(reference)}): "
            "the agent's changes stopped them, so the reward is 0"
        )
        evidence.notes.append(f"after the agent's changes: {failed}")
        components = {"exit_code": evidence.exit_code, "tests_ran": False}
        return Grade(reward=0.0, components=components, evidence=evidence, seconds=0.0)

    def _local(self, relative: str) -> Path:
        path = Path(self.task.base_dir) / relative
        if not path.exists():
            raise ConfigError(
                f"{self.task.path}: {relative} does not exist in {self.task.base_dir}",
                fix="fix the path (it is relative to the task file)",
            )
        return path

    async def resolve_image(self) -> str:
        config = self.task.spec.sandbox
        if config.image or not config.recipe:
            return config.image or DEFAULT_IMAGE
        if not self.provider.capabilities.images:  # e.g. the local provider
            return DEFAULT_IMAGE
        folder = self._local(config.recipe)
        tag = f"agentrl/task-{repo_slug(self.task.spec.name, 'task')}:{folder_hash(folder)}"
        info = await asyncio.to_thread(build_recipe, folder, tag)
        self.standin = info.standin
        return info.tag


async def put_path(sandbox: Sandbox, source: Path, dest: str, *, readonly: bool = False) -> int:
    """Copy a file or a folder (binary-safe, modes kept) to `dest`; returns the files copied.

    `readonly`: nobody but the owner (root, who copies them) may write the files."""
    mask = 0o755 if readonly else 0o777
    if source.is_file():
        await sandbox.write_file(dest, source.read_bytes(), mode=source.stat().st_mode & mask)
        return 1
    entries = sorted(source.rglob("*"))
    folders = [
        posixpath.join(dest, p.relative_to(source).as_posix()) for p in entries if p.is_dir()
    ]
    made = await sandbox.exec(ExecRequest(command=["mkdir", "-p", dest, *folders], timeout=60))
    if made.exit_code != 0:
        raise SandboxError(f"cannot create {dest} in the sandbox: {_one_line(made.output, 200)}")
    files = [p for p in entries if p.is_file()]
    for path in files:
        target = posixpath.join(dest, path.relative_to(source).as_posix())
        await sandbox.write_file(target, path.read_bytes(), mode=path.stat().st_mode & mask)
    return len(files)


def _text(path: Path, limit: int = 1 << 20) -> str:
    """A grader file's text, for the paths it names (a binary or huge file names none)."""
    if path.stat().st_size > limit:
        return ""
    data = path.read_bytes()
    return "" if b"\0" in data else data.decode(errors="replace")


def _brief(graded: Grade) -> str:
    tests = graded.evidence.tests
    if tests:
        return f"{len(tests)} tests parsed"
    return f"exit code {graded.evidence.exit_code}"


def _absolute(path: str, workdir: str) -> str:
    return posixpath.normpath(posixpath.join(workdir, path))


def _one_line(text: str, chars: int, *, tail: bool = False) -> str:
    """A command or its output as a message shows it: lines joined by ` | `, `chars` of a
    longer one kept (then `...`)."""
    return one_line(text, chars + 3, sep=" | ", tail=tail) or "(no output)"
