"""matplotlib for files only (never a window), and PNGs written whole or not at all."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from agentrl.atomic import atomic_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, png: Path) -> None:
    """Write `png` whole or not at all (a temporary file, then one rename)."""
    fig.tight_layout()
    with atomic_file(png) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
        pyplot().close(fig)
