"""agentrl's own player: the ReAct loop (generate, parse, act, observe).

The token ledger is the episode's chat: it grows by appending, and continues in a new
segment when the template or the task's context policy (`agentrl.context`) rewrites
history. The loop ends by raising `EpisodeEnd` with its reason (max_turns too); a reply
the server aborted is the sampler's failure.
"""

from __future__ import annotations

from typing import Literal, NoReturn

from agentrl import context
from agentrl.errors import SamplerError
from agentrl.inference.base import SamplingParams
from agentrl.play import EpisodeEnd, Play
from agentrl.toolcall import act
from agentrl.trajectory import StopReason, Turn


class ReactPlayer:
    """Plays RUN with the task's tools and prompt."""

    task_tools = True

    async def play(self, ctx: Play) -> NoReturn:
        await _react(ctx)


async def _react(ctx: Play) -> NoReturn:
    """Generate, parse, act, observe: until a turn ends the episode or turns run out.
    Before each action the task's context policy may drop old turns or ask the policy
    for a summary (a turn of kind `summary`, not counted against max_turns)."""
    task, chat, turns, sandbox = ctx.task, ctx.chat, ctx.turns, ctx.sandbox
    limits = task.spec.limits
    since_summary = 0  # a branch starts with turns done: the first decision counts them
    for turn in turns:
        since_summary = 0 if turn.kind == "summary" else since_summary + 1
    while sum(t.kind == "action" for t in turns) < limits.max_turns:
        if context.wants_summary(task, chat, since_summary):
            context.ask_summary(task, chat)
            turn = await _sample(ctx, task.spec.context.summary_tokens, "summary")
            context.summarized(task, chat, turn.action)
            since_summary = 0
            continue
        context.drop_oldest(task, chat)
        turn = await _sample(ctx, limits.max_new_tokens, "action")
        await ctx.settle()  # before the sandbox changes
        obs = await act(turn.action, task.spec.prompt.action_format, ctx.tools, sandbox, turn)
        ctx.reward_last_turn(obs.reward)
        if obs.done:
            turn.observation = obs.text
            ctx.snapshot_last_turn()
            raise EpisodeEnd(StopReason.finished)
        # The turn is whole (its observation in the ledger) when its snapshot starts: the
        # run's journal records the state the snapshot holds.
        turn.observation = context.observe(task, chat, obs.text, turn.tool_name)
        ctx.snapshot_last_turn()
        since_summary += 1
    raise EpisodeEnd(StopReason.max_turns)


async def _sample(ctx: Play, max_tokens: int, kind: Literal["action", "summary"]) -> Turn:
    """One reply of the policy, appended to the chat and recorded as a turn; a reply the
    sampler cut off ends the episode."""
    task, chat = ctx.task, ctx.chat
    room = task.spec.limits.context_length - len(chat)
    if room <= 0:
        raise EpisodeEnd(StopReason.context_limit)
    sampling = task.spec.sampling
    params = SamplingParams(
        max_tokens=min(max_tokens, room),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop=tuple(sampling.stop) if kind == "action" else (),
    )
    completion, gen_seconds = await ctx.generate(chat.ids, params)
    begin = len(chat.response_ids)
    text = chat.add_sampled(
        completion.token_ids,
        completion.finish_reason,
        logprobs=completion.logprobs,
        versions=completion.token_versions,
    )
    turn = Turn(
        action=text,
        span=(begin, len(chat.response_ids)),
        segment=len(chat.segments),
        kind=kind,
        finish_reason=completion.finish_reason,
        gen_seconds=gen_seconds,
        replica=completion.replica,
    )
    ctx.add_turn(turn)
    if completion.finish_reason == "abort":  # cut off by the server: not the agent's doing
        raise SamplerError(
            f"the sampler aborted this reply after {len(completion.token_ids)} tokens",
            fix="a server paused with mode=abort outside the router, or was shut down",
        )
    if completion.finish_reason == "length" and (kind == "action" or params.max_tokens == room):
        chat.close_turn()
        raise EpisodeEnd(
            StopReason.context_limit if params.max_tokens == room else StopReason.sampler_length
        )
    return turn
