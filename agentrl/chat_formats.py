"""What agentrl knows about the chat formats of the model families agents are trained from.

The family is read off the chat template text (`family`), never configured. For each
family this module says, as data, which tokens end a sampled turn and how its tool
calls look; and, as two small functions, how a sampled reply and a tool observation
become messages that family's template renders as the model saw them:

- ChatML families (Qwen2.5, Qwen3, SmolLM2) and Llama 3: the reply is the assistant's
  `content`, verbatim. Their templates render it back unchanged (Qwen3 splits its
  `<think>` block off and writes it back in the same form), so a prefix-stable template
  stays one segment. Observations are `tool` messages (Qwen renders them as
  `<tool_response>` in a user turn, Llama 3 as an `ipython` turn).
- DeepSeek-R1 distills: the reply is `content` (the template drops its reasoning from
  history: segments); observations are user messages, since the distills were not
  trained on the template's tool-output format.
- gpt-oss (harmony): the template refuses channel markup in `content`, so the reply is
  taken apart: the analysis channel becomes `thinking`, the final channel `content`, a
  commentary message to `functions.NAME` a `tool_calls` entry; a tool result is a `tool`
  message naming the function (the template requires the call before it). That call is
  parsed once, by `harmony_call`, for rendering and for acting (`agentrl.toolcall`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Message = dict[str, Any]
FamilyName = Literal["harmony", "deepseek_r1", "llama3", "qwen3", "qwen2.5", "chatml", "generic"]


@dataclass(frozen=True)
class ChatFamily:
    """One family's format, as data."""

    name: FamilyName
    markers: tuple[str, ...]
    """All of these appear in the family's chat template (how it is detected)."""
    end_of_turn: tuple[str, ...]
    """Tokens the model emits to end a turn (a sampler stops on them)."""
    tool_call_format: str
    """How the family's models write a tool call (`agentrl.toolcall` parses each)."""
    observation_role: Literal["tool", "user"]


# Checked in order: the first family whose markers all appear in the template wins.
_ORDER: tuple[ChatFamily, ...] = (
    ChatFamily(
        "harmony",
        ("<|start|>", "<|channel|>", "<|message|>"),
        ("<|return|>", "<|call|>"),
        "harmony: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}",
        "tool",
    ),
    ChatFamily(
        "deepseek_r1",
        ("<｜Assistant｜>", "</think>"),
        ("<｜end▁of▁sentence｜>",),
        "none trained; Hermes <tool_call> JSON when prompted",
        "user",
    ),
    ChatFamily(
        "llama3",
        ("<|start_header_id|>", "<|eot_id|>"),
        ("<|eot_id|>", "<|eom_id|>"),
        'Llama 3 JSON: {"name": ..., "parameters": {...}}, optionally after <|python_tag|>',
        "tool",
    ),
    ChatFamily(
        "qwen3",
        ("<|im_start|>", "<think>"),
        ("<|im_end|>",),
        'Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        "tool",
    ),
    ChatFamily(
        "qwen2.5",
        ("<|im_start|>", "<tool_call>"),
        ("<|im_end|>",),
        'Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
        "tool",
    ),
    ChatFamily("chatml", ("<|im_start|>",), ("<|im_end|>",), "Hermes <tool_call> JSON", "tool"),
)
FAMILIES: dict[str, ChatFamily] = {
    f.name: f for f in (*_ORDER, ChatFamily("generic", (), (), "Hermes <tool_call> JSON", "tool"))
}


def family(template: str) -> FamilyName:
    """The family whose markers the chat template text carries ("generic" if none)."""
    return next((f.name for f in _ORDER if all(m in template for m in f.markers)), "generic")


def assistant_message(family: str, text: str) -> Message:
    """The message a sampled reply `text` becomes (see module docstring)."""
    if family == "harmony":
        return _harmony_reply(text)
    return {"role": "assistant", "content": text}


def observation_message(family: str, text: str, tool_name: str | None) -> Message:
    """The message a tool's output becomes; `tool_name` None when no call was made (the
    observation explains a malformed reply), which harmony can only take as a user turn."""
    chat = FAMILIES.get(family, FAMILIES["generic"])
    if chat.observation_role == "user" or (family == "harmony" and tool_name is None):
        return {"role": "user", "content": text}
    message: Message = {"role": "tool", "content": text}
    if tool_name is not None:
        message["name"] = tool_name
    return message


def template_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool schemas ({"name", "description", "parameters"}) in the OpenAI form every
    published template expects (`{"type": "function", "function": {...}}`; gpt-oss's
    reads `tool.function`, the others render it whole)."""
    return [t if "function" in t else {"type": "function", "function": dict(t)} for t in tools]


# -- harmony -----------------------------------------------------------------------------

# One harmony message as a model writes it after `<|start|>assistant`: a header (channel,
# an optional recipient before or after it, an optional content type), `<|message|>`,
# the body up to the token that ends it.
HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?\s*(?:to=(?P<pre>\S+?)\s*)?"
    r"<\|channel\|>(?P<channel>\w+)(?:\s+to=(?P<post>[^\s<]+))?\s*"
    r"(?:<\|constrain\|>)?(?P<type>[\w/+-]*)\s*<\|message\|>"
    r"(?P<body>.*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
    re.DOTALL,
)


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str
    recipient: str | None
    content_type: str
    body: str


def harmony_messages(text: str) -> list[HarmonyMessage]:
    """The harmony messages in a sampled reply, in order."""
    return [
        HarmonyMessage(m["channel"], m["pre"] or m["post"] or None, m["type"] or "", m["body"])
        for m in HARMONY_MESSAGE.finditer(text)
    ]


@dataclass(frozen=True)
class HarmonyCall:
    """A reply's tool call: its first message addressed to `functions.NAME`."""

    name: str
    arguments: Any
    """The body as JSON ({} when empty); the body's text as sampled when it is not JSON."""
    content_type: str
    error: str | None
    """Why the body is not JSON (then the call cannot be made), else None."""


def harmony_call(text: str) -> HarmonyCall | None:
    """The tool call of a sampled reply; None when no message is addressed to a function.
    It never raises: a body that is not JSON is kept as text (what a template writes back
    verbatim) and `error` says why (what the model is told)."""
    return _harmony_call(harmony_messages(text))


def _harmony_call(parts: list[HarmonyMessage]) -> HarmonyCall | None:
    call = next((p for p in parts if (p.recipient or "").startswith("functions.")), None)
    if call is None or call.recipient is None:
        return None
    name, body = call.recipient.removeprefix("functions."), call.body.strip()
    try:
        arguments, error = (json.loads(body) if body else {}), None
    except json.JSONDecodeError as e:
        arguments = call.body
        error = f"the call's <|message|> is not valid JSON ({e.msg} at character {e.pos})"
    return HarmonyCall(name, arguments, call.content_type, error)


def _harmony_reply(text: str) -> Message:
    parts = harmony_messages(text)
    if not parts:  # no channel markup: plain text is the final answer
        return {"role": "assistant", "content": text}
    thinking = "\n".join(p.body for p in parts if p.channel == "analysis")
    call = _harmony_call(parts)
    final = next((p.body for p in parts if p.channel == "final"), None)
    message: Message = {"role": "assistant"}
    if call is not None:
        function = {"name": call.name, "arguments": call.arguments}
        message["tool_calls"] = [{"type": "function", "function": function}]
        if call.content_type and call.content_type != "json":
            function["content_type"] = call.content_type
    else:
        message["content"] = final if final is not None else ""
    if thinking:
        message["thinking"] = thinking
    return message
