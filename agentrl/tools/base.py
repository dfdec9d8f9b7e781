"""The tool seam: a name, a description, a JSON schema, and an async call.

Tools are registered by short name (a dict from name to dotted path, imported
lazily), so a task's YAML lists them by name; a full dotted path also works.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ConfigError
from agentrl.registry import resolve
from agentrl.sandbox.base import Sandbox


class Observation(BaseModel):
    """What a tool call returns to the agent (and to the trajectory's turn record)."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="what the agent sees (already truncated)")
    exit_code: int | None = Field(default=None, description="for command-like tools")
    error: bool = Field(default=False, description="the call failed (bad arguments, timeout...)")
    done: bool = Field(default=False, description="the episode ends (finish/submit)")
    answer: str | None = Field(default=None, description="the agent's final answer, if done")


class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object schema)."""

    async def __call__(self, sandbox: Sandbox, **arguments: Any) -> Observation: ...

    async def close(self) -> None:
        """Release per-episode state (shells, browser contexts); idempotent."""
        ...


def schema(tool: Tool) -> dict[str, Any]:
    """The tool as the function schema chat templates and prompts render."""
    return {"name": tool.name, "description": tool.description, "parameters": tool.parameters}


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
