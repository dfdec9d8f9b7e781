"""`agentrl view` without a browser: the cached line index of a trajectory file (built
once, reused, extended as the file grows, rebuilt when a resume cut it back), search,
one episode's page data (token texts, grade, branches, replay commands), the HTTP
routes and their errors, and the CLI's refusals. The page itself, in Chromium:
tests/test_view_browser.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from clirun import agentrl
from conftest import sigint_as_a_terminal_sends

from agentrl.errors import ConfigError
from agentrl.trajectory import (
    AgentInfo,
    BranchOf,
    EnvInfo,
    Segment,
    StopReason,
    ToolCall,
    Trajectory,
    TrajectoryStore,
    Turn,
)
from agentrl.view.export import export
from agentrl.view.folder import RunFolder, divergence
from agentrl.view.index import COLUMNS, EpisodeIndex, record, summarize
from agentrl.view.server import ViewServer


def episode(tid: str, *, reward: float = 1.0, text: str = "ls", **overrides: object) -> Trajectory:
    """A valid two-turn episode whose first action is `text`."""
    fields: dict[str, object] = dict(
        trajectory_id=tid,
        group_id=tid.split("_")[0],
        task="demo",
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 20, 21, 30, 31],
        loss_mask=[1, 1, 1, 0, 0, 1, 1],
        logprobs=[-0.5, -0.1, -2.0, 0.0, 0.0, -0.3, -0.0],
        token_versions=[3, 3, 3, -1, -1, 4, 4],
        reward=reward,
        stop_reason=StopReason.finished,
        turns=[
            Turn(
                action=text,
                tool_call=ToolCall(name="bash", arguments={"command": "ls"}),
                observation="a.txt\nb.txt",
                exit_code=0,
                span=(0, 3),
                replica="r0",
            ),
            Turn(action="done", span=(5, 7), replica="r1"),
        ],
        seconds={"init": 1.0, "run": 2.0, "eval": 0.5},
    )
    fields.update(overrides)
    return Trajectory(**fields)  # type: ignore[arg-type]


def write(path: Path, *trajs: Trajectory) -> None:
    store = TrajectoryStore(path)
    for t in trajs:
        store.append(t)


def column(index: EpisodeIndex, name: str) -> list[object]:
    at = COLUMNS.index(name)
    return [row[at] for row in index.rows]


# --- the index -----------------------------------------------------------------------


def test_the_fast_record_reads_what_a_full_parse_reads():
    """The parse that skips the token arrays yields the same table row as parsing all of
    it, for records with segments, an external agent, a branch and an infra failure."""
    cases = [
        episode("a_0"),
        episode("b_1", text='he said "hi"\n\\ ok', reward=0.0),
        episode(
            "c_0",
            segments=[
                Segment(
                    reason="template",
                    prompt_ids=[1, 2],
                    response_ids=[5, 6, 7],
                    loss_mask=[1, 0, 1],
                    logprobs=[-0.1, 0.0, -0.2],
                    token_versions=[1, -1, 1],
                )
            ],
            agent=AgentInfo(name="mini", command="mini -y", where="beside", calls=2),
            env=EnvInfo(node="w2"),
            branch_of=BranchOf(trajectory_id="a_0", turn=1, purpose="value"),
        ),
        Trajectory(
            trajectory_id="d_0",
            group_id="d",
            task="demo",
            prompt_ids=[1],
            stop_reason=StopReason.sandbox_error,
            error="the container died",
        ),
    ]
    for traj in cases:
        line = traj.to_json().encode()
        full = json.loads(line)
        full["sampled"] = sum(full["loss_mask"])
        assert summarize(0, record(line)) == summarize(0, full)
    row = summarize(0, record(cases[2].to_json().encode()))
    named = dict(zip(COLUMNS, row, strict=True))
    assert named["tokens"] == 5 + 2  # both ledgers' sampled tokens
    assert (named["agent"], named["node"], named["branch_of"], named["branch_turn"]) == (
        "mini",
        "w2",
        "a_0",
        1,
    )
    assert named["replicas"] == "r0,r1" and named["turns"] == 2
    assert dict(zip(COLUMNS, summarize(0, record(cases[3].to_json().encode())), strict=True))[
        "infra"
    ]


def test_the_index_is_built_once_and_read_back_from_its_cache(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    write(path, *(episode(f"q-{i}_0", reward=float(i % 2)) for i in range(5)))
    first = EpisodeIndex(path)
    assert first.refresh() == 5
    assert first.cache.is_file() and column(first, "id")[4] == "q-4_0"
    # Mark the cached rows: a second index that shows the mark read the cache, not the file.
    lines = first.cache.read_text().splitlines()
    marked = [lines[0]] + [ln.replace('"demo"', '"FROM-CACHE"') for ln in lines[1:]]
    first.cache.write_text("\n".join(marked) + "\n")
    second = EpisodeIndex(path)
    assert second.refresh() == 0
    assert column(second, "task") == ["FROM-CACHE"] * 5
    assert json.loads(second.line(3))["trajectory_id"] == "q-3_0"


def test_a_growing_file_is_indexed_from_where_the_index_ends(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    write(path, episode("a_0"), episode("b_0"))
    index = EpisodeIndex(path)
    index.refresh()
    # A torn last line (its writer mid-append) is not a row yet.
    line = episode("c_0").to_json().encode()
    with path.open("ab") as f:
        f.write(line[:40])
    assert index.refresh() == 0 and len(index) == 2
    with path.open("ab") as f:
        f.write(line[40:] + b"\n")
    assert index.refresh() == 1
    assert column(index, "id") == ["a_0", "b_0", "c_0"]
    # The cache grew by that row alone: a fresh index reads all three from it.
    assert len(index.cache.read_text().splitlines()) == 1 + 3
    again = EpisodeIndex(path)
    again.refresh()
    assert again.rows == index.rows


def test_a_file_cut_back_by_a_resume_is_indexed_again(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    write(path, episode("a_0"), episode("b_0"), episode("c_0"))
    index = EpisodeIndex(path)
    index.refresh()
    # `agentrl train --resume` keeps the lines up to its checkpoint, then appends anew.
    kept = path.read_bytes().splitlines(keepends=True)[:1]
    path.write_bytes(b"".join(kept))
    write(path, episode("d_0", reward=0.0), episode("e_0"))
    index.refresh()
    assert column(index, "id") == ["a_0", "d_0", "e_0"]
    assert column(index, "reward") == [1.0, 0.0, 1.0]
    fresh = EpisodeIndex(path)
    fresh.refresh()
    assert fresh.rows == index.rows


def test_a_rewritten_file_finds_parents_where_they_are_now(tmp_path: Path):
    """A resume cuts the file back and appends other episodes, more than there were: the
    ids the folder knows are those of the new rows, not of the old ones."""
    path = tmp_path / "trajectories.jsonl"
    write(path, episode("a_0"), episode("b_0"))
    folder = RunFolder(tmp_path)
    folder.refresh()
    kept = path.read_bytes().splitlines(keepends=True)[:1]
    path.write_bytes(b"".join(kept))
    kid = episode("c_0~1-0", branch_of=BranchOf(trajectory_id="c_0", turn=1, purpose="value"))
    write(path, episode("c_0"), kid, episode("d_0"))
    folder.refresh()
    assert folder.episode("train", 2)["parent"]["id"] == "c_0"
    assert [b["id"] for b in folder.episode("train", 1)["branches"]] == ["c_0~1-0"]


def test_an_unwritable_cache_keeps_the_index_in_memory(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    write(path, episode("a_0"), episode("b_0"))
    (tmp_path / "trajectories.jsonl.index").mkdir()  # where the cache would go
    index = EpisodeIndex(path)
    assert index.refresh() == 2
    write(path, episode("c_0"))
    assert index.refresh() == 1 and len(index) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "trajectories.jsonl",
        "trajectories.jsonl.index",
    ]


def test_two_viewers_of_one_run_never_write_a_row_twice(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    write(path, *(episode(f"q-{i}_0") for i in range(50)))
    indexes = [EpisodeIndex(path) for _ in range(4)]
    threads = [threading.Thread(target=ix.refresh) for ix in indexes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    offsets = [json.loads(ln)[0] for ln in indexes[0].cache.read_text().splitlines()[1:]]
    assert len(offsets) == len(set(offsets)) == 50
    assert all(len(ix) == 50 for ix in indexes)


def test_an_unreadable_line_is_a_row_that_says_so(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    write(path, episode("a_0"))
    with path.open("ab") as f:
        f.write(b'{"trajectory_id": "broken", \n')
    write(path, episode("c_0"))
    index = EpisodeIndex(path)
    index.refresh()
    assert column(index, "id") == ["a_0", "(unreadable line 2)", "c_0"]
    folder = RunFolder(tmp_path)
    folder.refresh()
    with pytest.raises(Exception, match="row 1"):
        folder.episode("train", 1)


# --- search and episodes ---------------------------------------------------------------


def test_search_finds_actions_and_observations_in_any_case_and_nothing_else(tmp_path: Path):
    path = tmp_path / "trajectories.jsonl"
    write(
        path,
        episode("a_0", text="grep -R TODO src"),
        episode("b_0", text='echo "quoted"\tand\\back'),
        episode("c_0", text="café au lait"),
        episode("d_0", text="cat x", reward_components={"observation": "grep"}),
    )
    folder = RunFolder(tmp_path)
    folder.refresh()

    def found(q: str) -> list[int]:
        return folder.search("train", q)["rows"]

    assert found("todo") == [0] and found("GREP -r") == [0]
    assert found('"quoted"\tand\\b') == [1]  # JSON escapes on both sides
    assert found("CAFÉ") == [] and found("café") == [2]  # ASCII letters fold, others don't
    assert found("B.TXT") == [0, 1, 2, 3]  # observations too
    assert found("observation") == []  # keys and other fields are not searched
    assert folder.search("train", "b.txt", since=2)["rows"] == [2, 3]  # a live page's new rows
    assert found("") == []


@pytest.mark.model
def test_an_episode_has_its_token_texts_grade_branches_and_replay_commands(tmp_path: Path):
    from agentrl.inference.embedded import load_tokenizer

    tok = load_tokenizer()
    ids = tok.encode("ls -la\nok done: café → 世界 🎉")
    n = len(ids)
    alone = tok.batch_decode([[i] for i in ids])
    assert sum("\ufffd" in t for t in alone) >= 3  # characters split across tokens
    parent = episode(
        "p_0",
        response_ids=ids,
        loss_mask=[1] * n,
        logprobs=[-0.5] * n,
        token_versions=[2] * n,
        turns=[Turn(action="ls", span=(0, 3)), Turn(action="done", span=(3, n))],
    )
    kid_ids = [*ids[:3], *tok.encode(" something else")]
    m = len(kid_ids)
    kid = episode(
        "p_0~1-0",
        response_ids=kid_ids,
        loss_mask=[1] * m,
        logprobs=[-0.5] * m,
        token_versions=[2] * 3 + [3] * (m - 3),
        turns=[Turn(action="ls", span=(0, 3)), Turn(action="else", span=(3, m))],
        branch_of=BranchOf(trajectory_id="p_0", turn=1, snapshot="s1", purpose="value"),
        reward=0.0,
    )
    write(tmp_path / "trajectories.jsonl", parent.with_grade(None), kid)
    (tmp_path / "trajectories.grades").mkdir()
    (tmp_path / "trajectories.grades" / "p_0.json").write_text('{"tests": {"t1": "PASSED"}}')
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    lines[0] = lines[0].replace('"grade_file":null', '"grade_file":"trajectories.grades/p_0.json"')
    (tmp_path / "trajectories.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "run.json").write_text(
        json.dumps({"run_id": "r", "provider": "local", "tasks": [], "model": "embedded"})
    )
    folder = RunFolder(tmp_path)
    folder.refresh()
    page = folder.episode("train", 0)
    assert page["token_note"] is None
    texts = page["tokens"][0]["response"]
    assert len(texts) == n and "".join(texts) == tok.decode(ids)
    assert "\ufffd" not in "".join(texts) and "世" in texts and texts[-1] == " 🎉"
    assert page["grade"] == {"tests": {"t1": "PASSED"}}
    assert page["branches"] == [
        {
            "file": "train",
            "row": 1,
            "id": "p_0~1-0",
            "turn": 1,
            "purpose": "value",
            "reward": 0.0,
            "stop": "finished",
            "divergence": {"segment": 0, "token": 3, "turn": 1},
        }
    ]
    assert page["replay"][0] == f"agentrl replay {tmp_path.resolve()} p_0"
    assert page["replay"][2].endswith("--from-turn 1 --policy local")
    child = folder.episode("train", 1)
    assert child["parent"]["id"] == "p_0" and child["parent"]["divergence"]["token"] == 3
    assert divergence(parent, parent) is None


def test_without_a_recorded_model_an_episode_shows_ids_and_says_why(tmp_path: Path):
    write(tmp_path / "trajectories.jsonl", episode("a_0"))
    folder = RunFolder(tmp_path)
    folder.refresh()
    page = folder.episode("train", 0)
    assert page["tokens"] is None and "--model" in page["token_note"]


def test_a_grade_file_outside_the_run_folder_is_not_served(tmp_path: Path):
    run = tmp_path / "run"
    (tmp_path / "secret.json").write_text('{"password": "hunter2"}')
    line = episode("a_0").to_json().replace('"grade_file":null', '"grade_file":"../secret.json"')
    run.mkdir()
    (run / "trajectories.jsonl").write_text(line + "\n")
    folder = RunFolder(run)
    folder.refresh()
    grade = folder.episode("train", 0)["grade"]
    assert "outside the run folder" in grade["error"] and "hunter2" not in json.dumps(grade)


# --- HTTP, the CLI, the export -------------------------------------------------------


def _get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_routes_answer_json_and_bad_requests_say_what_is_wrong(tmp_path: Path):
    write(tmp_path / "trajectories.jsonl", episode("a_0"), episode("b_0", reward=0.0))
    folder = RunFolder(tmp_path)
    folder.refresh()
    with ViewServer(folder) as server:
        status, run = _get(server.url + "api/run")
        assert status == 200 and run["kind"] == "run"
        assert run["infra_stops"] == ["aborted", "eval_error", "sandbox_error"]  # the page's
        assert run["files"] == [
            {"id": "train", "label": "episodes", "path": "trajectories.jsonl", "rows": 2}
        ]
        status, rows = _get(server.url + "api/rows?file=train&since=1")
        assert status == 200 and [r[1] for r in rows["rows"]] == ["b_0"]
        for query, words in [
            ("api/rows?file=nope", "no trajectory file 'nope'"),
            ("api/episode?file=train&row=9", "rows 0..1, not 9"),
            ("api/episode?file=train&row=x", "not an integer"),
            ("api/episode?file=train", "missing ?row="),
            ("api/what", "no such route"),
        ]:
            status, body = _get(server.url + query)
            assert status == 400 and words in str(body["error"]), (query, body)
        # Live: a new episode shows in the stamp and the rows without restarting anything.
        stamp = _get(server.url + "api/stamp")[1]
        write(tmp_path / "trajectories.jsonl", episode("c_0"))
        after = _get(server.url + "api/stamp")[1]
        assert after["stamp"] != stamp["stamp"] and after["files"] == {"train": 3}
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + "static/../folder.py", timeout=10)
        assert e.value.code == 404


def test_a_page_closed_mid_request_is_a_log_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
):
    write(tmp_path / "trajectories.jsonl", episode("a_0"))
    caplog.set_level(logging.DEBUG, logger="agentrl.http")
    with ViewServer(RunFolder(tmp_path)) as server:
        host, port = server.url.removeprefix("http://").rstrip("/").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.sendall(b"GET /api/run HTTP/1.1\r\n")  # then a reset, not the rest
        deadline = time.monotonic() + 10
        while "went away" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "went away" in caplog.text and "ConnectionResetError" in caplog.text
    assert "Traceback" not in capsys.readouterr().err


def _agentrl(*args: str) -> subprocess.CompletedProcess[str]:
    return agentrl(*args, timeout=120)


def test_the_cli_serves_a_run_and_stops_cleanly_on_ctrl_c(tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent.parent / "examples/runs/look-then-act-branch", run)
    proc = subprocess.Popen(
        sigint_as_a_terminal_sends(
            [sys.executable, "-m", "agentrl.cli", "view", str(run), "--port", "0"]
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        said = ""
        while "Ctrl-C stops" not in said:
            line = proc.stdout.readline()
            if not line:  # it ended before serving: how (a signal is a negative code)
                out, err = proc.communicate(timeout=30)
                raise AssertionError(f"exit {proc.returncode}: {out!r} {err!r}")
            said += line
        found = re.search(r"http://127\.0\.0\.1:\d+/", said)
        assert found, said
        status, info = _get(found.group(0) + "api/run")
        assert status == 200 and info["kind"] == "train" and info["files"][0]["rows"] == 196
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert (run / "trajectories.jsonl.index").is_file()  # the index stays for next time


def test_the_cli_refuses_what_it_cannot_view_in_one_line(tmp_path: Path):
    for target, words in [
        (tmp_path / "nope", "no such run folder"),
        (tmp_path, "is not a run folder"),
    ]:
        out = _agentrl("view", str(target))
        assert out.returncode == 1, out
        assert words in out.stderr and "fix:" in out.stderr and "Traceback" not in out.stderr
    write(tmp_path / "trajectories.jsonl", episode("a_0"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _agentrl("view", str(tmp_path), "--port", str(port))
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "fix:" in out.stderr and "Traceback" not in out.stderr


def test_an_export_never_overwrites_and_never_leaves_half_a_copy(tmp_path: Path):
    run = tmp_path / "run"
    write(run / "trajectories.jsonl", *(episode(f"q-{i}_0") for i in range(150)))
    folder = RunFolder(run)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="already exists"):
        export(folder, taken)
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]
    out = tmp_path / "copy"
    assert export(folder, out) == 150
    assert sorted(p.name for p in (out / "data" / "episodes" / "train").iterdir()) == [
        "0.js",
        "1.js",
    ]
    assert "data/run.js" in (out / "index.html").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    shutil.rmtree(out)


def test_every_metric_the_page_charts_is_one_a_run_writes():
    """The charts read metrics by name: each must be a field of the metrics records, or
    one of the backend's flat train_step metrics as a real run wrote them (the shipped
    run), so a renamed metric cannot leave a chart silently empty."""
    from agentrl.train.records import EvalRecord, TrainRecord

    js = (Path(__file__).parent.parent / "agentrl" / "view" / "static" / "app.js").read_text()
    charts = js[js.index("function chartSpecs(") : js.index("function agentFailures(")]
    charts += js[js.index("function agentFailures(") :].split("\n  }\n", 1)[0]
    read = set(re.findall(r"hasKey\(\w+, '(\w+)'\)", charts))
    read |= set(re.findall(r"\br\.(\w+)", charts)) | set(re.findall(r"\['(\w+)', '", charts))
    written = set(TrainRecord.model_fields) | set(EvalRecord.model_fields)
    shipped = Path(__file__).parent.parent / "examples" / "runs" / "look-then-act-branch"
    for line in (shipped / "metrics.jsonl").read_text().splitlines():
        written |= set(json.loads(line))
    assert {"loss", "lag_max", "clip_high_frac", "reward_ci95"} <= read  # the parse finds them
    assert read <= written, sorted(read - written)
