"""Harbor's verifier, as a task.toml sets it: where the tests run (`shared`: in the agent's
environment; `separate`: in a container of their own once the agent's is gone), what is
carried from one to the other (the task's `artifacts` and `/logs/artifacts`), and the
`[[verifier.collect]]` commands run in the agent's container before anything is read.

Separate mode starts the verifier, as Harbor does, from `[verifier.environment]`'s
`docker_image` (its tests baked in), else from `tests/Dockerfile` built with `tests/` as
its context (tests baked in), else from the task's own image with `tests/` copied to
`/tests`. agentrl carries each artifact whole, through the same grading copy that carries
a shared task's outputs (`agentrl.sandbox.seal`): Python startup hooks and pytest
configuration above the tests are dropped there too.

What would grade otherwise than Harbor and agentrl does not do is refused, never ignored:
collect commands or artifacts in another compose service, a command's `user`, an
artifact's `exclude` patterns.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import ConfigError

ARTIFACTS_DIR = "/logs/artifacts"
"""Harbor's convention folder: whatever the agent's container holds there is collected."""
MAIN = "main"
"""Harbor's name for the agent's own container (the only service agentrl starts)."""
DEFAULT_HOOK_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CollectHook:
    """A `[[verifier.collect]]` command, run in the agent's container after its turns."""

    command: str
    timeout: float = DEFAULT_HOOK_TIMEOUT_S


@dataclass(frozen=True)
class HarborVerifier:
    """Where a Harbor task's tests run, and what reaches them."""

    separate: bool = False
    image: str | None = None
    """`[verifier.environment].docker_image`: the verifier's image, tests baked in."""
    dockerfile: bool = False
    """`tests/Dockerfile`: the verifier's image is built from `tests/`, tests baked in."""
    env: dict[str, str] | None = None
    """`[verifier.environment.env]`: the verifier container's environment (None: the
    task's `[environment.env]`, as Harbor copies the agent's environment)."""
    hooks: tuple[CollectHook, ...] = ()
    artifacts: tuple[str, ...] = field(default=(ARTIFACTS_DIR,))
    """Absolute paths in the agent's container carried to the verifier whole."""

    @property
    def bundled_tests(self) -> bool:
        """Whether the verifier's image holds the tests (none are copied in)."""
        return self.separate and (self.image is not None or self.dockerfile)


def harbor_verifier(data: dict[str, Any], folder: Path) -> HarborVerifier:
    """The verifier a task.toml's `data` asks for (ConfigError where agentrl cannot do it
    as Harbor does). `folder`: the task's."""
    where = folder / "task.toml"
    verifier = _table(data.get("verifier"), "verifier", where)
    mode = verifier.get("environment_mode")
    environment = verifier.get("environment")
    if mode not in (None, "shared", "separate"):
        raise ConfigError(
            f"{where}: verifier.environment_mode: {mode!r} is neither shared nor separate",
            fix='environment_mode = "shared" (the default) or "separate"',
        )
    if mode == "shared" and environment:
        raise ConfigError(
            f"{where}: verifier.environment_mode = 'shared' with a [verifier.environment]",
            fix="drop one: an environment of its own means environment_mode = 'separate'",
        )
    separate = mode == "separate" or (mode is None and bool(environment))
    listed = _list(verifier.get("collect"), "verifier.collect", where)
    hooks = tuple(_hook(h, where) for h in listed)
    artifacts = [ARTIFACTS_DIR]
    for entry in _list(data.get("artifacts"), "artifacts", where):
        artifacts.append(_artifact(entry, where))
    if not separate:
        return HarborVerifier(hooks=hooks, artifacts=tuple(dict.fromkeys(artifacts)))
    env_table = _table(environment, "verifier.environment", where)
    for key in ("gpus", "mcp_servers"):
        if env_table.get(key):
            raise ConfigError(
                f"{where}: verifier.environment.{key}: not supported",
                fix=f"drop verifier.environment.{key}",
            )
    image = env_table.get("docker_image") or None
    env = _table(env_table.get("env"), "verifier.environment.env", where) if environment else None
    return HarborVerifier(
        separate=True,
        image=str(image) if image else None,
        dockerfile=image is None and (folder / "tests" / "Dockerfile").is_file(),
        env={str(k): str(v) for k, v in env.items()} if env is not None else None,
        hooks=hooks,
        artifacts=tuple(dict.fromkeys(artifacts)),
    )


def _hook(entry: object, where: Path) -> CollectHook:
    hook = _table(entry, "verifier.collect", where)
    command = hook.get("command")
    if not isinstance(command, str) or not command.strip():
        raise ConfigError(f"{where}: verifier.collect: each needs a command", fix='command = "..."')
    _main_only(hook, "verifier.collect", where)
    if hook.get("user") is not None:
        raise ConfigError(
            f"{where}: verifier.collect: a command's user is not supported",
            fix="drop user: the command runs as the container's default user",
        )
    return CollectHook(command, float(hook.get("timeout_sec", DEFAULT_HOOK_TIMEOUT_S)))


def _artifact(entry: object, where: Path) -> str:
    """An artifact's source path (a string entry, or a table's `source`)."""
    if isinstance(entry, dict):
        _main_only(entry, "artifacts", where)
        if entry.get("exclude"):
            raise ConfigError(
                f"{where}: artifacts: exclude patterns are not supported",
                fix="name the paths to carry without exclude",
            )
        entry = entry.get("source")
    if not isinstance(entry, str) or not entry.startswith("/") or ".." in entry.split("/"):
        raise ConfigError(
            f"{where}: artifacts: {entry!r} is not an absolute path without '..'",
            fix='e.g. artifacts = ["/app/out"]',
        )
    return posixpath.normpath(entry)


def _main_only(table: dict[str, Any], what: str, where: Path) -> None:
    service = table.get("service")
    if service not in (None, MAIN):
        raise ConfigError(
            f"{where}: {what}: service {service!r}: compose services beside the agent's "
            "container are not supported",
            fix="agentrl starts one container per episode",
        )


def _table(value: object, what: str, where: Path) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{what}] must be a table", fix=f"write [{what}] as a table")
    return value


def _list(value: object, what: str, where: Path) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {what} must be a list", fix=f"write {what} as a list")
    return value
