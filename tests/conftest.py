"""Shared fixtures: a unique run id per test whose containers must all be gone at the end."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest


def labelled_containers(run_id: str) -> list[str]:
    """Ids of every container (running or not) labelled agentrl.run=<run_id>."""
    from agentrl.sandbox.images import docker_client

    client = docker_client()
    try:
        found = client.api.containers(all=True, filters={"label": f"agentrl.run={run_id}"})
        return [c["Id"] for c in found]
    finally:
        client.close()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh run id; the test fails if any container of that run is left behind."""
    from agentrl.sandbox.docker import remove_run
    from agentrl.sandbox.images import docker_client

    run = f"test-{request.node.name[:24]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")
    yield run
    left = labelled_containers(run)
    if left:  # clean up before failing, so one failure leaks nothing
        client = docker_client()
        try:
            remove_run(client, run)
        finally:
            client.close()
    assert left == []
