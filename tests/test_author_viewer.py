"""`agentrl view` on a task author's first day (issue 39): a run that ended says so instead
of "live" (and turns live again when it grows), a reward that never left 0 is drawn on
0..1 rather than 0..100, and every key of the episodes page's URL is documented. Real
Chromium (Playwright) on copies of the shipped run."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import test_view_browser

from agentrl.trajectory import TrajectoryStore
from agentrl.view.folder import RunFolder
from agentrl.view.server import ViewServer

ROOT = Path(__file__).parents[1]
SHIPPED = ROOT / "examples" / "runs" / "look-then-act-branch"
APP = ROOT / "agentrl" / "view" / "static" / "app.js"
DOC = ROOT / "docs" / "viewer.md"


def test_every_key_of_the_episodes_url_is_documented() -> None:
    app = APP.read_text(encoding="utf-8")
    filters = app.split("const FILTERS = [", 1)[1].split("];", 1)[0]
    extra = re.search(r"const LIST_KEYS = \['file'\]\.concat\(.*?, \[(.*?)\]\)", app)
    assert extra is not None
    keys = ["file", *re.findall(r"key: '(\w+)'", filters), *re.findall(r"'(\w+)'", extra[1])]
    columns = app.split("const TABLE_COLS = [", 1)[1].split("];", 1)[0]
    sortable = re.findall(r"\['(\w+)', '[^']*'\]", columns)
    assert len(keys) == 16 and "sort" in keys and len(sortable) == 14
    section = DOC.read_text(encoding="utf-8").split("## Links: what the URL holds", 1)[1]
    section = section.split("\n## ", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    assert documented == keys  # each key, in the page's order, and no other
    (sort_row,) = [line for line in section.splitlines() if line.startswith("| `sort` |")]
    assert re.findall(r"`(\w+)`", sort_row.split("|")[2]) == sortable
    for route in ("`#/`", "`#/episodes?KEY=VALUE&...`", "`#/episode/FILE/ROW`"):
        assert route in section
    assert "#/episode/' + encodeURIComponent(file) + '/' + row" in app  # the route it documents


# The page fixture of the viewer's browser tests (a page whose script errors fail the
# test), on conftest's Chromium.
page = test_view_browser.page


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    return copy


def _badges(page: Any) -> list[str]:
    return [page.text_content("#mode-badge"), page.text_content("#live-indicator")]


def test_a_run_that_ended_says_finished_and_turns_live_when_it_grows(
    page: Any, tmp_path: Path
) -> None:
    run = _copy(tmp_path)
    now = time.time()
    for path in run.rglob("*"):  # written during the run, then the summary at its end
        os.utime(path, (now - 60, now - 60))
    os.utime(run / "summary.json", (now - 30, now - 30))
    folder = RunFolder(run)
    folder.refresh()
    with ViewServer(folder) as server:
        page.goto(server.url)
        page.wait_for_selector("#live-indicator")
        assert _badges(page) == ["finished", "finished"]
        assert "live" not in page.get_attribute("#mode-badge", "class")
        # A resumed run writes again: the page (still polling) says it is live.
        store = TrajectoryStore(run / "trajectories.jsonl")
        first = next(iter(store))
        store.append(first.model_copy(update={"trajectory_id": "resumed_0"}))
        page.wait_for_function(
            "document.querySelector('#mode-badge').textContent === 'live'", timeout=20_000
        )
        assert _badges(page) == ["live", "live"]


def test_a_reward_that_stayed_0_is_drawn_on_0_to_1_not_0_to_100(page: Any, tmp_path: Path) -> None:
    run = _copy(tmp_path)
    zeroed = ("reward_mean", "reward_ci95", "pass_rate", "pass_at_1", "pass_at_1_ci95")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # a run none of whose episodes ever passed
        row.update({k: 0.0 for k in zeroed if k in row})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = RunFolder(run)
    folder.refresh()
    with ViewServer(folder) as server:
        page.goto(server.url)
        for metric in ("reward", "pass_rate"):
            page.wait_for_selector(f".chart[data-metric={metric}] canvas")
        scales = page.evaluate(
            "Object.fromEntries(agentrlApp.state.charts.map(c => "
            "[c.box.dataset.metric, [c.u.scales.y.min, c.u.scales.y.max]]))"
        )
    assert scales["reward"] == [0, 1] and scales["pass_rate"] == [0, 1]


def test_an_agentrl_run_folder_is_a_run_and_an_interrupted_one_is_not_finished(
    tmp_path: Path,
) -> None:
    """`agentrl run` keeps its folder as an evaluation does (eval.json) plus its
    conversations and summary: the viewer calls it a run, finished only once its summary
    says the run completed (an interrupted run's says `complete: false`)."""
    run = tmp_path / "run"
    run.mkdir()
    trajs = list(TrajectoryStore(SHIPPED / "trajectories.jsonl"))[:2]
    store = TrajectoryStore(run / "trajectories.jsonl")
    for t in trajs:
        store.append(t)
    (run / "eval.json").write_text("{}")
    assert RunFolder(run).kind == "eval"  # an evaluation folder, so far
    (run / "conversations.jsonl").write_text("")
    summary = {"task": "t", "episodes": 2, "complete": False, "missing": 2}
    (run / "summary.json").write_text(json.dumps(summary))
    past = time.time() - 30
    for path in run.iterdir():
        os.utime(path, (past, past))
    folder = RunFolder(run)
    folder.refresh()
    assert folder.kind == "run" and not folder.finished()
    (run / "summary.json").write_text(json.dumps({**summary, "complete": True, "missing": 0}))
    assert folder.finished()
