"""Finding the tool call in an assistant's text, and making it (`act`).

The formats the model families agents are trained from emit are understood:
- Hermes (Qwen2.5, Qwen3, SmolLM2):
  `<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>`
- Llama 3.x JSON: the reply is `{"name": "bash", "parameters": {"command": "ls"}}`,
  optionally after `<|python_tag|>`
- harmony (gpt-oss): a commentary message to `functions.NAME`,
  `<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{...}<|call|>`
- XML-ish (OpenHands / SWE-agent style):
  `<function=bash><parameter=command>ls</parameter></function>`

`parse_tool_call` returns the first call, None when there is none, or a
`ToolCallError` whose message tells the model how to fix its reply.

Tasks with `action_format: bash_block` use `parse_bash_block` instead: the first
```bash (or ```sh, or unlabelled) fenced block of the reply is a bash call, as in
mini-SWE-agent; small models that never learned a tool-call syntax can still act.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any

from agentrl.chat_formats import harmony_call
from agentrl.sandbox.base import Sandbox
from agentrl.tools.base import Observation, Tool
from agentrl.trajectory import ToolCall, Turn

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FUNCTION = re.compile(r"<function=([\w.-]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([\w.-]+)>(.*?)</parameter>", re.DOTALL)
# A Llama 3 call: the reply (or what follows <|python_tag|>) is a JSON object naming a tool.
_LLAMA_JSON = re.compile(r'\A\s*(?:<\|python_tag\|>\s*)?(?=\{\s*"name")|<\|python_tag\|>\s*')
_HARMONY_CALL = re.compile(r"to=functions\.")
_FENCED = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_SHELLS = ("", "bash", "sh", "shell")

FORMAT_HINT = (
    'Call exactly one tool per reply as <tool_call>{"name": "<tool>", "arguments": {...}}'
    "</tool_call> (JSON inside the tags), or call `finish` when you are done."
)


BASH_BLOCK_HINT = "Reply with exactly one command in a ```bash code block."


class ToolCallError(Exception):
    """The reply tried to call a tool but the call cannot be used; the message says why."""


def parse_tool_call(text: str) -> ToolCall | None:
    """The first tool call in `text`; None if it has none; ToolCallError if it is broken."""
    found = [
        (m, parse)
        for m, parse in (
            (_HERMES.search(text), _hermes),
            (_FUNCTION.search(text), _function),
            (_LLAMA_JSON.search(text), _llama_json),
            (_HARMONY_CALL.search(text), _harmony),
        )
        if m is not None
    ]
    for match, parse in sorted(found, key=lambda f: f[0].start()):
        call = parse(text, match)
        if call is not None:
            return call
    return None


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A reply as an OpenAI-style message takes it: the text outside its tool calls, and
    every call (Hermes and `<function=...>` blocks, all of them, in order; else the first
    call of another format). A call that cannot be parsed leaves the reply as text, no
    calls: the harness reads it and decides, as a vLLM tool parser does."""
    try:
        for pattern, parse in ((_HERMES, _hermes), (_FUNCTION, _function)):
            matches = list(pattern.finditer(text))
            if matches:
                calls = [parse(text, m) for m in matches]
                return pattern.sub("", text).strip(), calls
        call = parse_tool_call(text)
    except ToolCallError:
        return text, []
    if call is None:
        return text, []
    head = min(
        (m.start() for m in (_LLAMA_JSON.search(text), _HARMONY_CALL.search(text)) if m),
        default=0,
    )
    return text[:head].strip(), [call]


def _hermes(text: str, match: re.Match[str]) -> ToolCall:
    return _from_data(_json(match.group(1), "the text inside <tool_call>"))


def _function(text: str, match: re.Match[str]) -> ToolCall:
    arguments = {k: _strip_one_newline(v) for k, v in _PARAMETER.findall(match.group(2))}
    return ToolCall(name=match.group(1), arguments=arguments)


def _llama_json(text: str, match: re.Match[str]) -> ToolCall:
    """`{"name": ..., "parameters": {...}}` where the match ends (Llama 3.2 may chain
    calls with `;`: the first counts)."""
    try:
        data, _ = json.JSONDecoder().raw_decode(text, match.end())
    except json.JSONDecodeError as e:
        raise ToolCallError(
            f"the tool call is not valid JSON ({e.msg} at character {e.pos - match.end()}). "
            + FORMAT_HINT
        ) from e
    return _from_data(data)


def _harmony(text: str, match: re.Match[str]) -> ToolCall | None:
    """The first harmony message addressed to `functions.NAME` (None when `to=functions.`
    is only mentioned in text, not a message header)."""
    call = harmony_call(text)
    if call is not None and call.error is not None:
        raise ToolCallError(f"{call.error}. {FORMAT_HINT}")
    return None if call is None else _from_data({"name": call.name, "arguments": call.arguments})


def parse_bash_block(text: str) -> ToolCall | None:
    """The first fenced shell block of `text` as a bash call; None if there is none."""
    # Whole blocks, in order: a closing fence never opens the next block.
    block = next((m for m in _FENCED.finditer(text) if m.group(1) in _SHELLS), None)
    if block is None:
        return None
    command = block.group(2).strip("\n")
    if not command.strip():
        raise ToolCallError("the ```bash block is empty. " + BASH_BLOCK_HINT)
    return ToolCall(name="bash", arguments={"command": command})


def _json(body: str, where: str) -> Any:
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(
            f"{where} is not valid JSON ({e.msg} at character {e.pos}). " + FORMAT_HINT
        ) from e


def _from_data(data: Any) -> ToolCall:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise ToolCallError('a tool call needs a "name" string. ' + FORMAT_HINT)
    arguments: Any = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallError(
                f'"arguments" is a string that is not JSON ({e.msg}). ' + FORMAT_HINT
            ) from e
    if not isinstance(arguments, dict):
        raise ToolCallError('"arguments" must be a JSON object. ' + FORMAT_HINT)
    return ToolCall(name=data["name"], arguments=arguments)


def _strip_one_newline(value: str) -> str:
    # `<parameter=x>\nvalue\n</parameter>` is how these calls are usually laid out.
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


async def act(
    text: str, action_format: str, tools: dict[str, Tool], sandbox: Sandbox, turn: Turn
) -> Observation:
    """Parse the reply `text` and make its call; the observation the agent sees (and the
    call, exit code, tool time and whether it failed on `turn`). Replay re-executes
    recorded turns with it."""
    obs = await _act(text, action_format, tools, sandbox, turn)
    turn.tool_error = obs.error
    return obs


async def _act(
    text: str, action_format: str, tools: dict[str, Tool], sandbox: Sandbox, turn: Turn
) -> Observation:
    blocks = action_format == "bash_block"
    try:
        call = parse_bash_block(text) if blocks else parse_tool_call(text)
    except ToolCallError as e:
        return Observation(text=f"error: {e}", error=True)
    if call is None:
        what, hint = ("```bash block", BASH_BLOCK_HINT) if blocks else ("tool call", FORMAT_HINT)
        return Observation(text=f"error: no {what} found in your reply. {hint}", error=True)
    turn.tool_call = call
    tool = tools.get(call.name)
    if tool is None:
        names = ", ".join(sorted(tools))
        return Observation(
            text=f"error: unknown tool {call.name!r}; available: {names}", error=True
        )
    start = time.monotonic()
    # The tool checks the arguments (a bad call is an error observation); an exception
    # from inside it, a TypeError too, is the tool's bug: the RUN boundary reports it.
    obs = await tool(sandbox, **call.arguments)
    turn.tool_seconds = time.monotonic() - start
    turn.exit_code = obs.exit_code
    return obs


async def close_tools(tools: dict[str, Tool], *, keep_processes: bool = False) -> None:
    """Close every tool (idempotent): its shells, browsers and watches end (with
    `keep_processes`, the processes the agent's commands started live on)."""
    for tool in tools.values():
        with contextlib.suppress(Exception):  # one tool failing to close must not leak the rest
            await tool.close(keep_processes=keep_processes)


async def close_all(tools: dict[str, Tool], sandbox: Sandbox | None) -> None:
    await close_tools(tools)
    if sandbox is not None:
        await sandbox.close()
