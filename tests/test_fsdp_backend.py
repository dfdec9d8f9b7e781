"""The FSDP2 trainer backend on CPU: logprob fidelity, masking, micro-batches, ranks,
optimizer and schedule, atomic checkpoints, weight publishing, config rejection.

The logprob-match and publish tests (marked `model`) use the real embedded SmolLM2
model and the real LocalSampler. The rest use a tiny randomly initialised Llama (2
layers, hidden 64, SmolLM2's vocabulary, tied embeddings like SmolLM2) so that 2-rank
runs and crash tests stay fast on two CPU cores; the code paths are the same.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from pydantic import ValidationError
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from agentrl.algorithms import LossConfig
from agentrl.backends import latest_checkpoint, samples_from
from agentrl.backends.base import Sample
from agentrl.backends.fsdp import FSDPBackend, FSDPConfig, token_logprobs
from agentrl.backends.process_group import init_loopback_group
from agentrl.errors import ConfigError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import load_model, load_tokenizer
from agentrl.inference.local import LocalSampler
from agentrl.trajectory import StopReason, Trajectory
from agentrl.weights.checkpoint import PAUSE_ENV

PPO = LossConfig(type="ppo")
SMOLLM2_VOCAB = 49152  # the tiny model shares it, without needing the embedded model
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


def random_samples(n: int, seed: int = 0, vocab: int = SMOLLM2_VOCAB) -> list[Sample]:
    """Prompt, sampled span, observation (mask 0), sampled span: lengths differ per sample."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        spans = [(0, 5 + i), (1, 4 + 2 * i), (0, 3), (1, 6 - i % 3)]
        mask = [m for m, length in spans for _ in range(length)]
        logprobs = [-float(torch.rand(1, generator=g)) * 3 - 0.1 if m else 0.0 for m in mask]
        tokens = torch.randint(0, vocab, (len(mask),), generator=g).tolist()
        advantage = (-1.0) ** i * (0.5 + i / 4)
        samples.append(
            Sample(
                trajectory_id=f"s{i}",
                tokens=tokens,
                loss_mask=mask,
                sampler_logprobs=logprobs,
                advantage=advantage,
            )
        )
    return samples


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU, gathered from the ranks' shards if it is sharded."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def full_grads(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in backend.model.named_parameters() if p.grad is not None}


def full_params(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in backend.model.named_parameters()}


def learner_logprobs(model: torch.nn.Module, tokens: list[int], temperature: float) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids), temperature)[0].cpu()


def generate(sampler: LocalSampler, prompt: list[int], params: SamplingParams) -> Completion:
    async def go() -> Completion:
        return await sampler.generate(prompt, params)

    return asyncio.run(go())


def chat_prompt(text: str) -> list[int]:
    ids: list[int] = load_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    return ids


def sample_of(prompt: list[int], completion: Completion, advantage: float = 1.0) -> Sample:
    """Through a real Trajectory and samples_from, as the trainer will do it."""
    n = len(completion.token_ids)
    trajectory = Trajectory(
        trajectory_id="t0",
        group_id="g",
        task="chat",
        prompt_ids=prompt,
        response_ids=completion.token_ids,
        loss_mask=[1] * n,
        logprobs=completion.logprobs,
        token_versions=[completion.policy_version] * n,
        reward=1.0,
        stop_reason=StopReason.finished,
    )
    return samples_from([trajectory], {"t0": advantage})[0]


@pytest.mark.model
def test_step0_learner_logprobs_match_the_sampler(make_backend: Factory) -> None:
    sampler = LocalSampler.embedded()
    prompt = chat_prompt("Name three colours of the rainbow and say why the sky is blue.")
    try:
        params = SamplingParams(max_tokens=32, temperature=1.0, top_p=1.0, seed=7)
        completion = generate(sampler, prompt, params)
        cooler = generate(sampler, prompt, SamplingParams(max_tokens=32, temperature=0.7, seed=8))
    finally:
        asyncio.run(sampler.close())
    sample = sample_of(prompt, completion)
    assert sample.tokens == prompt + completion.token_ids

    backend = make_backend(model_path=None)  # the embedded SmolLM2
    metrics = backend.forward_backward([sample], LossConfig(type="cross_entropy"))
    print(f"logprob_mismatch at step 0: {metrics['logprob_mismatch']:.2e}")
    assert metrics["logprob_mismatch"] < 1e-3
    assert metrics["tokens"] == len(completion.token_ids)

    # Directly, token by token, and at another temperature than the learner's default.
    for c, temperature in ((completion, 1.0), (cooler, 0.7)):
        lp = learner_logprobs(backend.model, prompt + c.token_ids, temperature)[len(prompt) :]
        diff = (lp - torch.tensor(c.logprobs)).abs()
        assert diff.mean() < 1e-3 and diff.max() < 1e-2, (temperature, diff.max())
        # The wrong temperature is visibly wrong: the comparison has teeth.
        wrong = learner_logprobs(backend.model, prompt + c.token_ids, temperature + 1.0)
        assert (wrong[len(prompt) :] - torch.tensor(c.logprobs)).abs().mean() > 1e-2


def test_loss_is_applied_only_where_the_mask_is_one(make_backend: Factory, tiny_dir: Path) -> None:
    """The gradient equals that of an independent masked cross-entropy (so positions are
    aligned), and is unchanged when trailing mask-0 tokens change."""
    (sample,) = random_samples(1, seed=3)
    tail = sample.model_copy(
        update={
            "tokens": sample.tokens + [11, 12, 13],
            "loss_mask": sample.loss_mask + [0] * 3,
            "sampler_logprobs": sample.sampler_logprobs + [0.0] * 3,
        }
    )
    ce = LossConfig(type="cross_entropy")
    grads = []
    for s in (sample, tail):
        backend = make_backend()
        backend.forward_backward([s], ce)
        grads.append(full_grads(backend))

    reference = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    ids = torch.tensor(sample.tokens)
    logits = reference(input_ids=ids[None]).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
    mask = torch.tensor(sample.loss_mask[1:], dtype=torch.float32)
    ((nll * mask).sum() / mask.sum()).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for name, g in grads[0].items():
        # The backend projects only the positions that predict masked tokens onto the
        # vocabulary; the reference projects all: the same sums in another order (the tied
        # embedding's gradient differs by ~1e-6 on entries up to ~0.5).
        torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-8, msg=name)


def test_micro_batches_sum_to_the_full_batch(make_backend: Factory) -> None:
    """One sample per micro-batch (and recomputed activations) vs all in one."""
    samples = random_samples(5)
    loss = LossConfig(type="ppo", aggregation="seq-mean-token-mean")
    runs = []
    for budget, recompute in ((1, True), (10**6, False)):
        backend = make_backend(micro_batch_tokens=budget, gradient_checkpointing=recompute)
        runs.append((backend.forward_backward(samples, loss), full_grads(backend)))
    (small, small_grads), (big, big_grads) = runs
    assert (small["micro_batches"], big["micro_batches"]) == (5, 1)
    assert small["loss"] == pytest.approx(big["loss"], rel=1e-5)
    assert small["logprob_mismatch"] == pytest.approx(big["logprob_mismatch"], rel=1e-5)
    for name, g in big_grads.items():
        torch.testing.assert_close(small_grads[name], g, rtol=1e-4, atol=1e-8, msg=name)


def _rank_main(rank: int, store: str, model_dir: str, out: str) -> None:
    """One of two CPU ranks (gloo on loopback): forward_backward, step, checkpoint."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # NCCL cannot put two ranks on one GPU
    init_loopback_group(Path(store), rank, 2)
    backend = FSDPBackend(FSDPConfig(micro_batch_tokens=64, lr=1e-3), model_dir)
    metrics = backend.forward_backward(random_samples(5), PPO)  # 3 vs 2 samples per rank
    grads = full_grads(backend)
    step = backend.optim_step()
    params = full_params(backend)
    backend.save_checkpoint(Path(out) / "ckpt", {"ranks": 2})
    if rank == 0:
        torch.save(
            {"metrics": metrics, "grads": grads, "step": step, "params": params},
            Path(out) / "rank0.pt",
        )
    backend.close()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_sum_to_the_one_rank_gradient(
    make_backend: Factory, tiny_dir: Path, tmp_path: Path
) -> None:
    mp.spawn(_rank_main, args=(str(tmp_path / "store"), str(tiny_dir), str(tmp_path)), nprocs=2)
    two = torch.load(tmp_path / "rank0.pt", weights_only=True)

    one = make_backend(micro_batch_tokens=64, lr=1e-3)
    metrics = one.forward_backward(random_samples(5), PPO)
    grads = full_grads(one)
    step = one.optim_step()
    assert two["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert two["metrics"]["tokens"] == metrics["tokens"]
    assert two["metrics"]["logprob_mismatch"] == pytest.approx(metrics["logprob_mismatch"])
    assert two["step"]["grad_norm"] == pytest.approx(step["grad_norm"], rel=1e-4)
    for name, g in grads.items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)
    params = full_params(one)
    for name, p in params.items():
        torch.testing.assert_close(two["params"][name], p, rtol=1e-4, atol=1e-6, msg=name)

    # A 2-rank checkpoint resumes in a 1-rank world (full state dicts).
    resumed = make_backend(micro_batch_tokens=64, lr=1e-3)
    assert resumed.load_checkpoint(tmp_path / "ckpt" / "step-000001") == {"ranks": 2}
    for name, p in full_params(resumed).items():
        assert torch.equal(p, two["params"][name]), name


def test_optimizer_step_and_lr_schedule(make_backend: Factory) -> None:
    backend = make_backend(lr=1e-3, schedule="cosine", warmup_steps=2, total_steps=6)
    samples = random_samples(2)
    before = full_params(backend)
    lrs = []
    for _ in range(6):
        backend.forward_backward(samples, PPO)
        lrs.append(backend.optim_step()["lr"])
    after = full_params(backend)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert backend.step == 6
    cos = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx([1e-3 * f for f in [0.5, 1.0, *cos]])

    linear = FSDPConfig(schedule="linear", warmup_steps=1, total_steps=5)
    assert [linear.lr_factor(s) for s in range(6)] == pytest.approx([1, 1, 0.75, 0.5, 0.25, 0])
    assert [FSDPConfig().lr_factor(s) for s in (0, 100)] == [1.0, 1.0]


def test_checkpoint_resume_is_bit_identical(make_backend: Factory, tmp_path: Path) -> None:
    samples = random_samples(3)
    a = make_backend(lr=1e-3, schedule="linear", total_steps=10)
    for _ in range(2):
        a.forward_backward(samples, PPO)
        a.optim_step()
    path = a.save_checkpoint(tmp_path, {"seen": ["q1", "q2"]})
    assert path == tmp_path / "step-000002" == latest_checkpoint(tmp_path)
    draw_a = torch.rand(4)
    loss_a = a.forward_backward(samples, PPO)["loss"]
    lr_a = a.optim_step()["lr"]

    b = make_backend(lr=1e-3, schedule="linear", total_steps=10)
    assert b.load_checkpoint(path) == {"seen": ["q1", "q2"]}
    assert b.step == 2
    assert torch.equal(torch.rand(4), draw_a)  # RNG restored
    assert b.forward_backward(samples, PPO)["loss"] == loss_a
    assert b.optim_step()["lr"] == lr_a
    params_a = full_params(a)
    for name, p in full_params(b).items():
        assert torch.equal(p, params_a[name]), name


_CHILD = """
import os, sys
from pathlib import Path
from agentrl.algorithms import LossConfig
from agentrl.backends.fsdp import FSDPBackend, FSDPConfig
sys.path.insert(0, {tests!r})
from test_fsdp_backend import random_samples
root = Path({root!r})
backend = FSDPBackend(FSDPConfig(lr=1e-3), {model!r})
for step in (1, 2):
    backend.forward_backward(random_samples(2), LossConfig())
    backend.optim_step()
    if step == 2:
        os.environ[{pause!r}] = "120"  # sleep after each file: the parent kills us there
    backend.save_checkpoint(root, {{"step": step}})
"""


@pytest.mark.slow
def test_kill_during_checkpoint_write_keeps_the_previous_one(
    make_backend: Factory, tiny_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    code = _CHILD.format(
        tests=str(Path(__file__).parent), root=str(root), model=str(tiny_dir), pause=PAUSE_ENV
    )
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, PAUSE_ENV: ""})
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob("step-000002.tmp-*/model.pt")):
            assert child.poll() is None, "the child died before its second checkpoint"
            assert time.monotonic() < deadline, "the second checkpoint never started"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # mid-write: model.pt done, the rest not
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    torn = list(root.glob("*.tmp-*"))
    assert len(torn) == 1 and not (root / "step-000002").exists()
    assert latest_checkpoint(root) == root / "step-000001"

    backend = make_backend(lr=1e-3)
    assert backend.load_checkpoint(root / "step-000001") == {"step": 1}
    assert backend.step == 1
    assert backend.save_checkpoint(root, {"step": 1}) == root / "step-000001"  # same step again
    assert sorted(p.name for p in root.iterdir()) == ["step-000001"]  # torn dir cleaned


@pytest.mark.model
@pytest.mark.slow
def test_publish_hands_the_learners_weights_to_the_sampler(make_backend: Factory) -> None:
    """After a step, publish swaps weights between batches: the batch running meanwhile
    keeps the old weights and version, the next one is sampled by the learner's weights."""
    sampler = LocalSampler.embedded()
    sampler.set_policy_version(3)
    backend = make_backend(model_path=None, lr=1e-4)
    prompt = chat_prompt("Write a haiku about autumn leaves.")
    first = generate(sampler, prompt, SamplingParams(max_tokens=16, seed=1))
    backend.forward_backward([sample_of(prompt, first)], PPO)
    backend.optim_step()

    async def go() -> tuple[Completion, int, Completion]:
        running = asyncio.create_task(sampler.generate(prompt, SamplingParams(max_tokens=48)))
        while sampler.stats.batches < 2:
            await asyncio.sleep(0.005)
        assert not running.done(), "the batch ended before publish: nothing was tested"
        version = await asyncio.to_thread(backend.publish, sampler)
        after = await sampler.generate(prompt, SamplingParams(max_tokens=24, seed=2))
        return await running, version, after

    try:
        during, version, after = asyncio.run(go())
    finally:
        asyncio.run(sampler.close())
    assert version == 4 == sampler.policy_version
    assert (during.policy_version, after.policy_version) == (3, 4)

    learner = full_params(backend)
    sampler_state = sampler.model.state_dict()
    assert all(torch.equal(sampler_state[n], p) for n, p in learner.items())
    # The batch that ran during publish was decoded entirely by the old weights.
    tokens = prompt + during.token_ids
    old_lp = learner_logprobs(load_model(), tokens, 1.0)[len(prompt) :]
    new_lp = learner_logprobs(backend.model, tokens, 1.0)[len(prompt) :]
    assert (old_lp - torch.tensor(during.logprobs)).abs().max() < 1e-3
    assert (new_lp - old_lp).abs().max() > 1e-3  # the update is visible: the check has teeth
    # The next batch samples from exactly the learner's weights.
    assert backend.forward_backward([sample_of(prompt, after)], PPO)["logprob_mismatch"] < 1e-3


def test_config_and_input_rejections(make_backend: Factory, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="bfloat16 needs CUDA"):
            FSDPConfig(dtype="bfloat16").check()
        with pytest.raises(ConfigError, match="bfloat16"):  # before any model is loaded
            FSDPBackend(FSDPConfig(dtype="bfloat16"), tmp_path / "no-such-model")
    with pytest.raises(ValidationError, match="total_steps"):
        FSDPConfig(schedule="cosine")
    with pytest.raises(ValidationError, match="extra"):
        FSDPConfig(learning_rate=1e-3)
    kl = LossConfig(type="ppo", kl_coef=0.1)
    with pytest.raises(ConfigError, match="reference_model") as err:
        FSDPConfig().validate_loss(kl)
    assert "reference_model: true" in err.value.fix
    FSDPConfig(reference_model=True).validate_loss(kl)

    backend = make_backend()
    with pytest.raises(ConfigError, match="reference model"):
        backend.forward_backward(random_samples(1), kl)
    empty = random_samples(1)[0].model_copy(
        update={"loss_mask": [0] * 18, "sampler_logprobs": [0.0] * 18}
    )
    with pytest.raises(ConfigError, match="no sampled token"):
        backend.forward_backward([empty], PPO)
    (ok,) = random_samples(1)
    huge = ok.model_copy(update={"tokens": [SMOLLM2_VOCAB] + ok.tokens[1:]})
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        backend.forward_backward([huge], PPO)
    long = ok.model_copy(
        update={k: getattr(ok, k) * 40 for k in ("tokens", "loss_mask", "sampler_logprobs")}
    )
    with pytest.raises(ConfigError, match="more than the model's context"):
        backend.forward_backward([long], PPO)
    with pytest.raises(ValidationError, match="nothing predicts the first token"):
        Sample(
            trajectory_id="x",
            tokens=[1, 2],
            loss_mask=[1, 1],
            sampler_logprobs=[-1.0, -1.0],
            advantage=0.0,
        )
    with pytest.raises(ConfigError, match="JSON"):
        backend.save_checkpoint(tmp_path, {"bad": object()})
    assert latest_checkpoint(tmp_path) is None and not list(tmp_path.glob("*.tmp-*"))


def test_reference_model_gives_kl(make_backend: Factory) -> None:
    """With a frozen reference, KL is 0 before any step and positive after one."""
    backend = make_backend(reference_model=True, lr=1e-2)
    loss = LossConfig(type="ppo", kl_coef=0.5)
    samples = random_samples(2)
    assert backend.forward_backward(samples, loss)["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    backend.optim_step()
    metrics = backend.forward_backward(samples, loss)
    assert metrics["kl_mean"] > 1e-6 and metrics["kl_loss"] > 0


def test_samples_from_skips_infrastructure_failures() -> None:
    ok = Trajectory(
        trajectory_id="q_0",
        group_id="q",
        task="t",
        prompt_ids=[5, 6],
        response_ids=[7, 8, 9],
        loss_mask=[1, 0, 1],
        logprobs=[-0.5, 0.0, -1.5],
        token_versions=[2, -1, 2],
        reward=1.0,
        stop_reason=StopReason.finished,
    )
    failed = Trajectory(
        trajectory_id="q_1",
        group_id="q",
        task="t",
        prompt_ids=[5, 6],
        stop_reason=StopReason.sandbox_error,
    )
    (sample,) = samples_from([ok, failed], {"q_0": 0.5, "q_1": 0.0})
    assert sample.tokens == [5, 6, 7, 8, 9]
    assert sample.loss_mask == [0, 0, 1, 0, 1]
    assert sample.sampler_logprobs == [0.0, 0.0, -0.5, 0.0, -1.5]
    assert sample.advantage == 0.5
