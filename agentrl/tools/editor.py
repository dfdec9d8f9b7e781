"""The `str_replace_editor` tool: view, create, str_replace, insert and undo_edit.

Same commands, arguments and messages as the SWE-agent / OpenHands editor that agents
are trained on; what it does to files (bytes through the sandbox, CRLF and binary files
kept intact) is in `editor_files`. Mistakes of the agent (a relative path, a missing
argument, an ambiguous `old_str`) come back as an `Observation` with `error=True`; only
sandbox failures raise.

Undo history lives in the tool instance (one per episode): a stack per path of the
bytes before each edit, where `create` records "did not exist", so undoing a
`create` removes the file again (directories it made are left in place).
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import shlex
from typing import Any, Literal, TypeVar, get_args

from pydantic import Field, field_validator

from agentrl.sandbox.base import Sandbox
from agentrl.tools.base import ModelTool, Observation, ToolArgs, ToolOptions
from agentrl.tools.editor_files import (
    Directory,
    Missing,
    Refused,
    Text,
    clip,
    lines,
    list_directory,
    number,
    occurrences,
    quoted,
    read,
    sh,
    write,
)

__all__ = ["COMMANDS", "EditorArgs", "EditorOptions", "EditorTool", "clip"]

T = TypeVar("T")
Command = Literal["view", "create", "str_replace", "insert", "undo_edit"]
COMMANDS: tuple[str, ...] = get_args(Command)
_REVIEW = "Review the changes and make sure they are as expected. Edit the file again if necessary."


class EditorArgs(ToolArgs):
    command: Command = Field(description="The command to run: " + ", ".join(COMMANDS) + ".")
    path: str = Field(description="Absolute path to a file or directory, e.g. `/workspace/app.py`.")
    file_text: str | None = Field(
        default=None, description="Required for `create`: the content of the new file."
    )
    old_str: str | None = Field(
        default=None, description="Required for `str_replace`: the exact text to replace."
    )
    new_str: str | None = Field(
        default=None,
        description="For `str_replace`: the replacement (empty deletes `old_str`). "
        "Required for `insert`: the text to insert.",
    )
    insert_line: int | None = Field(
        default=None,
        description="Required for `insert`: `new_str` goes after this line (0 inserts at the top).",
    )
    view_range: list[int] | None = Field(
        default=None,
        min_length=2,
        max_length=2,
        description="Optional for `view` on a file: [start, end] line numbers, "
        "1-based and inclusive; end -1 shows to the end of the file.",
    )

    @field_validator("insert_line", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"The `insert_line` argument must be an integer, got {value!r}.")
        return value

    @field_validator("view_range", mode="before")
    @classmethod
    def _two_integers(cls, value: Any) -> Any:
        if isinstance(value, str) and value.startswith("["):  # the list, JSON-encoded
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(value)
        if value is None:
            return None
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ValueError(f"Invalid `view_range` {value!r}: it must be a list of two integers.")
        for item in value:  # numbers some models quote are read as numbers
            if isinstance(item, bool) or not isinstance(item, int | str):
                raise ValueError(f"Invalid `view_range`: {item!r} must be an integer.")
            if isinstance(item, str) and not item.strip().lstrip("-").isdigit():
                raise ValueError(f"Invalid `view_range`: {item!r} must be an integer.")
        return [int(item) for item in value]


class EditorOptions(ToolOptions):
    max_output_chars: int = Field(default=10_000, description="longest observation (400+)")
    snippet_lines: int = Field(default=4, ge=0, description="context lines around an edit")
    undo_depth: int = Field(default=10, ge=0, description="edits per file that can be undone")

    @field_validator("max_output_chars")
    @classmethod
    def _room(cls, value: int) -> int:
        if value < 400:
            raise ValueError(f"max_output_chars={value} is too small: use 400+")
        return value


class EditorTool(ModelTool[EditorArgs, EditorOptions]):
    """View, create and edit files in the sandbox; per-path undo for this episode."""

    name = "str_replace_editor"
    description = (
        "Custom editing tool for viewing, creating and editing files.\n"
        "* State is persistent across calls; `path` must be an absolute path.\n"
        "* If `path` is a file, `view` shows it like `cat -n` (use `view_range` for part "
        "of a long file); if `path` is a directory, `view` lists the files and directories "
        "in it up to 2 levels deep, hiding hidden ones.\n"
        "* `create` makes a new file with `file_text`; it cannot overwrite an existing file.\n"
        "* Long outputs are truncated and marked with `<response clipped>`.\n"
        "* `undo_edit` reverts the last edit made to the file at `path`.\n"
        "Notes for `str_replace`:\n"
        "* `old_str` must match EXACTLY one or more consecutive lines of the file, "
        "whitespace and indentation included.\n"
        "* If `old_str` is not unique in the file, nothing is replaced; include enough "
        "context in `old_str` to make it unique.\n"
        "* `new_str` replaces `old_str`; leave it out or empty to delete `old_str`."
    )
    Args = EditorArgs
    Options = EditorOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._history: dict[str, list[bytes | None]] = {}

    async def run(self, sandbox: Sandbox, args: EditorArgs) -> Observation:
        limit = self.options.max_output_chars
        try:
            text = await self._run(sandbox, args)
        except Refused as e:
            return Observation(text=clip(str(e), limit), error=True)
        return Observation(text=clip(text, limit))

    async def close(self, *, keep_processes: bool = False) -> None:
        self._history.clear()

    async def _run(self, sandbox: Sandbox, args: EditorArgs) -> str:
        path = _path(sandbox, args.path)
        command = args.command
        if command == "view":
            return await self._view(sandbox, path, args.view_range)
        if command == "create":
            return await self._create(
                sandbox, path, _required(args.file_text, "file_text", command)
            )
        if command == "str_replace":
            old = _required(args.old_str, "old_str", command)
            return await self._str_replace(sandbox, path, old, args.new_str or "")
        if command == "insert":
            line = _required(args.insert_line, "insert_line", command)
            new = _required(args.new_str, "new_str", command)
            return await self._insert(sandbox, path, line, new)
        return await self._undo(sandbox, path)

    # -- commands ---------------------------------------------------------------------

    async def _view(self, sandbox: Sandbox, path: str, view_range: list[int] | None) -> str:
        try:
            data = await read(sandbox, path)
        except Directory:
            if view_range is not None:
                raise Refused(
                    "The `view_range` argument is not allowed when `path` is a directory."
                ) from None
            return await list_directory(sandbox, path)
        try:
            text = Text(path, data)
        except Refused:
            return (
                f"{path} is a binary file ({len(data)} bytes), not UTF-8 text; it is not shown. "
                f"Inspect it with bash, e.g. `xxd {shlex.quote(path)} | head`."
            )
        rows = text.lines()
        start, end = _range(view_range, len(rows)) if view_range is not None else (1, len(rows))
        header = f"Here's the result of running `cat -n` on {path}:\n"
        if text.crlf:
            header = f"Here's the result of running `cat -n` on {path} (CRLF line endings):\n"
        if not rows:
            return header + "(the file is empty)"
        return header + self._fit(rows, start, end)

    async def _create(self, sandbox: Sandbox, path: str, file_text: str) -> str:
        try:
            await read(sandbox, path)
        except Missing:
            pass
        else:
            raise Refused(
                f"File already exists at: {path}. `create` cannot overwrite files; "
                "use `str_replace` to edit it, or `view` to see it."
            )
        await write(sandbox, path, file_text.encode("utf-8"), keep_mode=False)
        self._remember(path, None)
        return f"File created successfully at: {path}"

    async def _str_replace(self, sandbox: Sandbox, path: str, old_str: str, new_str: str) -> str:
        if not old_str:
            raise Refused("`old_str` must not be empty; to add text use `insert` or `create`.")
        if old_str == new_str:
            raise Refused("No replacement was performed: `new_str` is identical to `old_str`.")
        before = await read(sandbox, path)
        text = Text(path, before)
        old, new = text.normalise(old_str), text.normalise(new_str)
        starts = occurrences(text.text, old)
        if not starts:
            raise Refused(
                f"No replacement was performed, old_str `{old_str}` did not appear verbatim in "
                f"{path}. It must match exactly, whitespace and indentation included; view the "
                "file to copy the exact text."
            )
        if len(starts) > 1:
            at = ", ".join(str(text.text.count("\n", 0, s) + 1) for s in starts)
            raise Refused(
                f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in "
                f"{path}, starting on lines {at}. Include more surrounding lines in old_str "
                "so that it matches exactly once."
            )
        start = starts[0]
        edited = text.text[:start] + new + text.text[start + len(old) :]
        await write(sandbox, path, text.encode(edited))
        self._remember(path, before)
        first = text.text.count("\n", 0, start) + 1
        snippet = self._snippet(edited, first, first + new.count("\n"))
        return (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a "
            f"snippet of {path}:\n{snippet}\n{_REVIEW}"
        )

    async def _insert(self, sandbox: Sandbox, path: str, insert_line: int, new_str: str) -> str:
        before = await read(sandbox, path)
        text = Text(path, before)
        rows = text.lines()
        if not 0 <= insert_line <= len(rows):
            raise Refused(
                f"Invalid `insert_line` {insert_line}: it must be within [0, {len(rows)}], "
                f"the range of lines of {path} (0 inserts at the top)."
            )
        new = text.normalise(new_str)
        new = new[:-1] if new.endswith("\n") else new  # the inserted text is whole lines
        # Splitting on "\n" keeps the trailing "" of a final newline, so it is kept too.
        parts = text.text.split("\n")
        edited = "\n".join([*parts[:insert_line], new, *parts[insert_line:]])
        await write(sandbox, path, text.encode(edited))
        self._remember(path, before)
        snippet = self._snippet(edited, insert_line + 1, insert_line + 1 + new.count("\n"))
        return (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a "
            f"snippet of the edited file:\n{snippet}\n"
            "Review the changes and make sure they are as expected (correct indentation, no "
            "duplicate lines, etc). Edit the file again if necessary."
        )

    async def _undo(self, sandbox: Sandbox, path: str) -> str:
        stack = self._history.get(path)
        if not stack:
            raise Refused(f"No edit history found for {path}; there is nothing to undo.")
        previous = stack.pop()
        if previous is None:
            result = await sh(sandbox, f"rm -f -- {quoted(sandbox, path)}")
            if result.exit_code != 0:
                stack.append(previous)
                raise Refused(f"Could not remove {path} to undo its creation: {result.output}")
            return f"Last edit to {path} undone: it was created by `create`, so it was removed."
        await write(sandbox, path, previous)
        view = await self._view(sandbox, path, None)
        return f"Last edit to {path} undone successfully. {view}"

    # -- helpers ----------------------------------------------------------------------

    def _remember(self, path: str, before: bytes | None) -> None:
        stack = self._history.setdefault(path, [])
        stack.append(before)
        del stack[: max(len(stack) - self.options.undo_depth, 0)]

    def _snippet(self, edited: str, first: int, last: int) -> str:
        """Lines first..last of the edited text (1-based) with `snippet_lines` around them."""
        rows = lines(edited)
        start = max(first - self.options.snippet_lines, 1)
        end = min(last + self.options.snippet_lines, len(rows))
        return number(rows[start - 1 : end], start) if rows else "(the file is empty)"

    def _fit(self, rows: list[str], start: int, end: int) -> str:
        """Numbered lines start..end, cut at a line boundary to fit the output budget."""
        budget = self.options.max_output_chars - 300  # room for the header and the note
        shown: list[str] = []
        used = 0
        for i in range(start, end + 1):
            row = f"{i:6}\t{rows[i - 1]}"
            if used + len(row) + 1 > budget and shown:
                return "\n".join(shown) + (
                    f"\n<response clipped: showed lines {start}-{i - 1} of {len(rows)}; "
                    "use `view_range` to see the rest, or `grep -n` to find what you need.>"
                )
            shown.append(row)
            used += len(row) + 1
        return "\n".join(shown)


def _path(sandbox: Sandbox, path: str) -> str:
    if not path or "\x00" in path:
        raise Refused("The `path` argument is required: an absolute path such as /workspace.")
    if not path.startswith("/"):
        suggestion = posixpath.join(sandbox.spec.workdir, path)
        raise Refused(
            f"The path {path} is not an absolute path, it should start with `/`. "
            f"Maybe you meant {suggestion}?"
        )
    return posixpath.normpath(path)


def _required(value: T | None, key: str, command: str) -> T:
    if value is None:
        raise Refused(f"The `{key}` argument is required for command `{command}`.")
    return value


def _range(view_range: list[int], n_lines: int) -> tuple[int, int]:
    """Check a `view_range` against a file of `n_lines` lines; returns inclusive bounds."""
    start, end = view_range
    if n_lines == 0:
        raise Refused("Invalid `view_range`: the file is empty; view it without a range.")
    if not 1 <= start <= n_lines:
        raise Refused(
            f"Invalid `view_range` {[start, end]}: its first element {start} must be within "
            f"[1, {n_lines}], the range of lines of the file."
        )
    if end == -1:
        return start, n_lines
    if end < start:
        raise Refused(
            f"Invalid `view_range` {[start, end]}: its second element {end} must be at least "
            f"its first {start}, or -1 for the end of the file."
        )
    if end > n_lines:
        raise Refused(
            f"Invalid `view_range` {[start, end]}: its second element {end} is past the end "
            f"of the file ({n_lines} lines); use -1 to view to the end."
        )
    return start, end
