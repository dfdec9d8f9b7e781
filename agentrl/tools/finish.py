"""The tools that end an episode: `finish` (an optional message) and `submit` (an answer).

Neither touches the sandbox; the observation carries `done=True` and the agent's text
as `answer`, which the ReAct loop turns into the `finished` stop reason.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from agentrl.sandbox.base import Sandbox
from agentrl.tools.base import ModelTool, Observation, ToolArgs, ToolOptions


class _Text(ToolArgs):
    # A number in the JSON call is written out as text; true/false is refused.
    model_config = ConfigDict(coerce_numbers_to_str=True)


class FinishArgs(_Text):
    message: str | None = Field(
        default=None, description="Optional short summary of what was done."
    )


class SubmitArgs(_Text):
    answer: str = Field(description="Your final answer.")


class FinishTool(ModelTool[FinishArgs, ToolOptions]):
    """Ends the episode; the optional `message` becomes the answer."""

    name = "finish"
    description = (
        "Finish the task and end the episode. Call it once you have completed the task "
        "(or cannot make further progress). Optionally include a short `message` "
        "summarising what you did."
    )
    Args = FinishArgs
    Options = ToolOptions

    async def run(self, sandbox: Sandbox, args: FinishArgs) -> Observation:
        return Observation(text="Finished; the episode ends.", done=True, answer=args.message)


class SubmitTool(ModelTool[SubmitArgs, ToolOptions]):
    """Ends the episode with the agent's `answer` (required)."""

    name = "submit"
    description = (
        "Submit your final answer and end the episode. You cannot act after submitting, "
        "so call it only when you are sure."
    )
    Args = SubmitArgs
    Options = ToolOptions

    async def run(self, sandbox: Sandbox, args: SubmitArgs) -> Observation:
        return Observation(
            text="Answer submitted; the episode ends.", done=True, answer=args.answer
        )
