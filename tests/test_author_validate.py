"""A task author's first day (issue 39): `agentrl validate` proves a train config can
start (every task and rows file it names, the split, the model folder), checks prompts at
a cost that does not grow with the instances beyond reading them, and a mistyped
`agentrl/` image gets a fix that names the images the recipes make, never a build of
another one. Real files, the real tokenizer, the real Docker engine; no model loaded.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from agentrl.chat import ChatSession
from agentrl.cli import main
from agentrl.episode import open_chat
from agentrl.errors import ConfigError, SandboxError
from agentrl.inference.embedded import model_dir
from agentrl.preflight import _could_overflow, check_prompts
from agentrl.sandbox import provider
from agentrl.sandbox.base import SandboxSpec
from agentrl.sandbox.images import missing_image_fix
from agentrl.tasks.env import build_tools
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Instance, Task
from agentrl.train_config import load_train

REPO = Path(__file__).resolve().parents[1]
SWE_FSDP = REPO / "examples" / "train" / "swe-fsdp.yaml"

TASK = """\
name: count
sandbox: {{image: agentrl/base:bookworm}}
instances: {instances}
prompt:
  system: You are a careful engineer. Call one tool per turn.
  instance: "Write {{text}} to /workspace/out.txt, then call finish."
tools: [bash, str_replace_editor, finish]
limits: {{max_turns: 4, max_new_tokens: 64, context_length: {context}}}
grader: {{type: command, command: test -s /workspace/out.txt}}
"""

TRAIN = """\
name: first-day
tasks: {tasks}
model: {model}
schedule: {{type: {schedule}, steps: 1, prompts_per_step: {batch}, n_samples_per_prompt: 2}}
"""


def _task(folder: Path, texts: list[str], context: int = 4096, name: str = "task.yaml") -> Path:
    rows = folder / f"{Path(name).stem}.jsonl"
    rows.write_text(
        "".join(json.dumps({"id": f"i{k}", "text": t}) + "\n" for k, t in enumerate(texts))
    )
    path = folder / name
    path.write_text(TASK.format(instances=rows.name, context=context))
    return path


def _config(
    folder: Path, tasks: list[str], model: str = "embedded", extra: str = "", batch: int = 1
) -> Path:
    path = folder / "train.yaml"
    schedule = "async" if batch > 1 else "sync"
    text = TRAIN.format(tasks=json.dumps(tasks), model=model, schedule=schedule, batch=batch)
    path.write_text(text + extra)
    return path


def _validate(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["validate", str(path)])
    out = capsys.readouterr()
    return code, out.out + out.err


# -- a train config is validated as train starts from it ---------------------------------


def test_a_missing_or_broken_task_file_fails_validate_and_train_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(TASK.format(instances="[{id: a}]", context=4096).replace("{text}", "{txt}"))
    config = _config(tmp_path, ["missing.jsonl", "broken.yaml"])
    code, out = _validate(config, capsys)
    assert code == 1
    assert f"{config}:2: tasks[0]: 'missing.jsonl' not found (looked for {tmp_path}" in out
    assert f"{broken}:6: prompt.instance: placeholder {{txt}}" in out
    assert ": ok (" not in out and "Traceback" not in out
    # `agentrl train` fails the same way, before torch or anything else is loaded.
    code = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(config), "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert code.returncode == 1 and "Traceback" not in code.stderr
    assert f"{config}:2: tasks[0]: 'missing.jsonl' not found" in code.stderr
    assert f"{broken}:6: prompt.instance: placeholder {{txt}}" in code.stderr
    assert not (tmp_path / "r").exists()
    code, out = _validate(tmp_path / "gone", capsys)  # a folder that is not there
    assert code == 1 and f"{tmp_path / 'gone'}: not found" in out


def test_the_swe_recipe_without_its_data_files_does_not_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/train/swe-fsdp.yaml with its model folder in place but no rows: every
    rows file it names is reported at its line, as `agentrl train` would report it."""
    folder = tmp_path / "examples" / "train"
    folder.mkdir(parents=True)
    config = Path(shutil.copy(SWE_FSDP, folder / "swe-fsdp.yaml"))
    model = tmp_path / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (model / name).write_text("{}")
    code, out = _validate(config, capsys)
    assert code == 1, out
    assert f"{config}:21: tasks[0]: '../../data/swe/swe-gym.jsonl' not found" in out
    assert "eval.tasks[0]: '../../data/swe/swe-bench-verified.jsonl' not found" in out
    assert "model:" not in out  # the folder is there


@pytest.mark.model  # the embedded model must be installed for its config to be valid
def test_validate_checks_the_split_the_batch_and_the_model_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _task(tmp_path, ["one", "two", "three"])
    lonely = _config(tmp_path, ["task.yaml"], extra="eval: {holdout_every: 4}\n")
    code, out = _validate(lonely, capsys)  # instance 0 is held out, two train
    assert code == 0 and "2 training and 1 held-out instances" in out
    _task(tmp_path, ["only"], name="one.yaml")
    config = _config(tmp_path, ["one.yaml"])
    code, out = _validate(config, capsys)
    assert code == 1 and "0 training and 1 held-out instances" in out
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    config = _config(tmp_path, ["task.yaml"], model="model", batch=8)
    code, out = _validate(config, capsys)
    assert code == 1
    assert f"{config}:3: model: model folder 'model'" in out
    assert "holds no weights (*.safetensors or *.bin), no tokenizer" in out
    assert "schedule.prompts_per_step: 2 training prompts cannot fill one mini-batch" in out
    with pytest.raises(ConfigError, match="cannot fill one mini-batch"):
        load_train(config)


@pytest.mark.model
def test_validate_of_a_good_train_config_loads_its_tasks_without_torch(tmp_path: Path) -> None:
    _task(tmp_path, [f"text {k}" for k in range(8)])
    config = _config(tmp_path, ["task.yaml"])
    code = (
        "import sys\n"
        "from agentrl.cli import main\n"
        f"assert main(['validate', {str(config)!r}]) == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'tinker', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "6 training and 2 held-out instances" in done.stdout
    inputs = load_train(config)
    assert [len(t.instances) for t in inputs.tasks] == [8] and inputs.eval_tasks == []


# -- the prompt check tokenizes only what could overflow ----------------------------------


def _tokenizer(template: str | None = None) -> PreTrainedTokenizerBase:
    fast: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(model_dir())
    if template is not None:
        fast.chat_template = template
    return fast


@pytest.mark.model
def test_only_prompts_that_could_reach_the_limit_are_tokenized(tmp_path: Path) -> None:
    texts = [f"line {k}" for k in range(2000)] + ["word " * 5000, "word " * 400, "é" * 20]
    task = load_task(_task(tmp_path, texts))
    tokenizer = _tokenizer()
    counted = [i.id for i in _could_overflow(task, build_tools(task), tokenizer)]
    assert counted == ["i2000", "i2001", "i2002"]  # two long ones, one not ASCII
    with pytest.raises(ConfigError, match=r"instance i2000: the first prompt is [\d,]+ tokens"):
        check_prompts(task, tokenizer)


@pytest.mark.model
def test_an_instance_left_uncounted_always_fits(tmp_path: Path) -> None:
    """The shortcut is sound: every instance it skips fits when tokenized, for a template
    that trims what it is given too; a template that escapes its content gets every
    instance counted."""
    # Digits are a token each: prompts whose tokens come near their bytes.
    texts = [("7" * n) + '"<&> \\' * (n % 7) + " " * (n % 3) for n in range(0, 1800, 23)]
    task = load_task(_task(tmp_path, texts))
    plain = _tokenizer()
    trimming = _tokenizer(
        plain.chat_template.replace("message['content']", "message['content'] | trim")
    )
    escaping = _tokenizer(
        plain.chat_template.replace("message['content']", "message['content'] | tojson")
    )
    tools = build_tools(task)
    for tokenizer in (plain, trimming):
        counted = {i.id for i in _could_overflow(task, tools, tokenizer)}
        assert 0 < len(counted) < len(task.instances)
        for instance in task.instances:
            if instance.id not in counted:
                chat = _chat(task, instance, tokenizer)
                assert len(chat) < task.spec.limits.context_length, instance.id
    assert len(list(_could_overflow(task, tools, escaping))) == len(task.instances)


def _chat(task: Task, instance: Instance, tokenizer: PreTrainedTokenizerBase) -> ChatSession:
    return open_chat(task, instance, build_tools(task), tokenizer)


# -- a mistyped agentrl/ image ------------------------------------------------------------


def test_a_mistyped_agentrl_image_names_the_recipes_and_the_nearest() -> None:
    fix = missing_image_fix("agentrl/base:bookwrom")
    assert "did you mean agentrl/base:bookworm?" in fix
    assert "agentrl/eval-python:bookworm" in fix  # every image a recipe makes
    assert "agentrl images build" not in fix  # that would build another image, and fail again
    assert missing_image_fix("agentrl/base:bookworm") == "agentrl images build base"
    assert "agentrl images build" not in missing_image_fix("agentrl/mything:v1")
    assert missing_image_fix("python:3.13") == "docker pull python:3.13 (or docker load it)"


@pytest.mark.docker
def test_starting_a_mistyped_agentrl_image_gets_that_fix(run_id: str) -> None:
    async def go() -> None:
        prov = provider("docker", reap_at_start=False)
        with pytest.raises(SandboxError, match="image agentrl/base:bookwrom not found") as info:
            await prov.start(SandboxSpec(run_id=run_id, image="agentrl/base:bookwrom"))
        assert info.value.fix is not None
        assert "did you mean agentrl/base:bookworm?" in info.value.fix
        assert "agentrl images build" not in info.value.fix

    asyncio.run(go())
