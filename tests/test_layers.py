"""The layers of docs/design.md, kept: every import in the package (a lazy one inside a
function, and one only for type checking, included) goes to the same layer or below,
and the top-level packages and modules import one another without a circle. And a
module past 400 lines says at its top why it is one module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "agentrl"

LAYERS: list[list[str]] = [
    ["cli"],
    [
        "train",
        "train_config",
        "evaluation",
        "check",
        "replay",
        "runner",
        "preflight",
        "cluster",
        "view",
        "tinker_server",
        "doctor",
        "atif",
    ],
    ["dispatch"],
    ["episode"],
    ["gateway", "play", "context", "snapshots", "toolcall"],
    [
        "tasks",
        "tools",
        "chat",
        "chat_formats",
        "inference",
        "backends",
        "algorithms",
        "algorithm_config",
        "harnesses",
    ],
    ["sandbox", "weights"],
    [
        "trajectory",
        "scores",
        "figures",
        "errors",
        "yamlfile",
        "yamlnodes",
        "textfile",
        "registry",
        "corpus",
        "http",
        "atomic",
        "scratch",
        "run_info",
        "cache",
        "batch",
    ],
]
"""Top to bottom, as docs/design.md#layers draws them."""


def _entry(module: str) -> str:
    """The top-level package or module of `agentrl.x.y` (x)."""
    return module.split(".")[1]


def _imports() -> list[tuple[str, str, str]]:
    """(importing file, its top-level entry, the imported top-level entry) for every
    import of agentrl in the package, wherever it stands in the file."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        entry = rel.parts[1].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "agentrl":
                    names = [f"agentrl.{a.name}" for a in node.names]
                elif node.module.startswith("agentrl."):
                    names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("agentrl.")]
            found += [(str(rel), entry, _entry(name)) for name in names]
    return found


def test_every_entry_of_the_package_has_a_layer() -> None:
    entries = {
        p.name.removesuffix(".py")
        for p in PACKAGE.iterdir()
        if p.name not in ("__init__.py", "py.typed", "__pycache__")
    }
    placed = [name for layer in LAYERS for name in layer]
    assert sorted(entries - set(placed)) == [], "add them to LAYERS and docs/design.md"
    assert sorted(set(placed) - entries) == [], "LAYERS names what does not exist"


def test_nothing_imports_upward() -> None:
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    upward = sorted(
        f"{path}: {entry} imports {target}"
        for path, entry, target in _imports()
        if target in layer and entry in layer and layer[target] < layer[entry]
    )
    assert upward == []


def test_no_import_circle_among_top_level_entries() -> None:
    graph: dict[str, set[str]] = {}
    for _, entry, target in _imports():
        if entry != target:
            graph.setdefault(entry, set()).add(target)
    circles = []
    for start in sorted(graph):  # a path from start back to itself
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert circles == []


def test_design_md_draws_these_layers() -> None:
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rows = design.split("## Layers", 1)[1].split("```", 2)[1].strip().splitlines()
    assert len(rows) == len(LAYERS), "docs/design.md#layers has one row per layer"
    for names, row in zip(LAYERS, rows, strict=True):
        for name in names:
            spelled = f"{name}/" if (PACKAGE / name).is_dir() else f"{name}.py"
            assert spelled in row.split(), f"docs/design.md's layer {row!r} lacks {spelled}"


LONG = 400
REASON = "# Over 400 lines: "


def test_a_module_over_400_lines_says_why_at_its_top() -> None:
    """A long module is a choice: its first line says why it is one module."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > LONG and not (lines[0].startswith(REASON) and len(lines[0]) > 40):
            unexplained.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    assert unexplained == [], f"split them, or begin each with {REASON!r} and the reason"
