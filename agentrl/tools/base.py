"""The tool seam: a name, a description, a JSON schema, and an async call.

`Tool` is the protocol an episode calls. `ModelTool` is the shared behaviour of the
shipped tools: each declares an `Args` model (what a call takes) and an `Options` model
(what a task's YAML may set), and from those two classes come the JSON schema the model
is shown, the check of every call's arguments (a bad call is an error observation that
says what is wrong), the check of options when a tool is built, and `agentrl validate`'s
option problems. Tools are registered by short name (a dict from name to dotted path,
imported lazily), so a task's YAML lists them by name; a full dotted path also works.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import ConfigError
from agentrl.registry import resolve
from agentrl.sandbox.base import Sandbox
from agentrl.yamlfile import Loc, readable, suggest


class Observation(BaseModel):
    """What a tool call returns to the agent (and to the trajectory's turn record)."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="what the agent sees (already truncated)")
    exit_code: int | None = Field(default=None, description="for command-like tools")
    error: bool = Field(default=False, description="the call failed (bad arguments, timeout...)")
    done: bool = Field(default=False, description="the episode ends (finish/submit)")
    answer: str | None = Field(default=None, description="the agent's final answer, if done")
    reward: float | None = Field(
        default=None, description="the environment's reward for this step (OpenEnv), if it gave one"
    )


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object schema)."""

    async def __call__(self, sandbox: Sandbox, /, **arguments: Any) -> Observation:
        """Positional `sandbox`: a model's arguments may use any name, even "sandbox"."""
        ...

    async def close(self, *, keep_processes: bool = False) -> None:
        """Release per-episode state (shells, browser contexts); idempotent.
        `keep_processes` (EVAL): stop acting, but leave what the agent's commands started
        running (a server it left up answers the grader, as under the harnesses); a later
        plain `close()` ends it all."""
        ...


class ToolArgs(BaseModel):
    """Base of a tool's arguments: unknown ones are refused (the schema says so)."""

    model_config = ConfigDict(extra="forbid")


class ToolOptions(BaseModel):
    """Base of a tool's options, as a task's `tools: [{name, options}]` gives them."""

    model_config = ConfigDict(extra="forbid")


A = TypeVar("A", bound=BaseModel)
Opts = TypeVar("Opts", bound=BaseModel)


class ModelTool(ABC, Generic[A, Opts]):
    """A tool whose arguments and options are pydantic models (`Args`, `Options`).

    `__call__` validates the model's arguments into `Args` and hands them to `run`; a
    call that does not fit is an error observation, never an exception. An exception
    raised inside `run` (a TypeError too) is the tool's own bug and propagates.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    Args: type[A]
    Options: type[Opts]

    def __init__(self, **options: Any) -> None:
        self.options: Opts = build_options(type(self), options)

    @functools.cached_property
    def parameters(self) -> dict[str, Any]:
        # Built once per tool: a prompt check renders it for every instance of a task.
        return args_schema(self.Args)

    async def __call__(self, sandbox: Sandbox, /, **arguments: Any) -> Observation:
        try:
            args = self.Args.model_validate(arguments)
        except ValidationError as e:
            return Observation(text=f"error: {explain(self.name, self.Args, e)}", error=True)
        return await self.run(sandbox, args)

    @abstractmethod
    async def run(self, sandbox: Sandbox, args: A) -> Observation:
        """Act on the validated arguments."""

    async def close(self, *, keep_processes: bool = False) -> None:
        return None


def build_options(cls: type, options: dict[str, Any]) -> Any:
    """`options` as `cls.Options`; ConfigError naming every problem."""
    try:
        return (options_model(cls) or ToolOptions).model_validate(options)
    except ValidationError as e:
        lines = [
            f"{'.'.join(map(str, loc))}: {message}" if loc else message
            for loc, message in option_problems(cls, e)
        ]
        raise ConfigError(f"{cls.__name__}: " + "; ".join(lines)) from e


def options_model(cls: type) -> type[BaseModel] | None:
    """The options a tool class declares; None for a tool without an `Options` model
    (its constructor alone checks what it is given)."""
    model = getattr(cls, "Options", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def option_problems(cls: type, error: ValidationError) -> list[tuple[Loc, str]]:
    """(where under `options`, message) for each problem, as `agentrl validate` reports them."""
    names = list((options_model(cls) or ToolOptions).model_fields)
    out: list[tuple[Loc, str]] = []
    for e in error.errors():
        loc = tuple(e["loc"])
        if e["type"] == "extra_forbidden":
            key = str(loc[-1])
            its = f"; its options: {', '.join(names) or 'none'}"
            out.append((loc, f"{cls.__name__} has no option {key!r}{suggest(key, names)}{its}"))
        elif e["type"] == "value_error":  # the Options model's own check says it all
            message = e["msg"].removeprefix("Value error, ")
            out.append((loc, message))
        else:
            out.append((loc, readable(e)))
    return out


# -- the schema the model is shown --------------------------------------------------------

_FIRST = ("type", "enum", "items", "minItems", "maxItems")


def args_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The arguments as the object schema chat templates render: no titles or defaults,
    an optional argument shown as its type, `type` first and `description` last."""
    raw = model.model_json_schema()
    properties = {}
    for name, prop in raw.get("properties", {}).items():
        options = [p for p in prop.get("anyOf", []) if p != {"type": "null"}]
        merged = {**prop, **options[0]} if len(options) == 1 else prop
        kept = {k: v for k, v in merged.items() if k not in ("title", "default", "anyOf")}
        ordered = {k: kept[k] for k in _FIRST if k in kept}
        ordered |= {k: v for k, v in kept.items() if k not in ordered and k != "description"}
        if "description" in kept:
            ordered["description"] = kept["description"]
        properties[name] = ordered
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": raw.get("required", []),
    }
    if model.model_config.get("extra") == "forbid":
        schema["additionalProperties"] = False
    return schema


def schema(tool: Tool) -> dict[str, Any]:
    """The tool as the function schema chat templates and prompts render."""
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters}


# -- what a bad call tells the model ------------------------------------------------------

_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "a list",
}


def explain(tool: str, model: type[BaseModel], error: ValidationError) -> str:
    """One line that says what is wrong with a call's arguments and how to call it."""
    accepted = ", ".join(model.model_fields)
    problems, unknown = [], []
    for e in error.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        if e["type"] == "extra_forbidden":
            unknown.append(field)
        elif e["type"] == "missing":
            problems.append(f"the `{field}` argument is required{_choices(model, field)}")
        elif e["type"] == "literal_error":
            problems.append(f"unknown {field} {e['input']!r}{_choices(model, field)}")
        elif e["type"] in _EXPECTED:
            what = type(e["input"]).__name__
            problems.append(f"`{field}` must be {_EXPECTED[e['type']]}, got {what}")
        elif e["type"] == "value_error":  # the Args model's own check says it all
            problems.append(str(e["ctx"]["error"]))
        else:
            problems.append(f"`{field}`: {e['msg']}")
    if unknown:
        problems.append(f"unknown argument(s) {', '.join(unknown)}; it accepts: {accepted}")
    return f"{tool}: " + "; ".join(problems)


def _choices(model: type[BaseModel], field: str) -> str:
    info = model.model_fields.get(field)
    enum = args_schema(model)["properties"].get(field, {}).get("enum") if info else None
    if not enum:
        return ""
    shown = [str(v) for v in enum]
    return f"; use one of: {', '.join(shown[:-1])} or {shown[-1]}" if len(shown) > 1 else ""


# -- the registry -------------------------------------------------------------------------

REGISTRY: dict[str, str] = {
    "bash": "agentrl.tools.bash:BashTool",
    "str_replace_editor": "agentrl.tools.editor:EditorTool",
    "browser": "agentrl.tools.browser:BrowserTool",
    "finish": "agentrl.tools.finish:FinishTool",
    "submit": "agentrl.tools.finish:SubmitTool",
}


def tool_class(name: str) -> type:
    """Resolve a registered short name or a `module:Class` path; unknown names list choices."""
    cls = resolve(REGISTRY, name, "tool")
    if not isinstance(cls, type):
        raise ConfigError(f"tool {name!r} is not a class")
    return cls
