"""`agentrl serve-tinker` driven by the real tinker SDK (0.38.0) over HTTP on 127.0.0.1.

The server runs in this process on conftest's tiny random Llama (SmolLM2's vocabulary),
with the embedded SmolLM2 tokenizer saved beside it so get_tokenizer and stop strings
work offline. Every expected number is computed here, independently, with plain
transformers and torch on the same model folder. The CLI tests start the real command.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from transformers import LlamaForCausalLM

from agentrl.errors import ConfigError
from agentrl.tinker_server.futures import Futures, Sequencer, Worker
from agentrl.tinker_server.learner import TinkerLearner, parse_loss
from agentrl.tinker_server.server import TinkerServer, serve
from agentrl.tinker_server.wire import Datum

pytestmark = pytest.mark.model  # the model folder gets the embedded SmolLM2 tokenizer

NAME = "tiny"
VOCAB = 49152
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture
def service(tinker_server: TinkerServer) -> Iterator[tinker.ServiceClient]:
    """A client session; closing it releases its models for the next test."""
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-test")
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def hf(tiny_dir: Path) -> LlamaForCausalLM:
    model: LlamaForCausalLM = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


def full_weights(service: tinker.ServiceClient) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=NAME, rank=0).result()


def reference_logprobs(hf: LlamaForCausalLM, tokens: list[int], targets: list[int]) -> torch.Tensor:
    logits_T_V = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits_T_V, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sft(ids: list[int]) -> types.Datum:
    """Next-token cross-entropy on every token of `ids`."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def expected_loss(
    name: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], lo: float, hi: float
) -> torch.Tensor:
    """Tinker's per-token losses, written out from its documentation."""
    if name == "cross_entropy":
        return -inputs["weights"] * lp
    ratio, adv = torch.exp(lp - inputs["logprobs"]), inputs["advantages"]
    if name == "importance_sampling":
        return -ratio * adv
    if name == "ppo":
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    return -ratio.clamp(lo, hi).detach() * lp * adv  # cispo


# (loss_fn, loss_fn_config, the thresholds that apply): defaults, and set explicitly
LOSS_CASES = [
    ("cross_entropy", None, (0.0, 0.0)),
    ("importance_sampling", None, (0.0, 0.0)),
    ("ppo", None, (0.8, 1.2)),
    ("cispo", None, (0.0, 4.0)),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, (0.9, 1.05)),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, (0.9, 1.05)),
]


def loss_inputs(name: str, lp: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """Weights, or sampler logprobs within ±0.5 of the learner's (so ratios get clipped)
    and advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    n = len(lp)
    if name == "cross_entropy":
        return {"weights": torch.rand(n, generator=g)}
    return {
        "logprobs": lp + torch.rand(n, generator=g) - 0.5,
        "advantages": torch.randn(n, generator=g),
    }


def test_losses_match_an_independent_torch_computation(
    service: tinker.ServiceClient, hf: LlamaForCausalLM
) -> None:
    client = full_weights(service)
    sequences = [random_ids(10, seed=1), random_ids(6, seed=2)]  # two lengths: padding
    for k, (name, config, (lo, hi)) in enumerate(LOSS_CASES):
        data, want_lp, want_loss = [], [], []
        for s, ids in enumerate(sequences):
            with torch.no_grad():
                lp = reference_logprobs(hf, ids[:-1], ids[1:])
            inputs = loss_inputs(name, lp, seed=10 * k + s)
            want_lp.append(lp)
            want_loss.append(expected_loss(name, lp, inputs, lo, hi))
            loss_fn_inputs = {
                "target_tokens": ids[1:],
                **{i: v.tolist() for i, v in inputs.items()},
            }
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=loss_fn_inputs
                )
            )
        out = client.forward_backward(data, name, config).result()
        total = float(sum(loss.sum() for loss in want_loss))
        # float32 logprobs agree to ~1e-6; exp() and advantages scale that: relative 1e-5
        assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5), name
        for got, lp, loss in zip(out.loss_fn_outputs, want_lp, want_loss, strict=True):
            np.testing.assert_allclose(got["logprobs"].to_numpy(), lp.numpy(), atol=1e-5)
            np.testing.assert_allclose(
                got["elementwise_loss"].to_numpy(), loss.numpy(), rtol=1e-5, atol=1e-5
            )


def test_learner_gradients_match_autograd(tiny_dir: Path) -> None:
    """The gradient of each loss (cispo's stop-gradient, ppo's min) equals autograd's on
    the plain model."""
    learner = TinkerLearner(tiny_dir, None)
    try:
        ids = random_ids(9, seed=3)
        for k, (name, config, (lo, hi)) in enumerate(LOSS_CASES):
            reference = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
            lp = reference_logprobs(reference, ids[:-1], ids[1:])
            inputs = loss_inputs(name, lp.detach(), seed=k)
            expected_loss(name, lp, inputs, lo, hi).sum().backward()
            want = reference.model.layers[0].mlp.down_proj.weight.grad

            arrays = {i: v.numpy() for i, v in inputs.items()}
            datum = Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), **arrays})
            learner.backend.optimizer.zero_grad(set_to_none=True)
            learner.forward_backward([datum], parse_loss(name, config or {}), backward=True)
            got = learner.backend.model.model.layers[0].mlp.down_proj.weight.grad
            assert want is not None and got is not None
            torch.testing.assert_close(got.full_tensor(), want, atol=1e-6, rtol=1e-4)
    finally:
        learner.close()


def test_training_lowers_the_loss_and_gradients_accumulate(service: tinker.ServiceClient) -> None:
    one, both = full_weights(service), full_weights(service)
    d1, d2 = sft(random_ids(8, seed=4)), sft(random_ids(5, seed=5))
    # Submitted without waiting: the server runs them in seq_id order.
    first = one.forward_backward([d1], "cross_entropy")
    second = one.forward_backward([d2], "cross_entropy")
    step_one = one.optim_step(ADAM)
    together = both.forward_backward([d1, d2], "cross_entropy").result()
    step_both = both.optim_step(ADAM).result()
    summed = first.result().metrics["loss:sum"] + second.result().metrics["loss:sum"]
    assert summed == pytest.approx(together.metrics["loss:sum"], rel=1e-6)
    assert step_one.result().metrics["grad_norm:mean"] == pytest.approx(
        step_both.metrics["grad_norm:mean"], rel=1e-5
    )
    after_one = one.forward([d1, d2], "cross_entropy").result().loss_fn_outputs
    after_both = both.forward([d1, d2], "cross_entropy").result().loss_fn_outputs
    for a, b in zip(after_one, after_both, strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)

    losses = [one.forward([d1], "cross_entropy").result().metrics["loss:sum"]]
    for _ in range(3):
        one.forward_backward([d1], "cross_entropy")
        one.optim_step(ADAM)
        losses.append(one.forward([d1], "cross_entropy").result().metrics["loss:sum"])
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * losses[0], losses


def forward_logprobs(
    client: tinker.TrainingClient, prompt: list[int], tokens: list[int]
) -> np.ndarray:
    """The learner's logprobs of `tokens` sampled after `prompt`."""
    ids = prompt + tokens
    datum = sft(ids)
    out = client.forward([datum], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()[-len(tokens) :]


def test_sampling_snapshots(service: tinker.ServiceClient) -> None:
    client = full_weights(service)
    prompt = random_ids(5, seed=6)
    model_input = types.ModelInput.from_ints(prompt)
    params = types.SamplingParams(max_tokens=6, seed=7)
    first = client.save_weights_and_get_sampling_client().result()
    result = first.sample(model_input, num_samples=3, sampling_params=params).result()
    assert len(result.sequences) == 3
    assert len({tuple(s.tokens) for s in result.sequences}) == 3  # one seed, three samples
    for s in result.sequences:
        assert len(s.tokens) == 6 and s.stop_reason == "length" and s.sequence_id
        assert s.logprobs is not None
        np.testing.assert_allclose(
            s.logprobs, forward_logprobs(client, prompt, s.tokens), atol=1e-4
        )

    # A stop token ends the sample there, and is kept.
    tokens = result.sequences[0].tokens
    stop = types.SamplingParams(max_tokens=6, seed=7, stop=[tokens[2]])
    stopped = first.sample(model_input, num_samples=1, sampling_params=stop).result().sequences[0]
    assert stopped.tokens == tokens[:3] and stopped.stop_reason == "stop"
    assert first.compute_logprobs(model_input).result()[1:] == pytest.approx(
        forward_logprobs(client, prompt[:1], prompt[1:]).tolist(), abs=1e-4
    )

    # Train, publish twice: the first client still samples its own snapshot, until a
    # third publication releases it (--keep-samplers 2).
    client.forward_backward([sft(prompt + tokens)], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=0.1))
    second = client.save_weights_and_get_sampling_client().result()
    single = types.SamplingParams(max_tokens=6, seed=7)
    again = first.sample(model_input, num_samples=1, sampling_params=single).result().sequences[0]
    newer = second.sample(model_input, num_samples=1, sampling_params=single).result().sequences[0]
    assert again.tokens == tokens and again.logprobs == pytest.approx(
        result.sequences[0].logprobs, abs=1e-5
    )
    assert newer.logprobs is not None and np.allclose(
        newer.logprobs, forward_logprobs(client, prompt, newer.tokens), atol=1e-4
    )
    assert newer.logprobs != pytest.approx(again.logprobs, abs=1e-3)
    client.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match="--keep-samplers"):
        first.sample(model_input, num_samples=1, sampling_params=single).result()


def test_save_state_then_resume_continues_identically(service: tinker.ServiceClient) -> None:
    client = full_weights(service)
    d1, d2 = sft(random_ids(7, seed=8)), sft(random_ids(6, seed=9))
    probe = sft(random_ids(5, seed=10))
    client.forward_backward([d1], "cross_entropy")
    client.optim_step(ADAM)
    path = client.save_state("ckpt").result().path
    assert path == f"tinker://{client.model_id}/weights/ckpt"

    weights_only = service.create_training_client_from_state(path).result()
    lp = weights_only.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    want = client.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_array_equal(lp.to_numpy(), want.to_numpy())

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().is_lora is False
    outs = []
    for c in (client, resumed):
        c.forward_backward([d2], "cross_entropy")
        step = c.optim_step(ADAM).result()
        out = c.forward([probe], "cross_entropy").result()
        outs.append((step.metrics["grad_norm:mean"], out.loss_fn_outputs[0]["logprobs"].to_numpy()))
    assert outs[0][0] == pytest.approx(outs[1][0], rel=1e-6)
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-6)


def test_unsupported_requests_fail_fast_and_the_client_goes_on(
    service: tinker.ServiceClient,
) -> None:
    client = full_weights(service)
    datum = sft(random_ids(5, seed=11))
    for loss_fn, config, message in [
        (
            "dro",
            None,
            "loss_fn 'dro' is not supported by agentrl serve-tinker "
            "(supported: cross_entropy, importance_sampling, ppo, cispo)",
        ),
        (
            "ppo",
            {"beta": 0.1},
            "loss_fn ppo takes only clip_high_threshold, clip_low_threshold; got beta",
        ),
        ("importance_sampling", None, "datum 0: loss_fn importance_sampling reads loss_fn_inputs"),
    ]:
        start = time.monotonic()
        with pytest.raises(tinker.RequestFailedError) as info:
            client.forward_backward([datum], loss_fn, config).result()  # type: ignore[arg-type]
        assert message in str(info.value) and info.value.category.value == "user"
        assert time.monotonic() - start < 5
    assert client.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.RequestFailedError, match="serves base model 'tiny', not 'other/m'"):
        service.create_lora_training_client(base_model="other/m", rank=0).result()


def test_malformed_requests_get_a_one_line_400(tinker_server: TinkerServer) -> None:
    host, port = tinker_server.url.removeprefix("http://").split(":")
    for path, content_type, body in [
        ("/api/v1/forward_backward", "application/x-protobuf", b"not a protobuf"),
        ("/api/v1/optim_step", "application/json", b"{"),
        ("/api/v1/optim_step", "application/json", b'{"model_id": "m"}'),
    ]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", path, body, {"Content-Type": content_type, "X-API-Key": "tml-x"})
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        assert response.status == 400 and response.getheader("Content-Length") == str(len(raw))
        detail = json.loads(raw)["detail"]
        assert detail and "\n" not in detail, detail


def test_a_taken_port_is_one_clear_error(tinker_server: TinkerServer, tiny_dir: Path) -> None:
    port = int(tinker_server.url.rsplit(":", 1)[1])
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: .*--port"):
        serve(str(tiny_dir), name=NAME, port=port)


def test_sequencer_runs_in_seq_id_order_and_submits_are_idempotent() -> None:
    worker, futures = Worker(), Futures()
    ran: list[int] = []
    sequencer = Sequencer(worker)

    def job(seq: int) -> Callable[[], dict[str, int]]:
        return lambda: ran.append(seq) or {}  # type: ignore[func-returns-value]

    for seq in (2, 3, 1):  # how the SDK sends a forward_backward in three chunks
        future, new = futures.create("fwd", ("m", seq))
        assert new
        sequencer.submit(seq, future, job(seq))
    again, new = futures.create("fwd", ("m", 2))
    assert not new and again.wait(10)
    assert ran == [1, 2, 3]
    late, _ = futures.create("fwd", ("m", 0))
    sequencer.submit(0, late, dict)
    assert late.error == ("seq_id 0 was already used by this model", "user")
    assert worker.close(10)


def test_lora_trains_samples_and_resumes(service: tinker.ServiceClient) -> None:
    client = service.create_lora_training_client(base_model=NAME, rank=4).result()
    info = client.get_info()
    assert info.is_lora is True and info.lora_rank == 4
    d1 = sft(random_ids(8, seed=12))
    before = client.forward([d1], "cross_entropy").result().metrics["loss:sum"]
    client.forward_backward([d1], "cross_entropy")
    client.optim_step(ADAM)
    path = client.save_state("lora").result().path
    after = client.forward([d1], "cross_entropy").result().metrics["loss:sum"]
    assert after < before

    prompt = random_ids(4, seed=13)
    sampler = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, seed=0)
    s = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    np.testing.assert_allclose(
        s.logprobs or [], forward_logprobs(client, prompt, s.tokens), atol=1e-4
    )

    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 4
    outs = []
    for c in (client, resumed):
        c.forward_backward([d1], "cross_entropy")
        outs.append(c.optim_step(ADAM).result().metrics["grad_norm:mean"])
    assert outs[0] == pytest.approx(outs[1], rel=1e-6)


# ---- the command ----------------------------------------------------------------------


def test_cli_serves_checks_the_key_and_stops_on_sigterm(tiny_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve-tinker", "--model", str(tiny_dir)]
        + ["--port", "0", "--state-dir", str(tmp_path), "--api-key", "tml-secret"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, line
        url = match.group(0)
        with urllib.request.urlopen(url + "/api/v1/healthz", timeout=10) as res:
            assert json.loads(res.read()) == {"status": "ok"}
        request = urllib.request.Request(url + "/api/v1/client/config", b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 401
        request.add_header("X-API-Key", "tml-secret")
        with urllib.request.urlopen(request, timeout=10) as res:
            assert json.loads(res.read())["use_pyqwest_transport"] is False
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_bad_model_is_one_line_and_exit_1(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "serve-tinker", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "300"},
    )
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1, res.stderr  # the CLI: a bad input is exit 1
    assert len(lines) == 1 and "not a model folder" in lines[0], res.stderr
