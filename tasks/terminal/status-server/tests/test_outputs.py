"""The agent left a status service running on 127.0.0.1:8765; the tests only talk to it."""

import json
import urllib.error
import urllib.request

import pytest

BASE = "http://127.0.0.1:8765"


def get(path: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(BASE + path, timeout=5) as reply:
            return reply.status, reply.read(), reply.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        return error.code, error.read(), ""


def test_status_serves_the_settings_and_its_pid() -> None:
    status, body, kind = get("/status")
    assert status == 200 and kind.startswith("application/json")
    data = json.loads(body)
    assert data["name"] == "alpha" and data["level"] == "3"
    assert isinstance(data["pid"], int) and data["pid"] > 1


@pytest.mark.parametrize("path", ["/", "/status/x", "/health"])
def test_other_paths_are_not_found(path: str) -> None:
    assert get(path)[0] == 404
