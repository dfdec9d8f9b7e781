"""What a player plays an episode through: the narrow context of RUN, and the Player seam.

A player is what acts in RUN: agentrl's ReAct loop (`agentrl.episode.react`) or an
external harness through the gateway (`agentrl.episode.harness`). It gets a `Play`, never
the Episode: the sandbox and the tools, the one ledger of the conversation, the turn
records, the limits, and `generate`, which goes through the dispatcher's generation slot
and stops the agent's clock while the sampler has the episode. A player ends by
raising: `EpisodeEnd` with the agent's stop reason, or the error that failed it;
`Episode.boundary` alone turns either into the trajectory's stop reason.

This module sits below both the episode package and the gateway, so the gateway adapts
HTTP calls onto a `Play` and never imports the Episode.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn, Protocol

from agentrl.trajectory import AgentInfo, StopReason, Turn

if TYPE_CHECKING:
    from agentrl.chat import ChatSegment, ChatSession
    from agentrl.inference.base import Completion, Sampler, SamplingParams
    from agentrl.sandbox.base import Sandbox
    from agentrl.tasks.spec import EpisodeLimits, Instance, Task
    from agentrl.tools.base import Tool

Gate = Callable[[], AbstractAsyncContextManager[object]]
"""What a trajectory holds while the sampler works for it (a dispatcher's generation slot)."""


def no_gate() -> AbstractAsyncContextManager[object]:
    return contextlib.nullcontext()


class EpisodeEnd(Exception):
    """Ends the RUN stage; `stop_reason` says why (the agent's own ending)."""

    def __init__(self, stop_reason: StopReason) -> None:
        super().__init__(stop_reason.value)
        self.stop_reason = stop_reason


class Ledger(Protocol):
    """The token ledger of one episode, as its trajectory records it: every segment."""

    @property
    def all_segments(self) -> list[ChatSegment]: ...


@dataclass(eq=False)
class Play:
    """One episode's RUN as a player sees it. `chat` is the conversation the episode
    opened (the task's prompt, and the task's tools for the ReAct loop); `ledger` is what
    the trajectory records, the chat unless the player keeps its own (the harness's
    recorder). `generate` is the only way to the sampler."""

    trajectory_id: str
    task: Task
    instance: Instance
    sandbox: Sandbox
    tools: dict[str, Tool]
    chat: ChatSession
    turns: list[Turn]
    sampler: Sampler
    gate: Gate
    sampler_clock: Callable[[], AbstractAsyncContextManager[object]]
    """Held while the sampler has the episode: the agent's own clock stops meanwhile."""
    settle: Callable[[], Awaitable[None]]
    """Wait for the snapshot in flight: the next action must not change what it holds."""
    snapshot_last_turn: Callable[[], None]
    """Commit the sandbox as the last turn left it, if the snapshot policy says so."""
    ledger: Ledger | None = None
    agent: AgentInfo | None = None
    """The external harness that played, recorded by the harness player."""
    turn_rewards: dict[int, float] = field(default_factory=dict)
    """Rewards the environment gave for turns (by index), where it gives them (OpenEnv)."""

    @property
    def limits(self) -> EpisodeLimits:
        return self.task.spec.limits

    def add_turn(self, turn: Turn) -> Turn:
        self.turns.append(turn)
        return turn

    def reward_last_turn(self, reward: float | None) -> None:
        """Record the environment's reward for the last turn (None: it gave none)."""
        if reward is not None:
            self.turn_rewards[len(self.turns) - 1] = float(reward)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[Completion, float]:
        """One reply of the policy under the generation slot, the agent's clock stopped
        meanwhile: (the completion, its seconds in the sampler once the slot was held)."""
        async with self.sampler_clock(), self.gate():
            start = time.monotonic()
            completion = await self.sampler.generate(
                prompt_ids, params, session_id=self.trajectory_id
            )
            return completion, time.monotonic() - start


class Player(Protocol):
    """What plays RUN. `task_tools`: whether it acts with the task's tools and the
    episode's rendered prompt (the ReAct loop), or brings its own (a harness)."""

    task_tools: bool

    async def play(self, ctx: Play) -> NoReturn:
        """Act until the episode ends; end by raising (`EpisodeEnd`, or what failed)."""
        ...
