# Over 400 lines: one session's ledgers and the calls that extend them change together.
"""The recorder: one episode's gateway session, turning an external harness's calls
(messages in, messages out) into the token-exact ledger native episodes keep.

The harness never sees a token; the recorder never trusts it to hand back what it was
given. It keeps, per episode, a `ChatSession` (`agentrl.chat`) and the *view* the
harness was left with after the last call: the messages it sent plus the reply it got,
in normal form (`wire.normal`). Each call then is one of:

- an extension: the messages begin with that view. Only the new messages (tool results,
  user turns) are rendered, as the template's delta after the ledger's ids (mask 0), and
  the model samples after them. The reply the harness echoes back is never re-rendered
  from what it sent: every assistant message the gateway issued stands for the exact
  text sampled (the raw reply, tool-call markup, stop string and all), so the prompt
  is the previous prompt plus the ids actually sampled;
- anything else — an earlier message edited, history truncated or summarized, a retry,
  another set of tools: the conversation continues in a new segment (reason `client`)
  whose prompt renders the messages as sent. Nothing is trained on a prefix the model
  did not see; no mask is zeroed after the fact.

Re-tokenization drift is counted, not suffered: each call's messages are also rendered
exactly as the harness sent them, and a call whose ids differ from the ledger's counts
in `drift` (what a proxy that re-renders messages would have trained on).

Sampling is the task's: its temperature and top_p replace the harness's (the calls that
asked for other values are counted in `overridden`), `max_tokens` is capped by the
task's `max_new_tokens` and the room left in `context_length`. The harness's `stop`
strings apply (they are its protocol) and the reply leaves them out, as OpenAI's does;
the task's own `stop` strings apply too and stay in the reply. The ledger keeps every
sampled id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from agentrl.chat import ChatSegment, ChatSession
from agentrl.chat_formats import assistant_message, observation_message
from agentrl.errors import AgentRLError, SamplerError
from agentrl.gateway import wire
from agentrl.http import HTTPError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.toolcall import split_tool_calls
from agentrl.trajectory import StopReason, ToolCall, Turn

if TYPE_CHECKING:
    from agentrl.play import Play

log = logging.getLogger(__name__)

Message = dict[str, Any]
OVER = 404
"""The answer to a call after its episode is over. Not 403: litellm makes that a generic
APIError that mini-swe-agent retries for minutes; a 404 no client retries."""


class Recorder:
    """One episode's session (see module docstring). Calls are taken one at a time."""

    def __init__(self, play: Play, model: str) -> None:
        self.play, self.model = play, model
        self.loop = asyncio.get_running_loop()
        self.chat: ChatSession | None = None
        self.text: _TextLedger | None = None
        self.done: list[ChatSegment] = []  # segments of a conversation the harness left
        self.view: list[str] = []  # normal forms of what the harness holds after the last reply
        self.issued: dict[str, str] = {}  # an issued reply's normal form -> the sampled text
        self.call_tools: dict[str, str] = {}  # an issued tool call's id -> its tool's name
        self.tools_key = ""
        self.calls = self.edits = self.drift = 0
        self.overridden: Counter[str] = Counter()
        self.stop: StopReason | None = None  # why the episode ended for the harness
        self.failure: Exception | None = None  # infrastructure: the episode is never graded
        self.over = asyncio.Event()  # set when the episode is over: the harness is stopped
        self._lock = asyncio.Lock()
        self._replied_at: float | None = None
        self._unanswered = False  # the ledger ends with a prompt whose reply never left
        self._calling: asyncio.Task[Any] | None = None  # the call being answered

    # -- the ledger, as the trajectory records it ---------------------------------------

    @property
    def all_segments(self) -> list[ChatSegment]:
        current = self.chat.all_segments if self.chat else self.text.segments if self.text else []
        return [*self.done, *current]

    # -- the calls ------------------------------------------------------------------------

    async def chat_completion(self, request: wire.ChatRequest) -> dict[str, Any]:
        async with self._lock:
            with self._infrastructure():
                self._calling = asyncio.current_task()
                self._admit(request.n)
                chat = self._chat_for(request)
                params = self._params(
                    request.budget, request.stops, request.temperature, request.top_p
                )
                prompt = len(chat)
                completion, turn = await self._sample(chat.ids, params)
                text = chat.add_sampled(
                    completion.token_ids,
                    completion.finish_reason,
                    logprobs=completion.logprobs,
                    versions=completion.token_versions,
                )
                turn.action = text
                turn.span = (turn.span[0], len(chat.response_ids))
                self.play.turns.append(turn)
                self._finish(completion, prompt)
                shown = _without_stop(text, request.stops)  # the task's own stay in
                content, calls = split_tool_calls(shown) if request.wants_tools else (shown, [])
                ids = [f"call_{len(self.play.turns)}_{i}" for i in range(len(calls))]
                self.call_tools.update(
                    {cid: call.name for cid, call in zip(ids, calls, strict=True)}
                )
                turn.tool_call = calls[0] if calls else None
                reply = wire.reply_message(content, calls, ids)
                self.issued[wire.key(reply)] = text
                self.view, self._unanswered = [*self.view, wire.key(reply)], False
                finish = "tool_calls" if calls else _finish_reason(completion)
                await self._settle()
                logprobs = self._logprobs(completion) if request.logprobs else None
                usage = wire.usage(prompt, len(completion.token_ids))
                return wire.chat_body(
                    f"chatcmpl-{self.play.trajectory_id}-{self.calls}",
                    request.model or self.model,
                    reply,
                    finish,
                    usage,
                    logprobs,
                )

    async def completion(self, request: wire.CompletionRequest) -> dict[str, Any]:
        async with self._lock:
            with self._infrastructure():
                self._calling = asyncio.current_task()
                self._admit(request.n)
                if self.chat is not None:  # from chat to raw prompts: a new conversation
                    self.done += self.chat.all_segments
                    self.chat = None
                    self.edits += 1
                if self.text is None:
                    self.text = _TextLedger(self.play.chat, len(self.done) > 0)
                self.edits += self.text.prompt(request.prompt)
                ledger = self.text
                params = self._params(
                    request.max_tokens, request.stops, request.temperature, request.top_p
                )
                prompt = len(ledger.ids)
                completion, turn = await self._sample(ledger.ids, params)
                text = ledger.sampled(completion)
                turn.action = text
                turn.span = (turn.span[0], len(ledger.current.response_ids))
                self.play.turns.append(turn)
                self._finish(completion, prompt)
                await self._settle()
                usage = wire.usage(prompt, len(completion.token_ids))
                return wire.completion_body(
                    f"cmpl-{self.play.trajectory_id}-{self.calls}",
                    request.model or self.model,
                    _without_stop(_without_eos(text, completion, ledger.eos_text), request.stops),
                    _finish_reason(completion),
                    usage,
                )

    async def exec(self, request: wire.ExecRequest) -> dict[str, Any]:
        """A command in the episode's sandbox, for a harness beside it; it counts as the
        last turn's tool time."""
        sandbox = self.play.sandbox
        if self.over.is_set():
            raise HTTPError(OVER, f"the episode is over ({self._why()}): stop the agent")
        with self._infrastructure():
            return await self._exec(sandbox, request)

    async def _exec(self, sandbox: Sandbox, request: wire.ExecRequest) -> dict[str, Any]:
        limits = self.play.task.spec.limits
        timeout = min(request.timeout or limits.tool_timeout, limits.tool_timeout)
        await self._settle()  # a snapshot of the state before this command, first
        start = time.monotonic()
        result = await sandbox.exec(
            ExecRequest(command=request.command, timeout=timeout, workdir=request.cwd)
        )
        turns = self.play.turns
        if turns:
            last = turns[-1]
            last.tool_seconds += time.monotonic() - start
            last.exit_code = result.exit_code
            if last.tool_call is None:
                last.tool_call = ToolCall(name="exec", arguments={"command": request.command})
        return {
            "output": result.output,
            "returncode": result.exit_code,
            "timed_out": result.timed_out,
        }

    def end(self, stop: StopReason | None = None) -> None:
        """The episode is over: refuse every later call (`stop`: why, if the agent's)."""
        if stop is not None and self.stop is None:
            self.stop = stop
        self.over.set()

    def close(self) -> None:
        """RUN is over: refuse every later call and cancel one still being answered (its
        reply would come after the episode; it enters no trajectory)."""
        self.end()
        if self._calling is not None and not self._calling.done():
            self._calling.cancel()

    # -- steps of a call ------------------------------------------------------------------

    @contextlib.contextmanager
    def _infrastructure(self) -> Iterator[None]:
        """A call that fails for any reason but the harness's request (the sampler, the
        sandbox, a bug here) fails the episode: never graded, whatever the harness does
        after (one that swallows the error and exits 0 is not `finished`)."""
        try:
            yield
        except HTTPError:
            raise
        except Exception as e:
            if not isinstance(e, AgentRLError):
                log.exception("%s: a gateway call failed", self.play.trajectory_id)
            self.failure = self.failure or e
            self.end()
            raise HTTPError(OVER, f"the episode is over (it failed: {e})") from e

    def _admit(self, n: int | None) -> None:
        if self.over.is_set():
            raise HTTPError(OVER, f"the episode is over ({self._why()}): stop the agent")
        if n is not None and n > 1:
            raise HTTPError(400, f"n={n}: the gateway samples one reply per call (n=1)")
        limits = self.play.task.spec.limits
        if sum(t.kind == "action" for t in self.play.turns) >= limits.max_turns:
            self.end(StopReason.max_turns)
            raise HTTPError(OVER, f"the episode is over (max_turns: {limits.max_turns} calls)")

    def _why(self) -> str:
        return self.stop.value if self.stop else "aborted"

    def _chat_for(self, request: wire.ChatRequest) -> ChatSession:
        """The ledger after this call's messages: extended, or continued in a new segment."""
        messages, tools = request.messages, request.tools
        keys = [wire.key(m) for m in messages]
        chat, n = self.chat, len(self.view)
        if chat is not None and self._unanswered and keys == self.view:
            return chat  # a retry of a call whose reply never left: the ledger is ready
        if chat is None or wire.tools_key(tools) != self.tools_key:
            if chat is not None or self.text is not None:
                self.done, self.text = self.all_segments, None
                self.edits += 1
            chat = self.chat = ChatSession(
                self.play.chat.tokenizer,
                self._converted(messages, exact=True),
                tools=tools or None,
                template_kwargs=self.play.task.spec.prompt.template_kwargs,
            )
            if self.done:
                chat.current.reason = "client"
            self.tools_key = wire.tools_key(tools)
        elif len(keys) > n and keys[:n] == self.view:
            new = messages[n:]
            self._observed(new)
            chat.add_messages(self._converted(new, exact=True))
        else:  # history edited, truncated, summarized, or the call retried
            self.edits += 1
            replied = max((i for i, k in enumerate(keys) if k == self.view[-1]), default=None)
            self._observed(messages[replied + 1 :] if replied is not None else [])
            chat.restart(chat.prepared(self._converted(messages, exact=True)), "client")
        self.view, self._unanswered = keys, True
        as_sent = chat.encode(
            chat.render(chat.prepared(self._converted(messages)), generation_prompt=True)
        )
        self.drift += as_sent != chat.ids
        return chat

    def _converted(self, messages: list[Message], *, exact: bool = False) -> list[Message]:
        """Messages as the template takes them. `exact`: each reply the gateway issued is
        the text sampled for it, verbatim (else: as the harness sent it back)."""
        family = self.play.chat.family
        out: list[Message] = []
        for m in messages:
            role, content = m.get("role"), wire.text_of(m.get("content")) or ""
            if role == "assistant":
                raw = self.issued.get(wire.key(m)) if exact else None
                out.append(
                    assistant_message(family, raw) if raw is not None else _authored(m, content)
                )
            elif role == "tool":
                name = m.get("name") or self.call_tools.get(str(m.get("tool_call_id")))
                out.append(observation_message(family, content, name))
            else:
                out.append({"role": "system" if role == "developer" else role, "content": content})
        return out

    def _observed(self, new: list[Message]) -> None:
        """What came back after the last reply: its turn's observation (and the harness's
        time since the reply, when no exec call measured its tools)."""
        turns = self.play.turns
        if not turns or turns[-1].observation:
            return
        last = turns[-1]
        last.observation = "\n".join(wire.text_of(m.get("content")) or "" for m in new)
        if last.tool_seconds == 0.0 and self._replied_at is not None:
            last.tool_seconds = round(time.monotonic() - self._replied_at, 3)

    def _params(
        self,
        budget: int | None,
        stops: tuple[str, ...],
        temperature: float | None,
        top_p: float | None,
    ) -> SamplingParams:
        task = self.play.task.spec
        for name, asked, used in (
            ("temperature", temperature, task.sampling.temperature),
            ("top_p", top_p, task.sampling.top_p),
        ):
            if asked is not None and asked != used:
                self.overridden[name] += 1
        return SamplingParams(
            max_tokens=min(budget or task.limits.max_new_tokens, task.limits.max_new_tokens),
            temperature=task.sampling.temperature,
            top_p=task.sampling.top_p,
            stop=(*task.sampling.stop, *stops),
        )

    async def _sample(self, ids: list[int], params: SamplingParams) -> tuple[Completion, Turn]:
        play, limits = self.play, self.play.limits
        room = limits.context_length - len(ids)
        if room <= 0:
            self.end(StopReason.context_limit)
            raise HTTPError(
                400,
                f"This model's maximum context length is {limits.context_length} tokens. "
                f"However, your messages resulted in {len(ids)} tokens "
                "(context_length_exceeded): the episode is over",
            )
        params = params.model_copy(update={"max_tokens": min(params.max_tokens, room)})
        play.snapshot_last_turn()  # as the harness's actions since the last reply left it
        completion, seconds = await play.generate(ids, params)
        self.calls += 1
        segment = len(self.all_segments) - 1
        turn = Turn(
            action="",
            span=(len(ids) - len(self.all_segments[-1].prompt_ids), 0),
            segment=segment,
            finish_reason=completion.finish_reason,
            gen_seconds=seconds,
            replica=completion.replica,
        )
        return completion, turn

    def _finish(self, completion: Completion, prompt: int) -> None:
        """After a reply to a `prompt`-token prompt is in the ledger: an aborted one fails
        the episode (the sampler's doing); one that filled the context ends it."""
        if completion.finish_reason == "abort":
            self.failure = SamplerError(
                f"the sampler aborted a reply after {len(completion.token_ids)} tokens",
                fix="a server paused with mode=abort outside the router, or was shut down",
            )
            self.end()
            raise HTTPError(OVER, "the episode is over (the sampler aborted): stop the agent")
        full = prompt + len(completion.token_ids) >= self.play.task.spec.limits.context_length
        if completion.finish_reason == "length" and full:
            self.end(StopReason.context_limit)
        self._replied_at = time.monotonic()

    async def _settle(self) -> None:
        await self.play.settle()

    def _logprobs(self, completion: Completion) -> list[dict[str, Any]]:
        tokenizer = self.play.chat.tokenizer
        out = []
        for token, lp in zip(completion.token_ids, completion.logprobs, strict=True):
            text = str(tokenizer.decode([token]))
            out.append(
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            )
        return out


class _TextLedger:
    """The ledger of `/v1/completions` calls: prompts the harness rendered itself. A
    prompt that begins with the previous prompt and everything sampled after it (as
    text, or as ids) extends the segment by the rest (mask 0); any other begins one."""

    def __init__(self, chat: ChatSession, after_chat: bool) -> None:
        self.encode, self.decode = chat.encode, chat.decode
        self.segments: list[ChatSegment] = []
        self.covered: str | list[int] = ""
        self.eos_text = str(chat.tokenizer.eos_token or "")
        self._reason = "client" if after_chat else "start"

    @property
    def current(self) -> ChatSegment:
        return self.segments[-1]

    @property
    def ids(self) -> list[int]:
        return self.current.prompt_ids + self.current.response_ids

    def prompt(self, prompt: str | list[int]) -> int:
        """Take the call's prompt; 1 if it began a segment after the first, else 0."""
        covered = self.covered
        if self.segments and type(prompt) is type(covered) and prompt[: len(covered)] == covered:
            rest = prompt[len(covered) :]
            ids = self.encode(rest) if isinstance(rest, str) else list(rest)
            self.current.append(ids, sampled=False)
            self.covered = prompt
            return 0
        new = bool(self.segments)
        reason = "client" if new else self._reason
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.segments.append(ChatSegment(ids, reason))  # type: ignore[arg-type]
        self.covered = prompt
        return int(new)

    def sampled(self, completion: Completion) -> str:
        ids = completion.token_ids
        self.current.append(
            ids, sampled=True, logprobs=completion.logprobs, versions=completion.token_versions
        )
        text = self.decode(ids)
        self.covered = self.covered + (text if isinstance(self.covered, str) else ids)  # type: ignore[operator]
        return text


def _authored(message: Message, content: str) -> Message:
    """An assistant message the harness wrote itself (a few-shot example, an edit)."""
    out: Message = {"role": "assistant", "content": content}
    calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        with contextlib.suppress(TypeError, json.JSONDecodeError):
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        calls.append({"type": "function", "function": function})
    if calls:
        out["tool_calls"] = calls
    return out


def _without_stop(text: str, stops: tuple[str, ...]) -> str:
    at = min((i for s in stops if (i := text.find(s)) >= 0), default=-1)
    return text if at < 0 else text[:at]


def _without_eos(text: str, completion: Completion, eos: str) -> str:
    if completion.finish_reason == "stop" and eos and text.endswith(eos):
        return text[: -len(eos)]
    return text


def _finish_reason(completion: Completion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"
