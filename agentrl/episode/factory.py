"""The one way episodes are made: a task's runtime for a run (`make_env`), and the
episodes of a run (`Episodes`), fresh or going on from a recorded one's turn.

`agentrl run`, `agentrl eval`, training (its rollouts and branch continuations) and
`agentrl replay --policy` all make their episodes here, so the player, the snapshot
policy and what a sandbox mounts are decided in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from agentrl.episode import harness
from agentrl.episode.episode import Episode, player_for
from agentrl.errors import ConfigError
from agentrl.registry import resolve

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.episode.journal import EpisodeJournal, InFlight, Journal
    from agentrl.inference.base import Sampler
    from agentrl.sandbox.base import SandboxProvider
    from agentrl.snapshots import Retention
    from agentrl.tasks.env import EpisodeEnv, TaskEnv
    from agentrl.tasks.spec import Instance, SnapshotPolicy, Task
    from agentrl.trajectory import Trajectory


def make_env(task: Task, provider: SandboxProvider, run_id: str) -> TaskEnv:
    """The task's runtime (TaskEnv, or the subclass its format names) for one run; its
    sandboxes mount what the task's player needs (the gateway's socket for a harness
    inside the sandbox, made only when a sandbox starts)."""
    from agentrl.tasks.env import TaskEnv

    env_class = resolve({}, task.env, "task runtime")
    if not (isinstance(env_class, type) and issubclass(env_class, TaskEnv)):
        raise ConfigError(f"task runtime {task.env!r} is not a TaskEnv")
    env = env_class(task, provider, run_id)
    agent = task.spec.agent
    if agent is not None and agent.where == "sandbox":
        env.mounts = lambda: harness.mounts(agent)
    return env


@dataclass
class Episodes:
    """Makes one run's episodes: its sampler and tokenizer, each task's runtime (by task
    name), the snapshot policy (None: each task's own), the run's journal (None:
    none), where episodes with replay points record what a resume after a kill needs,
    and the run's `Retention`, which holds what finished episodes keep within the
    policy's `keep_gb` (None: no bound; a run shares one across its factories)."""

    sampler: Sampler
    tokenizer: PreTrainedTokenizerBase
    envs: Mapping[str, EpisodeEnv]
    snapshots: SnapshotPolicy | None = None
    journal: Journal | None = None
    retention: Retention | None = None
    _said: set[str] = field(default_factory=set, repr=False)

    def fresh(
        self,
        task: Task,
        instance: Instance,
        sample: int,
        *,
        scheduled_step: int = 0,
        branching: int = 0,
    ) -> Episode:
        """Sample `sample` of `instance` (trajectory `<instance>_<sample>`). `branching`:
        the branch estimator's snapshot cadence; an external harness's episode is never
        branched (agentrl did not act). Where the run's journal holds this episode in
        flight from a killed process, it goes on from there (`Episode.resumed`)."""
        player, env = player_for(task), self.envs[task.spec.name]
        snapshots = self.snapshots or task.spec.snapshots
        if not env.can_snapshot:  # no replay points, no branches: the provider cannot
            if snapshots.every or branching:
                self._say_once(
                    f"{env.provider_name} sandboxes cannot snapshot: the episodes of "
                    f"{task.spec.name} get no replay points and no branches"
                )
            snapshots, branching = snapshots.model_copy(update={"every": 0}), 0
        journal, found = None, self._found(task, f"{instance.id}_{sample}")
        if found is not None and found.final is not None:  # it had finished: as it was
            return Episode.finished_before(
                task, instance, found.final, self.sampler, self.tokenizer, env
            )
        if self.journal is not None and snapshots.every and player.task_tools:
            journal = self.journal.episode(task.spec.name, f"{instance.id}_{sample}")
            if found is not None and (
                resumed := self._resumed(task, instance, found, snapshots, journal)
            ):
                resumed.retention = self.retention
                return resumed
        episode = Episode(
            task,
            instance,
            sample,
            self.sampler,
            self.tokenizer,
            env,
            scheduled_step=scheduled_step,
            snapshots=snapshots,
            branching=branching if player.task_tools else 0,
            player=player,
        )
        episode.journal = journal
        episode.retention = self.retention
        # begun by a killed process, with nothing to go on from: what it committed is gone
        episode.after_kill = (task.spec.name, f"{instance.id}_{sample}") in (
            self.journal.started if self.journal is not None else set()
        )
        return episode

    def _found(self, task: Task, trajectory_id: str) -> InFlight | None:
        """What the run's journal holds of this episode (once: it is made once)."""
        if self.journal is None:
            return None
        return self.journal.take(task.spec.name, trajectory_id)

    def _resumed(
        self,
        task: Task,
        instance: Instance,
        found: InFlight,
        snapshots: SnapshotPolicy,
        journal: EpisodeJournal,
    ) -> Episode | None:
        """The episode the journal holds in flight, going on; None: it starts afresh."""
        try:
            episode = Episode.resumed(
                task,
                instance,
                found,
                self.sampler,
                self.tokenizer,
                self.envs[task.spec.name],
                snapshots=snapshots,
                journal=journal,
            )
        except ConfigError as e:
            log.warning("%s: %s; %s", journal.trajectory_id, e.message, e.fix)
            return None
        log.info(
            "%s: goes on after turn %d, from its snapshot (the run before was killed)",
            journal.trajectory_id,
            found.turns,
        )
        return episode

    def _say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("%s", message)

    def continued(
        self,
        task: Task,
        instance: Instance,
        parent: Trajectory,
        turn: int,
        *,
        trajectory_id: str,
        purpose: Literal["value", "replay"],
        snapshot: str | None,
    ) -> Episode:
        """An episode going on from `parent` before its turn `turn` (`Episode.continued`)."""
        return Episode.continued(
            task,
            instance,
            parent,
            turn,
            self.sampler,
            self.tokenizer,
            self.envs[task.spec.name],
            trajectory_id=trajectory_id,
            purpose=purpose,
            snapshot=snapshot,
        )


async def run_episode(
    task: Task,
    instance: Instance,
    sample: int,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    env: EpisodeEnv,
    *,
    scheduled_step: int = 0,
) -> Trajectory:
    """One episode of `task` on `instance`, start to end; always a validated Trajectory."""
    episodes = Episodes(sampler, tokenizer, {task.spec.name: env})
    return await played(episodes.fresh(task, instance, sample, scheduled_step=scheduled_step))


async def played(episode: Episode) -> Trajectory:
    """`episode` (fresh or continued) from INIT to close; its validated Trajectory."""
    try:
        await episode.init()
        await episode.run()
        await episode.evaluate()
    finally:
        await episode.close()
    return episode.result()
