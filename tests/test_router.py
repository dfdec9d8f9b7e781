"""The router and weight publication against real `agentrl serve` replicas.

Two replicas run as separate processes on 127.0.0.1, each `agentrl serve --model` over
conftest's tiny random Llama (SmolLM2's vocabulary and tokenizer: nothing here depends
on SmolLM2's weights), shared by the tests of this module in order: stickiness, weights
moved by checkpoint and by the collective protocol (gloo here, NCCL with vLLM on a GPU
node), pause keep / abort / wait around a publication with requests in flight, a hung
replica quarantined, a killed one failed over and, once restarted, kept out until it
has the run's weights. The end-to-end test (async training through two replicas, one
of which fails) runs on two SmolLM2 replicas, the model the trainer publishes. The same
router against real vLLM servers (a fresh one's "default" version, pause keep refused
because vLLM stamps no token versions, checkpoint publication, sleep): tests/test_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from agentrl.errors import ConfigError, SamplerError
from agentrl.http import free_port
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.local import LocalSampler
from agentrl.inference.router import Router

pytestmark = pytest.mark.model


class Server:
    """One `agentrl serve --model MODEL` process."""

    def __init__(self, log: Path, model: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.model = model
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = ["serve", "--port", str(self.port), "--model", self.model]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agentrl.cli", *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                # Two replicas and this process share the machine: one thread each.
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )

    def wait_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                if httpx2.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.url} did not come up"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _pair(logs: Path, model: str) -> Iterator[list[Server]]:
    pair = [Server(logs / "a.log", model), Server(logs / "b.log", model)]
    try:
        for s in pair:
            s.start()
        for s in pair:
            s.wait_up()
        yield pair
    finally:
        for s in pair:
            s.stop()


@pytest.fixture(scope="module")
def servers(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Two replicas of the tiny model."""
    yield from _pair(tmp_path_factory.mktemp("serve-logs"), str(tiny_dir))


@pytest.fixture(scope="module")
def smollm2_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Two replicas of the embedded SmolLM2 (the model `agentrl train` publishes)."""
    yield from _pair(tmp_path_factory.mktemp("serve-logs-smollm2"), "embedded")


def _tiny(tiny_dir: Path) -> LlamaForCausalLM:
    model: LlamaForCausalLM = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def weights(tiny_dir: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _tiny(tiny_dir).state_dict().items()}


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tokenizer = load_tokenizer()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    return [int(t) for t in ids]


def _gather(router: Router, *requests: tuple[list[int], SamplingParams, str]) -> list[Completion]:
    async def go() -> list[Completion]:
        return await asyncio.gather(*(router.generate(p, q, session_id=s) for p, q, s in requests))

    return asyncio.run(go())


def _router(servers: list[Server], **kwargs: Any) -> Router:
    return Router([s.url for s in servers], **kwargs)


async def _decoding(router: Router, n: int) -> None:
    """Wait until `n` requests are in flight, then a little longer: they are decoding."""
    while sum(r["inflight"] for r in router.status()) < n:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)


# Tokens for a request that is still decoding when a publication or a kill meets it: the
# tiny model decodes fast, and its 512 positions hold the prompt and this many.
LONG = 400


def test_every_turn_of_a_session_goes_to_one_replica_and_sessions_spread(
    servers: list[Server], prompt: list[int]
) -> None:
    router = _router(servers)
    try:
        params = SamplingParams(max_tokens=4)
        by_session: dict[str, set[str | None]] = {}
        for turn in range(3):  # turns grow the prompt, as a trajectory does
            sessions = [f"traj-{i}" for i in range(6)]
            done = _gather(router, *[(prompt + [turn] * turn, params, s) for s in sessions])
            for s, c in zip(sessions, done, strict=True):
                by_session.setdefault(s, set()).add(c.replica)
        assert all(len(replicas) == 1 for replicas in by_session.values()), by_session
        placed = [next(iter(r)) for r in by_session.values()]
        assert sorted(placed.count(s.url) for s in servers) == [3, 3]  # least-loaded
        assert [r["sessions"] for r in router.status()] == [3, 3]
        assert sum(r["served"] for r in router.status()) == 18
    finally:
        router.close_sync()


@pytest.mark.parametrize("transfer", ["checkpoint", "gloo"])
def test_a_publication_moves_the_weights_into_every_replica(
    servers: list[Server],
    prompt: list[int],
    weights: dict[str, torch.Tensor],
    transfer: str,
    tmp_path: Path,
    tiny_dir: Path,
) -> None:
    changed = {k: v.clone() for k, v in weights.items()}
    noise = torch.randn(changed[_LAYER].shape, generator=torch.Generator().manual_seed(0))
    changed[_LAYER] += 0.05 * noise
    model = _tiny(tiny_dir)
    before = _sample(LocalSampler(model), prompt)
    model.load_state_dict(changed)
    expected = _sample(LocalSampler(model), prompt)
    assert expected.logprobs != before.logprobs  # the change shows
    router = _router(
        servers, transfer=transfer, publish_dir=tmp_path / "published", clear_kv_cache=True
    )
    try:
        version = router.policy_version + 1
        router.update_weights(changed, version)
        assert router.versions() == {s.url: version for s in servers}
        assert router.stats.cache_resets == 2  # each replica's prefix cache cleared
        assert all(r["version"] == version and not r["quarantined"] for r in router.status())
        got = _gather(router, *[(prompt, _SEEDED, f"w-{i}") for i in range(2)])
        assert {c.replica for c in got} == {s.url for s in servers}
        for c in got:  # each replica samples exactly from the new weights
            assert c.token_ids == expected.token_ids
            assert c.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
            assert c.token_versions == [version] * len(c.token_ids)
        router.update_weights(weights, version + 1)  # put the originals back
        back = _gather(router, (prompt, _SEEDED, "w-0"))[0]
        assert back.logprobs == pytest.approx(before.logprobs, abs=1e-5)
        if transfer == "checkpoint":  # only the newest folders are kept
            assert len(list((tmp_path / "published").iterdir())) <= 2
    finally:
        router.close_sync()


_LAYER = "model.layers.1.mlp.down_proj.weight"
_SEEDED = SamplingParams(max_tokens=12, seed=7)


def _sample(sampler: LocalSampler, prompt: list[int]) -> Completion:
    async def go() -> Completion:
        try:
            return await sampler.generate(prompt, _SEEDED)
        finally:
            await sampler.close()

    return asyncio.run(go())


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_a_publication_with_requests_in_flight_stamps_each_token_exactly(
    servers: list[Server], prompt: list[int], weights: dict[str, torch.Tensor], mode: str
) -> None:
    router = _router(servers, pause_mode=mode)
    max_tokens = LONG
    try:
        old = router.policy_version
        new = old + 1

        async def go() -> list[Completion]:
            # One session per replica, so each decodes one batch (wait mode drains it).
            params = [SamplingParams(max_tokens=max_tokens, seed=i) for i in range(2)]
            tasks = [
                asyncio.create_task(router.generate(prompt, p, session_id=f"{mode}-{i}"))
                for i, p in enumerate(params)
            ]
            await _decoding(router, 2)  # on both replicas
            await asyncio.to_thread(router.update_weights, weights, new)
            return await asyncio.gather(*tasks)

        done = asyncio.run(go())
        for c in done:
            assert c.finish_reason in ("stop", "length")  # never a cut reply to the agent
            assert len(c.token_ids) <= max_tokens
            assert c.token_versions == sorted(c.token_versions)
            assert set(c.token_versions) <= {old, new}  # a request queued behind: all new
        spanning = [c for c in done if {old, new} <= set(c.token_versions)]
        if mode == "wait":  # drained before the update: one version each
            assert not spanning and router.stats.continuations == 0
        else:  # sampled partly before, partly after, and says so token by token
            assert spanning, [c.token_versions for c in done]
        if mode == "abort":  # the router finished the cut replies under the new weights
            assert router.stats.continuations >= len(spanning)
    finally:
        router.close_sync()


def test_a_replica_that_misses_the_update_is_quarantined_and_the_run_goes_on(
    servers: list[Server], prompt: list[int], weights: dict[str, torch.Tensor]
) -> None:
    hung = servers[1]
    router = _router(servers, control_timeout=4.0, health_interval=60.0)
    assert hung.proc is not None
    try:
        version = router.policy_version + 1
        hung.proc.send_signal(signal.SIGSTOP)  # alive, listening, answers nothing
        router.update_weights(weights, version)
        status = {r["replica"]: r for r in router.status()}
        assert status[servers[0].url]["version"] == version
        assert status[servers[0].url]["quarantined"] is None
        assert f"missed version {version}" in (status[hung.url]["quarantined"] or "")
        assert router.stats.quarantines == 1
        done = _gather(
            router, *[(prompt, SamplingParams(max_tokens=4), f"q-{i}") for i in range(4)]
        )
        assert {c.replica for c in done} == {servers[0].url}  # no new request to it
        assert all(c.token_versions == [version] * 4 for c in done)

        hung.proc.send_signal(signal.SIGCONT)
        hung.wait_up()
        router.update_weights(weights, version + 1)  # it confirms this one: back in service
        assert all(r["quarantined"] is None for r in router.status())
        assert router.versions() == {s.url: version + 1 for s in servers}
    finally:
        hung.proc.send_signal(signal.SIGCONT)
        router.close_sync()


def test_a_killed_replica_fails_over_and_a_restarted_one_waits_for_the_weights(
    servers: list[Server], prompt: list[int], weights: dict[str, torch.Tensor]
) -> None:
    victim = servers[1]
    router = _router(servers, health_interval=0.5)
    assert victim.proc is not None
    try:
        version = router.policy_version + 1
        router.update_weights(weights, version)

        async def go() -> list[Completion]:
            params = SamplingParams(max_tokens=LONG)
            tasks = [
                asyncio.create_task(router.generate(prompt, params, session_id=f"k-{i}"))
                for i in range(4)
            ]
            await _decoding(router, 4)
            assert victim.proc is not None
            victim.proc.kill()  # mid-generation
            return await asyncio.gather(*tasks)

        done = asyncio.run(go())
        # The cut requests were sent again, whole, to the survivor: nothing half-sampled
        # was kept, and the replica that served each reply is on record.
        assert {c.replica for c in done} == {servers[0].url}
        assert router.stats.failovers >= 1
        assert all(c.token_versions == [version] * len(c.token_ids) for c in done)
        assert not next(r for r in router.status() if r["replica"] == victim.url)["healthy"]

        victim.start()  # back, but with the base weights (version 0)
        victim.wait_up()
        deadline = time.monotonic() + 30
        while not next(r for r in router.status() if r["replica"] == victim.url)["healthy"]:
            assert time.monotonic() < deadline, router.status()
            time.sleep(0.2)
        back = next(r for r in router.status() if r["replica"] == victim.url)
        assert back["version"] == 0 and "serving version 0" in (back["quarantined"] or "")
        done = _gather(
            router, *[(prompt, SamplingParams(max_tokens=2), f"r-{i}") for i in range(4)]
        )
        assert {c.replica for c in done} == {servers[0].url}
        router.update_weights(weights, version + 1)
        assert all(r["quarantined"] is None for r in router.status())
    finally:
        router.close_sync()


def test_bad_router_input_fails_clearly() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        Router([])
    with pytest.raises(ConfigError, match="listed twice"):
        Router(["127.0.0.1:1", "http://127.0.0.1:1/v1"])
    with pytest.raises(ConfigError, match="pause mode"):
        Router(["127.0.0.1:1"], pause_mode="later")  # type: ignore[arg-type]
    router = Router([f"http://127.0.0.1:{free_port()}"], health_interval=60)  # nobody there
    try:
        with pytest.raises(SamplerError, match="no replica can serve"):
            _gather(router, ([1, 2, 3], SamplingParams(max_tokens=2), "s"))
    finally:
        router.close_sync()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.docker
def test_async_training_through_serve_replicas_survives_one_failing_the_sync(
    smollm2_servers: list[Server], tmp_path: Path
) -> None:
    """The trainer tests' task under the async schedule, sampling on both replicas. After
    the first step one replica stops answering (SIGSTOP): it misses the next publication,
    is quarantined, its in-flight requests fail over, and the run finishes on the other."""
    from agentrl.trajectory import TrajectoryStore

    servers = smollm2_servers
    data = Path(__file__).parent / "data" / "train"
    config = yaml.safe_load((data / "train_async.yaml").read_text())
    config["tasks"] = [str(data / "task.yaml")]
    config["checkpoint"] = {"every": 0, "keep": 1}  # only at the end: not what is tested here
    config["servers"] = {
        "urls": [s.url for s in servers],
        "pause": "keep",  # agentrl serve stamps each token: replies span publications
        "control_timeout": 5.0,
        "request_timeout": 10.0,  # max_new_tokens 16: a reply takes 1-3 s
    }
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "train", str(tmp_path / "train.yaml")]
        + ["--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stopped = servers[1]
    assert stopped.proc is not None
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        stopped.proc.send_signal(signal.SIGSTOP)
        output = proc.communicate(timeout=600)[0]
    finally:
        stopped.proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    stopped.wait_up()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    first, second = [r for r in rows if r["kind"] == "train"]
    start = first["policy_version"] - 1  # the version the run's first publication set
    assert [r["version"] for r in first["replicas"]] == [start + 1] * 2
    # Step 1 trains on tokens of the first publication only: the learner scores exactly
    # what the servers sampled (the weights arrived bit for bit).
    assert first["tokens_by_age"] == {"0": first["sampled_tokens"]}
    assert first["logprob_mismatch"] < 1e-3
    status = {r["replica"]: r for r in second["replicas"]}
    assert status[servers[0].url]["version"] == start + 2
    # Out of service either way: quarantined when it was still a target of the
    # publication, or already marked down by a timed-out request or the health check.
    gone = status[stopped.url]
    assert not gone["healthy"] or f"missed version {start + 2}" in (gone["quarantined"] or "")
    assert gone["version"] != start + 2
    assert first["submitted"] == first["accepted"] + first["filtered"] + first["running"]
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
    assert {t.consumed_step for t in trajs if t.consumed_step is not None} == {0, 1}
    for t in trajs:
        sampled = [v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m]
        assert sampled == sorted(sampled) and set(sampled) <= {start, start + 1, start + 2}
    used = {turn.replica for t in trajs for turn in t.turns}
    assert used == {s.url for s in servers}
    assert not list((out / "published").iterdir())  # the router cleans up its folders
