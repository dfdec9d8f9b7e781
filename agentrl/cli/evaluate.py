"""`agentrl eval`: k attempts of every instance, pass@1 and pass@k, resumable; and
`agentrl eval --compare RUN_A RUN_B`, the paired difference of two evaluations."""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from agentrl.cli.episodes import agent_override, instance_ids, limit_overrides
from agentrl.cli.output import console, err_console, tag
from agentrl.errors import ConfigError

if TYPE_CHECKING:
    from agentrl.evaluation import Attempt, Evaluation
    from agentrl.scores import Comparison, Scores, TaskScore
    from agentrl.tasks.spec import Task

SHOWN_INSTANCES = 40  # more than this: the per-instance table is in results.json only


def evaluate(args: argparse.Namespace) -> int:
    if args.compare:
        if args.tasks:
            raise ConfigError(
                "--compare takes two evaluation folders, not tasks",
                fix="agentrl eval --compare RUN_A RUN_B (without task paths)",
            )
        return compare(args.compare[0], args.compare[1], args.json)
    if not args.tasks:
        raise ConfigError(
            "agentrl eval: no tasks given",
            fix="agentrl eval TASK [TASK ...] --policy POLICY -k K, or --compare RUN_A RUN_B",
        )
    from agentrl.evaluation import EvalSpec, Evaluation, wanted

    tasks = _load(args)
    policy = _policy_name(args.policy)
    spec = EvalSpec(
        tasks={t.spec.name: t.hash for t in tasks},
        paths=[str(Path(t.path).resolve()) for t in tasks],
        policy=policy,
        model=str(Path(args.model).resolve())
        if args.model and Path(args.model).is_dir()
        else args.model,
        temperature=args.temperature,
        limits=limit_overrides(args),
    )
    out = args.out or Path("runs") / _default_name(tasks, policy)
    evaluation = Evaluation(out, spec, overwrite=args.overwrite)
    asked = wanted(tasks, args.attempts)
    todo = evaluation.missing(asked, retry_infra=args.retry_infra)
    kept = len(asked) - len(todo)
    if kept:
        console.print(f"{out}: {kept} of {len(asked)} attempts already recorded (kept)")
    if todo:
        try:
            _run(args, evaluation, tasks, todo)
        except KeyboardInterrupt:
            have = len(asked) - len(evaluation.missing(asked))
            err_console.print(
                f"{have} of {len(asked)} attempts are recorded in {out}; "
                "the same command continues from there"
            )
            raise
    results = evaluation.results(asked, args.attempts)
    _print_scores(results.scores, f"agentrl eval -> {out}")
    overall = results.scores.overall
    console.print(f"results: {out / 'results.json'}  trajectories: {out / 'trajectories.jsonl'}")
    if overall.pass_at_k:
        from agentrl.evaluation import PLOT, plot_pass_at_k

        title = f"{out.name}: {overall.instances} instances, {args.attempts} attempts each"
        plot_pass_at_k(results.scores, out / PLOT, title)
        console.print(f"pass@k plot: {out / PLOT}")
    if overall.infra_failures:
        say = f"{overall.infra_failures} of {overall.attempts} attempts"
        err_console.print(
            tag(
                "infrastructure failures:",
                "red",
                f"{say} (not graded, not counted in pass@k): see `agentrl failures {out}`; "
                "--retry-infra runs them again",
            )
        )
        err_console.print(f"first: {overall.first_infra_error}")
        if overall.first_infra_fix:
            err_console.print(tag("fix:", "yellow", overall.first_infra_fix))
    if overall.attempts and not overall.graded:
        raise ConfigError(
            f"no attempt was graded: all {overall.attempts} failed for infrastructure "
            f"reasons ({overall.first_infra_error})",
            fix=overall.first_infra_fix or f"see `agentrl failures {out}`",
        )
    return 0


def _load(args: argparse.Namespace) -> list[Task]:
    """The tasks, their instances selected, limits and temperature overridden; two tasks
    may not share a name or an instance id (an attempt's trajectory id would be ambiguous)."""
    from agentrl.tasks.formats import expand, load_any
    from agentrl.tasks.select import select_instances, with_overrides

    ids = instance_ids(args.instances)
    tasks = [load_any(p) for p in expand(args.tasks)]  # a dataset folder: each of its tasks
    if ids:
        have = {i.id for t in tasks for i in t.instances}
        if unknown := [i for i in ids if i not in have]:
            raise ConfigError(
                f"no instance {', '.join(unknown)} in the tasks given",
                fix="agentrl validate TASK lists a task's instances",
            )
        tasks = [select_instances(t, ids, strict=False) for t in tasks]
        tasks = [t for t in tasks if t.instances]
    overrides = limit_overrides(args)
    agent = agent_override(args)
    tasks = [with_overrides(t, overrides, args.temperature, agent) for t in tasks]
    names = [t.spec.name for t in tasks]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"two tasks are named {twice[0]}", fix="evaluate them in separate runs")
    owner: dict[str, str] = {}
    for t in tasks:
        for inst in t.instances:
            if inst.id in owner:
                raise ConfigError(
                    f"instance {inst.id} is in {owner[inst.id]} and in {t.spec.name}: "
                    "their attempts would share trajectory ids",
                    fix="evaluate them in separate runs",
                )
            owner[inst.id] = t.spec.name
    return tasks


def _policy_name(policy: str) -> str:
    """What the evaluation records as its policy: what it is, not how it was spelled. A
    train run as the checkpoint it means now (a resume after training went on must not mix
    two), a folder or a script by its absolute path (`scripted:solve.yaml` run from the
    task's folder and `scripted:task/solve.yaml` from above it are one policy)."""
    from agentrl.inference.config import (
        CheckpointSamplerConfig,
        ScriptedSamplerConfig,
        parse_policy,
    )

    config = parse_policy(policy)
    if isinstance(config, CheckpointSamplerConfig):
        return config.path
    if isinstance(config, ScriptedSamplerConfig):
        return f"scripted:{Path(config.script).resolve()}"
    return str(Path(policy).resolve()) if Path(policy).is_dir() else policy


def _default_name(tasks: list[Task], policy: str) -> str:
    """`eval-<task>[+N]-<policy>`: the same command writes (and resumes) the same folder."""
    more = f"+{len(tasks) - 1}" if len(tasks) > 1 else ""
    slug = re.sub(r"[^\w.-]+", "-", policy).strip("-")[-48:]
    return f"eval-{tasks[0].spec.name}{more}-{slug}"


def _run(
    args: argparse.Namespace, evaluation: Evaluation, tasks: list[Task], todo: list[Attempt]
) -> None:
    from pydantic import TypeAdapter

    from agentrl.dispatch import DispatchConfig
    from agentrl.evaluation import run_attempts
    from agentrl.inference.config import parse_policy
    from agentrl.inference.embedded import model_tokenizer
    from agentrl.sandbox import provider

    dispatcher = TypeAdapter(DispatchConfig).validate_python(
        {"type": args.dispatcher, "concurrency": args.concurrency}
    )
    policy = parse_policy(evaluation.spec.policy)
    model = evaluation.spec.model or policy.tokenizer_model()
    tokenizer = model_tokenizer(model)
    sampler = policy.build(tokenizer=tokenizer)

    async def go() -> None:
        try:
            await run_attempts(
                evaluation,
                tasks,
                todo,
                sampler,
                tokenizer,
                provider(args.provider),
                dispatcher,
                retry_infra=args.retry_infra,
                model=model,
            )
        finally:
            await sampler.close()

    asyncio.run(go())


def _print_wide(table: Table) -> None:
    """A table in full: a terminal's width, or 120 columns where output is a file or pipe
    (rich's 80 would cut the headers)."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(highlight=False, markup=False, emoji=False, width=120).print(table)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _print_scores(scores: Scores, title: str) -> None:
    ks = list(scores.overall.pass_at_k)
    rows: list[TaskScore] = (
        [*scores.tasks, scores.overall] if len(scores.tasks) > 1 else scores.tasks
    )
    table = Table(title=title)
    table.add_column("task", no_wrap=True)
    for col in ("instances", "attempts", "pass@1 %", "±95%"):
        table.add_column(col, justify="right")
    for k in ks[1:]:
        table.add_column(f"pass@{k} %", justify="right")
    for col in ("reward", "infra"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            row.task,
            str(row.instances),
            str(row.attempts),
            _pct(row.pass_at_1),
            _pct(row.pass_at_1_ci95),
            *[_pct(row.pass_at_k.get(k)) for k in ks[1:]],
            "-" if row.reward_mean is None else f"{row.reward_mean:.3f}",
            f"{row.infra_failures} ({100 * row.infra_share:.0f}%)",
            style="bold" if row.task == "all" else ("red" if row.infra_failures else None),
        )
    if len(scores.instances) <= SHOWN_INSTANCES:
        _print_instances(scores)
    _print_wide(table)
    for row in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(row.stop_reasons.items()))
        console.print(f"{row.task} stop reasons: {reasons}")


def _print_instances(scores: Scores) -> None:
    table = Table(title="per instance")
    table.add_column("task", no_wrap=True)
    table.add_column("instance", no_wrap=True)
    for col in ("solved", "graded", "infra", "reward", "turns", "tokens", "s"):
        table.add_column(col, justify="right")
    for i in scores.instances:
        table.add_row(
            i.task,
            i.instance,
            str(i.solved),
            str(i.graded),
            str(i.infra_failures),
            "-" if i.reward_mean is None else f"{i.reward_mean:.2f}",
            "-" if i.turns_mean is None else f"{i.turns_mean:.1f}",
            "-" if i.sampled_tokens_mean is None else f"{i.sampled_tokens_mean:.0f}",
            "-" if i.seconds_mean is None else f"{i.seconds_mean:.1f}",
            style="red" if i.infra_failures else None,
        )
    _print_wide(table)


def compare(a: Path, b: Path, json_out: Path | None) -> int:
    from agentrl.atomic import write_text
    from agentrl.evaluation import results_of
    from agentrl.scores import compare as paired

    name_a, scores_a = results_of(a)
    name_b, scores_b = results_of(b)
    result = paired(scores_a, scores_b, names=(name_a, name_b))
    _print_comparison(result)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_text(json_out, result.model_dump_json(indent=2) + "\n")
    if not result.instances:
        raise ConfigError(
            f"{a} and {b} share no graded instance",
            fix="compare evaluations of the same task instances",
        )
    return 0


def _print_comparison(c: Comparison) -> None:
    table = Table(title=f"B - A on {c.instances} shared instances (paired bootstrap)")
    for col in ("", "pass@1 %"):
        table.add_column(col)
    table.add_row(f"A  {c.a}", _pct(c.pass_at_1_a))
    table.add_row(f"B  {c.b}", _pct(c.pass_at_1_b))
    ci = "-" if c.ci95 is None else f"[{100 * c.ci95[0]:+.1f}, {100 * c.ci95[1]:+.1f}]"
    diff = "-" if c.difference is None else f"{100 * c.difference:+.1f}"
    verdict = "significant" if c.significant else "not significant (the interval holds 0)"
    table.add_row("B - A (95% CI)", f"{diff}  {ci}  {verdict}", style="bold")
    _print_wide(table)
    if c.only_a or c.only_b:
        console.print(f"left out: {c.only_a} instances only A graded, {c.only_b} only B")
    for label, changes in (("better in B", c.gained), ("worse in B", c.lost)):
        shown = ", ".join(f"{x.instance} {x.a:.2f}->{x.b:.2f}" for x in changes[:20])
        more = f" (+{len(changes) - 20} more)" if len(changes) > 20 else ""
        console.print(f"{label}: {len(changes)}" + (f": {shown}{more}" if changes else ""))
