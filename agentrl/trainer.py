"""`agentrl train`: the controller of the sync schedule.

Each step: the next `prompts_per_step` training prompts (a seeded shuffle per epoch, so
the order is a function of the seed and the step alone), `n_samples_per_prompt`
episodes each through the configured dispatcher, advantages per group, one
forward/backward over the batch and one optimizer step, then the new weights are
published to the sampler (version v + 1). Held-out instances are evaluated before the
first step, every `eval.every` steps and after the last one.

Everything a run writes is in its output folder:
  metrics.jsonl        one line per step (and per evaluation), grep-able
  tensorboard/         the same numbers, when the `tensorboard` package is installed
  trajectories.jsonl   every episode, validated, with its scheduled/consumed step
  checkpoints/step-N   atomic checkpoints; `--resume` continues from the newest
  reward.png           train reward per step and held-out reward with 95% intervals
  summary.json         before/after held-out reward, times
A resumed run drops the metric lines and trajectories of steps the checkpoint does not
cover, so the files read as one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentrl.agent import Episode
from agentrl.algorithms import compute_advantages, group_stats
from agentrl.backends.base import samples_from
from agentrl.backends.checkpoint import latest_checkpoint
from agentrl.errors import ConfigError
from agentrl.runner import RunInfo, make_env, write_atomic, write_run_info
from agentrl.tasks.env import TaskEnv
from agentrl.trajectory import Trajectory, TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.backends.fsdp import FSDPBackend
    from agentrl.backends.ranks import Leader
    from agentrl.inference.local import LocalSampler
    from agentrl.inference.router import Router
    from agentrl.tasks.spec import Instance, Task
    from agentrl.train_config import TrainConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    task: int  # index into the config's tasks
    instance: Instance

    @property
    def id(self) -> str:
        return f"{self.task}:{self.instance.id}"


def split(tasks: Sequence[Task], holdout_every: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval): every `holdout_every`-th instance of each task (from the first) is eval."""
    train: list[Prompt] = []
    held: list[Prompt] = []
    for t, task in enumerate(tasks):
        for i, inst in enumerate(task.instances):
            (held if i % holdout_every == 0 else train).append(Prompt(t, inst))
    return train, held


def data_order(n: int, seed: int, start: int, count: int) -> list[int]:
    """Indices of the prompts at positions [start, start + count) of the run's stream:
    epoch after epoch, each a permutation seeded by (seed, epoch)."""
    out = []
    for pos in range(start, start + count):
        epoch, k = divmod(pos, n)
        perm = list(range(n))
        random.Random(f"{seed}/{epoch}").shuffle(perm)
        out.append(perm[k])
    return out


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% normal interval (0 with fewer than 2 values)."""
    if not values:
        return float("nan"), 0.0
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, 1.96 * statistics.stdev(values) / math.sqrt(len(values))


def batch_metrics(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    rewards = [t.reward for t in trajs if t.trainable and t.reward is not None]
    mean, half = mean_interval(rewards)
    return {
        "episodes": len(trajs),
        "reward_mean": mean,
        "reward_ci95": half,
        "reward_std": statistics.pstdev(rewards) if rewards else float("nan"),
        "pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else float("nan"),
        "infra_failures": sum(not t.trainable for t in trajs),
        "stop_reasons": dict(Counter(t.stop_reason.value for t in trajs)),
        "sampled_tokens": sum(t.num_sampled for t in trajs),
        "total_tokens": sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs),
    }


class Trainer:
    """One training run of `config` writing into `out_dir`."""

    def __init__(
        self,
        config: TrainConfig,
        tasks: Sequence[Task],
        out_dir: Path,
        *,
        show_progress: bool = True,
    ) -> None:
        self.config, self.tasks, self.out = config, list(tasks), out_dir
        self.task_paths = [t.path for t in self.tasks]
        self.show_progress = show_progress
        self.train, self.held = split(self.tasks, config.eval.holdout_every)
        if not self.train or not self.held:
            raise ConfigError(
                f"{len(self.train)} training and {len(self.held)} held-out instances",
                fix="give the tasks more instances, or change eval.holdout_every",
            )
        self.temperature = _temperature(self.tasks)
        self.ckpt_root = out_dir / "checkpoints"
        self.run_id = f"train-{config.name}-{uuid.uuid4().hex[:6]}"
        self._board: Any = None

    async def run(self, *, resume: bool = False) -> dict[str, Any]:
        """Train; returns the summary (empty on torchrun ranks other than 0)."""
        cfg = self.config
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        backend_cfg = cfg.backend.model_copy(
            update={"temperature": self.temperature, "seed": cfg.seed}
        )
        backend_cfg.check().validate_loss(cfg.algorithm.loss)
        if rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        built = backend_cfg.build(None if cfg.model == "embedded" else cfg.model)
        backend: FSDPBackend | Leader = built
        if world > 1:  # under torchrun: rank 0 leads, the others mirror its backend calls
            from agentrl.backends.ranks import Leader, control_group, follow

            group = control_group()
            if rank != 0:
                try:
                    calls = follow(built, group)
                    log.info("rank %d: followed %d backend calls", rank, calls)
                finally:
                    built.close()
                return {}
            backend = Leader(built, group)
        try:
            return await self._lead(backend, resume)
        finally:
            backend.close()

    async def _lead(self, backend: FSDPBackend | Leader, resume: bool) -> dict[str, Any]:
        """Rank 0 (or the only rank): rollouts, training calls, files."""
        from agentrl.inference.embedded import load_tokenizer
        from agentrl.sandbox import provider as make_provider

        cfg = self.config
        tokenizer = load_tokenizer()
        sampler = _sampler(cfg, self.out)
        provider = make_provider(cfg.provider)
        envs = [make_env(task, provider, self.run_id) for task in self.tasks]
        start = 0
        try:
            if resume and (path := latest_checkpoint(self.ckpt_root)) is not None:
                start = int(backend.load_checkpoint(path)["step"])
                self._truncate(start)
                log.info("resumed from %s at step %d", path, start)
            elif resume:
                log.info(
                    "--resume: no complete checkpoint in %s; starting at step 0", self.ckpt_root
                )
            else:
                self._fresh()
            info = RunInfo(run_id=self.run_id, provider=provider.name, tasks=self.task_paths)
            write_run_info(self.out, info)
            backend.publish(sampler)  # the sampler samples exactly the learner's weights
            self._board = _board(self.out / "tensorboard")
            return await self._loop(backend, sampler, tokenizer, envs, start)
        finally:
            if self._board is not None:
                self._board.close()
            await sampler.close()
            from agentrl.sandbox.docker import remove_run

            if cfg.provider == "docker":
                remove_run(provider.client, self.run_id)  # type: ignore[attr-defined]

    async def _loop(
        self,
        backend: FSDPBackend | Leader,
        sampler: LocalSampler | Router,
        tokenizer: PreTrainedTokenizerBase,
        envs: list[TaskEnv],
        start: int,
    ) -> dict[str, Any]:
        cfg = self.config
        sched = cfg.schedule
        store = TrajectoryStore(self.out / "trajectories.jsonl")
        started = time.monotonic()
        with Progress(
            TextColumn("[bold]{task.fields[name]}[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            disable=not self.show_progress,
        ) as progress:
            steps_bar = progress.add_task("", total=sched.steps, completed=start, name="train")
            if start == 0:
                await self._evaluate(0, sampler, tokenizer, envs, progress)
            for step in range(start, sched.steps):
                row = await self._step(step, backend, sampler, tokenizer, envs, progress, store)
                progress.update(
                    steps_bar,
                    advance=1,
                    description=f"reward {row['reward_mean']:.2f}  loss {row.get('loss', 0):.3f}",
                )
                done = step + 1
                if (cfg.eval.every and done % cfg.eval.every == 0) or done == sched.steps:
                    await self._evaluate(done, sampler, tokenizer, envs, progress)
                if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or (
                    done == sched.steps
                ):
                    self._checkpoint(backend, done)
        summary = self._summary(time.monotonic() - started)
        _plot(self.out / "metrics.jsonl", self.out / "reward.png", cfg.name)
        return summary

    async def _step(
        self,
        step: int,
        backend: FSDPBackend | Leader,
        sampler: LocalSampler | Router,
        tokenizer: PreTrainedTokenizerBase,
        envs: list[TaskEnv],
        progress: Progress,
        store: TrajectoryStore,
    ) -> dict[str, Any]:
        cfg, sched = self.config, self.config.schedule
        order = data_order(
            len(self.train), cfg.seed, step * sched.prompts_per_step, sched.prompts_per_step
        )
        prompts = [self.train[i] for i in order]
        n = sched.n_samples_per_prompt
        episodes = [
            Episode(
                self.tasks[p.task],
                p.instance,
                step * n + k,  # unique trajectory ids across the run
                sampler,
                tokenizer,
                envs[p.task],
                scheduled_step=step,
                snapshots=cfg.snapshots,
            )
            for p in prompts
            for k in range(n)
        ]
        t0 = time.monotonic()
        trajs = await self._rollout(episodes, progress, f"step {step + 1} rollout")
        t1 = time.monotonic()
        trajs = [t.model_copy(update={"consumed_step": step}) for t in trajs]
        for t in trajs:
            store.append(t)
        advantages = compute_advantages(trajs, cfg.algorithm.advantage)
        samples = samples_from(trajs, advantages)
        row: dict[str, Any] = {"kind": "train", "step": step + 1, **batch_metrics(trajs)}
        row["prompts"] = [p.id for p in prompts]
        stats = group_stats(trajs)
        row["zero_variance_groups"] = stats.zero_variance_groups
        supervised = cfg.algorithm.loss.type == "cross_entropy"  # advantages unused
        if samples and (supervised or any(s.advantage != 0.0 for s in samples)):
            row.update(backend.forward_backward(samples, cfg.algorithm.loss))
            row.update(backend.optim_step())
            t2 = time.monotonic()
            row["policy_version"] = backend.publish(sampler)
        else:  # every group tied: no gradient, nothing to publish; the prompts are consumed
            row["skipped"] = "no group had a reward spread" if samples else "no trainable episode"
            t2 = time.monotonic()
            row["policy_version"] = sampler.policy_version
        t3 = time.monotonic()
        row.update(
            rollout_s=round(t1 - t0, 2), train_s=round(t2 - t1, 2), publish_s=round(t3 - t2, 2)
        )
        from agentrl.inference.router import Router

        if isinstance(sampler, Router):  # which replica serves which version
            row["replicas"] = sampler.status()
        self._log(row)
        return row

    async def _evaluate(
        self,
        step: int,
        sampler: LocalSampler | Router,
        tokenizer: PreTrainedTokenizerBase,
        envs: list[TaskEnv],
        progress: Progress,
    ) -> dict[str, Any]:
        episodes = [
            Episode(
                self.tasks[p.task],
                p.instance,
                j,
                sampler,
                tokenizer,
                envs[p.task],
                snapshots=self.config.snapshots,
            )
            for p in self.held
            for j in range(self.config.eval.samples)
        ]
        t0 = time.monotonic()
        trajs = await self._rollout(episodes, progress, f"eval after step {step}")
        (self.out / "eval").mkdir(exist_ok=True)
        store = TrajectoryStore(self.out / "eval" / f"step-{step:06d}.jsonl")
        for t in trajs:
            store.append(t)
        row = {"kind": "eval", "step": step, **batch_metrics(trajs)}
        row["eval_s"] = round(time.monotonic() - t0, 2)
        self._log(row)
        return row

    async def _rollout(
        self, episodes: list[Episode], progress: Progress, what: str
    ) -> list[Trajectory]:
        from agentrl.dispatch import make_dispatcher

        cfg = self.config.dispatcher
        dispatcher = make_dispatcher(cfg.type, **cfg.model_dump(exclude={"type"}))
        bar = progress.add_task(what, total=len(episodes), name="episodes")
        out: list[Trajectory] = []
        try:
            async with aclosing(dispatcher.run(episodes)) as stream:
                async for traj in stream:
                    out.append(traj)
                    progress.update(bar, advance=1)
        finally:
            progress.remove_task(bar)
        return out

    def _checkpoint(self, backend: FSDPBackend | Leader, done: int) -> None:
        path = backend.save_checkpoint(
            self.ckpt_root, {"step": done, "seed": self.config.seed}, step=done
        )
        log.info("checkpoint %s", path)
        keep = self.config.checkpoint.keep
        complete = sorted(p for p in self.ckpt_root.glob("step-*") if ".tmp" not in p.name)
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _log(self, row: dict[str, Any]) -> None:
        with (self.out / "metrics.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        log.info("%s", json.dumps({k: v for k, v in row.items() if k != "prompts"}))
        if self._board is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._board.add_scalar(f"{row['kind']}/{key}", value, row["step"])
            self._board.flush()

    def _fresh(self) -> None:
        for name in ("metrics.jsonl", "trajectories.jsonl", "summary.json", "reward.png"):
            (self.out / name).unlink(missing_ok=True)
        shutil.rmtree(self.ckpt_root, ignore_errors=True)
        shutil.rmtree(self.out / "eval", ignore_errors=True)
        shutil.rmtree(self.out / "tensorboard", ignore_errors=True)

    def _truncate(self, start: int) -> None:
        """Keep only what steps < start (and the evals up to `start`) wrote."""
        metrics = self.out / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            kept = [r for r in rows if r["step"] <= start]  # train rows count done steps
            write_atomic(metrics, "".join(json.dumps(r) + "\n" for r in kept))
        trajs = self.out / "trajectories.jsonl"
        if trajs.exists():
            kept_t = [t for t in TrajectoryStore(trajs) if t.scheduled_step < start]
            write_atomic(trajs, "".join(t.to_json() + "\n" for t in kept_t))

    def _summary(self, seconds: float) -> dict[str, Any]:
        rows = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if r["kind"] == "eval"]
        train = [r for r in rows if r["kind"] == "train"]
        summary = {
            "name": self.config.name,
            "steps": len(train),
            "eval_before": _eval_view(evals[0]) if evals else None,
            "eval_after": _eval_view(evals[-1]) if evals else None,
            "eval_episodes": evals[-1]["episodes"] if evals else 0,
            "train_reward_first": train[0]["reward_mean"] if train else None,
            "train_reward_last": train[-1]["reward_mean"] if train else None,
            "seconds": round(seconds, 1),
        }
        write_atomic(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def _board(folder: Path) -> Any:
    """A TensorBoard writer, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(folder))


def _eval_view(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("step", "reward_mean", "reward_ci95", "pass_rate", "episodes")}


def _temperature(tasks: Sequence[Task]) -> float:
    """The one sampling temperature of the run; the learner divides its logits by it."""
    temps = {t.spec.sampling.temperature for t in tasks}
    if len(temps) != 1:
        raise ConfigError(
            f"the tasks sample at different temperatures {sorted(temps)}",
            fix="give every task of a train config the same sampling.temperature",
        )
    for t in tasks:
        if t.spec.sampling.top_p < 1.0:
            raise ConfigError(
                f"task {t.spec.name}: sampling.top_p {t.spec.sampling.top_p} < 1: the learner "
                "cannot reproduce the logprobs of a truncated distribution",
                fix="set sampling.top_p: 1.0 in tasks you train on",
            )
    temp = temps.pop()
    if temp <= 0:
        raise ConfigError(
            "sampling.temperature 0 (greedy) has no logprobs to learn from",
            fix="train with a temperature > 0 (e.g. 0.7 or 1.0)",
        )
    return temp


def _sampler(cfg: TrainConfig, out: Path) -> LocalSampler | Router:
    from agentrl.inference.local import LocalSampler

    if cfg.servers is not None:
        from agentrl.inference.router import Router

        s = cfg.servers
        return Router(
            s.urls,
            pause_mode=s.pause,
            transfer=s.transfer,
            publish_dir=out / "published",
            request_timeout=s.request_timeout,
        )
    model = cfg.model
    if model == "embedded":
        return LocalSampler.embedded()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return LocalSampler(
        AutoModelForCausalLM.from_pretrained(model, dtype="float32").eval(),
        tokenizer=AutoTokenizer.from_pretrained(model),
    )


def _plot(metrics: Path, png: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r["step"] for r in train],
        [r["reward_mean"] for r in train],
        marker=".",
        label="train batch reward",
    )
    if evals:
        ax.errorbar(
            [r["step"] for r in evals],
            [r["reward_mean"] for r in evals],
            yerr=[r["reward_ci95"] for r in evals],
            fmt="o",
            capsize=4,
            label=f"held-out reward (95% CI, {evals[-1]['episodes']} episodes)",
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(name)
    ax.legend(loc="upper left")
    fig.tight_layout()
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(png)
