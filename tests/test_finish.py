"""finish and submit end the episode with the agent's text; bad arguments do not."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

import pytest

from agentrl.sandbox import provider
from agentrl.sandbox.base import Sandbox, SandboxSpec
from agentrl.tools.base import Observation, Tool, schema, tool_class
from agentrl.tools.finish import FinishTool, SubmitTool


def call(tool: Tool, **arguments: object) -> Observation:
    """Calls the tool with a real (local) sandbox, which it must ignore."""

    async def main() -> Observation:
        sandbox: Sandbox = await provider("local").start(
            SandboxSpec(run_id=f"test-finish-{uuid.uuid4().hex[:8]}")
        )
        try:
            return await tool(sandbox, **arguments)
        finally:
            await tool.close()
            await sandbox.close()

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("name", "cls", "required"), [("finish", FinishTool, []), ("submit", SubmitTool, ["answer"])]
)
def test_registered_with_an_object_schema(name: str, cls: type, required: list[str]) -> None:
    assert tool_class(name) is cls
    tool = cls()
    rendered = json.loads(json.dumps(schema(tool)))
    assert rendered["name"] == name
    assert rendered["description"]
    parameters = rendered["parameters"]
    assert parameters["type"] == "object"
    assert parameters["required"] == required
    assert parameters["additionalProperties"] is False
    assert all(prop["type"] == "string" for prop in parameters["properties"].values())


def test_finish_ends_the_episode_with_or_without_a_message() -> None:
    observation = call(FinishTool())
    assert observation.done
    assert not observation.error
    assert observation.answer is None
    observation = call(FinishTool(), message="fixed the bug in parser.py")
    assert observation.done
    assert observation.answer == "fixed the bug in parser.py"


def test_submit_ends_the_episode_with_the_answer() -> None:
    observation = call(SubmitTool(), answer="42")
    assert (observation.done, observation.error, observation.answer) == (True, False, "42")
    observation = call(SubmitTool(), answer=42)  # a number from the JSON call is written out
    assert observation.answer == "42"
    observation = call(SubmitTool(), answer="")
    assert observation.done
    assert observation.answer == ""


@pytest.mark.parametrize(
    ("make", "arguments", "fragment"),
    [
        (SubmitTool, {}, "the `answer` argument is required"),
        (SubmitTool, {"answer": ["a"]}, "`answer` must be a string, got list"),
        (SubmitTool, {"answer": "a", "why": "b"}, "unknown argument(s) why; it accepts: answer"),
        (FinishTool, {"message": {"a": 1}}, "`message` must be a string, got dict"),
        (FinishTool, {"answer": "a"}, "unknown argument(s) answer; it accepts: message"),
        (FinishTool, {"sandbox": "a"}, "unknown argument(s) sandbox"),  # any name is the model's
    ],
)
def test_bad_arguments_do_not_end_the_episode(
    make: Callable[[], Tool], arguments: dict[str, object], fragment: str
) -> None:
    observation = call(make(), **arguments)
    assert observation.error
    assert not observation.done
    assert fragment in observation.text


def test_close_is_idempotent() -> None:
    async def main(tool: Tool) -> None:
        await tool.close()
        await tool.close()

    for tool in (FinishTool(), SubmitTool()):
        asyncio.run(main(tool))
