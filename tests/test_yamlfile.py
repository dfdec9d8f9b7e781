"""YAML config files: every malformed one gives `file:line: field: message`, one line each."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ConfigError
from agentrl.yamlfile import ConfigFileError, Problem, YamlFile, load_model


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Model):
    max_turns: int = Field(default=10, ge=1, description="turns per episode")
    timeout: float = 60.0


class CommandCheck(_Model):
    type: Literal["command"] = "command"
    command: str


class ScriptCheck(_Model):
    type: Literal["script"] = "script"
    path: str


class Config(_Model):
    name: str = Field(description="run name")
    steps: int = Field(ge=1)
    mode: Literal["fast", "slow"] = "fast"
    limits: Limits = Field(default_factory=Limits)
    check: Annotated[CommandCheck | ScriptCheck, Field(discriminator="type")]
    tags: list[str] | str = Field(default_factory=list)


GOOD = """\
name: demo
steps: 3
mode: slow
limits:
  max_turns: 5
check:
  type: script
  path: check.sh
tags: [a, b]
"""


def _problems(tmp_path: Path, text: str) -> list[str]:
    """The error's lines, with the file name left off."""
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as info:
        load_model(path, Config, what="config")
    assert str(info.value).splitlines() == [str(p) for p in info.value.problems]
    assert all(p.file == str(path) for p in info.value.problems)
    return [str(p).removeprefix(f"{path}:") for p in info.value.problems]


def test_a_good_file_loads(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(GOOD)
    config = load_model(path, Config, what="config")
    assert config.mode == "slow" and config.limits.max_turns == 5
    assert config.check == ScriptCheck(path="check.sh")
    assert config.tags == ["a", "b"]


def test_the_error_is_a_config_error_with_a_fix(tmp_path):
    with pytest.raises(ConfigFileError) as info:
        load_model(tmp_path / "missing.yaml", Config, what="config")
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)
    assert info.value.fix
    assert info.value.problems == [
        Problem(str(tmp_path / "missing.yaml"), 1, "config", "file not found")
    ]


def test_yaml_syntax_error(tmp_path):
    text = GOOD.replace("  max_turns: 5", "  max_turns: 5\n   bad: [1, 2")
    (problem,) = _problems(tmp_path, text)
    assert problem.startswith("6: yaml: ")


def test_empty_file(tmp_path):
    assert _problems(tmp_path, "# nothing yet\n") == [
        "1: config: the file is empty: a config is a mapping with name, steps, check..."
    ]


def test_top_level_not_a_mapping(tmp_path):
    assert _problems(tmp_path, "- name: demo\n") == [
        "1: config: the top level should be a mapping (name: ..., ...), got a list"
    ]


def test_duplicate_key(tmp_path):
    text = GOOD.replace("  max_turns: 5\n", "  max_turns: 5\n  max_turns: 6\n")
    assert _problems(tmp_path, text) == [
        "6: limits.max_turns: duplicate key (first on line 5): remove one"
    ]


def test_misspelt_key_is_reported_once_as_unknown(tmp_path):
    text = GOOD.replace("steps:", "stpes:")
    assert _problems(tmp_path, text) == ["2: stpes: unknown key 'stpes' (did you mean 'steps'?)"]


def test_unknown_key_without_a_close_match_lists_the_valid_keys(tmp_path):
    text = GOOD.replace("  max_turns: 5", "  max_turns: 5\n  colour: red")
    assert _problems(tmp_path, text) == [
        "6: limits.colour: unknown key 'colour' (valid keys: max_turns, timeout)"
    ]


def test_missing_required_key_points_at_its_parent(tmp_path):
    assert _problems(tmp_path, GOOD.replace("name: demo\n", "")) == [
        "1: name: required key 'name' is missing (run name)"
    ]
    text = GOOD.replace("  path: check.sh\n", "")
    assert _problems(tmp_path, text) == ["6: check.path: required key 'path' is missing"]


def test_wrong_type_in_a_nested_mapping_is_at_its_line(tmp_path):
    text = GOOD.replace("max_turns: 5", "max_turns: five")
    assert _problems(tmp_path, text) == [
        "5: limits.max_turns: should be a valid integer, got 'five'"
    ]
    text = GOOD.replace("max_turns: 5", "max_turns: 0")
    assert _problems(tmp_path, text) == [
        "5: limits.max_turns: should be greater than or equal to 1, got 0"
    ]
    assert _problems(tmp_path, GOOD.replace("limits:\n  max_turns: 5", "limits: 5")) == [
        "4: limits: should be a mapping (key: value), got 5"
    ]


def test_literal(tmp_path):
    assert _problems(tmp_path, GOOD.replace("mode: slow", "mode: quick")) == [
        "3: mode: should be 'fast' or 'slow', got 'quick'"
    ]


def test_bad_union_member_is_one_line(tmp_path):
    assert _problems(tmp_path, GOOD.replace("tags: [a, b]", "tags: 5")) == [
        "9: tags: should be a list or a string, got 5"
    ]
    # Inside the member that fits (a list), only that member's error.
    assert _problems(tmp_path, GOOD.replace("tags: [a, b]", "tags: [a, {b: c}]")) == [
        "9: tags[1]: should be a valid string, got a mapping"
    ]


def test_discriminated_union(tmp_path):
    assert _problems(tmp_path, GOOD.replace("type: script", "type: scrpt")) == [
        "7: check.type: unknown check type 'scrpt' (did you mean 'script'?); valid: command, script"
    ]
    assert _problems(tmp_path, GOOD.replace("  type: script\n", "")) == [
        "6: check.type: required key 'type' is missing (one of: command, script)"
    ]


def test_every_problem_of_a_file_in_line_order(tmp_path):
    text = GOOD.replace("steps: 3", "steps: 0").replace("mode: slow", "mode: quick")
    text = text.replace("max_turns: 5", "max_trns: 5").replace("tags: [a, b]", "tags: 5")
    assert [p.split(": ")[:2] for p in _problems(tmp_path, text)] == [
        ["2", "steps"],
        ["3", "mode"],
        ["5", "limits.max_trns"],
        ["9", "tags"],
    ]


def test_yaml_file_takes_checks_beyond_the_schema(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(GOOD)
    file = YamlFile(path, what="config")
    config = file.validate(Config, file.parse())
    assert config is not None and file.problems == []
    file.add(("check", "path"), "check.sh not found beside the config")
    file.add(("tags", 1), "tag 'b' is reserved")
    file.add(("rows", 2), "no id", line=3, file="rows.jsonl")
    assert [str(p) for p in file.sorted_problems()] == [
        f"{path}:8: check.path: check.sh not found beside the config",
        f"{path}:9: tags[1]: tag 'b' is reserved",
        "rows.jsonl:3: rows[2]: no id",
    ]
