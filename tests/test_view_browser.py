"""`agentrl view` in real Chromium (Playwright) on the shipped run folder
(examples/runs/look-then-act-branch: a real `agentrl train` run of the main job with
branch credit, written by SmolLM2 in Docker): the overview draws, filters narrow the
table to exactly the rows Python counts, an episode's token colours follow its ledger
(every mask-1 token marked sampled), its branches show where they diverge, a run in
progress shows a new episode without a reload, and the static export opens from disk.
Nothing is faked; the tokenizer is the run's own (the embedded model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentrl import corpus
from agentrl.trajectory import StopReason, Trajectory, TrajectoryStore
from agentrl.view.export import export
from agentrl.view.folder import RunFolder
from agentrl.view.server import ViewServer

pytestmark = pytest.mark.model

SHIPPED = Path(__file__).parent.parent / "examples" / "runs" / "look-then-act-branch"


def trajectories(path: Path) -> list[Trajectory]:
    return list(TrajectoryStore(path))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the shipped run (the viewer writes its index beside the files)."""
    copy = tmp_path_factory.mktemp("view") / SHIPPED.name
    shutil.copytree(SHIPPED, copy)
    return copy


@pytest.fixture(scope="module")
def served(run: Path) -> Iterator[str]:
    folder = RunFolder(run)
    folder.refresh()
    folder.warm()
    with ViewServer(folder) as server:
        yield server.url


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page whose script errors fail the test."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield page
    page.close()
    assert errors == []


def count(page: Any) -> int:
    return int(page.text_content("#episode-count").strip())


def wait_count(page: Any, n: int) -> None:
    page.wait_for_function(
        f"document.querySelector('#episode-count')?.textContent.trim() === '{n}'", timeout=20_000
    )


def test_the_overview_draws_the_runs_metrics(page: Any, served: str, run: Path):
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["kind"] == "train"]
    evals = [m for m in metrics if m["kind"] == "eval"]
    assert steps and len(evals) >= 2  # what the shipped run holds
    page.goto(served)
    for metric in ("reward", "pass_rate", "stop_reasons", "failures", "tokens", "loss", "clip"):
        page.wait_for_selector(f".chart[data-metric={metric}] canvas")
    assert page.locator(".chart[data-metric=lag]").count() == 0  # a sync run has no lag
    assert run.name in page.text_content("header")


def test_filters_narrow_the_table_to_the_rows_that_match(page: Any, served: str, run: Path):
    trajs = trajectories(run / "trajectories.jsonl")
    page.goto(served + "#/episodes?file=train")
    wait_count(page, len(trajs))
    failed = [t for t in trajs if t.reward is not None and t.reward <= 0]
    assert 0 < len(failed) < len(trajs)
    page.fill("#f-reward-max", "0")
    page.press("#f-reward-max", "Enter")
    wait_count(page, len(failed))
    instance = failed[0].group_id
    page.fill("#f-instance", instance)
    page.press("#f-instance", "Enter")
    wait_count(page, sum(t.group_id == instance for t in failed))
    keys = page.eval_on_selector_all("#episodes tbody tr", "rs => rs.map(r => r.dataset.key)")
    ids = {trajs[int(k.split(":")[1])].trajectory_id for k in keys}
    assert ids == {t.trajectory_id for t in failed if t.group_id == instance}
    # Sorted by reward, descending: the first page is the best episodes.
    page.goto(served + "#/episodes?file=train")
    wait_count(page, len(trajs))
    page.click("#episodes th[data-col=reward]")  # ascending, then descending from the keyboard
    page.focus("#episodes th[data-col=reward]")
    page.keyboard.press("Enter")
    page.wait_for_function("agentrlApp.state.list.sort === 'reward' && agentrlApp.state.list.desc")
    sort = page.get_attribute("#episodes th[data-col=reward]", "aria-sort")
    assert sort == "descending"
    keys = page.eval_on_selector_all("#episodes tbody tr", "rs => rs.map(r => r.dataset.key)")
    rewards = [trajs[int(k.split(":")[1])].reward for k in keys]
    assert rewards == sorted(rewards, reverse=True) and rewards[0] == 1.0
    # Search in actions and observations, on top of the cleared filters.
    word = "note.txt"
    hits = [t for t in trajs if any(word in u.action or word in u.observation for u in t.turns)]
    assert 0 < len(hits) < len(trajs)
    page.fill("#f-search", "NOTE.TXT")
    page.press("#f-search", "Enter")
    wait_count(page, len(hits))


def test_an_episodes_tokens_are_coloured_by_its_ledger(page: Any, served: str, run: Path):
    trajs = trajectories(run / "trajectories.jsonl")
    row, traj = next((k, t) for k, t in enumerate(trajs) if t.branch_of is None and t.turns)
    page.goto(served + f"#/episode/train/{row}")
    page.wait_for_selector("#tokens span.tok.sampled")
    tokens = page.eval_on_selector_all(
        "#tokens span.tok[data-seg='0']",
        """ts => ts.map(t => ({i: +t.dataset.i, id: +t.dataset.id, mask: +t.dataset.mask,
                               sampled: t.classList.contains('sampled'),
                               bg: getComputedStyle(t).backgroundColor, title: t.title}))""",
    )
    assert [t["id"] for t in tokens] == traj.response_ids
    assert [t["mask"] for t in tokens] == traj.loss_mask
    assert [t["sampled"] for t in tokens] == [m == 1 for m in traj.loss_mask]
    sampled_bg = {t["bg"] for t in tokens if t["sampled"]}
    context_bg = {t["bg"] for t in tokens if not t["sampled"]}
    assert len(sampled_bg) == 1 and sampled_bg.isdisjoint(context_bg)
    first = next(i for i, m in enumerate(traj.loss_mask) if m)
    assert f"{traj.logprobs[first]:.3f}" in tokens[first]["title"]
    assert f"v{traj.token_versions[first]}" in tokens[first]["title"]
    # Coloured by logprob, sampled tokens vary with their probability.
    page.select_option("#tok-mode", "logprob")
    shades = page.eval_on_selector_all(
        "#tokens span.tok.sampled",
        "ts => new Set(ts.map(t => getComputedStyle(t).backgroundColor)).size",
    )
    assert shades > 1
    assert len(page.locator("#turns .turn").all()) == len(traj.turns)
    assert f"agentrl replay {run.resolve()} {traj.trajectory_id}" in page.text_content("#replay")


def test_a_branched_episode_shows_its_continuations_and_where_they_diverge(
    page: Any, served: str, run: Path
):
    trajs = trajectories(run / "trajectories.jsonl")
    kids = [t for t in trajs if t.branch_of is not None]
    assert kids  # branch credit ran
    parent_id = kids[0].branch_of.trajectory_id  # type: ignore[union-attr]
    row = next(k for k, t in enumerate(trajs) if t.trajectory_id == parent_id)
    page.goto(served + f"#/episode/train/{row}")
    page.wait_for_selector("#branches a.branch")
    shown = page.eval_on_selector_all("#branches a.branch", "bs => bs.map(b => b.dataset.key)")
    mine = [
        k for k, t in enumerate(trajs) if t.branch_of and t.branch_of.trajectory_id == parent_id
    ]
    assert sorted(shown) == sorted(f"train:{k}" for k in mine)
    # A continuation marks the token where it stops following its parent.
    page.click(f"#branches a.branch[data-key='train:{mine[0]}']")
    page.wait_for_selector("#tokens span.tok.diverge")
    kid, parent = trajs[mine[0]], trajs[row]
    at = int(page.get_attribute("#tokens span.tok.diverge", "data-i"))
    assert kid.response_ids[:at] == parent.response_ids[:at]
    assert at == len(parent.response_ids) or kid.response_ids[at] != parent.response_ids[at]


def test_a_run_in_progress_shows_a_new_episode_without_a_reload(
    page: Any, browser: Any, tmp_path: Path
):
    live = tmp_path / "live"
    shutil.copytree(SHIPPED, live)
    store = TrajectoryStore(live / "trajectories.jsonl")
    n = len(list(store))
    folder = RunFolder(live)
    folder.refresh()
    with ViewServer(folder) as server:
        page.goto(server.url + "#/episodes?file=train")
        wait_count(page, n)
        loads = page.evaluate("window.__agentrlLoads")
        first = next(iter(store))
        turns = [first.turns[0].model_copy(update={"observation": "a LIVE-MARKER here"})]
        newest = first.model_copy(
            update={"trajectory_id": "appended-while-open_0", "turns": turns + first.turns[1:]}
        )
        store.append(newest)
        wait_count(page, n + 1)
        held = page.evaluate("agentrlApp.state.rows.train.map(r => r[1])")
        assert "appended-while-open_0" in held
        # A search stays on while the run goes on: new episodes that match join it.
        page.fill("#f-search", "live-marker")
        page.press("#f-search", "Enter")
        wait_count(page, 1)
        store.append(newest.model_copy(update={"trajectory_id": "appended-later_0"}))
        wait_count(page, 2)
        assert page.evaluate("window.__agentrlLoads") == loads  # no reload happened
        # An infrastructure failure is marked as such: the stop reasons come from the server.
        lost = Trajectory(
            trajectory_id="lost_0",
            group_id="lost",
            task=first.task,
            prompt_ids=first.prompt_ids,
            response_ids=[],
            loss_mask=[],
            logprobs=[],
            token_versions=[],
            reward=None,
            stop_reason=StopReason.sandbox_error,
            error="the engine went away",
        )
        store.append(lost)
        page.wait_for_function(f"agentrlApp.state.rows.train.length === {n + 3}")
        page.goto(server.url + f"#/episode/train/{n + 2}")
        page.wait_for_selector("#ep-header.infra .badge.infra")
        page.goto("about:blank")  # before its server goes


def test_the_export_opens_from_disk(page: Any, run: Path, tmp_path: Path):
    out = tmp_path / "shared"
    written = export(RunFolder(run), out)
    trajs = trajectories(run / "trajectories.jsonl")
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url))
    page.goto((out / "index.html").as_uri() + "#/episodes?file=train")
    wait_count(page, len(trajs))
    assert written >= len(trajs)
    page.goto((out / "index.html").as_uri() + "#/episode/train/3")
    page.wait_for_selector("#tokens span.tok.sampled")
    ids = page.eval_on_selector_all(
        "#tokens span.tok[data-seg='0']", "ts => ts.map(t => +t.dataset.id)"
    )
    assert ids == trajs[3].response_ids
    outside = [u for u in asked if not u.startswith(("file://", "data:"))]
    assert asked and outside == []  # everything it needs is in the folder: no CDN, no server


@pytest.mark.docker
@pytest.mark.slow  # cold, it builds the ubuntu:24.04 stand-in and the brought Python (minutes)
@pytest.mark.corpus("harbor/regex-log")
def test_a_genuine_harbor_tasks_episode_shows_its_graders_verdicts(page: Any, tmp_path: Path):
    """A published Harbor task (tests/corpus.json), unchanged, played by a script that runs
    its own reference solution as one bash call: the page shows the real test file's
    verdicts, the call and its observation."""
    genuine = corpus.find("harbor/regex-log")
    assert genuine is not None
    solve = (genuine / "solution" / "solve.sh").read_text(encoding="utf-8")
    call = json.dumps({"name": "bash", "arguments": {"command": solve}})
    finish = '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>'
    script = tmp_path / "oracle.yaml"
    script.write_text(json.dumps([f"<tool_call>{call}</tool_call>", finish]))  # JSON is YAML
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "run", str(genuine), "--policy",
         f"scripted:{script}", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    traj = trajectories(out / "trajectories.jsonl")[0]
    assert traj.reward == 1.0 and traj.grade_file
    tests = json.loads((out / traj.grade_file).read_text())["tests"]
    assert tests and set(tests.values()) <= {"PASSED", "SKIPPED"}
    folder = RunFolder(out)
    folder.refresh()
    with ViewServer(folder) as server:
        page.goto(server.url + "#/episode/train/0")
        page.wait_for_selector("#tokens span.tok.sampled")
        shown = page.text_content("#grade")
        assert all(name in shown for name in tests)
        assert "/app/regex.txt" in page.text_content("#turns .turn[data-turn='0']")
        page.goto("about:blank")


def test_an_async_run_shows_its_lag_and_a_segmented_episode_its_ledgers(page: Any, tmp_path: Path):
    """What the shipped run lacks: an async run's lag chart, and an episode whose history
    was rewritten (two ledgers), each ledger's tokens shown with its own mask."""
    from agentrl.trajectory import Segment, StopReason, Turn

    run = tmp_path / "async-run"
    run.mkdir()
    rows = [
        {"kind": "train", "step": s, "episodes": 4, "reward_mean": 0.5, "reward_ci95": 0.1,
         "pass_rate": 0.5, "infra_failures": 0, "stop_reasons": {"finished": 4},
         "sampled_tokens": 40, "total_tokens": 80, "lag_max": s - 1, "stale_groups": 0}
        for s in (1, 2, 3)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    segment = Segment(
        reason="template",
        prompt_ids=[1, 2, 3, 4],
        response_ids=[7, 8, 9],
        loss_mask=[1, 1, 0],
        logprobs=[-0.2, -0.4, 0.0],
        token_versions=[2, 2, -1],
    )
    traj = Trajectory(
        trajectory_id="seg_0",
        group_id="seg",
        task="demo",
        prompt_ids=[1, 2],
        response_ids=[5, 6],
        loss_mask=[1, 0],
        logprobs=[-0.1, 0.0],
        token_versions=[1, -1],
        reward=1.0,
        stop_reason=StopReason.finished,
        turns=[Turn(action="a", span=(0, 1)), Turn(action="b", span=(0, 2), segment=1)],
        segments=[segment],
    )
    TrajectoryStore(run / "trajectories.jsonl").append(traj)
    folder = RunFolder(run, model="embedded")
    folder.refresh()
    with ViewServer(folder) as server:
        page.goto(server.url)
        page.wait_for_selector(".chart[data-metric=lag] canvas")
        page.goto(server.url + "#/episode/train/0")
        page.wait_for_selector("#tokens span.tok[data-seg='1']")
        assert "template" in page.text_content("#segments")
        masks = page.eval_on_selector_all(
            "#tokens span.tok[data-seg='1']", "ts => ts.map(t => +t.dataset.mask)"
        )
        assert masks == segment.loss_mask
        page.goto("about:blank")


SUMMARIZED = SHIPPED.parent / "trail-summarize"
TRAIL = Path(__file__).parent.parent / "tasks" / "train" / "trail"


def summarizing_trail(folder: Path) -> Path:
    """The task of the shipped trail-summarize run: tasks/train/trail with the context
    block its README names (a 320-token context, summaries of at most 64 tokens, the last
    turn kept verbatim), in a copy under `folder`."""
    copy = folder / "trail-summarize"
    shutil.copytree(TRAIL, copy)
    text = (copy / "task.yaml").read_text()
    old = "  context_length: 256\n"
    assert text.count(old) == 1 and text.count("history: drop_oldest\n  keep_turns: 2\n") == 1
    text = text.replace(old, "  context_length: 320\n").replace(
        "history: drop_oldest\n  keep_turns: 2\n",
        "history: summarize\n  keep_turns: 1\n  summary_tokens: 64\n",
    )
    (copy / "task.yaml").write_text(text)
    return copy / "task.yaml"


def test_a_summarized_episodes_segments_train_token_exactly(page: Any, tmp_path: Path):
    """The second shipped run (examples/runs/trail-summarize: a real `agentrl train` of the
    trail task with `history: summarize`): a summarized episode's every ledger is shown
    with its own ids and mask, the summaries' own tokens marked sampled (trained); the
    ledgers are exactly the chats the turns rebuild (`conversation`), so what trains is
    what the policy saw; and the trainer's logprobs matched the sampler's on the
    segments a summary began (`logprob_mismatch_rewritten`, every step)."""
    from agentrl.episode import conversation
    from agentrl.inference.embedded import load_tokenizer
    from agentrl.tasks.load import load_task

    run = tmp_path / SUMMARIZED.name
    shutil.copytree(SUMMARIZED, run)
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    mismatch = [m["logprob_mismatch_rewritten"] for m in steps if m["kind"] == "train"]
    assert mismatch and all(0 <= m < 1e-4 for m in mismatch)
    trajs = trajectories(run / "trajectories.jsonl")
    summarized = [t for t in trajs if any(u.kind == "summary" for u in t.turns)]
    assert summarized and all(t.segments for t in summarized)
    task, tokenizer = load_task(summarizing_trail(tmp_path / "task")), load_tokenizer()
    for t in summarized:  # the ledgers are the chats the turns rebuild, token for token
        rebuilt = conversation(task, t, tokenizer).all_segments
        assert [(s.reason, s.prompt_ids, s.response_ids, s.loss_mask) for s in rebuilt] == [
            (s.reason, s.prompt_ids, s.response_ids, s.loss_mask) for s in t.ledgers()
        ]
    ids = {t.trajectory_id for t in summarized}  # the one with the most ledgers
    row, traj = max(
        enumerate(trajs), key=lambda kt: (kt[1].trajectory_id in ids, len(kt[1].segments))
    )
    ledgers = traj.ledgers()
    folder = RunFolder(run, model="embedded")  # the policy was a checkpoint: same tokenizer
    folder.refresh()
    with ViewServer(folder) as server:
        page.goto(server.url + f"#/episode/train/{row}")
        page.wait_for_selector(f"#tokens span.tok[data-seg='{len(ledgers) - 1}']")
        reasons = page.eval_on_selector_all(
            "#segments tbody tr", "rs => rs.map(r => r.children[1].textContent)"
        )
        assert reasons == ["start (top level)"] + [s.reason for s in traj.segments]
        assert "summary" in reasons
        for k, ledger in enumerate(ledgers):
            shown = page.eval_on_selector_all(
                f"#tokens span.tok[data-seg='{k}']",
                """ts => ts.map(t => ({id: +t.dataset.id, mask: +t.dataset.mask,
                                       sampled: t.classList.contains('sampled')}))""",
            )
            assert [t["id"] for t in shown] == ledger.response_ids
            assert [t["mask"] for t in shown] == ledger.loss_mask
            assert [t["sampled"] for t in shown] == [m == 1 for m in ledger.loss_mask]
        for turn in (u for u in traj.turns if u.kind == "summary"):
            start, end = turn.span
            assert set(ledgers[turn.segment].loss_mask[start:end]) == {1}  # trained on
            ids = ledgers[turn.segment].response_ids[start:end]
            assert tokenizer.decode(ids, skip_special_tokens=True).strip() == turn.action.strip()
        assert page.locator("#turns .summary-turn").count() == sum(
            u.kind == "summary" for u in traj.turns
        )
        page.goto("about:blank")
