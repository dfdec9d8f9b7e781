# Over 400 lines: the YAML task schema, field by field: the one page of code a task author reads.
"""The task format: what a YAML task file may say, as pydantic models (extra keys forbidden).

A task names its sandbox, its instances, its prompt, its tools, its limits, its
grader and its sampling defaults. Paths in a task are relative to the task file.
Semantic checks that need more than one field (placeholders vs instance fields,
tools that exist, files that exist) live in `agentrl.tasks.load`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.tasks.placeholders import Kind, fill
from agentrl.yamlnodes import Loc

DEFAULT_IMAGE = "agentrl/base:bookworm"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SandboxConfig(_Model):
    """Where the agent acts."""

    image: str | None = Field(default=None, description=f"image to start (default {DEFAULT_IMAGE})")
    recipe: str | None = Field(
        default=None, description="folder with a Dockerfile beside the task, built as the image"
    )
    workdir: str = Field(default="/workspace", description="the agent's working directory")
    cpus: float = Field(default=1.0, gt=0, description="CPU limit (cores)")
    memory_mb: int = Field(default=2048, ge=64, description="memory limit (MiB)")
    pids: int = Field(default=512, ge=16, description="process limit")
    disk_mb: int = Field(
        default=10240,
        ge=64,
        description="disk limit (MiB) on what the agent writes in the sandbox; past it the "
        "command writing is stopped and the agent told to delete files",
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment variables")
    network: bool = Field(
        default=False,
        description="the agent's turns need a network (e.g. to install packages): granted "
        "only where the user names a Docker network in $AGENTRL_AGENT_NETWORK (one that "
        "reaches only a package registry or its proxy, say); without it they have none "
        "and `agentrl check` says so",
    )
    setup: list[str] = Field(
        default_factory=list, description="commands run at INIT, before the agent's first turn"
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="sandbox path -> file or folder beside the task, copied in at INIT",
    )

    @model_validator(mode="after")
    def _one_image_source(self) -> SandboxConfig:
        if self.image and self.recipe:
            raise ValueError("give either `image` or `recipe`, not both")
        if not self.workdir.startswith("/"):
            raise ValueError(f"workdir must be an absolute path, got {self.workdir!r}")
        return self


class PromptConfig(_Model):
    """The conversation's first messages; `{field}` placeholders take instance fields."""

    system: str = Field(
        default="",
        description="system prompt; tool schemas are appended automatically (required unless "
        "an external agent brings its own)",
    )
    instance: str = Field(description="the first user message, per instance")
    action_format: Literal["tool_call", "bash_block"] = Field(
        default="tool_call",
        description="how the model acts: tool calls (the tools' schemas go into the system"
        " prompt), or, as in mini-SWE-agent, one ```bash code block per reply that runs in"
        " the bash tool (no schemas: the system prompt explains the format)",
    )
    template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra variables for the model's chat template, e.g. {enable_thinking: false}",
    )


class ToolConfig(_Model):
    """A tool by registered name, with constructor options."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class EpisodeLimits(_Model):
    """When an episode stops."""

    max_turns: int = Field(default=30, ge=1, description="assistant turns at most")
    max_new_tokens: int = Field(default=1024, ge=1, description="sampled tokens per turn")
    context_length: int = Field(default=8192, ge=64, description="prompt + response tokens")
    tool_timeout: float = Field(default=60.0, gt=0, description="seconds per tool call")
    episode_timeout: float = Field(
        default=1800.0,
        gt=0,
        description="seconds of the agent's own time per episode (RUN: tool calls and the "
        "loop; time waiting on or in the sampler is not counted)",
    )

    @model_validator(mode="after")
    def _possible(self) -> EpisodeLimits:
        if self.max_new_tokens >= self.context_length:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) must be below context_length "
                f"({self.context_length}): no room for the prompt"
            )
        if self.tool_timeout > self.episode_timeout:
            raise ValueError(
                f"tool_timeout ({self.tool_timeout:g} s) is longer than episode_timeout "
                f"({self.episode_timeout:g} s)"
            )
        return self


class _GraderBase(_Model):
    files: dict[str, str] = Field(
        default_factory=dict,
        description="sandbox path -> file or folder beside the task, copied in at EVAL only",
    )
    timeout: float = Field(default=600.0, gt=0, description="seconds for grading")
    network: bool = Field(
        default=False,
        description="grading may use the network: the Docker network named by "
        "$AGENTRL_EVAL_NETWORK is connected at EVAL (after the agent's processes are "
        "stopped); the agent's turns never have one",
    )
    outputs: list[str] = Field(
        default_factory=list,
        description="absolute paths or glob patterns whose changes the grader sees as the "
        "agent left them, beyond the workdir and the paths the grader's files name (e.g. "
        "/usr/local/lib/python3*/dist-packages/*.pth for a package the tests import); "
        "everything else the agent changed is graded as the image has it",
    )

    @field_validator("outputs")
    @classmethod
    def _absolute_outputs(cls, value: list[str]) -> list[str]:
        relative = [v for v in value if not v.startswith("/")]
        if relative:
            raise ValueError(f"outputs must be absolute paths, not {relative}")
        return value


class CommandGrader(_GraderBase):
    """Run a command: exit code 0 gives 1.0 (any other 0.0), or read a number from
    `reward_file`."""

    type: Literal["command"]
    command: str = Field(
        description="run with bash -c in the sandbox's workdir; {field} placeholders"
    )
    reward_file: str | None = Field(
        default=None,
        description="if set, the reward is the number the command wrote here (or a JSON "
        'object with a numeric "reward"; its other keys become reward components), whatever '
        "the exit code; deleted before the command runs, so a file the agent left never counts",
    )


class PytestGrader(_GraderBase):
    """Run the listed tests with pytest; reward 1.0 when every one of them passes (PASSED or
    XFAIL), else 0.0. A listed test pytest does not report counts as not passing; when it
    reports none of them the tests did not run, and whether they run where the task's
    reference solution ran decides the episode's grade."""

    type: Literal["pytest"]
    fail_to_pass: list[str] | str = Field(
        default="FAIL_TO_PASS",
        description="tests the agent's work must make pass: a list of pytest node ids "
        "(`/tests/test_x.py::test_y`: a path absolute or relative to the workdir, "
        "{field} placeholders), or the name of the instance field that lists them (a list "
        "or JSON text of one, as SWE-bench rows carry)",
    )
    pass_to_pass: list[str] | str = Field(
        default="PASS_TO_PASS",
        description="tests that must keep passing, given like fail_to_pass; `[]` for none",
    )
    command: str = Field(
        default="python3 -m pytest -rA -p no:cacheprovider",
        description="the pytest invocation, run with bash -c in the workdir; the test ids "
        "are appended (and -rA, whose summary is read, if missing); {field} placeholders",
    )


class PythonGrader(_GraderBase):
    """Call `module:function(sandbox, instance)` on this machine; it returns a reward (a
    number), a dict with a numeric "reward" (its "output" becomes the evidence's output,
    its other keys reward components), or a `Grade`. An `async def` is awaited within
    `timeout`; the sandbox's methods are coroutines (`exec`, `read_file`, `write_file`)."""

    type: Literal["python"]
    function: str = Field(
        pattern=r"^[\w.]+:\w+$",
        description="module:function, importable, or a module file beside the task "
        "(`grade:score` is score() in grade.py next to the task file)",
    )


class EnvironmentGrader(_GraderBase):
    """The environment's own rewards: each step's reward, as the environment's server gave
    it (an OpenEnv environment: `agentrl.tasks.openenv`), is the turn's reward; the
    episode's is their sum, or the last one given. Nothing runs at EVAL."""

    type: Literal["environment"]
    reward: Literal["sum", "last"] = Field(
        default="sum",
        description="the episode's reward: the sum of its steps' rewards, or the last one",
    )


Grader = Annotated[
    CommandGrader | PytestGrader | PythonGrader | EnvironmentGrader, Field(discriminator="type")
]


class SamplingDefaults(_Model):
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: list[str] = Field(
        default_factory=list,
        description="strings that end a reply (kept in it), e.g. a closing code fence, so "
        "the model acts as soon as its action is complete instead of rambling on",
    )

    @field_validator("stop")
    @classmethod
    def _nonempty(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop


class SnapshotPolicy(_Model):
    """When RUN commits the sandbox, so that a failed episode can be replayed from a turn."""

    every: int = Field(
        default=0,
        ge=0,
        description="snapshot after INIT and after every k-th turn; 0 turns snapshots off",
    )
    keep_successful: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of successful episodes (full reward) whose snapshots are kept; "
        "every other episode's are always kept",
    )
    keep_every: int = Field(
        default=0,
        ge=0,
        description="once an episode is over, keep only its snapshots after INIT and every "
        "k-th turn (0: all it made): `every: 1` lets a killed run go on from the last turn "
        "while replay keeps a sparser trail (it restores the nearest earlier one)",
    )
    keep_gb: float | None = Field(
        default=None,
        gt=0,
        description="the most disk (GiB) the snapshots that finished episodes keep may take, "
        "per task and run: past it, the episodes that finished first lose theirs (a long "
        "training run keeps a window of its newest failures); none: no bound",
    )


DEFAULT_SUMMARY_PROMPT = (
    "The conversation is about to exceed the context window. Summarize what you have done "
    "and learned so far (commands run, files changed, what remains), so that you can "
    "continue from your summary alone. Reply with the summary only, no tool call."
)


class ContextPolicy(_Model):
    """How a long episode keeps within the context window. Each change of history
    (dropping turns, a summary) continues the episode in a new trajectory segment."""

    observation_tokens: int | None = Field(
        default=None,
        ge=16,
        description="an observation longer than this many tokens keeps its head and tail "
        "(half each) and says how many tokens were cut between them",
    )
    history: Literal["keep", "drop_oldest", "summarize"] = Field(
        default="keep",
        description="when the next turn would pass budget_tokens: keep everything (the "
        "episode ends context_limit when it is full), drop the oldest turns, or ask the "
        "policy for a summary that replaces them",
    )
    budget_tokens: int | None = Field(
        default=None,
        ge=64,
        description="prompt tokens + max_new_tokens above which history is dropped or "
        "summarized (default: limits.context_length; with summarize, less summary_tokens "
        "and the request's own tokens, so that the summary has its room)",
    )
    keep_turns: int = Field(
        default=1,
        ge=0,
        description="the most recent turns, kept verbatim: drop_oldest never drops them, "
        "summarize keeps them after the summary",
    )
    summary_prompt: str = Field(
        default=DEFAULT_SUMMARY_PROMPT, description="what the policy is asked to summarize"
    )
    summary_tokens: int = Field(default=256, ge=1, description="max tokens of the summary")


class AgentConfig(_Model):
    """An external agent harness that plays the episode instead of agentrl's own loop: a
    command agentrl starts per episode, pointed at a gateway session (an OpenAI-compatible
    endpoint that records every call token-exactly: `agentrl.gateway`)."""

    command: str = Field(
        min_length=1,
        description="run with bash -c; $OPENAI_BASE_URL, $OPENAI_API_KEY, $AGENTRL_MODEL, "
        "$AGENTRL_TASK (the instance's prompt.instance text), $AGENTRL_TASK_FILE, "
        "$AGENTRL_AGENT_DIR, and beside the sandbox $AGENTRL_EXEC_URL, $AGENTRL_HARNESSES and "
        "$AGENTRL_TASK_DIR are set",
    )
    name: str | None = Field(
        default=None, description="what trajectories call it (default: the command's first word)"
    )
    where: Literal["beside", "sandbox"] = Field(
        default="beside",
        description="beside: on this machine, acting on the sandbox through $AGENTRL_EXEC_URL; "
        "sandbox: inside the sandbox (the harness must be installed in its image)",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="more environment variables for it; $NAME in a value is replaced by the "
        "variable's value (agentrl's own above included)",
    )
    ok_exit_codes: list[int] = Field(
        default_factory=lambda: [0],
        description="exit codes of a harness that ended normally; any other ends the episode "
        "as an infrastructure failure (never graded), unless agentrl stopped the harness",
    )
    stop_grace: float = Field(
        default=10.0,
        ge=0,
        description="seconds a harness has to exit once its episode is over (max_turns, "
        "context_limit) before it is killed",
    )


def _default_tools() -> list[str | ToolConfig]:
    return ["bash", "str_replace_editor", "finish"]


class TaskSpec(_Model):
    """One task file."""

    name: str = Field(pattern=r"^[A-Za-z0-9][\w.-]*$", description="short id, used in run dirs")
    description: str = ""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    instances: list[dict[str, Any]] | str = Field(
        description="inline list of dicts with an `id`, or a .jsonl/.yaml/.csv file beside the task"
    )
    prompt: PromptConfig
    tools: list[str | ToolConfig] = Field(default_factory=lambda: _default_tools())
    limits: EpisodeLimits = Field(default_factory=EpisodeLimits)
    context: ContextPolicy = Field(default_factory=ContextPolicy)
    grader: Grader
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    snapshots: SnapshotPolicy = Field(default_factory=SnapshotPolicy)
    agent: AgentConfig | None = Field(
        default=None,
        description="an external agent harness instead of agentrl's loop (prompt.system and "
        "tools then do not apply: the harness brings its own)",
    )
    oracle: list[str] = Field(
        default_factory=list,
        description="the reference solution: shell commands (with {field} placeholders) that "
        "solve an instance when run in its sandbox after INIT; `agentrl check` runs them",
    )
    environment: str | None = Field(
        default=None,
        description="an OpenEnv environment folder (openenv.yaml) beside the task: its server "
        "is the sandbox, its actions are the tools (`tools:` may add finish or submit), each "
        "instance's fields are the arguments of its reset(); graded by `type: environment`",
    )

    @model_validator(mode="after")
    def _environment_fits(self) -> TaskSpec:
        if self.environment is None:
            if self.grader.type == "environment":
                raise ValueError(
                    "grader type environment grades an OpenEnv environment's steps: name its "
                    "folder in `environment:`"
                )
            return self
        if self.grader.type != "environment":
            raise ValueError(
                "an environment: task is graded by its steps: grader: {type: environment}"
            )
        other = [c.name for c in self.tool_configs() if c.name not in ("finish", "submit")]
        if other:
            raise ValueError(
                f"an environment's actions are its tools; tools: may add finish or submit, not "
                f"{', '.join(other)} (they would act on the environment's own container)"
            )
        box = self.sandbox
        if box.image or box.recipe or box.files or box.setup or self.oracle or self.agent:
            raise ValueError(
                "an environment: task's sandbox is the environment's own image: no "
                "sandbox.image, recipe, files or setup, no oracle, no agent"
            )
        return self

    @model_validator(mode="after")
    def _context_fits(self) -> TaskSpec:
        if self.agent is None and "system" not in self.prompt.model_fields_set:
            raise ValueError("prompt.system is required (only an external agent brings its own)")
        context, limits = self.context, self.limits
        budget = context.budget_tokens
        if budget is not None and budget > limits.context_length:
            raise ValueError(
                f"context.budget_tokens ({budget}) is above limits.context_length "
                f"({limits.context_length})"
            )
        if budget is not None and context.history == "keep":
            raise ValueError("context.budget_tokens does nothing with history: keep")
        if budget is None:  # context.budget's default, less the summary request (unknown here)
            summary = context.summary_tokens if context.history == "summarize" else 0
            budget_or_default = limits.context_length - summary
        else:
            budget_or_default = budget
        room = budget_or_default - limits.max_new_tokens  # for a prompt
        if budget is not None and room <= 0:
            raise ValueError(
                f"context.budget_tokens ({budget}) leaves no room for a prompt beside "
                f"limits.max_new_tokens ({limits.max_new_tokens})"
            )
        if context.history == "summarize" and context.summary_tokens >= room:
            raise ValueError(
                f"context.summary_tokens ({context.summary_tokens}) leaves no room for the "
                f"prompt after a summary: the budget ({room + limits.max_new_tokens}"
                f"{'' if budget is not None else ', by default the context less the summary'}"
                f") less limits.max_new_tokens ({limits.max_new_tokens}) is {room}"
            )
        return self

    def tool_configs(self) -> list[ToolConfig]:
        return [ToolConfig(name=t) if isinstance(t, str) else t for t in self.tools]

    def templates(self) -> list[tuple[Loc, str, Kind]]:
        """Every template the task holds, where it is and how it is filled: the prompts,
        the setup, oracle and grader commands, the reward file and the listed test ids."""
        out: list[tuple[Loc, str, Kind]] = [
            (("prompt", "system"), self.prompt.system, "prompt"),
            (("prompt", "instance"), self.prompt.instance, "prompt"),
        ]
        out += [(("sandbox", "setup", i), c, "shell") for i, c in enumerate(self.sandbox.setup)]
        out += [(("oracle", i), c, "shell") for i, c in enumerate(self.oracle)]
        grader = self.grader
        if isinstance(grader, CommandGrader | PytestGrader):
            out.append((("grader", "command"), grader.command, "shell"))
        if isinstance(grader, CommandGrader) and grader.reward_file is not None:
            out.append((("grader", "reward_file"), grader.reward_file, "shell"))
        if isinstance(grader, PytestGrader):
            for key in ("fail_to_pass", "pass_to_pass"):
                ids = getattr(grader, key)
                if isinstance(ids, list):
                    out += [(("grader", key, i), t, "shell") for i, t in enumerate(ids)]
        return out


class Instance(_Model):
    """One instance of a task: an id and the fields its templates and grader use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    fields: dict[str, Any] = Field(default_factory=dict)

    def render(self, template: str, kind: Kind = "prompt") -> str:
        """`template` with `{field}` placeholders (and `{id}`) filled; `{{` is a literal brace.

        One way for every template (`agentrl.tasks.placeholders`): only plain names are
        filled, a format spec, conversion, attribute or index (`{f:d}`, `{f!r}`, `{f.stem}`,
        `{f[0]}`) is a ValueError, never code run on a field's value (`agentrl validate`
        reports them at their line). A shell template leaves the shell's braces as written.
        """
        return fill(template, {**self.fields, "id": self.id}, kind)


class Task(_Model):
    """A loaded, validated task: the spec, where it lives, its instances, its hash."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: TaskSpec
    path: str = Field(description="the task file (or folder, for imported formats)")
    base_dir: str = Field(description="relative paths in the spec resolve against this")
    instances: list[Instance]
    hash: str = Field(description="sha256 of the task's files, for the trajectory's env record")
    env: str = Field(
        default="agentrl.tasks.env:TaskEnv",
        description="module:Class of the INIT/EVAL runtime (SWE-bench gives each instance its "
        "image)",
    )
    format: str = Field(
        default="agentrl",
        description="what the task was read as: agentrl (YAML), terminal-bench, harbor, "
        "swe-bench, swe-gym, swe-smith, r2e-gym",
    )
