"""Context management for long episodes: what a turn's history looks like to the model.

The task's `context:` policy (`tasks/spec.py:ContextPolicy`) says three things:

- an observation longer than `observation_tokens` keeps its head and tail, half each,
  with a line saying how many tokens were cut (the turn records what the model saw);
- with `history: drop_oldest`, before a turn whose prompt plus `max_new_tokens` would
  pass `budget_tokens`, the oldest turns are dropped (never the system prompt, the task,
  or the last `keep_turns` turns) until it fits;
- with `history: summarize`, the policy itself is asked (`summary_prompt`) for a summary
  of its work; the summary replaces every turn so far. It is a turn of its own (kind
  `summary`, trained like any other sampled tokens).

Dropping and summarizing change history, so the episode continues in a new segment
(`ChatSession.restart`). Every decision here is a function of the chat and the policy
alone, so replay rebuilds the same segments from the turn records.
"""

from __future__ import annotations

from agentrl.chat import ChatSession, Message
from agentrl.tasks.spec import Task

_CUT = "\n[... {n} tokens of output cut ...]\n"
_SUMMARY_HEADER = "\n\nYour own summary of your work on this task so far:\n"
_DROPPED = "\n\n(Your earliest turns were dropped to fit the context window.)"


def truncate(chat: ChatSession, text: str, max_tokens: int | None) -> str:
    """`text`, or its head and tail (`max_tokens` in all) around a line saying how many
    tokens were cut."""
    if max_tokens is None:
        return text
    ids = chat.encode(text)
    if len(ids) <= max_tokens:
        return text
    head, tail = max_tokens // 2, max_tokens - max_tokens // 2
    cut = len(ids) - head - tail
    return chat.decode(ids[:head]) + _CUT.format(n=cut) + chat.decode(ids[-tail:])


def observe(task: Task, chat: ChatSession, text: str) -> str:
    """Add a tool observation (truncated by the policy) to the chat; return what the
    model sees."""
    shown = truncate(chat, text, task.spec.context.observation_tokens)
    chat.add_messages([{"role": "tool", "content": shown}])
    return shown


def budget(task: Task) -> int:
    return task.spec.context.budget_tokens or task.spec.limits.context_length


def over_budget(task: Task, chat: ChatSession) -> bool:
    return len(chat) + task.spec.limits.max_new_tokens > budget(task)


def drop_oldest(task: Task, chat: ChatSession) -> None:
    """With `history: drop_oldest` and the next turn over budget: continue in a new
    segment without the oldest turns (as few as fit; keep_turns at least kept)."""
    policy = task.spec.context
    if policy.history != "drop_oldest" or not over_budget(task, chat):
        return
    starts = _turn_starts(chat)
    keep = policy.keep_turns
    droppable = starts[: len(starts) - keep] if keep else starts
    if not droppable:
        return
    room = budget(task) - task.spec.limits.max_new_tokens
    for k in range(1, len(droppable) + 1):
        cut = starts[k] if k < len(starts) else len(chat.messages)
        messages = _with_note(chat.opening, _DROPPED) + chat.messages[cut:]
        if len(chat.encode(chat.render(messages, generation_prompt=True))) <= room:
            break
    chat.restart(messages, "drop_oldest")


def wants_summary(task: Task, chat: ChatSession, actions_since: int) -> bool:
    """Whether to ask for a summary before the next action: over budget, and the policy
    has acted since its last summary (a summary of a summary is never asked)."""
    return (
        task.spec.context.history == "summarize" and actions_since > 0 and over_budget(task, chat)
    )


def ask_summary(task: Task, chat: ChatSession) -> None:
    """Put the summary request to the policy (a user message, then its reply)."""
    chat.add_messages([{"role": "user", "content": task.spec.context.summary_prompt}])


def summarized(chat: ChatSession, summary: str) -> None:
    """Continue in a new segment: the system prompt and the task, with the summary."""
    chat.restart(_with_note(chat.opening, _SUMMARY_HEADER + summary.strip()), "summary")


def _turn_starts(chat: ChatSession) -> list[int]:
    """Where each turn (an assistant message and what answered it) begins in the chat's
    messages, after its opening (the system prompt and the task: never dropped)."""
    first = len(chat.opening)
    return [i for i, m in enumerate(chat.messages) if i >= first and m.get("role") == "assistant"]


def _with_note(head: list[Message], note: str) -> list[Message]:
    """The head with `note` appended to the task message (its last message)."""
    *first, task_message = (dict(m) for m in head)
    task_message["content"] = f"{task_message.get('content', '')}{note}"
    return [*first, task_message]
