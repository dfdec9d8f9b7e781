"""Token-in-token-out chat bookkeeping over a Hugging Face tokenizer's chat template.

A `ChatSession` owns the growing token sequence of one conversation:

- `prompt_ids`: the template rendering of the first messages (system, user, tool
  schemas) plus the generation prompt;
- sampled ids are appended verbatim (`loss_mask` 1) — never decoded and re-encoded;
- an observation (tool or user message) is appended as a *delta*: exactly the text
  the template adds for it, including whatever closes the previous assistant turn
  and the next generation prompt, tokenized on its own (`loss_mask` 0).

Invariant: when the sampled ids are the tokenizer's own encoding of the assistant
text, `prompt_ids + response_ids` equals the tokenization of the whole conversation
rendered by the template at once. The session keeps the rendered text its ids
stand for (`covered`) and checks at every step that the template's rendering of the
longer conversation starts with it; a template that rewrites history (drops earlier
reasoning, trims content, renumbers) raises ChatTemplateError instead of silently
training on tokens the model never saw.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from agentrl.errors import ChatTemplateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
FinishReason = Literal["stop", "length", "abort"]


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


class ChatSession:
    """The token ledger of one conversation (see module docstring)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: Sequence[Message],
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ChatTemplateError(
                f"tokenizer {type(tokenizer).__name__} has no chat template",
                fix="use an instruct/chat model, or set tokenizer.chat_template",
            )
        self._template_tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
            [dict(t) for t in tools] if tools and "tools" in template else None
        )
        self.messages: list[Message] = [dict(m) for m in messages]
        if tools and self._template_tools is None:
            self.messages = _with_tool_block(self.messages, render_tool_schemas(tools))
        self.covered = self.render(self.messages, generation_prompt=True)
        self.prompt_ids: list[int] = self.encode(self.covered)
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        # Template text that closes the last assistant turn and is not in the ids yet.
        self._pending = ""

    # -- rendering -------------------------------------------------------------------

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self._template_tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
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

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    # -- the two ways the conversation grows --------------------------------------------

    def add_sampled(self, token_ids: Sequence[int], finish_reason: FinishReason) -> str:
        """Append the sampler's ids verbatim (mask 1); return the assistant text they say."""
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
        self.messages.append({"role": "assistant", "content": content})
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.covered += content + stop_text
        self._pending = closing[len(stop_text) :]
        return content

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Append tool/user messages as the template renders them, plus the generation
        prompt (mask 0); return the delta ids."""
        longer = self.messages + [dict(m) for m in messages]
        delta = self._rendered_after(longer, generation_prompt=True)
        self.messages = longer
        return self._append_template_text(delta)

    def close_turn(self) -> list[int]:
        """Append the template text that ends the last assistant turn (e.g. `<|im_end|>`
        after a length stop), so the ids render a complete conversation."""
        return self._append_template_text(self._pending)

    # -- internals -------------------------------------------------------------------

    def _closing(self, content: str) -> str:
        """The template text after `content` when it closes the conversation as the
        assistant's reply (e.g. `<|im_end|>\\n`)."""
        reply = {"role": "assistant", "content": content}
        rendered = self._rendered_after([*self.messages, reply], generation_prompt=False)
        if not rendered.startswith(content):
            raise ChatTemplateError(
                "the chat template does not render the assistant's text verbatim "
                f"(expected it to start with {content[:40]!r}, got {rendered[:40]!r})",
                fix="use a template that keeps assistant content as sampled",
            )
        return rendered[len(content) :]

    def _rendered_after(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        """What rendering `messages` adds after the text the ids already stand for."""
        full = self.render(messages, generation_prompt=generation_prompt)
        prefix = self.covered
        if not full.startswith(prefix):
            at = next(
                (i for i, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b),
                min(len(prefix), len(full)),
            )
            raise ChatTemplateError(
                "the chat template is not append-only: rendering the longer conversation "
                f"changes earlier text at character {at} ({prefix[at : at + 30]!r} became "
                f"{full[at : at + 30]!r}); token-in-token-out needs history to stay as sampled",
                fix="start a new training segment at this turn, or use an append-only template",
            )
        return full[len(prefix) :]

    def _append_template_text(self, text: str) -> list[int]:
        ids = self.encode(text) if text else []
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.covered += text
        self._pending = ""
        return ids


def _with_tool_block(messages: list[Message], block: str) -> list[Message]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content', '')}\n\n{block}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]
