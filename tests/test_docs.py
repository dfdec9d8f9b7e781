"""The front door stays true: the README's layout names every module of the package and
only files that exist; every relative link in README.md and docs/ resolves; the README
stays a two-minute page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"


def _layout() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Layout", 1)[1]
    return section.split("```", 2)[1]


def test_the_readme_layout_names_every_module_and_only_what_exists() -> None:
    layout = _layout()
    entries = sorted(
        p.name
        for p in (ROOT / "agentrl").iterdir()
        if p.name not in ("__init__.py", "py.typed", "__pycache__")
    )
    missing = [e for e in entries if not re.search(rf"\b{re.escape(e)}", layout)]
    assert missing == [], f"README layout does not name: {missing}"
    files = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    files |= {p.name for p in ROOT.rglob("*") if p.is_dir() and ".venv" not in p.parts}
    named = set(re.findall(r"\b([a-z_]+\.py)\b", layout))
    named |= set(re.findall(r"\b([a-z_-]+)/", layout))
    assert sorted(named - files) == [], "README layout names what does not exist"


def test_every_relative_link_in_the_docs_resolves() -> None:
    broken = []
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            web = target.startswith(("http://", "https://"))
            if not web and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_readme_is_a_two_minute_page() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200


def test_the_swe_page_sizes_the_disk_from_what_the_code_writes() -> None:
    """docs/swe.md says how much disk a SWE run takes, for each thing it writes; the
    checkpoint row's arithmetic is the backend's (float32 master weights, AdamW's two
    moments, model.pt and optimizer.pt)."""
    page = (ROOT / "docs" / "swe.md").read_text(encoding="utf-8")
    disk = page.split("**The disk.**", 1)[1].split("**The images.**", 1)[0]
    for row in ("model folder", "checkpoint", "instance images", "snapshots", "runs/swe-fsdp/"):
        line = next((ln for ln in disk.splitlines() if row in ln), "")
        assert re.search(r"\d+ (GB|GiB|TB|MB)", line), f"swe.md's disk table: no size for {row}"
    backend = (ROOT / "agentrl" / "backends" / "fsdp.py").read_text(encoding="utf-8")
    assert "dtype=torch.float32" in backend and '"optimizer.pt"' in backend
    assert "float32 master weights" in disk and "AdamW's two float32 moments" in disk
