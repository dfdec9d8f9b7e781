"""The OpenAI wire format the gateway speaks: requests as pydantic models (unknown keys
kept, never refused: harnesses send whatever their client library adds), messages in a
normal form the recorder compares, and the response bodies (JSON, and the same reply as
a server-sent event stream)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentrl.trajectory import ToolCall

Message = dict[str, Any]


class _Request(BaseModel):
    """What both completion routes take (the fields the gateway acts on; any other key a
    client library adds is accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = False

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatRequest(_Request):
    """`POST /v1/chat/completions`."""

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stream_options: dict[str, Any] | None = None
    logprobs: bool | None = None

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def wants_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_Request):
    """`POST /v1/completions`: a prompt the harness rendered itself (text, or token ids)."""

    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=1)


class ExecRequest(BaseModel):
    """`POST /sessions/{sid}/exec`: a command for the episode's sandbox (harnesses beside it)."""

    model_config = ConfigDict(extra="forbid")

    command: str
    cwd: str | None = None
    timeout: float | None = Field(default=None, gt=0)


def text_of(content: Any) -> str | None:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    return str(content)


def normal(message: Message) -> Message:
    """The parts of a message that say what the model saw, in one form: the keys a client
    library adds (ids of its own, nulls, refusal, extra, provider fields) dropped, content
    as text ("" and null alike), tool calls as (id, name, arguments). Two messages with the
    same normal form render alike."""
    out: Message = {"role": str(message.get("role", ""))}
    content = text_of(message.get("content"))
    if content:
        out["content"] = content
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "name": (c.get("function") or {}).get("name"),
                "arguments": (c.get("function") or {}).get("arguments"),
            }
            for c in calls
            if isinstance(c, dict)
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    return out


def key(message: Message) -> str:
    return json.dumps(normal(message), sort_keys=True, ensure_ascii=False)


def tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    """The tools offered, as one comparable string (a change of tools is a new segment)."""
    return json.dumps(list(tools or []), sort_keys=True, ensure_ascii=False)


def reply_message(content: str, calls: Sequence[ToolCall], call_ids: Sequence[str]) -> Message:
    message: Message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [
            {
                "id": cid,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c, cid in zip(calls, call_ids, strict=True)
        ]
    return message


def chat_body(
    cid: str,
    model: str,
    message: Message,
    finish_reason: str,
    usage: dict[str, int],
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": None if logprobs is None else {"content": logprobs},
    }
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def chat_stream(body: dict[str, Any], include_usage: bool) -> bytes:
    """The reply `body` as the event stream a streaming client reads: the role, the
    content, each tool call (id, name and arguments in its first fragment), the finish
    reason, the usage when asked for, `[DONE]`. Sent whole once sampled (the sampler
    works a reply at a time), so streaming clients and libraries work unchanged."""
    choice = body["choices"][0]
    message = choice["message"]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: Message, finish: str | None = None) -> dict[str, Any]:
        return head | {
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        }

    events = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        events.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": i, **call}]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append(head | {"choices": [], "usage": body["usage"]})
    lines = [f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def completion_body(
    cid: str, model: str, text: str, finish_reason: str, usage: dict[str, int]
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def completion_stream(body: dict[str, Any]) -> bytes:
    choice = body["choices"][0]
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    events = [
        head | {"choices": [{"index": 0, "text": choice["text"], "finish_reason": None}]},
        head | {"choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"]}]},
    ]
    lines = [f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
