"""The Tinker backend: samples as Tinker datums, the options Tinker cannot honour, and
training through the real `tinker` SDK against `agentrl serve-tinker` on 127.0.0.1.

No hosted Tinker account is used (none is reachable here): the service is agentrl's own
Tinker-compatible server, started on loopback with a tiny model.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.algorithms import LossConfig
from agentrl.backends.base import Sample
from agentrl.backends.tinker import TinkerConfig, loss_call, to_datums, token_scales
from agentrl.errors import ConfigError
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
    with pytest.raises(ConfigError, match="at temperature 1, but the tasks sample at temperature 0.7"):
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
