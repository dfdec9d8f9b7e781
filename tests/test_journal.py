"""The journal of episodes in flight (`agentrl/episode/journal.py`), read back as a resume
reads it: the newest landed state, the ledger cut there, a resume's later lines void
what came after it, the version filter, compaction, and a write that fails.

Plain files and the journal's own records; the episodes that write it for real, killed
with SIGKILL, are in test_resume_at_turn.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.chat import ChatSegment
from agentrl.episode import journal as journal_module
from agentrl.episode.journal import Journal
from agentrl.trajectory import EnvInfo, StopReason, Trajectory, Turn


def segment(prompt: list[int], sampled: list[int], observed: list[int], version: int = 1):
    seg = ChatSegment(list(prompt))
    seg.append(
        sampled, sampled=True, logprobs=[-0.5] * len(sampled), versions=[version] * len(sampled)
    )
    seg.append(observed, sampled=False)
    return seg


def turn(k: int, start: int, end: int, seg: int = 0) -> Turn:
    return Turn(action=f"a{k}", observation=f"o{k}", span=(start, end), segment=seg)


def test_the_newest_landed_state_is_what_goes_on(tmp_path: Path) -> None:
    j = Journal(tmp_path / "inflight.jsonl")
    w = j.episode("t", "i_0")
    w.opened("i", 0, 3, EnvInfo(image="img"))
    s0 = segment([1, 2], [10, 11], [20])
    w.reached(0, [], [ChatSegment([1, 2])])
    w.landed(0, "snap-init")
    turns = [turn(0, 0, 2)]
    w.reached(1, turns, [s0])
    w.landed(1, "snap-1")
    s0.append([12], sampled=True, logprobs=[-0.1], versions=[1])
    s0.append([21], sampled=False)
    turns.append(turn(1, 3, 4))
    w.reached(2, turns, [s0])  # its commit never landed: the kill came first
    (found,) = j.in_flight().values()
    assert (found.turns, found.snapshot, found.sample, found.ended) == (1, "snap-1", 0, None)
    p = found.partial
    assert (p.prompt_ids, p.response_ids, p.loss_mask) == ([1, 2], [10, 11, 20], [1, 1, 0])
    assert p.logprobs == [-0.5, -0.5, 0.0] and p.token_versions == [1, 1, -1]
    assert [u.action for u in p.turns] == ["a0"] and p.turns[0].snapshot_id == "snap-1"
    assert (p.env.init_snapshot, p.env.image, p.scheduled_step) == ("snap-init", "img", 3)
    assert found.made == ["snap-init", "snap-1"]


def test_a_resume_voids_what_came_after_its_state_and_is_recorded(tmp_path: Path) -> None:
    j = Journal(tmp_path / "inflight.jsonl")
    w = j.episode("t", "i_0")
    w.opened("i", 0, 0, EnvInfo())
    s0 = segment([1], [10], [20])
    w.reached(1, [turn(0, 0, 1)], [s0])
    w.landed(1, "s1")
    s0.append([11], sampled=True, logprobs=[-1.0], versions=[1])
    s1 = segment([5, 6], [30], [40])  # a second segment (drop_oldest) began
    w.reached(2, [turn(0, 0, 1), turn(1, 2, 3)], [s0, s1])
    w.landed(2, "s2")
    # A later process went on from state 1: what it writes follows from there.
    w2 = j.episode("t", "i_0")
    w2.resumed(1, [2])
    s0b = segment([1], [10], [20])
    s0b.append([13], sampled=True, logprobs=[-2.0], versions=[1])
    s0b.append([22], sampled=False)
    w2.reached(2, [turn(0, 0, 1), turn(1, 2, 3)], [s0b])
    w2.landed(2, "s2b")
    (found,) = j.in_flight().values()
    assert (found.turns, found.snapshot) == (2, "s2b")
    assert found.partial.response_ids == [10, 20, 13, 22] and found.partial.segments == []
    assert found.partial.resumed_at == [1]
    assert found.made == ["s1", "s2b"]


def test_ended_at_the_last_snapshot_only_grades(tmp_path: Path) -> None:
    j = Journal(tmp_path / "inflight.jsonl")
    w = j.episode("t", "i_0")
    w.opened("i", 0, 0, EnvInfo())
    w.reached(1, [turn(0, 0, 1)], [segment([1], [10], [])])
    w.landed(1, "s1")
    w.ended(1, StopReason.finished)
    (found,) = j.in_flight().values()
    assert found.ended == StopReason.finished
    w.ended(1, StopReason.context_limit)  # not an end a resume grades without sampling
    assert '"context_limit"' not in j.path.read_text()


def test_only_what_the_checkpoints_versions_sampled_is_offered(tmp_path: Path) -> None:
    """A resumed run has the weights up to its checkpoint's version: an episode goes on
    from its newest state those sampled; one a lost later version began runs again."""
    path = tmp_path / "inflight.jsonl"
    w = Journal(path).episode("t", "i_0")
    w.opened("i", 0, 0, EnvInfo())
    s0 = segment([1], [10], [20], version=4)
    w.reached(1, [turn(0, 0, 1)], [s0])
    w.landed(1, "s1")
    s0.append([11], sampled=True, logprobs=[-1.0], versions=[5])  # after a publication
    w.reached(2, [turn(0, 0, 1), turn(1, 2, 3)], [s0])
    w.landed(2, "s2")
    assert Journal(path, version=5).in_flight()[("t", "i_0")].turns == 2
    assert Journal(path, version=4).in_flight()[("t", "i_0")].turns == 1
    assert Journal(path, version=3).in_flight() == {}


def test_a_finished_episode_comes_back_as_it_was(tmp_path: Path) -> None:
    j = Journal(tmp_path / "inflight.jsonl")
    traj = Trajectory(
        trajectory_id="i_3", group_id="i", task="t", prompt_ids=[1], response_ids=[9],
        loss_mask=[1], logprobs=[-0.2], token_versions=[2], reward=1.0,
        stop_reason=StopReason.finished, scheduled_step=1,
    ).check()  # fmt: skip
    j.finished(traj)
    (found,) = Journal(j.path, version=2).in_flight().values()
    assert found.final == traj
    assert found.sample == 3
    j.drop({("t", "i_3")})  # a checkpoint holds it
    assert j.in_flight() == {}


def test_recorded_episodes_leave_the_journal_as_it_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "COMPACT_BYTES", 400)
    j = Journal(tmp_path / "inflight.jsonl")
    for n in range(6):
        w = j.episode("t", f"i_{n}")
        w.opened("i", n, 0, EnvInfo())
        w.reached(1, [turn(0, 0, 1)], [segment([1], [10], [20])])
        w.landed(1, f"s{n}")
        if n != 4:
            j.closed("t", f"i_{n}")
    keys = {(x["t"]) for x in map(json.loads, j.path.read_text().splitlines())}
    assert "i_4" in keys and "i_0" not in keys and len(keys) <= 2
    assert set(j.in_flight()) >= {("t", "i_4")}


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    j = Journal(tmp_path / "inflight.jsonl")
    w = j.episode("t", "i_0")
    w.opened("i", 0, 0, EnvInfo())
    w.reached(1, [turn(0, 0, 1)], [segment([1], [10], [])])
    w.landed(1, "s1")
    with j.path.open("a") as f:
        f.write('{"task": "t", "t": "i_0", "landed": 2, "snap')
    (found,) = j.in_flight().values()
    assert found.snapshot == "s1"


def test_a_write_that_fails_stops_the_episodes_journal_not_the_episode(tmp_path: Path) -> None:
    j = Journal(tmp_path / "inflight.jsonl")
    w = j.episode("t", "i_0")
    w.opened("i", 0, 0, EnvInfo())
    w.reached(1, [turn(0, 0, 1)], [segment([1], [10], [20])])
    w.landed(1, "s1")
    blocked = tmp_path / "inflight.jsonl"
    blocked.unlink()
    blocked.mkdir()  # every later append fails (EISDIR), as a full disk would
    w.reached(2, [turn(0, 0, 1), turn(1, 2, 3)], [segment([1], [10], [20])])
    assert w.stopped
    w.landed(2, "s2")  # nothing more is written, and nothing raises


def test_lines_are_fsynced_on_the_journals_thread_a_batch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No episode waits for the disk: a write returns once its line is in the file (what
    a kill -9 keeps), and the fsync that keeps it through a power loss runs on the
    journal's own thread, one for all lines written meanwhile; `synced` returns once
    every line so far is fsynced (a superseded snapshot is removed only then), and the
    thread ends when idle."""
    import asyncio
    import os
    import threading

    real_fsync, calls = os.fsync, []

    def fsync(fd: int) -> None:
        calls.append((threading.current_thread().name, j._written))
        real_fsync(fd)

    monkeypatch.setattr(journal_module.os, "fsync", fsync)
    monkeypatch.setattr(journal_module, "FLUSHER_IDLE_S", 0.2)
    j = Journal(tmp_path / "inflight.jsonl")
    w = j.episode("t", "i_0")
    for k in range(50):
        w.landed(k, f"s{k}")
    assert len((tmp_path / "inflight.jsonl").read_text().splitlines()) == 50
    asyncio.run(w.synced())
    assert j._synced == j._written == 50
    assert calls and calls[-1][1] == 50  # the last fsync covers every line
    assert all(name != threading.main_thread().name for name, _ in calls)
    flusher = j._flusher
    if flusher is not None:
        flusher.join(timeout=5)
    assert j._flusher is None  # idle: ended
    w.landed(50, "s50")  # a later write starts it again, and is synced
    asyncio.run(w.synced())
    assert j._synced == 51 and calls[-1][1] == 51
