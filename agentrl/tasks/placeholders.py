"""Task templates: the one way a template is filled from an instance, and read by validation.

A task holds templates in its prompts, its shell commands (setup, oracle, the grader's
command) and its grader's fields (a reward file, test ids); `TaskSpec.templates()` lists
them. Every one is filled the same way:

- `{name}` is the instance's field `name` (or its `id`); a name no field has stays as
  written (`agentrl validate` reports it);
- `{{` and `}}` are a literal `{` and `}`;
- `{name:spec}`, `{name!r}`, `{name.attr}`, `{name[0]}` are refused (a ValueError): they
  would run code on a field's value, as str.format does.

A placeholder's name is an identifier, as a field's is. The kinds differ only in what
else a brace may be. In a `shell` template the shell's own braces need no escape:
`${VAR}` and every brace that does not make a `{name}` (`{a,b}`, `{1..3}`, `{1}`, `{ }`,
awk's `{print $1}`, `find -exec ... {}`) stay as written. In a `prompt` every literal
brace is written `{{` or `}}`, as in str.format: a single one is a mistake, so is a pair
around anything but a name (`{1}`, `{ }`, `{"a": 1}`), and `${name}` is a dollar sign
before the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

Kind = Literal["prompt", "shell"]

_PATTERNS: dict[Kind, re.Pattern[str]] = {
    "prompt": re.compile(r"\{\{|\}\}|\{(?P<field>[^{}]*)\}|(?P<stray>[{}])"),
    # `${...}` is matched first so that it stays the shell's. A placeholder's name is an
    # identifier (what a field can be named), and so is an attribute's, so that `{1}`,
    # `{1..3}`, `{a..z}`, `{a-b}`, `{1,2}` and `{ }` stay the shell's.
    "shell": re.compile(
        r"\{\{|\}\}|\$\{[^{}]*\}"
        r"|\{(?P<field>[A-Za-z_]\w*(?:(?:\.[A-Za-z_]|\[|![a-z]|:)[^{}\s]*)?)\}"
    ),
}


class Placeholder(NamedTuple):
    """One placeholder of a template, as written between its braces."""

    name: str
    newlines: int
    """newlines before it in the template (its line, for a problem's line number)"""
    after_dollar: bool
    """right after a `$`: in a prompt, perhaps a shell variable meant literally"""


def names(template: str, kind: Kind) -> list[Placeholder]:
    """The placeholders of `template`, each once; ValueError for a single brace in a prompt."""
    out: list[Placeholder] = []
    for match in _PATTERNS[kind].finditer(template):
        if match.groupdict().get("stray"):
            raise ValueError(_stray(match.group(0)))
        name = match.group("field")
        if name is None or any(p.name == name for p in out):
            continue
        before = template[: match.start()]
        out.append(Placeholder(name, before.count("\n"), before.endswith("$")))
    return out


def fill(template: str, values: Mapping[str, Any], kind: Kind) -> str:
    """`template` with its placeholders filled from `values` (see the module's rules)."""
    if "{" not in template and "}" not in template:  # nothing to fill: most templates
        return template

    def one(match: re.Match[str]) -> str:
        token, name = match.group(0), match.group("field")
        if token in ("{{", "}}"):
            return token[0]
        if match.groupdict().get("stray"):
            raise ValueError(_stray(token))
        if name is None:  # the shell's `${VAR}`
            return token
        if not name.isidentifier():
            raise ValueError(f"placeholder {{{name}}}: only plain {{field}} placeholders")
        return str(values[name]) if name in values else token

    return _PATTERNS[kind].sub(one, template)


def _stray(brace: str) -> str:
    if brace == "{":
        return "a single '{' (expected '}' to close a placeholder)"
    return "a single '}' (no '{' opens it)"
