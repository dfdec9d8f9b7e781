"""Reading SWE-bench-style rows: a JSON list or JSONL file becomes one Task with an
Instance per row, its dataset detected from the columns, each row checked for what its
format requires (the file, line, instance and field named in every error).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import ConfigError, GraderError
from agentrl.sandbox.base import Sandbox
from agentrl.tasks.graders import listed_tests
from agentrl.tasks.spec import (
    ContextPolicy,
    EpisodeLimits,
    Instance,
    PromptConfig,
    PythonGrader,
    SandboxConfig,
    Task,
    TaskSpec,
)
from agentrl.tasks.swe import TEST_TIMEOUT_S, WORKDIR, Format
from agentrl.tasks.swe.harness import SWE_GYM_REPOS, needs_swebench, require_swebench
from agentrl.textfile import regular_file

_SDIST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")

REQUIRED: dict[Format, tuple[str, ...]] = {
    "swe-bench": (
        *("instance_id", "repo", "base_commit", "problem_statement", "test_patch"),
        *("FAIL_TO_PASS", "PASS_TO_PASS"),
    ),
    "swe-gym": (
        *("instance_id", "repo", "base_commit", "problem_statement", "test_patch"),
        *("FAIL_TO_PASS", "PASS_TO_PASS"),
    ),
    "swe-smith": (
        *("instance_id", "repo", "patch", "problem_statement", "image_name"),
        *("FAIL_TO_PASS", "PASS_TO_PASS"),
    ),
    "r2e-gym": ("repo_name", "docker_image", "problem_statement", "expected_output_json"),
}
STRINGS = (
    *("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "patch"),
    *("hints_text", "version", "environment_setup_commit", "created_at", "image_name"),
    *("image", "docker_image", "repo_archive", "test_cmd", "eval_script", "log_parser"),
    *("eval_type", "repo_name", "commit_hash", "expected_output_json"),
)

SYSTEM_PROMPT = (
    "You are an expert software engineer fixing an issue in a Python repository. You work "
    "inside a sandboxed container without network access. Use the tools to explore the code, "
    "reproduce the problem, edit the source and check your fix; call finish when you are done."
)
INSTANCE_PROMPT = """<uploaded_files>
{workdir}
</uploaded_files>
The repository {{{repo}}} is checked out in {workdir}, a git repository.
Consider the following issue:

<issue>
{{problem_statement}}
</issue>

Change the non-test files in {workdir} so that the issue is resolved. Tests for it already
exist elsewhere: do not add, change or delete any tests.

Suggested steps:
1. Find and read the code relevant to the issue.
2. Write a small script that reproduces the problem, and run it.
3. Edit the source code to fix the problem.
4. Rerun your script to confirm the fix, and think about edge cases.
Call finish when you are done."""


class Source(BaseModel):
    """agentrl's addition to a row: the source to build an image from, and how to install it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sdist: str | None = Field(
        default=None, description="NAME==VERSION on PyPI; its sdist is the repository source"
    )
    sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$", description="expected sha256 of the sdist"
    )
    install: list[str] = Field(
        default_factory=list, description="shell commands run in /testbed at image build"
    )


def detect_format(row: dict[str, Any]) -> Format:
    """Which dataset a row comes from, by the columns only that dataset has."""
    if "expected_output_json" in row or ("docker_image" in row and "repo_name" in row):
        return "r2e-gym"
    if "test_patch" not in row and "image_name" in row and "patch" in row:
        return "swe-smith"
    if row.get("repo") in SWE_GYM_REPOS:
        return "swe-gym"
    return "swe-bench"


def load_swe_bench(path: Path | str, *, ids: list[str] | None = None) -> Task:
    """The task of the rows in `path` (JSON list or JSONL), or of the rows in `ids`.

    A malformed row raises ConfigError naming the file, the line, the instance and the field.
    """
    file = regular_file(Path(path), what="rows file").resolve()
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    pairs = _rows(file, data)
    formats = {detect_format(row) for _, row in pairs if isinstance(row, dict)}
    if len(formats) > 1:
        raise ConfigError(
            f"{file}: rows of several datasets in one file ({', '.join(sorted(formats))})",
            fix="put each dataset's rows in a file of its own",
        )
    fmt: Format = formats.pop() if formats else "swe-bench"
    instances = [_instance(row, f"{file}{where}", fmt) for where, row in pairs]
    seen: set[str] = set()
    for instance in instances:
        if instance.id in seen:
            raise ConfigError(f"{file}: instance {instance.id} appears twice")
        seen.add(instance.id)
    if ids is not None:
        unknown = [i for i in ids if i not in seen]
        if unknown:
            names = [i.id for i in instances]
            listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise ConfigError(
                f"{file}: no instance {', '.join(unknown)}", fix=f"its instances: {listed}"
            )
        instances = [i for i in instances if i.id in ids]
    if fmt != "r2e-gym" and instances and needs_swebench(instances):
        require_swebench()
    repo_field = "repo_name" if fmt == "r2e-gym" else "repo"
    spec = TaskSpec(
        name=re.sub(r"[^\w.-]+", "-", f"{fmt}-{file.stem}"),
        description=f"{fmt} instances from {file.name}",
        sandbox=SandboxConfig(workdir=WORKDIR, memory_mb=4096),
        instances=file.name,
        prompt=PromptConfig(
            system=SYSTEM_PROMPT, instance=INSTANCE_PROMPT.format(workdir=WORKDIR, repo=repo_field)
        ),
        limits=EpisodeLimits(
            max_turns=50, max_new_tokens=2048, context_length=32768, tool_timeout=120.0
        ),
        # Long episodes stay in 32k: long outputs keep their head and tail; past 28k
        # tokens the policy summarizes its work and continues in a new segment.
        context=ContextPolicy(
            observation_tokens=2048, history="summarize", budget_tokens=28000, keep_turns=2
        ),
        # Graded by SweBenchEnv.grade (a fresh container per grade); this is never called.
        grader=PythonGrader(
            type="python",
            function=f"{__name__}:graded_by_env",
            timeout=TEST_TIMEOUT_S + 300,
            network=True,  # the harness's eval script reinstalls the repository
        ),
    )
    digest = hashlib.sha256(data).hexdigest()[:12]
    return Task(
        spec=spec,
        path=str(file),
        base_dir=str(file.parent),
        instances=instances,
        hash=digest,
        env="agentrl.tasks.swe.env:SweBenchEnv",
        format=fmt,
    )


def graded_by_env(sandbox: Sandbox, instance: Instance) -> float:
    raise GraderError("SWE-bench-style rows are graded by SweBenchEnv, not by this function")


def _rows(file: Path, data: bytes) -> list[tuple[str, object]]:
    """(where, row) pairs: where is `:N` (a JSONL line) or `: row N` (of a JSON list)."""
    text = data.decode(errors="replace")
    if file.suffix == ".json" or text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(rows, list):
            raise ConfigError(f"{file}: expected a JSON list of rows")
        return [(f": row {i}", row) for i, row in enumerate(rows, 1)]
    pairs: list[tuple[str, object]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                pairs.append((f":{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{file}:{number}: not valid JSON: {exc.msg}") from None
    return pairs


def instance_id(row: dict[str, Any], fmt: Format) -> str | None:
    """The row's id; R2E-Gym rows have none, so theirs is `<repo_name>__<commit_hash[:12]>`."""
    if fmt == "r2e-gym" and not row.get("instance_id"):
        repo, commit = row.get("repo_name"), row.get("commit_hash") or ""
        if isinstance(repo, str) and isinstance(commit, str) and repo:
            return f"{repo}__{commit[:12]}" if commit else repo
        return None
    name = row.get("instance_id")
    return name if isinstance(name, str) and name.strip() else None


def _instance(row: object, where: str, fmt: Format) -> Instance:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    name = instance_id(row, fmt)
    if name is None:
        field = "repo_name" if fmt == "r2e-gym" else "instance_id"
        raise ConfigError(f"{where}: {field}: missing or not a non-empty string")
    label = f"{where}: {fmt} instance {name}"
    for key in REQUIRED[fmt]:
        if key not in row:
            raise ConfigError(
                f"{label}: {key}: missing", fix=f"{fmt} rows need " + ", ".join(REQUIRED[fmt])
            )
    for key in STRINGS:
        if key in row and not isinstance(row[key], str | type(None)):
            raise ConfigError(f"{label}: {key}: expected a string, got {type(row[key]).__name__}")
    instance = Instance(id=name, fields=dict(row))
    if fmt == "r2e-gym":
        try:
            expected = json.loads(str(row["expected_output_json"]))
        except ValueError:
            raise ConfigError(f"{label}: expected_output_json: not JSON") from None
        if not isinstance(expected, dict) or not expected:
            raise ConfigError(f"{label}: expected_output_json: not a non-empty JSON object")
        return instance
    if fmt != "swe-smith" and not str(row["test_patch"]).strip():
        raise ConfigError(f"{label}: test_patch: empty")
    try:
        tests = listed_tests("FAIL_TO_PASS", instance) + listed_tests("PASS_TO_PASS", instance)
    except GraderError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if not tests:
        raise ConfigError(f"{label}: FAIL_TO_PASS: lists no tests (nor does PASS_TO_PASS)")
    if row.get("source") is not None:
        try:
            source = Source.model_validate(row["source"])
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(["source", *map(str, first["loc"])])
            raise ConfigError(f"{label}: {field}: {first['msg']}") from None
        if source.sdist is not None and not _SDIST.match(source.sdist):
            raise ConfigError(f"{label}: source.sdist: {source.sdist!r} is not NAME==VERSION")
    return instance
