"""SWE-bench rows: loading as published, malformed rows, and every shipped instance in Docker.

Each instance in tasks/swe_bench/ is played in its own image (built once per recipe
hash): the gold patch applied with `git apply` must earn 1.0 and doing nothing 0.0, and
the sandbox the agent sees holds the repository at its base commit, clean, with none
of test_patch's changes. Every Docker test labels its containers with a fresh run id
and asserts that none is left afterwards.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agentrl.errors import ConfigError, ImageBuildError
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.sandbox.docker import DockerProvider
from agentrl.sandbox.images import ImageInfo
from agentrl.sandbox.local import LocalProvider
from agentrl.tasks.evidence import Grade
from agentrl.tasks.graders import listed_tests
from agentrl.tasks.spec import Instance, PythonGrader
from agentrl.tasks.swe import BASE_TAG
from agentrl.tasks.swe.env import SweBenchEnv
from agentrl.tasks.swe.images import (
    build_instance_image,
    find_or_build_image,
    prepare_context,
    standard_image_name,
)
from agentrl.tasks.swe.rows import load_swe_bench
from agentrl.tasks.swe.rules import patch_files

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "tasks" / "swe_bench" / "instances.jsonl"
SHIPPED = load_swe_bench(ROWS)
IDS = [instance.id for instance in SHIPPED.instances]


def _rows() -> list[dict[str, Any]]:
    return [json.loads(line) for line in ROWS.read_text().splitlines()]


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------- loading, no Docker


def test_shipped_rows_load_as_one_task() -> None:
    assert len(IDS) >= 3 and len(set(IDS)) == len(IDS)
    assert SHIPPED.spec.sandbox.workdir == "/testbed"
    assert [t.name for t in SHIPPED.spec.tool_configs()] == ["bash", "str_replace_editor", "finish"]
    assert isinstance(SHIPPED.spec.grader, PythonGrader) and not SHIPPED.spec.grader.files
    for instance, row in zip(SHIPPED.instances, _rows(), strict=True):
        assert instance.fields == row  # every published field kept as it is
        prompt = instance.render(SHIPPED.spec.prompt.instance)
        assert row["problem_statement"] in prompt and "/testbed" in prompt
        assert row["test_patch"] not in prompt and "test_patch" not in prompt
        assert listed_tests("FAIL_TO_PASS", instance)
        assert re.fullmatch(r"[0-9a-f]{40}", row["base_commit"])
        assert re.search(r"\b[0-9a-f]{40}\b", row["hints_text"])  # the upstream fix commit
        assert re.fullmatch(r"[\w.-]+==[\w.]+", row["source"]["sdist"])


def test_json_list_with_list_fields_loads_like_jsonl(tmp_path: Path) -> None:
    rows = _rows()
    for row in rows:
        row["FAIL_TO_PASS"] = json.loads(row["FAIL_TO_PASS"])
        row["PASS_TO_PASS"] = json.loads(row["PASS_TO_PASS"])
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2))
    task = load_swe_bench(path)
    assert [i.id for i in task.instances] == IDS
    for mine, shipped in zip(task.instances, SHIPPED.instances, strict=True):
        for field in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            assert listed_tests(field, mine) == listed_tests(field, shipped)


def test_ids_pick_instances_and_an_unknown_one_is_named() -> None:
    task = load_swe_bench(ROWS, ids=[IDS[-1]])
    assert [i.id for i in task.instances] == [IDS[-1]]
    with pytest.raises(ConfigError, match="no instance nope__nope-1"):
        load_swe_bench(ROWS, ids=["nope__nope-1"])


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda row: row.pop(key)


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda row: row.__setitem__(key, value)


MALFORMED = [
    ("test_patch missing", _drop("test_patch"), ":2: swe-bench instance {id}: test_patch: missing"),
    (
        "test_patch empty",
        _set("test_patch", " \n"),
        ":2: swe-bench instance {id}: test_patch: empty",
    ),
    (
        "repo not text",
        _set("repo", 5),
        ":2: swe-bench instance {id}: repo: expected a string, got int",
    ),
    (
        "FAIL_TO_PASS not JSON",
        _set("FAIL_TO_PASS", "tests/a.py::b"),
        ":2: instance {id}: field FAIL_TO_PASS is not a JSON list of test ids",
    ),
    (
        "PASS_TO_PASS of numbers",
        _set("PASS_TO_PASS", [1, 2]),
        ":2: instance {id}: field PASS_TO_PASS must list test ids",
    ),
    (
        "no tests at all",
        lambda row: row.update(FAIL_TO_PASS="[]", PASS_TO_PASS=[]),
        ":2: swe-bench instance {id}: FAIL_TO_PASS: lists no tests",
    ),
    (
        "sdist without version",
        _set("source", {"sdist": "cachetools"}),
        ":2: swe-bench instance {id}: source.sdist: 'cachetools' is not NAME==VERSION",
    ),
    (
        "unknown source key",
        _set("source", {"sdist": "a==1", "instal": []}),
        ":2: swe-bench instance {id}: source.instal: Extra inputs are not permitted",
    ),
    ("no instance_id", _drop("instance_id"), ":2: instance_id: missing"),
]


@pytest.mark.parametrize(
    ("change", "expected"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_row_gives_one_line_naming_instance_and_field(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], expected: str
) -> None:
    rows = _rows()
    change(rows[1])
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ConfigError) as caught:
        load_swe_bench(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert expected.format(id=IDS[1]) in message, message


def test_unreadable_files_and_duplicates_are_named(tmp_path: Path) -> None:
    rows = _rows()
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"broken.jsonl:2: not valid JSON"):
        load_swe_bench(broken)
    twice = _write_jsonl(tmp_path / "twice.jsonl", [rows[0], rows[0]])
    with pytest.raises(ConfigError, match=f"instance {IDS[0]} appears twice"):
        load_swe_bench(twice)
    (tmp_path / "object.json").write_text(json.dumps(rows[0]))
    with pytest.raises(ConfigError, match="expected a JSON list"):
        load_swe_bench(tmp_path / "object.json")


def test_patch_files_and_image_names() -> None:
    for instance in SHIPPED.instances:
        files = patch_files(instance.fields["test_patch"])
        assert files and all(f.startswith(("test", "tests/")) for f in files)
    created = "--- /dev/null\n+++ b/tests/new_test.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n"
    # inside a hunk, a removed "-- x" and an added "++ y" line are no file header
    changed = "--- a/q.sql\n+++ b/q.sql\n@@ -1,2 +1,2 @@\n--- old\n+++ new\n a\n"
    assert patch_files(created + changed) == ["tests/new_test.py", "q.sql"]
    assert (
        standard_image_name("django__django-11099")
        == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )


def test_build_context_from_a_repo_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRL_CACHE", str(tmp_path / "cache"))
    flat, nested = tmp_path / "flat.tar.gz", tmp_path / "nested.tar.gz"
    for archive, prefix in ((flat, ""), (nested, "proj-1.0/")):
        with tarfile.open(archive, "w:gz") as tar:
            for name in ("setup.py", "proj/__init__.py"):
                info = tarfile.TarInfo(prefix + name)
                info.size = 3
                tar.addfile(info, io.BytesIO(b"x=1"))
    row = {**_rows()[0], "repo_archive": "flat.tar.gz"}
    row.pop("source")
    for archive, strips in ((flat, False), (nested, True)):
        row["repo_archive"] = archive.name
        folder = prepare_context(Instance(id=row["instance_id"], fields=row), tmp_path)
        assert (folder / "src.tar.gz").read_bytes() == archive.read_bytes()
        dockerfile = (folder / "Dockerfile").read_text()
        assert dockerfile.startswith("FROM agentrl/base:bookworm\n")
        assert ("--strip-components=1" in dockerfile) is strips
        assert "repo_archive" in dockerfile and "WORKDIR /testbed" in dockerfile


def test_the_local_provider_is_refused() -> None:
    env = SweBenchEnv(SHIPPED, LocalProvider(), "test-swe-local")
    with pytest.raises(ConfigError, match="need the docker provider"):
        asyncio.run(env.instance_image(SHIPPED.instances[0]))


# ---------------------------------------------------------------- Docker


@pytest.fixture(scope="module")
def images() -> dict[str, ImageInfo]:
    """Each shipped instance's image, built (or found) once; about 10 s each the first time."""
    base_dir = Path(SHIPPED.base_dir)
    built = {}
    for instance in SHIPPED.instances:
        info = build_instance_image(instance, base_dir)
        print(f"{instance.id}: {'built' if info.built else 'found'} in {info.seconds:.1f} s")
        built[instance.id] = info
    return built


@pytest.mark.docker
@pytest.mark.slow
def test_images_build_once_per_recipe_hash(images: dict[str, ImageInfo]) -> None:
    for instance in SHIPPED.instances:
        again = build_instance_image(instance, Path(SHIPPED.base_dir))
        assert not again.built and again.id == images[instance.id].id
        assert find_or_build_image(instance, Path(SHIPPED.base_dir)) == again.tag


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("instance", SHIPPED.instances, ids=IDS)
def test_gold_patch_earns_one_and_doing_nothing_zero(
    instance: Instance, images: dict[str, ImageInfo], run_id: str
) -> None:
    async def episode(env: SweBenchEnv, gold: bool) -> Grade:
        sandbox = await env.init(instance, f"{instance.id}-{'gold' if gold else 'noop'}")
        try:
            await _assert_base_state(sandbox, instance)
            if gold:
                await sandbox.write_file("/tmp/gold.patch", instance.fields["patch"].encode())
                done = await sandbox.exec(ExecRequest(command="git apply -v /tmp/gold.patch"))
                assert done.exit_code == 0, done.output
            return await env.evaluate(sandbox, instance)
        finally:
            await sandbox.close()

    async def both() -> tuple[Grade, Grade]:
        env = SweBenchEnv(SHIPPED, DockerProvider(reap_at_start=False), run_id)
        assert (await env.instance_image(instance)).startswith("agentrl/swe-start-")
        return await asyncio.gather(episode(env, True), episode(env, False))

    started = time.monotonic()
    gold, noop = asyncio.run(both())
    print(f"{instance.id}: gold + no-op in {time.monotonic() - started:.1f} s")
    fail_to_pass = listed_tests("FAIL_TO_PASS", instance)
    pass_to_pass = listed_tests("PASS_TO_PASS", instance)
    assert gold.reward == 1.0 and gold.components["resolved"] is True, gold.evidence.output
    assert set(gold.evidence.tests.values()) == {"PASSED"}
    assert gold.evidence.notes[0] == "agent's patch: git apply --verbose"
    assert noop.reward == 0.0 and noop.components["resolved"] is False, noop.evidence.output
    assert noop.evidence.notes[0] == "agent's patch: empty"
    # doing nothing fails exactly the FAIL_TO_PASS tests; it does not just fail to run them
    assert {noop.evidence.tests[t] for t in fail_to_pass} == {"FAILED"}
    assert {noop.evidence.tests[t] for t in pass_to_pass} <= {"PASSED"}
    assert noop.components["fail_to_pass"] == f"0/{len(fail_to_pass)}"


async def _assert_base_state(sandbox: Sandbox, instance: Instance) -> None:
    """The repository as the agent first sees it: the base commit, clean, no test_patch."""
    command = "git status --porcelain && git describe --tags --exact-match"
    status = await sandbox.exec(ExecRequest(command=command))
    assert status.exit_code == 0 and status.output == f"{BASE_TAG}\n", status.output
    test_patch = instance.fields["test_patch"]
    for name in re.findall(r"^\+\s*def (test_\w+)", test_patch, re.MULTILINE):
        found = await sandbox.exec(ExecRequest(command=["grep", "-rq", f"def {name}", "/testbed"]))
        assert found.exit_code == 1, f"test {name} is visible before EVAL"
    # test_patch applies as it stands and is not applied already (checked, then removed)
    await sandbox.write_file("/tmp/check.patch", test_patch.encode())
    check = "git apply --check /tmp/check.patch && ! git apply --check -R /tmp/check.patch"
    checked = await sandbox.exec(
        ExecRequest(command=f"{check}; code=$?; rm /tmp/check.patch; exit $code")
    )
    assert checked.exit_code == 0, checked.output
    module = instance.fields["repo"].split("/")[1].replace("-", "_")
    where = await sandbox.exec(
        ExecRequest(
            command=["python3", "-c", f"import {module}; print({module}.__file__)"], workdir="/"
        )
    )
    assert where.output.startswith(f"/testbed/{module}"), where.output


@pytest.mark.docker
@pytest.mark.slow
def test_test_files_the_agent_edited_are_restored_before_test_patch(
    images: dict[str, ImageInfo], run_id: str
) -> None:
    instance = next(i for i in SHIPPED.instances if i.id.startswith("tkem__cachetools"))
    edited = patch_files(instance.fields["test_patch"])[0]

    async def play() -> Grade:
        env = SweBenchEnv(SHIPPED, DockerProvider(reap_at_start=False), run_id)
        sandbox = await env.init(instance, f"{instance.id}-tamper")
        try:
            await sandbox.write_file("/tmp/gold.patch", instance.fields["patch"].encode())
            command = f"git apply /tmp/gold.patch && echo 'import unittest' > {edited}"
            done = await sandbox.exec(ExecRequest(command=command))
            assert done.exit_code == 0, done.output
            return await env.evaluate(sandbox, instance)
        finally:
            await sandbox.close()

    grade = asyncio.run(play())
    assert grade.reward == 1.0, grade.evidence.output
    assert grade.evidence.tampered == [edited] and grade.components["tampered_tests"] == 1


@pytest.mark.docker
def test_a_row_with_no_image_and_no_source_says_what_to_do(tmp_path: Path) -> None:
    row = {**_rows()[0], "instance_id": "nobody__nothing-1"}
    row.pop("source")
    task = load_swe_bench(_write_jsonl(tmp_path / "rows.jsonl", [row]))
    with pytest.raises(ImageBuildError, match="nobody__nothing-1: no image under any") as e:
        find_or_build_image(task.instances[0], tmp_path)
    names = "swebench/sweb.eval.x86_64.nobody_1776_nothing-1:latest, "
    names += "sweb.eval.x86_64.nobody__nothing-1:latest"
    assert names in str(e.value)
    assert "docker pull swebench/sweb.eval.x86_64.nobody_1776_nothing-1:latest" in e.value.fix
