"""`run.json`: what a run folder (of `agentrl run`, `eval` or `train`) needs to be
replayed: the run id its sandboxes were labelled with, the provider, the task files, and
whose tokenizer its token ids are in."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agentrl import atomic
from agentrl.errors import ConfigError


class RunInfo(BaseModel):
    """`run.json`: what a run folder needs to be replayed (`agentrl replay`)."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    provider: str
    tasks: list[str]  # task files or folders, absolute
    model: str | None = Field(
        default=None,
        description="whose tokenizer the token ids are in: 'embedded' or a model folder "
        "(None: not recorded, a run written before this field)",
    )


RUN_INFO = "run.json"


def write_run_info(out_dir: Path, info: RunInfo) -> None:
    tasks = [str(Path(t).resolve()) for t in info.tasks]
    absolute = info.model_copy(update={"tasks": tasks})
    atomic.write_text(out_dir / RUN_INFO, json.dumps(absolute.model_dump(), indent=2))


def read_run_info(run_dir: Path) -> RunInfo:
    path = run_dir / RUN_INFO
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} has no {RUN_INFO}",
            fix="pass a folder that `agentrl run` or `agentrl train` wrote (this version or later)",
        )
    return RunInfo.model_validate_json(path.read_text())
