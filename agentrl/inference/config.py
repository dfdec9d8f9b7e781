"""Sampler configs: which policy writes an episode's replies, as one discriminated union.

`--policy local|openai:URL|router:URL,URL|scripted:FILE|FOLDER` and a train config's
`servers:` block both parse into `SamplerConfig`; each variant builds its sampler lazily,
so this module imports neither torch, transformers nor ray. Each also names the model
whose tokenizer its replies are in (`tokenizer_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import ConfigError
from agentrl.inference.base import PauseMode, Transfer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.inference.local import LocalSampler
    from agentrl.inference.openai import OpenAISampler
    from agentrl.inference.router import Router
    from agentrl.inference.scripted import ScriptedSampler


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def tokenizer_model(self) -> str:
        """Whose tokenizer the replies are in: 'embedded' or a model folder. A server's
        model is out of sight: the embedded one unless a variant says otherwise."""
        return "embedded"


class LocalSamplerConfig(_Model):
    """The model in this process, batched continuously (CPU or one GPU)."""

    type: Literal["local"] = "local"
    model: str = Field(default="embedded", description="'embedded' (SmolLM2-135M) or a model dir")
    publish_pause: PauseMode | None = Field(
        default=None,
        description="how a weight update meets running requests: None lets them finish "
        "first; keep (the async schedule) decodes them on under the new weights, each "
        "token stamped with its version",
    )

    def build(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        publish_dir: Path | None = None,
    ) -> LocalSampler:
        from agentrl.inference.local import LocalSampler

        sampler = LocalSampler.for_model(self.model)
        sampler.publish_pause = self.publish_pause
        return sampler

    def tokenizer_model(self) -> str:
        """Whose tokenizer the replies are in: 'embedded' or a model folder."""
        return self.model


class CheckpointSamplerConfig(_Model):
    """A train run's checkpoint, exported once to a model folder (in the cache) and
    sampled in this process like `local`."""

    type: Literal["checkpoint"] = "checkpoint"
    path: str = Field(
        description="a train run folder (its newest checkpoint) or a checkpoints/step-N folder"
    )

    def build(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        publish_dir: Path | None = None,
    ) -> LocalSampler:
        from agentrl.inference.local import LocalSampler

        return LocalSampler.for_model(self.tokenizer_model())

    def tokenizer_model(self) -> str:
        """The exported model folder (exported here on first use)."""
        from agentrl.inference.checkpoints import checkpoint_model

        return str(checkpoint_model(self.path))


class OpenAISamplerConfig(_Model):
    """One vLLM-compatible server (`agentrl serve`, vLLM): http://host:port or .../v1."""

    type: Literal["openai"] = "openai"
    url: str = Field(description="the server's base URL")

    def build(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        publish_dir: Path | None = None,
    ) -> OpenAISampler:
        from agentrl.inference.openai import OpenAISampler

        return OpenAISampler(self.url)


class RouterConfig(_Model):
    """Several vLLM-compatible servers behind the router: sessions stick to one server,
    failed ones are routed around, and a trainer publishes weights to all of them."""

    type: Literal["router"] = "router"
    urls: list[str] = Field(
        min_length=1, description="server base URLs (http://host:port), e.g. agentrl serve"
    )
    pause: PauseMode = Field(
        default="abort",
        description="what in-flight requests do while weights are published (keep: only "
        "with servers that report each token's version, such as agentrl serve)",
    )
    transfer: Transfer = Field(
        default="checkpoint",
        description="checkpoint: a safetensors folder every server reloads (shared disk); "
        "gloo: vLLM's weight-transfer protocol over gloo (agentrl serve); nccl: the same "
        "with vLLM on GPUs",
    )
    request_timeout: float = Field(default=600.0, gt=0, description="seconds per completion")
    control_timeout: float = Field(
        default=300.0,
        gt=0,
        description="seconds a server may take for a control call (pause, a weight "
        "transfer) before it is quarantined and the run goes on without it",
    )
    clear_kv_cache: bool = Field(
        default=False, description="reset every server's prefix cache after each publication"
    )
    cache_salt: bool = Field(
        default=True,
        description="salt prefix caches by weights version (vLLM cache_salt): no request "
        "reuses KV blocks that older weights computed",
    )

    def build(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        publish_dir: Path | None = None,
    ) -> Router:
        """`publish_dir`: where checkpoint transfers write (default: a temporary folder)."""
        from agentrl.inference.router import Router

        return Router(
            [u for u in self.urls if u.strip()],
            pause_mode=self.pause,
            transfer=self.transfer,
            publish_dir=publish_dir,
            request_timeout=self.request_timeout,
            control_timeout=self.control_timeout,
            clear_kv_cache=self.clear_kv_cache,
            cache_salt=self.cache_salt,
        )


class ScriptedSamplerConfig(_Model):
    """Fixed replies from a file, in order: a deterministic policy for tests and demos."""

    type: Literal["scripted"] = "scripted"
    script: str = Field(description="a .yaml/.yml/.json list, or text split on `---` lines")

    def build(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        publish_dir: Path | None = None,
    ) -> ScriptedSampler:
        from agentrl.inference.scripted import ScriptedSampler, load_script

        if tokenizer is None:
            raise ConfigError("a scripted policy needs the tokenizer its replies are encoded with")
        return ScriptedSampler(load_script(self.script), tokenizer)


SamplerConfig = Annotated[
    LocalSamplerConfig
    | CheckpointSamplerConfig
    | OpenAISamplerConfig
    | RouterConfig
    | ScriptedSamplerConfig,
    Field(discriminator="type"),
]

POLICY_FIX = (
    "use --policy local, --policy scripted:FILE, --policy openai:http://HOST:PORT, "
    "--policy router:http://HOST:PORT,http://HOST:PORT, or --policy FOLDER (a train run, "
    "one of its checkpoints, or a model folder)"
)


def parse_policy(spec: str) -> SamplerConfig:
    """`--policy`: `local` (the embedded model), `scripted:FILE`, `openai:URL` (a
    vLLM-compatible server; `http://host:port` or `.../v1`, e.g. what `agentrl serve`
    prints), `router:URL,URL,...` (several, sessions sticky to one), or a folder: a train
    run or one of its checkpoints (exported to a model folder, sampled in process), or a
    model folder (config.json: sampled in process)."""
    kind, _, arg = spec.partition(":")
    try:
        if kind == "local" and not arg:
            return LocalSamplerConfig()
        if kind == "scripted" and arg:
            return ScriptedSamplerConfig(script=arg)
        if kind == "openai" and arg:
            return OpenAISamplerConfig(url=arg)
        if kind == "router" and arg:
            return RouterConfig(urls=[u for u in arg.split(",") if u.strip()])
    except ValidationError:
        pass  # e.g. router: with only commas
    if Path(spec).is_dir():
        return _folder_policy(Path(spec))
    raise ConfigError(f"unknown policy {spec!r}", fix=POLICY_FIX)


def _folder_policy(folder: Path) -> LocalSamplerConfig | CheckpointSamplerConfig:
    from agentrl.inference.checkpoints import CHECKPOINT_FIX, find_checkpoint, holds_checkpoints

    if holds_checkpoints(folder):  # resolved now: a run still training may save newer ones
        return CheckpointSamplerConfig(path=str(find_checkpoint(folder).resolve()))
    if (folder / "config.json").is_file():
        return LocalSamplerConfig(model=str(folder.resolve()))
    raise ConfigError(
        f"policy {folder}: neither a train run, a checkpoint nor a model folder (config.json)",
        fix=f"{CHECKPOINT_FIX}; or a Hugging Face model folder",
    )
