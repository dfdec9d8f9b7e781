"""`agentrl check`: does each task's grader tell a solution from doing nothing?

For every instance, two episodes without a model, through the same sandbox and grader
that training uses (INIT, then EVAL with its sealing and its reference rule):
- oracle: the reference solution runs in the sandbox first (Terminal-Bench
  `solution.sh`, Harbor `solution/solve.sh`, a SWE-bench row's `patch`, a YAML task's
  `oracle:` commands);
- no-op: nothing runs.

An instance passes when the oracle earns full reward (1.0) and the no-op less. An
infrastructure failure (the sandbox did not start, the solution crashed, the tests did
not run) is reported as such and fails the check.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import AgentRLError, GraderError, first_line
from agentrl.sandbox.base import SandboxProvider
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.graders import PASSING
from agentrl.tasks.spec import Instance, Task

FULL_REWARD = 1.0


class Outcome(BaseModel):
    """One graded episode of a check."""

    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    tests: str = Field(default="", description="passed/failed, as the grader parsed them")
    failed: list[str] = Field(
        default_factory=list, description="the tests that did not pass (the first ten)"
    )
    error: str | None = Field(default=None, description="an infrastructure failure, if any")
    fix: str | None = None
    seconds: float = 0.0


class CheckRow(BaseModel):
    """One instance of `agentrl check`."""

    model_config = ConfigDict(extra="forbid")

    task: str
    format: str
    instance: str
    oracle: Outcome
    noop: Outcome
    ok: bool
    notes: list[str] = Field(default_factory=list, description="what a person should know")


async def check_task(task: Task, env: TaskEnv, *, concurrency: int = 2) -> list[CheckRow]:
    """Oracle and no-op for every instance of `task`, `concurrency` instances at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(instance: Instance) -> CheckRow:
        async with gate:
            oracle, noop = await asyncio.gather(
                _episode(env, instance, oracle=True), _episode(env, instance, oracle=False)
            )
        ok = (
            oracle.error is None
            and noop.error is None
            and oracle.reward is not None
            and oracle.reward >= FULL_REWARD
            and noop.reward is not None
            and noop.reward < FULL_REWARD
        )
        missing = env.missing_network()
        return CheckRow(
            task=task.spec.name,
            format=task.format,
            instance=instance.id,
            oracle=oracle,
            noop=noop,
            ok=ok,
            notes=([missing] if missing else []) + env.image_notes(),
        )

    return list(await asyncio.gather(*(one(i) for i in task.instances)))


async def _episode(env: TaskEnv, instance: Instance, *, oracle: bool) -> Outcome:
    started = time.monotonic()
    kind = "oracle" if oracle else "noop"
    try:
        sandbox = await env.init(instance, name=f"{instance.id}-{kind}")
    except AgentRLError as e:
        return Outcome(
            error=f"sandbox: {first_line(e)}", fix=e.fix or None, seconds=_since(started)
        )
    try:
        if oracle:
            try:
                await env.run_oracle(sandbox, instance)
            except AgentRLError as e:
                return _failed("reference solution", e, started)
        try:
            graded = await env.evaluate(sandbox, instance)
        except GraderError as e:
            return Outcome(
                error=f"eval: {first_line(e)}", fix=e.fix or None, seconds=_since(started)
            )
        except AgentRLError as e:
            return Outcome(
                error=f"sandbox: {first_line(e)}", fix=e.fix or None, seconds=_since(started)
            )
    finally:
        await sandbox.close()
    failed = [name for name, status in graded.evidence.tests.items() if status not in PASSING]
    return Outcome(
        reward=graded.reward,
        tests=_tests(graded.components),
        failed=failed[:10],
        seconds=_since(started),
    )


def _failed(stage: str, error: AgentRLError, started: float) -> Outcome:
    return Outcome(
        error=f"{stage}: {first_line(error)}", fix=error.fix or None, seconds=_since(started)
    )


def _tests(components: dict[str, object]) -> str:
    if "fail_to_pass" in components:
        return f"F2P {components['fail_to_pass']}, P2P {components.get('pass_to_pass')}"
    if "tests_passed" in components:
        return f"{components['tests_passed']} passed, {components['tests_failed']} failed"
    return f"exit {components.get('exit_code')}" if "exit_code" in components else ""


def _since(started: float) -> float:
    return round(time.monotonic() - started, 1)


def check_paths(
    paths: list[Path],
    provider: SandboxProvider,
    *,
    instances: list[str] | None = None,
    concurrency: int = 2,
) -> list[CheckRow]:
    """`agentrl check` over task files and folders: the rows of every instance."""
    from agentrl.runner import make_env, select_instances
    from agentrl.tasks.formats import load_any

    tasks = [select_instances(load_any(p), instances, strict=False) for p in paths]
    if instances and not any(t.instances for t in tasks):
        from agentrl.errors import ConfigError

        raise ConfigError(
            f"no instance {', '.join(instances)} in {', '.join(map(str, paths))}",
            fix="list a task's instances with `agentrl validate PATH`",
        )
    run_id = f"check-{uuid.uuid4().hex[:8]}"

    async def go() -> list[CheckRow]:
        rows: list[CheckRow] = []
        for task in tasks:
            if task.instances:
                env = make_env(task, provider, run_id)
                rows += await check_task(task, env, concurrency=concurrency)
        return rows

    return asyncio.run(go())
