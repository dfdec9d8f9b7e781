"""Load a task file: YAML with line numbers, the schema, then the checks across fields.

`check_task` returns every problem as `file:line: field: message` and never raises for
bad input; `load_task` returns the validated Task or raises TaskError listing them all.
Lines come from the YAML node tree, so a pydantic error's loc points at the offending
key (for a missing key: at its parent). Paths in a task resolve beside the task file.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import string
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import ErrorDetails

from agentrl.errors import ConfigError
from agentrl.tasks.spec import (
    CommandGrader,
    Instance,
    PytestGrader,
    PythonGrader,
    Task,
    TaskSpec,
    ToolConfig,
)
from agentrl.tools.base import REGISTRY, tool_class

Loc = tuple[str | int, ...]
TASK_SUFFIXES = (".yaml", ".yml")
INSTANCE_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml", ".csv")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a task, at a line of a file."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.message}"


class TaskError(ConfigError):
    """A task has problems; `problems` lists each, the message has one per line."""

    default_fix = "fix each problem above, then check again with: agentrl validate FILE"

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("\n".join(map(str, problems)))
        self.problems = list(problems)


def is_task_path(path: str | Path) -> bool:
    """A task file (.yaml/.yml), or a task folder (Terminal-Bench task.yaml, Harbor task.toml)."""
    p = Path(path)
    if p.is_dir():
        return (p / "task.yaml").is_file() or (p / "task.toml").is_file()
    return p.suffix in TASK_SUFFIXES


def check_task(path: str | Path) -> list[Problem]:
    """Every problem with the task at `path` (none: it is valid); never raises for bad input."""
    return _Loader(Path(path)).run()[1]


def load_task(path: str | Path) -> Task:
    """The validated task at `path`; raises TaskError listing every problem."""
    task, problems = _Loader(Path(path)).run()
    if task is None:
        raise TaskError(problems)
    return task


def parse_test_ids(value: object) -> list[str] | None:
    """A FAIL_TO_PASS-style field as a list of test ids (SWE-bench publishes JSON strings)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _load_folder(path: Path) -> tuple[Task | None, list[Problem]]:
    # The hook for imported formats: Terminal-Bench (task.yaml) and Harbor (task.toml)
    # folders become a Task in agentrl.tasks.terminal.load_terminal_task.
    if not is_task_path(path):
        return None, [Problem(str(path), 1, "task", "no task.yaml or task.toml in this folder")]
    if importlib.util.find_spec("agentrl.tasks.terminal") is None:
        return None, [Problem(str(path), 1, "task", "task folders are not supported yet")]
    from agentrl.tasks.terminal import load_terminal_task

    try:
        return load_terminal_task(path), []
    except TaskError as e:
        return None, e.problems
    except ConfigError as e:
        return None, [Problem(str(path), 1, "task", str(e))]


class _FileProblem(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line, self.message = line, message


@dataclass
class _Row:
    value: Any
    file: str
    line: int
    loc: Loc


class _Loader:
    def __init__(self, path: Path) -> None:
        self.path, self.file, self.base = path, str(path), path.parent
        self.root: yaml.Node | None = None
        self.problems: list[Problem] = []

    def add(self, loc: Loc, message: str, *, line: int | None = None) -> None:
        self.problems.append(Problem(self.file, line or self.line(loc), _dotted(loc), message))

    def line(self, loc: Loc) -> int:
        return _find(self.root, loc)[0]

    def run(self) -> tuple[Task | None, list[Problem]]:
        if self.path.is_dir():
            return _load_folder(self.path)
        data = self._parse()
        if data is None:
            return None, self.problems
        try:
            spec = TaskSpec.model_validate(data)
        except ValidationError as e:
            self._schema_problems(e.errors(), data)
            return None, self._sorted()
        instances = self._instances(spec)
        self._placeholders(spec, instances)
        self._tools(spec)
        self._files(spec)
        self._grader(spec, instances)
        if self.problems:
            return None, self._sorted()
        task = Task(
            spec=spec,
            path=str(self.path.resolve()),
            base_dir=str(self.base.resolve()),
            instances=instances,
            hash=self._hash(spec),
        )
        return task, []

    def _sorted(self) -> list[Problem]:
        unique = list(dict.fromkeys(self.problems))
        return sorted(unique, key=lambda p: (p.file != self.file, p.file, p.line))

    def _parse(self) -> dict[str, Any] | None:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            what = "file not found" if isinstance(e, FileNotFoundError) else f"cannot read: {e}"
            self.problems.append(Problem(self.file, 1, "task", what))
            return None
        try:
            self.root, data = _compose(text)
        except yaml.YAMLError as e:
            self.problems.append(Problem(self.file, *_yaml_error(e, text)))
            return None
        if data is None:
            self.add((), "the file is empty: a task is a mapping with name, instances, prompt...")
        elif not isinstance(data, dict):
            self.add((), f"the top level should be a mapping (name: ..., ...), got {_show(data)}")
        else:
            for loc, line, first in _duplicate_keys(self.root, ()):
                self.add(loc, f"duplicate key (first on line {first}): remove one", line=line)
            return data
        return None

    def _schema_problems(self, errors: list[ErrorDetails], data: object) -> None:
        walked = [(e, _walk(e["loc"])) for e in errors]
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
                self.add(prefix, f"should be {' or '.join(members)}, got {_show(value)}")
            else:
                skip |= {i for i, m in items if _kind_of_type(m) != _kind(value)}
        # A misspelt key is reported once, as unknown: not also as the required key it misses.
        typos = {(tuple(w.path[:-1]), str(w.path[-1])) for e, w in walked if _is_extra(e, w)}
        for i, (e, w) in enumerate(walked):
            if e["type"] == "missing" and w.path:
                parent, key = tuple(w.path[:-1]), str(w.path[-1])
                if any(p == parent and _suggest(t, [key]) for p, t in typos):
                    skip.add(i)
        for i, (e, w) in enumerate(walked):
            if i not in skip:
                loc, message = _schema_message(e, w)
                self.add(loc, message)

    def _instances(self, spec: TaskSpec) -> list[Instance]:
        if isinstance(spec.instances, str):
            rows = self._read_rows(spec.instances)
        else:
            rows = [
                _Row(v, self.file, self.line(("instances", i)), ("instances", i))
                for i, v in enumerate(spec.instances)
            ]
        if not rows:
            if rows is not None:
                self.add(("instances",), "no instances: give at least one")
            return []
        out: list[Instance] = []
        first: dict[str, int] = {}
        for row in rows:
            v = row.value
            if not isinstance(v, dict):
                self._at(row, (), f"an instance should be a mapping of fields, got {_show(v)}")
            elif "id" not in v:
                self._at(row, (), "instance has no 'id' (each instance needs a unique id)")
            elif isinstance(v["id"], bool) or not isinstance(v["id"], str | int):
                self._at(row, ("id",), f"id should be a string or an integer, got {_show(v['id'])}")
            elif v["id"] == "":
                self._at(row, ("id",), "id is empty (each instance needs a unique id)")
            elif (iid := str(v["id"])) in first:
                self._at(row, ("id",), f"duplicate id {iid!r} (first on line {first[iid]})")
            else:
                first[iid] = row.line
                fields = {str(k): x for k, x in v.items() if k != "id"}
                out.append(Instance(id=iid, fields=fields))
        return out

    def _at(self, row: _Row, sub: Loc, message: str) -> None:
        inline = row.file == self.file
        line = self.line(row.loc + sub) if inline else row.line
        self.problems.append(Problem(row.file, line, _dotted(row.loc + sub), message))

    def _read_rows(self, name: str) -> list[_Row] | None:
        path = self.base / name
        if path.suffix not in INSTANCE_SUFFIXES:
            self.add(("instances",), f"{name!r}: an instances file is {_or(INSTANCE_SUFFIXES)}")
            return None
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            missing = isinstance(e, FileNotFoundError)
            msg = f"{name!r} not found (looked for {path})" if missing else _one_line(e)
            self.add(("instances",), msg)
            return None
        reader = {".jsonl": _rows_jsonl, ".json": _rows_json, ".csv": _rows_csv}.get(path.suffix)
        try:
            entries = (reader or _rows_yaml)(text)
        except _FileProblem as e:
            self.problems.append(Problem(str(path), e.line, "instances", e.message))
            return None
        rows = []
        for i, (line, value, error) in enumerate(entries):
            if error:
                self.problems.append(Problem(str(path), line, f"instances[{i}]", error))
            else:
                rows.append(_Row(value, str(path), line, ("instances", i)))
        return rows if rows or not entries else None  # None: every entry was reported

    def _placeholders(self, spec: TaskSpec, instances: list[Instance]) -> None:
        templates: list[tuple[Loc, str]] = [
            (("prompt", "system"), spec.prompt.system),
            (("prompt", "instance"), spec.prompt.instance),
        ]
        if isinstance(spec.grader, CommandGrader):
            templates.append((("grader", "command"), spec.grader.command))
        fields = sorted({f for inst in instances for f in inst.fields})
        for loc, text in templates:
            try:
                names = _fill_names(text) if loc[0] == "grader" else _format_names(text)
            except ValueError as e:
                self.add(loc, f"{e} (write {{{{ or }}}} for a literal brace)")
                continue
            for name, newlines, after_dollar in names:
                line = _line_in(self.root, loc, newlines)
                base = re.split(r"[.\[]", name, maxsplit=1)[0]
                if not base or base.isdigit():
                    hint = "use {field}, or {{ }} for literal braces"
                    self.add(loc, f"placeholder {{{name}}} names no field: {hint}", line=line)
                    continue
                lacking = [inst for inst in instances if base != "id" and base not in inst.fields]
                if not lacking:
                    continue
                if len(lacking) == len(instances):
                    guess = _suggest(base, [*fields, "id"])
                    msg = f"placeholder {{{base}}}: no instance has a field {base!r}{guess}"
                    msg += f"; fields: {', '.join(fields) or 'none but id'}"
                else:
                    guess = _suggest(base, list(lacking[0].fields))
                    who = f"instance {_ids(lacking)}"
                    msg = f"placeholder {{{base}}}: {who} has no field {base!r}{guess}"
                if after_dollar:
                    msg += f"; for a shell variable write ${{{{{base}}}}}"
                self.add(loc, msg, line=line)

    def _tools(self, spec: TaskSpec) -> None:
        seen: dict[str, int] = {}
        for i, item in enumerate(spec.tools):
            cfg = ToolConfig(name=item) if isinstance(item, str) else item
            loc: Loc = ("tools", i) if isinstance(item, str) else ("tools", i, "name")
            if cfg.name in seen:
                self.add(loc, f"tool {cfg.name!r} is listed twice (also tools[{seen[cfg.name]}])")
                continue
            seen[cfg.name] = i
            try:
                cls = tool_class(cfg.name)
            except ConfigError as e:
                known = cfg.name in REGISTRY or ":" in cfg.name
                choices = ", ".join(sorted(REGISTRY))
                msg = f"unknown tool {cfg.name!r}{_suggest(cfg.name, list(REGISTRY))}"
                self.add(loc, str(e) if known else f"{msg}; registered: {choices}, or module:Class")
                continue
            except Exception as e:  # a tool module that fails to import is the user's to fix
                self.add(loc, f"cannot import tool {cfg.name!r}: {_one_line(e)}")
                continue
            self._options(cls, cfg, ("tools", i))

    def _options(self, cls: type, cfg: ToolConfig, loc: Loc) -> None:
        try:
            sig = inspect.signature(cls, eval_str=True)
        except Exception:  # no introspectable signature: nothing to check against
            return
        params = sig.parameters
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names = [n for n, p in params.items() if p.kind in kinds]
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            unknown = [k for k in cfg.options if k not in names]
            for key in unknown:
                options = f"; its options: {', '.join(names) or 'none'}"
                msg = f"{cls.__name__} has no option {key!r}{_suggest(key, names)}{options}"
                self.add((*loc, "options", key), msg)
            if unknown:
                return
        try:
            sig.bind(**cfg.options)
        except TypeError as e:
            self.add((*loc, "options") if cfg.options else loc, f"{cls.__name__}: {e}")
            return
        for key, value in cfg.options.items():
            annotation = params[key].annotation if key in params else inspect.Parameter.empty
            if annotation is inspect.Parameter.empty:
                continue
            try:
                TypeAdapter(annotation).validate_python(value)
            except ValidationError as e:
                self.add((*loc, "options", key), _readable(e.errors()[0]))
            except Exception:  # an annotation pydantic cannot check: the constructor will
                continue

    def _files(self, spec: TaskSpec) -> None:
        for section, files in (("sandbox", spec.sandbox.files), ("grader", spec.grader.files)):
            for dest, src in files.items():
                if not (self.base / src).exists():
                    msg = f"{src!r} not found beside the task (looked for {self.base / src})"
                    self.add((section, "files", dest), msg)
        if recipe := spec.sandbox.recipe:
            folder = self.base / recipe
            if not folder.is_dir():
                self.add(("sandbox", "recipe"), f"recipe folder {recipe!r} not found ({folder})")
            elif not (folder / "Dockerfile").is_file():
                self.add(("sandbox", "recipe"), f"recipe folder {recipe!r} has no Dockerfile")

    def _grader(self, spec: TaskSpec, instances: list[Instance]) -> None:
        grader = spec.grader
        if isinstance(grader, PythonGrader):
            from agentrl.tasks.graders import load_function  # the grader's own resolution

            try:
                load_function(grader.function, self.base)
            except ConfigError as e:
                self.add(("grader", "function"), e.message)
            except Exception as e:  # importing user code may raise anything: report it
                self.add(("grader", "function"), f"cannot import: {_one_line(e)}")
        elif isinstance(grader, PytestGrader):
            for key in ("fail_to_pass", "pass_to_pass"):
                name = getattr(grader, key)
                if not isinstance(name, str):
                    continue
                lacking = [i for i in instances if name not in i.fields]
                given = [i for i in instances if name in i.fields]
                bad = [i for i in given if parse_test_ids(i.fields[name]) is None]
                if lacking:
                    who = "no instance" if len(lacking) == len(instances) else _ids(lacking)
                    fields = sorted({f for i in instances for f in i.fields})
                    self.add(("grader", key), f"{who} has a field {name!r}{_suggest(name, fields)}")
                if bad:
                    msg = f"field {name!r} of instance {_ids(bad)} is not a list of test ids"
                    self.add(("grader", key), msg + " (nor a JSON string of one)")

    def _hash(self, spec: TaskSpec) -> str:
        paths = [self.path]
        if isinstance(spec.instances, str):
            paths.append(self.base / spec.instances)
        copied = (*spec.sandbox.files.values(), *spec.grader.files.values())
        paths += [self.base / src for src in copied]
        if spec.sandbox.recipe:
            paths.append(self.base / spec.sandbox.recipe)
        if isinstance(spec.grader, PythonGrader):  # a grader module beside the task, if any
            module = spec.grader.function.partition(":")[0]
            beside = self.base.joinpath(*module.split(".")).with_suffix(".py")
            if beside.is_file():
                paths.append(beside)
        h = hashlib.sha256()
        for p in paths:
            for f in sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]:
                data = f.read_bytes()
                # Names relative to the task, so the hash is the same wherever the task lives.
                name = Path(os.path.relpath(f, self.base)).as_posix()
                h.update(f"{name}\0{len(data)}\0".encode())
                h.update(data)
        return h.hexdigest()[:16]


# --- YAML with positions ---------------------------------------------------------------


def _compose(text: str) -> tuple[yaml.Node | None, Any]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    finally:
        loader.dispose()


def _yaml_error(e: yaml.YAMLError, text: str) -> tuple[int, str, str]:
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        msg = e.problem or e.context or "invalid YAML"
        if e.problem and e.context:
            where = f" on line {e.context_mark.line + 1}" if e.context_mark else ""
            msg = f"{e.problem} ({e.context}{where})"
        return (mark.line + 1 if mark else 1), "yaml", msg
    if isinstance(e, yaml.reader.ReaderError):
        return text[: e.position].count("\n") + 1, "yaml", f"{e.reason} (character {e.character!r})"
    return 1, "yaml", _one_line(e)


def _find(root: yaml.Node | None, loc: Loc) -> tuple[int, yaml.Node | None]:
    """The line of the key (or item) at `loc` and its node; if absent, its nearest parent's."""
    node = root
    line = root.start_mark.line + 1 if root is not None else 1
    for elem in loc:
        if isinstance(node, yaml.MappingNode):
            pairs = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]
            match = [(k, v) for k, v in pairs if k.value == str(elem)]
            if not match:
                return line, None
            key, node = match[-1]  # the last duplicate is the one the data holds
            line = key.start_mark.line + 1
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(elem, int) and elem < len(node.value)
        ):
            node = node.value[elem]
            line = node.start_mark.line + 1
        else:
            return line, None
    return line, node


def _line_in(root: yaml.Node | None, loc: Loc, newlines: int) -> int:
    """The line `newlines` lines into the string at `loc`, exact for `|` block scalars."""
    line, node = _find(root, loc)
    if isinstance(node, yaml.ScalarNode) and node.style == "|":
        return node.start_mark.line + 2 + newlines
    return line


def _duplicate_keys(node: yaml.Node | None, loc: Loc) -> list[tuple[Loc, int, int]]:
    out: list[tuple[Loc, int, int]] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for k, v in node.value:
            key, line = str(k.value), k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and key in first:
                out.append(((*loc, key), line, first[key]))
            first.setdefault(key, line)
            out += _duplicate_keys(v, (*loc, key))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out += _duplicate_keys(item, (*loc, i))
    return out


# --- placeholders: (name, newlines before it, right after a `$`) ----------------------

# The grader fills its command like graders.fill: `${VAR}` and other braces stay as written.
_FILL_PLACEHOLDER = re.compile(r"(?<!\$)\{(\w+)\}")


def _format_names(text: str) -> list[tuple[str, int, bool]]:
    """Placeholders as str.format reads them (the prompts); ValueError for a stray brace."""
    out, newlines, seen = [], 0, set()
    for literal, name, _spec, _conv in string.Formatter().parse(text):
        newlines += literal.count("\n")
        if name is not None and name not in seen:
            seen.add(name)
            out.append((name, newlines, literal.endswith("$")))
    return out


def _fill_names(text: str) -> list[tuple[str, int, bool]]:
    out: list[tuple[str, int, bool]] = []
    for m in _FILL_PLACEHOLDER.finditer(text):
        if all(m.group(1) != name for name, _n, _d in out):
            out.append((m.group(1), text[: m.start()].count("\n"), False))
    return out


# --- instances files: (line, value, error) per entry ---------------------------------


def _rows_jsonl(text: str) -> list[tuple[int, Any, str | None]]:
    out: list[tuple[int, Any, str | None]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((n, json.loads(line), None))
            except json.JSONDecodeError as e:
                out.append((n, None, f"invalid JSON: {e.msg} (column {e.colno})"))
    return out


def _rows_json(text: str) -> list[tuple[int, Any, str | None]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _FileProblem(e.lineno, f"invalid JSON: {e.msg} (column {e.colno})") from e
    if not isinstance(data, list):
        raise _FileProblem(1, f"should be a JSON list of instances, got {_show(data)}")
    try:  # JSON is YAML: the node tree gives each entry's line
        node = _compose(text)[0]
        lines = [n.start_mark.line + 1 for n in node.value] if node else []
    except yaml.YAMLError:
        lines = []
    if len(lines) != len(data):
        lines = [1] * len(data)
    return [(line, v, None) for line, v in zip(lines, data, strict=True)]


def _rows_yaml(text: str) -> list[tuple[int, Any, str | None]]:
    try:
        node, data = _compose(text)
    except yaml.YAMLError as e:
        line, _field, msg = _yaml_error(e, text)
        raise _FileProblem(line, msg) from e
    if data is None:
        return []
    if not isinstance(data, list) or not isinstance(node, yaml.SequenceNode):
        raise _FileProblem(1, f"should be a list of instances, got {_show(data)}")
    return [(n.start_mark.line + 1, v, None) for n, v in zip(node.value, data, strict=True)]


def _rows_csv(text: str) -> list[tuple[int, Any, str | None]]:
    reader = csv.DictReader(io.StringIO(text))
    out: list[tuple[int, Any, str | None]] = []
    try:
        for row in reader:
            extra = row.pop(None, None)  # type: ignore[call-overload]  # DictReader's restkey
            error = f"{len(extra)} more cell(s) than the header" if extra else None
            out.append((reader.line_num, row, error))
    except csv.Error as e:
        raise _FileProblem(reader.line_num, f"invalid CSV: {e}") from e
    return out


# --- pydantic errors, made readable ---------------------------------------------------


@dataclass
class _Where:
    path: list[str | int] = field(default_factory=list)  # into the YAML document
    owner: type[BaseModel] | None = None  # the model whose field path[-1] is (or is not)
    branches: list[tuple[Loc, Any]] = field(default_factory=list)  # union path -> member


def _walk(loc: Loc) -> _Where:
    """Follow a pydantic loc through TaskSpec's annotations, dropping union labels and tags."""
    tp: Any = TaskSpec
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
            if info and info.discriminator and i < len(loc):
                tp = _tags(tp).get(str(loc[i]), Any)  # pydantic puts the tag into the loc
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


def _is_extra(e: ErrorDetails, w: _Where) -> bool:
    return e["type"] == "extra_forbidden" and bool(w.path)


def _schema_message(e: ErrorDetails, w: _Where) -> tuple[Loc, str]:
    path, kind, value = tuple(w.path), e["type"], e.get("input")
    info = w.owner.model_fields.get(str(path[-1])) if w.owner and path else None
    about = f" ({info.description})" if info and info.description else ""
    if kind == "extra_forbidden":
        key, valid = str(path[-1]), list(w.owner.model_fields) if w.owner else []
        guess = _suggest(key, valid) or f" (valid keys: {', '.join(valid)})"
        return path, f"unknown key {key!r}{guess}"
    if kind == "missing":
        return path, f"required key {path[-1]!r} is missing{about}"
    if kind in ("union_tag_invalid", "union_tag_not_found") and info:
        tags = list(_tags(info.annotation))
        if kind == "union_tag_not_found":
            return (*path, "type"), f"required key 'type' is missing (one of: {', '.join(tags)})"
        tag = str((e.get("ctx") or {}).get("tag"))
        guess = _suggest(tag, tags)
        return (*path, "type"), f"unknown {path[-1]} type {tag!r}{guess}; valid: {', '.join(tags)}"
    if kind == "value_error":  # a model validator: impossible limits, image and recipe...
        return path, e["msg"].removeprefix("Value error, ")
    if kind == "string_pattern_mismatch":
        pattern = (e.get("ctx") or {}).get("pattern")
        return path, f"{value!r} does not match the pattern {pattern}{about}"
    return path, _readable(e)


def _readable(e: ErrorDetails) -> str:
    if e["type"] in ("model_type", "model_attributes_type", "dict_type"):
        return f"should be a mapping (key: value), got {_show(e.get('input'))}"
    msg = e["msg"].split(", unable to")[0]
    if msg.startswith("Input should be "):
        msg = "should be " + msg.removeprefix("Input should be ")
    return f"{msg}, got {_show(e.get('input'))}"


def _strip_none(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _tags(union: Any) -> dict[str, Any]:
    """A discriminated union's members by their `type` literal."""
    out: dict[str, Any] = {}
    for member in get_args(union):
        for tag in get_args(member.model_fields["type"].annotation):
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


def _dotted(loc: Loc) -> str:
    out = ""
    for elem in loc:
        if isinstance(elem, int):
            out += f"[{elem}]"
        elif re.fullmatch(r"[A-Za-z_][\w-]*", elem):
            out += f".{elem}" if out else elem
        else:
            out += f"[{json.dumps(elem)}]"
    return out or "task"


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _show(value: object) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "nothing (null)"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _ids(instances: list[Instance]) -> str:
    shown = ", ".join(repr(i.id) for i in instances[:3])
    return shown + (f" and {len(instances) - 3} more" if len(instances) > 3 else "")


def _or(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + f" or {items[-1]}"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
