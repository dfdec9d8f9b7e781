"""The Tinker backend: samples as Tinker datums, the options Tinker cannot honour, and
training through the real `tinker` SDK against `agentrl serve-tinker` on 127.0.0.1.

No hosted Tinker account is used (none is reachable here): the service is agentrl's own
Tinker-compatible server, started on loopback with a tiny model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.algorithms import LossConfig
from agentrl.backends.base import Sample
from agentrl.backends.tinker import (
    TinkerBackend,
    TinkerConfig,
    loss_call,
    to_datums,
    token_scales,
)
from agentrl.errors import ConfigError, SamplerError
from agentrl.train_config import load_train_config
from agentrl.yamlfile import ConfigFileError

DATA = Path(__file__).parent / "data" / "train"


def _samples() -> list[Sample]:
    return [
        Sample(  # prompt of 3, a reply of 2 sampled tokens, an observation, 1 more sampled
            trajectory_id="a",
            tokens=[5, 6, 7, 8, 9, 10, 11],
            loss_mask=[0, 0, 0, 1, 1, 0, 1],
            sampler_logprobs=[0.0, 0.0, 0.0, -0.5, -1.0, 0.0, -2.0],
            advantage=1.5,
        ),
        Sample(
            trajectory_id="b",
            tokens=[5, 6, 12],
            loss_mask=[0, 0, 1],
            sampler_logprobs=[0.0, 0.0, -0.25],
            advantage=-0.5,
        ),
    ]


def test_a_sample_becomes_a_datum_token_for_token_with_observations_zeroed() -> None:
    samples = _samples()
    (a, b) = to_datums(samples, LossConfig(type="ppo", dual_clip=None))
    assert a.model_input.to_ints() == [5, 6, 7, 8, 9, 10]  # tokens[:-1]
    inputs = {k: v.tolist() for k, v in a.loss_fn_inputs.items()}
    assert inputs["target_tokens"] == [6, 7, 8, 9, 10, 11]  # tokens[1:]
    assert inputs["logprobs"] == [0.0, 0.0, -0.5, -1.0, 0.0, -2.0]
    # token-mean over the batch's 4 sampled tokens: each sampled token carries A / 4
    assert inputs["advantages"] == pytest.approx([0, 0, 1.5 / 4, 1.5 / 4, 0, 1.5 / 4])
    assert b.loss_fn_inputs["advantages"].tolist() == pytest.approx([0, -0.5 / 4])
    assert set(inputs) == {"target_tokens", "logprobs", "advantages"}


def test_turn_level_advantages_reach_each_token_of_the_datum() -> None:
    """Branch credit gives a sample's turns their own advantages: each sampled token's
    datum advantage is its own, scaled as the aggregation says."""
    (s,) = _samples()[:1]
    s = s.model_copy(update={"token_advantages": [0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 2.0]})
    (d,) = to_datums([Sample.model_validate(s.model_dump())], LossConfig(type="ppo"))
    assert d.loss_fn_inputs["advantages"].tolist() == pytest.approx(
        [0, 0, 0.5 / 3, 0.5 / 3, 0, 2.0 / 3]  # token-mean over its 3 sampled tokens
    )


def test_cross_entropy_carries_the_aggregation_in_its_weights() -> None:
    (a, b) = to_datums(_samples(), LossConfig(type="cross_entropy"))
    assert set(a.loss_fn_inputs) == {"target_tokens", "weights"}
    assert a.loss_fn_inputs["weights"].tolist() == pytest.approx([0, 0, 0.25, 0.25, 0, 0.25])
    assert b.loss_fn_inputs["weights"].tolist() == pytest.approx([0, 0.25])


def test_each_aggregation_folds_into_per_token_scales() -> None:
    samples = _samples()  # 3 + 1 sampled tokens, 2 sequences
    assert token_scales(samples, LossConfig(aggregation="token-mean")) == [0.25, 0.25]
    assert token_scales(samples, LossConfig(aggregation="seq-mean-token-sum")) == [0.5, 0.5]
    scales = token_scales(samples, LossConfig(aggregation="seq-mean-token-mean"))
    assert scales == pytest.approx([1 / (3 * 2), 1 / (1 * 2)])


def test_the_folded_loss_equals_the_native_aggregated_loss() -> None:
    """Tinker's sum over tokens of its ppo loss, on the folded advantages, is the native
    policy_loss (computed here by agentrl.algorithms) on the same logprobs."""
    from agentrl.algorithms import policy_loss

    samples = _samples()
    torch.manual_seed(0)
    for aggregation in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        for kind in ("ppo", "tis", "importance_sampling", "cross_entropy"):
            options = {"dual_clip": None} if kind == "ppo" else {}
            loss = LossConfig(type=kind, aggregation=aggregation, **options)
            name, cfg = loss_call(loss)
            total = 0.0
            native = 0.0
            for s, d in zip(samples, to_datums(samples, loss), strict=True):
                n = len(s.tokens)
                lp_T = -torch.rand(n - 1) * 2  # learner logprobs of the targets
                q_T = torch.tensor(s.sampler_logprobs[1:])
                inputs = {k: torch.tensor(v.tolist()) for k, v in d.loss_fn_inputs.items()}
                ratio_T = torch.exp(lp_T - q_T)
                if name == "cross_entropy":
                    total += float(-(inputs["weights"] * lp_T).sum())
                elif name == "importance_sampling":
                    total += float(-(ratio_T * inputs["advantages"]).sum())
                elif name == "ppo":
                    a_T = inputs["advantages"]
                    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
                    total += float(-torch.minimum(ratio_T * a_T, ratio_T.clamp(lo, hi) * a_T).sum())
                else:  # cispo
                    w_T = ratio_T.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
                    total += float(-(w_T * lp_T * inputs["advantages"]).sum())
                mask_1_T = torch.tensor([s.loss_mask])
                lp_1_T = torch.cat([torch.zeros(1), lp_T])[None]
                value, _ = policy_loss(
                    lp_1_T,
                    torch.tensor([s.sampler_logprobs]),
                    torch.tensor([s.advantage]),
                    mask_1_T,
                    loss,
                    total_tokens=4.0,
                    total_seqs=2.0,
                )
                native += float(value)
            assert total == pytest.approx(native, abs=1e-6), (kind, aggregation)


def test_losses_map_to_tinker_names_and_thresholds() -> None:
    assert loss_call(LossConfig(type="ppo", clip_low=0.2, clip_high=0.28, dual_clip=None)) == (
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28},
    )
    assert loss_call(LossConfig(type="tis", tis_cap=2.0)) == (
        "cispo",
        {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0},
    )
    assert loss_call(LossConfig(type="importance_sampling")) == ("importance_sampling", {})
    assert loss_call(LossConfig(type="cross_entropy")) == ("cross_entropy", {})


def _config(tmp_path: Path, backend: str, loss: str = "{type: ppo, dual_clip: null}") -> Path:
    (tmp_path / "task.yaml").write_text((DATA / "task.yaml").read_text())
    text = (DATA / "train.yaml").read_text().replace("backend: {type: fsdp, lr: 1.0e-5}", "")
    text += f"backend: {backend}\nalgorithm:\n  loss: {loss}\n"
    (tmp_path / "train.yaml").write_text(text)
    return tmp_path / "train.yaml"


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        ("{type: ppo}", "loss dual_clip 3.0: Tinker's ppo loss has no dual clip"),
        ("{type: ppo, dual_clip: null, kl_coef: 0.1}", "Tinker's losses have no KL term"),
    ],
)
def test_options_tinker_cannot_honour_fail_when_the_config_loads(
    tmp_path: Path, loss: str, message: str
) -> None:
    path = _config(tmp_path, "{type: tinker, base_url: 'http://127.0.0.1:9'}", loss)
    with pytest.raises(ConfigFileError, match=message):
        load_train_config(path)
    # the same loss on the native backend (with a reference model for KL) loads
    native = "{type: fsdp, reference_model: true}"
    assert load_train_config(_config(tmp_path, native, loss)).backend.type == "fsdp"


def test_the_cli_rejects_them_in_one_line(tmp_path: Path) -> None:
    path = _config(tmp_path, "{type: tinker, base_url: 'http://127.0.0.1:9'}", "{type: ppo}")
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "Tinker's ppo loss has no dual clip (set algorithm.loss.dual_clip: null" in proc.stderr


def test_servers_and_temperatures_other_than_1_are_refused(tmp_path: Path) -> None:
    path = _config(tmp_path, "{type: tinker}")
    text = path.read_text() + "servers: {urls: ['http://127.0.0.1:9']}\n"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match="the tinker backend samples on the Tinker"):
        load_train_config(path)
    with pytest.raises(
        ConfigError, match="at temperature 1, but the tasks sample at temperature 0.7"
    ):
        TinkerConfig(temperature=0.7).check()
    TinkerConfig(temperature=1.0).check()


def test_the_api_key_comes_from_the_environment_or_is_a_placeholder_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    assert TinkerConfig(base_url="http://127.0.0.1:8000").api_key() == "tml-agentrl-local"
    assert TinkerConfig(base_url="http://localhost:8000").api_key() == "tml-agentrl-local"
    with pytest.raises(ConfigError, match="needs an API key for the hosted Tinker service"):
        TinkerConfig().api_key()
    with pytest.raises(ConfigError, match="needs an API key for https://tinker.example"):
        TinkerConfig(base_url="https://tinker.example").api_key()
    monkeypatch.setenv("TINKER_API_KEY", "tml-abc")
    assert TinkerConfig().api_key() == "tml-abc"


# -- through the real SDK against agentrl serve-tinker (conftest's tinker_server) ---------

TASK = Path(__file__).parent / "data" / "tinker" / "task.yaml"


def _tinker(server_url: str, **options: Any) -> TinkerBackend:
    return TinkerConfig(
        base_url=server_url, base_model="tiny", lora_rank=0, lr=1e-3, **options
    ).build()


def _batch(model_dir: Path) -> list[Sample]:
    """Three samples of real tiny-model logprobs, the sampler's a little off (so ratios
    differ from 1 and clipping engages), one of them with an observation in the middle."""
    from transformers import AutoModelForCausalLM

    from agentrl.backends.fsdp import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (n, masks, advantage) in enumerate(
        [
            (12, [0] * 5 + [1] * 7, 1.0),
            (9, [0] * 3 + [1] * 2 + [0] * 2 + [1] * 2, -0.7),
            (6, [0, 0, 0, 1, 1, 1], 0.4),
        ]
    ):
        ids = torch.randint(0, 49152, (1, n), generator=g)
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0]
        noise = (torch.rand(n, generator=g) - 0.5) * 0.6
        out.append(
            Sample(
                trajectory_id=f"s{i}",
                tokens=ids[0].tolist(),
                loss_mask=masks,
                sampler_logprobs=[
                    float(x + e) if m else 0.0 for x, e, m in zip(lp, noise, masks, strict=True)
                ],
                advantage=advantage,
            )
        )
    return out


def _learner_logprobs(backend: Any, samples: list[Sample]) -> list[float]:
    """The samples' target logprobs under the backend's current weights, concatenated."""
    if isinstance(backend, TinkerBackend):
        datums = to_datums(samples, LossConfig(type="cross_entropy"))
        out = backend.client.forward(datums, "cross_entropy").result(timeout=120)
        return [float(x) for o in out.loss_fn_outputs for x in o["logprobs"].tolist()]
    from agentrl.backends.fsdp import token_logprobs

    result: list[float] = []
    for s in samples:
        ids = torch.tensor([s.tokens])
        with torch.no_grad():
            lp = token_logprobs(backend.model, ids, torch.ones_like(ids), 1.0)[0, 1:]
        result += [float(x) for x in lp]
    return result


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(type="ppo", dual_clip=None, aggregation="token-mean"),
        LossConfig(type="tis", tis_cap=1.1, aggregation="seq-mean-token-mean"),
        LossConfig(type="importance_sampling", aggregation="seq-mean-token-sum"),
        LossConfig(type="cross_entropy"),
    ],
    ids=lambda loss: loss.type,
)
def test_one_step_through_tinker_equals_one_native_step(
    tinker_server: Any, tiny_dir: Path, loss: LossConfig
) -> None:
    from agentrl.backends.fsdp import FSDPConfig

    samples = _batch(tiny_dir)
    native = FSDPConfig(lr=1e-3, max_grad_norm=0.5, temperature=1.0).build(tiny_dir)
    remote = _tinker(tinker_server.url, max_grad_norm=0.5)
    try:
        before = _learner_logprobs(native, samples)
        assert _learner_logprobs(remote, samples) == pytest.approx(before, abs=1e-5)
        got, want = remote.train_step(samples, loss), native.train_step(samples, loss)
        for key in ("loss", "logprob_mismatch", "ratio_mean", "grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        assert got["tokens"] == want["tokens"] == 14
        if loss.type == "ppo":
            assert got["clip_high_frac"] == pytest.approx(want["clip_high_frac"])
        assert remote.step == native.step == 1
        after_remote, after_native = (_learner_logprobs(b, samples) for b in (remote, native))
        moved = max(abs(a - b) for a, b in zip(after_native, before, strict=True))
        assert moved > 1e-3  # the step changed the weights...
        assert after_remote == pytest.approx(after_native, abs=2e-4)  # ...both the same way
    finally:
        remote.close()
        native.close()


def test_a_checkpoint_round_trip_resumes_exactly(
    tinker_server: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    """save_state + meta.json, then a new backend from it: the next step (with a warm-up
    schedule, so the learning rate depends on the step) is the uninterrupted run's."""
    samples = _batch(tiny_dir)
    loss = LossConfig(type="ppo", dual_clip=None)
    options = {"warmup_steps": 3, "schedule": "linear", "total_steps": 6}
    first = _tinker(tinker_server.url, **options)
    try:
        first.train_step(samples, loss)
        path = first.save_checkpoint(tmp_path, {"note": "after one step"}, step=1)
        assert path == tmp_path / "step-000001" and (path / "meta.json").is_file()
        want = first.train_step(samples, loss)
        want_lp = _learner_logprobs(first, samples)
    finally:
        first.close()
    resumed = _tinker(tinker_server.url, **options)
    try:
        assert resumed.load_checkpoint(path) == {"note": "after one step"}
        assert resumed.step == 1
        got = resumed.train_step(samples, loss)
        assert got["lr"] == want["lr"] == pytest.approx(1e-3 * 2 / 3)
        for key in ("loss", "grad_norm", "logprob_mismatch"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
        assert _learner_logprobs(resumed, samples) == pytest.approx(want_lp, abs=1e-6)
    finally:
        resumed.close()
    other = TinkerConfig(base_url=tinker_server.url, base_model="tiny", lora_rank=4).build()
    try:  # a checkpoint of full weights does not resume a LoRA run
        with pytest.raises(ConfigError, match="saved with lora_rank 0, the config says 4"):
            other.load_checkpoint(path)
    finally:
        other.close()


def test_each_publication_gives_the_sampler_the_next_version(tinker_server: Any) -> None:
    import asyncio

    from agentrl.inference.base import SamplingParams
    from agentrl.inference.local import LocalSampler

    backend = _tinker(tinker_server.url)
    sampler = backend.sampler()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    try:
        assert sampler.policy_version == 0
        with pytest.raises(SamplerError, match="nothing published yet"):
            asyncio.run(sampler.generate([1, 2, 3], params))
        assert backend.publish(sampler) == 1 and sampler.policy_version == 1
        done = asyncio.run(sampler.generate([1, 2, 3], params))
        assert 1 <= len(done.token_ids) <= 6 and len(done.logprobs) == len(done.token_ids)
        assert done.token_versions == [1] * len(done.token_ids)
        assert all(lp <= 0 for lp in done.logprobs)
        assert backend.publish(sampler) == 2 and sampler.policy_version == 2
        again = asyncio.run(sampler.generate([1, 2, 3], params))
        assert again.policy_version == 2 and set(again.token_versions) == {2}
        with pytest.raises(ConfigError, match="publishes to a TinkerSampler, not LocalSampler"):
            backend.publish(LocalSampler.__new__(LocalSampler))
    finally:
        backend.close()
        asyncio.run(sampler.close())


def _run_config(tmp_path: Path, server_url: str, schedule: dict[str, Any]) -> Any:
    from agentrl.train_config import CheckpointConfig, EvalConfig, TrainConfig

    return TrainConfig(
        name="tinker-coin",
        tasks=[str(TASK)],
        backend=TinkerConfig(base_url=server_url, base_model="tiny", lora_rank=0, lr=1e-3),
        algorithm={"loss": {"type": "ppo", "dual_clip": None}},
        schedule={"prompts_per_step": 2, "n_samples_per_prompt": 4, **schedule},
        dispatcher={"type": "pipeline", "concurrency": 8},
        eval=EvalConfig(holdout_every=4, samples=2),
        checkpoint=CheckpointConfig(every=1, keep=1),
        provider="local",
    )


def _train(config: Any, out: Path, *, resume: bool = False) -> dict[str, Any]:
    import asyncio

    from agentrl.tasks.load import load_task
    from agentrl.train import Trainer

    trainer = Trainer(config, [load_task(TASK)], out, show_progress=False)
    return asyncio.run(trainer.run(resume=resume))


def _sampled_versions(t: Any) -> list[int]:
    return [v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m]


def _rows(out: Path, kind: str = "train") -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_the_trainer_trains_through_serve_tinker_and_resumes(
    tinker_server: Any, tmp_path: Path
) -> None:
    """agentrl's trainer, unchanged, with the tinker backend: episodes sampled by the
    service's snapshot, trained there, published back; a resumed run continues from the
    service's saved state."""
    from agentrl.trajectory import TrajectoryStore

    config = _run_config(tmp_path, tinker_server.url, {"type": "sync", "steps": 2})
    summary = _train(config, tmp_path / "run")
    assert summary["steps"] == 2
    rows = _rows(tmp_path / "run")
    assert [r["policy_version"] for r in rows if "skipped" not in r or not r["skipped"]]
    for r in rows:
        if isinstance(r.get("skipped"), str):
            continue  # a batch without a reward spread: nothing to train
        assert r["logprob_mismatch"] < 1e-3  # the service samples what it trains
    trajs = list(TrajectoryStore(tmp_path / "run" / "trajectories.jsonl"))
    assert len(trajs) == 2 * 2 * 4
    for t in trajs:  # every sampled token carries the version of the snapshot sampling it
        assert set(_sampled_versions(t)) == {t.scheduled_step + 1}
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "meta.json").is_file()
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert meta["tinker_path"].startswith("tinker://")

    longer = config.model_copy(update={"schedule": config.schedule.model_copy(update={"steps": 3})})
    _train(longer, tmp_path / "run", resume=True)
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2, 3]


def test_the_async_schedule_runs_on_the_tinker_backend(tinker_server: Any, tmp_path: Path) -> None:
    """Snapshots never change under a request: each trajectory's tokens carry exactly one
    version, one the scheduled step could have seen (within the staleness budget)."""
    from agentrl.trajectory import TrajectoryStore

    schedule = {"type": "async", "steps": 3, "max_staleness_steps": 1}
    summary = _train(_run_config(tmp_path, tinker_server.url, schedule), tmp_path / "run")
    assert summary["steps"] == 3 and summary["schedule"] == "async"
    rows = _rows(tmp_path / "run")
    assert all(r["lag_max"] <= 2 for r in rows)
    for t in TrajectoryStore(tmp_path / "run" / "trajectories.jsonl"):
        if t.consumed_step is None:
            continue  # a filtered group
        (version,) = set(_sampled_versions(t))
        assert t.scheduled_step + 1 <= version <= t.consumed_step + 1
