"""Chaos: each bad input a hostile sweep found, through the `agentrl` command line.

Every case must end the same way: one line (or one per problem) saying what is
wrong, a `fix:` line, exit code 1, no traceback, nothing half written. The commands
run in process (`agentrl.cli.main`), except where a real subprocess is the point.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentrl.cli import main
from agentrl.trajectory import Trajectory, TrajectoryStore

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).parents[2]


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def refused(*args: str) -> str:
    """Run the command; assert it failed as a person should see it; its stderr."""
    code, out, err = cli(*args)
    assert code == 1, (code, out, err)
    assert "Traceback" not in out + err and "internal error" not in err, err
    assert err.splitlines()[-1].startswith("fix: "), err
    return err


def task(tmp_path: Path, name: str = "t", **changes: object) -> Path:
    doc: dict[str, object] = {
        "name": name,
        "instances": [{"id": "a", "filename": "a.txt"}],
        "prompt": {"system": "Write files.", "instance": "Create {filename}."},
        "grader": {"type": "command", "command": "test -f {filename}"},
        "limits": {"max_turns": 2, "max_new_tokens": 16, "context_length": 1024},
        **changes,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    levels = ["l0: &l0 [" + ", ".join(["lol"] * 10) + "]"]
    levels += [f"l{d}: &l{d} [" + ", ".join([f"*l{d - 1}"] * 10) + "]" for d in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("name: bomb\n" + "\n".join(levels) + "\ninstances: [*l9]\n")
    start = time.monotonic()
    err = refused("validate", str(path))
    assert time.monotonic() - start < 10
    assert f"{path}:" in err and "alias bomb" in err


def test_deep_nesting_is_refused(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("name: deep\nprompt: " + "[" * 20_000 + "]" * 20_000 + "\n")
    assert f"{path}:1: yaml: nested too deeply" in refused("validate", str(path))


@pytest.mark.parametrize("placeholder", ["{filename:d}", "{filename.stem}", "{filename[99]}"])
def test_placeholders_with_a_spec_attribute_or_index_are_refused(tmp_path, placeholder):
    prompt = {"system": "s", "instance": f"Create {placeholder}."}
    err = refused("validate", str(task(tmp_path, prompt=prompt)))
    assert f"prompt.instance: placeholder {placeholder}: only plain {{field}}" in err


@pytest.mark.parametrize("source", ["/usr", "../outside.txt"])
def test_files_from_outside_the_task_folder_are_refused(tmp_path, source):
    (tmp_path / "outside.txt").write_text("x")
    folder = tmp_path / "task"
    folder.mkdir()
    path = task(folder, sandbox={"files": {"/x": source}})
    assert f"is outside the task's folder ({folder})" in refused("validate", str(path))


def test_a_bool_is_not_a_number(tmp_path):
    limits = {"max_turns": True, "max_new_tokens": 16, "context_length": 1024}
    err = refused("validate", str(task(tmp_path, limits=limits)))
    assert "limits.max_turns: should be a number, got true" in err


def test_a_prompt_that_cannot_fit_is_refused_by_validate(tmp_path):
    prompt = {"system": "s", "instance": "word " * 1_000_000}
    err = refused("validate", str(task(tmp_path, prompt=prompt)))
    assert "the prompt is 5,000,001 bytes, which cannot fit" in err


def test_rich_markup_in_a_path_is_printed_as_written(tmp_path):
    odd = tmp_path / "[" / "x][bold]"  # the path reads [/x][bold]
    odd.mkdir(parents=True)
    path = odd / "missing.yaml"
    err = refused("validate", str(path))
    assert f"{path}:1: task: file not found" in err


def test_rich_markup_in_a_trajectory_id_is_printed_as_written(tmp_path):
    traj = Trajectory(
        trajectory_id="[/x]_0",
        group_id="[/x]",
        task="t",
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        loss_mask=[1, 1],
        logprobs=[-0.1, -0.2],
        token_versions=[0, 0],
        reward=0.0,
        stop_reason="finished",
    )
    TrajectoryStore(tmp_path / "trajectories.jsonl").append(traj)
    code, out, err = cli("failures", str(tmp_path))
    assert code == 0, err
    assert "for example [/x]_0" in out and "agentrl replay" in out


def test_failures_needs_a_run_folder(tmp_path):
    assert "no such run folder" in refused("failures", str(tmp_path / "nope"))
    assert "holds no trajectories" in refused("failures", str(tmp_path))


TRAIN = REPO / "examples" / "train" / "shell-basics.yaml"


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_train_steps_below_one_are_refused(tmp_path, steps):
    err = refused("train", str(TRAIN), "--steps", steps, "--out", str(tmp_path / "run"))
    assert "--steps: should be greater than or equal to 1" in err
    assert not (tmp_path / "run").exists()


def test_a_model_folder_that_does_not_exist_is_refused_by_validate(tmp_path):
    doc = yaml.safe_load(TRAIN.read_text())
    doc["tasks"] = [str(REPO / "tasks" / "train" / "shell-basics" / "task.yaml")]
    doc["model"] = "models/nowhere"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    err = refused("validate", str(path))
    assert f"{path}:" in err and "model: model folder 'models/nowhere' not found" in err


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    out = tmp_path / "run"
    err = refused("train", str(TRAIN), "--steps", "1", "--out", str(out), "--resume")
    assert "--resume: no complete checkpoint in" in err
    assert not list(out.glob("**/*.jsonl"))


def _run_refused(tmp_path: Path, path: Path, *extra: str) -> str:
    script = tmp_path / "script.yaml"
    script.write_text(json.dumps(["```bash\ntouch a.txt\n```"]))
    out = tmp_path / "out"
    policy = [] if "--policy" in extra else ["--policy", f"scripted:{script}"]
    err = refused("run", str(path), "--out", str(out), *policy, *extra)
    assert not out.exists(), "nothing is written for a run that never started"
    return err


@pytest.mark.docker
def test_run_with_a_missing_image_fails_before_any_episode(tmp_path):
    err = _run_refused(tmp_path, task(tmp_path, sandbox={"image": "agentrl/no-such:1"}))
    assert "INIT of instance a failed before any episode started" in err
    assert "image agentrl/no-such:1 not found" in err


@pytest.mark.docker
def test_run_with_a_failing_setup_fails_before_any_episode(tmp_path):
    err = _run_refused(tmp_path, task(tmp_path, sandbox={"setup": ["echo broken; exit 3"]}))
    assert "setup command 'echo broken; exit 3' exited 3: broken" in err


def test_run_with_no_policy_server_fails_before_any_episode(tmp_path):
    err = _run_refused(tmp_path, task(tmp_path), "--policy", "openai:http://127.0.0.1:9")
    assert "no answer from http://127.0.0.1:9/v1" in err


def test_run_with_a_prompt_longer_than_the_context_fails_before_any_episode(tmp_path):
    limits = {"max_turns": 2, "max_new_tokens": 16, "context_length": 64}
    path = task(tmp_path, limits=limits, prompt={"system": "s", "instance": "word " * 200})
    err = _run_refused(tmp_path, path)
    assert "instance a: the first prompt is" in err and "limits.context_length is 64" in err


def test_debug_shows_the_traceback_and_without_it_there_is_none(tmp_path):
    """The one real subprocess: what a person's terminal shows, with and without --debug."""
    path = tmp_path / "[x].yaml"
    path.write_text("name: x\nlimits: {max_turns: true}\n")
    cmd = [sys.executable, "-m", "agentrl.cli", "train", str(path), "--steps", "0"]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert plain.stderr.splitlines()[-1].startswith("fix: ")
    debug = subprocess.run([*cmd[:3], "--debug", *cmd[3:]], capture_output=True, text=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["validate"], "the following arguments are required: files"),
        (["run", "t.yaml", "-n", "0"], "argument -n/--samples: 0 is below 1"),
        (["run", "t.yaml", "--concurrency", "0"], "argument --concurrency: 0 is below 1"),
        (["run", "t.yaml", "--max-turns", "0"], "argument --max-turns: 0 is below 1"),
        (["run", "t.yaml", "--max-new-tokens", "x"], "'x' is not an integer"),
        (["run", "t.yaml", "--snapshots", "-1"], "argument --snapshots: -1 is below 0"),
        (["serve", "--port", "70000"], "70000 is not a port (0-65535)"),
        (["sample", "--temperature", "nan"], "nan is not a temperature"),
        (["no-such-command"], "invalid choice: 'no-such-command'"),
    ],
)
def test_a_wrong_command_line_is_one_line_and_a_fix(args, message, capsys):
    """argparse's own way (usage text, exit 2) is not how agentrl reports a mistake."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    error, fix = capsys.readouterr().err.splitlines()
    assert error.startswith("error: agentrl") and message in error
    assert fix.startswith("fix: agentrl") and fix.endswith("--help lists the arguments")
