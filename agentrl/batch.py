"""What a batch of episodes did, in numbers: one model and one function for `agentrl run`'s
summary.json and for each train step's and held-out evaluation's row in metrics.jsonl.

Rewards are over the graded episodes; infrastructure failures are counted apart (never
graded, never trained on). Per-episode means (turns, tool calls) are over the agent's
episodes. A turn is an action turn (a summary the policy wrote of its history is not
one); a tool error is what the turn records as one (`Turn.tool_error`: no call parsed, an
unknown tool, bad arguments, the tool's own error), never guessed from the observation's
text. A float with nothing to average is NaN in memory and in metrics.jsonl (null in
summary.json, `finite`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, Field, field_validator

from agentrl.scores import mean_interval
from agentrl.trajectory import Trajectory, agent_counts

NAN = float("nan")


class BatchStats(BaseModel):
    """What a batch of episodes did (see the module docstring)."""

    episodes: int
    reward_mean: float = Field(description="over graded episodes (nan: none)")
    reward_ci95: float = Field(description="half-width of the mean's 95% interval")
    reward_std: float
    reward_min: float = NAN
    reward_max: float = NAN
    pass_rate: float = Field(description="share of graded episodes with reward >= 1")
    infra_failures: int = Field(description="episodes not graded, never trained on")
    infra_error: str | None = Field(default=None, description="the first infra failure's")
    infra_fix: str | None = None
    stop_reasons: dict[str, int]
    sampled_tokens: int
    total_tokens: int = Field(description="prompt + response tokens over every segment")
    turns_mean: float = Field(default=NAN, description="action turns per episode")
    tool_calls_mean: float = Field(
        default=NAN, description="turns per episode whose reply held a tool call"
    )
    tool_calls: int = Field(default=0, description="turns whose reply held a tool call")
    tool_errors: int = Field(default=0, description="turns whose call failed (Turn.tool_error)")
    segments: int = Field(
        default=0, description="segments beyond each episode's first (history was rewritten)"
    )
    gen_seconds: float = Field(default=0.0, description="seconds the sampler worked, summed")
    tool_seconds: float = Field(default=0.0, description="seconds the tools worked, summed")
    sandbox_seconds: float = Field(
        default=0.0, description="seconds the episodes held a sandbox (INIT, turns, EVAL), summed"
    )
    agent: dict[str, int] = Field(
        default_factory=dict,
        description="episodes an external harness played: their model calls, edits (calls "
        "that began a client segment) and drift (calls whose messages as sent would have "
        "tokenized otherwise); {} when none",
    )

    @field_validator(
        "reward_mean",
        "reward_std",
        "reward_min",
        "reward_max",
        "pass_rate",
        "turns_mean",
        "tool_calls_mean",
        mode="before",
    )
    @classmethod
    def _null_is_nan(cls, value: Any) -> Any:
        return NAN if value is None else value  # summary.json writes nan as null


def batch_stats(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """The fields of `BatchStats` for `trajs` (a dict, so a record that extends the model
    takes them with its own)."""
    rewards = [t.reward for t in trajs if t.trainable and t.reward is not None]
    infra = [t for t in trajs if not t.trainable]
    turns = [turn for t in trajs for turn in t.turns]
    mean, half = mean_interval(rewards)
    return dict(
        episodes=len(trajs),
        reward_mean=mean,
        reward_ci95=half,
        reward_std=statistics.pstdev(rewards) if rewards else NAN,
        reward_min=min(rewards) if rewards else NAN,
        reward_max=max(rewards) if rewards else NAN,
        pass_rate=sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else NAN,
        infra_failures=len(infra),
        infra_error=infra[0].error if infra else None,
        infra_fix=infra[0].fix if infra else None,
        stop_reasons=dict(Counter(t.stop_reason.value for t in trajs)),
        sampled_tokens=sum(t.num_sampled for t in trajs),
        total_tokens=sum(
            len(ledger.prompt_ids) + len(ledger.response_ids)
            for t in trajs
            for ledger in t.ledgers()
        ),
        turns_mean=_per_episode(trajs, lambda t: sum(u.kind == "action" for u in t.turns)),
        tool_calls_mean=_per_episode(
            trajs, lambda t: sum(u.tool_call is not None for u in t.turns)
        ),
        tool_calls=sum(turn.tool_call is not None for turn in turns),
        tool_errors=sum(turn.tool_error for turn in turns),
        segments=sum(len(t.segments) for t in trajs),
        gen_seconds=round(sum(turn.gen_seconds for turn in turns), 3),
        tool_seconds=round(sum(turn.tool_seconds for turn in turns), 3),
        sandbox_seconds=round(sum(sandbox_seconds(t) for t in trajs), 3),
        agent=agent_counts(trajs),
    )


def sandbox_seconds(traj: Trajectory) -> float:
    """Seconds the episode held its sandbox: INIT (or a restore), its turns, EVAL."""
    return math.fsum(traj.seconds.get(stage, 0.0) for stage in ("init", "run", "eval"))


def _per_episode(trajs: Sequence[Trajectory], count: Callable[[Trajectory], int]) -> float:
    """The mean of `count` over the episodes that were the agent's (nan: none)."""
    mine = [count(t) for t in trajs if t.trainable]
    return statistics.fmean(mine) if mine else NAN


def finite(value: Any) -> Any:
    """`value` with every non-finite float as None (JSON has no NaN; a nan reward mean
    means 'nothing graded')."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value
