"""SWE-bench rows, loaded as they are published, and graded like the official harness.

A file of rows (a JSON list, or JSONL) becomes one Task with an Instance per row; the
instance keeps every field of its row. The agent works in the repository at /testbed
and never sees `test_patch`. Each instance has its own image: the prebuilt SWE-bench
image the row names (`image_name`, else the standard `swebench/sweb.eval.x86_64.<id>`)
when it is present locally, otherwise one built on the base image from the row's
`source`: the library's sdist from PyPI (`source.sdist`, NAME==VERSION, downloaded once
into the cache) or a local `repo_archive`, committed to git at /testbed, then
`source.install` run. Built images are tagged by recipe hash, so each builds once.

EVAL, as the harness does it: restore the files `test_patch` touches to the base
commit, apply `test_patch` (`git apply`, else `patch --fuzz`), run the FAIL_TO_PASS and
PASS_TO_PASS tests with `pytest -rA`, parse the log (`graders.parse_pytest_log`);
resolved, and a reward of 1.0, when every listed test passed.
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
from pathlib import Path
from typing import Any

from docker.errors import ImageNotFound
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.errors import ConfigError, GraderError, ImageBuildError
from agentrl.inference.embedded import cache_root
from agentrl.sandbox.base import ExecRequest, Sandbox, SandboxProvider
from agentrl.sandbox.images import ImageInfo, build_recipe, docker_client, folder_hash
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.graders import PASSING, listed_tests, parse_pytest_log
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

WORKDIR = "/testbed"
BASE_TAG = "agentrl-base"
"""Tags the base commit in built images, whose commit id differs from the upstream one."""
REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
STRINGS = (
    *REQUIRED[:5],
    *("patch", "hints_text", "version", "environment_setup_commit", "created_at"),
    *("image_name", "repo_archive", "test_cmd"),
)
DEFAULT_TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
# Prebuilt SWE-bench images keep the project's environment in a conda env named testbed.
CONDA = "if [ -f /opt/miniconda3/bin/activate ]; then . /opt/miniconda3/bin/activate testbed; fi; "
EVAL_PATCH = "/tmp/agentrl-eval/test.patch"
APPLY_TIMEOUT_S = 120.0
TEST_TIMEOUT_S = 1500.0
SDIST_TIMEOUT_S = 300.0
_APPLIED = {0: "git apply", 3: "patch --fuzz"}
_SDIST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
_GIT_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)

SYSTEM_PROMPT = (
    "You are an expert software engineer fixing an issue in a Python repository. You work "
    "inside a sandboxed container without network access. Use the tools to explore the code, "
    "reproduce the problem, edit the source and check your fix; call finish when you are done."
)
INSTANCE_PROMPT = f"""<uploaded_files>
{WORKDIR}
</uploaded_files>
The repository {{repo}} is checked out in {WORKDIR}, a git repository at its base commit.
Consider the following issue:

<issue>
{{problem_statement}}
</issue>

Change the non-test files in {WORKDIR} so that the issue is resolved. Tests for it already
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


def load_swe_bench(path: Path | str, *, ids: list[str] | None = None) -> Task:
    """The task of the SWE-bench rows in `path` (JSON list or JSONL), or of the rows in `ids`.

    A malformed row raises ConfigError naming the file, the line, the instance and the field.
    """
    file = Path(path).resolve()
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    instances = [_instance(row, f"{file}{where}") for where, row in _rows(file, data)]
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
    spec = TaskSpec(
        name=re.sub(r"[^\w.-]+", "-", f"swe-bench-{file.stem}"),
        description=f"SWE-bench instances from {file.name}",
        sandbox=SandboxConfig(workdir=WORKDIR, memory_mb=4096),
        instances=file.name,
        prompt=PromptConfig(system=SYSTEM_PROMPT, instance=INSTANCE_PROMPT),
        limits=EpisodeLimits(
            max_turns=50, max_new_tokens=2048, context_length=32768, tool_timeout=120.0
        ),
        grader=PythonGrader(
            type="python", function=f"{__name__}:grade_instance", timeout=TEST_TIMEOUT_S + 300
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
    )


class SweBenchEnv(TaskEnv):
    """TaskEnv whose sandboxes start from each instance's own image (found or built once)."""

    def __init__(self, task: Task, provider: SandboxProvider, run_id: str) -> None:
        super().__init__(task, provider, run_id)
        self._images: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def instance_image(self, instance: Instance) -> str:
        if self.provider.name != "docker":
            raise ConfigError(
                f"instance {instance.id}: SWE-bench instances need the docker provider "
                f"(the repository lives in the image at {WORKDIR})",
                fix="run with the docker sandbox provider",
            )
        async with self._locks.setdefault(instance.id, asyncio.Lock()):
            if instance.id not in self._images:
                base_dir = Path(self.task.base_dir)
                self._images[instance.id] = await asyncio.to_thread(
                    find_or_build_image, instance, base_dir
                )
            return self._images[instance.id]


def find_or_build_image(instance: Instance, base_dir: Path) -> str:
    """The prebuilt image of `instance` if present locally, else the one built from its source."""
    prebuilt = str(instance.fields.get("image_name") or standard_image_name(instance.id))
    if _present(prebuilt):
        return prebuilt
    fields = instance.fields
    if fields.get("source") is None and not fields.get("repo_archive"):
        raise ImageBuildError(
            f"instance {instance.id}: image {prebuilt} is not present and the row has no "
            "`source` or `repo_archive` to build one from",
            fix=f"docker pull {prebuilt} (or docker load it), or add a `source` to the row",
        )
    return build_instance_image(instance, base_dir).tag


def standard_image_name(instance_id: str) -> str:
    """The name SWE-bench publishes an instance's evaluation image under."""
    key = instance_id.lower().replace("__", "_1776_")
    return f"swebench/sweb.eval.x86_64.{key}:latest"


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
    dockerfile = _dockerfile(instance, source, strip=_single_top_folder(archive))
    _write_if_changed(folder / "Dockerfile", dockerfile.encode())
    return folder


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
                tail = " | ".join(done.stderr.strip().splitlines()[-3:])
                raise ImageBuildError(
                    f"pip download {requirement} failed: {tail[-400:]}",
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


async def grade_instance(sandbox: Sandbox, instance: Instance) -> dict[str, Any]:
    """Apply test_patch, run the listed tests with pytest -rA; reward 1.0 when all pass."""
    fail_to_pass = listed_tests("FAIL_TO_PASS", instance)
    wanted = list(dict.fromkeys(fail_to_pass + listed_tests("PASS_TO_PASS", instance)))
    if not wanted:
        raise GraderError(f"instance {instance.id}: FAIL_TO_PASS and PASS_TO_PASS list no tests")
    fields = instance.fields
    test_patch = str(fields["test_patch"])
    await sandbox.write_file(EVAL_PATCH, test_patch.encode())
    script = _apply_script(str(fields["base_commit"]), patch_files(test_patch))
    applied = await sandbox.exec(ExecRequest(command=script, timeout=APPLY_TIMEOUT_S))
    if applied.timed_out:
        raise GraderError(f"instance {instance.id}: applying test_patch timed out")
    how = _APPLIED.get(applied.exit_code) if applied.exit_code is not None else None
    if how is None:  # as the harness counts it: unresolved, not a grader failure
        return {
            "reward": 0.0,
            "resolved": False,
            "test_patch": "failed to apply",
            "tests": {t: "MISSING" for t in wanted},
            "output": applied.output,
        }
    command = str(fields.get("test_cmd") or DEFAULT_TEST_CMD)
    if "-rA" not in command.split():
        command += " -rA"
    command = CONDA + command + " " + " ".join(shlex.quote(t) for t in wanted)
    result = await sandbox.exec(ExecRequest(command=command, timeout=TEST_TIMEOUT_S))
    if result.timed_out:
        raise GraderError(f"instance {instance.id}: tests timed out after {TEST_TIMEOUT_S:g} s")
    if result.exit_code in (126, 127):
        raise GraderError(f"instance {instance.id}: the test command did not run: {command[:200]}")
    found = parse_pytest_log(result.output, wanted)
    tests = {t: found.get(t, "MISSING") for t in wanted}
    resolved = all(status in PASSING for status in tests.values())
    return {
        "reward": 1.0 if resolved else 0.0,
        "resolved": resolved,
        "test_patch": how,
        "tests": tests,
        "exit_code": result.exit_code,
        "output": applied.output + "\n" + result.output,
    }


def patch_files(diff: str) -> list[str]:
    """The paths a diff touches: from its `diff --git` headers, else its `---`/`+++` pairs."""
    paths = [p for pair in _GIT_HEADER.findall(diff) for p in pair]
    lines = diff.splitlines()
    if not paths:  # a plain unified diff: `---`, `+++`, then `@@` is a file header
        for old, new, hunk in zip(lines, lines[1:], lines[2:], strict=False):
            if old.startswith("--- ") and new.startswith("+++ ") and hunk.startswith("@@"):
                paths += [_strip_prefix(old[4:]), _strip_prefix(new[4:])]
    return list(dict.fromkeys(p for p in paths if p != "/dev/null"))


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    return path[2:] if path.startswith(("a/", "b/")) else path


def _apply_script(base_commit: str, files: list[str]) -> str:
    """Restore the test files to the base commit (new ones removed), then apply test_patch."""
    refs = [f"{base_commit}^{{commit}}", f"refs/tags/{BASE_TAG}^{{commit}}"]
    find = " || ".join(f"git rev-parse -q --verify {shlex.quote(r)}" for r in refs)
    quoted = " ".join(shlex.quote(f) for f in files) or '""'
    patch = shlex.quote(EVAL_PATCH)
    return (
        f"base=$({find} 2>/dev/null)\n"
        f'if [ -n "$base" ]; then for f in {quoted}; do\n'
        f'  [ -n "$f" ] && {{ git checkout -q "$base" -- "$f" 2>/dev/null || rm -f -- "$f"; }}\n'
        "done; fi\n"
        f"git apply -v {patch} && exit 0\n"
        f"patch --batch --fuzz=5 -p1 -i {patch} && exit 3\n"
        "exit 4\n"
    )


def _dockerfile(instance: Instance, source: Source, *, strip: bool) -> str:
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


def _rows(file: Path, data: bytes) -> list[tuple[str, object]]:
    """(where, row) pairs: where is `:N` (a JSONL line) or `: row N` (of a JSON list)."""
    text = data.decode(errors="replace")
    if file.suffix == ".json" or text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(rows, list):
            raise ConfigError(f"{file}: expected a JSON list of SWE-bench rows")
        return [(f": row {i}", row) for i, row in enumerate(rows, 1)]
    pairs: list[tuple[str, object]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                pairs.append((f":{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{file}:{number}: not valid JSON: {exc.msg}") from None
    return pairs


def _instance(row: object, where: str) -> Instance:
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
    name = row.get("instance_id")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}: instance_id: missing or not a non-empty string")
    label = f"{where}: instance {name}"
    for key in REQUIRED:
        if key not in row:
            raise ConfigError(f"{label}: {key}: missing", fix="rows need " + ", ".join(REQUIRED))
    for key in STRINGS:
        if key in row and not isinstance(row[key], str | type(None)):
            raise ConfigError(f"{label}: {key}: expected a string, got {type(row[key]).__name__}")
    if not str(row["test_patch"]).strip():
        raise ConfigError(f"{label}: test_patch: empty")
    instance = Instance(id=name, fields=dict(row))
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
