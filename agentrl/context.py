"""Context management for long episodes: what a turn's history looks like to the model.

The task's `context:` policy (`tasks/spec.py:ContextPolicy`, docs/tasks.md#context-management)
says three things:

- an observation longer than `observation_tokens` keeps its head and tail, half each,
  around a line saying how many tokens were cut (the turn records what the model saw);
- with `history: drop_oldest`, before a turn whose prompt plus `max_new_tokens` would
  pass `budget_tokens`, the oldest turns are dropped (never the system prompt, the task,
  or the last `keep_turns` turns), as few as make the prompt fit;
- with `history: summarize`, at that point the policy itself is asked (`summary_prompt`)
  for a summary of its work: a turn of its own (kind `summary`, trained like any other
  sampled tokens, not counted against max_turns). The summary, appended to the task,
  then replaces every turn but the last `keep_turns`. The request goes in with the
  observation that filled the budget, in one template delta, so asking starts no segment.

Dropping and summarizing change history, so the episode continues in a new segment
(`ChatSession.restart`). Every decision here is a function of the chat and the policy
alone, so `agent.conversation` rebuilds the same segments from the turn records.
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


def observe(task: Task, chat: ChatSession, text: str, tool_name: str | None) -> str:
    """Add the output of tool `tool_name` (None: no call was made), truncated by the
    policy, to the chat; return what the model sees."""
    shown = truncate(chat, text, task.spec.context.observation_tokens)
    observed(task, chat, shown, tool_name)
    return shown


def observed(task: Task, chat: ChatSession, shown: str, tool_name: str | None) -> None:
    """Add an observation as the model sees it, in the message its template takes; when
    it fills the budget of a summarizing policy, the summary request goes in with it."""
    messages: list[Message] = [chat.observation(shown, tool_name)]
    policy, reply = task.spec.context, task.spec.limits.max_new_tokens
    if policy.history == "summarize" and chat.length_after(messages) + reply > budget(task, chat):
        messages.append(_request(task))
    chat.add_messages(messages)


def budget(task: Task, chat: ChatSession) -> int:
    """`budget_tokens`, or its default: the whole context, less, when the policy
    summarizes, the room the summary needs: its request as this chat's template renders it
    and `summary_tokens`. The summary is asked when the next turn would pass the budget,
    and one cut off ends the episode: a budget of the whole context left it a few tokens
    (every summary of the embedded model on the trail task), and one less summary_tokens
    alone still left the request's tokens out (about 70 of them)."""
    policy, context_length = task.spec.context, task.spec.limits.context_length
    if policy.budget_tokens is not None:
        return policy.budget_tokens
    if policy.history != "summarize":
        return context_length
    request = max(chat.length_after([_request(task)]) - len(chat), 0)
    return context_length - policy.summary_tokens - request


def over_budget(task: Task, chat: ChatSession) -> bool:
    return len(chat) + task.spec.limits.max_new_tokens > budget(task, chat)


def drop_oldest(task: Task, chat: ChatSession) -> None:
    """With `history: drop_oldest` and the next turn over budget: continue in a new
    segment without the oldest turns (as few as fit; keep_turns at least kept)."""
    policy = task.spec.context
    if policy.history != "drop_oldest" or not over_budget(task, chat):
        return
    starts = _turn_starts(chat, chat.messages)
    droppable = starts[: max(len(starts) - policy.keep_turns, 0)]
    if not droppable:
        return
    room = budget(task, chat) - task.spec.limits.max_new_tokens
    head = _with_note(chat.opening, _DROPPED)
    for k in range(1, len(droppable) + 1):
        cut = starts[k] if k < len(starts) else len(chat.messages)
        messages = head + chat.messages[cut:]
        if len(chat.encode(chat.render(messages, generation_prompt=True))) <= room:
            break
    chat.restart(messages, "drop_oldest")


def wants_summary(task: Task, chat: ChatSession, actions_since: int) -> bool:
    """Whether to ask for a summary before the next action: the policy has acted since its
    last summary (a summary of a summary is never asked), and the request is in (see
    `observed`) or the next turn would pass the budget."""
    if actions_since == 0 or task.spec.context.history != "summarize":
        return False
    return _asked(task, chat) or over_budget(task, chat)


def ask_summary(task: Task, chat: ChatSession) -> None:
    """Put the summary request to the policy, unless it went in with the observation."""
    if not _asked(task, chat):
        chat.add_messages([_request(task)])


def summarized(task: Task, chat: ChatSession, summary: str) -> None:
    """Continue in a new segment: the system prompt and the task with the summary, then
    the last `keep_turns` turns as they were (the request and the reply not repeated)."""
    before = chat.messages[:-2]  # the summary request and the summary are the last two
    starts = _turn_starts(chat, before)
    keep = task.spec.context.keep_turns
    recent = before[starts[-min(keep, len(starts))] :] if keep and starts else []
    head = _with_note(chat.opening, _SUMMARY_HEADER + summary.strip())
    chat.restart(head + recent, "summary")


def _request(task: Task) -> Message:
    return {"role": "user", "content": task.spec.context.summary_prompt}


def _asked(task: Task, chat: ChatSession) -> bool:
    """Whether the chat's last message is the summary request (not yet answered)."""
    last = chat.messages[-1] if len(chat.messages) > len(chat.opening) else {}
    return last == _request(task)


def _turn_starts(chat: ChatSession, messages: list[Message]) -> list[int]:
    """Where each turn (an assistant message and what answered it) begins in `messages`,
    after the chat's opening (the system prompt and the task: never dropped)."""
    first = len(chat.opening)
    return [i for i, m in enumerate(messages) if i >= first and m.get("role") == "assistant"]


def _with_note(head: list[Message], note: str) -> list[Message]:
    """The head with `note` appended to the task message (its last message)."""
    *first, task_message = (dict(m) for m in head)
    task_message["content"] = f"{task_message.get('content', '')}{note}"
    return [*first, task_message]
