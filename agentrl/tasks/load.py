# Over 400 lines: a YAML task's loading (files, instances, placeholders, errors) is one pass.
"""Load a task file: the schema (via agentrl.yamlfile), then the checks across fields.

`check_task` returns every problem as `file:line: field: message` and never raises for
bad input; `load_task` returns the validated Task or raises TaskError listing them all.
Beyond the schema this module owns what only a task has: instances (inline or in a file
beside the task), placeholders, tools and their options, files, the grader, task
folders and the content hash. Paths in a task resolve beside the task file.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentrl.errors import ConfigError, first_line
from agentrl.tasks.instance_files import READERS, FileProblem, rows_yaml
from agentrl.tasks.placeholders import names
from agentrl.tasks.spec import (
    Instance,
    PromptConfig,
    PytestGrader,
    PythonGrader,
    Task,
    TaskSpec,
    ToolConfig,
)
from agentrl.textfile import UnreadableFile, read_text
from agentrl.tools.base import REGISTRY, option_problems, options_model, tool_class
from agentrl.yamlfile import (
    ConfigFileError,
    Loc,
    Problem,
    YamlFile,
    show,
    suggest,
)

__all__ = ["Problem", "TaskError", "check_task", "first_prompts", "load_task", "parse_test_ids"]

INSTANCE_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml", ".csv")
BYTES_PER_TOKEN = 32
"""More bytes per token than any tokenizer packs into a prompt of text (3-5 is usual)."""


class TaskError(ConfigFileError):
    """A task has problems; `problems` lists each, the message has one per line."""

    default_fix = "fix each problem above, then check again with: agentrl validate FILE"


def check_task(path: str | Path) -> list[Problem]:
    """Every problem with the task at `path` (none: it is valid); never raises for bad input."""
    return _Loader(Path(path)).run()[1]


def load_task(path: str | Path) -> Task:
    """The validated task at `path`; raises TaskError listing every problem."""
    task, problems = _Loader(Path(path)).run()
    if task is None:
        raise TaskError(problems)
    return task


def first_prompts(instance: Instance, prompt: PromptConfig) -> tuple[str, str]:
    """The system prompt and the first user message of `instance`, filled (a template
    without a brace comes back as it is: `tasks.placeholders.fill`)."""
    return instance.render(prompt.system), instance.render(prompt.instance)


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


@dataclass
class _Row:
    value: Any
    file: str
    line: int
    loc: Loc


class _Loader(YamlFile):
    def __init__(self, path: Path) -> None:
        super().__init__(path, what="task", keys=("name", "instances", "prompt"))
        self.base = path.parent

    def run(self) -> tuple[Task | None, list[Problem]]:
        data = self.parse()
        if data is None:
            return None, self.problems
        spec = self.validate(TaskSpec, data)
        if spec is None:
            return None, self.sorted_problems()
        instances = self._instances(spec)
        self._placeholders(spec, instances)
        self._tools(spec)
        self._files(spec)
        self._grader(spec, instances)
        if not self.problems:
            self._prompt_sizes(spec, instances)
        if self.problems:
            return None, self.sorted_problems()
        task = Task(
            spec=spec,
            path=str(self.path.resolve()),
            base_dir=str(self.base.resolve()),
            instances=instances,
            hash=self._hash(spec),
        )
        if spec.environment is not None:  # an OpenEnv environment's runtime plays it
            from agentrl.tasks.openenv.load import ENV_RUNTIME

            task = task.model_copy(update={"env": ENV_RUNTIME, "format": "openenv"})
        return task, []

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
                self._at(row, (), f"an instance should be a mapping of fields, got {show(v)}")
            elif "id" not in v:
                self._at(row, (), "instance has no 'id' (each instance needs a unique id)")
            elif isinstance(v["id"], bool) or not isinstance(v["id"], str | int):
                self._at(row, ("id",), f"id should be a string or an integer, got {show(v['id'])}")
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
        line = None if row.file == self.file else row.line
        self.add(row.loc + sub, message, line=line, file=row.file)

    def _read_rows(self, name: str) -> list[_Row] | None:
        path = self.base / name
        if path.suffix not in INSTANCE_SUFFIXES:
            self.add(("instances",), f"{name!r}: an instances file is {_or(INSTANCE_SUFFIXES)}")
            return None
        if not self._beside(name, ("instances",)):
            return None
        try:
            text = read_text(path, what="instances file")
        except UnreadableFile as e:
            if not path.exists():
                self.add(("instances",), _not_found(name, path))
            else:
                self.add(("instances",), f"{name!r}: {e.reason}", line=e.line, file=str(path))
            return None
        try:
            entries = READERS.get(path.suffix, rows_yaml)(text)
        except FileProblem as e:
            self.add(("instances",), e.message, line=e.line, file=str(path))
            return None
        rows = []
        for i, (line, value, error) in enumerate(entries):
            if error:
                self.add(("instances", i), error, line=line, file=str(path))
            else:
                rows.append(_Row(value, str(path), line, ("instances", i)))
        return rows if rows or not entries else None  # None: every entry was reported

    def _placeholders(self, spec: TaskSpec, instances: list[Instance]) -> None:
        fields = sorted({f for inst in instances for f in inst.fields})
        for loc, text, kind in spec.templates():  # one way to read them (tasks.placeholders)
            try:
                found = names(text, kind)
            except ValueError as e:
                self.add(loc, f"{e} (write {{{{ or }}}} for a literal brace)")
                continue
            for name, newlines, after_dollar in found:
                line = self.line_in(loc, newlines)
                base = re.split(r"[.\[:!]", name, maxsplit=1)[0]
                if not base.isidentifier():  # a prompt's: a shell template's stay literal
                    hint = "use {field}, or {{ }} for literal braces"
                    self.add(loc, f"placeholder {{{name}}} names no field: {hint}", line=line)
                    continue
                if name != base:
                    hint = "no format spec, conversion, attribute or index; {{ }} for braces"
                    msg = f"placeholder {{{name}}}: only plain {{field}} placeholders are filled"
                    self.add(loc, f"{msg} ({hint})", line=line)
                    continue
                lacking = [inst for inst in instances if base != "id" and base not in inst.fields]
                if not lacking:
                    continue
                if len(lacking) == len(instances):
                    guess = suggest(base, [*fields, "id"])
                    msg = f"placeholder {{{base}}}: no instance has a field {base!r}{guess}"
                    msg += f"; fields: {', '.join(fields) or 'none but id'}"
                else:
                    guess = suggest(base, list(lacking[0].fields))
                    who = f"instance {_ids(lacking)}"
                    msg = f"placeholder {{{base}}}: {who} has no field {base!r}{guess}"
                if after_dollar:
                    msg += f"; for a shell variable write ${{{{{base}}}}}"
                elif kind == "shell" and len(lacking) == len(instances):
                    msg += f"; a literal brace is written {{{{{base}}}}}"
                self.add(loc, msg, line=line)

    def _prompt_sizes(self, spec: TaskSpec, instances: list[Instance]) -> None:
        # Without the run's tokenizer, only what cannot fit any: over BYTES_PER_TOKEN bytes
        # a token. `agentrl run` and `train` count the real tokens before the first episode.
        limit = BYTES_PER_TOKEN * spec.limits.context_length
        templates = (spec.prompt.system, spec.prompt.instance)
        fixed = sum(len(t.encode()) for t in templates)
        slots = sum(t.count("{") for t in templates)  # a value per opening brace at most
        for inst in instances:
            # Filled only when it could pass the limit: a field's text is 4 bytes a character
            # at most.
            longest = max([len(inst.id), *(len(str(v)) for v in inst.fields.values())])
            if fixed + 4 * slots * longest <= limit:
                continue
            size = sum(len(text.encode()) for text in first_prompts(inst, spec.prompt))
            if size > limit:
                msg = f"instance {inst.id!r}: the prompt is {size:,} bytes, which cannot fit "
                msg += f"limits.context_length ({spec.limits.context_length:,} tokens)"
                self.add(("prompt", "instance"), f"{msg}: shorten it or raise the limit")
                return

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
                msg = f"unknown tool {cfg.name!r}{suggest(cfg.name, list(REGISTRY))}"
                self.add(loc, str(e) if known else f"{msg}; registered: {choices}, or module:Class")
                continue
            except Exception as e:  # a tool module that fails to import is the user's to fix
                self.add(loc, f"cannot import tool {cfg.name!r}: {first_line(e, typed=True)}")
                continue
            self._options(cls, cfg, ("tools", i))
        if spec.prompt.action_format == "bash_block" and "bash" not in seen:
            self.add(
                ("prompt", "action_format"),
                "bash_block runs its blocks in the bash tool: list bash under tools",
            )

    def _options(self, cls: type, cfg: ToolConfig, loc: Loc) -> None:
        """The options against the tool's own `Options` model (the one its constructor uses)."""
        model = options_model(cls)
        if model is None:  # it declares none: only its constructor can check them
            return
        try:
            model.model_validate(cfg.options)
        except ValidationError as e:
            for where, message in option_problems(cls, e):
                at = (*loc, "options", *where) if cfg.options else loc
                self.add(at, message if where else f"{cls.__name__}: {message}")

    def _beside(self, name: str, loc: Loc) -> bool:
        """Whether `name` stays inside the task's folder (links followed); else a problem."""
        base = self.base.resolve()
        where = (base / name).resolve()
        if Path(name).is_absolute() or not where.is_relative_to(base):
            msg = f"{name!r} is outside the task's folder ({base}): paths in a task stay inside it"
            self.add(loc, f"{msg}; copy what it needs beside the task")
            return False
        return True

    def _files(self, spec: TaskSpec) -> None:
        for section, files in (("sandbox", spec.sandbox.files), ("grader", spec.grader.files)):
            for dest, src in files.items():
                loc: Loc = (section, "files", dest)
                path = self.base / src
                if not self._beside(src, loc):
                    continue
                if not path.exists():
                    self.add(loc, _not_found(src, path, "beside the task"))
                elif not (path.is_file() or path.is_dir()):
                    self.add(loc, f"{src!r} is not a regular file or folder (a FIFO, a device?)")
        if (env := spec.environment) is not None and self._beside(env, ("environment",)):
            from agentrl.tasks.openenv.load import MANIFEST

            if not (self.base / env / MANIFEST).is_file():
                self.add(
                    ("environment",), f"{env!r} is no OpenEnv environment folder (no {MANIFEST})"
                )
            elif not any(
                (self.base / env / p).is_file() for p in ("server/Dockerfile", "Dockerfile")
            ):
                self.add(
                    ("environment",), f"{env!r} has no server/Dockerfile to build its image from"
                )
        if (recipe := spec.sandbox.recipe) and self._beside(recipe, ("sandbox", "recipe")):
            folder = self.base / recipe
            if not folder.is_dir():
                self.add(("sandbox", "recipe"), f"recipe folder {recipe!r} not found ({folder})")
            elif not (folder / "Dockerfile").is_file():
                self.add(("sandbox", "recipe"), f"recipe folder {recipe!r} has no Dockerfile")

    def _grader(self, spec: TaskSpec, instances: list[Instance]) -> None:
        grader = spec.grader
        if isinstance(grader, PythonGrader):
            from agentrl.tasks.graders import load_function

            try:
                fn = load_function(grader.function, self.base)
            except ConfigError as e:
                self.add(("grader", "function"), e.message)
            except Exception as e:  # importing user code may raise anything: report it
                self.add(("grader", "function"), f"cannot import: {first_line(e, typed=True)}")
            else:
                self._awaits(fn, grader.function)
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
                    msg = f"{who} has a field {name!r}{suggest(name, fields)}"
                    if key not in grader.model_fields_set:
                        msg += f" ({key} names it by default): list the tests in the task"
                        msg += ", or `pass_to_pass: []` for none" if key == "pass_to_pass" else ""
                    self.add(("grader", key), msg)
                if bad:
                    msg = f"field {name!r} of instance {_ids(bad)} is not a list of test ids"
                    self.add(("grader", key), msg + " (nor a JSON string of one)")

    def _awaits(self, fn: Callable[..., object], name: str) -> None:
        """A python grader must be a coroutine function: the sandbox's methods are
        coroutines, and a plain function cannot await them. Reported at its `def` line."""
        call = type(fn).__call__  # an object whose __call__ is `async def` is one too
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call):
            return
        code = getattr(inspect.unwrap(fn), "__code__", None)
        attr = name.partition(":")[2]
        msg = f"grader {name} is not a coroutine function: it cannot await the sandbox"
        msg += f"; write `async def {attr}(sandbox, instance)`"
        if code is None:
            self.add(("grader", "function"), msg)
        else:
            self.add(("grader", "function"), msg, line=code.co_firstlineno, file=code.co_filename)

    def _hash(self, spec: TaskSpec) -> str:
        paths = [self.path]
        if isinstance(spec.instances, str):
            paths.append(self.base / spec.instances)
        copied = (*spec.sandbox.files.values(), *spec.grader.files.values())
        paths += [self.base / src for src in copied]
        if spec.sandbox.recipe:
            paths.append(self.base / spec.sandbox.recipe)
        if spec.environment:
            paths.append(self.base / spec.environment)
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


def _not_found(name: str, path: Path, where: str = "") -> str:
    """`name` is missing at `path`: the message, with the closest name in its folder."""
    try:
        siblings = sorted(p.name for p in path.parent.iterdir())
    except OSError:  # no such folder either
        siblings = []
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
    guess = f" (did you mean {str(Path(name).parent / close[0])!r}?)" if close else ""
    return f"{name!r} not found{f' {where}' if where else ''}{guess} (looked for {path})"


def _ids(instances: list[Instance]) -> str:
    shown = ", ".join(repr(i.id) for i in instances[:3])
    return shown + (f" and {len(instances) - 3} more" if len(instances) > 3 else "")


def _or(items: Sequence[str]) -> str:
    return ", ".join(items[:-1]) + f" or {items[-1]}"
