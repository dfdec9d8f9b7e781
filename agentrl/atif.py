"""Trajectories in ATIF, the Agent Trajectory Interchange Format (v1.8, validated by the
`atif` package's pydantic models), out and back in.

An episode becomes one ATIF document: a system step and a user step (the task's prompts
as the instance renders them), then one agent step per turn: its decoded reply as the
message, its parsed tool call, the observation as the result of that call, and its
sampled tokens in `metrics` (`completion_token_ids`, `logprobs`; the ledger's prompt ids
on the first step of each segment). What ATIF has no field for goes under the key
`agentrl` of an `extra`: on each agent step its span, its tokens' policy versions, the
non-sampled tokens that follow it in the ledger (template, observation), its timings and
snapshot; at the root the reward, its components, the stop reason, the segments' reasons
and prompts, and the episode's bookkeeping (steps, seconds, environment, resume points).

`from_atif` inverts `to_atif` exactly: the trajectory it returns equals the exported one,
token for token, and passes the ledger checks. A document another tool wrote has no
`agentrl` extra: ATIF holds no loss mask, no policy versions and not the tokens between
replies, so it is refused rather than made into a ledger that was never sampled.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import atif as m

from agentrl import __version__, atomic
from agentrl.errors import ConfigError, TrajectoryError
from agentrl.trajectory import Segment, ToolCall, Trajectory, TrajectoryStore, Turn, run_files

if TYPE_CHECKING:
    from agentrl.tasks.spec import Task

log = logging.getLogger(__name__)

SCHEMA = "ATIF-v1.8"
KEY = "agentrl"
"""Where, in an `extra`, what ATIF has no field for is kept."""
_ROOT = (
    "group_id", "task", "reward", "turn_rewards", "reward_components", "stop_reason",
    "scheduled_step", "consumed_step", "seconds", "env", "agent", "branch_of", "resumed_at",
    "error", "fix", "grade_file",
)  # fmt: skip
_TURN = ("exit_code", "tool_error", "finish_reason", "gen_seconds", "tool_seconds", "replica",
         "snapshot_id", "kind")  # fmt: skip


def _tokens(ledger: Segment, start: int, end: int, *, sampled: bool) -> dict[str, Any]:
    """Tokens [start, end) of a ledger, with their mask, logprobs and versions only where
    they differ from what such tokens carry by default (sampled: 1, its logprob, a version;
    else 0, 0.0, -1)."""
    run: dict[str, Any] = {"ids": ledger.response_ids[start:end]}
    mask = ledger.loss_mask[start:end]
    if any(m != int(sampled) for m in mask):
        run["mask"] = mask
    if not sampled:
        if any(lp != 0.0 for lp in ledger.logprobs[start:end]):
            run["logprobs"] = ledger.logprobs[start:end]
        if any(v != -1 for v in ledger.token_versions[start:end]):
            run["versions"] = ledger.token_versions[start:end]
    return run


def to_atif(
    traj: Trajectory,
    task: Task | None = None,
    *,
    session_id: str | None = None,
    model: str | None = None,
) -> m.Trajectory:
    """One episode as an ATIF document, validated by the `atif` models. `task` (the one
    the episode ran) gives the opening messages and the tool definitions."""
    ledgers = traj.ledgers()
    steps: list[Any] = []
    tools = None
    if task is not None:
        from agentrl.tasks.env import build_tools
        from agentrl.tools.base import schema

        instance = next((i for i in task.instances if i.id == traj.group_id), None)
        if instance is not None:
            system = instance.render(task.spec.prompt.system)
            user = instance.render(task.spec.prompt.instance)
            steps.append(m.Step(step_id=1, source="system", message=system))
            steps.append(m.Step(step_id=2, source="user", message=user))
        tools = [{"type": "function", "function": schema(t)} for t in build_tools(task).values()]
    by_segment: dict[int, list[int]] = {}
    for k, turn in enumerate(traj.turns):
        by_segment.setdefault(turn.segment, []).append(k)
    for k, turn in enumerate(traj.turns):
        ledger = ledgers[turn.segment]
        start, end = turn.span
        mine = by_segment[turn.segment]
        following = mine.index(k) + 1
        stop = (
            traj.turns[mine[following]].span[0]
            if following < len(mine)
            else len(ledger.response_ids)
        )
        first_of_segment = mine[0] == k
        own: dict[str, Any] = {
            "segment": turn.segment,
            "span": list(turn.span),
            "versions": ledger.token_versions[start:end],
            "after": _tokens(ledger, end, stop, sampled=False),
            **{name: getattr(turn, name) for name in _TURN},
        }
        if (mask := _tokens(ledger, start, end, sampled=True).get("mask")) is not None:
            own["mask"] = mask
        call_id = f"call_{k + 1}"
        calls = None
        if turn.tool_call is not None:
            calls = [
                m.ToolCall(
                    tool_call_id=call_id,
                    function_name=turn.tool_call.name,
                    arguments=turn.tool_call.arguments,
                )
            ]
        result = m.ObservationResult(
            source_call_id=call_id if calls else None, content=turn.observation
        )
        metrics = m.Metrics(
            prompt_tokens=len(ledger.prompt_ids) + start,
            completion_tokens=end - start,
            prompt_token_ids=ledger.prompt_ids if first_of_segment else None,
            completion_token_ids=ledger.response_ids[start:end],
            logprobs=ledger.logprobs[start:end],
        )
        steps.append(
            m.Step(
                step_id=len(steps) + 1,
                source="agent",
                message=turn.action,
                tool_calls=calls,
                observation=m.Observation(results=[result]),
                metrics=metrics,
                llm_call_count=1,
                extra={KEY: own},
            )
        )
    root: dict[str, Any] = traj.model_dump(mode="json", include=set(_ROOT))
    root["schema_version"] = traj.schema_version
    root["ledgers"] = [
        {
            "reason": ledger.reason,
            "prompt_ids": ledger.prompt_ids,
            # tokens before the segment's first turn (none in what agentrl records today)
            "lead": _tokens(
                ledger,
                0,
                traj.turns[by_segment[s][0]].span[0] if s in by_segment else 0,
                sampled=False,
            ),
            **({} if s in by_segment else {"rest": _tokens(ledger, 0, len(ledger.response_ids),
                                                            sampled=False)}),
        }
        for s, ledger in enumerate(ledgers)
    ]  # fmt: skip
    return m.Trajectory(
        schema_version=SCHEMA,
        session_id=session_id,
        trajectory_id=traj.trajectory_id,
        agent=m.Agent(name="agentrl", version=__version__, model_name=model,
                      tool_definitions=tools),
        steps=steps or [m.Step(step_id=1, source="user", message="")],
        final_metrics=m.FinalMetrics(
            total_prompt_tokens=sum(len(x.prompt_ids) for x in ledgers),
            total_completion_tokens=traj.num_sampled,
            total_steps=len(steps),
            extra={"reward": traj.reward, "stop_reason": traj.stop_reason.value},
        ),
        extra={KEY: root},
    )  # fmt: skip


def _tool_call(step: Any) -> ToolCall | None:
    """A step's first tool call as a turn records it (a turn holds one)."""
    if not step.tool_calls:
        return None
    call = step.tool_calls[0]
    return ToolCall(name=call.function_name, arguments=call.arguments)


def _run(run: dict[str, Any], ledger: Segment, *, sampled: bool) -> None:
    """Append a `_tokens` run to `ledger` (the sampled defaults apply to the span's own)."""
    ids = run["ids"]
    n = len(ids)
    ledger.response_ids.extend(ids)
    ledger.loss_mask.extend(run.get("mask", [int(sampled)] * n))
    if not sampled:
        ledger.logprobs.extend(run.get("logprobs", [0.0] * n))
        ledger.token_versions.extend(run.get("versions", [-1] * n))


def from_atif(doc: m.Trajectory | dict[str, Any], *, where: str = "") -> Trajectory:
    """The agentrl trajectory of an ATIF document (`to_atif`'s exactly), checked."""
    prefix = f"{where}: " if where else ""
    try:
        parsed = doc if isinstance(doc, m.Trajectory) else m.Trajectory.model_validate(doc)
    except ValueError as e:
        raise TrajectoryError(f"{prefix}not an ATIF trajectory: {str(e).splitlines()[0]}") from e
    root = (parsed.extra or {}).get(KEY)
    agent_steps = [s for s in parsed.steps if s.source == "agent"]
    if root is None:
        raise TrajectoryError(
            f"{prefix}an ATIF document another tool wrote (no extra.{KEY}): its token "
            "ledger (masks, versions, what came between replies) is not in it",
            fix="import documents `agentrl export-trajectories --format atif` wrote",
        )
    ledgers = [Segment(reason=x["reason"], prompt_ids=x["prompt_ids"]) for x in root["ledgers"]]
    turns: list[Turn] = []
    for s, spec in enumerate(root["ledgers"]):
        _run(spec["lead"], ledgers[s], sampled=False)
        if "rest" in spec:
            _run(spec["rest"], ledgers[s], sampled=False)
    for step in agent_steps:
        own = (step.extra or {})[KEY]
        ledger = ledgers[own["segment"]]
        assert step.metrics is not None
        ids = step.metrics.completion_token_ids or []
        start = len(ledger.response_ids)
        _run({"ids": ids, **({"mask": own["mask"]} if "mask" in own else {})}, ledger,
             sampled=True)  # fmt: skip
        ledger.logprobs.extend(step.metrics.logprobs or [])
        ledger.token_versions.extend(own["versions"])
        if [start, len(ledger.response_ids)] != own["span"]:
            raise TrajectoryError(f"{prefix}step {step.step_id}: its tokens are not at its span")
        _run(own["after"], ledger, sampled=False)
        results = step.observation.results if step.observation else []
        turns.append(
            Turn(
                action=step.message if isinstance(step.message, str) else "",
                tool_call=_tool_call(step),
                observation=str(results[0].content or "") if results else "",
                span=(own["span"][0], own["span"][1]),
                segment=own["segment"],
                **{name: own[name] for name in _TURN},
            )
        )
    fields = {k: v for k, v in root.items() if k in _ROOT}
    traj = Trajectory.from_ledgers(
        ledgers,
        schema_version=root.get("schema_version", 1),
        trajectory_id=parsed.trajectory_id or "",
        turns=turns,
        **fields,
    )
    return traj.check()


def _file_name(trajectory_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", trajectory_id).lstrip(".-") or "episode"


def export_run(run_dir: Path, out: Path) -> int:
    """Every episode of a run folder (its trajectories, evaluations and branches) as one
    ATIF file each under `out`, laid out as the run's files are (`eval/step-N/`,
    `branches/`); each file is written whole. The number written."""
    from agentrl.run_info import read_run_info
    from agentrl.tasks.formats import load_any

    info = read_run_info(run_dir)
    tasks: dict[str, Task] = {}
    for path in info.tasks:
        try:
            task = load_any(path)
        except ConfigError as e:
            log.warning("%s: %s; its episodes are exported without their prompts", path, e)
            continue
        tasks[task.spec.name] = task
    written = 0
    for file in run_files(run_dir):
        rel = file.relative_to(run_dir)
        folder = out / rel.parent if rel.name == "trajectories.jsonl" else out / rel.stem
        folder.mkdir(parents=True, exist_ok=True)
        for traj in TrajectoryStore(file):
            doc = to_atif(traj, tasks.get(traj.task), session_id=info.run_id, model=info.model)
            text = json.dumps(doc.to_json_dict(), indent=1) + "\n"
            atomic.write_text(folder / f"{_file_name(traj.trajectory_id)}.json", text)
            written += 1
    return written


def _text(message: Any) -> str:
    """A step's message as text (a multimodal one's text parts)."""
    if isinstance(message, str):
        return message
    return "\n".join(p.text for p in message or [] if getattr(p, "text", None))


def viewed(doc: dict[str, Any], fallback_id: str) -> tuple[Trajectory, str]:
    """An ATIF document as the viewer shows it, and the text that opened it (its system
    and user steps before the first agent step). One this package wrote is its trajectory
    exactly (`from_atif`). Another tool's is made a record to look at, not one to train
    on, and is not checked: its agent steps are the turns (reply, first tool call, the
    results; a user or system step after one is appended to its observation), its token
    ids the ledger where every agent step has them, its reward `final_metrics.extra.reward`
    where it gives one (ATIF has no reward field), its stop reason `finished`."""
    try:
        parsed = m.Trajectory.model_validate(doc)
    except ValueError as e:
        raise TrajectoryError(f"not an ATIF trajectory: {str(e).splitlines()[0]}") from e
    first_agent = next((k for k, s in enumerate(parsed.steps) if s.source == "agent"), None)
    opening_steps = parsed.steps if first_agent is None else parsed.steps[:first_agent]
    opening = "\n\n".join(f"[{s.source}] {_text(s.message)}" for s in opening_steps)
    if (parsed.extra or {}).get(KEY) is not None:
        return from_atif(parsed), opening
    agent = [s for s in parsed.steps if s.source == "agent"]
    ids = [s.metrics.completion_token_ids if s.metrics else None for s in agent]
    prompt = agent[0].metrics.prompt_token_ids if agent and agent[0].metrics else None
    tokens = bool(agent) and bool(prompt) and all(ids)
    ledger = Segment(reason="start", prompt_ids=list(prompt or []) if tokens else [])
    turns: list[Turn] = []
    for step in parsed.steps[len(opening_steps) :]:
        if step.source != "agent":  # what the agent was told next
            if turns:
                extra = f"\n[{step.source}] {_text(step.message)}"
                turns[-1] = turns[-1].model_copy(
                    update={"observation": turns[-1].observation + extra}
                )
            continue
        start = len(ledger.response_ids)
        if tokens and step.metrics is not None:
            got = list(step.metrics.completion_token_ids or [])
            lps = step.metrics.logprobs or []
            ledger.response_ids.extend(got)
            ledger.loss_mask.extend([1] * len(got))
            ledger.logprobs.extend(lps if len(lps) == len(got) else [0.0] * len(got))
            ledger.token_versions.extend([0] * len(got))
        calls = step.tool_calls or []
        names = {c.tool_call_id: c.function_name for c in calls}
        results = step.observation.results if step.observation else []
        shown = [
            (f"[{names.get(r.source_call_id or '', 'result')}] " if len(results) > 1 else "")
            + _text(r.content)
            for r in results
        ]
        reply = _text(step.message)
        if step.reasoning_content:
            reply = f"[reasoning] {step.reasoning_content}\n{reply}"
        turns.append(
            Turn(
                action=reply,
                tool_call=_tool_call(step),
                observation="\n".join(shown),
                span=(start, len(ledger.response_ids)),
            )
        )
    final = (parsed.final_metrics.extra or {}) if parsed.final_metrics else {}
    reward = final.get("reward")
    tid = parsed.trajectory_id or parsed.session_id or fallback_id
    return (
        Trajectory.from_ledgers(
            [ledger],
            trajectory_id=tid,
            group_id=parsed.session_id or tid,
            task=parsed.agent.name,
            reward=float(reward) if isinstance(reward, int | float) else None,
            stop_reason="finished",
            turns=turns,
        ),
        opening,
    )
