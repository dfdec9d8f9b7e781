"""The conversation an episode opens, and the one it had, rebuilt from its records.

`open_chat` renders the task's prompt (with the task's tools for the ReAct loop) into the
token ledger an episode starts from. `conversation` rebuilds a recorded episode's chat
from its turn records, token for token (sampled ids verbatim, observations as the model
saw them, through the task's context policy): replay, branch continuations and the
`conversations.jsonl` of a run use it; `rebuilds` says whether the rebuilt chat is the
recorded one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrl import context
from agentrl.chat import ChatSession
from agentrl.tasks.env import build_tools
from agentrl.tasks.spec import Instance, Task
from agentrl.tools.base import Tool, schema
from agentrl.trajectory import Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def open_chat(
    task: Task,
    instance: Instance,
    tools: dict[str, Tool],
    tokenizer: PreTrainedTokenizerBase,
    *,
    opening: str | None = None,
) -> ChatSession:
    """The chat an episode starts from: the system prompt, the instance prompt, and after
    it the environment's opening observation where the task's sandbox gives one."""
    user = instance.render(task.spec.prompt.instance)
    if opening is not None:
        user = f"{user}\n\n{opening}" if user.strip() else opening
    messages = [
        {"role": "system", "content": instance.render(task.spec.prompt.system)},
        {"role": "user", "content": user},
    ]
    kwargs = task.spec.prompt.template_kwargs
    if task.spec.prompt.action_format == "bash_block":  # the system prompt explains the format
        return ChatSession(tokenizer, messages, template_kwargs=kwargs)
    schemas = [schema(t) for t in tools.values()]
    return ChatSession(tokenizer, messages, tools=schemas, template_kwargs=kwargs)


PROMPT_FIX = (
    "shorten the task's prompt (or the instance field it quotes), or raise limits.context_length"
)


def prompt_overflow(task: Task, chat: ChatSession) -> str | None:
    """Why the episode's first prompt leaves no room to sample, or None when it fits."""
    limits = task.spec.limits
    if len(chat) < limits.context_length:
        return None
    return (
        f"the first prompt is {len(chat):,} tokens; limits.context_length is "
        f"{limits.context_length:,}: no room for a reply"
    )


def conversation(
    task: Task, traj: Trajectory, tokenizer: PreTrainedTokenizerBase, upto: int | None = None
) -> ChatSession:
    """Replay an episode's conversation from its turn records (sampled ids verbatim with
    their recorded logprobs and versions, observations as the model saw them) through the
    chat template and the task's context policy: what the model saw, segments included.
    With `upto=K`, only turns before K: the chat as it stood when turn K was sampled."""
    instance = next(i for i in task.instances if i.id == traj.group_id)
    chat = open_chat(task, instance, build_tools(task), tokenizer)
    ledgers = traj.ledgers()
    for k, turn in enumerate(traj.turns[:upto]):
        if turn.kind == "summary":
            context.ask_summary(task, chat)
        else:
            context.drop_oldest(task, chat)
        ledger, (start, end) = ledgers[turn.segment], turn.span
        sampled = ledger.response_ids[start:end]
        if turn.finish_reason is not None:
            ended = turn.finish_reason == "stop"
        else:  # recorded before turns kept their finish reason
            ended = bool(sampled) and sampled[-1] == tokenizer.eos_token_id
        chat.add_sampled(
            sampled,
            "stop" if ended else "length",
            logprobs=ledger.logprobs[start:end],
            versions=ledger.token_versions[start:end],
        )
        last = k + 1 == len(traj.turns) and turn.segment + 1 == len(ledgers)
        if last and end == len(ledger.response_ids):
            break  # nothing followed the last turn (finish, or a timeout in its tool call)
        if not ended and (turn.kind == "action" or turn.segment + 1 == len(ledgers)):
            # a reply cut off ends the episode (a summary: when no segment followed it)
            chat.close_turn()
            break
        if turn.kind == "summary":
            context.summarized(task, chat, turn.action)
        else:
            context.observed(task, chat, turn.observation, turn.tool_name)
    return chat


def rebuilds(traj: Trajectory, chat: ChatSession) -> bool:
    """Whether a rebuilt chat is the recorded episode up to where it stands: every
    segment's prompt, and its response so far."""
    recorded = traj.ledgers()
    rebuilt = chat.all_segments
    return len(rebuilt) <= len(recorded) and all(
        r.prompt_ids == c.prompt_ids and r.response_ids[: len(c.response_ids)] == c.response_ids
        for r, c in zip(recorded, rebuilt, strict=False)
    )


def seen_messages(
    task: Task, traj: Trajectory, tokenizer: PreTrainedTokenizerBase
) -> list[dict[str, Any]]:
    """What the model saw, as messages: agentrl's own episodes rebuilt through the chat
    template; an external harness's, and one whose rebuild is not what was recorded (an
    environment opened it: its first observation and tools came from its server), as each
    segment's tokens decoded (the ledger is what the model saw)."""
    if traj.agent is None:
        chat = conversation(task, traj, tokenizer)
        if rebuilds(traj, chat):
            return chat.messages
    return [
        {
            "role": f"segment {k} ({s.reason})",
            "content": tokenizer.decode(s.prompt_ids + s.response_ids),
        }
        for k, s in enumerate(traj.ledgers())
    ]
