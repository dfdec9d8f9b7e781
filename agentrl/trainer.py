"""`agentrl train`: the controller of the sync and fully-async schedules.

sync, each step: the next `prompts_per_step` training prompts (a seeded shuffle per
epoch, so the order is a function of the seed and the step alone),
`n_samples_per_prompt` episodes each through the configured dispatcher, advantages per
group, one forward/backward over the batch and one optimizer step, then the new weights
are published to the sampler (version v + 1).

async: one dispatcher run is fed groups for the whole run, admitted under the staleness
budget (`agentrl.async_schedule`); the trainer takes mini-batches of finished groups
while generation goes on, trains and publishes in a worker thread (the sampler pauses
with in-flight requests kept, so a reply may span two versions: `token_versions` says
which token came from which), then widens the budget by one step. Zero-variance groups
are filtered. Trained and filtered prompt ids of the current epoch are checkpointed and
skipped on resume. Each step row adds the lag of its groups (consumed - scheduled step),
its sampled tokens by version age, the admission counters, and the idle fractions of
trainer and sampler; `admission.jsonl` holds the counters over time and `async.png`
plots them with the lag distribution.

Held-out instances are evaluated before the first step, every `eval.every` steps and
after the last one.

Everything a run writes is in its output folder:
  metrics.jsonl        one line per step (and per evaluation), grep-able
  tensorboard/         the same numbers, when the `tensorboard` package is installed
  trajectories.jsonl   every episode, validated, with its scheduled/consumed step
  checkpoints/step-N   atomic checkpoints; `--resume` continues from the newest
  reward.png           train reward per step and held-out reward with 95% intervals
  summary.json         before/after held-out reward, times
A checkpoint records how many metric lines and trajectories were written when it was
taken; a resumed run drops those written after, so the files read as one uninterrupted run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentrl.agent import Episode
from agentrl.algorithms import compute_advantages, group_stats
from agentrl.async_schedule import Admission, Group, GroupBuffer, MeteredSampler, no_signal
from agentrl.backends.base import WeightSink, samples_from
from agentrl.backends.checkpoint import latest_checkpoint
from agentrl.dispatch.core import Feed, cancel_and_wait
from agentrl.errors import ConfigError
from agentrl.inference.base import Sampler
from agentrl.inference.local import model_tokenizer
from agentrl.preflight import preflight
from agentrl.runner import RunInfo, make_env, write_atomic, write_run_info
from agentrl.tasks.env import EpisodeEnv
from agentrl.train_config import AsyncSchedule
from agentrl.trajectory import Trajectory, TrajectoryStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.backends.base import TrainerBackend
    from agentrl.backends.fsdp import FSDPConfig
    from agentrl.backends.tinker import TinkerConfig
    from agentrl.tasks.spec import Instance, Task
    from agentrl.train_config import TrainConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class TrainSampler(Sampler, WeightSink, Protocol):
    """What the trainer samples with and publishes to."""


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


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The prompts of one epoch: a permutation of range(n) seeded by (seed, epoch)."""
    perm = list(range(n))
    random.Random(f"{seed}/{epoch}").shuffle(perm)
    return perm


def data_order(n: int, seed: int, start: int, count: int) -> list[int]:
    """Indices of the prompts at positions [start, start + count) of the run's stream:
    epoch after epoch, each a permutation seeded by (seed, epoch)."""
    out = []
    for pos in range(start, start + count):
        epoch, k = divmod(pos, n)
        out.append(epoch_order(n, seed, epoch)[k])
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
    infra = [t for t in trajs if not t.trainable]
    mean, half = mean_interval(rewards)
    first = {"infra_error": infra[0].error, "infra_fix": infra[0].fix} if infra else {}
    return {
        **first,
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
    """One training run of `config` writing into `out_dir`.

    `sampler` replaces the one the config names (tests and benchmarks pass a simulated
    one); the trainer closes it.
    """

    def __init__(
        self,
        config: TrainConfig,
        tasks: Sequence[Task],
        out_dir: Path,
        *,
        show_progress: bool = True,
        sampler: TrainSampler | None = None,
    ) -> None:
        self.config, self.out = config, out_dir
        self.tasks = [_at_temperature(t, config.temperature) for t in tasks]
        self.task_paths = [t.path for t in self.tasks]
        self.show_progress = show_progress
        self.train, self.held = split(self.tasks, config.eval.holdout_every)
        if not self.train or not self.held:
            raise ConfigError(
                f"{len(self.train)} training and {len(self.held)} held-out instances",
                fix="give the tasks more instances, or change eval.holdout_every",
            )
        sched = config.schedule
        if isinstance(sched, AsyncSchedule) and len(self.train) < sched.prompts_per_step:
            raise ConfigError(
                f"{len(self.train)} training prompts cannot fill one mini-batch of "
                f"schedule.prompts_per_step {sched.prompts_per_step} groups",
                fix="lower prompts_per_step or give the tasks more instances",
            )
        self.temperature = _temperature(self.tasks)
        self.ckpt_root = out_dir / "checkpoints"
        self.run_id = f"train-{config.name}-{uuid.uuid4().hex[:6]}"
        self._board: Any = None
        self._given_sampler = sampler
        # Training steps, publications and checkpoints run on this one thread, off the event
        # loop: the learner's tensors stay with one thread while generation and tools go on.
        self._learner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        self._lines = 0  # metric lines written (a checkpoint records it)
        self._stored = 0  # trajectories written

    async def run(self, *, resume: bool = False) -> dict[str, Any]:
        """Train; returns the summary (empty on torchrun ranks other than 0).

        With `resume`, a run with no complete checkpoint is refused (ConfigError), never
        silently started over."""
        cfg = self.config
        if resume and latest_checkpoint(self.ckpt_root) is None:
            raise ConfigError(
                f"--resume: no complete checkpoint in {self.ckpt_root}",
                fix="start from step 0 without --resume (add --overwrite to replace the "
                "folder), or point --out at the run to continue",
            )
        backend_cfg = cfg.backend.model_copy(
            update={"temperature": self.temperature, "seed": cfg.seed}
        )
        backend_cfg.check().validate_loss(cfg.algorithm.loss)
        if cfg.cluster is None:
            return await self._run(backend_cfg, resume)
        from agentrl.backends.fsdp import FSDPConfig
        from agentrl.cluster import connect, disconnect
        from agentrl.cluster.trainer import TrainerGroup, environment

        connect(cfg.cluster.address, cfg.cluster.namespace)
        ranks = None
        try:
            if cfg.cluster.trainer is not None:  # rank 0 here, the followers as Ray actors
                if "WORLD_SIZE" in os.environ:
                    raise ConfigError(
                        "cluster.trainer starts the trainer ranks as Ray actors: "
                        "do not also start agentrl train under torchrun",
                        fix="start `agentrl train` as one process",
                    )
                assert isinstance(backend_cfg, FSDPConfig)  # the config validator checks
                ranks = TrainerGroup(cfg.cluster.trainer)
                model_path = None if cfg.model == "embedded" else cfg.model
                await asyncio.to_thread(ranks.start, backend_cfg, model_path)
            with environment(ranks.env if ranks is not None else {}):
                return await self._run(backend_cfg, resume)
        finally:
            if ranks is not None:
                await asyncio.to_thread(ranks.close)
            disconnect()

    async def _run(self, backend_cfg: FSDPConfig | TinkerConfig, resume: bool) -> dict[str, Any]:
        cfg = self.config
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
        if world > 1 and backend_cfg.type != "fsdp":
            raise ConfigError(
                f"backend {backend_cfg.type} trains on its service: run it without torchrun",
                fix="start `agentrl train` as one process",
            )
        # The learner thread owns the backend: built, driven and closed there, so a remote
        # backend's blocking calls never run on the event loop.
        model_path = None if cfg.model == "embedded" else cfg.model
        built: TrainerBackend = await self._on_learner(backend_cfg.build, model_path)
        backend = built
        if world > 1:  # under torchrun: rank 0 leads, the others mirror its backend calls
            from agentrl.backends.fsdp import FSDPBackend
            from agentrl.backends.ranks import Leader, control_group, follow

            assert isinstance(built, FSDPBackend)  # the world > 1 check above
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
            try:
                await self._on_learner(backend.close)
            finally:
                self._learner.shutdown(wait=True)

    async def _lead(self, backend: TrainerBackend, resume: bool) -> dict[str, Any]:
        """Rank 0 (or the only rank): rollouts, training calls, files."""
        cfg = self.config
        tokenizer = model_tokenizer(cfg.model)
        async with contextlib.AsyncExitStack() as stack:
            sampler = self._given_sampler or await self._sampler(backend, stack)
            stack.push_async_callback(sampler.close)
            envs = await self._envs(stack)
            await preflight(envs, sampler, tokenizer)
            resumed: dict[str, Any] = {}
            if resume and (path := latest_checkpoint(self.ckpt_root)) is not None:
                resumed = await self._on_learner(backend.load_checkpoint, path)
                self._truncate(resumed)
                log.info("resumed from %s at step %d", path, resumed["step"])
            else:
                self._fresh()
            info = RunInfo(run_id=self.run_id, provider=cfg.provider, tasks=self.task_paths)
            write_run_info(self.out, info)
            # The sampler samples exactly the learner's weights.
            await self._on_learner(backend.publish, sampler)
            self._board = _board(self.out / "tensorboard")
            if self._board is not None:
                stack.callback(self._board.close)
            return await self._loop(backend, sampler, tokenizer, envs, resumed)
        raise AssertionError("unreachable")  # the exit stack does not swallow exceptions

    async def _envs(self, stack: contextlib.AsyncExitStack) -> list[EpisodeEnv]:
        """Each task's EpisodeEnv: here (docker or local), or on the cluster's sandbox nodes."""
        cfg = self.config
        if cfg.cluster is None:
            from agentrl.sandbox import provider as make_provider

            provider = make_provider(cfg.provider)
            if cfg.provider == "docker":
                from agentrl.sandbox.docker import remove_run

                client = provider.client  # type: ignore[attr-defined]
                stack.callback(remove_run, client, self.run_id)
            return [make_env(task, provider, self.run_id) for task in self.tasks]
        from agentrl.cluster.sandboxes import RemoteTaskEnv, SandboxFleet

        nodes = cfg.cluster.sandboxes
        fleet = SandboxFleet(self.run_id, resource=nodes.resource, refresh_s=nodes.refresh_s)
        stack.push_async_callback(fleet.close)
        await fleet.start()
        return [RemoteTaskEnv(task, fleet, self.run_id) for task in self.tasks]

    async def _sampler(
        self, backend: TrainerBackend, stack: contextlib.AsyncExitStack
    ) -> TrainSampler:
        cfg = self.config
        replicas = cfg.cluster.samplers if cfg.cluster is not None else None
        urls: list[str] = []
        if replicas is not None:
            from agentrl.cluster.samplers import SamplerFleet

            fleet = SamplerFleet(replicas, cfg.model, _publish_pause(cfg))
            stack.push_async_callback(fleet.close)
            urls = await fleet.start()
        return _sampler(cfg, self.out, backend, urls)

    async def _loop(
        self,
        backend: TrainerBackend,
        sampler: TrainSampler,
        tokenizer: PreTrainedTokenizerBase,
        envs: list[EpisodeEnv],
        resumed: dict[str, Any],
    ) -> dict[str, Any]:
        cfg = self.config
        sched = cfg.schedule
        start = int(resumed.get("step", 0))
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
            if isinstance(sched, AsyncSchedule):
                steps = self._async_steps(sampler, tokenizer, envs, store, resumed, backend)
            else:
                steps = self._sync_steps(start, sampler, tokenizer, envs, progress, store, backend)
            async with aclosing(steps) as rows:
                async for row, extra in rows:
                    progress.update(
                        steps_bar,
                        advance=1,
                        description=f"reward {row['reward_mean']:.2f}  "
                        f"loss {row.get('loss', 0):.3f}",
                    )
                    done = row["step"]
                    if (cfg.eval.every and done % cfg.eval.every == 0) or done == sched.steps:
                        await self._evaluate(done, sampler, tokenizer, envs, progress)
                    if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or (
                        done == sched.steps
                    ):
                        await self._on_learner(self._checkpoint, backend, done, extra)
        summary = self._summary(time.monotonic() - started)
        _plot(self.out / "metrics.jsonl", self.out / "reward.png", cfg.name)
        if isinstance(sched, AsyncSchedule):
            _plot_async(self.out, cfg.name, sched.max_staleness_steps)
        return summary

    async def _sync_steps(
        self,
        start: int,
        sampler: TrainSampler,
        tokenizer: PreTrainedTokenizerBase,
        envs: list[EpisodeEnv],
        progress: Progress,
        store: TrajectoryStore,
        backend: TrainerBackend,
    ) -> AsyncGenerator[tuple[dict[str, Any], dict[str, Any]], None]:
        """The sync schedule's steps: (metrics row, checkpoint extra) after each."""
        cfg, sched = self.config, self.config.schedule
        meter = MeteredSampler(sampler)
        for step in range(start, sched.steps):
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
                    meter,
                    tokenizer,
                    envs[p.task],
                    scheduled_step=step,
                    snapshots=cfg.snapshots,
                )
                for p in prompts
                for k in range(n)
            ]
            t0, idle = time.monotonic(), meter.idle_s()
            trajs = await self._rollout(episodes, progress, f"step {step + 1} rollout")
            t1 = time.monotonic()
            trajs = [t.model_copy(update={"consumed_step": step}) for t in trajs]
            for t in trajs:
                self._append(store, t)
            row: dict[str, Any] = {"kind": "train", "step": step + 1, **batch_metrics(trajs)}
            row["prompts"] = [p.id for p in prompts]
            row.update(await self._train(backend, sampler, trajs))
            wall = max(time.monotonic() - t0, 1e-9)
            row["rollout_s"] = round(t1 - t0, 2)
            row["wait_s"] = round(t1 - t0, 3)  # the trainer waits for the whole rollout
            row["trainer_idle_frac"] = round((t1 - t0) / wall, 4)
            row["sampler_idle_frac"] = round((meter.idle_s() - idle) / wall, 4)
            row["step_s"] = round(wall, 3)
            self._log(row)
            yield row, {}

    async def _async_steps(
        self,
        sampler: TrainSampler,
        tokenizer: PreTrainedTokenizerBase,
        envs: list[EpisodeEnv],
        store: TrajectoryStore,
        resumed: dict[str, Any],
        backend: TrainerBackend,
    ) -> AsyncGenerator[tuple[dict[str, Any], dict[str, Any]], None]:
        """The fully-async schedule's steps: (metrics row, checkpoint extra) after each."""
        from agentrl.dispatch import make_dispatcher

        cfg = self.config
        sched = cfg.schedule
        assert isinstance(sched, AsyncSchedule)
        B, n, S = sched.prompts_per_step, sched.n_samples_per_prompt, sched.max_staleness_steps
        step = int(resumed.get("step", 0))
        data = _DataState.from_extra(resumed)
        buf = GroupBuffer(Admission.resumed(B, S, step))
        meter = MeteredSampler(sampler)
        feed = Feed()
        groups: dict[str, Group] = {}  # trajectory id -> its group, until it comes back
        timeline = _Timeline(self.out / "admission.jsonl", buf)

        async def produce() -> None:
            while True:
                used = data.trained | data.filtered
                for i in epoch_order(len(self.train), cfg.seed, data.epoch):
                    prompt = self.train[i]
                    if prompt.id in used:  # consumed before a resume
                        continue
                    scheduled = await buf.admit()
                    group = Group(data.next_group, data.epoch, prompt.id, scheduled, n)
                    data.next_group += 1
                    for k in range(n):
                        ep = Episode(
                            self.tasks[prompt.task],
                            prompt.instance,
                            group.index * n + k,  # unique trajectory ids across the run
                            meter,
                            tokenizer,
                            envs[prompt.task],
                            scheduled_step=scheduled,
                            snapshots=cfg.snapshots,
                        )
                        groups[ep.trajectory_id] = group
                        feed.put(ep)
                await buf.end_epoch()  # returns when the trainer has closed the epoch

        async def collect() -> None:
            dcfg = cfg.dispatcher
            dispatcher = make_dispatcher(dcfg.type, **dcfg.model_dump(exclude={"type"}))
            async with aclosing(dispatcher.run(feed)) as stream:
                async for traj in stream:
                    group = groups.pop(traj.trajectory_id)
                    group.trajectories.append(traj)
                    if not group.complete:
                        continue
                    keep = not (
                        sched.filter_zero_variance
                        and no_signal(group.trajectories, sched.filter_tolerance)
                    )
                    if not keep:
                        data.filtered.add(group.prompt_id)
                        for t in group.trajectories:  # consumed_step None: never trained
                            self._append(store, t)
                    await buf.finish(group, keep=keep)
                    timeline.flush()

        workers = [
            asyncio.create_task(produce(), name="async producer"),
            asyncio.create_task(collect(), name="async collector"),
        ]
        last = time.monotonic()
        idle_before = meter.idle_s()
        try:
            while step < sched.steps:
                wait_from = time.monotonic()
                batch, epoch_end = await _watch(buf.take(B), workers)
                waited = time.monotonic() - wait_from
                timeline.flush()
                if epoch_end:
                    self._log(
                        {
                            "kind": "epoch_end",
                            "step": step,
                            "epoch": data.epoch,
                            "trained_prompts": len(data.trained),
                            "filtered_prompts": len(data.filtered),
                            "partial_batch": [g.prompt_id for g in batch],
                        }
                    )
                    log.info(
                        "epoch %d ends: %d prompts trained, %d filtered, a partial batch of "
                        "%d groups is not trained",
                        data.epoch, len(data.trained), len(data.filtered), len(batch),
                    )  # fmt: skip
                    if not data.trained:
                        raise ConfigError(
                            f"epoch {data.epoch} could not fill one mini-batch: "
                            f"{len(data.filtered)} of its {len(self.train)} prompts were "
                            "filtered as having no reward signal (every episode of the group "
                            "got the same reward)",
                            fix="check the grader and the task's difficulty, raise "
                            "n_samples_per_prompt, or set schedule.filter_zero_variance: false",
                        )
                    data.next_epoch()
                    await buf.next_epoch()
                    continue
                lags = [step - g.scheduled_step for g in batch]
                for g, lag in zip(batch, lags, strict=True):
                    if lag > S:
                        log.warning(
                            "group %d (prompt %s) scheduled at step %d is consumed at step %d: "
                            "lag %d exceeds max_staleness_steps %d (trained on)",
                            g.index, g.prompt_id, g.scheduled_step, step, lag, S,
                        )  # fmt: skip
                trajs = [
                    t.model_copy(update={"consumed_step": step})
                    for g in batch
                    for t in g.trajectories
                ]
                for t in trajs:
                    self._append(store, t)
                version = sampler.policy_version  # the learner's weights, last published
                row: dict[str, Any] = {"kind": "train", "step": step + 1, **batch_metrics(trajs)}
                row["prompts"] = [g.prompt_id for g in batch]
                row["epoch"] = data.epoch
                row["lag"] = _histogram(lags)
                row["lag_max"] = max(lags)
                row["stale_groups"] = sum(lag > S for lag in lags)
                row["tokens_by_age"] = _histogram(
                    version - v
                    for t in trajs
                    for v, m in zip(t.token_versions, t.loss_mask, strict=True)
                    if m
                )
                row.update(await self._train(backend, sampler, trajs))
                await buf.advance()
                step += 1
                data.trained.update(row["prompts"])
                now, idle = time.monotonic(), meter.idle_s()
                wall = max(now - last, 1e-9)
                row["wait_s"] = round(waited, 3)
                row["trainer_idle_frac"] = round(waited / wall, 4)
                row["sampler_idle_frac"] = round((idle - idle_before) / wall, 4)
                row["step_s"] = round(wall, 3)
                row.update(buf.admission.counters())
                last, idle_before = now, idle
                timeline.flush()
                self._log(row)
                yield row, data.to_extra()
        finally:
            feed.close()
            await cancel_and_wait(workers)
            timeline.flush()

    async def _train(
        self, backend: TrainerBackend, sampler: TrainSampler, trajs: list[Trajectory]
    ) -> dict[str, Any]:
        """Advantages, one optimizer step over `trajs` and the publication, on the learner
        thread (generation, tools and grading go on meanwhile)."""
        cfg = self.config
        advantages = compute_advantages(trajs, cfg.algorithm.advantage)
        samples = samples_from(trajs, advantages)
        row: dict[str, Any] = {"zero_variance_groups": group_stats(trajs).zero_variance_groups}
        supervised = cfg.algorithm.loss.type == "cross_entropy"  # advantages unused
        t1 = time.monotonic()
        if samples and (supervised or any(s.advantage != 0.0 for s in samples)):
            row.update(await self._on_learner(backend.train_step, samples, cfg.algorithm.loss))
            t2 = time.monotonic()
            row["policy_version"] = await self._on_learner(backend.publish, sampler)
        else:  # every group tied: no gradient, nothing to publish; the prompts are consumed
            row["skipped"] = "no group had a reward spread" if samples else "no trainable episode"
            t2 = time.monotonic()
            row["policy_version"] = sampler.policy_version
        t3 = time.monotonic()
        row.update(train_s=round(t2 - t1, 2), publish_s=round(t3 - t2, 2))
        from agentrl.inference.router import Router

        if isinstance(sampler, Router):  # which replica serves which version
            row["replicas"] = sampler.status()
        return row

    async def _evaluate(
        self,
        step: int,
        sampler: TrainSampler,
        tokenizer: PreTrainedTokenizerBase,
        envs: list[EpisodeEnv],
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

    def _checkpoint(self, backend: TrainerBackend, done: int, extra: dict[str, Any]) -> None:
        # What was written up to now: a resume drops what comes after.
        written = {"metrics_lines": self._lines, "trajectories": self._stored}
        path = backend.save_checkpoint(
            self.ckpt_root,
            {"step": done, "seed": self.config.seed, **written, **extra},
            step=done,
        )
        log.info("checkpoint %s", path)
        keep = self.config.checkpoint.keep
        complete = sorted(p for p in self.ckpt_root.glob("step-*") if ".tmp" not in p.name)
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    async def _on_learner(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._learner, fn, *args)

    def _append(self, store: TrajectoryStore, trajectory: Trajectory) -> None:
        store.append(trajectory)
        self._stored += 1

    def _log(self, row: dict[str, Any]) -> None:
        row.setdefault("rss_mb", _rss_mb())
        with (self.out / "metrics.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._lines += 1
        log.info("%s", json.dumps({k: v for k, v in row.items() if k != "prompts"}))
        if row.get("infra_failures"):  # apart from the rewards: never trained on
            log.warning(
                "%s %s: %d infrastructure failures (not graded, not trained on); first: %s%s",
                row["kind"],
                row["step"],
                row["infra_failures"],
                row.get("infra_error"),
                f"; fix: {row['infra_fix']}" if row.get("infra_fix") else "",
            )
        if self._board is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._board.add_scalar(f"{row['kind']}/{key}", value, row["step"])
            self._board.flush()

    def _fresh(self) -> None:
        for name in (
            "metrics.jsonl",
            "trajectories.jsonl",
            "summary.json",
            "reward.png",
            "admission.jsonl",
            "async.png",
        ):
            (self.out / name).unlink(missing_ok=True)
        shutil.rmtree(self.ckpt_root, ignore_errors=True)
        shutil.rmtree(self.out / "eval", ignore_errors=True)
        shutil.rmtree(self.out / "tensorboard", ignore_errors=True)

    def _truncate(self, checkpoint: dict[str, Any]) -> None:
        """Keep only the metric lines and trajectories written before `checkpoint`."""
        self._lines, self._stored = checkpoint["metrics_lines"], checkpoint["trajectories"]
        metrics = self.out / "metrics.jsonl"
        if metrics.exists():
            lines = metrics.read_text().splitlines(keepends=True)[: self._lines]
            write_atomic(metrics, "".join(lines))
        trajs = self.out / "trajectories.jsonl"
        if trajs.exists():
            kept = list(itertools.islice(TrajectoryStore(trajs), self._stored))
            write_atomic(trajs, "".join(t.to_json() + "\n" for t in kept))

    def _summary(self, seconds: float) -> dict[str, Any]:
        rows = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if r["kind"] == "eval"]
        train = [r for r in rows if r["kind"] == "train"]
        summary = {
            "name": self.config.name,
            "schedule": self.config.schedule.type,
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


@dataclass
class _DataState:
    """Where the async schedule is in its data: checkpointed, so a resume neither repeats
    nor skips a prompt of the current epoch."""

    epoch: int = 0
    trained: set[str] = field(default_factory=set)  # prompt ids of this epoch
    filtered: set[str] = field(default_factory=set)
    next_group: int = 0  # admission index of the next group (its trajectory ids)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> _DataState:
        return cls(
            int(extra.get("epoch", 0)),
            set(extra.get("trained_prompts", [])),
            set(extra.get("filtered_prompts", [])),
            int(extra.get("next_group", 0)),
        )

    def to_extra(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "trained_prompts": sorted(self.trained),
            "filtered_prompts": sorted(self.filtered),
            "next_group": self.next_group,
        }

    def next_epoch(self) -> None:
        self.epoch += 1
        self.trained.clear()
        self.filtered.clear()


class _Timeline:
    """Appends the admission counters' changes to admission.jsonl (wall-clock stamped)."""

    def __init__(self, path: Path, buffer: GroupBuffer) -> None:
        self.path, self.buffer, self.done = path, buffer, 0
        self.origin = time.time() - (time.monotonic() - buffer.start)

    def flush(self) -> None:
        rows = self.buffer.timeline[self.done :]
        if not rows:
            return
        with self.path.open("a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({"time": round(self.origin + r["t"], 3), **r}) + "\n")
        self.done += len(rows)


def _histogram(values: Iterable[int]) -> dict[str, int]:
    """{"value": count}, keys in numeric order (JSON keys are strings)."""
    counts = Counter(values)
    return {str(k): counts[k] for k in sorted(counts)}


async def _watch(awaitable: Awaitable[T], workers: list[asyncio.Task[None]]) -> T:
    """Await `awaitable`; if a worker ends first (it never should), raise what ended it."""
    main = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait([main, *workers], return_when=asyncio.FIRST_COMPLETED)
            if main in done:
                return main.result()
            for w in done:
                if not w.cancelled() and (error := w.exception()) is not None:
                    raise error
                raise RuntimeError(f"the {w.get_name()} stopped")
    finally:
        if not main.done():
            main.cancel()


def _board(folder: Path) -> Any:
    """A TensorBoard writer, or None when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(folder))


def _eval_view(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in ("step", "reward_mean", "reward_ci95", "pass_rate", "episodes")}


def _at_temperature(task: Task, temperature: float | None) -> Task:
    """`task` sampling at `temperature` (the train config's override), or as it is."""
    if temperature is None:
        return task
    sampling = task.spec.sampling.model_copy(update={"temperature": temperature})
    return task.model_copy(update={"spec": task.spec.model_copy(update={"sampling": sampling})})


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


def _publish_pause(cfg: TrainConfig) -> Literal["keep"] | None:
    """An in-process sampler under the async schedule publishes mid-reply, keeping
    in-flight requests (each token is stamped with the version that sampled it)."""
    return "keep" if cfg.schedule.type == "async" else None


def _sampler(
    cfg: TrainConfig, out: Path, backend: TrainerBackend, replicas: Sequence[str] = ()
) -> TrainSampler:
    """The configured sampler; `replicas`: URLs of sampler actors to route to as well."""
    from agentrl.backends.tinker import TinkerBackend
    from agentrl.inference.local import LocalSampler

    if isinstance(backend, TinkerBackend):  # samples what the service publishes
        return backend.sampler()

    if cfg.servers is not None or replicas:
        from agentrl.inference.router import Router
        from agentrl.train_config import ServersConfig

        s = cfg.servers or ServersConfig(urls=list(replicas))
        return Router(
            [*(cfg.servers.urls if cfg.servers else []), *replicas],
            pause_mode=s.pause,
            transfer=s.transfer,
            publish_dir=out / "published",
            request_timeout=s.request_timeout,
            control_timeout=s.control_timeout,
            clear_kv_cache=s.clear_kv_cache,
            cache_salt=s.cache_salt,
        )
    local = LocalSampler.for_model(cfg.model)
    if (pause := _publish_pause(cfg)) is not None:
        local.publish_pause = pause
    return local


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


def _plot_async(out: Path, name: str, max_staleness: int) -> None:
    """async.png: the admission counters over time, and the lag and token-age histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = [json.loads(line) for line in (out / "admission.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train" and "lag" in r]
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
        lags.update({int(k): v for k, v in r["lag"].items()})
        ages.update({int(k): v for k, v in r["tokens_by_age"].items()})
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
    fig.tight_layout()
    png = out / "async.png"
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(png)


def _rss_mb() -> float:
    """This process's resident memory now, in MiB (peak where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
