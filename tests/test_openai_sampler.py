"""OpenAISampler over real HTTP: against serve(LocalSampler) on the embedded model, and
against a tiny stdlib server that plays faults (5xx, timeouts, malformed answers) that a
healthy server never produces. Every server listens on 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import pytest
from transformers import PreTrainedTokenizerBase

from agentrl.errors import SamplerError
from agentrl.http import free_port
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.config import parse_policy
from agentrl.inference.embedded import EMBEDDED_NAME, load_tokenizer
from agentrl.inference.local import LocalSampler
from agentrl.inference.openai import OpenAISampler, normalize_base_url
from agentrl.inference.serve import serve
from agentrl.trajectory import TrajectoryStore

REPO = Path(__file__).resolve().parent.parent


# ---- fixtures: the real model behind serve() ------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


@pytest.fixture(scope="module")
def local() -> Iterator[LocalSampler]:
    sampler = LocalSampler.embedded()
    yield sampler
    asyncio.run(sampler.close())


@pytest.fixture(scope="module")
def url(local: LocalSampler, tokenizer: PreTrainedTokenizerBase) -> Iterator[str]:
    server, url = serve(local, tokenizer)
    yield url
    server.close()


@pytest.fixture(scope="module")
def prompt(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
    return cast(list[int], ids)


def over_http(url: str, *requests: tuple[list[int], SamplingParams]) -> list[Completion]:
    """Send every request at once through one OpenAISampler; closes it afterwards."""

    async def go() -> list[Completion]:
        sampler = OpenAISampler(url)
        try:
            return await asyncio.gather(*(sampler.generate(p, params) for p, params in requests))
        finally:
            await sampler.close()

    return asyncio.run(go())


def post(url: str, body: object) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as res:
            return res.status, json.loads(res.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- against the embedded model ------------------------------------------------------


@pytest.mark.model
def test_tokens_round_trip_exactly(local: LocalSampler, url: str, prompt: list[int]) -> None:
    for params in (
        SamplingParams(max_tokens=10, temperature=1.0, seed=3),
        SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=11),
    ):
        direct = asyncio.run(local.generate(prompt, params))
        (remote,) = over_http(url, (prompt, params))
        assert remote.token_ids == direct.token_ids
        assert remote.logprobs == pytest.approx(direct.logprobs, abs=1e-5)
        assert remote.finish_reason == direct.finish_reason
        assert remote.policy_version == direct.policy_version == 0


@pytest.mark.model
def test_policy_version_comes_from_the_server_header(
    local: LocalSampler, url: str, prompt: list[int]
) -> None:
    local.set_policy_version(5)
    try:
        (c,) = over_http(url, (prompt, SamplingParams(max_tokens=2, temperature=0)))
    finally:
        local.set_policy_version(0)
    assert c.policy_version == 5  # the client's own counter is still 0


@pytest.mark.model
def test_concurrent_http_requests_are_batched(
    local: LocalSampler, url: str, prompt: list[int]
) -> None:
    before = local.stats
    requests = [(prompt, SamplingParams(max_tokens=6, seed=s)) for s in range(5)]
    completions = over_http(url, *requests)
    after = local.stats
    assert after.requests - before.requests == 5
    assert after.batches - before.batches < 5, "HTTP requests should share LocalSampler batches"
    assert all(len(c.token_ids) == len(c.logprobs) > 0 for c in completions)


@pytest.mark.model
def test_finish_reasons_length_and_stop(url: str, prompt: list[int]) -> None:
    (long,) = over_http(url, (prompt, SamplingParams(max_tokens=6, temperature=0)))
    assert long.finish_reason == "length" and len(long.token_ids) == 6
    stop_id = long.token_ids[2]
    first = long.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(stop_id,))
    (stopped,) = over_http(url, (prompt, params))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == long.token_ids[: first + 1]  # the stop token is kept


@pytest.mark.model
def test_stop_strings_cut_the_text_like_vllm_but_never_the_ids(
    url: str, prompt: list[int], tokenizer: PreTrainedTokenizerBase
) -> None:
    (free,) = over_http(url, (prompt, SamplingParams(max_tokens=12, temperature=0)))
    ids, text = free.token_ids, tokenizer.decode(free.token_ids)

    def starts(k: int) -> int:
        return len(tokenizer.decode(ids[:k]))

    # The first 2 characters of a longer token k, seen nowhere before it: the completing
    # token runs past the string, so text and ids must be cut differently.
    k = next(
        k
        for k in range(1, len(ids))
        if len(tokenizer.decode(ids[k : k + 1])) >= 4
        and text.find(text[starts(k) : starts(k) + 2]) == starts(k)
    )
    start = starts(k)
    stop = text[start : start + 2]
    (stopped,) = over_http(
        url, (prompt, SamplingParams(max_tokens=12, temperature=0, stop=(stop,)))
    )
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ids[: k + 1]  # the completing token, whole

    body = {
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "stop": stop,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    for include, cut in ((True, start + 2), (False, start)):
        status, res = post(url, {**body, "include_stop_str_in_output": include})
        (choice,) = res["choices"]
        assert status == 200 and choice["finish_reason"] == "stop"
        assert choice["stop_reason"] == stop
        assert choice["text"] == text[:cut]  # vLLM's text ends at (or before) the string
        assert choice["token_ids"] == ids[: k + 1]


@pytest.mark.model
def test_seed_reproducibility(url: str, prompt: list[int]) -> None:
    same = over_http(url, *[(prompt, SamplingParams(max_tokens=8, seed=7))] * 2)
    assert same[0].token_ids == same[1].token_ids
    # Equal ids; logprobs equal up to float noise from how the two requests were batched.
    assert same[0].logprobs == pytest.approx(same[1].logprobs, abs=1e-5)
    others = over_http(url, *[(prompt, SamplingParams(max_tokens=8, seed=s)) for s in (8, 9)])
    assert any(c.token_ids != same[0].token_ids for c in others)


@pytest.mark.model
def test_model_is_discovered_from_v1_models(url: str, prompt: list[int]) -> None:
    async def go() -> str | None:
        sampler = OpenAISampler(url.removesuffix("/v1"))  # a bare host:port works too
        try:
            await sampler.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
            return sampler.model
        finally:
            await sampler.close()

    assert asyncio.run(go()) == EMBEDDED_NAME


@pytest.mark.model
def test_server_validates_like_vllm(url: str, prompt: list[int]) -> None:
    status, body = post(url, {"prompt": "hello", "max_tokens": 4})
    assert status == 400 and "send token ids" in body["error"]["message"]
    status, body = post(url, {"prompt": prompt, "max_token": 4, "best_of": 2})
    assert status == 400 and body["error"]["message"] == "unknown fields: best_of, max_token"
    status, body = post(url, {"prompt": prompt, "n": 2})
    assert status == 400 and "n" in body["error"]["message"]
    status, body = post(url, {"prompt": prompt, "model": "gpt-4"})
    assert status == 404
    status, body = post(
        url,
        {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 0, "return_token_ids": 1},
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 3
    assert body["usage"]["completion_tokens"] == 3 and body["object"] == "text_completion"


def control(url: str, method: str, path: str, body: object = None) -> tuple[int, dict[str, Any]]:
    """A control route of the server at `url` (.../v1): vLLM's live beside /v1."""
    data = None if body is None else json.dumps(body).encode()
    root = url.removesuffix("/v1")
    req = urllib.request.Request(f"{root}{path}", data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, json.loads(res.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.model
def test_control_routes_speak_vllm_dev_mode(
    local: LocalSampler,
    url: str,
    prompt: list[int],
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    from agentrl.inference.weight_transfer import save_weights

    version = local.policy_version
    assert control(url, "GET", "/weight_info") == (
        200,
        {"weight_version": str(version), "token_versions": True},
    )
    assert control(url, "GET", "/get_world_size") == (200, {"world_size": 1})
    # Weights change only while paused: no token is stamped with the wrong version.
    status, body = control(url, "POST", "/update_weight_version", {"new_version": "9"})
    assert status == 409 and "POST /pause first" in body["error"]["message"]
    status, body = control(url, "POST", "/start_weight_update")
    assert status == 409
    assert control(url, "POST", "/pause?mode=sideways")[0] == 400
    assert control(url, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert control(url, "GET", "/is_paused") == (200, {"is_paused": True})
    folder = save_weights(local.model.state_dict(), tmp_path / "w")
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
    assert control(url, "POST", "/collective_rpc", rpc)[0] == 200
    assert control(url, "POST", "/collective_rpc", {"method": "shutdown"})[0] == 400
    missing = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "none")}}
    status, body = control(url, "POST", "/collective_rpc", missing)
    assert status == 400 and "no .safetensors" in body["error"]["message"]
    new = version + 1
    assert control(url, "POST", "/update_weight_version", {"new_version": str(new)})[0] == 200
    status, body = control(url, "POST", "/finish_weight_update", {"weight_version": "3"})
    assert status == 409 and "start_weight_update" in body["error"]["message"]
    assert control(url, "POST", "/resume") == (200, {"status": "resumed"})
    assert control(url, "GET", "/weight_info")[1]["weight_version"] == str(new)
    status, body = post(url, {"prompt": prompt, "max_tokens": 3, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_versions"] == [new] * 3
    # Sleep (level 1: pause and keep the weights); level 2 is not offered.
    assert control(url, "POST", "/sleep?level=2")[0] == 400
    assert control(url, "POST", "/sleep?level=1")[0] == 200
    assert control(url, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    assert control(url, "POST", "/resume")[0] == 409  # asleep: wake up first
    assert control(url, "POST", "/wake_up")[0] == 200
    assert control(url, "GET", "/is_paused") == (200, {"is_paused": False})
    # Tokenizer routes.
    status, body = control(url, "POST", "/tokenize", {"prompt": "hello world"})
    assert status == 200 and body["tokens"] == tokenizer.encode("hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 8192
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    assert control(url, "POST", "/tokenize", {"messages": messages})[1]["tokens"] == prompt
    assert control(url, "POST", "/detokenize", {"tokens": body["tokens"]}) == (
        200,
        {"prompt": "hello world"},
    )
    assert control(url, "POST", "/nope")[0] == 404
    assert control(url, "POST", "/tokenize", {"x": 1})[0] == 400


@pytest.mark.model
def test_a_4xx_is_one_line_and_never_retried(url: str) -> None:
    async def go(sampler: OpenAISampler) -> None:
        try:
            await sampler.generate([10**7], SamplingParams(max_tokens=2))
        finally:
            await sampler.close()

    sampler = OpenAISampler(url)
    with pytest.raises(SamplerError) as info:
        asyncio.run(go(sampler))
    message = str(info.value)
    assert "\n" not in message and "HTTP 400" in message and "outside the vocabulary" in message
    assert sampler.stats.retries == 0 and sampler.stats.failures == 1


# ---- faults, from a stdlib server that plays a script ----------------------------------

GOOD: dict[str, Any] = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 0,
    "model": "fake",
    "choices": [
        {
            "index": 0,
            "text": "hi",
            "token_ids": [5, 6],
            "prompt_token_ids": [1],
            "logprobs": {"tokens": ["h", "i"], "token_logprobs": [-0.5, -0.25]},
            "finish_reason": "stop",
            "stop_reason": None,
        }
    ],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}


class Script:
    """Replies to POST /v1/completions in order: (status, body) or a delay in seconds."""

    def __init__(self, *replies: tuple[int, object] | float) -> None:
        self.replies = list(replies)
        self.posts = 0
        self.model_lists = 0
        self.bodies: list[dict[str, Any]] = []


@pytest.fixture
def fake() -> Iterator[tuple[Script, str]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            script.model_lists += 1
            self._reply(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

        def do_POST(self) -> None:
            script.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            reply = script.replies[min(script.posts, len(script.replies) - 1)]
            script.posts += 1
            if isinstance(reply, float):
                time.sleep(reply)
                reply = (200, GOOD)
            self._reply(*reply)

        def _reply(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield script, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def generate(sampler: OpenAISampler, times: int = 1) -> Completion:
    async def go() -> Completion:
        try:
            for _ in range(times):
                c = await sampler.generate([1], SamplingParams(max_tokens=2, seed=0))
            return c
        finally:
            await sampler.close()

    return asyncio.run(go())


def test_5xx_twice_then_success_after_counted_retries(fake: tuple[Script, str]) -> None:
    script, url = fake
    error = {"error": {"message": "engine overloaded", "type": "x", "code": 500}}
    script.replies = [(500, error), (500, error), (200, GOOD)]
    sampler = OpenAISampler(url, max_retries=3, backoff=0.01)
    sampler.set_policy_version(7)
    c = generate(sampler)
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([5, 6], [-0.5, -0.25], "stop")
    assert c.policy_version == 7  # no header: the sampler's own counter
    assert sampler.stats.retries == 2 and script.posts == 3
    assert "cache_salt" not in script.bodies[0]  # off unless asked (a hosted API may refuse it)


def test_the_cache_salt_carries_the_weights_version(fake: tuple[Script, str]) -> None:
    script, url = fake
    script.replies = [(200, GOOD)]
    sampler = OpenAISampler(url, cache_salt=True)
    sampler.set_policy_version(3)
    generate(sampler)
    assert script.bodies[-1]["cache_salt"] == "agentrl-v3"


def test_5xx_every_time_gives_up_with_the_message(fake: tuple[Script, str]) -> None:
    script, url = fake
    script.replies = [(503, {"error": {"message": "down\nfor maintenance"}})]
    sampler = OpenAISampler(url, model="fake", max_retries=1, backoff=0.01)
    with pytest.raises(SamplerError, match=r"HTTP 503 2 time\(s\): down for maintenance$"):
        generate(sampler)
    assert sampler.stats.retries == 1 and script.posts == 2


def test_model_is_discovered_once(fake: tuple[Script, str]) -> None:
    script, url = fake
    script.replies = [(200, GOOD)]
    sampler = OpenAISampler(url)
    generate(sampler, times=3)
    assert sampler.model == "fake" and script.model_lists == 1 and script.posts == 3


def test_timeout_is_retried_then_named(fake: tuple[Script, str]) -> None:
    script, url = fake
    script.replies = [1.0]
    sampler = OpenAISampler(url, model="fake", timeout=0.2, max_retries=1, backoff=0.01)
    with pytest.raises(SamplerError, match="timed out after 0.2 s"):
        generate(sampler)
    assert sampler.stats.retries == 1


def choice_with(**fields: object) -> dict[str, object]:
    return {**GOOD, "choices": [{**GOOD["choices"][0], **fields}]}


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (choice_with(logprobs=None), "no choices[0].logprobs.token_logprobs"),
        (choice_with(logprobs={"tokens": ["h", "i"]}), "no choices[0].logprobs.token_logprobs"),
        (choice_with(token_ids=None), "return_token_ids"),
        (choice_with(token_ids=[5]), "1 token ids but 2 logprobs"),
        (choice_with(finish_reason="content_filter"), "'content_filter' is not one of"),
        ({**GOOD, "choices": []}, "0 choices"),
    ],
)
def test_unusable_answers_are_errors_not_retried(
    fake: tuple[Script, str], body: object, complaint: str
) -> None:
    script, url = fake
    script.replies = [(200, body)]
    sampler = OpenAISampler(url, model="fake", backoff=0.01)
    with pytest.raises(SamplerError, match=re.escape(complaint)):
        generate(sampler)
    assert sampler.stats.retries == 0 and script.posts == 1


def test_dead_port_is_retried_then_names_the_url() -> None:
    base = f"http://127.0.0.1:{free_port()}"
    sampler = OpenAISampler(base, model="m", max_retries=2, backoff=0.01, timeout=5)
    with pytest.raises(SamplerError) as info:
        generate(sampler)
    assert f"no answer from {base}/v1" in str(info.value) and "3 attempt(s)" in str(info.value)
    assert "\n" not in str(info.value)
    assert sampler.stats.retries == 2 and sampler.stats.failures == 1


def test_urls_are_normalised_and_parse_policy_builds_the_sampler() -> None:
    for given in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "127.0.0.1:8000/v1/"):
        assert normalize_base_url(given) == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("http://h:1/v1/completions") == "http://h:1/v1"
    policy = parse_policy("openai:http://127.0.0.1:8000").build()
    assert isinstance(policy, OpenAISampler) and policy.base_url == "http://127.0.0.1:8000/v1"
    asyncio.run(policy.close())


# ---- people's entry points: agentrl serve, agentrl run --policy openai:URL -------------


@pytest.mark.model
def test_agentrl_serve_prints_its_url_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        match = re.search(r"http://127\.0\.0\.1:\d+/v1", proc.stdout.readline())
        assert match, "the first line names the URL"
        with urllib.request.urlopen(match.group(0) + "/models", timeout=10) as res:
            assert json.loads(res.read())["data"][0]["id"] == EMBEDDED_NAME
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.model
@pytest.mark.docker
def test_agentrl_run_with_an_openai_policy(local: LocalSampler, url: str, tmp_path: Path) -> None:
    local.set_policy_version(4)  # proves the server's version reaches every sampled token
    try:
        res = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "run", "tests/data/agent/echo_task.yaml"]
            + ["--policy", f"openai:{url}", "-n", "1", "--out", str(tmp_path)]
            + ["--max-turns", "2", "--max-new-tokens", "32"],  # the ledger, not the answer
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
            env={**os.environ, "COLUMNS": "200"},
        )
    finally:
        local.set_policy_version(0)
    assert res.returncode == 0, res.stdout + res.stderr
    trajs = list(TrajectoryStore(tmp_path / "trajectories.jsonl").read())  # validates each
    assert len(trajs) == 2
    for t in trajs:
        assert t.trainable and sum(t.loss_mask) > 0
        assert {v for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m} == {4}
