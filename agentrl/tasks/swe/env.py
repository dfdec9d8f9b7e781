"""SweBenchEnv: the runtime of SWE-bench-style rows. The agent's sandbox starts from the
instance's prepared image; a grade takes the agent's patch, drops its changes to tests
and grades what is left in a fresh container (the `grade` module)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from agentrl.errors import ConfigError, SandboxError
from agentrl.sandbox.base import ExecRequest, Sandbox, SandboxProvider
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.evidence import DidNotRun, Grade, tail
from agentrl.tasks.spec import Instance, Task
from agentrl.tasks.swe import WORKDIR, Format
from agentrl.tasks.swe.grade import grade_patch
from agentrl.tasks.swe.images import find_or_build_image, prepare_image
from agentrl.tasks.swe.patch import agent_patch, drop_test_changes
from agentrl.tasks.swe.rows import detect_format


class SweBenchEnv(TaskEnv):
    """TaskEnv whose sandboxes start from each instance's prepared image and whose grades
    come from a fresh container with only the agent's patch carried over."""

    def __init__(self, task: Task, provider: SandboxProvider, run_id: str) -> None:
        super().__init__(task, provider, run_id)
        self.format: Format = (
            detect_format(task.instances[0].fields) if task.instances else ("swe-bench")
        )
        self._images: dict[str, tuple[str, str]] = {}  # id -> (found image, prepared image)
        self._locks: dict[str, asyncio.Lock] = {}

    async def instance_image(self, instance: Instance) -> str:
        return (await self._image_pair(instance))[1]

    async def _image_pair(self, instance: Instance) -> tuple[str, str]:
        if not self.provider.capabilities.images:
            raise ConfigError(
                f"instance {instance.id}: SWE-bench instances need the docker provider "
                f"(the repository lives in the image at {WORKDIR}; sandbox provider "
                f"{self.provider.name!r} runs no image)",
                fix="run with the docker sandbox provider",
            )
        async with self._locks.setdefault(instance.id, asyncio.Lock()):
            if instance.id not in self._images:
                base_dir, fmt = Path(self.task.base_dir), self.format
                found = await asyncio.to_thread(find_or_build_image, instance, base_dir, fmt)
                ready = await asyncio.to_thread(prepare_image, found, instance, fmt)
                self._images[instance.id] = (found, ready)
            return self._images[instance.id]

    async def grade(self, sandbox: Sandbox, instance: Instance) -> Grade:
        """The agent's patch, graded in a fresh container as the format's harness grades."""
        started = time.monotonic()
        # R2E-Gym's hidden tests are no change of the agent's (its runtime's own rule)
        hidden = ("r2e_tests", "run_tests.sh") if self.format == "r2e-gym" else ()
        patch = await agent_patch(sandbox, hidden)
        kept, tampered = drop_test_changes(patch, instance)
        found, ready = await self._image_pair(instance)
        spec = await self.spec(instance, f"{sandbox.spec.name or instance.id}-grade")
        if self.format in ("swe-smith", "r2e-gym"):  # graded from the unprepared image
            spec = spec.model_copy(update={"image": found})
        fresh = await self.provider.start(spec)
        try:
            online = await self.go_online(fresh)
            graded = await grade_patch(fresh, instance, self.format, kept)
        except DidNotRun as failed:
            failed.evidence.tampered[:0] = tampered
            raise
        finally:
            await fresh.close()
        graded.evidence.notes[:0] = online
        graded.evidence.tampered[:0] = tampered  # dropped here; then put back in `fresh`
        components = {**graded.components, "tampered_tests": len(graded.evidence.tampered)}
        return graded.model_copy(
            update={"components": components, "seconds": time.monotonic() - started}
        )

    async def run_oracle(self, sandbox: Sandbox, instance: Instance) -> str:
        """The reference solution in the agent's sandbox: the gold patch (SWE-smith: the bug
        patch reversed)."""
        fields = instance.fields
        if self.format == "r2e-gym" or not fields.get("patch"):
            raise ConfigError(f"instance {instance.id}: the row has no reference patch")
        await sandbox.write_file("/tmp/agentrl-gold.diff", str(fields["patch"]).encode())
        reverse = " -R" if self.format == "swe-smith" else ""
        done = await sandbox.exec(
            ExecRequest(command=f"git apply -v{reverse} /tmp/agentrl-gold.diff", timeout=120)
        )
        if done.exit_code != 0:
            raise SandboxError(f"the gold patch does not apply: {tail(done.output)}")
        return done.output
