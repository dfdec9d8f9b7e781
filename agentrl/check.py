"""`agentrl check`: does each task's grader tell a solution from doing nothing?

For every instance, two episodes without a model, through the same sandbox and grader
that training uses (INIT, then EVAL with its sealing and its reference rule):
- oracle: the reference solution runs in the sandbox first (Terminal-Bench
  `solution.sh`, Harbor `solution/solve.sh`, a SWE-bench row's `patch`, a YAML task's
  `oracle:` commands);
- no-op: nothing runs.

An instance passes when the oracle earns full reward (1.0) and the no-op less. A format
with no reference solution (an OpenEnv environment: its server gives the rewards) has no
oracle episode: its instance passes when the environment starts, resets and grades a no-op. An
infrastructure failure (the sandbox did not start, the solution crashed, the tests did
not run) is reported as such and fails the check. A failing instance gets a verdict of a
few words, the lines of the grader's output that explain it (`explain`), the path of the
whole output, and a fix that says what to look at.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
import traceback
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import AgentRLError, GraderError, first_line
from agentrl.sandbox.base import SandboxProvider
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.evidence import DidNotRun, Evidence
from agentrl.tasks.pytest_log import PASSING
from agentrl.tasks.spec import CommandGrader, Instance, PytestGrader, PythonGrader, Task

FULL_REWARD = 1.0
EXPLAIN_LINES = 10


class Outcome(BaseModel):
    """One graded episode of a check."""

    model_config = ConfigDict(extra="forbid")

    reward: float | None = None
    tests: str = Field(default="", description="passed/failed, as the grader parsed them")
    failed: list[str] = Field(
        default_factory=list, description="the tests that did not pass (the first ten)"
    )
    error: str | None = Field(default=None, description="an infrastructure failure, if any")
    fix: str | None = None
    seconds: float = 0.0
    excerpt: list[str] = Field(
        default_factory=list, description="a failing instance's lines that explain it"
    )
    log: str | None = Field(default=None, description="a failing instance's whole grader output")
    evidence: Evidence | None = Field(default=None, exclude=True)


class CheckRow(BaseModel):
    """One instance of `agentrl check`."""

    model_config = ConfigDict(extra="forbid")

    task: str
    format: str
    instance: str
    oracle: Outcome
    noop: Outcome
    ok: bool
    verdict: str = Field(default="pass", description="in a few words: pass, or what failed")
    fix: str | None = Field(default=None, description="a failing instance's: what to look at")
    notes: list[str] = Field(default_factory=list, description="what a person should know")


async def check_task(
    task: Task, env: TaskEnv, *, concurrency: int = 2, logs: Path | None = None
) -> list[CheckRow]:
    """Oracle and no-op for every instance of `task`, `concurrency` instances at a time; a
    failing instance's grader output goes to a file in `logs` (default: a temporary folder)."""
    gate = asyncio.Semaphore(concurrency)
    logs = logs or Path(tempfile.gettempdir()) / f"agentrl-check-{uuid.uuid4().hex[:8]}"

    async def one(instance: Instance) -> CheckRow:
        if not env.has_reference:
            return await _without_reference(env, instance, gate)
        async with gate:
            oracle, noop = await asyncio.gather(
                _episode(env, instance, oracle=True), _episode(env, instance, oracle=False)
            )
        ok = (
            oracle.error is None
            and noop.error is None
            and oracle.reward is not None
            and oracle.reward >= FULL_REWARD
            and noop.reward is not None
            and noop.reward < FULL_REWARD
        )
        verdict, fix, kind = ("pass", None, None) if ok else _judge(oracle, noop)
        if kind is not None:  # the episode that shows what is wrong
            log = logs / f"{task.spec.name}.{instance.id}.{kind}.log"
            _explain(oracle if kind == "oracle" else noop, log)
        missing = env.missing_network()
        return CheckRow(
            task=task.spec.name,
            format=task.format,
            instance=instance.id,
            oracle=oracle,
            noop=noop,
            ok=ok,
            verdict=verdict,
            fix=fix,
            notes=([missing] if missing else []) + env.image_notes(),
        )

    return list(await asyncio.gather(*(one(i) for i in task.instances)))


async def _without_reference(env: TaskEnv, instance: Instance, gate: asyncio.Semaphore) -> CheckRow:
    """A no-op alone, for a format without a reference solution: it passes when the
    sandbox starts and its grade comes back."""
    async with gate:
        noop = await _episode(env, instance, oracle=False)
    ok = noop.error is None and noop.reward is not None
    return CheckRow(
        task=env.task.spec.name,
        format=env.task.format,
        instance=instance.id,
        oracle=Outcome(),
        noop=noop,
        ok=ok,
        verdict="pass (no oracle)" if ok else "no-op: sandbox error",
        fix=None if ok else noop.fix or "see what `agentrl doctor` says",
        notes=[f"{env.task.format} has no reference solution: the no-op alone is checked"],
    )


async def _episode(env: TaskEnv, instance: Instance, *, oracle: bool) -> Outcome:
    started = time.monotonic()
    kind = "oracle" if oracle else "noop"
    try:
        sandbox = await env.init(instance, name=f"{instance.id}-{kind}")
    except AgentRLError as e:
        return Outcome(
            error=f"sandbox: {first_line(e)}", fix=e.fix or None, seconds=_since(started)
        )
    try:
        if oracle:
            try:
                await env.run_oracle(sandbox, instance)
            except AgentRLError as e:
                return _failed("reference solution", e, started)
        try:
            graded = await env.evaluate(sandbox, instance)
        except GraderError as e:
            evidence = e.evidence if isinstance(e, DidNotRun) else None
            broken = grader_broken(e)
            return Outcome(
                error=f"{'grader' if broken else 'eval'}: {first_line(e)}",
                fix=grader_fix(env.task, e) if broken else e.fix or None,
                seconds=_since(started),
                evidence=evidence,
            )
        except AgentRLError as e:
            return Outcome(
                error=f"sandbox: {first_line(e)}", fix=e.fix or None, seconds=_since(started)
            )
    finally:
        await sandbox.close()
    failed = [name for name, status in graded.evidence.tests.items() if status not in PASSING]
    return Outcome(
        reward=graded.reward,
        tests=_tests(graded.components),
        failed=failed[:10],
        seconds=_since(started),
        evidence=graded.evidence,
    )


def grader_broken(error: GraderError) -> bool:
    """Whether the grader itself is at fault, not the tests or the sandbox: it crashed,
    timed out or returned no reward (any GraderError but DidNotRun), or its test command
    ran to the end (exit 0) and still left nothing to read (no reward file, none of the
    listed tests)."""
    return not isinstance(error, DidNotRun) or error.evidence.exit_code == 0


def grader_fix(task: Task, error: GraderError) -> str:
    """What to fix when the grader is at fault: the line of the grader's code that raised,
    or the key of its config that names what the command never produced."""
    grader = task.spec.grader
    if isinstance(grader, PythonGrader):
        where = _raised_at(error, Path(task.path).parent)
        at = f" at {where}" if where else f" ({grader.function})"
        return f"the python grader itself failed{at}: fix it there, then check again"
    if isinstance(grader, CommandGrader) and grader.reward_file and isinstance(error, DidNotRun):
        return (
            f"the grader command ran (exit 0) but wrote no file at reward_file "
            f"({grader.reward_file}): make reward_file the path the command writes"
        )
    if isinstance(grader, PytestGrader) and isinstance(error, DidNotRun):
        return "pytest ran but reported none of the listed tests: fix fail_to_pass/pass_to_pass"
    return error.fix or "the grader itself failed (the error above): fix the grader"


def _raised_at(error: BaseException, base: Path) -> str | None:
    """`file:line` of the deepest frame of the exception behind `error` in a file under
    `base` (the task's own grader code), else the deepest frame at all; None without one."""
    cause = error.__cause__
    frames = traceback.extract_tb(cause.__traceback__) if cause else []
    if not frames:
        return None
    base = base.resolve()
    own = [f for f in frames if Path(f.filename).resolve().is_relative_to(base)]
    frame = (own or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


NO_TESTS_FIX = (
    "the test command did not run even with the reference solution in place: the lines above "
    "say why (often a program or file the tests need that the image lacks); fix the image or "
    "the test script"
)
ORACLE_FAILS_FIX = (
    "the reference solution does not pass the task's own tests: the failures are above, all of "
    "them in the log; fix the solution, or the tests if they ask for the wrong thing"
)
NOOP_PASSES_FIX = (
    "the tests already pass in the untouched sandbox, so they reward doing nothing: make them "
    "check what the task asks the agent to change"
)


def _judge(oracle: Outcome, noop: Outcome) -> tuple[str, str, str]:
    """A failing instance's verdict, its fix, and which episode shows it ("oracle", "noop")."""
    both = (("oracle", "oracle", oracle), ("noop", "no-op", noop))
    for kind, name, o in both:
        if o.error and not o.error.startswith(("eval: ", "grader: ", "reference solution: ")):
            return f"{name}: sandbox error", o.fix or "see what `agentrl doctor` says", kind
    if oracle.error and oracle.error.startswith("reference solution: "):
        return "solution failed", oracle.fix or "make the reference solution run", "oracle"
    for kind, name, o in both:
        if o.error and o.error.startswith("grader: "):
            return f"{name}: grader broken", o.fix or "fix the grader", kind
    for kind, name, o in both:
        if o.error:  # a fix that says to run `agentrl check` again sends you in a circle
            fix = o.fix if o.fix and "agentrl check" not in o.fix else NO_TESTS_FIX
            return f"{name}: no tests ran", fix, kind
    if oracle.reward is not None and oracle.reward < FULL_REWARD:
        return f"oracle earns {oracle.reward:g}", ORACLE_FAILS_FIX, "oracle"
    return f"no-op earns {noop.reward:g}", NOOP_PASSES_FIX, "noop"


_SUMMARY = re.compile(r"=+ short test summary info =+", re.IGNORECASE)
_COUNTS = re.compile(r"^=+ .*\b(passed|failed|errors?|no tests ran)\b.* =+$")
_TELLING = re.compile(
    r"error|fail|not found|no such|no module|denied|traceback|exception|refused|timed? ?out"
    r"|cannot|unable",
    re.IGNORECASE,
)


def explain(output: str, most: int = EXPLAIN_LINES) -> list[str]:
    """The lines of a grader's output that say why it failed, in their order: pytest's
    assertion lines (`E ...`), the tests its summary lists and its final count; without a
    pytest summary, the lines that name an error and the last three."""
    lines = [line.rstrip() for line in output.splitlines() if line.strip()]
    at = next((i for i, line in enumerate(lines) if _SUMMARY.search(line)), None)
    if at is not None:
        asserts = [i for i in range(at) if lines[i].startswith("E ")][:4]
        listed = [i for i in range(at + 1, len(lines)) if lines[i].startswith(("FAILED", "ERROR"))]
        counts = [i for i in range(at + 1, len(lines)) if _COUNTS.match(lines[i])][-1:]
        picked = asserts + listed[: most - len(asserts) - len(counts)] + counts
    else:
        telling = [i for i, line in enumerate(lines) if _TELLING.search(line)]
        last = list(range(max(len(lines) - 3, 0), len(lines)))
        picked = telling[: most - len(last)] + last
    return [lines[i][:240] for i in sorted(set(picked))][:most]


def _explain(outcome: Outcome, log: Path) -> None:
    """Fill `outcome`'s excerpt and write its whole grader output to `log`."""
    evidence = outcome.evidence
    if evidence is None:  # no grader ran: the error is all there is
        outcome.excerpt = [outcome.error] if outcome.error else []
        return
    outcome.excerpt = explain(evidence.output)
    head = [f"grader: {evidence.grader}", f"command: {evidence.command}"]
    head.append(f"exit code: {evidence.exit_code}")
    head += [f"error: {outcome.error}"] if outcome.error else [f"reward: {outcome.reward}"]
    head += [f"reference: {evidence.reference}"] if evidence.reference else []
    head += [f"note: {note}" for note in evidence.notes]
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("\n".join(head) + "\n\n" + evidence.output, encoding="utf-8")
    outcome.log = str(log)


def _failed(stage: str, error: AgentRLError, started: float) -> Outcome:
    return Outcome(
        error=f"{stage}: {first_line(error)}", fix=error.fix or None, seconds=_since(started)
    )


def _tests(components: dict[str, object]) -> str:
    if "fail_to_pass" in components:
        return f"F2P {components['fail_to_pass']}, P2P {components.get('pass_to_pass')}"
    if "tests_passed" in components:
        return f"{components['tests_passed']} passed, {components['tests_failed']} failed"
    return f"exit {components.get('exit_code')}" if "exit_code" in components else ""


def _since(started: float) -> float:
    return round(time.monotonic() - started, 1)


def check_paths(
    paths: list[Path],
    provider: SandboxProvider,
    *,
    instances: list[str] | None = None,
    concurrency: int = 2,
) -> list[CheckRow]:
    """`agentrl check` over task files and folders: the rows of every instance."""
    from agentrl.episode import make_env
    from agentrl.tasks.formats import expand, load_any
    from agentrl.tasks.select import select_instances

    # a dataset folder: each of its tasks
    tasks = [select_instances(load_any(p), instances, strict=False) for p in expand(paths)]
    if instances and not any(t.instances for t in tasks):
        from agentrl.errors import ConfigError

        raise ConfigError(
            f"no instance {', '.join(instances)} in {', '.join(map(str, paths))}",
            fix="list a task's instances with `agentrl validate PATH`",
        )
    run_id = f"check-{uuid.uuid4().hex[:8]}"
    logs = Path(tempfile.gettempdir()) / f"agentrl-{run_id}"  # made only if an instance fails

    async def go() -> list[CheckRow]:
        rows: list[CheckRow] = []
        for task in tasks:
            if task.instances:
                env = make_env(task, provider, run_id)
                rows += await check_task(task, env, concurrency=concurrency, logs=logs)
        return rows

    return asyncio.run(go())
