"""kvserver.py serves the key-value API on 127.0.0.1; the tests start it themselves."""

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

SERVER = "/app/kvserver.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def call(base: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(base + path, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(["python3", SERVER, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if call(url, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not answer /health in 15 s"
            time.sleep(0.1)
        yield url
    finally:
        server.kill()
        server.wait(timeout=10)


def test_health(base: str) -> None:
    assert call(base, "GET", "/health") == (200, b"ok")


def test_put_get_replace(base: str) -> None:
    assert call(base, "GET", "/kv/alpha")[0] == 404
    assert call(base, "PUT", "/kv/alpha", b"one")[0] == 201
    assert call(base, "GET", "/kv/alpha") == (200, b"one")
    assert call(base, "PUT", "/kv/alpha", b"uno")[0] == 200
    assert call(base, "GET", "/kv/alpha") == (200, b"uno")


def test_values_are_bytes(base: str) -> None:
    blob = bytes(range(256)) * 4
    assert call(base, "PUT", "/kv/blob.bin", blob)[0] == 201
    assert call(base, "GET", "/kv/blob.bin") == (200, blob)


def test_delete(base: str) -> None:
    call(base, "PUT", "/kv/doomed", b"x")
    assert call(base, "DELETE", "/kv/doomed")[0] == 204
    assert call(base, "GET", "/kv/doomed")[0] == 404
    assert call(base, "DELETE", "/kv/doomed")[0] == 404


def test_list_keys_sorted(base: str) -> None:
    for key in ("zeta", "b_2", "a-1"):
        call(base, "PUT", f"/kv/{key}", key.encode())
    request = urllib.request.Request(base + "/kv")
    with urllib.request.urlopen(request, timeout=5) as reply:
        assert reply.status == 200
        assert reply.headers.get_content_type() == "application/json"
        keys = json.loads(reply.read())
    assert keys == sorted(keys)
    assert {"zeta", "b_2", "a-1", "alpha", "blob.bin"} <= set(keys)


def test_unknown_paths(base: str) -> None:
    assert call(base, "GET", "/nothing")[0] == 404
    assert call(base, "POST", "/kv/alpha", b"y")[0] in (404, 405)


def test_concurrent_clients(base: str) -> None:
    errors: list[str] = []

    def client(n: int) -> None:
        for i in range(10):
            key = f"c{n}-{i}"
            if call(base, "PUT", f"/kv/{key}", key.encode())[0] != 201:
                errors.append(key)
            elif call(base, "GET", f"/kv/{key}") != (200, key.encode()):
                errors.append(key)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
