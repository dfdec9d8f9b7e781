"""A task as a command runs it: some of its instances, some of its limits replaced."""

from __future__ import annotations

import hashlib

from pydantic import ValidationError

from agentrl.errors import ConfigError
from agentrl.tasks.spec import AgentConfig, Task


def with_overrides(
    task: Task,
    limits: dict[str, int] | None = None,
    temperature: float | None = None,
    agent: AgentConfig | None = None,
) -> Task:
    """`task` with some of its limits and its sampling temperature replaced, validated as
    the file itself is (impossible limits are a ConfigError); with `agent`, played by
    that external harness (its hash then names the harness too: an evaluation of the
    task's own agent is another evaluation)."""
    spec = task.spec
    if limits:
        try:
            new = type(spec.limits).model_validate({**spec.limits.model_dump(), **limits})
        except ValidationError as e:
            raise ConfigError(f"limits: {e.errors()[0]['msg']}") from e
        spec = spec.model_copy(update={"limits": new})
    if temperature is not None:
        sampling = spec.sampling.model_copy(update={"temperature": temperature})
        spec = spec.model_copy(update={"sampling": sampling})
    if agent is not None and agent != spec.agent:
        spec = spec.model_copy(update={"agent": agent})
        digest = hashlib.sha256(f"{task.hash}\n{agent.model_dump_json()}".encode()).hexdigest()
        return task.model_copy(update={"spec": spec, "hash": digest[: len(task.hash)]})
    return task if spec is task.spec else task.model_copy(update={"spec": spec})


def select_instances(task: Task, ids: list[str] | None, *, strict: bool = True) -> Task:
    """`task` with only the instances in `ids` (all when None); with `strict`, an id the
    task does not have is a ConfigError naming the ones it has."""
    if not ids:
        return task
    have = [i.id for i in task.instances]
    unknown = [i for i in ids if i not in have]
    if strict and unknown:
        listed = ", ".join(have[:8]) + (", ..." if len(have) > 8 else "")
        raise ConfigError(
            f"{task.path}: no instance {', '.join(unknown)}", fix=f"its instances: {listed}"
        )
    return task.model_copy(update={"instances": [i for i in task.instances if i.id in ids]})
