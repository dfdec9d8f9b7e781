# Over 400 lines: a located message per kind of validation error, for every YAML file.
"""YAML config files validated into pydantic models, with every problem at its line.

`load_model` is the whole story for a plain config: the validated model, or a
ConfigFileError listing each problem as `file:line: field: message`. `YamlFile` is the
same machinery for loaders that check more than the schema (tasks): parse, validate,
then add their own problems at a loc. Lines come from the YAML node tree, so a pydantic
error's loc points at the offending key (for a missing key: at its parent); a value
that fits no member of a union gets one line, and a misspelt key is reported once, as
unknown, with the closest valid key. Parsing and lines are `agentrl.yamlnodes`'s.
"""

from __future__ import annotations

import difflib
import json
import re
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from agentrl.errors import ConfigError
from agentrl.textfile import UnreadableFile, read_text
from agentrl.yamlnodes import Loc, compose, duplicate_keys, find, yaml_error

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config, at a line of a file."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.message}"


class ConfigFileError(ConfigError):
    """A config file has problems; `problems` lists each, the message has one per line."""

    default_fix = "fix each problem above, then check again"

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = list(problems)


def load_model(
    path: str | Path,
    model: type[M],
    *,
    what: str,
    check: Callable[[M, YamlFile], M] | None = None,
) -> M:
    """The `model` validated from the YAML file at `path`; raises ConfigFileError listing all.

    `check`, given the valid model and the file, adds what only the reader knows (a
    folder that must exist) as problems at their lines, and returns the model to use.
    """
    fields = model.model_fields
    keys = sorted(fields, key=lambda name: not fields[name].is_required())[:3]
    file = YamlFile(Path(path), what=what, keys=keys)
    data = file.parse()
    result = file.validate(model, data) if data is not None else None
    if result is not None and check is not None:
        result = check(result, file)
    if result is None or file.problems:
        raise ConfigFileError(file.sorted_problems())
    return result


def load_yaml(path: str | Path, *, what: str = "file") -> object:
    """The data of the YAML file at `path`, whatever its top level, read through the same
    guards as every config (a regular UTF-8 file; no alias bomb, no deep nesting; no key
    given twice); ConfigFileError naming the line otherwise. For formats that are not
    agentrl's own (a Terminal-Bench task.yaml, a docker-compose file)."""
    file = YamlFile(Path(path), what=what)
    data = file.parse_document()
    if file.problems:
        raise ConfigFileError(file.sorted_problems())
    return data


class YamlFile:
    """One YAML file: its data's node tree (for lines) and the problems found so far.

    `what` names the file's kind in messages ("task") and labels problems with the whole
    file; `keys` are the top-level keys a reader expects first, shown when the file is
    empty or not a mapping.
    """

    def __init__(self, path: Path, *, what: str, keys: Sequence[str] = ()) -> None:
        self.path, self.file, self.what, self.keys = path, str(path), what, tuple(keys)
        self.root: yaml.Node | None = None
        self.problems: list[Problem] = []

    def add(self, loc: Loc, message: str, *, line: int | None = None, file: str = "") -> None:
        """A problem at `loc` (its line from the tree unless given); `file`: one this names."""
        line = line if line is not None else self.line(loc)
        self.problems.append(Problem(file or self.file, line, _dotted(loc, self.what), message))

    def line(self, loc: Loc) -> int:
        """The line of the key (or item) at `loc`; if absent, its nearest parent's."""
        return find(self.root, loc)[0]

    def line_in(self, loc: Loc, newlines: int) -> int:
        """The line `newlines` lines into the string at `loc`, exact for `|` block scalars."""
        line, node = find(self.root, loc)
        if isinstance(node, yaml.ScalarNode) and node.style == "|":
            return node.start_mark.line + 2 + newlines
        return line

    def parse_document(self) -> object:
        """The document, whatever its top level (duplicate keys become problems); None
        when it cannot be read or parsed (a problem says why) or is empty."""
        try:
            text = read_text(self.path)
        except UnreadableFile as e:
            self.add((), e.reason, line=e.line)
            return None
        try:
            self.root, data = compose(text)
        except yaml.YAMLError as e:
            line, message = yaml_error(e, text)
            self.problems.append(Problem(self.file, line, "yaml", message))
            return None
        for loc, line, first in duplicate_keys(self.root, ()):
            self.add(loc, f"duplicate key (first on line {first}): remove one", line=line)
        return data

    def parse(self) -> dict[str, Any] | None:
        """The top-level mapping (duplicate keys become problems); None when there is none."""
        before = len(self.problems)
        data = self.parse_document()
        if data is None and len(self.problems) > before:  # unreadable, or not YAML
            return None
        if data is None:
            keys = f"with {', '.join(self.keys)}..." if self.keys else "(key: value)"
            self.add((), f"the file is empty: a {self.what} is a mapping {keys}")
        elif not isinstance(data, dict):
            example = f"{self.keys[0]}: ..., ..." if self.keys else "key: value"
            self.add((), f"the top level should be a mapping ({example}), got {show(data)}")
        else:
            return data
        return None

    def validate(self, model: type[M], data: object) -> M | None:
        """`data` as a `model`; on failure None, each schema error a problem at its line."""
        try:
            result = model.model_validate(data)
        except ValidationError as e:
            self._schema_problems(model, e.errors(), data)
            return None
        # pydantic reads true as 1: a count or a limit written as a yes/no is a mistake.
        flagged = list(_bools_as_numbers(result, data, ()))
        for loc in flagged:
            self.add(loc, f"should be a number, got {str(_get(data, loc)).lower()}")
        return None if flagged else result

    def sorted_problems(self) -> list[Problem]:
        """The problems without repeats, this file's first, each file's by line."""
        unique = list(dict.fromkeys(self.problems))
        return sorted(unique, key=lambda p: (p.file != self.file, p.file, p.line))

    def _schema_problems(
        self, model: type[BaseModel], errors: list[ErrorDetails], data: object
    ) -> None:
        walked = [(e, _walk(model, e["loc"])) for e in errors]
        # A value that fits no member of a union gets one line, not one per member.
        at_union: dict[Loc, list[tuple[int, Any]]] = {}
        for i, (_e, w) in enumerate(walked):
            for prefix, member in w.branches:
                at_union.setdefault(prefix, []).append((i, member))
        skip: set[int] = set()
        for prefix, items in at_union.items():
            value = _get(data, prefix)
            if all(tuple(walked[i][1].path) == prefix for i, _m in items):
                skip |= {i for i, _m in items}
                members = list(dict.fromkeys(_describe(m) for _i, m in items))
                self.add(prefix, f"should be {' or '.join(members)}, got {show(value)}")
            else:
                skip |= {i for i, m in items if _kind_of_type(m) != _kind(value)}
        # A misspelt key is reported once, as unknown: not also as the required key it misses.
        typos = {(tuple(w.path[:-1]), str(w.path[-1])) for e, w in walked if _is_extra(e, w)}
        for i, (e, w) in enumerate(walked):
            if e["type"] == "missing" and w.path:
                parent, key = tuple(w.path[:-1]), str(w.path[-1])
                if any(p == parent and suggest(t, [key]) for p, t in typos):
                    skip.add(i)
        for i, (e, w) in enumerate(walked):
            if i not in skip:
                loc, message = _schema_message(e, w)
                if e["type"] == "string_type" and self._unquoted_colon(loc):
                    message += f": {UNQUOTED_COLON}"
                self.add(loc, message)

    def _unquoted_colon(self, loc: Loc) -> bool:
        """Whether the value at `loc` is a mapping YAML made of a plain `key: value` (a
        string with `: ` in it, unquoted), not one written as a mapping (`{...}`, or a
        block of several keys)."""
        node = find(self.root, loc)[1]
        if not isinstance(node, yaml.MappingNode) or len(node.value) != 1:
            return False
        text, at = node.start_mark.buffer, node.start_mark.pointer
        return isinstance(text, str) and text[at : at + 1] != "{"


# --- pydantic errors, made readable ---------------------------------------------------


@dataclass
class _Where:
    path: list[str | int] = field(default_factory=list)  # into the YAML document
    owner: type[BaseModel] | None = None  # the model whose field path[-1] is (or is not)
    branches: list[tuple[Loc, Any]] = field(default_factory=list)  # union path -> member


def _walk(model: type[BaseModel], loc: Loc) -> _Where:
    """Follow a pydantic loc through the model's annotations, dropping union labels and tags."""
    tp: Any = model
    w = _Where()
    i = 0
    while i < len(loc):
        elem = loc[i]
        i += 1
        tp = _strip_none(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            w.owner = tp
            w.path.append(elem)
            info = tp.model_fields.get(str(elem))
            tp = info.annotation if info else Any
            if info and info.discriminator and i < len(loc):  # pydantic puts the tag into the loc
                tp = _tags(tp, info.discriminator).get(str(loc[i]), Any)
                i += 1
        elif get_origin(tp) in (Union, types.UnionType):
            label = str(elem).split("[")[0]  # pydantic labels members: str, list[...], ToolConfig
            member = next((m for m in get_args(tp) if _name(m) == label), Any)
            w.branches.append((tuple(w.path), member))
            tp = member
        else:
            w.owner = None
            w.path.append(elem)
            tp = get_args(tp)[-1] if get_origin(tp) in (list, dict) else Any
    return w


def _bools_as_numbers(value: object, data: object, loc: Loc) -> Iterator[Loc]:
    """Where `data` gave true/false for a field `value`'s model declares a number."""
    if isinstance(value, BaseModel) and isinstance(data, dict):
        for name, info in type(value).model_fields.items():
            if name not in data:
                continue
            given = data[name]
            if isinstance(given, bool) and _is_number(info.annotation):
                yield (*loc, name)
            else:
                yield from _bools_as_numbers(getattr(value, name), given, (*loc, name))
    elif isinstance(value, list) and isinstance(data, list):
        for i, (v, d) in enumerate(zip(value, data, strict=False)):
            yield from _bools_as_numbers(v, d, (*loc, i))
    elif isinstance(value, dict) and isinstance(data, dict):
        for key in data:
            if key in value:
                yield from _bools_as_numbers(value[key], data[key], (*loc, key))


def _is_number(tp: Any) -> bool:
    """Whether a field of type `tp` holds a number (int, float, their union, optional)."""
    tp = _strip_none(tp)
    if get_origin(tp) in (Union, types.UnionType):
        return all(m in (int, float, type(None)) for m in get_args(tp))
    return tp in (int, float)


def _is_extra(e: ErrorDetails, w: _Where) -> bool:
    return e["type"] == "extra_forbidden" and bool(w.path)


def _schema_message(e: ErrorDetails, w: _Where) -> tuple[Loc, str]:
    path, kind, value = tuple(w.path), e["type"], e.get("input")
    info = w.owner.model_fields.get(str(path[-1])) if w.owner and path else None
    about = f" ({info.description})" if info and info.description else ""
    if kind == "extra_forbidden":
        key, valid = str(path[-1]), list(w.owner.model_fields) if w.owner else []
        guess = suggest(key, valid) or f" (valid keys: {', '.join(valid)})"
        return path, f"unknown key {key!r}{guess}"
    if kind == "missing":
        return path, f"required key {path[-1]!r} is missing{about}"
    if kind in ("union_tag_invalid", "union_tag_not_found") and info and info.discriminator:
        key = _discriminator_key(info.discriminator)
        tags = list(_tags(info.annotation, info.discriminator))
        if kind == "union_tag_not_found":
            return (*path, key), f"required key {key!r} is missing (one of: {', '.join(tags)})"
        tag = str((e.get("ctx") or {}).get("tag"))
        guess = suggest(tag, tags)
        return (*path, key), f"unknown {path[-1]} {key} {tag!r}{guess}; valid: {', '.join(tags)}"
    if kind == "value_error":  # a model validator: impossible limits, image and recipe...
        return path, e["msg"].removeprefix("Value error, ")
    if kind == "string_pattern_mismatch":
        pattern = (e.get("ctx") or {}).get("pattern")
        return path, f"{value!r} does not match the pattern {pattern}{about}"
    return path, readable(e)


def readable(e: ErrorDetails) -> str:
    """One pydantic error as `should be ..., got ...` (no loc, no pydantic jargon)."""
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"should be a mapping (key: value), got {show(e.get('input'))}"
    msg = e["msg"].split(", unable to")[0]
    if msg.startswith("Input should be "):
        msg = "should be " + msg.removeprefix("Input should be ")
    return f"{msg}, got {show(e.get('input'))}"


UNQUOTED_COLON = (
    "YAML reads an unquoted `: ` as key and value; quote the whole string "
    "('...' or \"...\"), or write it as a `|` block"
)


def _strip_none(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _discriminator_key(discriminator: object) -> str:
    return discriminator if isinstance(discriminator, str) else "type"


def _tags(union: Any, discriminator: object) -> dict[str, Any]:
    """A discriminated union's members by the literal of their discriminator field."""
    key = _discriminator_key(discriminator)
    out: dict[str, Any] = {}
    for member in get_args(union):
        info = getattr(member, "model_fields", {}).get(key)
        for tag in get_args(info.annotation) if info else ():
            out[str(tag)] = member
    return out


def _name(tp: Any) -> str:
    tp = get_origin(tp) or tp
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _kind_of_type(tp: Any) -> str:
    origin = get_origin(tp) or tp
    if origin is list:
        return "list"
    if origin is dict or (isinstance(origin, type) and issubclass(origin, BaseModel)):
        return "mapping"
    return "scalar"


def _kind(value: object) -> str:
    return "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else "scalar"


def _describe(tp: Any) -> str:
    kind = _kind_of_type(tp)
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}
    return f"a {kind}" if kind != "scalar" else names.get(tp, str(tp))


def _get(data: object, path: Loc) -> object:
    for elem in path:
        if isinstance(data, dict):
            data = data.get(elem)
        elif isinstance(data, list) and isinstance(elem, int) and elem < len(data):
            data = data[elem]
        else:
            return None
    return data


# --- small text helpers ---------------------------------------------------------------


def _dotted(loc: Loc, whole: str) -> str:
    out = ""
    for elem in loc:
        if isinstance(elem, int):
            out += f"[{elem}]"
        elif re.fullmatch(r"[A-Za-z_][\w-]*", elem):
            out += f".{elem}" if out else elem
        else:
            out += f"[{json.dumps(elem)}]"
    if loc and isinstance(loc[0], int):  # an item of a top-level list: script[2]
        out = whole + out
    return out or whole


def suggest(word: str, choices: list[str]) -> str:
    """` (did you mean 'x'?)` for the closest of `choices`, or nothing."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def show(value: object) -> str:
    """A value as a message shows it: its kind for containers, a short repr for scalars."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
