"""The ReAct episode: INIT a sandbox, loop generate -> parse -> tool -> observe, EVAL.

The conversation's token ledger is the ChatSession's: it grows by appending, and continues
in a new segment when the template or the task's context policy (`agentrl.context`)
rewrites history. Each stage runs in the episode's
`boundary`, the one place an exception becomes a stop reason: the loop ends by raising
`EpisodeEnd` with its reason (max_turns too); a sandbox, sampler or grader failure, a
timeout or a bug is an infrastructure stop reason, never a reward: every episode yields
one Trajectory. Replay points: `agentrl.snapshots`; a reply's tool call: `toolcall.act`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from agentrl import context
from agentrl.chat import ChatSegment, ChatSession
from agentrl.errors import (
    AgentRLError,
    ConfigError,
    GraderError,
    SamplerError,
    SandboxBroken,
    SandboxError,
)
from agentrl.gateway.external import run_harness
from agentrl.inference.base import Completion, Sampler, SamplingParams
from agentrl.snapshots import Snapshots
from agentrl.tasks.env import build_tools
from agentrl.tasks.evidence import DidNotRun, Evidence
from agentrl.tasks.spec import Instance, SnapshotPolicy, Task
from agentrl.toolcall import act, close_all, close_tools
from agentrl.tools.base import Tool, schema
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

    from agentrl.gateway.recorder import Recorder
    from agentrl.sandbox.base import Sandbox
    from agentrl.tasks.env import EpisodeEnv


log = logging.getLogger(__name__)


class EpisodeEnd(Exception):
    """Ends the RUN stage; `stop_reason` says why."""

    def __init__(self, stop_reason: StopReason) -> None:
        super().__init__(stop_reason.value)
        self.stop_reason = stop_reason


def open_chat(
    task: Task, instance: Instance, tools: dict[str, Tool], tokenizer: PreTrainedTokenizerBase
) -> ChatSession:
    messages = [
        {"role": "system", "content": instance.render(task.spec.prompt.system)},
        {"role": "user", "content": instance.render(task.spec.prompt.instance)},
    ]
    kwargs = task.spec.prompt.template_kwargs
    if task.spec.prompt.action_format == "bash_block":  # the system prompt explains the format
        return ChatSession(tokenizer, messages, template_kwargs=kwargs)
    schemas = [schema(t) for t in tools.values()]
    return ChatSession(tokenizer, messages, tools=schemas, template_kwargs=kwargs)


PROMPT_FIX = (
    "shorten the task's prompt (or the instance field it quotes), or raise limits.context_length"
)


def prompt_overflow(task: Task, chat: ChatSession) -> str | None:
    """Why the episode's first prompt leaves no room to sample, or None when it fits."""
    limits = task.spec.limits
    if len(chat) < limits.context_length:
        return None
    return (
        f"the first prompt is {len(chat):,} tokens; limits.context_length is "
        f"{limits.context_length:,}: no room for a reply"
    )


def conversation(
    task: Task, traj: Trajectory, tokenizer: PreTrainedTokenizerBase, upto: int | None = None
) -> ChatSession:
    """Replay an episode's conversation from its turn records (sampled ids verbatim with
    their recorded logprobs and versions, observations as the model saw them) through the
    chat template and the task's context policy: what the model saw, segments included.
    With `upto=K`, only turns before K: the chat as it stood when turn K was sampled."""
    instance = next(i for i in task.instances if i.id == traj.group_id)
    chat = open_chat(task, instance, build_tools(task), tokenizer)
    ledgers = traj.ledgers()
    for k, turn in enumerate(traj.turns[:upto]):
        if turn.kind == "summary":
            context.ask_summary(task, chat)
        else:
            context.drop_oldest(task, chat)
        ledger, (start, end) = ledgers[turn.segment], turn.span
        sampled = ledger.response_ids[start:end]
        if turn.finish_reason is not None:
            ended = turn.finish_reason == "stop"
        else:  # recorded before turns kept their finish reason
            ended = bool(sampled) and sampled[-1] == tokenizer.eos_token_id
        chat.add_sampled(
            sampled,
            "stop" if ended else "length",
            logprobs=ledger.logprobs[start:end],
            versions=ledger.token_versions[start:end],
        )
        last = k + 1 == len(traj.turns) and turn.segment + 1 == len(ledgers)
        if last and end == len(ledger.response_ids):
            break  # nothing followed the last turn (finish, or a timeout in its tool call)
        if not ended and (turn.kind == "action" or turn.segment + 1 == len(ledgers)):
            # a reply cut off ends the episode (a summary: when no segment followed it)
            chat.close_turn()
            break
        if turn.kind == "summary":
            context.summarized(task, chat, turn.action)
        else:
            context.observed(task, chat, turn.observation, turn.tool_name)
    return chat


def rebuilds(traj: Trajectory, chat: ChatSession) -> bool:
    """Whether a rebuilt chat is the recorded episode up to where it stands: every
    segment's prompt, and its response so far."""
    recorded = traj.ledgers()
    rebuilt = chat.all_segments
    return len(rebuilt) <= len(recorded) and all(
        r.prompt_ids == c.prompt_ids and r.response_ids[: len(c.response_ids)] == c.response_ids
        for r, c in zip(recorded, rebuilt, strict=False)
    )


def seen_messages(
    task: Task, traj: Trajectory, tokenizer: PreTrainedTokenizerBase
) -> list[dict[str, Any]]:
    """What the model saw, as messages: agentrl's own episodes rebuilt through the chat
    template; an external harness's as each segment's tokens decoded (its messages were
    the harness's: the ledger is what the model saw of them)."""
    if traj.agent is None:
        return conversation(task, traj, tokenizer).messages
    return [
        {
            "role": f"segment {k} ({s.reason})",
            "content": tokenizer.decode(s.prompt_ids + s.response_ids),
        }
        for k, s in enumerate(traj.ledgers())
    ]


Gate = Callable[[], AbstractAsyncContextManager[object]]
"""What a trajectory holds while the sampler works for it (a dispatcher's generation slot)."""


def no_gate() -> AbstractAsyncContextManager[object]:
    return contextlib.nullcontext()


Stage = Literal["init", "run", "eval"]
_CRASHED = dict(init=StopReason.sandbox_error, run=StopReason.aborted, eval=StopReason.eval_error)


class Episode:
    """One episode split into its stages, so a dispatcher can schedule them apart.

    `init` -> `run` -> `evaluate` -> `close`; `result()` is the validated Trajectory. A
    stage never raises for a failure of the episode: its `boundary` records the stop
    reason and error, and later stages then do nothing, so every episode yields exactly
    one trajectory. Only cancellation propagates.

    `branching=k` (the branch estimator) also commits the state before every k-th turn
    and holds every snapshot at close: whoever branches from them reclaims them
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
    ) -> None:
        self.task, self.instance, self.sampler, self.env = task, instance, sampler, env
        self.snapshots = Snapshots(snapshots or task.spec.snapshots, branching)
        self.trajectory_id = f"{instance.id}_{sample}"
        self.scheduled_step = scheduled_step
        self.branch_of: BranchOf | None = None  # a continuation: whose, from which turn
        # An external agent brings its own tools and conversation: `chat` is then only the
        # task's text (the recorder keeps what the harness sent and was sampled).
        self.tools = env.tools() if task.spec.agent is None else {}
        self.chat = open_chat(task, instance, self.tools, tokenizer)
        self.recorder: Recorder | None = None
        self.agent_info: AgentInfo | None = None
        self.turns: list[Turn] = []
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
        ep.chat = conversation(task, parent, tokenizer, upto=turn)
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
        return ep

    @property
    def first_turn(self) -> int:
        """Turns before this one are inherited (a continuation's prefix)."""
        return self.branch_of.turn if self.branch_of is not None else 0

    @property
    def failed(self) -> bool:
        """Whether an infrastructure failure already ended this episode."""
        return self.stop in INFRA_STOP_REASONS

    def fail(self, stop: StopReason, error: str, fix: str | None = None) -> None:
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
        except SamplerError as e:  # the sampler failed: infrastructure, not the agent
            self.fail(StopReason.aborted, str(e), e.fix)
        except GraderError as e:  # the grader could not grade: never a reward
            self.evidence = e.evidence if isinstance(e, DidNotRun) else None
            self.fail(StopReason.eval_error, str(e), e.fix)
        except SandboxBroken as e:  # the agent's own doing: EVAL grades what it left
            self.stop, self.broken = StopReason.sandbox_broken, str(e)
        except AgentRLError as e:  # sandbox died, setup failed, image missing
            self.fail(StopReason.sandbox_error, str(e), e.fix)
        except Exception as e:  # a bug (a tool's TypeError too): this episode fails, not others
            log.exception("%s: %s crashed", self.trajectory_id, stage.upper())
            self.fail(_CRASHED[stage], f"{type(e).__name__}: {e}")
        finally:
            self.seconds[stage] = time.monotonic() - start

    def _timed_out(self, stage: Stage, timeout: float | None, elapsed: float) -> None:
        if stage == "init":
            self.fail(StopReason.sandbox_error, f"INIT timed out after {timeout} s")
        elif stage == "eval":
            self.fail(StopReason.eval_error, f"EVAL timed out after {timeout} s")
        elif self.turns and not self._in_sampler:  # the agent's own time ran out
            self.stop = StopReason.episode_timeout
        else:  # the sampler held the episode when the dispatcher's run_timeout struck
            first = "before the first completion" if not self.turns else "waiting on the sampler"
            self.fail(
                StopReason.aborted,
                f"RUN timed out after {elapsed:.0f} s {first} (is the sampler overloaded? "
                "lower the generation concurrency or raise the dispatcher's run_timeout)",
            )

    async def init(self, *, timeout: float | None = None, attempts: int = 1) -> None:
        """Start and set up the sandbox; infrastructure errors retried `attempts` times."""
        overflow = None if self.task.spec.agent else prompt_overflow(self.task, self.chat)
        if overflow is not None:
            self.fail(StopReason.aborted, f"{self.instance.id}: {overflow}", PROMPT_FIX)
            return  # a task that cannot fit: no sandbox, never the agent's failure
        with self.boundary("init", timeout):
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
            if self.sandbox is not None:  # the image that ran (SWE-bench: the instance's own)
                self.env_info.image = self.sandbox.spec.image
                self.env_info.node = self.sandbox.spec.node
                if self.snapshots.due(0):
                    self.snapshots.start(self.sandbox, self.env_info, "init")

    async def _start(self) -> Sandbox:
        """A fresh sandbox, or, for a continuation, the snapshot it branches from."""
        restore = self.branch_of.snapshot if self.branch_of is not None else None
        if restore is None:
            return await self.env.init(self.instance, name=self.trajectory_id)
        return await self.env.restore(self.instance, restore, name=self.trajectory_id)

    async def run(self, gate: Gate = no_gate, *, timeout: float | None = None) -> None:
        """The ReAct turns; `gate` is held around each generation request."""
        if self.failed or self.sandbox is None:
            return
        with self.boundary("run"):
            async with asyncio.timeout(timeout):  # wall time: the dispatcher's guard
                async with asyncio.timeout(self.task.spec.limits.episode_timeout) as clock:
                    self._clock = clock  # the agent's own time: stopped while sampling
                    if self.task.spec.agent is None:
                        await _react(self, gate)
                    elif (stop := await run_harness(self, gate)) is not None:
                        raise EpisodeEnd(stop)

    @contextlib.contextmanager
    def waiting_on_sampler(self) -> Iterator[None]:
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

    async def generate(
        self, gate: Gate, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[Completion, float]:
        """One reply from the policy under `gate`, the episode's clock stopped meanwhile;
        (the completion, its seconds in the sampler once the slot was held)."""
        with self.waiting_on_sampler():
            async with gate():
                start = time.monotonic()
                completion = await self.sampler.generate(
                    prompt_ids, params, session_id=self.trajectory_id
                )
                return completion, time.monotonic() - start

    def snapshot_last_turn(self) -> None:
        """Commit the sandbox as the last turn left it, when the policy says this turn is
        due (and it has none yet): a replay point before the next turn."""
        turns = self.turns
        if self.sandbox is None or not turns or turns[-1].snapshot_id is not None:
            return
        last = len(turns) >= self.task.spec.limits.max_turns
        if self.snapshots.due(len(turns), last=last):
            self.snapshots.start(self.sandbox, turns[-1], f"turn-{len(turns) - 1:03d}")

    async def evaluate(self, *, timeout: float | None = None) -> None:
        """Grade the sandbox; a crashing or slow grader is an eval_error."""
        with self.boundary("eval", timeout):
            await self.snapshots.settle(self.trajectory_id)  # before the grader's files go in
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
            await self.snapshots.settle(self.trajectory_id)
        await close_all(self.tools, sandbox)
        if self._drops_snapshots():  # a success not sampled for keeping
            await self.snapshots.remove(self.env.remove_snapshot)

    def _drops_snapshots(self) -> bool:
        if self.snapshots.held:  # the branches that need them reclaim them
            return False
        key = f"{self.env.run_id}/{self.trajectory_id}"
        return not self.failed and self.snapshots.dropped(key, self.reward)

    def result(self) -> Trajectory:
        """The validated trajectory of whatever the stages did; one that breaks the ledger
        is a bug, reported as an aborted trajectory (data, not a crash)."""
        try:
            return self._trajectory()
        except Exception as e:
            log.exception("%s: its trajectory breaks the ledger", self.trajectory_id)
            self.fail(StopReason.aborted, f"{type(e).__name__}: {e}")
            return self._trajectory()

    def _trajectory(self) -> Trajectory:
        stop = self.stop or StopReason.aborted
        # An infrastructure failure is never trained on as if the agent failed.
        infra = stop in INFRA_STOP_REASONS
        recorded = self.recorder.segments if self.recorder is not None else []
        segments = recorded or self.chat.all_segments
        if len(segments) > 1 and not segments[-1].response_ids:
            # The observation after the last turn began a segment the sampler never saw.
            segments = segments[:-1]
        first, *rest = [_recorded(s, infra) for s in segments]
        turns, env_info = self.turns, self.env_info
        if self._drops_snapshots():  # close() removes those it made: record none of them
            turns, env_info = self.snapshots.unrecorded(turns, env_info)
        return (
            Trajectory(
                trajectory_id=self.trajectory_id,
                group_id=self.instance.id,
                task=self.task.spec.name,
                prompt_ids=first.prompt_ids,
                response_ids=first.response_ids,
                loss_mask=first.loss_mask,
                logprobs=first.logprobs,
                token_versions=first.token_versions,
                segments=rest,
                reward=self.reward,
                reward_components=self.components,
                stop_reason=stop,
                turns=turns,
                scheduled_step=self.scheduled_step,
                seconds={stage: round(s, 3) for stage, s in self.seconds.items()},
                env=env_info,
                agent=self.agent_info,
                branch_of=self.branch_of,
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
    """One episode of `task` on `instance`; always returns a validated Trajectory."""
    episode = Episode(
        task, instance, sample, sampler, tokenizer, env, scheduled_step=scheduled_step
    )
    try:
        await episode.init()
        await episode.run()
        await episode.evaluate()
    finally:
        await episode.close()
    return episode.result()


async def _react(episode: Episode, gate: Gate) -> NoReturn:
    """Generate, parse, act, observe: until a turn ends the episode or turns run out.
    Before each action the task's context policy may drop old turns or ask the policy
    for a summary (a turn of kind `summary`, not counted against max_turns)."""
    task, chat, turns, sandbox = episode.task, episode.chat, episode.turns, episode.sandbox
    assert sandbox is not None  # run() checks
    limits = task.spec.limits
    since_summary = 0  # a branch starts with turns done: the first decision counts them
    for turn in turns:
        since_summary = 0 if turn.kind == "summary" else since_summary + 1
    while sum(t.kind == "action" for t in turns) < limits.max_turns:
        if context.wants_summary(task, chat, since_summary):
            context.ask_summary(task, chat)
            turn = await _sample(episode, gate, task.spec.context.summary_tokens, "summary")
            context.summarized(task, chat, turn.action)
            since_summary = 0
            continue
        context.drop_oldest(task, chat)
        turn = await _sample(episode, gate, limits.max_new_tokens, "action")
        await episode.snapshots.settle(episode.trajectory_id)  # before the sandbox changes
        obs = await act(turn.action, task.spec.prompt.action_format, episode.tools, sandbox, turn)
        episode.snapshot_last_turn()
        if obs.done:
            turn.observation = obs.text
            raise EpisodeEnd(StopReason.finished)
        turn.observation = context.observe(task, chat, obs.text, turn.tool_name)
        since_summary += 1
    raise EpisodeEnd(StopReason.max_turns)


async def _sample(
    episode: Episode, gate: Gate, max_tokens: int, kind: Literal["action", "summary"]
) -> Turn:
    """One reply of the policy, appended to the chat and recorded as a turn; a reply the
    sampler cut off ends the episode."""
    task, chat = episode.task, episode.chat
    room = task.spec.limits.context_length - len(chat)
    if room <= 0:
        raise EpisodeEnd(StopReason.context_limit)
    sampling = task.spec.sampling
    params = SamplingParams(
        max_tokens=min(max_tokens, room),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop=tuple(sampling.stop) if kind == "action" else (),
    )
    completion, gen_seconds = await episode.generate(gate, chat.ids, params)
    begin = len(chat.response_ids)
    text = chat.add_sampled(
        completion.token_ids,
        completion.finish_reason,
        logprobs=completion.logprobs,
        versions=completion.token_versions,
    )
    turn = Turn(
        action=text,
        span=(begin, len(chat.response_ids)),
        segment=len(chat.segments),
        kind=kind,
        finish_reason=completion.finish_reason,
        gen_seconds=gen_seconds,
        replica=completion.replica,
    )
    episode.turns.append(turn)
    if completion.finish_reason == "abort":  # cut off by the server: not the agent's doing
        raise SamplerError(
            f"the sampler aborted this reply after {len(completion.token_ids)} tokens",
            fix="a server paused with mode=abort outside the router, or was shut down",
        )
    if completion.finish_reason == "length" and (kind == "action" or params.max_tokens == room):
        chat.close_turn()
        raise EpisodeEnd(
            StopReason.context_limit if params.max_tokens == room else StopReason.sampler_length
        )
    return turn
