"""Token-in-token-out chat bookkeeping over a Hugging Face tokenizer's chat template.

A `ChatSession` is the token ledger of one conversation, kept as one or more segments.
A segment (`ChatSegment`) is token-exact on its own:

- `prompt_ids`: the template rendering of the conversation so far plus the generation
  prompt — exactly what the sampler is given when the segment begins;
- sampled ids are appended verbatim (`loss_mask` 1, with their logprobs and policy
  versions) — never decoded and re-encoded;
- an observation (tool or user message) is appended as a *delta*: exactly the text the
  template adds for it, including whatever closes the previous assistant turn and the
  next generation prompt, tokenized on its own (`loss_mask` 0).

The session keeps the rendered text the current segment's ids stand for (`covered`) and
checks, at every observation, that the template's rendering of the longer conversation
starts with it. When it does (a prefix-stable template: the common case), the segment
grows and `prompt_ids + response_ids` equals the tokenization of the whole conversation
rendered at once. When it does not — a template that rewrites history (drops earlier
reasoning, trims content) — the session starts a new segment whose prompt is the new
rendering, so nothing is ever trained on tokens the model did not see. A context manager
(`restart`) starts one the same way. The mode is detected, never configured.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agentrl.chat_formats import assistant_message, family, observation_message, template_tools
from agentrl.errors import ChatTemplateError
from agentrl.trajectory import SegmentReason

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
FinishReason = Literal["stop", "length", "abort"]

_PLACEHOLDER = "\x00agentrl-reply\x00"


def render_tool_schemas(tools: Sequence[dict[str, Any]]) -> str:
    """Tool schemas as a system-prompt block, for templates that take no `tools`."""
    lines = [
        "You can call these tools. To call one, reply with a JSON object "
        '{"name": <tool name>, "arguments": {...}} inside <tool_call></tool_call> tags.',
        "<tools>",
    ]
    lines += [json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools]
    lines.append("</tools>")
    return "\n".join(lines)


@dataclass
class ChatSegment:
    """One token-exact stretch of a conversation (see module docstring)."""

    prompt_ids: list[int]
    reason: SegmentReason = "start"
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(
        self,
        ids: Sequence[int],
        *,
        sampled: bool,
        logprobs: Sequence[float] | None = None,
        versions: Sequence[int] | None = None,
    ) -> None:
        n = len(ids)
        self.response_ids += ids
        self.loss_mask += [int(sampled)] * n
        if sampled:
            self.logprobs += logprobs if logprobs is not None else [0.0] * n
            self.versions += versions if versions is not None else [0] * n
        else:
            self.logprobs += [0.0] * n
            self.versions += [-1] * n
        if len(self.logprobs) != len(self.response_ids) or len(self.versions) != len(
            self.response_ids
        ):
            raise ChatTemplateError(
                f"{n} sampled ids came with {len(logprobs or [])} logprobs and "
                f"{len(versions or [])} versions"
            )


class ChatSession:
    """The token ledger of one conversation (see module docstring)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ChatTemplateError(
                f"tokenizer {type(tokenizer).__name__} has no chat template",
                fix="use an instruct/chat model, or set tokenizer.chat_template",
            )
        self.template_kwargs = dict(template_kwargs or {})
        self.family = family(template)  # how replies and observations become messages
        self._template_tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
            list(template_tools(tools)) if tools and "tools" in template else None
        )
        self._tool_block = render_tool_schemas(tools) if tools and not self._template_tools else ""
        self.messages: list[Message] = self.prepared(messages)
        self.opening = [dict(m) for m in self.messages]  # what a context manager keeps
        self.segments: list[ChatSegment] = []  # finished, before `current`
        self.covered = self.render(self.messages, generation_prompt=True)
        self.current = ChatSegment(self.encode(self.covered))
        # Template text that closes the last assistant turn and is not in the ids yet.
        self._pending = ""

    def prepared(self, messages: Sequence[Message]) -> list[Message]:
        """`messages` as this session renders them: with the tool schemas in the system
        prompt when the template takes no `tools` (what a new conversation starts from)."""
        copies = [dict(m) for m in messages]
        return _with_tool_block(copies, self._tool_block) if self._tool_block else copies

    # -- rendering -------------------------------------------------------------------

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self._template_tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not render to text")
        return text

    def encode(self, text: str) -> list[int]:
        # The template writes its own special tokens (BOS included) as text.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        if not isinstance(text, str):
            raise ChatTemplateError("the tokenizer did not decode to text")
        return text

    # -- the current segment: what the sampler is given next --------------------------

    @property
    def prompt_ids(self) -> list[int]:
        return self.current.prompt_ids

    @property
    def response_ids(self) -> list[int]:
        return self.current.response_ids

    @property
    def loss_mask(self) -> list[int]:
        return self.current.loss_mask

    @property
    def ids(self) -> list[int]:
        return self.current.prompt_ids + self.current.response_ids

    def __len__(self) -> int:
        return len(self.current)

    @property
    def all_segments(self) -> list[ChatSegment]:
        return [*self.segments, self.current]

    # -- the ways the conversation grows ------------------------------------------------

    def add_sampled(
        self,
        token_ids: Sequence[int],
        finish_reason: FinishReason,
        *,
        logprobs: Sequence[float] | None = None,
        versions: Sequence[int] | None = None,
    ) -> str:
        """Append the sampler's ids verbatim (mask 1) with their logprobs and policy
        versions (0.0 and 0 when rebuilding a recorded conversation); return the
        assistant text they say."""
        if self._pending:
            raise ChatTemplateError("two assistant turns in a row: add an observation between")
        ids = list(token_ids)
        stop_text = ""
        if finish_reason == "stop" and ids:
            stop_text, content = self.decode(ids[-1:]), self.decode(ids[:-1])
        else:
            content = self.decode(ids)
        closing = self._closing(content)
        if stop_text and not closing.startswith(stop_text):
            # Stopped on a token the template does not use to end a turn (a stop string's
            # last token, say): it is content, decoded with the rest.
            content = self.decode(ids)
            closing, stop_text = self._closing(content), ""
        self.messages.append(assistant_message(self.family, content))
        self.current.append(ids, sampled=True, logprobs=logprobs, versions=versions)
        self.covered += content + stop_text
        self._pending = closing[len(stop_text) :]
        return content

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Append tool/user messages and the generation prompt: as the template's delta
        (mask 0; returned) when its rendering extends the current ids, else as the prompt
        of a new segment (returns [])."""
        self.messages = self.messages + [dict(m) for m in messages]
        full, delta = self._extension(self.messages)
        if delta is not None:
            return self._append_template_text(delta)
        self._begin(full, "template")
        return []

    def length_after(self, messages: Sequence[Message]) -> int:
        """The tokens the current segment would hold once `add_messages(messages)` ran:
        the delta added to it, or the new segment's prompt."""
        full, delta = self._extension([*self.messages, *messages])
        if delta is not None:
            return len(self) + len(self.encode(delta))
        return len(self.encode(full))

    def observation(self, text: str, tool_name: str | None = None) -> Message:
        """A tool's output as the message this model family's template takes (a tool
        message naming the tool; a user message where the family wants one)."""
        return observation_message(self.family, text, tool_name)

    def restart(self, messages: Sequence[Message], reason: SegmentReason) -> None:
        """Continue in a new segment whose prompt renders `messages` (a context manager
        dropped or summarized history)."""
        self.messages = [dict(m) for m in messages]
        self._begin(self.render(self.messages, generation_prompt=True), reason)

    def close_turn(self) -> list[int]:
        """Append the template text that ends the last assistant turn (e.g. `<|im_end|>`
        after a length stop), so the ids render a complete conversation."""
        return self._append_template_text(self._pending)

    # -- internals -------------------------------------------------------------------

    def _extension(self, messages: Sequence[Message]) -> tuple[str, str | None]:
        """The rendering of `messages` with the generation prompt, and what it adds after
        the text the current ids stand for (None: it does not extend them)."""
        full = self.render(messages, generation_prompt=True)
        return full, full[len(self.covered) :] if full.startswith(self.covered) else None

    def _begin(self, text: str, reason: SegmentReason) -> None:
        self.segments.append(self.current)
        self.current = ChatSegment(self.encode(text), reason)
        self.covered, self._pending = text, ""

    def _closing(self, content: str) -> str:
        """The template text after `content` when it closes the conversation as the
        assistant's reply (e.g. `<|im_end|>\\n`). A template that does not render the
        reply verbatim after the current ids (it trims it, drops its reasoning) is asked
        with a placeholder reply; the next observation then starts a new segment."""
        reply = assistant_message(self.family, content)
        rendered = self.render([*self.messages, reply], generation_prompt=False)
        if rendered.startswith(self.covered + content):
            return rendered[len(self.covered) + len(content) :]
        placeholder = {"role": "assistant", "content": _PLACEHOLDER}
        rendered = self.render([*self.messages, placeholder], generation_prompt=False)
        at = rendered.rfind(_PLACEHOLDER)
        return rendered[at + len(_PLACEHOLDER) :] if at >= 0 else ""

    def _append_template_text(self, text: str) -> list[int]:
        ids = self.encode(text) if text else []
        self.current.append(ids, sampled=False)
        self.covered += text
        self._pending = ""
        return ids


def _with_tool_block(messages: list[Message], block: str) -> list[Message]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content', '')}\n\n{block}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
