# Over 400 lines: restore, re-execute, compare and branch share one Session.
"""Replay a recorded episode from its sandbox snapshots (`agentrl replay`, `agentrl failures`).

An episode run with `snapshots.every: k` commits its sandbox after INIT
(`env.init_snapshot`) and after every k-th turn (`turn.snapshot_id`): the state
*before* turn K is the snapshot of turn K-1, or the INIT one for K = 0. To replay from
turn K, the latest such snapshot at or before K is restored (turn J <= K; with no
snapshot at all, INIT runs again) and the recorded replies of turns J..n are acted on
again through the same tools, and the sandbox is graded again. Each observation is
compared with the recorded one: one that differs only in volatile details (a timestamp,
a duration, a PID, a container's hostname: `VOLATILE`) is reported and replay goes on;
the first that differs in anything else is the divergence (turn, tool, and a diff), and
the replies after it are not acted on. A branch instead lets a policy sample from turn K
on: a new trajectory whose prefix is the original's, token for token.

The bash tool's shell is new in a restored sandbox: state that lived only in the old
shell (a `cd`, an exported variable) is not in a snapshot, which holds files only.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import re
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from agentrl.episode import Episodes, make_env
from agentrl.errors import AgentRLError, ConfigError, SnapshotGone, first_line
from agentrl.run_info import read_run_info
from agentrl.tasks.env import build_tools
from agentrl.tasks.formats import load_any
from agentrl.tasks.spec import Instance, Task
from agentrl.toolcall import act, close_all
from agentrl.trajectory import BRANCHES, Trajectory, TrajectoryStore, Turn, run_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.inference.base import Sampler
    from agentrl.sandbox.base import Sandbox, SandboxProvider
    from agentrl.tasks.env import TaskEnv
    from agentrl.tools.base import Tool

log = logging.getLogger(__name__)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# What two runs of the same command in the same state may print differently. A pattern
# that could match real content (a checksum, a random number) does not belong here.
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
VOLATILE: dict[str, re.Pattern[str]] = {
    "timestamps": re.compile(
        r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b"
        rf"|\b(?:(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun),? +)?{_MONTH} +\d{{1,2}},? +"
        r"(?:\d{2}:\d{2}(?::\d{2})?|\d{4})\b"
        r"|\b\d{2}:\d{2}:\d{2}(?:\.\d+)?\b"
    ),
    "durations": re.compile(
        r"\b\d+m\d+(?:\.\d+)?s\b|\b\d+(?:\.\d+)? ?(?:ns|us|µs|ms|s|secs?|seconds?|mins?|minutes?)\b"
    ),
    "PIDs": re.compile(r"(?i)\bpid[ =:]*\d+|^\[\d+\] \d+$|/proc/\d+", re.MULTILINE),
    "container ids": re.compile(r"\b(?=[0-9a-f]{0,11}[a-f])(?=[0-9a-f]{0,11}\d)[0-9a-f]{12}\b"),
    "temporary names": re.compile(r"\btmp\.[A-Za-z0-9]{6,}"),
}


class Divergence(_Frozen):
    """A turn whose replayed observation is not the recorded one."""

    turn: int
    tool: str | None
    recorded: str
    replayed: str
    diff: str
    volatile: list[str] = []
    """Non-empty: the kinds of volatile detail (`VOLATILE`) that are all the two differ in."""


class ReplayReport(_Frozen):
    trajectory_id: str
    from_turn: int
    restored_at: int  # the turn whose pre-state was restored (<= from_turn)
    snapshot: str | None  # None: INIT ran again
    replayed_turns: list[int]
    divergence: Divergence | None  # the first real one; the replies after it were not acted on
    volatile: list[Divergence] = []  # differences only in volatile details, replayed through
    reward_recorded: float | None
    reward_replayed: float | None  # the sandbox graded after the last replayed turn
    grade_error: str | None = None  # why it could not be graded again
    gone: list[str] = []  # snapshots found removed on the way to `restored_at`

    @property
    def matched(self) -> bool:
        """Every replayed observation equals the recorded one, up to volatile details."""
        return self.divergence is None

    @property
    def reward_matched(self) -> bool:
        """The sandbox earned the recorded reward again (true when none was recorded)."""
        recorded, replayed = self.reward_recorded, self.reward_replayed
        return self.grade_error is None and (recorded is None or recorded == replayed)


def find_trajectory(run_dir: Path, trajectory_id: str) -> Trajectory:
    for path in run_files(run_dir):
        for traj in TrajectoryStore(path):
            if traj.trajectory_id == trajectory_id:
                return traj
    raise ConfigError(
        f"no trajectory {trajectory_id!r} in {run_dir}",
        fix=f"list the failed ones with: agentrl failures {run_dir}",
    )


def restore_point(traj: Trajectory, turn: int) -> tuple[int, str | None]:
    """(J, snapshot): the latest turn J <= `turn` whose pre-state was snapshotted."""
    for j in range(turn, -1, -1):
        snapshot = traj.env.init_snapshot if j == 0 else traj.turns[j - 1].snapshot_id
        if snapshot:
            return j, snapshot
    return 0, None


def executed(turn: Turn) -> bool:
    """Whether the episode acted on this turn's reply (a reply cut off by a length limit
    never ran, and an episode timeout can end a turn before its call)."""
    return turn.finish_reason != "length" and (turn.tool_call is not None or turn.observation != "")


class Session:
    """A restored sandbox of one recorded episode, with the task's tools around it."""

    def __init__(self, run_dir: Path, trajectory_id: str, provider: SandboxProvider | None = None):
        from agentrl.sandbox import provider as make_provider

        info = read_run_info(run_dir)
        self.traj = find_trajectory(run_dir, trajectory_id)
        self.task = _task_of(info.tasks, self.traj)
        self.instance = _instance(self.task, self.traj.group_id)
        self.provider = provider or make_provider(self.traj.env.provider or info.provider)
        self.env: TaskEnv = make_env(self.task, self.provider, f"replay-{uuid.uuid4().hex[:8]}")
        self.tools: dict[str, Tool] = build_tools(self.task)
        self.sandbox: Sandbox | None = None
        self.gone: list[str] = []
        """snapshots `restore` found removed and went past, as lines for a person"""

    async def restore(self, turn: int) -> tuple[int, str | None]:
        """Start the sandbox as it was before turn J <= `turn` (see `restore_point`)."""
        n = len(self.traj.turns)
        if not 0 <= turn < max(n, 1):
            raise ConfigError(
                f"trajectory {self.traj.trajectory_id} has turns 0..{n - 1}, not {turn}",
                fix=f"pick --from-turn from 0 to {n - 1}",
            )
        name = f"{self.traj.trajectory_id}-replay"
        while True:
            j, snapshot = restore_point(self.traj, turn)
            if snapshot is None:
                self.sandbox = await self.env.init(self.instance, name=name)
                return j, snapshot
            try:
                self.sandbox = await self.env.restore(self.instance, snapshot, name=name)
                return j, snapshot
            except SnapshotGone:  # removed since (gc): the state before it, or INIT again
                self.gone.append(f"the snapshot before turn {j} ({snapshot[:19]}) is gone")
                log.warning("%s: restoring an earlier state", self.gone[-1])
                if j == 0:
                    self.sandbox = await self.env.init(self.instance, name=name)
                    return 0, None
                turn = j - 1

    def agentrl_played(self, what: str) -> None:
        """Refuse `what` on an episode an external harness played: its actions were the
        harness's, made outside agentrl's loop, so agentrl cannot act them again."""
        agent = self.traj.agent
        if agent is not None:
            raise ConfigError(
                f"{self.traj.trajectory_id} was played by the external agent {agent.name!r}: "
                f"agentrl cannot {what} (the harness, not agentrl, acted on its replies)",
                fix="open a bash in the sandbox as it was before a snapshotted turn: "
                "agentrl replay RUN ID --from-turn K --shell",
            )

    async def execute(self, i: int) -> Divergence | None:
        """Act on turn i's recorded reply again; how the observation differs, if it does."""
        assert self.sandbox is not None
        self.agentrl_played("act on its recorded replies again")
        turn = self.traj.turns[i]
        fresh = Turn(action=turn.action, span=turn.span)
        fmt = self.task.spec.prompt.action_format
        text = (await act(turn.action, fmt, self.tools, self.sandbox, fresh)).text
        if text == turn.observation:
            return None
        return Divergence(
            turn=i,
            tool=fresh.tool_call.name if fresh.tool_call else None,
            recorded=turn.observation,
            replayed=text,
            diff=_diff(turn.observation, text),
            volatile=volatile_only(turn.observation, text),
        )

    async def regrade(self) -> tuple[float | None, str | None]:
        """(reward, None) of the sandbox as it is now, or (None, why it cannot be graded)."""
        assert self.sandbox is not None
        try:
            return (await self.env.evaluate(self.sandbox, self.instance)).reward, None
        except AgentRLError as e:
            return None, first_line(e)

    async def close(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        await close_all(self.tools, sandbox)


async def replay(
    run_dir: Path,
    trajectory_id: str,
    from_turn: int = 0,
    *,
    provider: SandboxProvider | None = None,
) -> ReplayReport:
    """Restore the sandbox before `from_turn`, act on the recorded replies again, compare,
    and grade the sandbox again (after the divergence, if there is one)."""
    session = Session(run_dir, trajectory_id, provider)
    traj = session.traj
    try:
        j, snapshot = await session.restore(from_turn)
        replayed: list[int] = []
        volatile: list[Divergence] = []
        divergence = None
        for i in range(j, len(traj.turns)):
            if not executed(traj.turns[i]):
                continue
            replayed.append(i)
            difference = await session.execute(i)
            if difference is not None and difference.volatile:
                volatile.append(difference)
            elif difference is not None:  # later replies answered a state not reached here
                divergence = difference
                break
        reward, grade_error = await session.regrade()
    finally:
        await session.close()
    return ReplayReport(
        trajectory_id=trajectory_id,
        from_turn=from_turn,
        restored_at=j,
        snapshot=snapshot,
        replayed_turns=replayed,
        divergence=divergence,
        volatile=volatile,
        reward_recorded=traj.reward,
        reward_replayed=reward,
        grade_error=grade_error,
        gone=session.gone,
    )


async def restore_to(session: Session, turn: int) -> tuple[int, str | None, Divergence | None]:
    """Restore, then act on turns J..turn-1 again so the sandbox is as it was before
    `turn`; a divergence on the way (beyond volatile details) means it may not be."""
    j, snapshot = await session.restore(turn)
    for i in range(j, turn):
        if not executed(session.traj.turns[i]):
            continue
        divergence = await session.execute(i)
        if divergence is not None and not divergence.volatile:
            return j, snapshot, divergence
    return j, snapshot, None


async def branch(
    run_dir: Path,
    trajectory_id: str,
    from_turn: int,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    *,
    provider: SandboxProvider | None = None,
) -> tuple[Trajectory, Divergence | None]:
    """Let `sampler` continue the episode from turn `from_turn`, in the sandbox as it was
    then; the new trajectory (appended to the run's branches.jsonl) keeps the original's
    tokens, mask, logprobs and versions before that turn."""
    session = Session(run_dir, trajectory_id, provider)
    traj, task = session.traj, session.task
    session.agentrl_played("branch it (a branch continues agentrl's own loop)")
    try:
        _, snapshot, divergence = await restore_to(session, from_turn)
        await close_all(session.tools, None)  # the episode brings its own tools
        factory = Episodes(sampler, tokenizer, {task.spec.name: session.env})
        episode = factory.continued(
            task,
            session.instance,
            traj,
            from_turn,
            trajectory_id=f"{traj.trajectory_id}~{from_turn}-{uuid.uuid4().hex[:4]}",
            purpose="replay",
            snapshot=snapshot,
        )
        episode.sandbox, session.sandbox = session.sandbox, None
        try:
            await episode.run()
            await episode.evaluate()
        finally:
            await episode.close()
        result = episode.result()
    finally:
        await session.close()
    TrajectoryStore(run_dir / BRANCHES).append(result)
    return result, divergence


async def open_shell(
    run_dir: Path, trajectory_id: str, from_turn: int, provider: SandboxProvider | None = None
) -> tuple[int, Divergence | None]:
    """An interactive bash in the sandbox as it was before `from_turn`; removed on exit."""
    import subprocess

    from agentrl.sandbox.docker import DockerSandbox
    from agentrl.sandbox.local import LocalSandbox

    session = Session(run_dir, trajectory_id, provider)
    try:
        if not sys.stdin.isatty():  # checked before a sandbox starts for nothing
            raise ConfigError(
                "--shell opens an interactive bash, and this command's input is not a terminal",
                fix="run it in a terminal; without one, act on the recorded replies again: "
                f"agentrl replay {run_dir} {trajectory_id} --from-turn {from_turn}",
            )
        _, _, divergence = await restore_to(session, from_turn)
        sandbox = session.sandbox
        workdir = session.task.spec.sandbox.workdir
        if isinstance(sandbox, DockerSandbox):
            argv, cwd = ["docker", "exec", "-it", "-w", workdir, sandbox.id, "bash"], None
        elif isinstance(sandbox, LocalSandbox):
            argv, cwd = ["bash"], str(sandbox.root)
        else:
            raise ConfigError(f"no interactive shell for {type(sandbox).__name__} sandboxes")
        code = await asyncio.to_thread(subprocess.call, argv, cwd=cwd)
    finally:
        await session.close()
    return code, divergence


class FailureGroup(_Frozen):
    stop_reason: str
    outcome: str
    trajectories: list[Trajectory]
    grades: list[Path | None]
    """Each trajectory's grade evidence file (None: it has none), in the same order."""


def failures(run_dir: Path) -> list[FailureGroup]:
    """The run's episodes without full reward, grouped by stop reason and grader outcome,
    largest group first."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run folder", fix="pass a folder `agentrl run` wrote")
    if not run_files(run_dir):
        raise ConfigError(
            f"{run_dir}: holds no trajectories (no trajectories.jsonl, eval/ or branches)",
            fix="pass a folder `agentrl run` or `agentrl train` wrote",
        )
    groups: dict[tuple[str, str], list[tuple[Trajectory, Path | None]]] = defaultdict(list)
    for path in run_files(run_dir):
        for traj in TrajectoryStore(path):
            if traj.reward is not None and traj.reward >= 1.0:
                continue
            if traj.error:
                outcome = traj.error.splitlines()[0][:80]
            elif traj.reward is None:
                outcome = "not graded"
            else:
                outcome = f"reward {traj.reward:g}"
            grade = path.parent / traj.grade_file if traj.grade_file else None
            groups[(traj.stop_reason.value, outcome)].append((traj, grade))
    return sorted(
        (
            FailureGroup(
                stop_reason=s,
                outcome=o,
                trajectories=[t for t, _ in pairs],
                grades=[g for _, g in pairs],
            )
            for (s, o), pairs in groups.items()
        ),
        key=lambda g: (-len(g.trajectories), g.stop_reason, g.outcome),
    )


def snapshot_ids(trajs: list[Trajectory]) -> list[str]:
    ids = [t.env.init_snapshot for t in trajs] + [u.snapshot_id for t in trajs for u in t.turns]
    return sorted({i for i in ids if i})


def volatile_only(recorded: str, replayed: str) -> list[str]:
    """The kinds of volatile detail two different texts differ in, when those are all
    they differ in (every such detail masked, they are equal); else []."""
    masked = [recorded, replayed]
    kinds = []
    for kind, pattern in VOLATILE.items():
        found = [pattern.findall(text) for text in masked]
        masked = [pattern.sub(f"<{kind}>", text) for text in masked]
        if found[0] != found[1]:
            kinds.append(kind)
    return kinds if masked[0] == masked[1] else []


def _diff(recorded: str, replayed: str) -> str:
    lines = difflib.unified_diff(
        recorded.splitlines(), replayed.splitlines(), "recorded", "replayed", lineterm=""
    )
    return "\n".join(lines)


def _task_of(paths: list[str], traj: Trajectory) -> Task:
    tasks = [load_any(p) for p in paths]
    for task in tasks:
        if task.spec.name == traj.task:
            if traj.env.task_hash and task.hash != traj.env.task_hash:
                log.warning(
                    "task %s changed since the run (hash %s, recorded %s): replay may diverge",
                    task.spec.name,
                    task.hash,
                    traj.env.task_hash,
                )
            return task
    raise ConfigError(
        f"the run's tasks ({', '.join(t.spec.name for t in tasks)}) do not include {traj.task!r}",
        fix="check run.json in the run folder",
    )


def _instance(task: Task, instance_id: str) -> Instance:
    for inst in task.instances:
        if inst.id == instance_id:
            return inst
    raise ConfigError(f"task {task.spec.name} has no instance {instance_id!r} any more")
