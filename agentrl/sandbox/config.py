"""Sandbox provider configs: which provider starts an episode's sandboxes, as one
discriminated union.

`--provider docker|local|module:Class`, a train config's `provider:` (the same string)
and a trajectory's `env.provider` (what `agentrl replay` builds again) all parse into
`SandboxConfig` (`parse_provider`); each variant builds its provider lazily, so this
module imports no Docker SDK. A provider of your own is `module:Class`: a class whose
instances keep the `SandboxProvider` protocol (`agentrl.sandbox.base`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agentrl.errors import ConfigError
from agentrl.registry import resolve
from agentrl.sandbox.base import Capabilities

if TYPE_CHECKING:
    from agentrl.sandbox.base import SandboxProvider
    from agentrl.sandbox.docker import DockerProvider
    from agentrl.sandbox.local import LocalProvider

PROVIDER_FIX = "use docker, local, or module:Class (a provider of your own)"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DockerSandboxConfig(_Model):
    """Containers on the local Docker engine: isolated, limited, labelled, reaped."""

    type: Literal["docker"] = "docker"
    max_concurrent_starts: int = Field(default=8, ge=1, description="container starts at once")
    starts_per_second: float = Field(
        default=10.0, gt=0, description="container starts per second, on average"
    )
    reap_at_start: bool = Field(
        default=True, description="remove what dead runs left on this host when it is built"
    )

    def build(self) -> DockerProvider:
        from agentrl.sandbox.docker import DockerProvider

        return DockerProvider(
            max_concurrent_starts=self.max_concurrent_starts,
            starts_per_second=self.starts_per_second,
            reap_at_start=self.reap_at_start,
        )


class LocalSandboxConfig(_Model):
    """A temporary folder on this machine: NO isolation, for trying agentrl without Docker."""

    type: Literal["local"] = "local"

    def build(self) -> LocalProvider:
        from agentrl.sandbox.local import LocalProvider

        return LocalProvider()


class CustomSandboxConfig(_Model):
    """A provider of your own: `module:Class`, built with `options` as keyword arguments."""

    type: Literal["custom"] = "custom"
    path: str = Field(pattern=r"^[\w.]+:\w+$", description="module:Class")
    options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the class"
    )

    def build(self) -> SandboxProvider:
        cls = resolve({}, self.path, "sandbox provider")
        if not callable(cls):
            raise ConfigError(f"sandbox provider {self.path!r} is not a class")
        try:
            built = cls(**self.options)
        except TypeError as exc:
            raise ConfigError(f"sandbox provider {self.path!r}: bad options: {exc}") from exc
        starts = callable(getattr(built, "start", None))
        if not starts or not isinstance(getattr(built, "capabilities", None), Capabilities):
            raise ConfigError(
                f"sandbox provider {self.path!r} is no provider: it needs `capabilities` "
                "(agentrl.sandbox.base.Capabilities) and `start(spec)`",
                fix="subclass agentrl.sandbox.base.SandboxProvider (docs/sandboxes.md)",
            )
        provider = cast("SandboxProvider", built)
        provider.name = self.path  # what trajectories record, so that replay builds it again
        return provider


SandboxConfig = Annotated[
    DockerSandboxConfig | LocalSandboxConfig | CustomSandboxConfig, Field(discriminator="type")
]


def _known(spelling: str) -> str:
    try:
        parse_provider(spelling)
    except ConfigError as exc:
        raise ValueError(f"{exc.message} ({exc.fix})" if exc.fix else exc.message) from exc
    return spelling


ProviderName = Annotated[str, AfterValidator(_known)]
"""A config field holding a provider's spelling (a train config's `provider:`), checked
to parse; `parse_provider` turns it into its config."""

_UNION: TypeAdapter[SandboxConfig] = TypeAdapter(SandboxConfig)


def parse_provider(spec: str | Mapping[str, Any], **options: Any) -> SandboxConfig:
    """`docker`, `local` or `module:Class`, with `options` as keywords (a custom
    provider's `options`, else the variant's own fields); or a mapping with `type:`."""
    if not isinstance(spec, str):
        value = {**spec, **options}
    elif spec in ("docker", "local"):
        value = {"type": spec, **options}
    elif ":" in spec:
        value = {"type": "custom", "path": spec, "options": options}
    else:
        raise ConfigError(f"unknown sandbox provider {spec!r}", fix=PROVIDER_FIX)
    try:
        return _UNION.validate_python(value)
    except ValidationError as exc:
        raise ConfigError(f"sandbox provider {spec!r}: bad options: {_why(exc)}") from exc


def _why(exc: ValidationError) -> str:
    """Each error as `field: message` (the union's tag, first in its location, left out)."""
    where = [".".join(map(str, e["loc"][1:])) or "type" for e in exc.errors()]
    return "; ".join(f"{w}: {e['msg']}" for w, e in zip(where, exc.errors(), strict=True))
