"""The ReAct episode: INIT a sandbox, loop generate -> parse -> tool -> observe, EVAL.

The conversation only grows by appending (ChatSession); the episode ends through an
`EpisodeEnd` exception that carries its stop reason, caught in one place; the
trajectory is built and validated in `finally`-safe code, so every episode — also
one whose sandbox died or whose grader crashed — yields exactly one Trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from agentrl.chat import ChatSession
from agentrl.errors import AgentRLError, GraderError, SamplerError, SandboxError
from agentrl.inference.base import Completion, Sampler, SamplingParams
from agentrl.tasks.env import build_tools
from agentrl.tasks.graders import DidNotRun, Evidence
from agentrl.tasks.spec import Instance, SnapshotPolicy, Task
from agentrl.toolcall import (
    BASH_BLOCK_HINT,
    FORMAT_HINT,
    ToolCallError,
    parse_bash_block,
    parse_tool_call,
)
from agentrl.tools.base import Observation, Tool, schema
from agentrl.trajectory import INFRA_STOP_REASONS, EnvInfo, StopReason, Trajectory, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.sandbox.base import Sandbox
    from agentrl.tasks.env import EpisodeEnv


log = logging.getLogger(__name__)


class EpisodeEnd(Exception):
    """Ends the RUN stage; `stop_reason` says why."""

    def __init__(self, stop_reason: StopReason, detail: str = "") -> None:
        super().__init__(detail or stop_reason.value)
        self.stop_reason = stop_reason


@dataclass
class _Ledger:
    """Per-token bookkeeping beside the ChatSession's ids and mask."""

    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def sync(self, chat: ChatSession, sampled: Completion | None = None) -> None:
        """Pad to the chat's length: observation tokens get 0.0 / -1, sampled get theirs."""
        if sampled is not None:
            self.logprobs += sampled.logprobs
            self.versions += sampled.token_versions
        gap = len(chat.response_ids) - len(self.logprobs)
        self.logprobs += [0.0] * gap
        self.versions += [-1] * gap


def open_chat(
    task: Task, instance: Instance, tools: dict[str, Tool], tokenizer: PreTrainedTokenizerBase
) -> ChatSession:
    messages = [
        {"role": "system", "content": instance.render(task.spec.prompt.system)},
        {"role": "user", "content": instance.render(task.spec.prompt.instance)},
    ]
    if task.spec.prompt.action_format == "bash_block":  # the system prompt explains the format
        return ChatSession(tokenizer, messages)
    return ChatSession(tokenizer, messages, tools=[schema(t) for t in tools.values()])


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
    """Replay an episode's conversation from its turn records (sampled ids verbatim,
    observations as recorded) through the chat template: what the model saw, as messages.
    With `upto=K`, only turns before K: the chat as it stood when turn K was sampled."""
    instance = next(i for i in task.instances if i.id == traj.group_id)
    chat = open_chat(task, instance, build_tools(task), tokenizer)
    for turn in traj.turns[:upto]:
        sampled = traj.response_ids[turn.span[0] : turn.span[1]]
        if turn.finish_reason is not None:
            ended = turn.finish_reason == "stop"
        else:  # recorded before turns kept their finish reason
            ended = bool(sampled) and sampled[-1] == tokenizer.eos_token_id
        chat.add_sampled(sampled, "stop" if ended else "length")
        if len(chat.response_ids) == len(traj.response_ids):
            break  # nothing followed this turn (finish, or a timeout during its tool call)
        if not ended:  # a turn cut off by a length limit ends the episode
            chat.close_turn()
            break
        chat.add_messages([{"role": "tool", "content": turn.observation}])
    return chat


Gate = Callable[[], AbstractAsyncContextManager[object]]
"""What a trajectory holds while the sampler works for it (a dispatcher's generation slot)."""


def no_gate() -> AbstractAsyncContextManager[object]:
    return contextlib.nullcontext()


class Episode:
    """One episode split into its stages, so a dispatcher can schedule them apart.

    `init` -> `run` -> `evaluate` -> `close`; `result()` is the validated Trajectory. A
    stage never raises for a failure of the episode: it records the stop reason and
    error, and later stages then do nothing, so every episode yields exactly one
    trajectory. Only cancellation propagates.
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
    ) -> None:
        self.task, self.instance, self.sampler, self.env = task, instance, sampler, env
        self.snapshots = snapshots or task.spec.snapshots
        self.trajectory_id = f"{instance.id}_{sample}"
        self.scheduled_step = scheduled_step
        self.tools = env.tools()
        self.chat = open_chat(task, instance, self.tools, tokenizer)
        self.ledger = _Ledger()
        self.sandbox: Sandbox | None = None
        self.reward: float | None = None
        self.components: dict[str, Any] = {}
        self.evidence: Evidence | None = None
        self.stop: StopReason | None = None
        self.error: str | None = None
        self.fix: str | None = None
        self.env_info = EnvInfo(provider=env.provider_name, task_hash=task.hash)
        self.seconds = {"init": 0.0, "run": 0.0, "eval": 0.0}
        self._closing: asyncio.Future[None] | None = None
        # The commit in flight and the turn it belongs to (None: the INIT snapshot).
        self._pending: tuple[Turn | None, asyncio.Future[str]] | None = None
        self._committed: list[str] = []  # snapshots this episode made (a branch inherits others)

    @property
    def failed(self) -> bool:
        """Whether an infrastructure failure already ended this episode."""
        return self.stop in INFRA_STOP_REASONS

    def fail(self, stop: StopReason, error: str, fix: str | None = None) -> None:
        self.stop, self.error, self.fix = stop, error, fix or None

    async def init(self, *, timeout: float | None = None, attempts: int = 1) -> None:
        """Start and set up the sandbox; infrastructure errors retried `attempts` times."""
        if (overflow := prompt_overflow(self.task, self.chat)) is not None:
            self.fail(StopReason.aborted, f"{self.instance.id}: {overflow}", PROMPT_FIX)
            return  # a task that cannot fit: no sandbox, never the agent's failure
        start = time.monotonic()
        try:
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
                        self.sandbox = await self.env.init(self.instance, name=self.trajectory_id)
            if self.sandbox is not None:  # the image that ran (SWE-bench: the instance's own)
                self.env_info.image = self.sandbox.spec.image
                self.env_info.node = self.sandbox.spec.node
            if self.snapshots.every:
                self.start_snapshot(None, "init")
        except TimeoutError:
            self.fail(StopReason.sandbox_error, f"INIT timed out after {timeout} s")
        except AgentRLError as e:  # sandbox died, setup failed, image missing
            self.fail(StopReason.sandbox_error, str(e), e.fix)
        finally:
            self.seconds["init"] = time.monotonic() - start

    async def run(self, gate: Gate = no_gate, *, timeout: float | None = None) -> None:
        """The ReAct turns; `gate` is held around each generation request."""
        if self.failed or self.sandbox is None:
            return
        limit = self.task.spec.limits.episode_timeout
        start = time.monotonic()
        try:
            async with asyncio.timeout(limit if timeout is None else min(limit, timeout)):
                await _react(self, gate)
            self.stop = StopReason.max_turns
        except EpisodeEnd as end:
            self.stop = end.stop_reason
        except TimeoutError:
            if not self.ledger.turns:  # the agent never acted: the sampler never served it
                self.fail(
                    StopReason.aborted,
                    f"RUN timed out after {time.monotonic() - start:.0f} s before the first "
                    "completion (is the sampler overloaded? lower the generation concurrency "
                    "or raise limits.episode_timeout)",
                )
            else:
                self.stop = StopReason.episode_timeout
        except SamplerError as e:  # the sampler failed: infrastructure, not the agent
            self.fail(StopReason.aborted, str(e), e.fix)
        except AgentRLError as e:
            self.fail(StopReason.sandbox_error, str(e), e.fix)
        finally:
            self.seconds["run"] = time.monotonic() - start

    async def evaluate(self, *, timeout: float | None = None) -> None:
        """Grade the sandbox; a crashing or slow grader is an eval_error."""
        await self.settle_snapshot()  # the state RUN left, before the grader's files go in
        if self.failed or self.sandbox is None:
            return
        start = time.monotonic()
        # RUN is over: the tools go first, so no shell or watch of theirs acts during EVAL.
        await close_tools(self.tools)
        try:
            async with asyncio.timeout(timeout):
                grade = await self.env.evaluate(self.sandbox, self.instance)
            self.reward, self.components = grade.reward, grade.components
            self.evidence = grade.evidence
        except TimeoutError:
            self.fail(StopReason.eval_error, f"EVAL timed out after {timeout} s")
        except GraderError as e:  # the grader could not grade: never a reward
            self.evidence = e.evidence if isinstance(e, DidNotRun) else None
            self.fail(StopReason.eval_error, str(e), e.fix)
        except AgentRLError as e:
            self.fail(StopReason.sandbox_error, str(e), e.fix)
        finally:
            self.seconds["eval"] = time.monotonic() - start

    async def close(self) -> None:
        """Close tools and sandbox, shielded from cancellation. Idempotent: a second call
        waits for the first one's close, so whoever waits last sees the sandbox gone."""
        if self._closing is None:
            sandbox, self.sandbox = self.sandbox, None
            self._closing = asyncio.ensure_future(self._teardown(sandbox))
        await asyncio.shield(self._closing)

    async def _teardown(self, sandbox: Sandbox | None) -> None:
        with contextlib.suppress(Exception):
            await self.settle_snapshot()
        await close_all(self.tools, sandbox)
        if self._drops_snapshots():  # a success not sampled for keeping
            for snapshot_id in self._committed:
                with contextlib.suppress(Exception):  # gc --snapshots reclaims what is left
                    await self.env.remove_snapshot(snapshot_id)

    # -- snapshots ------------------------------------------------------------------

    def start_snapshot(self, turn: Turn | None, label: str) -> None:
        """Commit the sandbox in the background: the next generation runs meanwhile, and
        the next action waits for the commit (`settle_snapshot`)."""
        assert self.sandbox is not None and self._pending is None
        self._pending = (turn, asyncio.ensure_future(self.sandbox.snapshot(label)))

    async def settle_snapshot(self) -> None:
        """Wait for the commit in flight, if any, and record its id."""
        if self._pending is None:
            return
        turn, commit = self._pending
        try:
            snapshot_id = await asyncio.shield(commit)
        except AgentRLError as e:  # a failed commit loses a replay point, not the episode
            log.warning("%s: snapshot failed: %s", self.trajectory_id, e)
            self._pending = None
            return
        self._pending = None
        self._committed.append(snapshot_id)
        if turn is None:
            self.env_info.init_snapshot = snapshot_id
        else:
            turn.snapshot_id = snapshot_id

    def _drops_snapshots(self) -> bool:
        """Whether retention removes this episode's snapshots: a full-reward success not
        in the `keep_successful` sample (decided by a hash of its ids, so reproducibly)."""
        if self.failed or self.reward is None or self.reward < 1.0:
            return False
        key = f"{self.env.run_id}/{self.trajectory_id}".encode()
        draw = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
        return draw >= self.snapshots.keep_successful

    def result(self) -> Trajectory:
        """The validated trajectory of whatever the stages did."""
        chat, ledger = self.chat, self.ledger
        ledger.sync(chat)
        stop = self.stop or StopReason.aborted
        infra = stop in INFRA_STOP_REASONS
        turns, env_info = ledger.turns, self.env_info
        if self._drops_snapshots():  # close() removes those it made: record none of them
            gone = set(self._committed)
            turns = [
                t.model_copy(update={"snapshot_id": None}) if t.snapshot_id in gone else t
                for t in turns
            ]
            if env_info.init_snapshot in gone:
                env_info = env_info.model_copy(update={"init_snapshot": None})
        return (
            Trajectory(
                trajectory_id=self.trajectory_id,
                group_id=self.instance.id,
                task=self.task.spec.name,
                prompt_ids=chat.prompt_ids,
                response_ids=chat.response_ids,
                # An infrastructure failure is never trained on as if the agent failed.
                loss_mask=[0] * len(chat.loss_mask) if infra else chat.loss_mask,
                logprobs=[0.0] * len(ledger.logprobs) if infra else ledger.logprobs,
                token_versions=[-1] * len(ledger.versions) if infra else ledger.versions,
                reward=self.reward,
                reward_components=self.components,
                stop_reason=stop,
                turns=turns,
                scheduled_step=self.scheduled_step,
                env=env_info,
                error=self.error,
                fix=self.fix,
            )
            .check()
            .with_grade(self.evidence)
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


async def _react(episode: Episode, gate: Gate) -> None:
    task, chat, ledger, sampler = episode.task, episode.chat, episode.ledger, episode.sampler
    sandbox = episode.sandbox
    assert sandbox is not None  # run() checks
    limits, sampling = task.spec.limits, task.spec.sampling
    for _ in range(limits.max_turns - len(ledger.turns)):  # a branch starts with turns done
        room = limits.context_length - len(chat)
        if room <= 0:
            raise EpisodeEnd(StopReason.context_limit)
        params = SamplingParams(
            max_tokens=min(limits.max_new_tokens, room),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=tuple(sampling.stop),
        )
        async with gate():
            start = time.monotonic()
            completion = await sampler.generate(chat.ids, params, session_id=episode.trajectory_id)
            gen_seconds = time.monotonic() - start
        begin = len(chat.response_ids)
        text = chat.add_sampled(completion.token_ids, completion.finish_reason)
        ledger.sync(chat, completion)
        turn = Turn(
            action=text,
            span=(begin, len(chat.response_ids)),
            finish_reason=completion.finish_reason,
            gen_seconds=gen_seconds,
            replica=completion.replica,
        )
        ledger.turns.append(turn)
        if completion.finish_reason == "abort":  # cut off by the server: not the agent's doing
            raise SamplerError(
                f"the sampler aborted this reply after {len(completion.token_ids)} tokens",
                fix="a server paused with mode=abort outside the router, or was shut down",
            )
        if completion.finish_reason == "length":
            chat.close_turn()
            raise EpisodeEnd(
                StopReason.context_limit if params.max_tokens == room else StopReason.sampler_length
            )
        await episode.settle_snapshot()  # the last commit must end before the sandbox changes
        obs = await act(text, task.spec.prompt.action_format, episode.tools, sandbox, turn)
        turn.observation = obs.text
        every = episode.snapshots.every
        if every and len(ledger.turns) % every == 0:
            episode.start_snapshot(turn, f"turn-{len(ledger.turns) - 1:03d}")
        if obs.done:
            raise EpisodeEnd(StopReason.finished)
        chat.add_messages([{"role": "tool", "content": obs.text}])
        ledger.sync(chat)


async def act(
    text: str, action_format: str, tools: dict[str, Tool], sandbox: Sandbox, turn: Turn
) -> Observation:
    """Parse the reply `text` and make its call; the observation the agent sees (and the
    call, exit code and tool time on `turn`). Replay re-executes recorded turns with it."""
    blocks = action_format == "bash_block"
    try:
        call = parse_bash_block(text) if blocks else parse_tool_call(text)
    except ToolCallError as e:
        return Observation(text=f"error: {e}", error=True)
    if call is None:
        what, hint = ("```bash block", BASH_BLOCK_HINT) if blocks else ("tool call", FORMAT_HINT)
        return Observation(text=f"error: no {what} found in your reply. {hint}", error=True)
    turn.tool_call = call
    tool = tools.get(call.name)
    if tool is None:
        names = ", ".join(sorted(tools))
        return Observation(
            text=f"error: unknown tool {call.name!r}; available: {names}", error=True
        )
    start = time.monotonic()
    try:
        obs = await tool(sandbox, **call.arguments)
    except TypeError as e:  # arguments that do not fit the tool's call
        obs = Observation(text=f"error: bad arguments for {call.name}: {e}", error=True)
    turn.tool_seconds = time.monotonic() - start
    turn.exit_code = obs.exit_code
    return obs


async def close_tools(tools: dict[str, Tool]) -> None:
    """Close every tool (idempotent): its shells, browsers and watches end."""
    for tool in tools.values():
        with contextlib.suppress(Exception):  # one tool failing to close must not leak the rest
            await tool.close()


async def close_all(tools: dict[str, Tool], sandbox: Sandbox | None) -> None:
    await close_tools(tools)
    if sandbox is not None:
        await sandbox.close()
