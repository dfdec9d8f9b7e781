"""Reading an OpenEnv environment folder (`openenv.yaml`, `server/Dockerfile`) into a Task.

The manifest names the environment and the port its server listens on (8000 unless it
says otherwise); everything else about the environment (its actions, observations,
rewards) comes from the running server at INIT (`agentrl.tasks.openenv.env`). The task has
one instance, the environment's plain `reset()`; its episodes end when a step says done,
the agent calls finish, or the turns run out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import ConfigError
from agentrl.sandbox.images import folder_hash
from agentrl.tasks.spec import (
    EnvironmentGrader,
    EpisodeLimits,
    Instance,
    PromptConfig,
    SandboxConfig,
    Task,
    TaskSpec,
)
from agentrl.yamlfile import load_yaml

MANIFEST = "openenv.yaml"
ENV_RUNTIME = "agentrl.tasks.openenv.env:OpenEnvTaskEnv"
SYSTEM_PROMPT = (
    "You act in an environment through its tools: each call is one step of the environment, "
    "and what it returns is the step's observation. Reach the environment's goal; call "
    "finish when you are done."
)
INSTANCE_PROMPT = "The environment {id} was reset. Its first observation:"


class Manifest(BaseModel):
    """The keys of `openenv.yaml` agentrl reads (OpenEnv's spec_version 1 and the older
    form with `action:` / `observation:`); others are kept as the folder has them."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    port: int = Field(default=8000, ge=1, le=65535)
    description: str = ""


def is_environment(folder: Path) -> bool:
    """An OpenEnv environment folder: `openenv.yaml` and no task file of another format."""
    return (folder / MANIFEST).is_file() and not any(
        (folder / f).exists() for f in ("task.yaml", "task.toml")
    )


def manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    data = load_yaml(path, what="OpenEnv manifest")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping (name:, port:, ...)")
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "top level"
        raise ConfigError(
            f"{path}: {where}: {first['msg']}", fix="OpenEnv's manifest names the environment"
        ) from None


def load_openenv(folder: Path | str) -> Task:
    """The task an OpenEnv environment folder is."""
    root = Path(folder).resolve()
    info = manifest(root)
    from agentrl.tasks.openenv.image import dockerfile_of

    dockerfile_of(root)  # refused now, not at the first sandbox, when it has none
    name = re.sub(r"[^\w.-]+", "-", info.name).strip("-._") or root.name
    fields: dict[str, Any] = {}
    spec = TaskSpec(
        name=name,
        description=info.description or f"OpenEnv environment {info.name}",
        sandbox=SandboxConfig(workdir="/"),
        instances=[{"id": name, **fields}],
        prompt=PromptConfig(system=SYSTEM_PROMPT, instance=INSTANCE_PROMPT),
        tools=["finish"],
        limits=EpisodeLimits(max_turns=16, max_new_tokens=512),
        grader=EnvironmentGrader(type="environment"),
        environment=".",
    )
    return Task(
        spec=spec,
        path=str(root),
        base_dir=str(root),
        instances=[Instance(id=name, fields=fields)],
        hash=folder_hash(root),
        env=ENV_RUNTIME,
        format="openenv",
    )


def environment_folder(task: Task) -> Path:
    """The environment's folder: the one loaded, or the one a task file names."""
    return (Path(task.base_dir) / (task.spec.environment or ".")).resolve()


def server_port(task: Task) -> int:
    return manifest(environment_folder(task)).port
