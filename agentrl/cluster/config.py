"""The `cluster:` section of a train config: which Ray cluster, and what runs where.

Without it nothing changes and Ray is never imported. With it, sandboxes run on the
nodes that offer the sandbox resource, sampler replicas (if asked for) run as Ray actors
behind the router, and the FSDP trainer's ranks 1..N-1 (if asked for) run as Ray actors
in a placement group while this process is rank 0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.cluster.local import check_address


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxNodes(_Model):
    """Nodes that host Docker sandboxes: one sandbox worker actor on each."""

    resource: str = Field(
        default="sandbox",
        description="custom resource such nodes advertise (ray start --resources "
        "'{\"sandbox\": 8}'); its amount is how many sandboxes the node runs at once",
    )
    refresh_s: float = Field(
        default=5.0, gt=0, description="how often new or returning nodes are looked for"
    )


class SamplerReplicas(_Model):
    """In-process samplers (`agentrl serve`) started as Ray actors, behind the router."""

    replicas: int = Field(ge=1, description="how many")
    num_gpus: float = Field(default=0, ge=0, description="GPUs each holds (1 on a GPU node)")
    num_cpus: float = Field(default=1, ge=0, description="CPUs each holds")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources each needs, to place them (e.g. {agentrl_node_w1: 1})",
    )


class TrainerRanks(_Model):
    """The FSDP trainer across processes: this process is rank 0; ranks 1..N-1 are Ray
    actors in one placement group (what torchrun does on one machine)."""

    ranks: int = Field(ge=2, description="world size, rank 0 (this process) included")
    num_gpus: float = Field(default=0, ge=0, description="GPUs each follower rank holds")
    num_cpus: float = Field(default=1, ge=0, description="CPUs each follower rank holds")
    resources: dict[str, float] = Field(default_factory=dict)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="placement group strategy for the follower ranks"
    )
    master_address: str | None = Field(
        default=None,
        description="address the ranks reach rank 0 at (default: this node's Ray address)",
    )

    @model_validator(mode="after")
    def _reserves(self) -> TrainerRanks:
        if not (self.num_cpus > 0 or self.num_gpus > 0 or any(self.resources.values())):
            raise ValueError(
                "a trainer rank must reserve something (num_gpus, num_cpus or resources): "
                "Ray places a placement group's bundles by what they hold"
            )
        return self


class ClusterConfig(_Model):
    address: str = Field(
        description="the Ray cluster: the head's host:port (as `agentrl cluster status` "
        "prints), 'auto', or ray://host:port"
    )
    namespace: str = Field(default="agentrl", description="Ray namespace of the run's actors")
    sandboxes: SandboxNodes = Field(default_factory=SandboxNodes)
    samplers: SamplerReplicas | None = Field(
        default=None, description="sampler replicas as actors (default: the driver samples)"
    )
    trainer: TrainerRanks | None = Field(
        default=None, description="follower ranks as actors (default: one trainer process)"
    )

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)
