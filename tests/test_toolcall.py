"""Tool calls are found in both formats models are trained on; broken ones say how to fix;
a tool's Args model is both the schema shown and the check of a call."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import Field, ValidationError

from agentrl.toolcall import ToolCallError, parse_bash_block, parse_tool_call
from agentrl.tools.base import REGISTRY, ToolArgs, args_schema, explain, schema, tool_class
from agentrl.tools.bash import BashTool


def test_hermes_json_call() -> None:
    call_json = '{"name": "bash", "arguments": {"command": "ls -la"}}'
    text = f"Let me look.\n<tool_call>\n{call_json}\n</tool_call>"
    call = parse_tool_call(text)
    assert call is not None and (call.name, call.arguments) == ("bash", {"command": "ls -la"})


def test_hermes_double_encoded_arguments_and_missing_close_tag() -> None:
    call = parse_tool_call('<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}')
    assert call is not None and call.arguments == {"command": "pwd"}


def test_function_parameter_call_keeps_code_verbatim() -> None:
    text = (
        "I will edit.\n<function=str_replace_editor>\n<parameter=command>str_replace</parameter>\n"
        "<parameter=path>/workspace/a.py</parameter>\n"
        "<parameter=old_str>\n    x = 1\n</parameter>\n"
        "<parameter=new_str>\n    x = {'a': 2}\n</parameter>\n</function>"
    )
    call = parse_tool_call(text)
    assert call is not None and call.name == "str_replace_editor"
    assert call.arguments == {
        "command": "str_replace",
        "path": "/workspace/a.py",
        "old_str": "    x = 1",
        "new_str": "    x = {'a': 2}",
    }


def test_first_call_wins_and_plain_text_has_none() -> None:
    text = (
        '<function=finish></function> then <tool_call>{"name": "bash", "arguments": {}}</tool_call>'
    )
    call = parse_tool_call(text)
    assert call is not None and call.name == "finish"
    assert parse_tool_call("I think the answer is 42.") is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
        ('<tool_call>{"name": "bash", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "bash", "arguments": "{oops"}</tool_call>', "not JSON"),
    ],
)
def test_broken_calls_explain_the_format(text: str, words: str) -> None:
    with pytest.raises(ToolCallError) as info:
        parse_tool_call(text)
    assert words in str(info.value) and "<tool_call>" in str(info.value)


def test_bash_block_is_a_bash_call_and_only_the_first_block_counts() -> None:
    text = "Sure.\n```bash\nmkdir -p build\ncd build\n```\nthen\n```bash\nrm -rf /\n```"
    call = parse_bash_block(text)
    assert call is not None and call.name == "bash"
    assert call.arguments == {"command": "mkdir -p build\ncd build"}
    for fence in ("```sh\nls\n```", "```\nls\n```", "```shell \nls\n```"):
        call = parse_bash_block(fence)
        assert call is not None and call.arguments == {"command": "ls"}


def test_bash_block_absent_empty_or_of_another_language() -> None:
    assert parse_bash_block("touch a.txt") is None
    assert parse_bash_block("```python\nopen('a.txt', 'w')\n```") is None
    assert parse_bash_block("```bash\ntouch a.txt") is None  # never closed: not run
    with pytest.raises(ToolCallError, match="empty"):
        parse_bash_block("```bash\n\n```")


def test_a_closing_fence_never_opens_a_block() -> None:
    text = "```python\nx = 1\n```\nNow run it:\n```bash\npython x.py\n```"
    call = parse_bash_block(text)
    assert call is not None and call.arguments == {"command": "python x.py"}


class _Args(ToolArgs):
    path: str = Field(description="where")
    lines: list[int] | None = Field(default=None, min_length=2, max_length=2, description="range")
    mode: Literal["read", "write"] = Field(default="read", description="how")


def test_a_tools_args_model_is_the_schema_the_model_sees() -> None:
    """No pydantic artefacts (titles, defaults, anyOf for an optional argument) reach the
    chat template; keys come in the order the shipped tools always showed them."""
    assert json.dumps(args_schema(_Args)) == json.dumps(
        {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "where"},
                "lines": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "minItems": 2,
                    "maxItems": 2,
                    "description": "range",
                },
                "mode": {"type": "string", "enum": ["read", "write"], "description": "how"},
            },
            "required": ["path"],
            "additionalProperties": False,
        }
    )
    bash = schema(BashTool())
    assert bash["parameters"] == {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the command to run"}},
        "required": ["command"],
    }
    for name in REGISTRY:
        rendered = json.dumps(schema(tool_class(name)()))
        assert '"title"' not in rendered and '"anyOf"' not in rendered, name


def test_the_args_model_is_the_check_of_a_call() -> None:
    def told(arguments: dict[str, object]) -> str:
        with pytest.raises(ValidationError) as info:
            _Args.model_validate(arguments)
        return explain("tool", _Args, info.value)

    assert told({}) == "tool: the `path` argument is required"
    assert told({"path": 3, "mode": "delete", "colour": 1}) == (
        "tool: `path` must be a string, got int; unknown mode 'delete'; use one of: read or "
        "write; unknown argument(s) colour; it accepts: path, lines, mode"
    )


# Calls as the families document their models writing them: Llama 3.1's model card
# (JSON-based tool calling), Llama 3.x with <|python_tag|>, and OpenAI's harmony guide
# for gpt-oss (the recipient in the channel header as the model writes it, or before it
# as the published template renders history).
@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}',
        '<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": '
        '"San Francisco, CA", "unit": "Fahrenheit"}}<|eom_id|>',
        '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
        '"unit": "Fahrenheit"}}; {"name": "other", "parameters": {}}',
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_current_conditions <|constrain|>json"
        '<|message|>{"location":"San Francisco, CA","unit":"Fahrenheit"}<|call|>',
        "<|start|>assistant to=functions.get_current_conditions<|channel|>commentary json"
        '<|message|>{"location": "San Francisco, CA", "unit": "Fahrenheit"}<|call|>',
    ],
)
def test_llama3_json_and_harmony_calls(text: str) -> None:
    call = parse_tool_call(text)
    assert call is not None and call.name == "get_current_conditions"
    assert call.arguments == {"location": "San Francisco, CA", "unit": "Fahrenheit"}


def test_json_and_channels_that_are_not_calls() -> None:
    assert parse_tool_call('{"key": "value"}') is None  # JSON without a tool name
    assert parse_tool_call('The call looks like {"name": "bash", "parameters": {}}.') is None
    assert parse_tool_call("<|channel|>final<|message|>Use to=functions.bash next time.") is None
    analysis_then_final = (
        "<|channel|>analysis<|message|>No tool needed.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>42<|return|>"
    )
    assert parse_tool_call(analysis_then_final) is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"name": "bash", "parameters": {"command": "ls"', "not valid JSON"),
        ('<|python_tag|>{"name": "bash", "parameters": [1]}', "must be a JSON object"),
        (
            "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{oops}<|call|>",
            "not valid JSON",
        ),
    ],
)
def test_broken_llama3_and_harmony_calls_explain_the_format(text: str, words: str) -> None:
    with pytest.raises(ToolCallError, match=words):
        parse_tool_call(text)
