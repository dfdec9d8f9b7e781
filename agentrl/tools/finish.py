"""The tools that end an episode: `finish` (an optional message) and `submit` (an answer).

Neither touches the sandbox; the observation carries `done=True` and the agent's text
as `answer`, which the ReAct loop turns into the `finished` stop reason.
"""

from __future__ import annotations

from typing import Any

from agentrl.sandbox.base import Sandbox
from agentrl.tools.base import Observation


def _text_argument(arguments: dict[str, Any], key: str) -> str | None:
    """The argument as a string (numbers are accepted and written out); None if absent."""
    value = arguments.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise TypeError(f"`{key}` must be a string, got {type(value).__name__}")


def _unknown(arguments: dict[str, Any], allowed: set[str], tool: str) -> Observation | None:
    extra = sorted(set(arguments) - allowed)
    if not extra:
        return None
    accepted = ", ".join(sorted(allowed))
    return Observation(
        text=f"{tool} got unknown argument(s) {', '.join(extra)}; it accepts: {accepted}",
        error=True,
    )


class FinishTool:
    """Ends the episode; the optional `message` becomes the answer."""

    name = "finish"
    description = (
        "Finish the task and end the episode. Call it once you have completed the task "
        "(or cannot make further progress). Optionally include a short `message` "
        "summarising what you did."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "message": {
                "type": "string",
                "description": "Optional short summary of what was done.",
            },
        },
        "required": [],
        "additionalProperties": False,
    }

    async def __call__(self, sandbox: Sandbox, **arguments: Any) -> Observation:
        if problem := _unknown(arguments, {"message"}, self.name):
            return problem
        try:
            message = _text_argument(arguments, "message")
        except TypeError as e:
            return Observation(text=f"finish: {e}", error=True)
        return Observation(text="Finished; the episode ends.", done=True, answer=message)

    async def close(self) -> None:
        return None


class SubmitTool:
    """Ends the episode with the agent's `answer` (required)."""

    name = "submit"
    description = (
        "Submit your final answer and end the episode. You cannot act after submitting, "
        "so call it only when you are sure."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "description": "Your final answer."},
        },
        "required": ["answer"],
        "additionalProperties": False,
    }

    async def __call__(self, sandbox: Sandbox, **arguments: Any) -> Observation:
        if problem := _unknown(arguments, {"answer"}, self.name):
            return problem
        try:
            answer = _text_argument(arguments, "answer")
        except TypeError as e:
            return Observation(text=f"submit: {e}", error=True)
        if answer is None:
            return Observation(text="submit: the `answer` argument is required", error=True)
        return Observation(text="Answer submitted; the episode ends.", done=True, answer=answer)

    async def close(self) -> None:
        return None
