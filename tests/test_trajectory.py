"""The trajectory ledger: every contract violation is caught and named; JSONL round trips."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
from clirun import agentrl

from agentrl.errors import TrajectoryError
from agentrl.trajectory import StopReason, ToolCall, Trajectory, TrajectoryStore, Turn


def make(**overrides) -> Trajectory:
    """A valid two-turn trajectory: 3 sampled, 2 observation, 2 sampled tokens."""
    fields = dict(
        trajectory_id="query-42_0",
        group_id="query-42",
        task="demo",
        prompt_ids=[1, 2, 3],
        response_ids=[10, 11, 12, 20, 21, 30, 31],
        loss_mask=[1, 1, 1, 0, 0, 1, 1],
        logprobs=[-0.5, -0.1, -2.0, 0.0, 0.0, -0.3, -0.0],
        token_versions=[3, 3, 3, -1, -1, 4, 4],
        reward=1.0,
        turn_rewards=[0.0, 1.0],
        reward_components={"tests_passed": 3, "tests_total": 3},
        stop_reason=StopReason.finished,
        turns=[
            Turn(
                action="ls",
                tool_call=ToolCall(name="bash", arguments={"command": "ls"}),
                observation="a.txt",
                exit_code=0,
                span=(0, 3),
                gen_seconds=0.1,
                tool_seconds=0.01,
                snapshot_id="snap-1",
            ),
            Turn(action="done", span=(5, 7)),
        ],
    )
    fields.update(overrides)
    return Trajectory(**fields)


def test_valid_trajectory_passes():
    t = make().check()
    assert t.trainable and t.num_sampled == 5


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"loss_mask": [1, 1, 1, 0, 0, 1]}, "loss_mask", "length 6 != response_ids length 7"),
        ({"logprobs": [-0.5] * 8}, "logprobs", "length 8"),
        ({"token_versions": [3] * 6}, "token_versions", "length 6"),
        ({"loss_mask": [1, 1, 2, 0, 0, 1, 1]}, "loss_mask[2]", "not 0 or 1"),
        ({"logprobs": [-0.5, 0.2, -2.0, 0, 0, -0.3, 0]}, "logprobs[1]", "0.2 on a sampled"),
        (
            {"logprobs": [-0.5, float("nan"), -2.0, 0, 0, -0.3, 0]},
            "logprobs[1]",
            "nan on a sampled",
        ),
        (
            {"logprobs": [-0.5, float("-inf"), -2.0, 0, 0, -0.3, 0]},
            "logprobs[1]",
            "-inf on a sampled",
        ),
        ({"logprobs": [-0.5, -0.1, -2.0, -1.0, 0, -0.3, 0]}, "logprobs[3]", "non-sampled"),
        ({"token_versions": [3, 3, -1, -1, -1, 4, 4]}, "token_versions[2]", "policy version"),
        ({"token_versions": [3, 3, 3, 0, -1, 4, 4]}, "token_versions[3]", "non-sampled"),
        ({"response_ids": [10, 11, -12, 20, 21, 30, 31]}, "response_ids[2]", "negative"),
        ({"prompt_ids": []}, "prompt_ids", "empty"),
        (
            {"loss_mask": [0] * 7, "logprobs": [0.0] * 7, "token_versions": [-1] * 7}
            | {"turns": [], "turn_rewards": []},
            "loss_mask",
            "claims a trainable episode",
        ),
        ({"reward": None}, "reward", "None on a trainable"),
        ({"reward": float("inf")}, "reward", "inf on a trainable"),
        ({"turn_rewards": [1.0]}, "turn_rewards", "1 rewards for 2 turns"),
        ({"turn_rewards": [0.0, float("nan")]}, "turn_rewards[1]", "not finite"),
        ({"turns": [Turn(action="x", span=(2, 4))]}, "turns[0].span", "non-sampled"),
        ({"turns": [Turn(action="x", span=(5, 9))]}, "turns[0].span", "outside"),
        (
            {"turns": [Turn(action="x", span=(5, 7)), Turn(action="y", span=(0, 3))]},
            "turns[1].span",
            "out of order",
        ),
        ({"stop_reason": StopReason.sandbox_error}, "loss_mask", "must carry a zero loss mask"),
        ({"schema_version": 99}, "schema_version", "99 is not 1"),
    ],
)
def test_each_violation_is_named(overrides, field, words):
    with pytest.raises(TrajectoryError) as info:
        make(**overrides).check()
    message = str(info.value)
    assert message.startswith(f"trajectory 'query-42_0': {field}: "), message
    assert words in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)  # every agentrl error is also a stdlib type


def test_infrastructure_failure_keeps_its_turns_with_a_zeroed_mask():
    t = make(
        loss_mask=[0] * 7,
        logprobs=[0.0] * 7,
        token_versions=[-1] * 7,
        reward=None,
        stop_reason=StopReason.eval_error,
        error="grader crashed",
    ).check()
    assert not t.trainable and t.turns[0].span == (0, 3)


def test_infrastructure_failure_is_valid_with_zero_mask():
    t = make(
        response_ids=[],
        loss_mask=[],
        logprobs=[],
        token_versions=[],
        reward=None,
        turn_rewards=[],
        turns=[],
        stop_reason=StopReason.sandbox_error,
        error="container exited with 137",
    ).check()
    assert not t.trainable


def test_jsonl_round_trip_is_identical(tmp_path: Path):
    store = TrajectoryStore(tmp_path / "runs" / "t.jsonl")
    written = [
        make(trajectory_id=f"q_{i}", logprobs=[-1 / 3, -1e-9, -20.5, 0, 0, -0.3, -7e-300])
        for i in range(5)
    ]
    for t in written:
        store.append(t)
    read = list(store.read())
    assert read == written
    assert [t.model_dump() for t in read] == [t.model_dump() for t in written]
    assert read[0].logprobs[0] == -1 / 3  # floats survive bit for bit


def test_append_refuses_an_invalid_trajectory_and_writes_nothing(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    store = TrajectoryStore(path)
    store.append(make())
    before = path.read_bytes()
    with pytest.raises(TrajectoryError, match="loss_mask"):
        store.append(make(loss_mask=[1] * 6))
    assert path.read_bytes() == before


def test_concurrent_appends_never_interleave(tmp_path: Path):
    store = TrajectoryStore(tmp_path / "t.jsonl")

    def worker(k: int) -> None:
        for i in range(20):
            store.append(make(trajectory_id=f"w{k}_{i}"))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ids = sorted(t.trajectory_id for t in store.read())
    assert ids == sorted(f"w{k}_{i}" for k in range(4) for i in range(20))


def test_torn_last_line_is_reported_and_later_appends_survive(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    store = TrajectoryStore(path)
    store.append(make(trajectory_id="a"))
    with path.open("a") as f:  # a writer killed mid-record
        f.write(make(trajectory_id="b").to_json()[:57])
    with pytest.raises(TrajectoryError, match=r"t\.jsonl:2: .*\(the last line, torn"):
        list(store.read())
    store.append(make(trajectory_id="c"))
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert Trajectory.from_json(lines[2]).trajectory_id == "c"


def test_bad_records_name_file_line_and_field(tmp_path: Path):
    path = tmp_path / "t.jsonl"
    good = json.loads(make().to_json())
    bad_type = dict(good, loss_mask="oops")
    unknown = dict(good, rewrad=1.0)
    newer = dict(good, schema_version=7)
    for record, words in [
        (bad_type, "t.jsonl:1: trajectory 'query-42_0': loss_mask: Input should be a valid list"),
        (unknown, "t.jsonl:1: trajectory 'query-42_0': rewrad: Extra inputs are not permitted"),
        (newer, "schema_version 7 is newer than this agentrl understands"),
    ]:
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(TrajectoryError) as info:
            list(TrajectoryStore(path).read())
        assert words in str(info.value)
    path.write_text("{not json\n")
    with pytest.raises(TrajectoryError, match=r"t\.jsonl:1: not valid JSON"):
        list(TrajectoryStore(path).read())
    path.write_bytes(
        make().to_json().replace("ls", "l\udcffs").encode("utf-8", "surrogateescape") + b"\n"
    )
    with pytest.raises(TrajectoryError, match=r"t\.jsonl:1: not UTF-8 \(offset \d+\)"):
        list(TrajectoryStore(path).read())


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return agentrl(*args, timeout=120)


def test_cli_validate_reports_one_line_without_traceback(tmp_path: Path):
    good = tmp_path / "good.jsonl"
    TrajectoryStore(good).append(make())
    bad = tmp_path / "bad.jsonl"
    bad.write_text(make(logprobs=[0.5] * 7).model_dump_json() + "\n")
    ok = _cli("validate", str(good))
    assert ok.returncode == 0, ok.stderr
    assert "1 trajectories, all valid" in ok.stdout
    res = _cli("validate", str(bad))
    assert res.returncode == 1
    assert "Traceback" not in res.stderr + res.stdout
    assert "bad.jsonl:1: trajectory 'query-42_0': logprobs[0]: 0.5 on a sampled token" in (
        res.stderr.replace("\n", "")
    )
    missing = _cli("validate", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1 and "no such trajectory file" in missing.stderr
