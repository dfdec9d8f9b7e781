"""The sandbox seam is open: a provider of the tests' own (tests/sandbox_test_provider.py,
named `module:Class`, nothing in agentrl/ changed for it) plays a YAML task end to end
through the real episode, tokenizer and grader; what it cannot do is refused or skipped
with a message that says so, never a crash. And the built-in providers declare what
their sandboxes really do."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from sandbox_test_provider import FolderProvider

from agentrl.episode import make_env, run_episode
from agentrl.errors import ConfigError, Unsupported
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler
from agentrl.sandbox import provider
from agentrl.sandbox.base import Metered, SandboxSpec
from agentrl.sandbox.config import CustomSandboxConfig, DockerSandboxConfig, parse_provider
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Task
from agentrl.trajectory import StopReason, Trajectory

pytestmark = pytest.mark.model
NAME = "sandbox_test_provider:FolderProvider"
RUN_ID = f"test-seam-{uuid.uuid4().hex[:8]}"
TASK = """\
name: write-a-word
description: Write one word into a file.
sandbox:
  workdir: /workspace
  setup: ["echo ready > .setup-marker"]
instances:
  - {id: greet, filename: greeting.txt, content: hello}
  - {id: farewell, filename: bye.txt, content: goodbye}
prompt:
  system: You work in a folder.
  instance: "Create /workspace/{filename} holding exactly {content}, then call finish."
tools: [TOOLS]
limits: {max_turns: 4, max_new_tokens: 96, context_length: 2048, tool_timeout: 20}
grader:
  type: command
  command: 'test "$(cat {filename})" = "{content}" && test -f .setup-marker'
"""
CREATE = (
    '<tool_call>{"name": "str_replace_editor", "arguments": {"command": "create", '
    '"path": "/workspace/greeting.txt", "file_text": "hello"}}</tool_call>'
)
FINISH = '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def write_task(folder: Path, *, tools: str = "str_replace_editor, finish", extra: str = "") -> Task:
    path = folder / "task.yaml"
    path.write_text(TASK.replace("TOOLS", tools) + extra)
    return load_task(path)


def play(task: Task, replies: list[str], tokenizer, instance: int = 0) -> Trajectory:
    async def main() -> Trajectory:
        env = make_env(task, provider(NAME), RUN_ID)
        sampler = ScriptedSampler(replies, tokenizer)
        return await run_episode(task, task.instances[instance], 0, sampler, tokenizer, env)

    return asyncio.run(main())


def test_a_provider_of_ones_own_plays_a_yaml_task_end_to_end(tmp_path: Path, tokenizer) -> None:
    task = write_task(tmp_path)
    solved = play(task, [CREATE, FINISH], tokenizer)
    assert solved.stop_reason == StopReason.finished and solved.reward == 1.0
    assert solved.env.provider == NAME  # what replay builds again
    assert isinstance(provider(solved.env.provider), FolderProvider)
    unsolved = play(task, [CREATE, FINISH], tokenizer, instance=1)  # wrote the wrong file
    assert unsolved.stop_reason == StopReason.finished and unsolved.reward == 0.0


def test_what_it_lacks_is_refused_or_skipped_with_a_message(
    tmp_path: Path, tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    # Snapshots asked for every turn: the episode goes on without them, and says why.
    task = write_task(tmp_path, extra="snapshots: {every: 1}\n")
    with caplog.at_level(logging.WARNING):
        traj = play(task, [CREATE, FINISH], tokenizer)
    assert traj.stop_reason == StopReason.finished and traj.reward == 1.0
    assert traj.env.init_snapshot is None and all(t.snapshot_id is None for t in traj.turns)
    assert any("cannot snapshot" in r.getMessage() for r in caplog.records)

    # Restoring (replay, branch credit) is refused, naming the provider and the ability.
    env = make_env(task, provider(NAME), RUN_ID)
    with pytest.raises(Unsupported, match=f"'{NAME}' cannot restore .*snapshots"):
        asyncio.run(env.restore(task.instances[0], "any-snapshot", "restored"))

    # The bash tool needs a shell it has not: the episode ends as an infrastructure
    # failure that says so (never a reward).
    bash = write_task(tmp_path, tools="bash, finish")
    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    traj = play(bash, [call, FINISH], tokenizer)
    assert traj.stop_reason == StopReason.sandbox_error and traj.reward is None
    assert "no interactive shell" in (traj.error or "")

    # Grading has no copy to make: the evidence says the grader saw the sandbox as is.
    async def seal() -> list[str]:
        box = await provider(NAME).start(SandboxSpec(run_id=RUN_ID))
        try:
            return (await env.evaluate(box, task.instances[0])).evidence.sealed.notes
        finally:
            await box.close()

    assert any("no grading copy" in note for note in asyncio.run(seal()))


def test_every_spelling_builds_through_one_union(tmp_path: Path) -> None:
    from agentrl.train_config import TrainConfig

    schedule = {"type": "sync", "steps": 1, "prompts_per_step": 1, "n_samples_per_prompt": 2}
    base = {"name": "x", "tasks": ["t.yaml"], "schedule": schedule}
    assert TrainConfig.model_validate(base).provider == "docker"
    config = TrainConfig.model_validate({**base, "provider": NAME})
    assert parse_provider(config.provider) == CustomSandboxConfig(path=NAME)
    with pytest.raises(ValueError, match="unknown sandbox provider 'dokcer'"):
        TrainConfig.model_validate({**base, "provider": "dokcer"})
    with pytest.raises(ValueError, match="sandbox nodes run Docker"):
        TrainConfig.model_validate({**base, "provider": NAME, "cluster": {"address": "auto"}})

    custom = {"type": "custom", "path": NAME, "options": {"root": str(tmp_path)}}
    built = parse_provider(custom).build()
    assert isinstance(built, FolderProvider) and built.root == str(tmp_path)
    assert built.name == NAME and not any(built.capabilities.model_dump().values())
    assert parse_provider("docker", reap_at_start=False) == DockerSandboxConfig(reap_at_start=False)
    with pytest.raises(ConfigError, match="is no provider"):
        provider("pathlib:PurePath")
    with pytest.raises(ConfigError, match="bad options"):
        provider(NAME, colour="blue")
    with pytest.raises(ConfigError, match="bad options: colour"):
        provider("local", colour="blue")


def test_built_in_capabilities_are_what_their_sandboxes_do() -> None:
    local = provider("local")
    assert not local.capabilities.images and not local.capabilities.grading_copy

    async def sandbox_is_metered() -> bool:
        box = await local.start(SandboxSpec(run_id=RUN_ID))
        try:
            return isinstance(box, Metered)
        finally:
            await box.close()

    assert asyncio.run(sandbox_is_metered()) == local.capabilities.metered
    from agentrl.sandbox.docker import DockerProvider  # the class: no engine needed

    assert all(DockerProvider.capabilities.model_dump().values())


def test_choosing_a_provider_imports_no_docker_sdk() -> None:
    code = (
        "import sys\n"
        "from agentrl.sandbox.config import parse_provider\n"
        "parse_provider('docker'); parse_provider({'type': 'local'})\n"
        "assert 'docker' not in sys.modules, 'the docker SDK was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
