"""The entries of a task's instances file, each with its line: JSON Lines, JSON, YAML, CSV.

Each reader returns (line, value, error) per entry, or raises `FileProblem` when the
file as a whole cannot be read; the task loader turns both into problems at those lines.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import yaml

from agentrl.yamlfile import show
from agentrl.yamlnodes import compose, yaml_error

Entry = tuple[int, Any, str | None]


class FileProblem(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line, self.message = line, message


def rows_jsonl(text: str) -> list[Entry]:
    out: list[Entry] = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((n, json.loads(line), None))
            except json.JSONDecodeError as e:
                out.append((n, None, f"invalid JSON: {e.msg} (column {e.colno})"))
    return out


def rows_json(text: str) -> list[Entry]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise FileProblem(e.lineno, f"invalid JSON: {e.msg} (column {e.colno})") from e
    if not isinstance(data, list):
        raise FileProblem(1, f"should be a JSON list of instances, got {show(data)}")
    try:  # JSON is YAML: the node tree gives each entry's line
        node = compose(text)[0]
        lines = [n.start_mark.line + 1 for n in node.value] if node else []
    except yaml.YAMLError:
        lines = []
    if len(lines) != len(data):
        lines = [1] * len(data)
    return [(line, v, None) for line, v in zip(lines, data, strict=True)]


def rows_yaml(text: str) -> list[Entry]:
    try:
        node, data = compose(text)
    except yaml.YAMLError as e:
        line, msg = yaml_error(e, text)
        raise FileProblem(line, msg) from e
    if data is None:
        return []
    if not isinstance(data, list) or not isinstance(node, yaml.SequenceNode):
        raise FileProblem(1, f"should be a list of instances, got {show(data)}")
    return [(n.start_mark.line + 1, v, None) for n, v in zip(node.value, data, strict=True)]


def rows_csv(text: str) -> list[Entry]:
    reader = csv.DictReader(io.StringIO(text))
    out: list[Entry] = []
    try:
        for row in reader:
            extra = row.pop(None, None)  # type: ignore[call-overload]  # DictReader's restkey
            error = f"{len(extra)} more cell(s) than the header" if extra else None
            out.append((reader.line_num, row, error))
    except csv.Error as e:
        raise FileProblem(reader.line_num, f"invalid CSV: {e}") from e
    return out


READERS = {".jsonl": rows_jsonl, ".json": rows_json, ".csv": rows_csv}
"""By suffix; any other instances file is YAML (rows_yaml)."""
