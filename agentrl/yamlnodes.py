"""YAML with positions: one document parsed into its node tree (for lines) and its data,
refused before it is built when it is hostile (an alias bomb, too deep, cyclic); the
line of any loc in it; keys given twice; a parse error as a line and a message.
"""

from __future__ import annotations

from typing import Any

import yaml

from agentrl.errors import first_line

Loc = tuple[str | int, ...]


MAX_NODES = 1_000_000
"""Values in a YAML document with every alias expanded: beyond, it is an alias bomb."""
MAX_DEPTH = 100
"""How deeply a YAML document may nest: no config comes near it; a hostile one may."""


def compose(text: str) -> tuple[yaml.Node | None, Any]:
    """The node tree (for lines) and the data of one YAML document; raises yaml.YAMLError.

    A document is refused before it is built when its aliases would expand past
    MAX_NODES values ("billion laughs"), when it nests deeper than MAX_DEPTH, or when an
    alias refers to a node that contains it; a scalar Python cannot build (an integer of
    5,000 digits, the 13th month) is an error too, never a crash.
    """
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise _refused(None, f"nested too deeply (more than {MAX_DEPTH} levels)") from None
        if node is None:
            return None, None
        _check_shape(node)
        try:
            return node, loader.construct_document(node)
        except (ValueError, OverflowError) as e:
            raise _refused(None, f"a value cannot be read: {first_line(e, typed=True)}") from None
    finally:
        loader.dispose()


def _refused(node: yaml.Node | None, problem: str) -> yaml.MarkedYAMLError:
    mark = node.start_mark if node is not None else None
    return yaml.MarkedYAMLError(problem=problem, problem_mark=mark)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_shape(root: yaml.Node) -> None:
    """Raise when the document, aliases expanded, is too big, too deep or cyclic.

    One pass over the node graph (an alias is the same node object reached twice), each
    node's expanded size and depth computed once from its children's.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    opened: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            opened.discard(key)
            if depth[key] > MAX_DEPTH:
                raise _refused(node, f"nested too deeply (more than {MAX_DEPTH} levels)")
            if size[key] > MAX_NODES:
                raise _refused(
                    node,
                    f"its aliases expand to more than {MAX_NODES:,} values (an alias bomb?): "
                    "write the values out, or use fewer aliases",
                )
            continue
        if key in size:
            continue
        if key in opened:
            raise _refused(node, "an alias refers to a node that contains it")
        opened.add(key)
        stack.append((node, True))
        stack += [(k, False) for k in _children(node) if id(k) not in size]


def yaml_error(e: yaml.YAMLError, text: str) -> tuple[int, str]:
    """The line and a readable message of a YAML parse error in `text`."""
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        msg = e.problem or e.context or "invalid YAML"
        if e.problem and e.context:
            where = f" on line {e.context_mark.line + 1}" if e.context_mark else ""
            msg = f"{e.problem} ({e.context}{where})"
        return (mark.line + 1 if mark else 1), msg
    if isinstance(e, yaml.reader.ReaderError):
        return text[: e.position].count("\n") + 1, f"{e.reason} (character {e.character!r})"
    return 1, first_line(e, typed=True)


def find(root: yaml.Node | None, loc: Loc) -> tuple[int, yaml.Node | None]:
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


def duplicate_keys(
    node: yaml.Node | None, loc: Loc, seen: set[int] | None = None
) -> list[tuple[Loc, int, int]]:
    """Keys given twice in one mapping; a node reached again through an alias is not rewalked."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:
        return []
    seen.add(id(node))
    out: list[tuple[Loc, int, int]] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for k, v in node.value:
            key, line = str(k.value), k.start_mark.line + 1
            if isinstance(k, yaml.ScalarNode) and key in first:
                out.append(((*loc, key), line, first[key]))
            first.setdefault(key, line)
            out += duplicate_keys(v, (*loc, key), seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out += duplicate_keys(item, (*loc, i), seen)
    return out
