"""What a run records: typed step, eval and epoch rows in metrics.jsonl, and the summary.

Each row is a pydantic model written as one JSON line (`model_dump`, fields left None
omitted) and read back with `model_validate`, its `kind` choosing the model; the JSON
keys are flat, so the file stays grep-able and `jq`-able.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from agentrl import atomic
from agentrl.batch import BatchStats

if TYPE_CHECKING:
    from agentrl.train.plots import Board

log = logging.getLogger(__name__)


def resident_mb() -> float:
    """This process's resident memory now, in MiB (peak where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class EvalRecord(BatchStats):
    """The held-out instances evaluated after `step` steps, scored as `agentrl eval`
    scores (`agentrl.scores`): the attempts are in `eval/step-N/`."""

    kind: Literal["eval"] = "eval"
    step: int
    pass_at_1: float = Field(
        default=float("nan"), description="mean over instances of solved / graded attempts"
    )
    pass_at_1_ci95: float = Field(default=0.0, description="half-width of its 95% interval")
    pass_at_k: dict[str, float] = Field(
        default_factory=dict, description="k -> unbiased pass@k (Chen et al. 2021)"
    )
    eval_s: float = Field(description="seconds the evaluation took")
    rss_mb: float = Field(default_factory=resident_mb, description="this process's memory, MiB")


class TrainRecord(BatchStats):
    """One trainer step (`step` counts from 1). Beside these fields: the backend's
    train_step metrics (loss, grad_norm, lr, logprob_mismatch, ...), flat."""

    model_config = ConfigDict(extra="allow")

    kind: Literal["train"] = "train"
    step: int
    prompts: list[str] = Field(description="prompt ids, `<task>:<instance>`")
    zero_variance_groups: int
    overlong_masked: int = Field(
        default=0, description="context_limit episodes not trained on (algorithm.overlong)"
    )
    samples: int = Field(default=0, description="ledgers trained on (segments count apart)")
    policy_version: int = Field(description="the sampler's version after the step")
    skipped: float | str | None = Field(
        default=None, description="why no update was made (or the backend's 0.0 / 1.0)"
    )
    train_s: float
    publish_s: float
    replicas: list[dict[str, Any]] | None = Field(
        default=None, description="the router's view: which replica serves which version"
    )
    rollout_s: float | None = Field(default=None, description="sync: the batch's rollout")
    wait_s: float = Field(description="seconds the trainer waited for the batch")
    trainer_idle_frac: float
    sampler_idle_frac: float
    step_s: float
    # async only
    epoch: int | None = None
    lag: dict[str, int] | None = Field(default=None, description="groups by consumed - scheduled")
    lag_max: int | None = None
    stale_groups: int | None = Field(default=None, description="groups with lag > S")
    tokens_by_age: dict[str, int] | None = Field(
        default=None, description="sampled tokens by (last published - sampling) version"
    )
    branch_episodes: int | None = Field(
        default=None, description="branch credit: continuations run for this step's values"
    )
    branch_infra_failures: int | None = None
    branch_sampled_tokens: int | None = Field(
        default=None, description="tokens the continuations sampled after their branch point"
    )
    branch_states: int | None = Field(default=None, description="states given a value")
    branch_restore_p50_s: float | None = None
    branch_restore_p95_s: float | None = None
    branch_values: dict[str, dict[str, float]] | None = Field(
        default=None, description="per turn t: mean and sd over states of V(s_t), and states"
    )
    turn_adv_pos_frac: float | None = Field(
        default=None, description="share of the episodes' turns with a positive advantage"
    )
    turn_adv_neg_frac: float | None = None
    failed_first_turn_credited: float | None = Field(
        default=None,
        description="share of episodes without full reward whose first turn "
        "got a positive advantage",
    )
    submitted: int | None = None
    accepted: int | None = None
    filtered: int | None = None
    running: int | None = None
    buffered: int | None = None
    rss_mb: float = Field(default_factory=resident_mb, description="this process's memory, MiB")


class EpochEndRecord(BaseModel):
    """async: an epoch's end; its partial batch (fewer than B groups) is not trained."""

    kind: Literal["epoch_end"] = "epoch_end"
    step: int
    epoch: int
    trained_prompts: int
    filtered_prompts: int
    partial_batch: list[str]
    rss_mb: float = Field(default_factory=resident_mb, description="this process's memory, MiB")


Record = Annotated[TrainRecord | EvalRecord | EpochEndRecord, Field(discriminator="kind")]
_RECORD: TypeAdapter[TrainRecord | EvalRecord | EpochEndRecord] = TypeAdapter(Record)


def read_records(path: Path) -> list[TrainRecord | EvalRecord | EpochEndRecord]:
    """The rows of a metrics.jsonl (json.loads: a nan reward is written as NaN)."""
    lines = path.read_text().splitlines()
    return [_RECORD.validate_python(json.loads(line)) for line in lines if line.strip()]


class MetricsLog:
    """metrics.jsonl, appended and fsynced a row at a time, and mirrored to TensorBoard.
    `lines` counts the rows: a checkpoint records it, a resume truncates to it."""

    def __init__(self, path: Path, board: Board | None = None) -> None:
        self.path, self.board, self.lines = path, board, 0

    def write(self, record: TrainRecord | EvalRecord | EpochEndRecord) -> None:
        row = record.model_dump(exclude_none=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines += 1
        log.info("%s", json.dumps({k: v for k, v in row.items() if k != "prompts"}))
        if isinstance(record, BatchStats) and record.infra_failures:  # never trained on
            log.warning(
                "%s %s: %d infrastructure failures (not graded, not trained on); first: %s%s",
                record.kind,
                record.step,
                record.infra_failures,
                record.infra_error,
                f"; fix: {record.infra_fix}" if record.infra_fix else "",
            )
        if self.board is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.board.add_scalar(f"{record.kind}/{key}", value, record.step)
            self.board.flush()

    def truncate(self, lines: int) -> None:
        """Keep the first `lines` rows (those written before a checkpoint)."""
        self.lines = lines
        if self.path.exists():
            kept = self.path.read_text().splitlines(keepends=True)[:lines]
            atomic.write_text(self.path, "".join(kept))


class EvalView(BaseModel):
    """An evaluation as the summary shows it."""

    step: int
    reward_mean: float
    reward_ci95: float
    pass_rate: float
    pass_at_1: float = float("nan")
    pass_at_1_ci95: float = 0.0
    pass_at_k: dict[str, float] = Field(default_factory=dict)
    episodes: int


class Summary(BaseModel):
    """summary.json: the held-out reward before and after, the train reward, the time."""

    name: str
    schedule: str
    steps: int
    eval_before: EvalView | None
    eval_after: EvalView | None
    eval_episodes: int
    train_reward_first: float | None
    train_reward_last: float | None
    seconds: float
    skipped_steps: dict[str, int] = Field(
        default_factory=dict, description="steps that made no update, by why (their `skipped`)"
    )

    @classmethod
    def of(cls, path: Path, name: str, schedule: str, seconds: float) -> Summary:
        """The summary of the metrics.jsonl at `path`."""
        records = read_records(path)
        evals = [r for r in records if isinstance(r, EvalRecord)]
        train = [r for r in records if isinstance(r, TrainRecord)]
        view = set(EvalView.model_fields)

        def shown(r: EvalRecord) -> EvalView:
            return EvalView.model_validate(r.model_dump(include=view))

        return cls(
            name=name,
            schedule=schedule,
            steps=len(train),
            eval_before=shown(evals[0]) if evals else None,
            eval_after=shown(evals[-1]) if evals else None,
            eval_episodes=evals[-1].episodes if evals else 0,
            train_reward_first=train[0].reward_mean if train else None,
            train_reward_last=train[-1].reward_mean if train else None,
            seconds=round(seconds, 1),
            skipped_steps=dict(Counter(_why_skipped(r.skipped) for r in train if r.skipped)),
        )


def _why_skipped(skipped: float | str) -> str:
    """A step's `skipped` as a reason: the trainer's own words, or the backend's 1.0."""
    return skipped if isinstance(skipped, str) else "the backend dropped a non-finite gradient"
