"""Chaos: hostile input files for every reader a person points agentrl at.

A property-based fuzzer (hypothesis) writes task files, train configs and trajectory
files — valid ones broken at random places, and adversarial ones (alias bombs, deep
nesting, huge scalars, odd encodings, random bytes) — and runs `agentrl validate` on
each, in process. For every input: exit 0 with `ok`, or exit 1 with each problem as
`file:line: field: message` and a `fix:` line; never a traceback, never an internal
error, never a hang (each example has a time bound). Special files (FIFOs, devices,
folders) are refused without being read.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.cli import main
from agentrl.trajectory import Trajectory

SECONDS = 10.0  # per input: a reader that needs more is hanging on it
EXAMPLES = 60
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same inputs every run: a failure here is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROBLEM = re.compile(r"^\S.*:\d+: [^:\s][^:]*: .+$")  # file:line: field: message
LINE = re.compile(r"^\S.*:\d+: .+$")  # file:line: message (trajectories)

TASK: dict[str, Any] = {
    "name": "fuzz",
    "description": "a task the fuzzer breaks",
    "sandbox": {"image": "agentrl/base:bookworm", "memory_mb": 512, "setup": ["mkdir -p /w"]},
    "instances": [
        {"id": "a", "filename": "a.txt", "content": "hello"},
        {"id": "b", "filename": "b.txt", "content": "world"},
    ],
    "prompt": {"system": "You write files.", "instance": "Write {content} to {filename}."},
    "tools": ["bash", {"name": "finish"}],
    "limits": {"max_turns": 4, "max_new_tokens": 64, "context_length": 2048},
    "grader": {"type": "command", "command": "test -f /w/{filename}", "timeout": 30},
    "sampling": {"temperature": 1.0, "stop": ["```\n"]},
    "oracle": ["echo {content} > /w/{filename}"],
}
TRAIN = yaml.safe_load(
    (Path(__file__).parents[2] / "examples" / "train" / "shell-basics.yaml").read_text()
)

# Values a hostile or careless person writes where something else belongs.
NASTY = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
    st.sampled_from(
        [
            "{filename:d}",
            "{filename.stem}",
            "{content[99]}",
            "{0}",
            "{",
            "[/x] [bold]",
            "/usr",
            "../../../etc",
            "x" * 100_000,
            "9" * 5000,
            "\x00\x07\u202e",
            "🙂" * 50,
        ]
    ),
)


def _paths(value: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [loc] if loc else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*loc, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*loc, i))
    return out


def _broken(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with 1-4 values replaced by nasty ones, or a key added where none belongs."""
    paths = _paths(base)
    edit = st.tuples(st.sampled_from(paths), NASTY, st.booleans())

    def apply(edits: list[tuple[tuple[Any, ...], Any, bool]]) -> dict[str, Any]:
        doc = copy.deepcopy(base)
        for loc, value, as_new_key in edits:
            parent: Any = doc
            for key in loc[:-1]:
                if not isinstance(parent, dict | list):
                    break
                try:
                    parent = parent[key]
                except (KeyError, IndexError, TypeError):
                    break
            else:
                if isinstance(parent, dict):
                    parent[f"{loc[-1]}x" if as_new_key else loc[-1]] = value
                elif (
                    isinstance(parent, list) and isinstance(loc[-1], int) and loc[-1] < len(parent)
                ):
                    parent[loc[-1]] = value
        return doc

    return st.lists(edit, min_size=1, max_size=4).map(apply)


def _alias_bomb(width: int, depth: int, key: str) -> str:
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for d in range(1, depth):
        lines.append(f"l{d}: &l{d} [{', '.join([f'*l{d - 1}'] * width)}]")
    return f"{key}: fuzz\n" + "\n".join(lines) + f"\ninstances: [*l{depth - 1}]\n"


ADVERSARIAL_TEXT = st.one_of(
    st.builds(_alias_bomb, st.integers(2, 12), st.integers(2, 12), st.just("name")),
    st.builds(lambda n: "name: x\nprompt: " + "[" * n + "]" * n + "\n", st.integers(50, 30_000)),
    st.builds(lambda n: "name: x\nlimits: " + "{a: " * n + "1" + "}" * n, st.integers(50, 5_000)),
    st.builds(lambda n: f"name: x\nlimits: {{max_turns: {'9' * n}}}\n", st.integers(10, 20_000)),
    st.just("name: x\nwhen: 2001-13-45\n"),
    st.just("a: &a [*a]\n"),
    st.just("name: x\nname: y\n"),
    st.just("name: x\n\tbad: tab\n"),
    st.just("---\nname: x\n---\nname: y\n"),
    st.just("!!python/object/apply:os.system ['true']\n"),
    st.text(max_size=300),
)


def _encoded(text: str) -> st.SearchStrategy[bytes]:
    return st.sampled_from(["utf-8", "utf-16", "latin-1", "utf-32"]).map(
        lambda enc: text.encode(enc, errors="replace")
    )


def _validate(path: Path) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", str(path)])
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def _assert_clean(path: Path, line: re.Pattern[str]) -> None:
    code, out, err, seconds = _validate(path)
    assert seconds < SECONDS, f"{path.name}: {seconds:.1f} s"
    assert "Traceback" not in out + err and "internal error" not in err, err
    if code == 0:
        assert out.strip().startswith(f"{path}: "), out
        return
    assert code == 1, (code, err)
    lines = err.splitlines()
    problems = [x for x in lines if not x.startswith("fix: ")]
    assert problems and any(x.startswith("fix: ") for x in lines), err
    assert all(line.match(x) for x in problems), err


def _write(data: bytes, name: str, check: Callable[[Path], None]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(data)
        check(path)


def _yaml(doc: object) -> bytes:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False).encode()


@SETTINGS
@given(_broken(TASK))
def test_a_broken_task_file_is_lines_and_a_fix(doc):
    _write(_yaml(doc), "task.yaml", lambda p: _assert_clean(p, PROBLEM))


@SETTINGS
@given(ADVERSARIAL_TEXT.flatmap(_encoded) | st.binary(max_size=400))
def test_an_adversarial_task_file_is_lines_and_a_fix(data):
    _write(data, "task.yaml", lambda p: _assert_clean(p, PROBLEM))


@SETTINGS
@given(_broken(TRAIN))
def test_a_broken_train_config_is_lines_and_a_fix(doc):
    doc = {**doc, "schedule": doc.get("schedule", {})}  # stays a train config
    _write(_yaml(doc), "train.yaml", lambda p: _assert_clean(p, PROBLEM))


@SETTINGS
@given(ADVERSARIAL_TEXT.map(lambda t: "schedule: {}\n" + t).flatmap(_encoded))
def test_an_adversarial_train_config_is_lines_and_a_fix(data):
    _write(data, "train.yaml", lambda p: _assert_clean(p, PROBLEM))


def _trajectory() -> dict[str, Any]:
    traj = Trajectory(
        trajectory_id="fuzz_0",
        group_id="fuzz",
        task="fuzz",
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5, 6],
        loss_mask=[1, 1, 0],
        logprobs=[-0.5, -0.25, 0.0],
        token_versions=[0, 0, -1],
        reward=1.0,
        stop_reason="finished",
    )
    return json.loads(traj.check().to_json())


TRAJECTORY = _trajectory()


@SETTINGS
@given(
    st.one_of(
        _broken(TRAJECTORY).map(lambda d: (json.dumps(d) + "\n").encode()),
        st.builds(lambda n: ('{"a":' * n + "1" + "}" * n + "\n").encode(), st.integers(1, 100_000)),
        st.builds(lambda n: f'{{"reward": {"9" * n}}}\n'.encode(), st.integers(10, 20_000)),
        st.binary(max_size=300),
        st.just(json.dumps(TRAJECTORY)[:-7].encode()),  # torn: the writer was killed
        st.just(
            (json.dumps(TRAJECTORY).replace("fuzz_0", "\udcff", 1)).encode(
                "utf-8", "surrogateescape"
            )
        ),
    )
)
def test_a_broken_trajectory_file_is_a_line_and_a_fix(data):
    _write(data, "trajectories.jsonl", lambda p: _assert_clean(p, LINE))


def test_the_unbroken_documents_are_valid(tmp_path):
    """The fuzzer breaks documents that are valid to begin with (else it tests nothing)."""
    for name, data in (
        ("task.yaml", _yaml(TASK)),
        ("trajectories.jsonl", (json.dumps(TRAJECTORY) + "\n").encode()),
    ):
        (tmp_path / name).write_bytes(data)
        code, out, err, _ = _validate(tmp_path / name)
        assert code == 0, err
    train = {**TRAIN, "tasks": [str(tmp_path / "task.yaml")]}
    (tmp_path / "train.yaml").write_bytes(_yaml(train))
    code, out, err, _ = _validate(tmp_path / "train.yaml")
    assert code == 0, err


@pytest.mark.parametrize("name", ["task.yaml", "train.yaml", "rows.jsonl", "trajectories.jsonl"])
@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_special_files_are_refused_without_reading_them(tmp_path, name, kind):
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)  # opening it to read would block forever
    elif kind == "device":
        path.symlink_to("/dev/zero")  # reading it never ends
    else:
        path.mkdir()
    code, out, err, seconds = _validate(path)
    assert seconds < SECONDS
    assert code == 1, (out, err)
    assert "Traceback" not in err and "internal error" not in err
    lines = err.splitlines()
    assert lines[-1].startswith("fix: "), err
    if kind != "folder":  # a folder named task.yaml is asked for its task.yaml
        assert "not a regular file" in err, err


def test_an_instances_file_that_is_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "rows.jsonl")
    task = {**TASK, "instances": "rows.jsonl"}
    (tmp_path / "task.yaml").write_bytes(_yaml(task))
    code, _, err, seconds = _validate(tmp_path / "task.yaml")
    assert code == 1 and seconds < SECONDS
    assert "instances: 'rows.jsonl': is a FIFO, not a regular file" in err, err
