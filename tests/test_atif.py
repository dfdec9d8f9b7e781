"""ATIF out and back in (issue 43): `agentrl export-trajectories RUN --format atif` writes
every episode of a run folder as an ATIF v1.8 document that the `atif` package's own
models accept, and `agentrl.atif.from_atif` reads it back to the very trajectory it came
from, token for token, segments included.

The episodes are real: the shipped trail task (its context drops the oldest turns, so an
episode has several segments) played by the real CLI in Docker with the real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import atif
import pytest
from clirun import agentrl
from test_resume_at_turn import trail_variant

from agentrl.atif import from_atif, to_atif
from agentrl.errors import TrajectoryError
from agentrl.trajectory import StopReason, Trajectory, TrajectoryStore, Turn


@pytest.mark.docker
@pytest.mark.model
def test_a_runs_episodes_go_out_as_atif_and_come_back_token_for_token(tmp_path: Path) -> None:
    task, script = trail_variant(tmp_path)
    run = tmp_path / "run"
    args = ("--policy", f"scripted:{script}", "--instances", "trail-00")
    done = agentrl("run", task, *args, "--out", run)
    assert done.returncode == 0, done.stderr
    recorded = {t.trajectory_id: t for t in TrajectoryStore(run / "trajectories.jsonl")}
    assert len(recorded) == 1 and all(len(t.segments) >= 1 for t in recorded.values())

    out = agentrl("export-trajectories", run, "--format", "atif")
    assert out.returncode == 0, out.stderr
    files = sorted((run / "atif").glob("*.json"))
    assert [f.stem for f in files] == sorted(recorded)
    for f in files:
        raw = json.loads(f.read_text())
        doc = atif.Trajectory.model_validate(raw)  # the format's own models accept it
        traj = recorded[f.stem]
        assert doc.schema_version == "ATIF-v1.8" and doc.trajectory_id == traj.trajectory_id
        system, user, *agent = doc.steps
        assert (system.source, user.source) == ("system", "user")
        assert user.message == "Run: clue start"  # the instance's prompt, rendered
        assert [s.source for s in agent] == ["agent"] * len(traj.turns)
        for step, turn in zip(agent, traj.turns, strict=True):
            assert step.message == turn.action
            assert step.tool_calls and step.tool_calls[0].function_name == "bash"
            assert step.tool_calls[0].arguments == (
                turn.tool_call.arguments if turn.tool_call else {}
            )
            assert step.observation and step.observation.results[0].content == turn.observation
            start, end = turn.span
            ledger = traj.ledgers()[turn.segment]
            assert (
                step.metrics and step.metrics.completion_token_ids == ledger.response_ids[start:end]
            )
            assert step.metrics.logprobs == ledger.logprobs[start:end]
        firsts = [s for s in agent if s.metrics and s.metrics.prompt_token_ids]
        assert [s.metrics.prompt_token_ids for s in firsts if s.metrics] == [
            x.prompt_ids for x in traj.ledgers()
        ]  # each segment's prompt, on its first step
        assert doc.final_metrics and doc.final_metrics.extra == {
            "reward": traj.reward,
            "stop_reason": traj.stop_reason.value,
        }
        back = from_atif(raw, where=str(f))
        assert back == traj  # ids, masks, logprobs, versions, turns, segments, reward


def test_an_infrastructure_failure_keeps_its_zeroed_mask_through_atif() -> None:
    """A sandbox error zeroes the loss mask of what was sampled: the round trip keeps it
    zeroed (and the ledger's non-default tokens) rather than marking the reply sampled."""
    traj = Trajectory(
        trajectory_id="x_0",
        group_id="x",
        task="t",
        prompt_ids=[1, 2, 3],
        response_ids=[7, 8, 9, 10],
        loss_mask=[0, 0, 0, 0],
        logprobs=[0.0] * 4,
        token_versions=[-1] * 4,
        stop_reason=StopReason.sandbox_error,
        turns=[Turn(action="ab", span=(0, 2), observation="")],
        turn_rewards=[0.5],
        error="sandbox node w2 is gone",
    ).check()
    doc = to_atif(traj)
    assert doc.steps[0].source == "agent"  # no task given: no opening messages
    assert from_atif(doc.to_json_dict()) == traj


def test_an_atif_document_another_tool_wrote_is_refused_in_one_line() -> None:
    """ATIF has no loss mask, no policy versions and not the tokens between replies: a
    foreign document is not made into a ledger nobody sampled."""
    doc = {
        "schema_version": "ATIF-v1.8",
        "agent": {"name": "terminus-2", "version": "1"},
        "steps": [
            {"step_id": 1, "source": "user", "message": "fix it"},
            {"step_id": 2, "source": "agent", "message": "ls"},
        ],
    }
    with pytest.raises(TrajectoryError, match="another tool wrote") as e:
        from_atif(doc, where="t.json")
    assert "\n" not in e.value.message and e.value.fix
    with pytest.raises(TrajectoryError, match="not an ATIF trajectory"):
        from_atif({"steps": []})


def test_export_of_a_folder_that_is_no_run_is_one_line_and_a_fix(tmp_path: Path) -> None:
    done = agentrl("export-trajectories", tmp_path)
    assert done.returncode == 1
    assert "has no run.json" in done.stderr and "fix:" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "atif").exists()
