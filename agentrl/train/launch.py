"""`agentrl train`'s entry: check the config against the tasks, join the Ray cluster or
the torchrun world, build the backend on the learner thread, start the sampler and the
sandboxes on rank 0, and hand the run to the loop.

Ranks: under torchrun, rank 0 leads and the others mirror its backend calls
(`agentrl.backends.ranks`); with `cluster.trainer`, rank 0 runs here and the followers
are Ray actors. Everything a run writes is in its output folder:
  metrics.jsonl        one record per step (and per evaluation), grep-able
  tensorboard/         the same numbers, when the `tensorboard` package is installed
  trajectories.jsonl   every episode, validated, with its scheduled/consumed step
  checkpoints/step-N   atomic checkpoints; `--resume` continues from the newest
  reward.png           train reward per step and held-out reward with 95% intervals
  summary.json         before/after held-out reward, times
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.dispatch.stream import progress_bars
from agentrl.episode import make_env
from agentrl.errors import ConfigError
from agentrl.inference.embedded import model_tokenizer
from agentrl.preflight import preflight
from agentrl.run_info import RunInfo, read_run_info, write_run_info
from agentrl.tasks.select import with_overrides
from agentrl.train.data import run_temperature, split
from agentrl.train.loop import checkpoints, train_loop
from agentrl.train.records import MetricsLog
from agentrl.train.run import Learner, TrainRun
from agentrl.train.sampler import TrainSampler, train_sampler
from agentrl.train_config import start_problems
from agentrl.trajectory import TrajectoryStore
from agentrl.weights.checkpoint import latest_checkpoint

if TYPE_CHECKING:
    from agentrl.backends.base import TrainerBackend
    from agentrl.backends.config import FSDPConfig, TinkerConfig
    from agentrl.tasks.env import EpisodeEnv
    from agentrl.tasks.spec import Task
    from agentrl.train_config import TrainConfig

log = logging.getLogger(__name__)


class Trainer:
    """One training run of `config` writing into `out_dir`.

    `sampler` replaces the one the config names (tests and benchmarks pass a simulated
    one); the trainer closes it. `eval_tasks` are the loaded `eval.tasks`, in order.
    """

    def __init__(
        self,
        config: TrainConfig,
        tasks: Sequence[Task],
        out_dir: Path,
        *,
        show_progress: bool = True,
        sampler: TrainSampler | None = None,
        eval_tasks: Sequence[Task] = (),
    ) -> None:
        self.config, self.out = config, out_dir
        if len(eval_tasks) != len(config.eval.tasks):
            raise ValueError(
                f"eval_tasks: {len(eval_tasks)} loaded, eval.tasks names {len(config.eval.tasks)}"
            )
        problems = start_problems(config, tasks, eval_tasks)  # what `agentrl validate` says
        if problems:
            raise ConfigError(problems[0].message, fix=problems[0].fix)
        # held-out tasks (eval.tasks) come last: their prompts index into the same list
        temperature = config.temperature  # the train config's override, if any
        self.tasks = [
            with_overrides(t, temperature=temperature, agent=config.agent)
            for t in [*tasks, *eval_tasks]
        ]
        self.show_progress = show_progress
        self.train, self.held = split(self.tasks, config.eval.holdout_every, len(eval_tasks))
        self.temperature = run_temperature(self.tasks)
        self.run_id = f"train-{config.name}-{uuid.uuid4().hex[:6]}"
        self._given_sampler = sampler
        self._learner = Learner()

    async def run(self, *, resume: bool = False) -> dict[str, Any]:
        """Train; returns the summary (empty on torchrun ranks other than 0).

        With `resume`, a run with no complete checkpoint is refused (ConfigError), never
        silently started over."""
        cfg = self.config
        if resume and latest_checkpoint(checkpoints(self.out)) is None:
            raise ConfigError(
                f"--resume: no complete checkpoint in {checkpoints(self.out)}",
                fix="start from step 0 without --resume (add --overwrite to replace the "
                "folder), or point --out at the run to continue",
            )
        if resume:  # the same run: the snapshots its episodes made before a kill are its own
            with contextlib.suppress(ConfigError, ValueError):
                self.run_id = read_run_info(self.out).run_id
        backend_cfg = cfg.backend.model_copy(
            update={"temperature": self.temperature, "seed": cfg.seed}
        )
        backend_cfg.check().validate_loss(cfg.algorithm.loss)
        if cfg.cluster is None:
            return await self._ranks(backend_cfg, resume)
        from agentrl.backends.config import FSDPConfig
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
                return await self._ranks(backend_cfg, resume)
        finally:
            if ranks is not None:
                await asyncio.to_thread(ranks.close)
            disconnect()

    async def _ranks(self, backend_cfg: FSDPConfig | TinkerConfig, resume: bool) -> dict[str, Any]:
        """Build the backend on the learner thread; rank 0 leads, the others follow it."""
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
        built: TrainerBackend = await self._learner.call(backend_cfg.build, model_path)
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
                await self._learner.call(backend.close)
            finally:
                self._learner.shutdown()

    async def _lead(self, backend: TrainerBackend, resume: bool) -> dict[str, Any]:
        """Rank 0 (or the only rank): the sampler and sandboxes, then the loop."""
        cfg = self.config
        tokenizer = model_tokenizer(cfg.model)
        async with contextlib.AsyncExitStack() as stack:
            sampler = self._given_sampler or await self._sampler(backend, stack)
            stack.push_async_callback(sampler.close)
            envs = await self._envs(stack)
            await preflight(envs, sampler, tokenizer)
            task_paths = [t.path for t in self.tasks]
            info = RunInfo(
                run_id=self.run_id, provider=cfg.provider, tasks=task_paths, model=cfg.model
            )
            write_run_info(self.out, info)
            run = TrainRun(
                config=cfg,
                out=self.out,
                tasks=self.tasks,
                train=self.train,
                held=self.held,
                learner=self._learner,
                backend=backend,
                sampler=sampler,
                tokenizer=tokenizer,
                envs=envs,
                metrics=MetricsLog(self.out / "metrics.jsonl"),
                store=TrajectoryStore(self.out / "trajectories.jsonl"),
                progress=progress_bars(self.show_progress),
                run_id=self.run_id,
            )
            summary = await train_loop(run, resume=resume)
            return summary.model_dump()
        raise AssertionError("unreachable")  # the exit stack does not swallow exceptions

    async def _envs(self, stack: contextlib.AsyncExitStack) -> list[EpisodeEnv]:
        """Each task's EpisodeEnv: here (the configured provider), or on the cluster's
        sandbox nodes."""
        cfg = self.config
        if cfg.cluster is None:
            from agentrl.sandbox import provider as make_provider

            provider = make_provider(cfg.provider)
            stack.callback(provider.end_run, self.run_id)
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
        """The configured sampler, routing to sampler actors too when the cluster has them."""
        cfg = self.config
        replicas = cfg.cluster.samplers if cfg.cluster is not None else None
        urls: list[str] = []
        if replicas is not None:
            from agentrl.cluster.samplers import SamplerFleet

            fleet = SamplerFleet(replicas, cfg.local_sampler())
            stack.push_async_callback(fleet.close)
            urls = await fleet.start()
        return train_sampler(cfg, self.out, backend, urls)
