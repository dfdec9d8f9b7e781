# Over 400 lines: the train YAML's schema and its cross-field checks, in the order a user writes it.
"""The train config: which tasks, which model, which backend, algorithm and schedule.

One YAML file, validated like a task file (`file:line: field: what is wrong`). Task
paths resolve beside the config file. Each instance of each task is a prompt; every
`eval.holdout_every`-th instance (in file order) is held out for evaluation and never
trained on, unless `eval.tasks` names held-out task files of their own (SWE-bench
Verified rows beside SWE-Gym training rows): then those are evaluated and every
instance of `tasks` trains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from agentrl.algorithm_config import AdvantageConfig, LossConfig
from agentrl.backends.config import FSDPConfig, TinkerConfig
from agentrl.cluster.config import ClusterConfig
from agentrl.dispatch.base import DispatchConfig, PipelineConfig
from agentrl.errors import ConfigError
from agentrl.inference.config import LocalSamplerConfig, RouterConfig
from agentrl.sandbox.config import DockerSandboxConfig, ProviderName, parse_provider
from agentrl.tasks.spec import AgentConfig, SnapshotPolicy
from agentrl.trajectory import StopReason, Trajectory

if TYPE_CHECKING:
    from agentrl.tasks.spec import Task
    from agentrl.yamlfile import Loc, YamlFile


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _backend_type(value: Any) -> str:
    """The backend's `type`, fsdp when left out."""
    found = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return str(found or "fsdp")


BackendConfig = Annotated[
    Annotated[FSDPConfig, Tag("fsdp")] | Annotated[TinkerConfig, Tag("tinker")],
    Discriminator(_backend_type),
]


class AlgorithmConfig(_Model):
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    overlong: Literal["mask", "train"] = Field(
        default="mask",
        description="an episode that ended context_limit: its reward still counts in its "
        "group's baseline, but its tokens are not trained on (mask, as DAPO's overlong "
        "filtering), or they are, with its advantage (train)",
    )

    def trains_on(self, trajectory: Trajectory) -> bool:
        """Whether the loss sees this trajectory's tokens (see `overlong`)."""
        return self.overlong == "train" or trajectory.stop_reason != StopReason.context_limit


class SyncSchedule(_Model):
    """Generate a whole batch with version v, train on it, publish v + 1, repeat."""

    type: Literal["sync"] = "sync"
    steps: int = Field(ge=1, description="trainer steps (one optimizer step each)")
    prompts_per_step: int = Field(ge=1, description="prompts (instances) per step")
    n_samples_per_prompt: int = Field(ge=1, description="episodes per prompt (a group)")


class AsyncSchedule(_Model):
    """Fully asynchronous: generation keeps producing groups into a bounded buffer while
    the trainer consumes mini-batches of `prompts_per_step` groups (B).

    At trainer step s admission keeps accepted + running <= (S + s) * B, so at most
    B * (S + 1) groups are buffered or running; S = 0 never lets generation run ahead of
    its update. A group may still be consumed more than S steps after it was scheduled
    (a long episode): it is trained on, with a warning, and its lag recorded.
    """

    type: Literal["async"]
    steps: int = Field(ge=1, description="trainer steps (one optimizer step each)")
    prompts_per_step: int = Field(ge=1, description="groups per mini-batch (B)")
    n_samples_per_prompt: int = Field(ge=1, description="episodes per prompt (a group)")
    max_staleness_steps: int = Field(
        default=1, ge=0, description="S: how many steps generation may run ahead of training"
    )
    filter_zero_variance: bool = Field(
        default=True,
        description="drop groups whose live episodes' rewards are all equal (no signal); "
        "their prompts count as used and their admission slots are freed",
    )
    filter_tolerance: float = Field(
        default=0.0, ge=0, description="rewards within this spread count as equal"
    )


class EvalConfig(_Model):
    holdout_every: int = Field(
        default=4, ge=2, description="every k-th instance of each task is held out for eval"
    )
    tasks: list[str] = Field(
        default_factory=list,
        description="held-out task files or folders (beside this file), evaluated whole; "
        "when given, every instance of `tasks:` trains and holdout_every is not used",
    )
    every: int = Field(
        default=0, ge=0, description="evaluate every k steps (0: only before and after)"
    )
    samples: int = Field(default=4, ge=1, description="episodes per held-out instance")

    @model_validator(mode="after")
    def _one_split(self) -> EvalConfig:
        if self.tasks and "holdout_every" in self.model_fields_set:
            raise ValueError(
                "holdout_every and tasks both name the held-out instances: keep one "
                "(tasks: held-out files evaluated whole; holdout_every: every k-th training one)"
            )
        return self


class CheckpointConfig(_Model):
    every: int = Field(default=0, ge=0, description="save every k steps (0: only at the end)")
    keep: int = Field(default=2, ge=1, description="complete checkpoints kept (newest)")


class TrainConfig(_Model):
    name: str = Field(description="run name (output folder default: runs/<name>)")
    tasks: list[str] = Field(min_length=1, description="task files or folders, beside this file")
    model: str = Field(default="embedded", description="'embedded' (SmolLM2-135M) or a model dir")
    backend: BackendConfig = Field(
        default_factory=FSDPConfig, description="fsdp (native, torch) or tinker (a Tinker service)"
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    schedule: SyncSchedule | AsyncSchedule = Field(discriminator="type")
    dispatcher: DispatchConfig = Field(default_factory=PipelineConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    servers: RouterConfig | None = Field(
        default=None,
        description="sample on these vLLM-compatible servers behind the router (the same "
        "config as --policy router:URL,...); default: the model in-process",
    )
    provider: ProviderName = Field(
        default="docker",
        description="the sandbox provider: docker, local (no isolation), or module:Class "
        "(one of your own; agentrl.sandbox.config)",
    )
    cluster: ClusterConfig | None = Field(
        default=None,
        description="run on a Ray cluster: sandboxes on its sandbox nodes, optionally sampler "
        "replicas and trainer ranks as actors (default: everything in this process)",
    )
    snapshots: SnapshotPolicy | None = Field(
        default=None, description="sandbox snapshots for replay; default: each task's own"
    )
    agent: AgentConfig | None = Field(
        default=None,
        description="play every task, trained and held out, with this external agent harness "
        "(docs/agents.md) instead of each task's own agent",
    )
    seed: int = Field(default=0, description="data order and the backend's RNGs")
    temperature: float | None = Field(
        default=None,
        gt=0,
        description="sample every task at this temperature, in training and evaluation "
        "(e.g. 1.0 for the tinker backend); null: each task's own sampling.temperature",
    )

    @model_validator(mode="after")
    def _groups(self) -> TrainConfig:
        estimator = self.algorithm.advantage.estimator
        if estimator in ("grpo", "dr_grpo", "rloo", "branch") and (
            self.schedule.n_samples_per_prompt < 2
        ):
            raise ValueError(
                f"advantage {estimator} compares the episodes of a prompt: "
                "schedule.n_samples_per_prompt must be at least 2"
            )
        try:
            self.backend.validate_loss(self.algorithm.loss)
        except ConfigError as e:  # pydantic keeps only the message: carry the fix in it
            raise ValueError(f"{e.message} ({e.fix})" if e.fix else e.message) from e
        if self.cluster is not None:
            if not isinstance(parse_provider(self.provider), DockerSandboxConfig):
                raise ValueError("cluster: sandbox nodes run Docker sandboxes; use provider docker")
            if isinstance(self.backend, TinkerConfig) and (
                self.cluster.samplers is not None or self.cluster.trainer is not None
            ):
                raise ValueError(
                    "cluster.samplers / cluster.trainer: the tinker backend trains and samples "
                    "on its service; remove them (sandboxes may still run on the cluster)"
                )
        if isinstance(self.backend, TinkerConfig) and self.servers is not None:
            raise ValueError(
                "servers: the tinker backend samples on the Tinker service's own sampling "
                "clients; remove servers (or use backend type fsdp)"
            )
        return self

    def local_sampler(self) -> LocalSamplerConfig:
        """The model in this process (or in each sampler actor); under the async schedule a
        publication decodes running replies on under the new weights (`keep`)."""
        keep = self.schedule.type == "async"
        return LocalSamplerConfig(model=self.model, publish_pause="keep" if keep else None)

    def sampler_config(self, replicas: Sequence[str] = ()) -> LocalSamplerConfig | RouterConfig:
        """What the fsdp backend trains through (tinker samples on its service): the router
        over `servers.urls` plus `replicas` (sampler actors' URLs), else the local model."""
        if self.servers is None and not replicas:
            return self.local_sampler()
        urls = [*(self.servers.urls if self.servers else []), *replicas]
        return (self.servers or RouterConfig(urls=urls)).model_copy(update={"urls": urls})


def load_train_config(path: str | Path) -> TrainConfig:
    """The validated config, or ConfigFileError listing every problem with its line.

    A `model:` folder resolves beside the config file (as `tasks:` do) and must hold what
    the run loads from it (the embedded model must be installed): looked at, never loaded.
    Its tasks are not read: `load_train` reads them too."""
    from agentrl.yamlfile import load_model

    def check(config: TrainConfig, file: YamlFile) -> TrainConfig:
        return _model_folder(config, Path(path), file)

    return load_model(Path(path), TrainConfig, what="train config", check=check)


@dataclass(frozen=True)
class TrainInputs:
    """A train config and the tasks it names, loaded as `agentrl train` starts from them."""

    config: TrainConfig
    tasks: list[Task]
    eval_tasks: list[Task]
    """`eval.tasks`, in order"""


def load_train(path: str | Path) -> TrainInputs:
    """The config at `path` and every task it names, loaded and checked against it as
    `agentrl train` needs them before its first step: the model folder, each task (and
    eval task) found and valid, a held-out split with instances on both sides, a first
    mini-batch that fills, one sampling temperature the backend can learn at.

    ConfigFileError lists every problem at once, at its line in the config or in a task
    file. Files only: no Docker, no model, no torch; `agentrl validate` of a train config
    is this call."""
    from agentrl.yamlfile import load_model

    tasks: list[Task] = []
    held: list[Task] = []

    def check(config: TrainConfig, file: YamlFile) -> TrainConfig:
        config = _model_folder(config, Path(path), file)
        base = Path(path).parent
        named = [("tasks", i, t) for i, t in enumerate(config.tasks)]
        named += [("eval", i, t) for i, t in enumerate(config.eval.tasks)]
        from agentrl.tasks.formats import expand

        wanted = 0
        for key, i, name in named:
            loc: Loc = ("tasks", i) if key == "tasks" else ("eval", "tasks", i)
            for each in expand([base / name]):  # a dataset folder: each of its tasks
                wanted += 1
                task = _load_task(each, name, loc, file)
                if task is not None:
                    (tasks if key == "tasks" else held).append(task)
        if len(tasks) + len(held) == wanted:  # the split needs every task
            _check_start(config, tasks, held, file)
        return config

    config = load_model(Path(path), TrainConfig, what="train config", check=check)
    return TrainInputs(config, tasks, held)


def _model_folder(config: TrainConfig, path: Path, file: YamlFile) -> TrainConfig:
    """`config` with its model folder resolved beside the config file; problems added
    when it is not there, lacks what the run loads, or the embedded model is missing."""
    if config.model == "embedded":
        from agentrl.errors import ModelNotFoundError
        from agentrl.inference.embedded import gguf_path

        try:
            gguf_path()
        except ModelNotFoundError as e:
            file.add(("model",), f"{e.message} ({e.fix})")
        return config
    folder = path.parent / config.model
    if not folder.is_dir():
        file.add(
            ("model",),
            f"model folder {config.model!r} not found ({folder.resolve()}): give 'embedded' "
            "or a folder with the model's config.json and weights (nothing is downloaded)",
        )
        return config
    if lacking := _model_lacks(folder, weights=config.backend.type == "fsdp"):
        file.add(("model",), f"model folder {config.model!r} ({folder.resolve()}) {lacking}")
    return config.model_copy(update={"model": str(folder.resolve())})


def _model_lacks(folder: Path, *, weights: bool) -> str | None:
    """What a model folder lacks that the run loads from it (the tokenizer always; the
    config and weights where the fsdp backend trains them), or None."""
    names = {p.name for p in folder.iterdir()}
    missing = []
    if weights and "config.json" not in names:
        missing.append("config.json")
    if weights and not any(n.endswith((".safetensors", ".bin")) for n in names):
        missing.append("weights (*.safetensors or *.bin)")
    if not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}:
        missing.append("tokenizer (tokenizer.json or tokenizer_config.json)")
    if not missing:
        return None
    return f"holds no {', no '.join(missing)}: save the model and its tokenizer there"


def split_sizes(
    config: TrainConfig, tasks: Sequence[Task], held: Sequence[Task]
) -> tuple[int, int]:
    """(training, held-out) instances: `eval.tasks` whole when given, else every
    `eval.holdout_every`-th instance of each task (the first included), as
    `agentrl.train.data.split` takes them."""
    if held:
        return sum(len(t.instances) for t in tasks), sum(len(t.instances) for t in held)
    k = config.eval.holdout_every
    out = sum((len(t.instances) + k - 1) // k for t in tasks)
    return sum(len(t.instances) for t in tasks) - out, out


def _load_task(path: Path, name: str, loc: Loc, file: YamlFile) -> Task | None:
    """The task at `path` (as `name` in the config, at `loc`); None with its problems added."""
    from agentrl.tasks.formats import load_any
    from agentrl.textfile import UnreadableFile
    from agentrl.yamlfile import ConfigFileError, Problem

    if not path.exists():
        file.add(loc, f"{name!r} not found (looked for {path.resolve()})")
        return None
    try:
        return load_any(path)
    except ConfigFileError as e:  # the task's own problems, at their lines in it
        file.problems += e.problems
    except UnreadableFile as e:
        file.problems.append(Problem(str(e.path), e.line, "file", e.reason))
    except ConfigError as e:
        file.add(loc, f"{e.message} ({e.fix})" if e.fix else e.message)
    return None


@dataclass(frozen=True)
class StartProblem:
    """Why a run of these tasks cannot start, at the config key that decides it."""

    loc: Loc
    message: str
    fix: str


def start_problems(
    config: TrainConfig, tasks: Sequence[Task], held: Sequence[Task]
) -> list[StartProblem]:
    """What keeps `config` from training on `tasks` (and the held-out `eval.tasks`): a
    split without instances on both sides, a first mini-batch that cannot fill, sampling
    the learner cannot reproduce. `agentrl validate` reports them at the config's lines
    (`load_train`); `Trainer` refuses to start on the first."""
    problems: list[StartProblem] = []
    n_train, n_held = split_sizes(config, tasks, held)
    if not n_train or not n_held:
        key = "tasks" if held else "holdout_every"
        given = key in config.eval.model_fields_set
        problems.append(
            StartProblem(
                ("eval", key) if given else ("tasks",),  # the line of what decides the split
                f"{n_train} training and {n_held} held-out instances",
                "give the tasks more instances, or change eval.holdout_every (or name "
                "held-out task files in eval.tasks)",
            )
        )
    sched = config.schedule
    if isinstance(sched, AsyncSchedule) and 0 < n_train < sched.prompts_per_step:
        problems.append(
            StartProblem(
                ("schedule", "prompts_per_step"),
                f"{n_train} training prompts cannot fill one mini-batch of "
                f"{sched.prompts_per_step} groups",
                "lower prompts_per_step or give the tasks more instances",
            )
        )
    sampling = sampling_problems([*tasks, *held], config.temperature)
    problems += sampling
    temps = {config.temperature or t.spec.sampling.temperature for t in [*tasks, *held]}
    if not sampling and len(temps) == 1 and isinstance(config.backend, TinkerConfig):
        try:  # the fsdp backend's check is about the machine it runs on: not here
            config.backend.model_copy(update={"temperature": temps.pop()}).check()
        except ConfigError as e:
            problems.append(StartProblem(("temperature",), e.message, e.fix or ""))
    return problems


def sampling_problems(tasks: Sequence[Task], override: float | None = None) -> list[StartProblem]:
    """Sampling the learner cannot reproduce: tasks at different temperatures (none set in
    the train config), top_p < 1, a temperature of 0."""
    problems: list[StartProblem] = []
    temps = sorted({override or t.spec.sampling.temperature for t in tasks})
    if len(temps) > 1:
        problems.append(
            StartProblem(
                ("tasks",),
                f"the tasks sample at different temperatures {temps}",
                "give every task the same sampling.temperature, or set temperature: in "
                "the train config",
            )
        )
    for t in tasks:
        if t.spec.sampling.top_p < 1.0:
            problems.append(
                StartProblem(
                    ("tasks",),
                    f"task {t.spec.name}: sampling.top_p {t.spec.sampling.top_p} < 1: the "
                    "learner cannot reproduce the logprobs of a truncated distribution",
                    "set sampling.top_p: 1.0 in tasks you train on",
                )
            )
    if temps == [0.0]:
        problems.append(
            StartProblem(
                ("tasks",),
                "sampling.temperature 0 (greedy) has no logprobs to learn from",
                "train with a temperature > 0 (e.g. 0.7 or 1.0)",
            )
        )
    return problems


def _check_start(
    config: TrainConfig, tasks: Sequence[Task], held: Sequence[Task], file: YamlFile
) -> None:
    """`start_problems`, at the config's lines."""
    for problem in start_problems(config, tasks, held):
        file.add(problem.loc, f"{problem.message}: {problem.fix}")
