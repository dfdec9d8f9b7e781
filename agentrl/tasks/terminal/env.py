"""TerminalEnv: a Terminal-Bench or Harbor folder's runtime. The harness's own image if
present, the image's working directory where the task names none, the offline test
runtime at EVAL, the reference solution copied in and run as the harness runs it.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
import tomllib
from functools import cached_property
from pathlib import Path

from agentrl.errors import SandboxError
from agentrl.sandbox.base import ExecRequest, ExecResult, Sandbox, SandboxSpec
from agentrl.sandbox.images import (
    build_recipe,
    docker_client,
    folder_hash,
    missing_image_fix,
    repo_slug,
)
from agentrl.sandbox.seal import GradeScope
from agentrl.tasks.env import EVAL_NETWORK, TaskEnv, put_path
from agentrl.tasks.evidence import DidNotRun, Grade, tail
from agentrl.tasks.spec import Instance, Task
from agentrl.tasks.terminal import TESTS_DIR, offline
from agentrl.tasks.terminal.load import (
    WORKDIR_OF_IMAGE,
    detect_format,
    oracle_script,
    prebuilt_image,
    solution_commands,
)
from agentrl.tasks.terminal.verifier import (
    ARTIFACTS_DIR,
    CollectHook,
    HarborVerifier,
    harbor_verifier,
)

log = logging.getLogger(__name__)

TB_ORACLE = "/oracle/solution.sh"
HARBOR_SOLUTION_DIR = "/solution"


class TerminalEnv(TaskEnv):
    """A Terminal-Bench or Harbor folder's runtime: the harness's own image if present, the
    offline test runtime at EVAL, the reference solution run as the harness runs it."""

    _image_workdir: str | None = None
    _verifier_image: str | None = None
    """A separate verifier's image, once EVAL first resolved it."""
    _verifier_workdir: str | None = None

    @cached_property
    def _verifier_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    async def resolve_image(self) -> str:
        prebuilt = prebuilt_image(Path(self.task.path))
        if (
            self.task.spec.sandbox.recipe
            and prebuilt
            and self.provider.capabilities.images
            and await asyncio.to_thread(_present, prebuilt)
        ):
            return prebuilt
        return await super().resolve_image()

    async def spec(self, instance: Instance, name: str) -> SandboxSpec:
        """The task's sandbox; where the task names no working directory, the image's
        (as the harness's terminal starts there)."""
        spec = await super().spec(instance, name)
        if (
            self.task.spec.sandbox.workdir != WORKDIR_OF_IMAGE
            or not self.provider.capabilities.images
        ):
            return spec
        if self._image_workdir is None:
            self._image_workdir = await asyncio.to_thread(_working_dir, spec.image)
        return spec.model_copy(update={"workdir": self._image_workdir})

    def grade_scope(self, workdir: str) -> GradeScope:
        """The task's scope, less what the test scripts' uv or venv make in the workdir."""
        needs = offline.read_scripts(verifier_scripts(Path(self.task.path)))
        runtime = tuple(posixpath.join(workdir, name) for name in needs.project)
        return super().grade_scope(workdir).model_copy(update={"runtime": runtime})

    @cached_property
    def verifier(self) -> HarborVerifier | None:
        """A Harbor task's verifier settings (None: a Terminal-Bench task)."""
        folder = Path(self.task.path)
        if detect_format(folder) != "harbor":
            return None
        return harbor_verifier(tomllib.loads((folder / "task.toml").read_text()), folder)

    async def init(self, instance: Instance, name: str) -> Sandbox:
        """INIT; a Harbor task's container has `/logs/artifacts`, as Harbor's mounts it."""
        sandbox = await super().init(instance, name)
        if self.verifier is not None:
            try:
                await sandbox.exec(ExecRequest(command=["mkdir", "-p", ARTIFACTS_DIR]))
            except BaseException:
                await sandbox.close()
                raise
        return sandbox

    def scope(self, sandbox: Sandbox) -> GradeScope:
        """The task's scope; a separate verifier's once EVAL resolved its image: the
        copy starts from that image and gets the artifacts, whole, and nothing else."""
        scope = super().scope(sandbox)
        checks, image = self.verifier, self._verifier_image
        if checks is None or not checks.separate or image is None:
            return scope
        workdir = self._verifier_workdir or sandbox.spec.workdir
        return scope.model_copy(
            update={
                "outputs": checks.artifacts,
                "tests": (TESTS_DIR,),
                "lookup": (TESTS_DIR,),
                "cwd": workdir,
                "runtime": self.scope_at(workdir).runtime,
                "image": image,
                "env": self.task.spec.sandbox.env if checks.env is None else checks.env,
            }
        )

    async def evaluate(self, sandbox: Sandbox, instance: Instance) -> Grade:
        """Harbor's order: the collect commands in the agent's container, then the tests
        (in a container of their own where the task says so)."""
        checks = self.verifier
        notes = await collect(sandbox, checks.hooks) if checks else []
        if checks is not None and checks.separate:
            await self._resolve_verifier(sandbox, instance)
        graded = await super().evaluate(sandbox, instance)
        graded.evidence.notes[:0] = notes
        return graded

    async def _resolve_verifier(self, sandbox: Sandbox, instance: Instance) -> None:
        """The separate verifier's image (built once) and working directory."""
        checks = self.verifier
        assert checks is not None
        async with self._verifier_lock:
            if self._verifier_image is not None:
                return
            if not self.provider.capabilities.images:
                raise SandboxError(
                    f"{self.task.spec.name}: its tests run in a verifier container of their "
                    f"own, and {self.provider.name} sandboxes have no images",
                    fix="run it with the docker provider",
                )
            if checks.image is not None:
                if not await asyncio.to_thread(_present, checks.image):
                    raise SandboxError(
                        f"the verifier image {checks.image} is not on this machine",
                        fix=missing_image_fix(checks.image),
                    )
                image = checks.image
            elif checks.dockerfile:  # built as Harbor builds it: tests/ is the context
                folder = Path(self.task.path) / "tests"
                name = repo_slug(self.task.spec.name, "task")
                tag = f"agentrl/verifier-{name}:{folder_hash(folder)}"
                image = (await asyncio.to_thread(build_recipe, folder, tag)).tag
            else:  # a fresh container of the task's own image (never a snapshot's)
                image = await self.instance_image(instance)
                self._verifier_workdir = sandbox.spec.workdir
            if self._verifier_workdir is None:
                self._verifier_workdir = await asyncio.to_thread(_working_dir, image)
            self._verifier_image = image

    async def grade(self, sandbox: Sandbox, instance: Instance) -> Grade:
        folder = Path(self.task.path)
        needs = offline.read_scripts(verifier_scripts(folder), test_texts(folder))
        offline_only = needs.uses_bootstrap and self.eval_network() is None
        image = self._verifier_image or await self.instance_image(instance)
        brought = await offline.install(sandbox, needs, image) if offline_only else []
        try:
            graded = await super().grade(sandbox, instance)
        except DidNotRun as failed:
            failed.evidence.substitutions[:0] = brought + await offline.substitutions(sandbox)
            if any(offline.NO_PYTHON in line for line in brought):
                failed.fix = (
                    "the tests need a Python the sandbox does not have and none could be "
                    "brought: build the image with it, or grade where uv can download one"
                )
            raise
        graded.evidence.substitutions[:0] = brought + await offline.substitutions(sandbox)
        unmet = [line for line in graded.evidence.substitutions if offline.UNMET in line]
        if unmet:  # the tests ran without what they asked for: their verdict means nothing
            raise DidNotRun(
                f"the tests needed what could not be brought offline: {unmet[0]}",
                graded.evidence,
                fix="give grading a network that reaches the package sources "
                f"(${EVAL_NETWORK}), or build the image with what the tests install",
            )
        return graded

    async def run_oracle(self, sandbox: Sandbox, instance: Instance) -> str:
        """The reference solution, run as the harnesses run it; like them, what it left is
        graded whatever its exit code (only a timeout is an error)."""
        done = await run_oracle(self.task, sandbox)
        if done.timed_out:
            raise SandboxError(f"the reference solution timed out: {tail(done.output)}")
        if done.exit_code != 0:
            log.info(
                "%s: the reference solution exited %s; graded regardless, as the harnesses do: %s",
                self.task.spec.name,
                done.exit_code,
                tail(done.output),
            )
        return done.output


async def collect(sandbox: Sandbox, hooks: tuple[CollectHook, ...]) -> list[str]:
    """Run Harbor's `[[verifier.collect]]` commands in the agent's container, as Harbor
    does: in order, each to its timeout, a failure noted and never the end of grading
    (the tests then find what the command did not leave: the agent's doing)."""
    notes = []
    for hook in hooks:
        done = await sandbox.exec(ExecRequest(command=hook.command, timeout=hook.timeout))
        how = "timed out" if done.timed_out else f"exited {done.exit_code}"
        note = f"verifier.collect {hook.command[:80]!r} {how}"
        notes.append(note if done.exit_code == 0 else f"{note}: {tail(done.output)}")
    return notes


def _working_dir(image: str) -> str:
    client = docker_client()
    try:
        return str(client.images.get(image).attrs["Config"].get("WorkingDir") or "/")
    finally:
        client.close()


def verifier_scripts(folder: Path) -> list[str]:
    """The shell scripts a task's tests run: run-tests.sh and every .sh under tests/."""
    paths = [folder / "run-tests.sh", *sorted((folder / "tests").rglob("*.sh"))]
    return [p.read_text(errors="replace") for p in paths if p.is_file()]


def test_texts(folder: Path) -> list[str]:
    """The other text files of the tests (Python tests that write and run scripts)."""
    paths = sorted((folder / "tests").rglob("*.py"))
    return [p.read_text(errors="replace") for p in paths if p.is_file()]


def _present(image: str) -> bool:
    client = docker_client()
    try:
        return bool(client.images.list(name=image))
    finally:
        client.close()


async def run_oracle(task: Task, sandbox: Sandbox, timeout: float = 600.0) -> ExecResult:
    """Copy the reference solution in as each harness does, and run it in the workdir."""
    root, script = Path(task.path), oracle_script(task.path)
    if detect_format(root) == "harbor":
        await put_path(sandbox, script.parent, HARBOR_SOLUTION_DIR)
        command = f"bash {HARBOR_SOLUTION_DIR}/{script.name}"
    elif script.suffix == ".yaml":
        await sandbox.write_file(TB_ORACLE, solution_commands(script).encode(), mode=0o755)
        command = f"bash {TB_ORACLE}"
    else:
        await put_path(sandbox, script, TB_ORACLE)
        command = f"bash {TB_ORACLE}"
    return await sandbox.exec(ExecRequest(command=command, timeout=timeout))
