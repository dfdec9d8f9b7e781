"""OpenEnv environments as tasks (issue 43): a folder with `openenv.yaml` is a task whose
sandbox runs the environment's server, whose tools are its actions and whose rewards are
its steps'.

Real Docker, the real openenv-core server (PyPI), the CLI in a subprocess. The countdown
environment (examples/openenv/countdown_env) is agentrl's own, on openenv-core 0.2.2; the
genuine ones are OpenEnv's own folders as published (tests/corpus-openenv.json): Reasoning
Gym (one answer, scored), the maze (many steps, a reward each, done at the exit) and echo
(an MCP environment). Their images build from their Dockerfiles unchanged, on a stand-in
of OpenEnv's base image (sandboxes/standins/openenv-base)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from clirun import agentrl

from agentrl import corpus
from agentrl.errors import SandboxBroken
from agentrl.inference.embedded import load_tokenizer
from agentrl.sandbox.base import Sandbox
from agentrl.sandbox.docker.provider import DockerProvider
from agentrl.tasks.env import Opening
from agentrl.tasks.formats import dataset_tasks, kind_of, load_any
from agentrl.tasks.openenv.env import OpenEnvTaskEnv
from agentrl.tasks.openenv.image import bases
from agentrl.tasks.spec import Instance
from agentrl.trajectory import INFRA_STOP_REASONS, Trajectory, TrajectoryStore

ROOT = Path(__file__).parent.parent
COUNTDOWN = ROOT / "examples" / "openenv" / "countdown_env"
COUNTDOWN_TASK = ROOT / "examples" / "openenv" / "countdown.yaml"
REASONING_GYM, MAZE, ECHO = "openenv/reasoning_gym_env", "openenv/maze_env", "openenv/echo_env"
T = TypeVar("T")
MAZE_PATH = [3, 3, 3, 3, 1, 1, 3, 3, 1, 3, 1, 1, 1, 1]
"""The shortest way from (0, 0) to the exit (7, 7) of the maze the environment ships."""


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def script(folder: Path, *replies: str) -> Path:
    path = folder / f"script-{len(list(folder.glob('script-*')))}.yaml"
    path.write_text("".join(f"- {json.dumps(r)}\n" for r in replies))
    return path


def run(task: Path, out: Path, *replies: str) -> list[Trajectory]:
    done = agentrl(
        "run", task, "--policy", f"scripted:{script(out.parent, *replies)}", "--out", out,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return list(TrajectoryStore(out / "trajectories.jsonl"))


def passes_check(folder: Path) -> None:
    """`agentrl check`: no reference solution, so the no-op alone, which must start, reset
    and grade the environment."""
    check = agentrl("check", folder, timeout=1200)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "pass (no oracle)" in check.stdout and "1 of 1 instances pass" in check.stdout


def prompt_text(traj: Trajectory) -> str:
    return str(load_tokenizer().decode(traj.prompt_ids))


def published(local_path: str) -> Callable[[T], T]:
    """The marks of a test on a genuine environment (CI's conformance stage)."""
    marks = [pytest.mark.docker, pytest.mark.conformance, pytest.mark.model, pytest.mark.slow]

    def apply(test: T) -> T:
        for mark in [*marks, pytest.mark.corpus(local_path)]:
            test = mark(test)
        return test

    return apply


def genuine(local_path: str) -> Path:
    found = corpus.find(local_path)
    assert found is not None
    return found


# -- what a folder is --------------------------------------------------------------------


def test_an_openenv_folder_is_a_task_and_a_folder_of_them_a_dataset(tmp_path: Path) -> None:
    """`openenv.yaml` makes a folder an OpenEnv task (not beside a task file of another
    format); a folder of such folders is a dataset, as OpenEnv's own envs/ is."""
    assert kind_of(COUNTDOWN) == "openenv"
    task = load_any(COUNTDOWN)
    assert (task.format, task.spec.name, [i.id for i in task.instances]) == (
        "openenv",
        "countdown_env",
        ["countdown_env"],
    )
    assert task.spec.grader.type == "environment"
    (tmp_path / "envs").mkdir()
    for name in ("b_env", "a_env"):
        (tmp_path / "envs" / name / "server").mkdir(parents=True)
        (tmp_path / "envs" / name / "openenv.yaml").write_text(f"name: {name}\n")
        (tmp_path / "envs" / name / "server" / "Dockerfile").write_text("FROM scratch\n")
    assert dataset_tasks(tmp_path / "envs") == [
        tmp_path / "envs" / "a_env",
        tmp_path / "envs" / "b_env",
    ]
    both = tmp_path / "both"
    both.mkdir()
    (both / "openenv.yaml").write_text("name: x\n")
    (both / "task.toml").write_text('version = "1.0"\n')
    assert kind_of(both) == "task-folder"  # Harbor's task.toml decides


def test_a_bad_manifest_or_no_dockerfile_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "openenv.yaml").write_text("port: 8000\n")
    bad = agentrl("validate", tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "openenv.yaml: name: Field required" in bad.stderr and "fix:" in bad.stderr
    (tmp_path / "openenv.yaml").write_text("name: nodocker\n")
    bad = agentrl("validate", tmp_path)
    assert bad.returncode == 1 and "no server/Dockerfile" in bad.stderr and "fix:" in bad.stderr


def test_the_base_images_of_a_published_dockerfile_are_its_arg_defaults() -> None:
    text = (
        "ARG BASE_IMAGE=ghcr.io/meta-pytorch/openenv-base:latest\n"
        "FROM ${BASE_IMAGE} AS builder\nRUN true\nFROM ${BASE_IMAGE}\n"
        "COPY --from=builder /a /a\nFROM python:3.11-slim AS other\nFROM builder\n"
    )
    assert bases(text) == ["ghcr.io/meta-pytorch/openenv-base:latest", "python:3.11-slim"]


# -- agentrl's own countdown environment -------------------------------------------------


@contextlib.asynccontextmanager
async def countdown(
    run_id: str,
) -> AsyncIterator[tuple[OpenEnvTaskEnv, Sandbox, Instance, Opening]]:
    """The countdown's first instance started (INIT) and opened; its sandbox closed after."""
    task = load_any(COUNTDOWN)
    env = OpenEnvTaskEnv(task, DockerProvider(), run_id)
    instance = task.instances[0]
    sandbox = await env.init(instance, "countdown")
    try:
        opening = await env.opening(sandbox, instance)
        assert opening is not None
        yield env, sandbox, instance, opening
    finally:
        await sandbox.close()


@pytest.mark.docker
@pytest.mark.conformance
def test_steps_rewards_done_and_refused_actions(run_id: str) -> None:
    """Through the environment's tool: each step's reward and observation, an action that
    does not fit its schema and one the environment raises on are the agent's failed
    calls (no step, no reward), done ends it; the grade is the sum of the step rewards."""

    async def go() -> None:
        async with countdown(run_id) as (env, sandbox, instance, opening):
            first = "message: Count down from 3 to 1, one number per step.\nremaining: 3"
            assert opening.text == first
            assert sorted(opening.tools) == ["count", "finish"]
            count = opening.tools["count"]
            assert count.parameters["properties"]["number"]["type"] == "integer"
            seen = [await count(sandbox, number=n) for n in (3, 5)]
            rewarded = [(o.reward, o.error, o.done) for o in seen]
            assert rewarded == [(1.0, False, False), (-0.5, False, False)]
            assert seen[1].text == "message: wrong: the next number is 2\nremaining: 2"
            unfit = await count(sandbox, number="two")
            assert unfit.error and unfit.reward is None and "number:" in unfit.text
            raised = await count(sandbox, number=999)
            assert raised.error and "999 is not a number this environment counts" in raised.text
            last = [await count(sandbox, number=n) for n in (2, 1)]
            assert last[-1].done and last[-1].reward == 1.0
            grade = await env.evaluate(sandbox, instance)
            assert grade.reward == 2.5
            steps = {"steps": 4, "step_rewards": [1.0, -0.5, 1.0, 1.0], "done": True}
            assert grade.components == steps

    asyncio.run(go())


@pytest.mark.docker
@pytest.mark.conformance
def test_an_action_that_ends_the_server_is_the_agents_doing(run_id: str) -> None:
    async def go() -> None:
        async with countdown(run_id) as (env, sandbox, instance, opening):
            assert (await opening.tools["count"](sandbox, number=3)).reward == 1.0
            with pytest.raises(SandboxBroken, match="went away during the agent's step"):
                await opening.tools["count"](sandbox, number=-1)
            grade = await env.evaluate(sandbox, instance)  # what it earned before
            assert grade.reward == 1.0 and "went away" in " ".join(grade.evidence.notes)

    asyncio.run(go())


@pytest.mark.docker
@pytest.mark.conformance
@pytest.mark.model
def test_validate_check_and_run_the_countdown_from_the_cli(tmp_path: Path) -> None:
    """The folder as a person uses it: validate, check (no reference solution: a no-op
    alone), run with a scripted policy. The trajectory opens with the reset observation
    and the environment's action as a tool; every step's reward is its turn's."""
    valid = agentrl("validate", COUNTDOWN)
    assert valid.returncode == 0, valid.stderr
    assert "ok (1 instances, openenv task)" in valid.stdout
    passes_check(COUNTDOWN)
    (traj,) = run(
        COUNTDOWN,
        tmp_path / "solved",
        call("count", number=3),
        call("count", number=4),
        call("count", number=2),
        call("count", number=1),
    )
    assert traj.stop_reason.value == "finished" and traj.reward == 2.5
    assert traj.turn_rewards == [1.0, -0.5, 1.0, 1.0]
    assert traj.reward_components["step_rewards"] == [1.0, -0.5, 1.0, 1.0]
    text = prompt_text(traj)
    assert "Count down from 3 to 1, one number per step." in text
    assert '"name": "count"' in text and "the next number, counting down to 1" in text
    assert traj.turns[1].observation == "message: wrong: the next number is 2\nremaining: 2"
    traj.check()
    # conversations.jsonl: what the model saw, the opening observation included
    (seen,) = [json.loads(x) for x in (tmp_path / "solved" / "conversations.jsonl").open()]
    assert "Count down from 3 to 1" in json.dumps(seen["messages"])
    # The server gone at the agent's hand: graded on what came before, trained on.
    (broken,) = run(
        COUNTDOWN, tmp_path / "broken", call("count", number=3), call("count", number=-1)
    )
    assert broken.stop_reason.value == "sandbox_broken"
    assert broken.stop_reason not in INFRA_STOP_REASONS
    assert broken.reward == 1.0 and broken.turn_rewards == [1.0, 0.0]
    assert any(m == 1 for m in broken.loss_mask)


def test_a_task_file_names_an_environment_and_its_instances_reset_it(tmp_path: Path) -> None:
    """`environment:` in a task file: its instances' fields are reset()'s arguments, the
    prompt is the task's; what would act beside the environment's server is refused."""
    task = load_any(COUNTDOWN_TASK)
    assert (task.format, task.env) == ("openenv", "agentrl.tasks.openenv.env:OpenEnvTaskEnv")
    assert [(i.id, i.fields) for i in task.instances] == [
        ("from-2", {"start": 2}),
        ("from-4", {"start": 4}),
    ]
    bad = tmp_path / "bad.yaml"
    shutil.copytree(COUNTDOWN, tmp_path / "countdown_env")
    text = COUNTDOWN_TASK.read_text()
    for edit, words in [
        (("tools: [finish]", "tools: [finish, bash]"), "tools: may add finish or submit, not bash"),
        (
            ("grader: {type: environment}", "grader: {type: command, command: 'true'}"),
            "graded by its steps",
        ),
        (
            ("tools: [finish]", "tools: [finish]\nsandbox: {setup: [ls]}"),
            "no sandbox.image, recipe",
        ),
        (("environment: countdown_env", "environment: elsewhere"), "no OpenEnv environment folder"),
    ]:
        bad.write_text(text.replace(*edit))
        done = agentrl("validate", bad)
        assert done.returncode == 1 and words in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


@pytest.mark.docker
@pytest.mark.conformance
@pytest.mark.model
def test_a_task_file_runs_its_instances_on_the_environment(tmp_path: Path) -> None:
    trajs = run(
        COUNTDOWN_TASK,
        tmp_path / "run",
        call("count", number=2),
        call("count", number=1),
        call("finish"),
    )
    by_id = {t.group_id: t for t in trajs}
    two, four = by_id["from-2"], by_id["from-4"]
    assert two.stop_reason.value == "finished" and two.reward == 2.0
    assert "Count down to 1 (instance from-2)." in prompt_text(two)
    assert "Count down from 2 to 1" in prompt_text(two)
    assert "Count down from 4 to 1" in prompt_text(four)
    assert four.turn_rewards == [-0.5, -0.5, 0.0] and four.reward == -1.0
    assert four.stop_reason.value == "finished"  # its finish call


@pytest.mark.docker
@pytest.mark.conformance
@pytest.mark.model
@pytest.mark.slow
def test_the_embedded_model_plays_the_countdown(tmp_path: Path) -> None:
    """SmolLM2 itself, token in and token out: whatever it says, the trajectory is whole
    (its sampled tokens masked in, with their logprobs), graded by the environment, and no
    infrastructure failure."""
    out = tmp_path / "model"
    done = agentrl(
        "run", COUNTDOWN, "--policy", "local", "--max-turns", "2", "--max-new-tokens", "64",
        "--out", out, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (traj,) = TrajectoryStore(out / "trajectories.jsonl")
    assert traj.stop_reason not in INFRA_STOP_REASONS, traj.error
    assert traj.reward is not None and 1 <= len(traj.turns) <= 2
    assert not traj.turn_rewards or len(traj.turn_rewards) == len(traj.turns)
    sampled = [i for i, m in enumerate(traj.loss_mask) if m]
    assert sampled and all(traj.logprobs[i] < 0 or traj.logprobs[i] == 0.0 for i in sampled)
    assert "Count down from 3" in prompt_text(traj)
    traj.check()


# -- genuine published environments -----------------------------------------------------


@published(REASONING_GYM)
def test_reasoning_gym_as_published_scores_the_answer(tmp_path: Path) -> None:
    """validate, check, then two runs: a wrong answer earns 0 and the environment reveals
    the right one; that answer earns the dataset's full score."""
    folder = genuine(REASONING_GYM)
    assert agentrl("validate", folder).returncode == 0
    passes_check(folder)
    (wrong,) = run(folder, tmp_path / "wrong", call("reasoning_gym", answer="7"))
    assert "how many legs are there in total" in prompt_text(wrong)
    assert wrong.stop_reason.value == "finished" and wrong.reward == 0.0
    revealed = re.search(r"correct_answer: (\S+)", wrong.turns[0].observation)
    assert revealed is not None
    (right,) = run(folder, tmp_path / "right", call("reasoning_gym", answer=revealed.group(1)))
    assert right.reward == 1.0 and right.turn_rewards == [1.0]
    assert right.stop_reason.value == "finished"
    # A task file around it: one question per instance, from reset()'s arguments.
    shutil.copytree(folder, tmp_path / "task" / "reasoning_gym_env")
    task = tmp_path / "task" / "legs.yaml"
    task.write_text(
        "name: legs\nenvironment: reasoning_gym_env\ninstances:\n"
        "  - {id: s1, dataset_name: leg_counting, seed: 1, size: 1}\n"
        "  - {id: s2, dataset_name: leg_counting, seed: 2, size: 1}\n"
        "prompt: {system: Answer with the reasoning_gym tool., instance: 'Question {id}:'}\n"
        "tools: [finish]\ngrader: {type: environment}\n"
    )
    asked = {t.group_id: prompt_text(t) for t in run(task, tmp_path / "legs", call("finish"))}
    legs = r"how many legs are there in total if you have ([^?]+)"
    found = {k: m.group(1) for k, v in asked.items() if (m := re.search(legs, v))}
    assert len(found) == 2 and found["s1"] != found["s2"], asked


@published(MAZE)
def test_the_maze_as_published_rewards_every_step_to_the_exit(tmp_path: Path) -> None:
    folder = genuine(MAZE)
    passes_check(folder)
    (traj,) = run(folder, tmp_path / "maze", *[call("maze", action=a) for a in MAZE_PATH])
    assert traj.stop_reason.value == "finished", traj.error
    assert len(traj.turn_rewards) == len(MAZE_PATH)
    assert traj.turn_rewards[-1] == 10.0 and all(r < 0 for r in traj.turn_rewards[:-1])
    assert traj.reward == pytest.approx(sum(traj.turn_rewards))
    assert "current_position: [7, 7]" in traj.turns[-1].observation


@published(ECHO)
def test_echo_as_published_offers_its_mcp_tools(tmp_path: Path) -> None:
    """An MCP environment: its tools are the ones it lists (tools/list), each with its own
    schema. (Calling one runs into huggingface/OpenEnv#455 with the openenv-core its
    uv.lock pins: the server answers a WebSocket call_tool step with a 30 s timeout.)"""
    folder = genuine(ECHO)
    passes_check(folder)
    (traj,) = run(folder, tmp_path / "echo", call("finish", message="done"))
    assert traj.stop_reason.value == "finished" and traj.reward == 0.0
    text = prompt_text(traj)
    assert '"name": "echo_message"' in text and '"name": "echo_with_length"' in text
    assert "Echo back the provided message." in text
