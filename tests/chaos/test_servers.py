"""Chaos for both HTTP servers (`agentrl serve`, `agentrl serve-tinker`) on 127.0.0.1.

Real servers over real sockets: fuzzed and adversarial bodies, huge and negative
numbers, slow and vanishing clients, a burst of connections far beyond the old listen
backlog. Each case must end in a 4xx with a one-line JSON message (or a normal answer),
never a 5xx, and the server must answer a small request afterwards. The models are
conftest's tiny random Llama (512 positions) and, where a generation must run long, the
same shape with 8192 positions built in memory: random weights almost never sample
EOS, so a request with max_tokens null runs for thousands of steps.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.inference.embedded import model_tokenizer
from agentrl.inference.local import LocalSampler
from agentrl.inference.serve import CompletionServer, serve
from agentrl.inference.vllm_api import CompletionRequest

pytestmark = pytest.mark.model  # the tiny model folder holds the embedded tokenizer

READ_S = 1.0  # the servers' read deadline here: a request must arrive within 1 s
VOCAB = 49152
FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ---- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Iterator[tuple[LocalSampler, int]]:
    """`agentrl serve` over the 512-position tiny model: every generation is short."""
    sampler = LocalSampler.for_model(str(tiny_dir))
    server, _ = serve(sampler, model_tokenizer(str(tiny_dir)), read_timeout_s=READ_S)
    yield sampler, _port(server)
    server.close()
    asyncio.run(sampler.close())


@pytest.fixture(scope="module")
def long_context(tiny_dir: Path) -> Iterator[tuple[LocalSampler, int]]:
    """`agentrl serve` over a random 8192-position tiny Llama: max_tokens null runs long."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_dir)
    config.max_position_embeddings = 8192
    torch.manual_seed(1)
    tokenizer = model_tokenizer(str(tiny_dir))
    sampler = LocalSampler(LlamaForCausalLM(config).eval(), tokenizer=tokenizer)
    server, _ = serve(sampler, tokenizer, read_timeout_s=READ_S)
    yield sampler, _port(server)
    server.close()
    asyncio.run(sampler.close())


@pytest.fixture(scope="module")
def tinker(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`agentrl serve-tinker` over the tiny model, with the 1 s read deadline."""
    from agentrl.tinker_server.server import serve as serve_tinker

    state = tmp_path_factory.mktemp("tinker-chaos")
    with serve_tinker(str(tiny_dir), name="tiny", state_dir=state, read_timeout_s=READ_S) as srv:
        yield int(srv.url.rsplit(":", 1)[1])


def _port(server: CompletionServer) -> int:
    return int(server.url.removesuffix("/v1").rsplit(":", 1)[1])


# ---- helpers -------------------------------------------------------------------------


def call(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def post(port: int, path: str, payload: object) -> tuple[int, bytes]:
    return call(port, "POST", path, json.dumps(payload).encode())


def error_message(status: int, raw: bytes) -> str:
    """The one-line message of a 4xx from either server (serve: error.message; tinker:
    detail); fails on a 5xx or anything else."""
    assert 400 <= status < 500, (status, raw[:300])
    body = json.loads(raw)
    message = body["error"]["message"] if "error" in body else body["detail"]
    assert isinstance(message, str) and message.strip(), body
    assert "\n" not in message and "Traceback" not in message, message
    return message


def small_completion(port: int) -> dict[str, Any]:
    status, raw = post(port, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    assert status == 200, raw
    result: dict[str, Any] = json.loads(raw)
    assert result["usage"]["completion_tokens"] <= 2
    return result


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


def readable(sock: socket.socket, timeout: float) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll `condition` (a sampler counter: it offers no event) until true or timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def start_long_completion(port: int) -> socket.socket:
    """Send a completion that runs to the end of the context; returns its socket."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": None}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


# ---- agentrl serve -------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([-1, 0, 10**12, -(10**12), 2**63, 2**64, 10**30])
    | st.floats()  # NaN and Infinity included: json.dumps writes them, the server refuses
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=10,
)
completion_fields = st.sampled_from(sorted(CompletionRequest.model_fields)) | st.text(max_size=8)
# Bodies that reach the sampler: a good prompt, every other field adversarial.
near_valid = st.fixed_dictionaries(
    {"prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)},
    optional={
        "max_tokens": st.integers(-5, 40) | st.sampled_from([10**12, 2**63]),
        "temperature": st.floats(min_value=-1) | st.just(math.nan) | st.none(),
        "top_p": st.floats() | st.none(),
        "seed": st.integers() | st.none(),
        "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
        "stop_token_ids": st.lists(st.integers(), max_size=3),
        "n": st.integers(-2, 3),
    },
)
# Bodies for the tokenizer routes: the right key, anything in it.
tokenizer_bodies = (
    st.fixed_dictionaries({"tokens": st.lists(json_scalars, max_size=4)})
    | st.fixed_dictionaries({"messages": json_values})
    | st.fixed_dictionaries({"prompt": json_values})
)
bodies = st.binary(max_size=40) | (
    json_values
    | st.dictionaries(completion_fields, json_values, max_size=5)
    | near_valid
    | tokenizer_bodies
).map(lambda v: json.dumps(v).encode())


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/tokenize", "/detokenize"]), body=bodies)
def test_fuzzed_bodies_get_an_answer_or_a_one_line_4xx(
    tiny: tuple[LocalSampler, int], path: str, body: bytes
) -> None:
    _, port = tiny
    status, raw = call(port, "POST", path, body)
    if status != 200:
        error_message(status, raw)


def test_huge_negative_and_non_numbers_are_4xx(tiny: tuple[LocalSampler, int]) -> None:
    sampler, port = tiny
    room = sampler.context_length - 3
    cases: list[tuple[bytes, str]] = [
        (b'{"prompt": [1, 2, 3], "max_tokens": 1e12}', "maximum context length is 512"),
        (json.dumps({"prompt": [1, 2, 3], "max_tokens": room + 1}).encode(), "context length"),
        (json.dumps({"prompt": [1] * 600, "max_tokens": None}).encode(), "context length"),
        (b'{"prompt": [1, 2, 3], "max_tokens": -1}', "max_tokens"),
        (b'{"prompt": [1, 2, 3], "max_tokens": ' + b"9" * 5000 + b"}", "not JSON"),
        (b'{"prompt": [1, 2, 3], "temperature": NaN}', "NaN is not a JSON number"),
        (b'{"prompt": [1, 2, 3], "top_p": Infinity}', "Infinity is not a JSON number"),
        (b'{"prompt": [1, 2, 3], "temperature": 1e-300}', "sampling token 1 failed"),
        (b'{"prompt": [1, 2, 3], "seed": 1e30}', "seed"),
        (b'{"prompt": [1, 2, 3], "seed": 100000000000000000000000}', "64 bits"),
        (b'{"prompt": [-1]}', "non-negative"),
        (b'{"prompt": [100000000000000000000]}', "outside the vocabulary"),
        (b'{"prompt": [1, 2, 3], "max_tokens": "many"}', "max_tokens"),
        (b"[" * 100_000, "not JSON"),
        (b"\xff\xfe", "not JSON"),
    ]
    for body, expected in cases:
        status, raw = call(port, "POST", "/v1/completions", body)
        assert expected in error_message(status, raw), (body[:60], raw[:200])
    for path, payload in [
        ("/detokenize", {"tokens": [10**30]}),
        ("/detokenize", {"tokens": [-1]}),
        ("/tokenize", {"messages": 5}),
        ("/tokenize", {"messages": [{"role": {"x": 1}}]}),
    ]:
        error_message(*post(port, path, payload))
    # null max_tokens: the room the context leaves (here 4 tokens), no more.
    prompt = [1] * (sampler.context_length - 4)
    status, raw = post(port, "/v1/completions", {"prompt": prompt, "max_tokens": None})
    assert status == 200 and 1 <= json.loads(raw)["usage"]["completion_tokens"] <= 4
    small_completion(port)


def test_bad_lengths_and_encodings_are_4xx(tiny: tuple[LocalSampler, int]) -> None:
    _, port = tiny
    for headers, expected_status in [
        ({"Content-Length": str(1 << 40)}, 413),
        ({"Content-Length": "-5"}, 400),
        ({"Content-Length": "12abc"}, 400),
        ({"Transfer-Encoding": "chunked"}, 411),
    ]:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{lines}\r\n{{}}".encode())
            status, raw = read_answer(sock)
        assert status == expected_status, raw
        error_message(status, raw)
    # The stdlib's own rejections (a header line past 64 KiB) are JSON too.
    status, raw = call(port, "GET", "/v1/models", headers={"X-Big": "x" * 70_000})
    error_message(status, raw)
    small_completion(port)


def _slow_client_cases(port: int, path: str) -> None:
    """Headers sent a byte at a time, a body cut short and left open, a body cut short
    and closed: each frees its thread within the read deadline with a 4xx."""
    request = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        start = time.monotonic()
        # A trickle: each byte arrives well within any per-read timeout, forever.
        for byte in request[:-4]:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break  # the server cut us off
            if readable(sock, 0.1):
                break
        status, raw = read_answer(sock)
        assert status == 408 and time.monotonic() - start < 10 * READ_S
        error_message(status, raw)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request + b'{"prompt": [1')  # 13 of 50 bytes, then silence
        status, raw = read_answer(sock)
        assert status == 408, raw
        error_message(status, raw)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request + b'{"prompt": [1')
        sock.shutdown(socket.SHUT_WR)  # the client is done sending: the body is short
        status, raw = read_answer(sock)
        assert status == 400 and "ended after 13 of 50 bytes" in error_message(status, raw)


def test_slow_clients_are_cut_off_at_the_read_deadline(tiny: tuple[LocalSampler, int]) -> None:
    _, port = tiny
    _slow_client_cases(port, "/v1/completions")
    small_completion(port)


def test_a_small_request_overtakes_a_long_one(long_context: tuple[LocalSampler, int]) -> None:
    sampler, port = long_context
    with start_long_completion(port) as long:
        wait_for(lambda: sampler.stats.active == 1)
        small_completion(port)
        # The long one is still decoding and has not answered: it did not block the small.
        assert sampler.stats.active == 1
        assert not readable(long, 0)
    wait_for(lambda: sampler.stats.active == 0)  # closing it cancelled it


def test_a_client_that_disconnects_cancels_its_generation(
    long_context: tuple[LocalSampler, int],
) -> None:
    sampler, port = long_context
    before = sampler.stats
    long = start_long_completion(port)
    wait_for(lambda: sampler.stats.active == 1)
    long.close()
    wait_for(lambda: sampler.stats.active == 0)
    after = sampler.stats
    assert after.cancelled == before.cancelled + 1
    assert after.tokens - before.tokens < sampler.context_length - 3  # cut short
    small_completion(port)


def _burst(port: int, path: str, n: int = 200) -> list[str]:
    """`n` connections opened at the same instant, each one GET; returns the failures."""
    failures: list[str] = []
    start = threading.Barrier(n)

    def one() -> None:
        start.wait()
        try:
            status, _ = call(port, "GET", path, timeout=15)
            if status != 200:
                failures.append(f"HTTP {status}")
        except OSError as e:  # reset, refused, timed out
            failures.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def test_a_burst_of_connections_is_not_dropped(tiny: tuple[LocalSampler, int]) -> None:
    _, port = tiny
    assert _burst(port, "/health") == []
    small_completion(port)


def test_shutdown_with_departed_clients_is_quiet(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Clients that left before their answer (some while waiting, some at shutdown):
    debug lines only, no traceback, no warning."""
    sampler = LocalSampler.for_model(str(tiny_dir))
    server, _ = serve(sampler, model_tokenizer(str(tiny_dir)))
    port = _port(server)
    sampler.pause("keep")  # every completion waits
    caplog.set_level(logging.DEBUG, logger="agentrl")
    socks = [start_long_completion(port) for _ in range(20)]
    wait_for(lambda: sampler.stats.waiting == 20)
    for sock in socks[:10]:
        sock.close()  # gone while waiting: its completion is cancelled
    for sock in socks[10:]:  # reset just before shutdown: the 503 may meet a dead socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    server.close()
    sampler.resume()
    asyncio.run(sampler.close())
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], [r.getMessage() for r in loud]
    _, err = capfd.readouterr()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


# ---- agentrl serve-tinker ------------------------------------------------------------

SESSION = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
TINKER_JSON_ROUTES = [
    "create_session",
    "session_heartbeat",
    "create_model",
    "get_info",
    "optim_step",
    "asample",
    "create_sampling_session",
    "retrieve_future",
    "save_weights",
    "load_weights",
]


@FUZZ
@given(route=st.sampled_from(TINKER_JSON_ROUTES), body=bodies)
def test_tinker_fuzzed_bodies_get_an_answer_or_a_one_line_4xx(
    tinker: int, route: str, body: bytes
) -> None:
    status, raw = call(tinker, "POST", f"/api/v1/{route}", body)
    if status != 200:
        error_message(status, raw)


@FUZZ
@given(body=st.binary(max_size=200))
def test_tinker_fuzzed_protobuf_gets_a_one_line_4xx(tinker: int, body: bytes) -> None:
    headers = {"Content-Type": "application/x-protobuf"}
    status, raw = call(tinker, "POST", "/api/v1/forward_backward", body, headers)
    if status != 200:
        error_message(status, raw)


def test_tinker_huge_negative_and_non_numbers_are_4xx(tinker: int) -> None:
    status, raw = post(tinker, "/api/v1/create_session", SESSION)
    assert status == 200, raw
    session = json.loads(raw)["session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    sample = {"prompt": prompt, "sampling_params": {"max_tokens": 2}, "sampling_session_id": "x"}
    for route, body, expected in [
        ("asample", json.dumps({**sample, "num_samples": 10**12}).encode(), "num_samples"),
        ("asample", json.dumps({**sample, "num_samples": -3}).encode(), "num_samples"),
        ("optim_step", b'{"model_id": "m", "adam_params": {"learning_rate": NaN}}', "NaN"),
        ("create_session", b'{"tags": [], "sdk_version": ' + b"9" * 5000 + b"}", "not JSON"),
        ("get_info", b"[" * 100_000, "not JSON"),
    ]:
        status, raw = call(tinker, "POST", f"/api/v1/{route}", body)
        assert expected in error_message(status, raw), (route, raw[:200])
    # A LoRA rank that would exhaust memory: the model's future fails, the server lives.
    create = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": "tiny",
        "lora_config": {"rank": 10**9},
    }
    status, raw = post(tinker, "/api/v1/create_model", create)
    assert status == 200, raw
    request_id = json.loads(raw)["request_id"]
    status, raw = post(tinker, "/api/v1/retrieve_future", {"request_id": request_id})
    assert status == 200 and "lora rank" in json.loads(raw)["error"], raw
    assert call(tinker, "GET", "/api/v1/healthz")[0] == 200


def test_tinker_slow_clients_and_bursts(tinker: int) -> None:
    _slow_client_cases(tinker, "/api/v1/create_session")
    assert _burst(tinker, "/api/v1/healthz") == []
    status, _ = post(tinker, "/api/v1/create_session", SESSION)
    assert status == 200


def test_a_completion_past_the_request_deadline_is_cancelled_with_504(
    long_context: tuple[LocalSampler, int], tiny_dir: Path
) -> None:
    sampler, _ = long_context
    # A second server over the same sampler, with a half-second deadline.
    server, _ = serve(sampler, model_tokenizer(str(tiny_dir)), request_timeout_s=0.5)
    try:
        before = sampler.stats
        status, raw = post(_port(server), "/v1/completions", {"prompt": [5], "max_tokens": None})
        assert status == 504 and "0.5 s limit" in json.loads(raw)["error"]["message"]
        wait_for(lambda: sampler.stats.active == 0)
        assert sampler.stats.cancelled == before.cancelled + 1
    finally:
        server.close()
