"""TerminalEnv: a Terminal-Bench or Harbor folder's runtime. The harness's own image if
present, the image's working directory where the task names none, the offline test
runtime at EVAL, the reference solution copied in and run as the harness runs it.
"""

from __future__ import annotations

import asyncio
import logging
import posixpath
from pathlib import Path

from agentrl.errors import SandboxError
from agentrl.sandbox.base import ExecRequest, ExecResult, Sandbox, SandboxSpec
from agentrl.sandbox.images import docker_client
from agentrl.sandbox.seal import GradeScope
from agentrl.tasks.env import EVAL_NETWORK, TaskEnv, put_path
from agentrl.tasks.evidence import DidNotRun, Grade, tail
from agentrl.tasks.spec import Instance, Task
from agentrl.tasks.terminal import offline
from agentrl.tasks.terminal.load import (
    WORKDIR_OF_IMAGE,
    detect_format,
    oracle_script,
    prebuilt_image,
    solution_commands,
)

log = logging.getLogger(__name__)

TB_ORACLE = "/oracle/solution.sh"
HARBOR_SOLUTION_DIR = "/solution"


class TerminalEnv(TaskEnv):
    """A Terminal-Bench or Harbor folder's runtime: the harness's own image if present, the
    offline test runtime at EVAL, the reference solution run as the harness runs it."""

    _image_workdir: str | None = None

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

    async def grade(self, sandbox: Sandbox, instance: Instance) -> Grade:
        folder = Path(self.task.path)
        needs = offline.read_scripts(verifier_scripts(folder), test_texts(folder))
        offline_only = needs.uses_bootstrap and self.eval_network() is None
        image = await self.instance_image(instance)
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
