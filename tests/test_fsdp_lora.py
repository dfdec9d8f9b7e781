"""LoRA on the FSDP2 backend, on CPU: a fresh adapter is the base model, only adapters
train, a tied embedding stays put, published (merged) weights sample like the learner,
checkpoints resume exactly and refuse other adapters, ranks add up.

Most tests use the tiny tied Llama of conftest (SmolLM2's vocabulary); the last one runs
the real embedded SmolLM2 through the real LocalSampler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError
from test_fsdp_backend import (
    chat_prompt,
    full,
    generate,
    learner_logprobs,
    random_samples,
    sample_of,
)
from transformers import LlamaForCausalLM

from agentrl.algorithms import LossConfig
from agentrl.backends.fsdp import FSDPBackend, FSDPConfig
from agentrl.backends.process_group import init_loopback_group
from agentrl.errors import ConfigError
from agentrl.inference.base import SamplingParams
from agentrl.inference.embedded import load_model
from agentrl.inference.local import LocalSampler
from agentrl.weights import lora
from agentrl.weights.config import LoraSpec

PPO = LossConfig(type="ppo")
CE = LossConfig(type="cross_entropy")
SPEC = LoraSpec(rank=4, alpha=8.0)
Factory = Callable[..., FSDPBackend]


@pytest.fixture
def make_backend(tiny_dir: Path) -> Iterator[Factory]:
    """Builds backends (tiny model unless `model_path=None`); closes them all afterwards."""
    built: list[FSDPBackend] = []

    def make(model_path: Path | None = tiny_dir, **options: object) -> FSDPBackend:
        built.append(FSDPBackend(FSDPConfig.model_validate(options), model_path))
        return built[-1]

    yield make
    for backend in built:
        backend.close()


def split_params(backend: FSDPBackend) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base weights, adapters), whole and on CPU."""
    named = {n: full(p) for n, p in backend.model.named_parameters()}
    adapters = {n: p for n, p in named.items() if lora.is_adapter(n)}
    return {n: p for n, p in named.items() if n not in adapters}, adapters


def train(backend: FSDPBackend, steps: int, loss: LossConfig = CE) -> list[float]:
    """`steps` optimizer steps on one fixed batch; the loss before each."""
    samples = random_samples(3)
    losses = []
    for _ in range(steps):
        losses.append(backend.forward_backward(samples, loss)["loss"])
        backend.optim_step()
    return losses


def tiny_sampler(tiny_dir: Path, *, untied: bool) -> LocalSampler:
    model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    if untied:
        lora.untie_output(model)
    return LocalSampler(model)


def test_a_fresh_adapter_computes_the_base_model_exactly(make_backend: Factory) -> None:
    plain, adapted = make_backend(), make_backend(lora=SPEC)
    samples = random_samples(3)
    for s in samples:
        lp = learner_logprobs(adapted.model, s.tokens, 1.0)
        assert torch.equal(lp, learner_logprobs(plain.model, s.tokens, 1.0))
    # Through the loss too (only the masked positions are projected there).
    assert (
        adapted.forward_backward(samples, PPO)["loss"]
        == plain.forward_backward(samples, PPO)["loss"]
    )
    _, adapters = split_params(adapted)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if n.endswith("lora_A"))
    assert all(not p.any() for n, p in adapters.items() if n.endswith("lora_B"))


def test_only_the_adapters_train_and_the_loss_goes_down(make_backend: Factory) -> None:
    backend = make_backend(lora=SPEC, lr=1e-2, micro_batch_tokens=16, gradient_checkpointing=True)
    trainable = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.{ab}" for m in backend.adapted for ab in ("lora_A", "lora_B")}
    held = [p for group in backend.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in backend.model.parameters() if p.requires_grad}
    base_before, adapters_before = split_params(backend)

    losses = train(backend, 4)
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses
    base_after, adapters_after = split_params(backend)
    for name, p in base_before.items():
        assert torch.equal(base_after[name], p), name
    for name, p in adapters_before.items():
        assert not torch.equal(adapters_after[name], p), name


def test_the_tied_embedding_stays_put_when_lm_head_is_adapted(
    make_backend: Factory, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    head_only = LoraSpec(rank=4, train_attn=False, train_mlp=False, train_unembed=True)
    backend = make_backend(lora=head_only, lr=1e-2)
    assert backend.adapted == ["lm_head"]
    model = backend.model
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed  # still one (frozen) Parameter
    before = full(embed)
    tokens = random_samples(1)[0].tokens
    lp_before = learner_logprobs(model, tokens, 1.0)

    train(backend, 2)
    assert torch.equal(full(embed), before)
    assert full(model.get_output_embeddings().lora_B).abs().sum() > 0
    assert (learner_logprobs(model, tokens, 1.0) - lp_before).abs().max() > 1e-3  # teeth

    # A sampler whose model cannot be seen (a server) is warned that it must not tie them.
    remote = Collect()
    with caplog.at_level(logging.WARNING, logger="agentrl.weights.lora"):
        assert backend.publish(remote) == 1
    assert "tied input embedding" in caplog.text
    sampler = tiny_sampler(tiny_dir, untied=True)
    try:
        backend.publish(sampler)
    finally:
        asyncio.run(sampler.close())
    published = sampler.model.state_dict()
    assert published.keys() == remote.state.keys()
    assert torch.equal(published["model.embed_tokens.weight"], before)
    assert not torch.equal(published["lm_head.weight"], before)


class Collect:
    """A WeightSink that keeps what it is handed, as a server's transfer would."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.state: dict[str, torch.Tensor] = {}

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.state, self.policy_version = state_dict, version


def test_publish_hands_merged_weights_that_score_like_the_learner(
    make_backend: Factory, tiny_dir: Path
) -> None:
    backend = make_backend(lora=SPEC, lr=1e-2)
    train(backend, 3)
    tied, sampler = tiny_sampler(tiny_dir, untied=False), tiny_sampler(tiny_dir, untied=True)
    try:
        with pytest.raises(ConfigError, match="ties them") as err:
            backend.publish(tied)  # its input embedding would silently change
        assert "untie_output" in err.value.fix and tied.policy_version == 0
        assert backend.publish(sampler) == 1
        base = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        for s in random_samples(3, seed=5):
            mine = learner_logprobs(backend.model, s.tokens, 1.0)
            theirs = learner_logprobs(sampler.model, s.tokens, 1.0)
            assert (mine - theirs).abs().max() < 1e-5
            assert (mine - learner_logprobs(base, s.tokens, 1.0)).abs().max() > 1e-2  # teeth
        # Sampled by the published weights (KV cache, batching): scored alike by the learner.
        prompt = random_samples(1, seed=6)[0].tokens[:8]
        completion = generate(sampler, prompt, SamplingParams(max_tokens=16, seed=3))
        metrics = backend.forward_backward([sample_of(prompt, completion)], PPO)
        assert metrics["logprob_mismatch"] < 1e-5
    finally:
        for s in (tied, sampler):
            asyncio.run(s.close())


def test_merged_weights_without_an_adapted_head_fit_a_tied_model(tiny_dir: Path) -> None:
    spec = LoraSpec(rank=2, alpha=4.0, train_unembed=False, seed=3)
    adapted = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    lora.apply_lora(adapted, spec)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(std=0.05)
    plain = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    plain.load_state_dict(lora.merged_state_dict(adapted.state_dict(), spec), strict=True)
    assert lora.output_is_tied(plain)
    tokens = random_samples(1)[0].tokens
    diff = learner_logprobs(adapted, tokens, 1.0) - learner_logprobs(plain, tokens, 1.0)
    assert diff.abs().max() < 1e-5


def test_checkpoint_resume_matches_an_uninterrupted_run(
    make_backend: Factory, tmp_path: Path
) -> None:
    options = {"lr": 1e-2, "schedule": "linear", "total_steps": 10}
    a = make_backend(lora=SPEC, **options)
    train(a, 2)
    path = a.save_checkpoint(tmp_path, {"seen": 2})
    meta = json.loads((path / "meta.json").read_text())
    assert LoraSpec.model_validate(meta["lora"]) == SPEC  # enough to rebuild the config
    saved = torch.load(path / "model.pt", weights_only=True)
    assert set(saved) == {n for n, p in a.model.named_parameters() if p.requires_grad}
    draw_a = torch.rand(4)
    loss_a = train(a, 1)[0]

    # Another seed draws other adapters and RNG streams: the checkpoint must replace both.
    b = make_backend(lora=SPEC.model_copy(update={"seed": 9}), seed=9, **options)
    assert b.load_checkpoint(path) == {"seen": 2}
    assert b.step == 2 and torch.equal(torch.rand(4), draw_a)
    assert train(b, 1)[0] == loss_a
    assert b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    (base_a, adapters_a), (base_b, adapters_b) = split_params(a), split_params(b)
    for name, p in {**adapters_a, **base_a}.items():
        assert torch.equal({**adapters_b, **base_b}[name], p), name


def test_a_checkpoint_of_other_weights_is_refused_in_one_line(
    make_backend: Factory, tmp_path: Path
) -> None:
    adapted, plain = make_backend(lora=SPEC), make_backend()
    lora_ckpt = adapted.save_checkpoint(tmp_path / "lora", {})
    full_ckpt = plain.save_checkpoint(tmp_path / "full", {})
    with pytest.raises(ConfigError, match="holds LoRA rank 4, .* but this backend trains full"):
        plain.load_checkpoint(lora_ckpt)
    with pytest.raises(ConfigError, match="holds full weights, but .* LoRA rank 4") as err:
        adapted.load_checkpoint(full_ckpt)
    assert err.value.fix == "set backend lora: null"
    wider = make_backend(lora=SPEC.model_copy(update={"rank": 8}))
    with pytest.raises(ConfigError, match="rank 4, .*attn\\+mlp\\+unembed, .* LoRA rank 8") as err:
        wider.load_checkpoint(lora_ckpt)
    assert "\n" not in str(err.value) and '"rank": 4' in err.value.fix
    meta = json.loads((lora_ckpt / "meta.json").read_text())
    other_targets = SPEC.model_copy(update={"train_mlp": False})
    with pytest.raises(ConfigError, match="on attn\\+unembed"):
        lora.check_checkpoint(meta["lora"], other_targets, str(lora_ckpt))
    lora.check_checkpoint(meta["lora"], SPEC.model_copy(update={"seed": 1}), "")  # seed: free
    # The same spec on another model (here: adapters missing) is refused too, by name.
    adapters = torch.load(lora_ckpt / "model.pt", weights_only=True)
    del adapters["lm_head.lora_B"]
    torch.save(adapters, lora_ckpt / "model.pt")
    with pytest.raises(ConfigError, match="1 adapters do not fit .* lm_head.lora_B: saved none"):
        adapted.load_checkpoint(lora_ckpt)


def test_flags_select_the_adapted_modules(tiny_dir: Path) -> None:
    attn = {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in lora.ATTENTION}
    mlp = {f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in lora.MLP}
    for flags, expected in [
        ((True, True, True), attn | mlp | {"lm_head"}),
        ((True, False, False), attn),
        ((False, True, False), mlp),
        ((False, False, True), {"lm_head"}),
        ((True, False, True), attn | {"lm_head"}),
    ]:
        model = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        spec = LoraSpec(
            rank=2, **dict(zip(("train_attn", "train_mlp", "train_unembed"), flags, strict=True))
        )
        names = lora.apply_lora(model, spec)
        assert set(names) == expected and len(names) == len(expected), flags
        trainable = {n.rsplit(".", 1)[0] for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == expected, flags
        assert all(isinstance(model.get_submodule(n), lora.LoraLinear) for n in names)
    with pytest.raises(ConfigError, match="already has LoRA adapters"):
        lora.apply_lora(model, SPEC)
    with pytest.raises(ValidationError, match="adapts nothing"):
        LoraSpec(rank=2, train_attn=False, train_mlp=False, train_unembed=False)
    with pytest.raises(ValidationError, match="greater than 0"):
        LoraSpec(rank=0)
    with pytest.raises(ValidationError, match="extra"):
        FSDPConfig.model_validate({"lora": {"rank": 2, "dropout": 0.1}})


def test_the_reference_of_a_lora_backend_is_the_base_model(make_backend: Factory) -> None:
    backend = make_backend(lora=SPEC, reference_model=True, lr=1e-2)
    assert backend.reference is None  # no copy: the adapters are switched off instead
    loss = LossConfig(type="ppo", kl_coef=0.5)
    samples = random_samples(2)
    assert backend.forward_backward(samples, loss)["kl_mean"] == 0.0
    backend.optim_step()  # B moves (A, whose gradient was zero, does not): B A is not 0
    metrics = backend.forward_backward(samples, loss)
    assert metrics["kl_mean"] > 1e-6 and metrics["kl_loss"] > 0


def _rank_main(rank: int, store: str, model_dir: str, out: str) -> None:
    """One of two CPU ranks (gloo on loopback): LoRA forward_backward, step, checkpoint."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # NCCL cannot put two ranks on one GPU
    init_loopback_group(Path(store), rank, 2)
    backend = FSDPBackend(FSDPConfig(micro_batch_tokens=64, lr=1e-2, lora=SPEC), model_dir)
    results = []
    for _ in range(2):  # the second step moves A too
        metrics = backend.forward_backward(random_samples(5), PPO)  # 3 vs 2 samples per rank
        results.append((metrics, backend.optim_step()))
    _, adapters = split_params(backend)
    backend.save_checkpoint(Path(out) / "ckpt", {"ranks": 2})
    if rank == 0:
        torch.save({"results": results, "adapters": adapters}, Path(out) / "rank0.pt")
    backend.close()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_train_the_adapters_as_one_does(
    make_backend: Factory, tiny_dir: Path, tmp_path: Path
) -> None:
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(tiny_dir), str(tmp_path)), nprocs=2)
    two = torch.load(tmp_path / "rank0.pt", weights_only=True)

    one = make_backend(micro_batch_tokens=64, lr=1e-2, lora=SPEC)
    for metrics, step in two["results"]:
        assert one.forward_backward(random_samples(5), PPO)["loss"] == pytest.approx(
            metrics["loss"], rel=1e-5
        )
        assert one.optim_step()["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-4)
    _, adapters = split_params(one)
    for name, p in adapters.items():
        torch.testing.assert_close(two["adapters"][name], p, rtol=1e-4, atol=1e-6, msg=name)

    resumed = make_backend(micro_batch_tokens=64, lr=1e-2, lora=SPEC)  # in a world of one
    assert resumed.load_checkpoint(tmp_path / "ckpt" / "step-000002") == {"ranks": 2}
    for name, p in split_params(resumed)[1].items():
        assert torch.equal(p, two["adapters"][name]), name


@pytest.mark.model
@pytest.mark.slow  # 10-20 s on two shared cores
def test_lora_on_smollm2_samples_and_scores_alike_after_publish(make_backend: Factory) -> None:
    """The embedded SmolLM2 (tied): a fresh adapter scores the sampler's tokens as the
    base does; after a step and publish, the untied sampler samples from the learner."""
    backend = make_backend(model_path=None, lora=LoraSpec(rank=8), lr=1e-3)
    sampler = LocalSampler.embedded()
    lora.untie_output(sampler.model)
    prompt = chat_prompt("Write a haiku about autumn leaves.")
    try:
        first = generate(sampler, prompt, SamplingParams(max_tokens=24, seed=1))
        assert backend.forward_backward([sample_of(prompt, first)], PPO)["logprob_mismatch"] < 1e-3
        backend.optim_step()
        backend.forward_backward([sample_of(prompt, first, advantage=-1.0)], PPO)
        backend.optim_step()
        assert backend.publish(sampler) == 1
        after = generate(sampler, prompt, SamplingParams(max_tokens=24, seed=2))
    finally:
        asyncio.run(sampler.close())
    tokens = prompt + after.token_ids
    mine = learner_logprobs(backend.model, tokens, 1.0)[len(prompt) :]
    theirs = learner_logprobs(sampler.model, tokens, 1.0)[len(prompt) :]
    print(f"learner vs published weights: max |diff| {(mine - theirs).abs().max():.2e}")
    assert (mine - theirs).abs().max() < 1e-4
    base = learner_logprobs(load_model(), tokens, 1.0)[len(prompt) :]
    assert (theirs - base).abs().max() > 1e-3  # the adapters moved the published weights
    assert backend.forward_backward([sample_of(prompt, after)], PPO)["logprob_mismatch"] < 1e-3
