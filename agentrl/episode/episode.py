# Over 400 lines: the stages share one state and one boundary; apart, each reaches in.
"""The episode: INIT a sandbox, RUN a player, EVAL; one Trajectory, whatever happens.

Each stage runs in the episode's `boundary`, the one place an exception becomes a stop
reason: a player ends RUN by raising (`EpisodeEnd` with the agent's reason, or the error
that failed it); a sandbox, sampler or grader failure, a timeout or a bug is an
infrastructure stop reason, never a reward. The player (`agentrl.play.Player`: the ReAct
loop, or an external harness) sees a `Play`, never the Episode. The ledger the
trajectory records is the player's (`Play.ledger`). Replay points: `agentrl.snapshots`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Literal

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from agentrl.chat import ChatSegment
from agentrl.episode.conversation import (
    PROMPT_FIX,
    conversation,
    open_chat,
    prompt_overflow,
    rebuilds,
)
from agentrl.episode.harness import HarnessPlayer
from agentrl.episode.react import ReactPlayer
from agentrl.errors import (
    AgentRLError,
    ConfigError,
    EpisodeAborted,
    GraderError,
    SamplerError,
    SandboxBroken,
    SandboxError,
)
from agentrl.inference.base import Sampler
from agentrl.play import EpisodeEnd, Gate, Ledger, Play, Player, no_gate
from agentrl.snapshots import Retention, Snapshots, unrecorded
from agentrl.tasks.evidence import DidNotRun, Evidence
from agentrl.tasks.spec import Instance, SnapshotPolicy, Task
from agentrl.toolcall import close_all, close_tools
from agentrl.trajectory import (
    INFRA_STOP_REASONS,
    AgentInfo,
    BranchOf,
    EnvInfo,
    Segment,
    StopReason,
    Trajectory,
    Turn,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.episode.journal import EpisodeJournal, InFlight
    from agentrl.sandbox.base import Sandbox
    from agentrl.tasks.env import EpisodeEnv


log = logging.getLogger(__name__)


def player_for(task: Task) -> Player:
    """Who plays RUN: the task's external harness (`agent:`), else agentrl's ReAct loop."""
    return ReactPlayer() if task.spec.agent is None else HarnessPlayer()


Stage = Literal["init", "run", "eval", "record"]
_CRASHED = dict(
    init=StopReason.sandbox_error,
    run=StopReason.aborted,
    eval=StopReason.eval_error,
    record=StopReason.aborted,
)


class Episode:
    """One episode split into its stages, so a dispatcher can schedule them apart.

    `init` -> `run` -> `evaluate` -> `close`; `result()` is the validated Trajectory. A
    stage never raises for a failure of the episode: its `boundary` records the stop
    reason and error, and later stages then do nothing, so every episode yields exactly
    one trajectory. Only cancellation propagates.

    `player` plays RUN (`player_for(task)` unless given: the ReAct loop, or the task's
    external harness). `branching=k` (the branch estimator) also commits the state
    before every k-th turn and holds every snapshot at close: whoever branches from them
    reclaims them
    (`agentrl.train.branches`). `Episode.continued` makes an episode that goes on from a
    recorded one's turn, its INIT a restore of the snapshot before that turn.
    """

    def __init__(
        self,
        task: Task,
        instance: Instance,
        sample: int,
        sampler: Sampler,
        tokenizer: PreTrainedTokenizerBase,
        env: EpisodeEnv,
        *,
        scheduled_step: int = 0,
        snapshots: SnapshotPolicy | None = None,
        branching: int = 0,
        player: Player | None = None,
    ) -> None:
        self.task, self.instance, self.sampler, self.env = task, instance, sampler, env
        self.tokenizer = tokenizer
        self.player = player or player_for(task)
        self.snapshots = Snapshots(snapshots or task.spec.snapshots, branching)
        self.sample = sample
        self.trajectory_id = f"{instance.id}_{sample}"
        self.scheduled_step = scheduled_step
        self.branch_of: BranchOf | None = None  # a continuation: whose, from which turn
        self.restore_from: str | None = None  # INIT restores this snapshot (None: starts)
        self.journal: EpisodeJournal | None = None  # the run's journal, for a resume
        self.retention: Retention | None = None  # the run's bound on what finished ones keep
        self.resumed_at: list[int] = []  # where a killed run's episode went on
        self._resumed_lengths: list[int] | None = None  # its ledger's lengths there
        self.recorded: Trajectory | None = None  # it had finished before a kill: as it was
        self.after_kill = False  # a killed process began it: its commits may be here
        self._removals: set[asyncio.Future[None]] = set()  # superseded snapshots going
        # A harness brings its own tools and conversation: `chat` is then only the task's
        # text (the player's ledger keeps what the harness sent and was sampled).
        self.tools = env.tools() if self.player.task_tools else {}
        self.chat = open_chat(task, instance, self.tools, tokenizer)
        self.ledger: Ledger = self.chat
        self.agent_info: AgentInfo | None = None
        self.turns: list[Turn] = []
        self.turn_rewards: dict[int, float] = {}  # the environment's, by turn (OpenEnv)
        self.sandbox: Sandbox | None = None
        self.reward: float | None = None
        self.components: dict[str, Any] = {}
        self.evidence: Evidence | None = None
        self.broken: str | None = None  # how the agent stopped its own sandbox
        self.stop: StopReason | None = None
        self.error: str | None = None
        self.fix: str | None = None
        self.env_info = EnvInfo(provider=env.provider_name, task_hash=task.hash)
        self.seconds = {"init": 0.0, "run": 0.0, "eval": 0.0}
        self._clock: asyncio.Timeout | None = None  # episode_timeout, during RUN
        self._in_sampler = False
        self._closing: asyncio.Future[None] | None = None

    @classmethod
    def continued(
        cls,
        task: Task,
        instance: Instance,
        parent: Trajectory,
        turn: int,
        sampler: Sampler,
        tokenizer: PreTrainedTokenizerBase,
        env: EpisodeEnv,
        *,
        trajectory_id: str,
        purpose: Literal["value", "replay"],
        snapshot: str | None,
    ) -> Episode:
        """An episode that goes on from `parent` before its turn `turn`: the chat, token
        ledger and turn records before it are the parent's (tokens verbatim), and, when
        `snapshot` is given, its INIT restores that snapshot (the state before `turn`);
        otherwise the caller hands it a sandbox. It commits no snapshots of its own."""
        ep = cls(task, instance, 0, sampler, tokenizer, env, snapshots=SnapshotPolicy(every=0))
        ep.trajectory_id = trajectory_id
        ep.scheduled_step = parent.scheduled_step
        ep.env_info = parent.env.model_copy(update={"init_attempts": 1})
        ep.chat = ep.ledger = conversation(task, parent, tokenizer, upto=turn)
        if not rebuilds(parent, ep.chat):
            raise ConfigError(
                f"{parent.trajectory_id}: its turn records no longer rebuild its tokens (was "
                "the task's prompt or chat template changed since the run?)",
                fix="branch from a run made with the task as it is now",
            )
        ep.turns = [u.model_copy() for u in parent.turns[:turn]]
        ep.branch_of = BranchOf(
            trajectory_id=parent.trajectory_id, turn=turn, snapshot=snapshot, purpose=purpose
        )
        ep.restore_from = snapshot
        return ep

    @classmethod
    def resumed(
        cls,
        task: Task,
        instance: Instance,
        found: InFlight,
        sampler: Sampler,
        tokenizer: PreTrainedTokenizerBase,
        env: EpisodeEnv,
        *,
        snapshots: SnapshotPolicy,
        journal: EpisodeJournal,
    ) -> Episode:
        """The episode a killed run left in flight, going on from the newest state its
        journal holds (`agentrl.episode.journal`): INIT restores that state's snapshot,
        the chat is rebuilt from the recorded turns and must be the recorded ledger token
        for token (ConfigError otherwise: start it again), the turns after it are sampled
        again; one whose RUN had ended there is only graded. It is the same episode: same
        id and sample, its snapshots (retention removes them as its own), its journal."""
        partial, n = found.partial, found.turns
        ep = cls(
            task,
            instance,
            found.sample,
            sampler,
            tokenizer,
            env,
            scheduled_step=partial.scheduled_step,
            snapshots=snapshots,
        )
        ep.chat = ep.ledger = conversation(task, partial, tokenizer, upto=n)
        recorded = [(s.prompt_ids, s.response_ids) for s in partial.ledgers()]
        if recorded != [(s.prompt_ids, s.response_ids) for s in ep.chat.all_segments]:
            raise ConfigError(
                f"{partial.trajectory_id}: its journaled turns no longer rebuild its tokens "
                "(was the task's prompt or chat template changed since the run?)",
                fix="it starts again from INIT",
            )
        ep.env_info = partial.env.model_copy(update={"init_attempts": 1})
        ep.turns = [u.model_copy() for u in partial.turns]
        ep.resumed_at = [*partial.resumed_at, n]
        ep.restore_from = found.snapshot
        ep.snapshots.made = list(found.made)
        ep.snapshots.pinned = found.snapshot  # the sandbox runs on it: never removed under it
        ep.journal = journal
        ep._resumed_lengths = [len(s.response_ids) for s in partial.ledgers()]
        ep.stop = found.ended  # RUN had ended: EVAL is what is left
        return ep

    @classmethod
    def finished_before(
        cls,
        task: Task,
        instance: Instance,
        traj: Trajectory,
        sampler: Sampler,
        tokenizer: PreTrainedTokenizerBase,
        env: EpisodeEnv,
    ) -> Episode:
        """An episode that had finished before its run was killed (a training step's, in
        the journal): no stage runs, and its result is `traj` as it was."""
        ep = cls(task, instance, 0, sampler, tokenizer, env, scheduled_step=traj.scheduled_step)
        ep.trajectory_id, ep.recorded, ep.stop = traj.trajectory_id, traj, traj.stop_reason
        return ep

    @property
    def first_turn(self) -> int:
        """Turns before this one are inherited (a continuation's prefix)."""
        return self.branch_of.turn if self.branch_of is not None else 0

    @property
    def failed(self) -> bool:
        """Whether an infrastructure failure already ended this episode."""
        return self.stop in INFRA_STOP_REASONS

    def _fail(self, stop: StopReason, error: str, fix: str | None = None) -> None:
        self.stop, self.error, self.fix = stop, error, fix or None

    @contextlib.contextmanager
    def boundary(self, stage: Stage, timeout: float | None = None) -> Iterator[None]:
        """Where an exception becomes the stop reason (infrastructure, a bug too, is never
        the agent's failure, never a reward) and the stage's time is kept."""
        start = time.monotonic()
        try:
            yield
        except EpisodeEnd as end:
            self.stop = end.stop_reason
        except TimeoutError:
            self._timed_out(stage, timeout, time.monotonic() - start)
        except (SamplerError, EpisodeAborted) as e:  # infrastructure, not the agent's doing
            self._fail(StopReason.aborted, str(e), e.fix)
        except GraderError as e:  # the grader could not grade: never a reward
            self.evidence = e.evidence if isinstance(e, DidNotRun) else None
            self._fail(StopReason.eval_error, str(e), e.fix)
        except SandboxBroken as e:  # the agent's own doing: EVAL grades what it left
            self.stop, self.broken = StopReason.sandbox_broken, str(e)
        except AgentRLError as e:  # sandbox died, setup failed, image missing
            self._fail(StopReason.sandbox_error, str(e), e.fix)
        except Exception as e:  # a bug (a tool's TypeError too): this episode fails, not others
            log.exception("%s: %s crashed", self.trajectory_id, stage.upper())
            self._fail(_CRASHED[stage], f"{type(e).__name__}: {e}")
        finally:
            if stage in self.seconds:  # the three stages' wall time (not `record`)
                self.seconds[stage] = time.monotonic() - start

    def _timed_out(self, stage: Stage, timeout: float | None, elapsed: float) -> None:
        if stage == "init":
            self._fail(StopReason.sandbox_error, f"INIT timed out after {timeout} s")
        elif stage == "eval":
            self._fail(StopReason.eval_error, f"EVAL timed out after {timeout} s")
        elif self.turns and not self._in_sampler:  # the agent's own time ran out
            self.stop = StopReason.episode_timeout
        else:  # the sampler held the episode when the dispatcher's run_timeout struck
            first = "before the first completion" if not self.turns else "waiting on the sampler"
            self._fail(
                StopReason.aborted,
                f"RUN timed out after {elapsed:.0f} s {first} (is the sampler overloaded? "
                "lower the generation concurrency or raise the dispatcher's run_timeout)",
            )

    async def init(self, *, timeout: float | None = None, attempts: int = 1) -> None:
        """Start and set up the sandbox; infrastructure errors retried `attempts` times."""
        if self.recorded is not None:
            return
        with self.boundary("init", timeout):
            # A fresh episode's first prompt only: a continuation's chat is its parent's
            # before turn t, which the context policy trims before t is sampled.
            first = self.player.task_tools and self.branch_of is None
            overflow = prompt_overflow(self.task, self.chat) if first else None
            if overflow is not None:  # a task that cannot fit: no sandbox, not the agent's
                raise EpisodeAborted(f"{self.instance.id}: {overflow}", fix=PROMPT_FIX)
            retrying = AsyncRetrying(
                retry=retry_if_exception_type((SandboxError, TimeoutError)),
                stop=stop_after_attempt(attempts),
                wait=wait_exponential(multiplier=0.2, max=2.0),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    self.env_info.init_attempts = attempt.retry_state.attempt_number
                    async with asyncio.timeout(timeout):
                        self.sandbox = await self._start()
            if self.sandbox is None:
                return
            if self.restore_from is None:
                await self._opened(self.sandbox)
            if self._resumed_lengths is not None:  # a resume: its journal goes on from here
                assert self.journal is not None
                self.journal.resumed(len(self.turns), self._resumed_lengths)
                return
            # the image that ran (SWE-bench: the instance's own)
            self.env_info.image = self.sandbox.spec.image
            self.env_info.node = self.sandbox.spec.node
            if self.journal is not None:
                self.journal.opened(
                    self.instance.id, self.sample, self.scheduled_step, self.env_info
                )
            if self.snapshots.due(0) and self.restore_from is None:
                self._commit(self.env_info, "init")

    async def _start(self) -> Sandbox:
        """A fresh sandbox, or the snapshot a continuation or a resume goes on from. A
        resume whose snapshot cannot be restored (removed by `agentrl gc`, on a node that
        is gone) starts the episode again: never an infrastructure failure in its place,
        which would drop the episodes a kill found running from a training step."""
        if self.restore_from is None:
            return await self.env.init(self.instance, name=self.trajectory_id)
        try:
            return await self.env.restore(self.instance, self.restore_from, name=self.trajectory_id)
        except SandboxError as e:
            if self._resumed_lengths is None:  # a continuation: its branch point is gone
                raise
            log.warning(
                "%s: cannot go on from its snapshot (%s); it starts again", self.trajectory_id, e
            )
            self._afresh()
            return await self.env.init(self.instance, name=self.trajectory_id)

    async def _opened(self, sandbox: Sandbox) -> None:
        """Where the sandbox is an environment that opens the episode (an OpenEnv server's
        reset observation, its actions as tools), the chat starts from that: nothing was
        sampled yet."""
        opening = await self.env.opening(sandbox, self.instance)
        if opening is None:
            return
        if self.player.task_tools:
            self.tools = opening.tools
        self.chat = self.ledger = open_chat(
            self.task, self.instance, self.tools, self.tokenizer, opening=opening.text
        )
        overflow = prompt_overflow(self.task, self.chat) if self.player.task_tools else None
        if overflow is not None:
            raise EpisodeAborted(f"{self.instance.id}: {overflow}", fix=PROMPT_FIX)

    def _afresh(self) -> None:
        """Forget what a resume inherited: the episode as the factory makes it fresh."""
        self.chat = self.ledger = open_chat(self.task, self.instance, self.tools, self.tokenizer)
        self.turns, self.resumed_at, self.stop = [], [], None
        self.restore_from = self._resumed_lengths = None
        self.env_info = EnvInfo(provider=self.env.provider_name, task_hash=self.task.hash)
        self.snapshots = Snapshots(self.snapshots.policy)  # the old ones go at close
        self.after_kill = True
        if self.journal is not None:  # its next lines begin the episode again
            self.journal.turns_written, self.journal.lengths = 0, []

    def _commit(self, record: Turn | EnvInfo, label: str) -> None:
        """Snapshot the sandbox as it is after the turns done, in the background; the run's
        journal gets the state first and the snapshot's id the moment it lands."""
        assert self.sandbox is not None
        n, journal = len(self.turns), self.journal
        if journal is not None:
            journal.reached(n, self.turns, self.chat.all_segments)
        landed = None if journal is None else functools.partial(journal.landed, n)
        self.snapshots.start(self.sandbox, record, label, landed, done=n)

    async def _settle(self) -> None:
        """Wait for the commit in flight; remove, in the background, what it supersedes
        (`Snapshots._supersede`), the journal told first."""
        await self.snapshots.settle(self.trajectory_id)
        while self.snapshots.superseded:
            done, snapshot_id = self.snapshots.superseded.pop()
            if self.journal is not None:
                self.journal.dropped(done)
            task = asyncio.ensure_future(self._remove_snapshot(snapshot_id))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _remove_snapshot(self, snapshot_id: str) -> None:
        """Remove a superseded snapshot, once the journal's line that a newer one landed
        is on disk (a power loss between the two would leave a resume nothing to go on
        from)."""
        with contextlib.suppress(Exception):  # gc --snapshots reclaims what is left
            if self.journal is not None:
                await self.journal.synced()
            await self.env.remove_snapshot(snapshot_id)

    async def run(self, gate: Gate = no_gate, *, timeout: float | None = None) -> None:
        """RUN: the player's turns; `gate` is held around each generation request."""
        if self.stop is not None or self.sandbox is None:  # failed, or resumed after RUN
            return
        play = Play(
            trajectory_id=self.trajectory_id,
            task=self.task,
            instance=self.instance,
            sandbox=self.sandbox,
            tools=self.tools,
            chat=self.chat,
            turns=self.turns,
            sampler=self.sampler,
            gate=gate,
            sampler_clock=self.waiting_on_sampler,
            settle=self._settle,
            snapshot_last_turn=self.snapshot_last_turn,
            turn_rewards=self.turn_rewards,
        )
        try:
            with self.boundary("run"):
                async with asyncio.timeout(timeout):  # wall time: the dispatcher's guard
                    async with asyncio.timeout(self.task.spec.limits.episode_timeout) as clock:
                        self._clock = clock  # the agent's own time: stopped while sampling
                        await self.player.play(play)
                        raise RuntimeError(  # a player ends by raising, never by returning
                            f"{type(self.player).__name__}.play returned without ending RUN"
                        )
        finally:
            self.ledger = play.ledger or self.chat
            self.agent_info = play.agent
        if self.journal is not None and self.stop is not None:
            self.journal.ended(len(self.turns), self.stop)

    @contextlib.asynccontextmanager
    async def waiting_on_sampler(self) -> AsyncIterator[None]:
        """Stop the episode's clock while the sampler has it (waiting for a generation slot,
        generating): a shared, loaded sampler's time is never held against the agent."""
        clock, loop = self._clock, asyncio.get_running_loop()
        deadline = clock.when() if clock is not None else None
        left = None if deadline is None else deadline - loop.time()
        if clock is not None and left is not None:
            clock.reschedule(None)
        self._in_sampler = True
        try:
            yield
        finally:
            self._in_sampler = False
            if clock is not None and left is not None:
                clock.reschedule(loop.time() + left)

    def snapshot_last_turn(self) -> None:
        """Commit the sandbox as the last turn left it, when the policy says this turn is
        due (and it has none yet): a replay point before the next turn."""
        turns = self.turns
        if self.sandbox is None or not turns or turns[-1].snapshot_id is not None:
            return
        last = len(turns) >= self.task.spec.limits.max_turns
        if self.snapshots.due(len(turns), last=last):
            self._commit(turns[-1], f"turn-{len(turns) - 1:03d}")

    async def evaluate(self, *, timeout: float | None = None) -> None:
        """Grade the sandbox; a crashing or slow grader is an eval_error."""
        with self.boundary("eval", timeout):
            await self._settle()  # before the grader's files go in
            if self.failed or self.sandbox is None:
                return
            # RUN is over: the tools go first, so no shell or watch of theirs acts during EVAL.
            # Its processes stay, in the agent's own container: a service it left up answers
            # the grader over loopback; nothing of it reaches the grading copy.
            await close_tools(self.tools, keep_processes=True)
            async with asyncio.timeout(timeout):
                grade = await self.env.evaluate(self.sandbox, self.instance)
            self.reward, self.components = grade.reward, grade.components
            self.evidence = grade.evidence
            if self.broken:
                self.evidence.notes.insert(
                    0, f"RUN ended as the agent stopped its sandbox: {self.broken}"
                )

    async def close(self) -> None:
        """Close tools and sandbox, shielded from cancellation. Idempotent: a second call
        waits for the first one's close, so whoever waits last sees the sandbox gone."""
        if self._closing is None:
            sandbox, self.sandbox = self.sandbox, None
            self._closing = asyncio.ensure_future(self._teardown(sandbox))
        await asyncio.shield(self._closing)

    async def _teardown(self, sandbox: Sandbox | None) -> None:
        with contextlib.suppress(Exception):
            await self._settle()
        await asyncio.gather(*self._removals, return_exceptions=True)
        await close_all(self.tools, sandbox)
        if self.resumed_at or self.after_kill:  # a kill's commits may be here, unrecorded
            with contextlib.suppress(Exception):
                for snapshot_id in await self.env.snapshots_named(self.trajectory_id):
                    if snapshot_id not in self.snapshots.made:
                        await self.env.remove_snapshot(snapshot_id)
        removed = self._removed_at_close()
        if removed:
            await self.snapshots.remove(self.env.remove_snapshot, removed)
        if self.retention is not None and not self.snapshots.held:  # branches hand theirs on
            kept = [i for i in self.snapshots.made if i not in removed]
            await self.retention.keep(
                self.task.spec.name, self.trajectory_id, kept, self.snapshots.policy, self.env
            )

    def _removed_at_close(self) -> set[str]:
        """The snapshots retention removes as the episode closes (and its record omits):
        all of a success not sampled for keeping, else those `keep_every` thins out. An
        infrastructure failure keeps all; a branched episode's go when its branches
        reclaim them."""
        if self.snapshots.held or self.failed:
            return set()
        key = f"{self.env.run_id}/{self.trajectory_id}"
        if self.snapshots.dropped(key, self.reward):
            return set(self.snapshots.made)
        return self.snapshots.thinned(self.turns)

    def result(self) -> Trajectory:
        """The validated trajectory of whatever the stages did; one that breaks the ledger
        is a bug, reported as an aborted trajectory (data, not a crash), as is an episode
        no stage ended."""
        if self.recorded is not None:
            return self.recorded
        with self.boundary("record"):
            if self.stop is None:
                raise RuntimeError("no stage ended this episode (result before run)")
            return self._trajectory()
        return self._trajectory()

    def _trajectory(self) -> Trajectory:
        stop = self.stop
        assert stop is not None  # result() sees to it
        # An infrastructure failure is never trained on as if the agent failed.
        infra = stop in INFRA_STOP_REASONS
        # a harness that never called the model left its ledger empty: the task's text
        segments = self.ledger.all_segments or self.chat.all_segments
        if len(segments) > 1 and not segments[-1].response_ids:
            # The observation after the last turn began a segment the sampler never saw.
            segments = segments[:-1]
        ledgers = [_recorded(s, infra) for s in segments]
        turns, env_info = self.turns, self.env_info
        if removed := self._removed_at_close():  # close() removes them: record none of them
            turns, env_info = unrecorded(turns, env_info, removed)
        return (
            Trajectory.from_ledgers(
                ledgers,
                trajectory_id=self.trajectory_id,
                group_id=self.instance.id,
                task=self.task.spec.name,
                reward=self.reward,
                reward_components=self.components,
                stop_reason=stop,
                turns=turns,
                turn_rewards=[self.turn_rewards.get(k, 0.0) for k in range(len(turns))]
                if self.turn_rewards
                else [],
                scheduled_step=self.scheduled_step,
                seconds={stage: round(s, 3) for stage, s in self.seconds.items()},
                env=env_info,
                agent=self.agent_info,
                branch_of=self.branch_of,
                resumed_at=self.resumed_at,
                error=self.error,
                fix=self.fix,
            )
            .check()
            .with_grade(self.evidence)
        )


def _recorded(segment: ChatSegment, infra: bool) -> Segment:
    """A chat segment as the trajectory records it; an infrastructure failure's sampled
    tokens lose their mask, logprobs and versions."""
    n = len(segment.response_ids)
    return Segment(
        reason=segment.reason,
        prompt_ids=segment.prompt_ids,
        response_ids=segment.response_ids,
        loss_mask=[0] * n if infra else segment.loss_mask,
        logprobs=[0.0] * n if infra else segment.logprobs,
        token_versions=[-1] * n if infra else segment.versions,
    )
