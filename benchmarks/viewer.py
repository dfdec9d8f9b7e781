"""How fast `agentrl view` opens a big run, and one episode in it.

    .venv/bin/python benchmarks/viewer.py [--episodes 100000] [--dir bench-results/viewer]
    .venv/bin/python benchmarks/viewer.py --screenshots RUN_DIR   # the docs' two images

Generates a train run folder of `--episodes` trajectories (4 turns, ~600 tokens each,
3% infrastructure failures, 50 steps of metrics; kept in `--dir` and reused), then
measures, in the same run:

- `first_open_s`: indexing the file, the first time (one pass; the index is cached);
- `cached_open_s`: opening it again (what every later `agentrl view` of it costs);
- `read_whole_s`: reading every trajectory through `TrajectoryStore` (what a viewer
  without the index would do before showing anything);
- `episode_s`: one episode's page data from the index (median of 5 rows, tokenizer warm)
  against `find_s`, `agentrl replay`'s linear search for the same ids;
- in Chromium (Playwright) against the real server, each from a new page: the overview
  drawn, the table showing all rows, a filter applied, a search over the whole file
  (server side), one episode's tokens shown.
- `export`: `agentrl view --export` of a `--export-episodes` run (default 2,000: every
  episode is written with its token texts, so a copy grows with the run): seconds and MB
  per 1,000 episodes.

Writes benchmarks/results/viewer.json.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "viewer.json"
CHROMIUM = "/usr/bin/chromium"


def templates(seed: int = 0) -> list[dict[str, Any]]:
    """32 valid trajectories to vary: 4 turns of 100 sampled and 50 observation tokens."""
    from agentrl.trajectory import StopReason, ToolCall, Trajectory, Turn

    rng = random.Random(seed)
    out = []
    for k in range(32):
        infra = k == 31
        ids, mask, lps, vers, turns = [], [], [], [], []
        for t in range(4):
            start = len(ids)
            ids += [rng.randrange(49000) for _ in range(100)]
            mask += [0 if infra else 1] * 100
            lps += [0.0 if infra else round(-rng.random() * 3, 4) for _ in range(100)]
            vers += [-1 if infra else t // 2] * 100
            turns.append(
                Turn(
                    action=f"step {t}: grep -rn pattern{k} src/ | head",
                    tool_call=ToolCall(name="bash", arguments={"command": f"grep -rn p{k} src/"}),
                    observation=f"src/file{t}.py:{k}: pattern{k} found\n" * 3,
                    exit_code=0 if t % 3 else 1,
                    span=(start, start + 100),
                )
            )
            ids += [rng.randrange(49000) for _ in range(50)]
            mask += [0] * 50
            lps += [0.0] * 50
            vers += [-1] * 50
        traj = Trajectory(
            trajectory_id="x_0",
            group_id="x",
            task="big-run",
            prompt_ids=[rng.randrange(49000) for _ in range(200)],
            response_ids=ids,
            loss_mask=mask,
            logprobs=lps,
            token_versions=vers,
            reward=None if infra else float(k % 3 == 0),
            stop_reason=StopReason.sandbox_error if infra else StopReason.finished,
            turns=turns,
            seconds={"init": 1.0, "run": 20.0, "eval": 2.0},
            error="container died" if infra else None,
        ).check()
        out.append(json.loads(traj.to_json()))
    return out


def generate(run: Path, episodes: int, steps: int = 50) -> None:
    run.mkdir(parents=True)
    shapes = templates()
    per_step = episodes // steps
    with (run / "trajectories.jsonl").open("w", encoding="utf-8") as f:
        for i in range(episodes):
            d = dict(shapes[i % len(shapes)])
            d["trajectory_id"] = f"inst-{i // 8:05d}_{i % 8}"
            d["group_id"] = f"inst-{i // 8:05d}"
            d["scheduled_step"] = d["consumed_step"] = i // per_step
            f.write(json.dumps(d, separators=(",", ":"), ensure_ascii=False) + "\n")
    with (run / "metrics.jsonl").open("w", encoding="utf-8") as f:
        for s in range(1, steps + 1):
            row = {"kind": "train", "step": s, "episodes": per_step, "reward_mean": 0.3,
                   "reward_ci95": 0.01, "pass_rate": 0.3, "infra_failures": per_step // 32,
                   "stop_reasons": {"finished": per_step}, "sampled_tokens": 400 * per_step,
                   "total_tokens": 800 * per_step, "loss": 0.1 / s}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    info = {"run_id": "bench", "provider": "docker", "tasks": [], "model": "embedded"}
    (run / "run.json").write_text(json.dumps(info))


def timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def server_side(run: Path) -> dict[str, Any]:
    from agentrl.replay import find_trajectory
    from agentrl.trajectory import TrajectoryStore
    from agentrl.view.folder import RunFolder

    path = run / "trajectories.jsonl"
    path.with_name(path.name + ".index").unlink(missing_ok=True)
    first, folder = timed(lambda: RunFolder(run).refresh())
    cached_folder = RunFolder(run)
    cached, _ = timed(cached_folder.refresh)
    whole, n = timed(lambda: sum(1 for _ in TrajectoryStore(path)))
    cached_folder.warm()
    total = len(cached_folder.files["train"].index)
    rows = [total // 2 + 7919 * k for k in range(6)]
    rows = [r % total for r in rows]
    # The first decodes its tokens' texts; later ones find most of them known.
    first_page, _ = timed(lambda: cached_folder.episode("train", rows[0]))
    page_s = [timed(lambda r=r: cached_folder.episode("train", r))[0] for r in rows[1:]]
    rows_mb = len(json.dumps(cached_folder.rows("train"))) / 2**20
    ids = [cached_folder.files["train"].index.rows[r][1] for r in rows[:2]]
    find_s = [timed(lambda i=i: find_trajectory(run, i))[0] for i in ids]
    return {
        "file_mb": round(path.stat().st_size / 2**20, 1),
        "index_mb": round(path.with_name(path.name + ".index").stat().st_size / 2**20, 1),
        "episodes_read": n,
        "first_open_s": round(first, 2),
        "cached_open_s": round(cached, 2),
        "read_whole_s": round(whole, 2),
        "read_whole_over_cached_open": round(whole / cached, 1),
        "rows_json_mb": round(rows_mb, 1),
        "first_episode_s": round(first_page, 3),
        "episode_s": round(statistics.median(page_s), 3),
        "find_s": round(statistics.median(find_s), 2),
        "find_over_episode": round(statistics.median(find_s) / statistics.median(page_s), 1),
    }


def browser_side(run: Path) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from agentrl.view.folder import RunFolder
    from agentrl.view.server import ViewServer

    folder = RunFolder(run)
    start_s, _ = timed(folder.refresh)
    folder.warm()
    total = len(folder.files["train"].index)
    with ViewServer(folder) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)

        def fresh() -> Any:  # each timing starts from a new page: nothing loaded yet
            return browser.new_page(viewport={"width": 1400, "height": 900})

        page = fresh()
        overview, _ = timed(
            lambda: (page.goto(server.url), page.wait_for_selector(".chart[data-metric] canvas"))
        )
        page = fresh()
        every_row = f"document.querySelector('#episode-count')?.textContent.trim() === '{total}'"
        table, _ = timed(
            lambda: (
                page.goto(server.url + "#/episodes?file=train"),
                page.wait_for_function(every_row, timeout=60_000),
            )
        )
        filtered, _ = timed(
            lambda: (
                page.select_option("#f-stop", "infra"),
                page.wait_for_function(
                    "Number(document.querySelector('#episode-count').textContent) < 10000"
                ),
            )
        )
        searched, _ = timed(
            lambda: (
                page.fill("#f-search", "pattern7 found"),
                page.press("#f-search", "Enter"),
                page.wait_for_function(
                    "document.querySelector('#search-status')?.textContent.includes('contain')",
                    timeout=120_000,
                ),
            )
        )
        page = fresh()
        episode, _ = timed(
            lambda: (
                page.goto(server.url + f"#/episode/train/{total // 2}"),
                page.wait_for_selector("#tokens span.tok.sampled"),
            )
        )
        browser.close()
    return {
        "server_start_s": round(start_s, 2),
        "overview_s": round(overview, 2),
        "table_all_rows_s": round(table, 2),
        "filter_s": round(filtered, 2),
        "search_s": round(searched, 2),
        "episode_s": round(episode, 2),
    }


def screenshots(run: Path, out: Path) -> None:
    """The overview and one branched episode of `run`, for the docs."""
    from playwright.sync_api import sync_playwright

    from agentrl.view.folder import RunFolder
    from agentrl.view.index import COLUMNS
    from agentrl.view.server import ViewServer

    folder = RunFolder(run)
    folder.refresh()
    folder.warm()
    out.mkdir(parents=True, exist_ok=True)
    with ViewServer(folder) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(server.url)
        page.wait_for_selector(".chart[data-metric] canvas")
        page.wait_for_timeout(500)
        page.screenshot(path=str(out / "viewer-overview.png"))
        # An episode that was branched from: its tokens, its branches beside it.
        rows = folder.files["train"].index.rows
        of, ident = COLUMNS.index("branch_of"), COLUMNS.index("id")
        parents = {r[of] for r in rows if r[of]}
        row = next(r[0] for r in rows if r[of] is None and r[ident] in parents)
        page.goto(server.url + f"#/episode/train/{row}")
        page.wait_for_selector("#tokens span.tok.sampled")
        page.select_option("#tok-mode", "logprob")
        page.evaluate("window.scrollTo(0, document.querySelector('#tokens').offsetTop - 420)")
        page.wait_for_timeout(500)
        page.screenshot(path=str(out / "viewer-episode.png"))
        browser.close()


def export_side(run: Path) -> dict[str, Any]:
    from agentrl.view.export import export
    from agentrl.view.folder import RunFolder

    out = run.parent / f"{run.name}-export"
    shutil.rmtree(out, ignore_errors=True)
    folder = RunFolder(run)
    folder.refresh()
    folder.warm()
    seconds, n = timed(lambda: export(folder, out))
    mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    shutil.rmtree(out)
    return {
        "episodes": n,
        "export_s": round(seconds, 1),
        "export_mb": round(mb, 1),
        "s_per_1000": round(seconds * 1000 / n, 1),
        "mb_per_1000": round(mb * 1000 / n, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=100_000)
    ap.add_argument("--dir", type=Path, default=ROOT / "bench-results" / "viewer")
    ap.add_argument("--export-episodes", type=int, default=2_000)
    ap.add_argument("--screenshots", type=Path, metavar="RUN_DIR")
    ap.add_argument("--images", type=Path, default=ROOT / "docs" / "images")
    args = ap.parse_args()
    if args.screenshots:
        screenshots(args.screenshots, args.images)
        return
    run, small = (args.dir / f"run-{n}" for n in (args.episodes, args.export_episodes))
    for folder, n in ((run, args.episodes), (small, args.export_episodes)):
        if not folder.exists():
            seconds, _ = timed(lambda f=folder, n=n: generate(f, n))
            print(f"generated {folder} in {seconds:.0f} s", file=sys.stderr)
    result: dict[str, Any] = {
        "command": "benchmarks/viewer.py",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "episodes": args.episodes,
    }
    result["server"] = server_side(run)
    print(json.dumps(result["server"]), file=sys.stderr)
    result["browser"] = browser_side(run)
    result["export"] = export_side(small)
    print(json.dumps(result["export"]), file=sys.stderr)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
