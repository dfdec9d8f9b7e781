"""Countdown: say the numbers from `start` down to 1, one per step.

Each right number earns 1.0, a wrong one -0.5 (the count goes on); the episode is done at
1. Two actions exist to test what a trainer does with a misbehaving step: `number: 999`
raises inside the environment (an EXECUTION_ERROR answer), `number: -1` ends the server
process (as an agent's action that crashes its environment would).
"""

import os
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class CountAction(Action):
    """Say the next number of the countdown."""

    number: int = Field(description="the next number, counting down to 1")


class CountObservation(Observation):
    message: str = ""
    remaining: int = 0


class CountdownEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(episode_id="countdown", step_count=0)
        self._next = 3

    def reset(
        self, start: int = 3, episode_id: str | None = None, **kwargs: Any
    ) -> CountObservation:
        self._next = int(start)
        self._state = State(episode_id=episode_id or "countdown", step_count=0)
        return CountObservation(
            message=f"Count down from {self._next} to 1, one number per step.",
            remaining=self._next,
            reward=0.0,
            done=False,
        )

    def step(
        self, action: CountAction, timeout_s: float | None = None, **kwargs: Any
    ) -> CountObservation:
        self._state.step_count += 1
        if action.number == -1:
            os._exit(3)
        if action.number == 999:
            raise ValueError("999 is not a number this environment counts")
        if action.number != self._next:
            return CountObservation(
                message=f"wrong: the next number is {self._next}",
                remaining=self._next,
                reward=-0.5,
                done=False,
            )
        self._next -= 1
        done = self._next == 0
        return CountObservation(
            message="done" if done else "right",
            remaining=self._next,
            reward=1.0,
            done=done,
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(CountdownEnvironment, CountAction, CountObservation, env_name="countdown_env")
