"""How the CLI prints: one console for results, one for errors and notes.

No string is ever read as rich markup: paths, ids and messages print as written ("[/x]"
in a trajectory id is text); colour comes only from `tag`.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

console = Console(highlight=False, soft_wrap=True, markup=False, emoji=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)


def tag(label: str, style: str, text: str = "") -> Text:
    """`label` in `style`, then `text` as written."""
    return Text.assemble((label, style), " " + text if text else "")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
