"""A Harbor dataset folder (a folder of task folders, as `harbor run --path` takes one, and
as `terminal-bench@2.0` is once downloaded) loads whole, unchanged: `agentrl validate`,
`check`, `eval`, `run` and a train config's `tasks:` take it as its tasks (issue 43).
The genuine one is the corpus's `harbor/` folder (Terminal-Bench 2 tasks in Harbor's
format, byte for byte as published: tests/corpus.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from clirun import agentrl

from agentrl import corpus
from agentrl.errors import ConfigError
from agentrl.tasks.formats import dataset_tasks, expand, kind_of, load_any
from agentrl.trajectory import INFRA_STOP_REASONS, TrajectoryStore

HARBOR = "harbor"
MANIFEST = corpus.manifest("corpus.json")
KNOWN = {t["local_path"].split("/")[-1] for t in MANIFEST["tasks"] if t.get("known_difference")}


def _dataset() -> Path:
    folder = corpus.find(HARBOR)
    assert folder is not None
    return folder


def test_a_folder_of_task_folders_is_a_dataset_and_nothing_else_is(tmp_path: Path) -> None:
    """Harbor (task.toml) and Terminal-Bench (task.yaml with instruction:) folders count;
    an agentrl task folder, a file or an empty folder beside them do not."""
    (tmp_path / "b-harbor").mkdir()
    (tmp_path / "b-harbor" / "task.toml").write_text('version = "1.0"\n')
    (tmp_path / "a-tbench").mkdir()
    (tmp_path / "a-tbench" / "task.yaml").write_text("instruction: do it\n")
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "task.yaml").write_text("name: ours\nprompt: {}\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert dataset_tasks(tmp_path) == [tmp_path / "a-tbench", tmp_path / "b-harbor"]
    assert kind_of(tmp_path) == "dataset"
    assert expand([tmp_path / "ours", tmp_path]) == [
        tmp_path / "ours",
        tmp_path / "a-tbench",
        tmp_path / "b-harbor",
    ]
    assert dataset_tasks(tmp_path / "b-harbor") == []  # a task is not a dataset
    assert dataset_tasks(tmp_path / "empty") == []


@pytest.mark.corpus(HARBOR)
def test_validate_takes_the_genuine_harbor_dataset_whole() -> None:
    folder = _dataset()
    tasks = dataset_tasks(folder)
    assert len(tasks) >= 5
    done = agentrl("validate", folder)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if ": ok (" in line]
    assert len(lines) == len(tasks) and all("harbor task" in line for line in lines)


@pytest.mark.corpus(HARBOR)
def test_one_task_where_one_is_meant_says_so_in_one_line() -> None:
    folder = _dataset()
    with pytest.raises(ConfigError, match=r"is a dataset of \d+ tasks") as e:
        load_any(folder)
    assert "\n" not in e.value.message and str(dataset_tasks(folder)[0]) in (e.value.fix or "")


@pytest.mark.corpus(HARBOR)
def test_a_train_config_takes_a_dataset_as_its_tasks(tmp_path: Path) -> None:
    folder = _dataset()
    config = tmp_path / "train.yaml"
    config.write_text(
        f"name: harbor-dataset\ntasks: [{folder}]\n"
        "schedule: {type: sync, steps: 1, prompts_per_step: 2, n_samples_per_prompt: 2}\n"
        f"eval: {{tasks: [{folder}], samples: 1}}\n"
    )
    done = agentrl("validate", config)
    assert done.returncode == 0, done.stderr
    n = len(dataset_tasks(folder))
    assert f"{n} training and {n} held-out instances in {2 * n} task file(s)" in done.stdout


NOOP = '<tool_call>{"name": "bash", "arguments": {"command": "true"}}</tool_call>'


@pytest.mark.conformance
@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.corpus(HARBOR)
@pytest.mark.timeout(1500)  # cold, it builds the dataset's 8 images (CI: beside conformance's)
def test_run_and_check_take_the_genuine_harbor_dataset(tmp_path: Path) -> None:
    """`agentrl run DATASET` plays every task of it side by side (a policy that does
    nothing: graded by each task's own tests, 0), each into its own folder; `agentrl
    check DATASET` checks its tasks' reference solutions."""
    folder = _dataset()
    tasks = dataset_tasks(folder)
    script = tmp_path / "noop.json"
    script.write_text(json.dumps([NOOP]))
    out = tmp_path / "run"
    done = agentrl(
        *("run", folder, "--policy", f"scripted:{script}", "--max-turns", "1", "--out", out),
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [t.name for t in tasks]
    for task in tasks:
        (traj,) = TrajectoryStore(out / task.name / "trajectories.jsonl")
        if task.name in KNOWN:
            continue  # conformance records how it differs
        assert traj.stop_reason not in INFRA_STOP_REASONS, (task.name, traj.error)
        assert traj.reward == 0.0, task.name
    shutil.rmtree(out)
    first = tasks[0].name
    checked = agentrl("check", folder, "--instances", first, "--json", tmp_path / "c.json")
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    (row,) = json.loads((tmp_path / "c.json").read_text())
    assert row["ok"], row


def _harbor_task(folder: Path, toml: str) -> Path:
    (folder / "environment").mkdir(parents=True)
    (folder / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (folder / "tests").mkdir()
    (folder / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (folder / "instruction.md").write_text("Do the thing.\n")
    (folder / "task.toml").write_text(toml)
    return folder


def test_storage_and_the_environments_variables_are_honoured(tmp_path: Path) -> None:
    task = load_any(
        _harbor_task(
            tmp_path / "t",
            'version = "1.1"\n[environment]\ncpus = 2\nmemory = "3G"\nstorage = "4G"\n'
            '[environment.env]\nMODE = "strict"\n[verifier.env]\nLEVEL = "2"\n',
        )
    )
    box = task.spec.sandbox
    assert (box.cpus, box.memory_mb, box.disk_mb) == (2.0, 3072, 4096)
    assert box.env == {"MODE": "strict"} and box.workdir == "/app"
    assert task.instances[0].fields["verifier_env"] == {"LEVEL": "2"}


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ('[[steps]]\nname = "one"\n', "steps: multi-step tasks"),
        ("[environment]\ngpus = 1\n", "environment.gpus: tasks that need GPUs"),
    ],
)
def test_what_would_grade_otherwise_than_harbor_is_refused_not_ignored(
    tmp_path: Path, toml: str, said: str
) -> None:
    folder = _harbor_task(tmp_path / "t", 'version = "1.1"\n' + toml)
    with pytest.raises(ConfigError, match=said) as e:
        load_any(folder)
    assert "\n" not in e.value.message and e.value.fix
    # the verifier's settings: tests/test_harbor_verifier.py


@pytest.mark.docker
def test_a_datasets_tasks_run_side_by_side_each_into_its_folder(tmp_path: Path) -> None:
    """One dispatcher for the whole dataset (its log counts every task's episodes at
    once), a folder per task; `--instances` runs only the tasks holding them; `--resume`
    keeps the folders begun and runs the tasks not begun."""
    dataset = tmp_path / "dataset"
    for name in ("alpha", "beta", "gamma"):
        _harbor_task(dataset / name, 'version = "1.0"\n')
        (dataset / name / "environment" / "Dockerfile").write_text(
            "FROM agentrl/base:bookworm\nWORKDIR /app\n"
        )
    script = tmp_path / "noop.json"
    script.write_text(json.dumps([NOOP]))
    out = tmp_path / "run"
    run = ("run", dataset, "--policy", f"scripted:{script}", "--max-turns", "1", "--out", out)
    done = agentrl(*run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dataset: 3 episodes to run" in done.stderr  # one stream, all three tasks
    assert sorted(p.name for p in out.iterdir()) == ["alpha", "beta", "gamma"]
    first = {}
    for name in ("alpha", "beta", "gamma"):
        (traj,) = TrajectoryStore(out / name / "trajectories.jsonl")
        assert traj.task == name and traj.reward == 1.0  # test.sh writes 1
        first[name] = traj.trajectory_id, traj.seconds
    shutil.rmtree(out / "gamma")
    again = agentrl(*run, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "dataset: 1 episodes to run" in again.stderr  # gamma only
    for name in ("alpha", "beta"):
        (traj,) = TrajectoryStore(out / name / "trajectories.jsonl")
        assert (traj.trajectory_id, traj.seconds) == first[name]  # kept, not run again
    assert len(list(TrajectoryStore(out / "gamma" / "trajectories.jsonl"))) == 1
    only = agentrl(*run[:-1], tmp_path / "only", "--instances", "beta")
    assert only.returncode == 0, only.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "only").iterdir()) == ["beta"]
