"""The placeholders of a task's templates, as (name, newlines before it, right after a `$`).

Prompts are filled like str.format; shell commands (setup, oracle, the grader's) like
graders.fill, where `${VAR}` and other braces stay as written.
"""

from __future__ import annotations

import re
import string

# The grader fills its command like graders.fill: `${VAR}` and other braces stay as written.
_FILL_PLACEHOLDER = re.compile(r"(?<!\$)\{(\w+)\}")


def format_names(text: str) -> list[tuple[str, int, bool]]:
    """Placeholders as str.format reads them (the prompts); ValueError for a stray brace."""
    out, newlines, seen = [], 0, set()
    for literal, field, spec, conversion in string.Formatter().parse(text):
        newlines += literal.count("\n")
        name = None if field is None else field + (f"!{conversion}" if conversion else "")
        name = name + f":{spec}" if name is not None and spec else name
        if name is not None and name not in seen:
            seen.add(name)
            out.append((name, newlines, literal.endswith("$")))
    return out


def fill_names(text: str) -> list[tuple[str, int, bool]]:
    out: list[tuple[str, int, bool]] = []
    for m in _FILL_PLACEHOLDER.finditer(text):
        if all(m.group(1) != name for name, _n, _d in out):
            out.append((m.group(1), text[: m.start()].count("\n"), False))
    return out
