"""SWE-bench-style rows, loaded as published and graded as their official harnesses grade.

A file of rows (a JSON list, or JSONL) becomes one Task with an Instance per row. The
format is detected from the rows and said by `agentrl validate`:

- `swe-bench`: SWE-bench, Lite, Verified rows (FAIL_TO_PASS/PASS_TO_PASS as JSON text),
  with or without the `image`/`eval_script`/`log_parser`/`eval_type` columns the 2026
  datasets carry; agentrl's own rows add `source` (an sdist to build the image from).
- `swe-gym`: SWE-Gym rows (the same columns, test lists as lists, SWE-Gym's repositories).
- `swe-smith`: SWE-smith rows: `patch` introduces the bug; no test_patch; `image_name`.
- `r2e-gym`: R2E-Gym rows: `docker_image`, hidden tests in the image, `expected_output_json`.

The agent's sandbox starts from the instance's image, prepared once per image
(`prepare_image`): the repository at /testbed keeps no history after the state the
agent starts from (no later commits, branches, remotes, reflog or tags that leak the
fix), that state is tagged `agentrl-base`, and for SWE-smith the bug is applied and
its failing tests removed; for R2E-Gym the hidden tests are removed.

EVAL grades the agent's work the way each harness does: the agent's changes are taken
as a patch (`git diff agentrl-base`, binary-safe) from its sandbox, and applied in a
fresh container from the instance's image. Changes to test files (those of test_patch,
those that hold the FAIL_TO_PASS/PASS_TO_PASS tests, any conftest.py) are dropped
first and listed as `tampered` in the evidence. Then:

- swe-bench / swe-gym: the harness's eval script runs (the row's own `eval_script`, or
  the one the classic harness generates: reset the test files, apply test_patch, run the
  repository's test command on the test files between the output markers); the log is
  parsed and graded by the official `swebench` package (`get_logs_eval`,
  `get_eval_tests_report`, `get_resolution_status`): resolved is reward 1.0.
- swe-smith: the bug is applied to the clean repository, then the patch; the test files
  are restored; the profile's verbose pytest runs on the F2P and P2P files.
- r2e-gym: the hidden tests go where R2E-Gym's runtime puts them; `run_tests.sh` runs;
  reward 1.0 when every parsed status equals `expected_output_json`.

Instance images are looked up under the names each harness gives them (the row's own,
the hub name, the locally built name); agentrl's own rows can build theirs from a
PyPI sdist (`source`) or a local `repo_archive`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from docker.errors import ImageNotFound
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import ConfigError, GraderError, ImageBuildError, SandboxError
from agentrl.inference.embedded import cache_root
from agentrl.sandbox.base import ExecRequest, Sandbox, SandboxProvider
from agentrl.sandbox.images import ImageInfo, build_recipe, docker_client, folder_hash
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.graders import (
    DidNotRun,
    Evidence,
    Grade,
    check_collected,
    listed_tests,
    ran,
    tail,
    truncate,
)
from agentrl.tasks.spec import (
    DEFAULT_IMAGE,
    EpisodeLimits,
    Instance,
    PromptConfig,
    PythonGrader,
    SandboxConfig,
    Task,
    TaskSpec,
)
from agentrl.textfile import regular_file

Format = Literal["swe-bench", "swe-gym", "swe-smith", "r2e-gym"]

WORKDIR = "/testbed"
BASE_TAG = "agentrl-base"
"""Tags the state the agent starts from; its changes are `git diff agentrl-base`."""
DEFAULT_TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
CONDA = "if [ -f /opt/miniconda3/bin/activate ]; then . /opt/miniconda3/bin/activate testbed; fi; "
START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
PATCH = "/tmp/agentrl-patch.diff"
EVAL_SCRIPT = "/eval.sh"
APPLY_COMMANDS = (  # the harness's order; each retry starts from a clean tree
    "git apply --verbose",
    "git apply --verbose --3way",
    "git apply --verbose --reject",
    "patch --batch --forward --fuzz=5 -p1 -i",
)
TEST_TIMEOUT_S = 1800.0
PATCH_TIMEOUT_S = 120.0
MAX_PATCH_BYTES = 50 << 20
SDIST_TIMEOUT_S = 300.0
NON_TEST_EXTS = (
    *(".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml"),
    ".toml",
)
"""Files of test_patch that are no test directives (the harness's list, `csv` included)."""

# The classic harness's rules per repository (swebench 4.1's MAP_REPO_VERSION_TO_SPECS and
# MAP_REPO_TO_PARSER; SWE-Gym's fork for its repositories): the test command, the log
# parser, the install step its eval script repeats, extra commands; `_classic_spec` applies
# the version differences.
_PYTEST, _EDITABLE = "pytest -rA", "python -m pip install -e ."


@dataclass(frozen=True)
class ClassicSpec:
    test_cmd: str
    parser: str
    install: str | None = _EDITABLE
    eval_commands: tuple[str, ...] = ()


CLASSIC: dict[str, ClassicSpec] = {
    "astropy/astropy": ClassicSpec(
        _PYTEST, "parse_log_astropy", "python -m pip install -e .[test] --verbose"
    ),
    "django/django": ClassicSpec(
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1", "parse_log_django"
    ),
    "marshmallow-code/marshmallow": ClassicSpec(
        _PYTEST, "parse_log_marshmallow", "python -m pip install -e '.[dev]'"
    ),
    "matplotlib/matplotlib": ClassicSpec(_PYTEST, "parse_log_matplotlib"),
    "mwaskom/seaborn": ClassicSpec(
        "pytest --no-header -rA", "parse_log_seaborn", f"{_EDITABLE}[dev]"
    ),
    "pallets/flask": ClassicSpec(_PYTEST, "parse_log_flask"),
    "psf/requests": ClassicSpec(_PYTEST, "parse_log_requests", "python -m pip install ."),
    "pvlib/pvlib-python": ClassicSpec(_PYTEST, "parse_log_pvlib", f"{_EDITABLE}[all]"),
    "pydata/xarray": ClassicSpec(_PYTEST, "parse_log_xarray"),
    "pydicom/pydicom": ClassicSpec(_PYTEST, "parse_log_pydicom"),
    "pylint-dev/astroid": ClassicSpec(_PYTEST, "parse_log_astroid"),
    "pylint-dev/pylint": ClassicSpec(_PYTEST, "parse_log_pylint"),
    "pytest-dev/pytest": ClassicSpec(_PYTEST, "parse_log_pytest"),
    "pyvista/pyvista": ClassicSpec(_PYTEST, "parse_log_pyvista"),
    "scikit-learn/scikit-learn": ClassicSpec(
        _PYTEST,
        "parse_log_scikit",
        "python -m pip install -v --no-use-pep517 --no-build-isolation -e .",
    ),
    "sqlfluff/sqlfluff": ClassicSpec(_PYTEST, "parse_log_sqlfluff"),
    "sphinx-doc/sphinx": ClassicSpec(
        "tox --current-env -epy39 -v --", "parse_log_sphinx", f"{_EDITABLE}[test]"
    ),
    "sympy/sympy": ClassicSpec(
        "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
        "parse_log_sympy",
    ),
}
SWE_GYM: dict[str, ClassicSpec] = {  # SWE-Gym's fork (its install steps are not known here)
    "getmoto/moto": ClassicSpec("pytest -n0 -rA", "parse_log_pytest", None),
    "conan-io/conan": ClassicSpec("pytest -n0 -rA", "parse_log_pytest", None),
    "dask/dask": ClassicSpec("pytest -n0 -rA  --color=no", "parse_log_pytest", None),
    "Project-MONAI/MONAI": ClassicSpec("pytest -rA ", "parse_log_pytest", None),
    "iterative/dvc": ClassicSpec(_PYTEST, "parse_log_pytest", None),
    "bokeh/bokeh": ClassicSpec("pytest -rA -n0", "parse_log_pytest", None),
    "modin-project/modin": ClassicSpec("pytest -n0 -rA", "parse_log_pytest", None),
    "pydantic/pydantic": ClassicSpec(
        "pytest -rA --tb=short -vv -o console_output_style=classic --no-header",
        "parse_log_pytest",
        None,
    ),
    "pandas-dev/pandas": ClassicSpec("pytest -rA --tb=long", "parse_log_pytest", None),
    "facebookresearch/hydra": ClassicSpec("pytest -rA --tb=long", "parse_log_pytest", None),
    "python/mypy": ClassicSpec("pytest -n0 -rA -k", "parse_log_pytest", None),
}
SWE_GYM_REPOS = frozenset(SWE_GYM)
_DJANGO_LOCALE = (
    *("export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8"),
    *("export PYTHONIOENCODING=utf8", "export LANGUAGE=en_US:en"),
)
_DJANGO_LOCALE_GEN = (
    "sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen",
    *("export LANG=en_US.UTF-8", "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8"),
)
SWE_SMITH_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
R2E_TESTS, R2E_RUNNER = "/r2e_tests", "/testbed/run_tests.sh"
_SMITH_LINE = re.compile(r"^(\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL)\b")
_SDIST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
_GIT_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

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


# -- loading ------------------------------------------------------------------------------


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
    if fmt != "r2e-gym" and instances and not all(_own_row(i) for i in instances):
        _require_swebench()
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
        env="agentrl.tasks.swe_bench:SweBenchEnv",
        format=fmt,
    )


def graded_by_env(sandbox: Sandbox, instance: Instance) -> float:
    raise GraderError("SWE-bench-style rows are graded by SweBenchEnv, not by this function")


def _require_swebench() -> None:
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"grading SWE-bench rows needs the official swebench package ({exc})",
            fix="pip install 'agentrl[swebench]'",
        ) from None


def _own_row(instance: Instance) -> bool:
    """agentrl's own rows (a `source` to build from, no harness repository) need no swebench."""
    return instance.fields.get("source") is not None and _classic_spec(instance.fields) is None


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


# -- images -------------------------------------------------------------------------------


def standard_image_name(instance_id: str) -> str:
    """The name SWE-bench publishes an instance's evaluation image under (Docker Hub)."""
    key = instance_id.lower().replace("__", "_1776_")
    return f"swebench/sweb.eval.x86_64.{key}:latest"


def image_names(instance: Instance, fmt: Format) -> list[str]:
    """Where each harness looks for an instance's image, in order: the row's own name, the
    hub name, the name a local build of the harness gives it."""
    fields, iid = instance.fields, instance.id
    named = [str(fields[k]) for k in ("image", "image_name", "docker_image") if fields.get(k)]
    if fmt == "swe-gym":  # OpenHands' rule for SWE-Gym's images
        named.append(f"xingyaoww/sweb.eval.x86_64.{iid.replace('__', '_s_')}".lower())
    if fmt in ("swe-bench", "swe-gym"):
        named += [standard_image_name(iid), f"sweb.eval.x86_64.{iid.lower()}:latest"]
    return list(dict.fromkeys(n if ":" in n.rsplit("/", 1)[-1] else f"{n}:latest" for n in named))


def find_or_build_image(instance: Instance, base_dir: Path, fmt: Format = "swe-bench") -> str:
    """The instance's image: present locally under one of its names, or built from its
    source (agentrl's rows); ImageBuildError naming every name tried otherwise."""
    names = image_names(instance, fmt)
    for name in names:
        if _present(name):
            return name
    fields = instance.fields
    if fields.get("source") is None and not fields.get("repo_archive"):
        tried = ", ".join(names)
        raise ImageBuildError(
            f"instance {instance.id}: no image under any of its names ({tried}), and the row "
            "has no `source` or `repo_archive` to build one from",
            fix=f"docker pull {names[0]} (or docker load it, or `docker tag` a locally built "
            "image with one of those names), or add a `source` to the row",
        )
    return build_instance_image(instance, base_dir).tag


def build_instance_image(instance: Instance, base_dir: Path) -> ImageInfo:
    """Build (once per recipe hash) the base image plus the instance's repository at /testbed."""
    folder = prepare_context(instance, base_dir)
    slug = re.sub(r"[^a-z0-9_.-]+", "-", instance.id.lower()).strip(".-_") or "instance"
    return build_recipe(folder, f"agentrl/swe-{slug}:{folder_hash(folder)}")


def prepare_context(instance: Instance, base_dir: Path) -> Path:
    """The instance's build folder in the cache: a Dockerfile and the source archive."""
    fields = instance.fields
    source = Source.model_validate(fields.get("source") or {})
    if fields.get("repo_archive"):
        archive = base_dir / str(fields["repo_archive"])
        if not archive.is_file():
            raise ConfigError(f"instance {instance.id}: repo_archive {archive} does not exist")
    elif source.sdist:
        archive = fetch_sdist(source.sdist, source.sha256)
    else:
        raise ConfigError(f"instance {instance.id}: source: give `sdist` (or a repo_archive)")
    folder = cache_root() / "swe_bench" / "build" / instance.id
    folder.mkdir(parents=True, exist_ok=True)
    _write_if_changed(folder / "src.tar.gz", archive.read_bytes())
    dockerfile = _source_dockerfile(instance, source, strip=_single_top_folder(archive))
    _write_if_changed(folder / "Dockerfile", dockerfile.encode())
    return folder


def prepare_image(image: str, instance: Instance, fmt: Format) -> str:
    """The image the agent starts from, built once per (image, recipe) from `image`: the
    repository without history after the agent's starting state (tagged agentrl-base);
    SWE-smith's bug applied and its failing tests removed; R2E-Gym's hidden tests removed."""
    client = docker_client()
    try:
        image_id = str(client.images.get(image).id)
    finally:
        client.close()
    key = f"{fmt}-{instance.id}-{image_id}"
    folder = cache_root() / "swe_bench" / "prepare" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    files = {"prepare.sh": _prepare_script(instance, fmt)}
    if fmt == "swe-smith":
        files["bug.patch"] = str(instance.fields["patch"])
    for name, text in files.items():
        _write_if_changed(folder / name, text.encode())
    copies = "".join(f"COPY {name} /tmp/agentrl-prepare/{name}\n" for name in files)
    dockerfile = (
        f"FROM {image_id}\n{copies}"
        'RUN ["bash", "/tmp/agentrl-prepare/prepare.sh"]\n'
        'RUN ["rm", "-rf", "/tmp/agentrl-prepare"]\n'
    )
    _write_if_changed(folder / "Dockerfile", dockerfile.encode())
    slug = re.sub(r"[^a-z0-9_.-]+", "-", instance.id.lower()).strip(".-_") or "instance"
    return build_recipe(folder, f"agentrl/swe-start-{slug}:{folder_hash(folder)}").tag


def _prepare_script(instance: Instance, fmt: Format) -> str:
    """Bash, run at image build: the starting state, then no history beyond it."""
    lines = ["set -euo pipefail", f"cd {WORKDIR}", "git config --global --add safe.directory '*'"]
    lines += ["export GIT_AUTHOR_DATE=2000-01-01T00:00:00Z GIT_COMMITTER_DATE=2000-01-01T00:00:00Z"]
    lines += ["export GIT_AUTHOR_NAME=agentrl GIT_AUTHOR_EMAIL=agentrl@localhost"]
    lines += ["export GIT_COMMITTER_NAME=agentrl GIT_COMMITTER_EMAIL=agentrl@localhost"]
    if fmt == "swe-smith":  # offline: main + the bug, its failing tests gone, as one commit
        doomed = " ".join(shlex.quote(f) for f in files_of_tests(instance, fail_only=True)) or '""'
        lines += [
            "git apply /tmp/agentrl-prepare/bug.patch",
            f"rm -f -- {doomed}",
            "git checkout -q --orphan agentrl-start && git add -A"
            ' && git commit -qm "Initial commit"',
        ]
    if fmt == "r2e-gym":  # the hidden tests stay in the grading image only
        lines += [f"rm -rf {R2E_TESTS} {R2E_RUNNER} /root/r2e_tests /root/run_tests.sh"]
    lines += [
        # Keep HEAD (on its branch, if any) and tags older than HEAD that it contains;
        # delete every other ref (later commits, other branches, remotes, stash).
        "head=$(git rev-parse HEAD); branch=$(git symbolic-ref -q --short HEAD || true)",
        "ts=$(git show -s --format=%ct HEAD)",
        "git for-each-ref --format='%(refname)' | while read -r ref; do",
        '  case "$ref" in refs/tags/*)',
        '    c=$(git rev-list -n 1 "$ref")',
        '    if [ "$(git show -s --format=%ct "$c")" -le "$ts" ] &&'
        ' git merge-base --is-ancestor "$c" "$head"; then continue; fi;;',
        "  esac",
        '  git update-ref -d "$ref"',
        "done",
        'if [ -n "$branch" ]; then git update-ref "refs/heads/$branch" "$head"; fi',
        'for r in $(git remote); do git remote remove "$r"; done',
        "git stash clear 2>/dev/null || true",
        f'git tag -f {BASE_TAG} "$head" >/dev/null',
        "rm -f .git/FETCH_HEAD .git/ORIG_HEAD",
        "git reflog expire --expire=now --all",
        "git gc --prune=now --quiet",
        # Nothing is left that HEAD does not contain.
        'test -z "$(git rev-list --all --not "$head")"',
    ]
    return "\n".join(lines) + "\n"


def fetch_sdist(requirement: str, sha256: str | None = None) -> Path:
    """The sdist of NAME==VERSION from the cache, downloaded with pip the first time."""
    folder = cache_root() / "swe_bench" / "sdists" / requirement.replace("==", "-")
    found = sorted(folder.glob("*.tar.gz"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            cmd += ["--disable-pip-version-check", "--dest", tmp, requirement]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=SDIST_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ImageBuildError(f"pip download {requirement} timed out") from None
            if done.returncode != 0:
                last = " | ".join(done.stderr.strip().splitlines()[-3:])
                raise ImageBuildError(
                    f"pip download {requirement} failed: {last[-400:]}",
                    fix="check that PyPI answers, and that the name and version exist",
                )
            got = sorted(Path(tmp).glob("*.tar.gz"))
            if len(got) != 1:
                names = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
                raise ImageBuildError(f"pip download {requirement} gave {names}, not one .tar.gz")
            got[0].replace(folder / got[0].name)  # atomic: a reader never sees half a file
        found = sorted(folder.glob("*.tar.gz"))
    path = found[0]
    if sha256 is not None and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        raise ImageBuildError(
            f"{path} does not have the sha256 the row names ({sha256})",
            fix=f"delete {path.parent} to download it again, or fix the row's source.sha256",
        )
    return path


# -- the environment ----------------------------------------------------------------------


class SweBenchEnv(TaskEnv):
    """TaskEnv whose sandboxes start from each instance's prepared image and whose grades
    come from a fresh container with only the agent's patch carried over."""

    def __init__(self, task: Task, provider: SandboxProvider, run_id: str) -> None:
        super().__init__(task, provider, run_id)
        self.format: Format = (
            detect_format(task.instances[0].fields) if task.instances else ("swe-bench")
        )
        self._images: dict[str, tuple[str, str]] = {}  # id -> (found image, prepared image)
        self._locks: dict[str, asyncio.Lock] = {}

    async def instance_image(self, instance: Instance) -> str:
        return (await self._image_pair(instance))[1]

    async def _image_pair(self, instance: Instance) -> tuple[str, str]:
        if self.provider.name != "docker":
            raise ConfigError(
                f"instance {instance.id}: SWE-bench instances need the docker provider "
                f"(the repository lives in the image at {WORKDIR})",
                fix="run with the docker sandbox provider",
            )
        async with self._locks.setdefault(instance.id, asyncio.Lock()):
            if instance.id not in self._images:
                base_dir, fmt = Path(self.task.base_dir), self.format
                found = await asyncio.to_thread(find_or_build_image, instance, base_dir, fmt)
                ready = await asyncio.to_thread(prepare_image, found, instance, fmt)
                self._images[instance.id] = (found, ready)
            return self._images[instance.id]

    async def grade(self, sandbox: Sandbox, instance: Instance) -> Grade:
        """The agent's patch, graded in a fresh container as the format's harness grades."""
        started = time.monotonic()
        # R2E-Gym's hidden tests are no change of the agent's (its runtime's own rule)
        hidden = ("r2e_tests", "run_tests.sh") if self.format == "r2e-gym" else ()
        patch = await agent_patch(sandbox, hidden)
        kept, tampered = drop_test_changes(patch, instance, self.format)
        found, ready = await self._image_pair(instance)
        spec = await self.spec(instance, f"{sandbox.spec.name or instance.id}-grade")
        if self.format in ("swe-smith", "r2e-gym"):  # graded from the unprepared image
            spec = spec.model_copy(update={"image": found})
        fresh = await self.provider.start(spec)
        try:
            online = await self.go_online(fresh)
            graded = await grade_patch(fresh, instance, self.format, kept)
        finally:
            await fresh.close()
        graded.evidence.notes[:0] = online
        graded.evidence.tampered = tampered
        components = {**graded.components, "tampered_tests": len(tampered)}
        return graded.model_copy(
            update={"components": components, "seconds": time.monotonic() - started}
        )

    async def run_oracle(self, sandbox: Sandbox, instance: Instance) -> str:
        """The reference solution in the agent's sandbox: the gold patch (SWE-smith: the bug
        patch reversed)."""
        fields = instance.fields
        if self.format == "r2e-gym" or not fields.get("patch"):
            raise ConfigError(f"instance {instance.id}: the row has no reference patch")
        await sandbox.write_file("/tmp/agentrl-gold.diff", str(fields["patch"]).encode())
        reverse = " -R" if self.format == "swe-smith" else ""
        done = await sandbox.exec(
            ExecRequest(command=f"git apply -v{reverse} /tmp/agentrl-gold.diff", timeout=120)
        )
        if done.exit_code != 0:
            raise SandboxError(f"the gold patch does not apply: {tail(done.output)}")
        return done.output


# -- grading ------------------------------------------------------------------------------


async def agent_patch(sandbox: Sandbox, exclude: tuple[str, ...] = ()) -> str:
    """Everything the agent changed in /testbed since agentrl-base, as a binary git diff.

    Git runs with hooks, external diff drivers and filters of the repository's own config
    turned off; a repository the agent broke gives a DidNotRun with git's words."""
    safe = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c diff.external="
    base = (
        f"base=$(git rev-parse -q --verify {BASE_TAG}^{{commit}} || git rev-parse HEAD) && "
        f"{safe} add -A -- . {' '.join(shlex.quote(f':(exclude){p}') for p in exclude)} && "
        f'{safe} diff --cached --binary --no-color --no-ext-diff --no-textconv "$base" > {PATCH}'
    )
    done = await sandbox.exec(ExecRequest(command=base, timeout=PATCH_TIMEOUT_S))
    if done.exit_code != 0:
        evidence = ran(done, "git diff", "swe-bench", base)
        raise DidNotRun(f"cannot read the agent's changes: {tail(done.output)}", evidence)
    data = await sandbox.read_file(PATCH)
    if len(data) > MAX_PATCH_BYTES:
        evidence = Evidence(grader="swe-bench", command=base, notes=[f"{len(data)} bytes"])
        raise DidNotRun(f"the agent's changes are {len(data) >> 20} MiB", evidence)
    return data.decode(errors="surrogateescape")


def files_of_tests(instance: Instance, *, fail_only: bool = False) -> list[str]:
    """The files that hold the instance's FAIL_TO_PASS (and PASS_TO_PASS) tests."""
    ids = listed_tests("FAIL_TO_PASS", instance)
    if not fail_only:
        ids += listed_tests("PASS_TO_PASS", instance)
    files = (t.split("::", 1)[0] for t in ids if "::" in t)
    return list(dict.fromkeys(f for f in files if f.endswith(".py")))


def drop_test_changes(patch: str, instance: Instance, fmt: Format) -> tuple[str, list[str]]:
    """`patch` without its changes to test files (test_patch's files, the files of the listed
    tests, any conftest.py, R2E's r2e_tests/); the paths dropped."""
    guarded = set(files_of_tests(instance)) | set(
        patch_files(str(instance.fields.get("test_patch", "")))
    )
    kept, dropped = [], []
    for chunk in re.split(r"(?=^diff --git )", patch, flags=re.MULTILINE):
        header = _GIT_HEADER.findall(chunk.split("\n", 1)[0])
        paths = set(header[0]) if header else set()
        if any(
            p in guarded or p.rsplit("/", 1)[-1] == "conftest.py" or p.startswith("r2e_tests/")
            for p in paths
        ):
            dropped += sorted(paths)
        else:
            kept.append(chunk)
    return "".join(kept), list(dict.fromkeys(dropped))


async def apply_patch(sandbox: Sandbox, patch: str) -> str | None:
    """Apply the agent's patch at /testbed as the harness does (each fallback from a clean
    tree; a patch the tree already holds counts as applied); the command that worked, ""
    for an empty patch, None if none did."""
    if not patch.strip():
        return ""
    await sandbox.write_file(PATCH, patch.encode(errors="surrogateescape"))
    for attempt, command in enumerate(APPLY_COMMANDS):
        if attempt:
            reset = "git checkout -- . ; git clean -fdq"
            await sandbox.exec(ExecRequest(command=reset, timeout=PATCH_TIMEOUT_S))
        done = await sandbox.exec(
            ExecRequest(command=f"{command} {PATCH}", timeout=PATCH_TIMEOUT_S)
        )
        if done.exit_code == 0:
            return command
    check = f"git apply --check --reverse {PATCH}"
    done = await sandbox.exec(ExecRequest(command=check, timeout=PATCH_TIMEOUT_S))
    return f"{check} (already applied)" if done.exit_code == 0 else None


async def grade_patch(sandbox: Sandbox, instance: Instance, fmt: Format, patch: str) -> Grade:
    """Grade `patch` in `sandbox`, a fresh container from the instance's image."""
    started = time.monotonic()
    if fmt == "swe-smith":  # the clean repository plus the bug is what the patch fixes
        await sandbox.write_file("/tmp/agentrl-bug.diff", str(instance.fields["patch"]).encode())
        bug = await sandbox.exec(
            ExecRequest(command="git apply /tmp/agentrl-bug.diff", timeout=PATCH_TIMEOUT_S)
        )
        if bug.exit_code != 0:
            evidence = ran(bug, "applying the bug patch", fmt, "git apply")
            raise DidNotRun(f"the row's bug patch does not apply: {tail(bug.output)}", evidence)
    if fmt == "r2e-gym":  # where R2E-Gym's runtime puts the hidden tests
        setup = (
            f"mv {R2E_RUNNER} /root/run_tests.sh && mv {R2E_TESTS} /root/r2e_tests && "
            "ln -s /root/r2e_tests /testbed/r2e_tests"
        )
        done = await sandbox.exec(ExecRequest(command=setup, timeout=60))
        if done.exit_code != 0:
            evidence = ran(done, "moving R2E-Gym's tests", fmt, setup)
            raise DidNotRun(f"the image holds no R2E-Gym tests: {tail(done.output)}", evidence)
    how = await apply_patch(sandbox, patch)
    if how is None:  # the agent's doing: unresolved, as every harness counts it
        evidence = Evidence(grader=fmt, notes=["the agent's patch does not apply"])
        evidence.output = truncate(patch)
        components = {"resolved": False, "patch_applied": False}
        return Grade(reward=0.0, components=components, evidence=evidence, seconds=0.0)
    if fmt == "r2e-gym":
        graded = await _grade_r2e(sandbox, instance)
    elif fmt == "swe-smith":
        graded = await _grade_smith(sandbox, instance)
    else:
        graded = await _grade_swebench(sandbox, instance)
    graded.evidence.notes.insert(0, f"agent's patch: {how or 'empty'}")
    components = {**graded.components, "patch_applied": True}
    return graded.model_copy(
        update={"components": components, "seconds": time.monotonic() - started}
    )


async def _grade_swebench(sandbox: Sandbox, instance: Instance) -> Grade:
    """The harness's eval script; its log parsed and graded by the swebench package."""
    from swebench.harness.grading import get_logs_eval

    spec = eval_spec(instance)
    await sandbox.write_file(EVAL_SCRIPT, spec.eval_script.encode())
    command = f"/bin/bash {EVAL_SCRIPT}"
    result = await sandbox.exec(ExecRequest(command=command, timeout=TEST_TIMEOUT_S))
    evidence = ran(result, "the eval script", "swe-bench", command)
    with tempfile.NamedTemporaryFile("w", suffix=".log", encoding="utf-8") as log:
        log.write(result.output)
        log.flush()
        status_map, found = get_logs_eval(spec, log.name)
    if not found:
        evidence.tests = {t: "MISSING" for t in spec.FAIL_TO_PASS + spec.PASS_TO_PASS}
        raise DidNotRun(
            f"the eval script's log (exit {result.exit_code}) holds no gradable test results "
            f"({spec.log_parser})",
            evidence,
        )
    graded = resolution(spec.FAIL_TO_PASS, spec.PASS_TO_PASS, status_map, evidence, spec.eval_type)
    if "MISSING" in evidence.tests.values():  # tests that never ran: were they uncollectable?
        check_collected(result.output, evidence)
    return graded


def _statuses(
    report: dict[str, dict[str, list[str]]], status_map: dict[str, str]
) -> dict[str, str]:
    """Each listed test's status as the parser read it (MISSING: not in the log)."""
    statuses: dict[str, str] = {}
    for outcome in report.values():
        for key, verdict in (("success", "PASSED"), ("failure", "FAILED")):
            for test in outcome.get(key, []):
                statuses[test] = status_map.get(test, verdict if key == "success" else "MISSING")
    return statuses


def eval_spec(instance: Instance) -> Any:
    """The swebench TestSpec of a row: its own eval script (2026 datasets), or the one the
    classic harness generates for it."""
    from swebench.harness.utils import make_test_spec

    fields = instance.fields
    if fields.get("eval_script"):
        row = {**fields, "image": fields.get("image") or ""}
        row.setdefault("log_parser", _classic(fields)[1])
        row.setdefault("eval_type", "pass_and_fail")
        row.setdefault("version", "")
        return make_test_spec(row)
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", *classic_eval_script(instance)])
    row = {
        **fields,
        "image": "",
        "version": fields.get("version") or "",
        "eval_script": script,
        "log_parser": _classic(fields)[1],
        "eval_type": "pass_and_fail",
    }
    return make_test_spec(row)


def _classic_spec(fields: dict[str, Any]) -> ClassicSpec | None:
    """The classic harness's spec of a row's repository and version (None: no harness
    repository, e.g. agentrl's own rows)."""
    repo, version = str(fields.get("repo", "")), str(fields.get("version", ""))
    spec = CLASSIC.get(repo) or SWE_GYM.get(repo)
    if spec is None:
        return None
    major = _version(version)
    if repo == "django/django":
        install = "python setup.py install" if major < (3, 0) else _EDITABLE
        extra = _DJANGO_LOCALE if (1, 7) <= major < (3, 0) else ()
        extra = _DJANGO_LOCALE_GEN if (3, 0) <= major < (4, 0) else extra
        command = "./tests/runtests.py --verbosity 2" if version == "1.9" else spec.test_cmd
        return ClassicSpec(command, spec.parser, install, extra)
    if repo == "matplotlib/matplotlib" and major < (3, 0):
        return replace(spec, install="python setup.py build; python setup.py install")
    if repo == "matplotlib/matplotlib" and major >= (3, 8):
        return replace(spec, install='python -m pip install --no-build-isolation -e ".[dev]"')
    if repo == "mwaskom/seaborn" and major < (0, 12):
        return replace(spec, install=_EDITABLE)
    if repo == "astropy/astropy" and major < (3, 0):
        return replace(spec, test_cmd="pytest -rA -vv -o console_output_style=classic --tb=no")
    return spec


def _version(text: str) -> tuple[int, ...]:
    numbers = re.findall(r"\d+", text)
    return tuple(int(n) for n in numbers[:2]) or (0,)


def _classic(fields: dict[str, Any]) -> tuple[str, str]:
    """(test command, log parser) of a classic row: its own `test_cmd`, else the harness's."""
    spec = _classic_spec(fields)
    command = spec.test_cmd if spec else DEFAULT_TEST_CMD
    return str(fields.get("test_cmd") or command), spec.parser if spec else "parse_log_pytest"


def classic_eval_script(instance: Instance) -> list[str]:
    """The eval script the classic harness generates for a row (swebench 4.1's
    make_eval_script_list_py). agentrl's own rows (no harness repository) run the same
    steps without an install, from the tagged base when the upstream commit is unknown."""
    fields = instance.fields
    spec = _classic_spec(fields)
    base, test_patch = str(fields["base_commit"]), str(fields["test_patch"])
    files = " ".join(patch_files(test_patch, old=True))
    command, _ = _classic(fields)
    if fields.get("repo") == "python/mypy":  # SWE-Gym's mypy: the cases the test patch adds
        cases = re.findall(r"\[case ([^\]]+)\]", test_patch)
        test = f'{command} "{" or ".join(cases)}"'
    else:
        test = " ".join([command, *directives(instance)])
    if spec is None:
        base = f"$(git rev-parse -q --verify {base}^{{commit}} || echo {BASE_TAG})"
        activate = [CONDA.strip()]
    else:
        activate = ["source /opt/miniconda3/bin/activate", "conda activate testbed"]
    return [
        *activate,
        f"cd {WORKDIR}",
        *(spec.eval_commands if spec else ()),
        f"git config --global --add safe.directory {WORKDIR}",
        f"cd {WORKDIR}",
        "git status",
        "git show",
        f"git -c core.fileMode=false diff {base}",
        *(activate if spec else ()),
        *([spec.install] if spec and spec.install else []),
        f"git checkout {base} {files}",
        f"git apply -v - <<'EOF_114329324912'\n{test_patch}\nEOF_114329324912",
        f": '{START}'",
        test,
        f": '{END}'",
        f"git checkout {base} {files}",
    ]


def directives(instance: Instance) -> list[str]:
    """The test directives of the classic harness: test_patch's files, less non-test files;
    Django's as dotted module names."""
    paths = re.findall(r"diff --git a/.* b/(.*)", str(instance.fields["test_patch"]))
    paths = [p for p in paths if not any(p.endswith(ext) for ext in NON_TEST_EXTS)]
    if instance.fields.get("repo") == "django/django":
        paths = [p.removesuffix(".py").removeprefix("tests/").replace("/", ".") for p in paths]
    return paths


async def _grade_smith(sandbox: Sandbox, instance: Instance) -> Grade:
    """SWE-smith: the listed tests' files restored, the profile's verbose pytest on them."""
    files = files_of_tests(instance)
    restore = f"git checkout HEAD -- {' '.join(shlex.quote(f) for f in files)}" if files else "true"
    command = str(instance.fields.get("test_cmd") or SWE_SMITH_TEST_CMD)
    script = "\n".join(
        [
            CONDA.strip(),
            f"cd {WORKDIR}",
            restore,
            f": '{START}'",
            " ".join([command, *map(shlex.quote, files)]),
            f": '{END}'",
        ]
    )
    await sandbox.write_file(EVAL_SCRIPT, script.encode())
    run = f"/bin/bash {EVAL_SCRIPT}"
    result = await sandbox.exec(ExecRequest(command=run, timeout=TEST_TIMEOUT_S))
    evidence = ran(result, "the tests", "swe-smith", command)
    between = result.output.split(START, 1)[-1].split(END, 1)[0]
    status_map = {}
    for line in between.splitlines():
        match = _SMITH_LINE.match(line)
        if match:
            status_map[match.group(1)] = match.group(2)
    f2p, p2p = listed_tests("FAIL_TO_PASS", instance), listed_tests("PASS_TO_PASS", instance)
    if not status_map:
        evidence.tests = {t: "MISSING" for t in f2p + p2p}
        raise DidNotRun(f"the tests (exit {result.exit_code}) reported no results", evidence)
    return resolution(f2p, p2p, status_map, evidence)


def resolution(
    f2p: list[str],
    p2p: list[str],
    status_map: dict[str, str],
    evidence: Evidence,
    eval_type: str = "pass_and_fail",
) -> Grade:
    """The harness's verdict on parsed statuses: resolved (1.0) when every FAIL_TO_PASS and
    PASS_TO_PASS test passed, by swebench's rules (truncated ids, skips, missing tests)."""
    from swebench.harness.constants import FAIL_TO_PASS, PASS_TO_PASS, EvalType, ResolvedStatus
    from swebench.harness.grading import get_eval_tests_report, get_resolution_status

    wanted = {FAIL_TO_PASS: f2p, PASS_TO_PASS: p2p}
    report = get_eval_tests_report(status_map, wanted, eval_type=EvalType(eval_type))
    resolved = get_resolution_status(report) == ResolvedStatus.FULL.value
    evidence.tests = _statuses(report, status_map)
    components = {
        "resolved": resolved,
        "fail_to_pass": f"{len(report[FAIL_TO_PASS]['success'])}/{len(f2p)}",
        "pass_to_pass": f"{len(report[PASS_TO_PASS]['success'])}/{len(p2p)}",
    }
    return Grade(
        reward=1.0 if resolved else 0.0, components=components, evidence=evidence, seconds=0.0
    )


async def _grade_r2e(sandbox: Sandbox, instance: Instance) -> Grade:
    """R2E-Gym: run_tests.sh; reward 1.0 when the parsed statuses equal the expected ones."""
    command = "cd /testbed && bash /root/run_tests.sh"
    path = "PATH=/root/.venv/bin:/root/.local/bin:/testbed/.venv/bin:$PATH; "
    result = await sandbox.exec(ExecRequest(command=path + command, timeout=300))
    evidence = ran(result, "run_tests.sh", "r2e-gym", command)
    parsed = parse_r2e_log(result.output)
    expected = {
        k.split(" - ")[0]: v for k, v in json.loads(instance.fields["expected_output_json"]).items()
    }
    evidence.tests = parsed
    if not parsed:
        raise DidNotRun(f"run_tests.sh (exit {result.exit_code}) reported no results", evidence)
    matched = len(parsed) == len(expected) and all(parsed.get(k) == v for k, v in expected.items())
    differ = sorted(k for k in expected.keys() | parsed.keys() if parsed.get(k) != expected.get(k))
    if differ:
        evidence.notes.append(
            f"{len(differ)} tests differ from expected_output_json: {differ[:10]}"
        )
    components = {"resolved": matched, "tests_expected": len(expected), "tests_differ": len(differ)}
    return Grade(
        reward=1.0 if matched else 0.0, components=components, evidence=evidence, seconds=0.0
    )


def parse_r2e_log(log: str) -> dict[str, str]:
    """R2E-Gym's parse: after `short test summary info`, `Class.test` (no file) -> status."""
    text = _ANSI.sub("", log).replace("\r", "")
    if "short test summary info" not in text:
        return {}
    statuses: dict[str, str] = {}
    for line in text.split("short test summary info", 1)[1].splitlines():
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                key = ".".join(line.split("::")[1:]).split(" - ")[0].strip()
                if key:
                    statuses[key] = status
                break
    return statuses


def patch_files(diff: str, *, old: bool = False) -> list[str]:
    """The paths a diff touches: from its `diff --git` headers, else its `---`/`+++` pairs.

    `old`: only the `--- a/` side, as the harness's reset of test files reads them."""
    if old:
        return list(dict.fromkeys(re.findall(r"^--- a/(\S+)", diff, flags=re.MULTILINE)))
    paths = [p for pair in _GIT_HEADER.findall(diff) for p in pair]
    lines = diff.splitlines()
    if not paths:  # a plain unified diff: `---`, `+++`, then `@@` is a file header
        for old_line, new_line, hunk in zip(lines, lines[1:], lines[2:], strict=False):
            if (
                old_line.startswith("--- ")
                and new_line.startswith("+++ ")
                and hunk.startswith("@@")
            ):
                paths += [_strip_prefix(old_line[4:]), _strip_prefix(new_line[4:])]
    return list(dict.fromkeys(p for p in paths if p != "/dev/null"))


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    return path[2:] if path.startswith(("a/", "b/")) else path


def _source_dockerfile(instance: Instance, source: Source, *, strip: bool) -> str:
    upstream = f"{instance.fields['repo']} at {instance.fields['base_commit']}"
    origin = f"the PyPI sdist {source.sdist}" if source.sdist else "the row's repo_archive"
    steps = [
        f"mkdir -p {WORKDIR}",
        f"tar -xzf /tmp/src.tar.gz -C {WORKDIR} --no-same-owner"
        + (" --strip-components=1" if strip else ""),
        "rm /tmp/src.tar.gz",
        f"cd {WORKDIR}",
        "git init -q",
        "git add -A",
        "git -c user.name=agentrl -c user.email=agentrl@localhost commit -q --no-verify "
        + shlex.quote(f"-m{upstream}, from {origin}"),
        f"git tag {BASE_TAG}",
        "printf '__pycache__/\\n*.pyc\\n.pytest_cache/\\n' >> .git/info/exclude",
        *source.install,
    ]
    run = json.dumps(["bash", "-euo", "pipefail", "-c", "\n".join(steps)])
    return (
        f"FROM {DEFAULT_IMAGE}\n"
        "COPY src.tar.gz /tmp/src.tar.gz\n"
        "ENV GIT_AUTHOR_DATE=2000-01-01T00:00:00Z GIT_COMMITTER_DATE=2000-01-01T00:00:00Z\n"
        f"RUN {run}\n"
        f"WORKDIR {WORKDIR}\n"
    )


def _single_top_folder(archive: Path) -> bool:
    """Whether every member of the archive lies under one top folder (as in an sdist)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tops = {m.name.lstrip("./").split("/", 1)[0] for m in tar.getmembers()}
    except (tarfile.TarError, OSError) as exc:
        raise ImageBuildError(f"{archive} is not a .tar.gz archive: {exc}") from None
    tops.discard("")
    return len(tops) == 1


def _write_if_changed(path: Path, data: bytes) -> None:
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _present(image: str) -> bool:
    client = docker_client()
    try:
        client.images.get(image)
    except ImageNotFound:
        return False
    finally:
        client.close()
    return True
