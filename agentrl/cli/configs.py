"""`agentrl train` and `agentrl validate`: a train config run, any file checked."""

from __future__ import annotations

import argparse
import asyncio
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rich.table import Table

from agentrl.cli.output import console, err_console, tag
from agentrl.errors import AgentRLError, ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def train(args: argparse.Namespace) -> int:
    from agentrl.train_config import load_train
    from agentrl.yamlfile import readable

    # Every task, the split and the model folder, checked as `agentrl validate` checks
    # them, before torch is imported: a bad file is quick.
    inputs = load_train(args.config)
    config = inputs.config
    data = config.model_dump(exclude_unset=True)  # what the file says, and only that
    if args.steps is not None:
        data["schedule"]["steps"] = args.steps
    if args.servers is not None:
        urls = [u for u in args.servers.split(",") if u.strip()]
        data["servers"] = {**(data.get("servers") or {}), "urls": urls}
    if args.seed is not None:
        data["seed"] = args.seed
    try:  # the flags are validated like the file: --steps 0 is refused, not ignored
        config = type(config).model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        flag = {"schedule": "--steps", "servers": "--servers", "seed": "--seed"}
        raise ConfigError(
            f"{flag.get(str(err['loc'][0]), 'a flag')}: {readable(err)}",
            fix="give a value the train config itself could hold",
        ) from None
    tasks, eval_tasks = inputs.tasks, inputs.eval_tasks
    out = args.out or Path("runs") / config.name
    if out.exists() and any(out.iterdir()) and not args.resume and not args.overwrite:
        raise ConfigError(
            f"{out} already holds a run",
            fix="continue it with --resume, replace it with --overwrite, or pick --out DIR",
        )
    from agentrl.train import Trainer

    trainer = Trainer(config, tasks, out, eval_tasks=eval_tasks)
    summary = asyncio.run(trainer.run(resume=args.resume))
    if not summary:  # a torchrun rank other than 0: rank 0 reports
        return 0
    table = Table(title=f"agentrl train {config.name} -> {out}")
    table.add_column("held-out")
    table.add_column("step")
    table.add_column("reward (95% CI)")
    table.add_column("pass@1 (95% CI)")
    table.add_column("episodes")
    for key in ("eval_before", "eval_after"):
        row = summary.get(key)
        if row:
            reward = f"{row['reward_mean']:.3f} +- {row['reward_ci95']:.3f}"
            solved = f"{row['pass_at_1']:.3f} +- {row['pass_at_1_ci95']:.3f}"
            when, step, episodes = key.removeprefix("eval_"), str(row["step"]), str(row["episodes"])
            table.add_row(when, step, reward, solved, episodes)
    table.caption = _no_update(summary)
    table.caption_style = "bold red" if summary.get("skipped_steps") else None
    console.print(table)
    console.print(f"metrics: {out / 'metrics.jsonl'}  reward curve: {out / 'reward.png'}")
    console.print(f"held-out evaluations: {out / 'eval'} (agentrl eval --compare A B pairs two)")
    return 0


def _no_update(summary: dict[str, Any]) -> str | None:
    """The table's last word on steps that made no update (the weights did not move)."""
    skipped: dict[str, int] = summary.get("skipped_steps") or {}
    count, steps = sum(skipped.values()), summary["steps"]
    if not count:
        return None
    why = "; ".join(r if n == count else f"{r}: {n} steps" for r, n in skipped.items())
    if count == steps:
        return f"no update was made: every step ({steps}) was skipped ({why})"
    return f"{count} of {steps} steps made no update ({why})"


def validate(args: argparse.Namespace) -> int:
    from agentrl.tasks.formats import expand

    paths = expand(args.files)  # a dataset folder: each of its tasks
    fixes = [fix for path in paths if (fix := _validate_one(path, args.model)) is not None]
    for fix in dict.fromkeys(fixes):
        err_console.print(tag("fix:", "yellow", fix))
    return 1 if fixes else 0


def _validate_one(path: Path, model: str = "embedded") -> str | None:
    """Print what `path` is, or what is wrong with it; None if valid, else the fix. A task's
    prompts are counted with `model`'s tokenizer (a train config's are not: validating one
    stays free of torch and transformers; `agentrl train` counts them before it starts)."""
    from agentrl.tasks.formats import kind_of, load_any
    from agentrl.textfile import UnreadableFile
    from agentrl.yamlfile import ConfigFileError

    try:
        kind = kind_of(path)  # a FIFO is refused here, before any reader opens it
        if kind == "trajectories":
            from agentrl.trajectory import TrajectoryStore

            count = sum(1 for _ in TrajectoryStore(path).read())
            console.print(f"{path}: {count} trajectories, all valid")
        elif kind == "train-config":
            from agentrl.train_config import load_train, split_sizes

            run = load_train(path)  # all that `agentrl train` loads before its first step
            n_train, n_held = split_sizes(run.config, run.tasks, run.eval_tasks)
            files = len(run.tasks) + len(run.eval_tasks)
            console.print(
                f"{path}: ok (train config {run.config.name}): {n_train} training and "
                f"{n_held} held-out instances in {files} task file(s)"
            )
        else:
            task = load_any(path)
            what = "rows" if kind == "rows" else "task"
            tokenizer = _prompt_tokenizer(model)
            if tokenizer is None:
                what += "; prompt lengths not counted: the embedded model is not installed"
            else:
                from agentrl.preflight import check_prompts

                check_prompts(task, tokenizer)
            console.print(f"{path}: ok ({len(task.instances)} instances, {task.format} {what})")
    except UnreadableFile as e:  # a FIFO, a folder, not UTF-8: before any parser
        err_console.print(f"{e.path}:{e.line}: file: {e.reason}")
        return e.fix
    except ConfigFileError as e:  # TaskError included: each problem as file:line: field: ...
        for problem in e.problems:
            err_console.print(str(problem))
        return e.fix or ConfigFileError.default_fix
    except AgentRLError as e:
        err_console.print(str(e))
        return e.fix or "fix the file, then validate it again"
    return None


@functools.cache
def _prompt_tokenizer(model: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer `validate` counts prompt tokens with (loaded once); None for the
    default embedded model when it is not installed."""
    from agentrl.errors import ModelNotFoundError
    from agentrl.inference.embedded import gguf_path, model_dir

    if model == "embedded":
        try:
            gguf_path()
        except ModelNotFoundError:
            return None
    elif not Path(model).is_dir():
        raise ConfigError(
            f"--model {model}: no such folder", fix="pass embedded, or a model's folder"
        )
    folder = model_dir() if model == "embedded" else Path(model)
    if (folder / "tokenizer.json").is_file():
        # The fast tokenizer alone: counting tokens needs no torch (6 s to import here).
        from transformers import PreTrainedTokenizerFast

        fast: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(folder)
        return fast
    from agentrl.inference.embedded import model_tokenizer

    return model_tokenizer(model)
