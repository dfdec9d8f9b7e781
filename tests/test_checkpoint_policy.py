"""A train run's checkpoint as a policy: `--policy RUN_FOLDER` samples what the trainer
learned, full weights and LoRA alike, and the exported folder is a plain Hugging Face
model; folders that hold no usable checkpoint are refused in one line.

The sampling tests train the real embedded SmolLM2 (tied embeddings) one step on the
FSDP backend and compare the exported sampler's logprobs with the trainer's; the tiny
Llama of conftest (a model-folder base) is exported, served over HTTP and sampled.
"""

from __future__ import annotations

import asyncio
import filecmp
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_fsdp_backend import chat_prompt, learner_logprobs
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from agentrl.algorithms import LossConfig
from agentrl.backends.base import Sample
from agentrl.backends.fsdp import FSDPBackend, FSDPConfig
from agentrl.errors import ConfigError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.checkpoints import (
    EXPORT_NOTE,
    checkpoint_model,
    export_model,
    find_checkpoint,
)
from agentrl.inference.config import (
    CheckpointSamplerConfig,
    LocalSamplerConfig,
    OpenAISamplerConfig,
    parse_policy,
)
from agentrl.inference.embedded import load_model, load_tokenizer, model_tokenizer
from agentrl.inference.local import LocalSampler
from agentrl.inference.serve import serve
from agentrl.weights.config import LoraSpec

CE = LossConfig(type="cross_entropy")


@pytest.fixture
def exports() -> Iterator[list[Path]]:
    """Cache folders the test exported into; removed afterwards (each is a whole model)."""
    made: list[Path] = []
    yield made
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


def trained_run(
    run: Path, model: Path | None = None, **options: object
) -> tuple[FSDPBackend, list[int], int]:
    """One optimizer step of `model` (None: the embedded one) on a fixed reply, checkpointed
    as `agentrl train` does; returns the backend, the prompt + reply ids and the prompt length."""
    prompt = chat_prompt("Why is the sky blue? One sentence.")
    reply = load_tokenizer().encode("Because air scatters blue light the most.<|im_end|>")
    tokens = prompt + reply
    backend = FSDPBackend(FSDPConfig.model_validate(options), model)
    sample = Sample(
        trajectory_id="t0",
        tokens=tokens,
        loss_mask=[0] * len(prompt) + [1] * len(reply),
        sampler_logprobs=[0.0] * len(tokens),
        advantage=1.0,
    )
    backend.forward_backward([sample], CE)
    backend.optim_step()
    backend.save_checkpoint(run / "checkpoints", {"model": str(model or "embedded")}, step=1)
    return backend, tokens, len(prompt)


def check_sampler_scores_like_the_trainer(
    sampler: LocalSampler, backend: FSDPBackend, tokens: list[int], n_prompt: int
) -> None:
    learned = learner_logprobs(backend.model, tokens, 1.0)[n_prompt:]
    served = learner_logprobs(sampler.model, tokens, 1.0)[n_prompt:]
    base = learner_logprobs(load_model(), tokens, 1.0)[n_prompt:]
    to_trainer, to_base = (served - learned).abs().max(), (served - base).abs().max()
    print(f"exported vs trainer: max |diff| {to_trainer:.2e}; vs base: {to_base:.2e}")
    assert to_trainer < 1e-4
    assert to_base > 1e-3  # the step moved the weights the sampler serves

    async def sample() -> tuple[list[int], list[float]]:
        try:
            done = await sampler.generate(tokens[:n_prompt], SamplingParams(max_tokens=12, seed=3))
            return done.token_ids, done.logprobs
        finally:
            await sampler.close()

    ids, reported = asyncio.run(sample())  # what an episode would record
    scored = learner_logprobs(backend.model, tokens[:n_prompt] + ids, 1.0)[n_prompt:]
    mismatch = (torch.tensor(reported) - scored).abs().max()
    print(f"sampled {len(ids)} tokens: reported vs trainer logprobs, max |diff| {mismatch:.2e}")
    assert mismatch < 1e-3  # the sampling path's own arithmetic; the check above is exact


@pytest.mark.model
@pytest.mark.slow  # 9 s alone, up to 30 s on busy shared cores: a step, an export, loads
def test_a_full_weight_checkpoint_samples_as_the_trainer_scores(
    tmp_path: Path, exports: list[Path]
) -> None:
    backend, tokens, n_prompt = trained_run(tmp_path / "run", lr=1e-3)
    try:
        config = parse_policy(str(tmp_path / "run"))
        assert isinstance(config, CheckpointSamplerConfig)
        assert config.path == str((tmp_path / "run/checkpoints/step-000001").resolve())
        folder = Path(config.tokenizer_model())
        exports.append(folder)
        weights = folder / "model.safetensors"
        before = (weights.stat().st_ino, weights.stat().st_mtime_ns)
        sampler = config.build()
        assert checkpoint_model(tmp_path / "run") == folder  # exported once, then reused
        assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == before
        assert json.loads((folder / EXPORT_NOTE).read_text())["base_model"] == "embedded"
        assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
        assert (folder / "generation_config.json").is_file()  # the base has one
        check_sampler_scores_like_the_trainer(sampler, backend, tokens, n_prompt)
    finally:
        backend.close()


@pytest.mark.model
@pytest.mark.slow  # as above
def test_a_lora_checkpoint_is_merged_and_its_lm_head_untied(
    tmp_path: Path, exports: list[Path]
) -> None:
    # train_unembed adapts the lm_head SmolLM2 ties to its input embedding.
    spec = LoraSpec(rank=8, alpha=32.0, train_unembed=True)
    backend, tokens, n_prompt = trained_run(tmp_path / "run", lr=1e-2, lora=spec)
    try:
        config = parse_policy(str(tmp_path / "run/checkpoints/step-000001"))
        assert isinstance(config, CheckpointSamplerConfig)
        folder = Path(config.tokenizer_model())
        exports.append(folder)
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in folder.iterdir()
        }
        assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
        sampler = config.build()  # AutoModelForCausalLM.from_pretrained(folder), as vLLM loads
        head, embed = sampler.model.get_output_embeddings(), sampler.model.get_input_embeddings()
        assert head.weight is not embed.weight
        assert not torch.equal(head.weight, embed.weight)
        check_sampler_scores_like_the_trainer(sampler, backend, tokens, n_prompt)
    finally:
        backend.close()


def test_an_exported_model_folder_served_over_http_samples_as_the_trainer_scores(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """The GPU route on CPU: export, serve the folder (`agentrl serve --model OUT` here,
    `vllm serve OUT` there), then `--policy openai:URL`."""
    backend, tokens, n_prompt = trained_run(tmp_path / "run", tiny_dir, lr=1e-2)
    try:
        out = export_model(tmp_path / "run", tmp_path / "out")
        assert json.loads((out / EXPORT_NOTE).read_text())["base_model"] == str(tiny_dir)
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        served = learner_logprobs(reloaded, tokens, 1.0)
        assert (served - learner_logprobs(backend.model, tokens, 1.0)).abs().max() < 1e-4
        base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
        assert (served - learner_logprobs(base, tokens, 1.0)).abs().max() > 1e-3

        local = LocalSampler.for_model(str(out))
        server, url = serve(local, model_tokenizer(str(out)))
        sampler = parse_policy(f"openai:{url}").build()

        async def sample() -> Completion:
            try:
                return await sampler.generate(tokens[:n_prompt], SamplingParams(max_tokens=8))
            finally:
                await sampler.close()

        try:
            done = asyncio.run(sample())
        finally:
            server.close()
            asyncio.run(local.close())
        scored = learner_logprobs(backend.model, tokens[:n_prompt] + done.token_ids, 1.0)
        assert (torch.tensor(done.logprobs) - scored[n_prompt:]).abs().max() < 1e-3
    finally:
        backend.close()
    other = tmp_path / "other"  # the same layers with a narrower MLP: not what was trained
    config = LlamaConfig.from_pretrained(tiny_dir)
    config.intermediate_size = 96
    LlamaForCausalLM(config).save_pretrained(other)
    meta = tmp_path / "run/checkpoints/step-000001/meta.json"
    meta.write_text(meta.read_text().replace(str(tiny_dir), str(other)))
    with pytest.raises(ConfigError, match="do not fit the base model") as e:
        export_model(tmp_path / "run", tmp_path / "out2")
    assert "extra.model" in e.value.fix
    assert not (tmp_path / "out2").exists()


def write_checkpoint(folder: Path, meta: dict[str, object]) -> Path:
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(json.dumps(meta))
    (folder / "model.pt").write_bytes(b"")
    return folder


def test_folders_that_hold_no_usable_checkpoint_are_refused(tmp_path: Path) -> None:
    good = {"step": 3, "world_size": 1, "lora": None, "extra": {"model": "embedded"}}
    run = tmp_path / "run"
    (run / "checkpoints/step-000009.tmp-123").mkdir(parents=True)  # a torn write
    with pytest.raises(ConfigError, match="no complete checkpoint yet") as e:
        parse_policy(str(run))
    assert e.value.fix
    step = write_checkpoint(run / "checkpoints/step-000003", good)
    write_checkpoint(run / "checkpoints/step-000002", good)
    assert find_checkpoint(run) == step  # the newest complete one
    assert find_checkpoint(run / "checkpoints") == step
    assert parse_policy(str(run)) == CheckpointSamplerConfig(path=str(step.resolve()))

    with pytest.raises(ConfigError, match="neither a train run, a checkpoint nor a model"):
        parse_policy(str(tmp_path / "run/checkpoints/step-000009.tmp-123"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a train run, a checkpoint nor a model"):
        parse_policy(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_policy(str(tmp_path / "missing"))

    tinker = {"step": 1, "extra": {}, "tinker_path": "tinker://run-1/state/step-000001"}
    write_checkpoint(tmp_path / "t/checkpoints/step-000001", tinker)
    with pytest.raises(ConfigError, match="live on the Tinker service") as e:
        parse_policy(str(tmp_path / "t"))
    assert "create_training_client_from_state('tinker://run-1" in e.value.fix

    old = write_checkpoint(tmp_path / "old/step-000004", {**good, "extra": {}})
    with pytest.raises(ConfigError, match="extra.model") as e:
        parse_policy(str(old))
    assert '"model": "embedded"' in e.value.fix
    (tmp_path / "broken/step-000001").mkdir(parents=True)
    (tmp_path / "broken/step-000001/meta.json").write_text("{not json")
    with pytest.raises(ConfigError, match="meta.json: unreadable"):
        parse_policy(str(tmp_path / "broken"))

    moved = write_checkpoint(tmp_path / "moved/step-000001", {**good, "extra": {"model": "/gone"}})
    with pytest.raises(ConfigError, match="base model /gone: no such folder"):
        export_model(moved, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="already exists"):
        export_model(run, run)  # nothing is overwritten (checked before any weights load)


def test_a_model_folder_is_the_local_policy_and_each_names_its_tokenizer(
    tiny_dir: Path,
) -> None:
    config = parse_policy(str(tiny_dir))
    assert config == LocalSamplerConfig(model=str(tiny_dir.resolve()))
    assert config.tokenizer_model() == str(tiny_dir.resolve())
    assert parse_policy("local").tokenizer_model() == "embedded"
    assert OpenAISamplerConfig(url="http://127.0.0.1:1").tokenizer_model() == "embedded"
    assert parse_policy("router:http://127.0.0.1:1").tokenizer_model() == "embedded"


@pytest.mark.model
def test_the_embedded_model_exports_as_a_folder_a_server_starts_on(tmp_path: Path) -> None:
    """`agentrl export embedded DIR` (docs/serving.md's first step for a vLLM server): the
    embedded model's folder, whole, written atomically; an existing folder is refused."""
    from agentrl.inference.embedded import model_dir

    out = tmp_path / "models/smollm2"
    done = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "export", "embedded", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    source = model_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in source.iterdir())
    for file in source.iterdir():
        assert filecmp.cmp(file, out / file.name, shallow=False), file.name
    assert [p.name for p in out.parent.iterdir()] == ["smollm2"]  # no temporary folder left
    again = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "export", "embedded", str(out)],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1 and "already exists" in again.stderr
    assert "fix:" in again.stderr and "Traceback" not in again.stderr
