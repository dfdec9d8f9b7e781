"""`agentrl view RUN --export DIR`: the page and the run's data as files that open from
disk (file://) with no server: the same index.html and scripts, plus `data/run.js` (the
run and every file's table rows) and `data/episodes/<file>/<n>.js`, `CHUNK` episodes
each, which the page loads by script tag when one is opened (a browser will not
`fetch()` from file://). The folder is written beside DIR and renamed into place, so an
interrupted export leaves no half-written copy.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentrl.atomic import atomic_folder
from agentrl.errors import AgentRLError, ConfigError
from agentrl.view.folder import RunFolder
from agentrl.view.server import STATIC

CHUNK = 100
MARKER = "<!--agentrl-static-data-->"


def _js(value: Any) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def _episode(folder: RunFolder, file_id: str, row: int) -> dict[str, Any]:
    """An episode's page data, or what makes it unreadable (the page shows that)."""
    try:
        return folder.episode(file_id, row)
    except AgentRLError as e:
        return {"file": file_id, "row": row, "error": e.message, "fix": e.fix}


def export(
    folder: RunFolder, out: Path, *, progress: Callable[[int, int], None] | None = None
) -> int:
    """Write the static copy of `folder` to `out` (which must not exist, or be an empty
    folder). Returns the number of episodes written."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists", fix="name a new folder for --export")
    folder.refresh()
    run = folder.run()
    total = sum(len(f.index) for f in folder.files.values())
    with atomic_folder(out) as tmp:  # onto nothing, or the empty folder
        shutil.copytree(STATIC, tmp / "static")
        page = (STATIC / "index.html").read_text(encoding="utf-8")
        if MARKER not in page:
            raise ConfigError(f"{STATIC / 'index.html'} lacks {MARKER} (a broken install?)")
        script = '<script src="data/run.js"></script>'
        (tmp / "index.html").write_text(page.replace(MARKER, script), encoding="utf-8")
        rows = {f.id: folder.rows(f.id) for f in folder.files.values()}
        data = tmp / "data"
        data.mkdir()
        static = {"run": run, "rows": rows, "chunk": CHUNK}
        (data / "run.js").write_text(f"window.AGENTRL_STATIC = {_js(static)};\n", encoding="utf-8")
        done = 0
        for f in folder.files.values():
            where = data / "episodes" / f.id
            where.mkdir(parents=True)
            for start in range(0, len(f.index), CHUNK):
                rows_here = range(start, min(start + CHUNK, len(f.index)))
                episodes = [_episode(folder, f.id, row) for row in rows_here]
                body = f"AGENTRL_CHUNK({_js(f.id)}, {start // CHUNK}, {_js(episodes)});\n"
                (where / f"{start // CHUNK}.js").write_text(body, encoding="utf-8")
                done += len(episodes)
                if progress:
                    progress(done, total)
    return done
