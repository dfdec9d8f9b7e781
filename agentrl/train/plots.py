"""What a run draws: reward.png, async.png, and the TensorBoard writer."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Protocol

from agentrl.figures import pyplot, save
from agentrl.train.records import EvalRecord, TrainRecord, read_records


class Board(Protocol):
    """The part of TensorBoard's SummaryWriter a run uses."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def tensorboard(folder: Path) -> Board | None:
    """A TensorBoard writer, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    board: Board = SummaryWriter(str(folder))
    return board


def plot_reward(metrics: Path, png: Path, name: str) -> None:
    """reward.png: the train batch reward per step, the held-out reward with its 95% CI."""
    plt = pyplot()
    records = read_records(metrics)
    train = [r for r in records if isinstance(r, TrainRecord)]
    evals = [r for r in records if isinstance(r, EvalRecord)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r.step for r in train],
        [r.reward_mean for r in train],
        marker=".",
        label="train batch reward",
    )
    if evals:
        ax.errorbar(
            [r.step for r in evals],
            [r.reward_mean for r in evals],
            yerr=[r.reward_ci95 for r in evals],
            fmt="o",
            capsize=4,
            label=f"held-out reward (95% CI, {evals[-1].episodes} episodes)",
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(name)
    ax.legend(loc="upper left")
    save(fig, png)


def plot_async(out: Path, name: str, max_staleness: int) -> None:
    """async.png: the admission counters over time, and the lag and token-age histograms."""
    plt = pyplot()
    timeline = [json.loads(line) for line in (out / "admission.jsonl").read_text().splitlines()]
    records = read_records(out / "metrics.jsonl")
    train = [r for r in records if isinstance(r, TrainRecord) and r.lag is not None]
    fig, (ax, ax_lag) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[2, 1])
    if timeline:
        t0 = timeline[0]["time"]
        times = [r["time"] - t0 for r in timeline]
        for key in ("running", "buffered", "accepted", "filtered"):
            ax.step(times, [r[key] for r in timeline], where="post", label=key)
    ax.set_xlabel("seconds")
    ax.set_ylabel("groups")
    ax.set_title(f"{name}: admission (S = {max_staleness})")
    ax.legend(loc="upper left")
    lags: Counter[int] = Counter()
    ages: Counter[int] = Counter()
    for r in train:
        lags.update({int(k): v for k, v in (r.lag or {}).items()})
        ages.update({int(k): v for k, v in (r.tokens_by_age or {}).items()})
    width = 0.4
    if lags:
        ax_lag.bar([k - width / 2 for k in lags], list(lags.values()), width, label="groups by lag")
    if ages:
        total = sum(ages.values())
        groups = sum(lags.values()) or 1
        ax_lag.bar(
            [k + width / 2 for k in ages],
            [v / total * groups for v in ages.values()],
            width,
            label="sampled tokens by version age (scaled)",
        )
    ax_lag.axvline(max_staleness + 0.5, color="grey", linestyle="--", label="S")
    ax_lag.set_xlabel("steps")
    ax_lag.set_title("lag (consumed - scheduled step)")
    ax_lag.legend(loc="upper right", fontsize=8)
    save(fig, out / "async.png")
