"""The small helpers every layer shares, one of each: an error's first line and a text on
one line (errors.py), writing whole or not at all (atomic.py), free ports (http.py), the
torn last line of a JSONL file (trajectory.py), YAML read through the guards (yamlfile.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agentrl import atomic
from agentrl.errors import first_line, one_line
from agentrl.http import free_ports
from agentrl.trajectory import TrajectoryStore
from agentrl.yamlfile import ConfigFileError, load_yaml


def test_first_line_of_an_error() -> None:
    assert first_line(ValueError("\n  bad value\nmore detail")) == "bad value"
    assert first_line(ValueError("")) == "ValueError"
    assert first_line(ValueError("  \n ")) == "ValueError"
    assert first_line(KeyError("k"), typed=True) == "KeyError: 'k'"
    assert first_line(OSError(), typed=True) == "OSError"
    assert first_line(RuntimeError("x" * 50), limit=10) == "x" * 10
    assert first_line("explained\nby the engine") == "explained"


def test_one_line_of_a_text() -> None:
    assert one_line("a  b\n\n  c\td\n") == "a b c d"
    assert one_line("out\n\nerr", sep=" | ") == "out | err"
    assert one_line("x" * 20, 10) == "x" * 7 + "..."
    assert one_line("abcdefghijklmnop", 10, tail=True) == "...jklmnop"
    assert one_line("short", 10) == "short"
    assert one_line("") == ""


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic.write_text(path, "old")
    atomic.write_bytes(path, b"new", durable=True)
    assert path.read_text() == "new"
    with pytest.raises(RuntimeError), atomic.atomic_file(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left


def test_a_folder_is_published_whole(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "model"
    with atomic.atomic_folder(out, durable=True) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"1")
        assert not out.exists()
    assert (out / "sub" / "w.bin").read_bytes() == b"1"
    with pytest.raises(OSError), atomic.atomic_folder(out) as tmp:  # not empty, no replace
        (tmp / "w.bin").write_bytes(b"2")
    with atomic.atomic_folder(out, replace=True) as tmp:
        (tmp / "w.bin").write_bytes(b"2")
    assert [p.name for p in out.iterdir()] == ["w.bin"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]  # nothing aside left
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic.atomic_folder(empty) as tmp:  # onto an empty folder
        (tmp / "index.html").write_text("x")
    assert (empty / "index.html").is_file()


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(3)
    assert len(set(ports)) == 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))


def test_a_torn_last_line_is_cut_and_a_whole_file_kept(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ')
    TrajectoryStore(path).cut_torn_tail()
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    TrajectoryStore(path).cut_torn_tail()
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    path.write_bytes(b'{"only": ')  # no whole line at all
    TrajectoryStore(path).cut_torn_tail()
    assert path.read_bytes() == b""


def test_yaml_of_other_formats_passes_the_guards(tmp_path: Path) -> None:
    path = tmp_path / "solution.yaml"
    path.write_text("- command: ls\n- command: pwd\n")
    assert load_yaml(path) == [{"command": "ls"}, {"command": "pwd"}]
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(ConfigFileError, match=r"solution.yaml:2: .*duplicate key"):
        load_yaml(path)
    bomb = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    bomb += [
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]"
        for p, c in zip("abcdef", "bcdefg", strict=True)
    ]
    path.write_text("\n".join(bomb) + "\n")
    with pytest.raises(ConfigFileError, match="alias bomb"):
        load_yaml(path)
    path.write_bytes(b"key: \xff\n")
    with pytest.raises(ConfigFileError, match="not UTF-8"):
        load_yaml(path)
