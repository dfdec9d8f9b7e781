"""Shared fixtures: a unique run id per test whose containers must all be gone at the end,
a tiny randomly initialised Llama for learner tests that need no real model, and
`agentrl serve-tinker` serving it. And the suite's time guard: a test not marked `slow`
or `e2e` fails when its call takes more than `UNMARKED_LIMIT_S`.

The suite runs in two pytest-xdist workers, one test file at a time each, the files with
the most tests first (pyproject.toml addopts: `-n 2 --dist loadfile`; `-n 0` runs it in one
process). Files once went out in name order, because pty shells crashed in their fork in a
worker that had run other files first (faulthandler: Segmentation fault in pty.fork, in the
child): Python run in a forked child of a process holding torch and the rest. Nothing forks
that way any more (`agentrl.sandbox.shell.spawn_on_pty`, `sigint_as_a_terminal_sends`), and
name order left one worker idle for minutes at the end (19:47 against 15:48 here)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from agentrl.sandbox.base import Shell
    from agentrl.tinker_server.server import TinkerServer

SMOLLM2_VOCAB = 49152  # the tiny model shares the embedded tokenizer's vocabulary
UNMARKED_LIMIT_S = 60.0  # the whole suite must stay within 15 minutes on 2 cores


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.corpus(*local_paths)`: the test needs that genuine material
    (agentrl/corpus.py says where it is looked for). Absent, it skips and says why; under
    CI ($AGENTRL_REQUIRE_CORPUS) it fails: there the corpus proofs never skip, except on
    material a manifest marks `pending` (recorded, not yet added to shared/corpus)."""
    import os

    from agentrl.corpus import REQUIRE_ENV, missing, missing_reason, pending

    marker = item.get_closest_marker("corpus")
    if marker is None:
        return
    reason = missing_reason(list(marker.args))
    if reason is None:
        return
    if set(missing(list(marker.args))) <= pending():
        pytest.skip(f"pending (recorded in tests/corpus*.json, not yet in shared/corpus): {reason}")
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{reason}; {REQUIRE_ENV} is set, so the corpus must be present")
    pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Fail a passing test that is not marked slow or e2e when its call ran over the limit:
    a slow test must say so, so the suite's budget is spent on purpose."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or call.duration <= UNMARKED_LIMIT_S:
        return
    if item.get_closest_marker("slow") or item.get_closest_marker("e2e"):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"took {call.duration:.0f} s, over the {UNMARKED_LIMIT_S:g} s allowed a test not "
        "marked slow or e2e: make it cheaper, or mark it @pytest.mark.slow"
    )


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 64, 512 positions) saved as a model folder, with the
    embedded SmolLM2 tokenizer beside it (whose vocabulary it shares)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.inference.embedded import load_tokenizer

    config = LlamaConfig(
        vocab_size=SMOLLM2_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(config).save_pretrained(path)
    load_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tinker_server(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TinkerServer]:
    """`agentrl serve-tinker` in this process on 127.0.0.1, serving the tiny model as
    base_model "tiny"; clients that close their session free its model slots."""
    from agentrl.tinker_server.server import serve

    with pytest.MonkeyPatch.context() as env:
        env.setenv("TINKER_TELEMETRY", "0")
        env.setenv("NO_PROXY", "127.0.0.1,localhost")
        state = tmp_path_factory.mktemp("tinker-state")
        with serve(str(tiny_dir), name="tiny", state_dir=state, max_models=3) as srv:
            yield srv


def bash_block(command: str) -> str:
    """A reply of a `bash_block` task's policy: `command` in one ```bash block."""
    return f"```bash\n{command}\n```\n"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium through Playwright, for the viewer's page tests."""
    from playwright.sync_api import sync_playwright

    from agentrl.tools.chromium import chromium_path

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path())
        yield browser
        browser.close()


def labelled_containers(run_id: str) -> list[str]:
    """Ids of every container (running or not) labelled agentrl.run=<run_id>."""
    from agentrl.sandbox.images import docker_client

    client = docker_client()
    try:
        found = client.api.containers(all=True, filters={"label": f"agentrl.run={run_id}"})
        return [c["Id"] for c in found]
    finally:
        client.close()


def labelled_images(run_id: str) -> list[str]:
    """Ids of every image labelled agentrl.run=<run_id>: the run's snapshots and INIT states."""
    from agentrl.sandbox.images import docker_client

    client = docker_client()
    try:
        return [i["Id"] for i in client.api.images(filters={"label": f"agentrl.run={run_id}"})]
    finally:
        client.close()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh run id; the test fails if any container of that run is left behind. The
    run's snapshots a test keeps (replay) are removed after it, so the suite leaves the
    engine as it found it; tests about snapshot retention check `labelled_images`."""
    from agentrl.sandbox.docker import remove_run
    from agentrl.sandbox.images import docker_client

    run = f"test-{request.node.name[:24]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")
    yield run
    left = labelled_containers(run)
    if left or labelled_images(run):  # clean up before failing, so one failure leaks nothing
        client = docker_client()
        try:
            remove_run(client, run, snapshots=True)
        finally:
            client.close()
    assert left == []


def read_until(shell: Shell, pattern: bytes, timeout: float) -> re.Match[bytes]:
    """Read until `pattern` shows up; TimeoutError if it does not within `timeout` s."""
    seen, deadline = b"", time.monotonic() + timeout
    while (found := re.search(pattern, seen)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pattern!r} not in {seen[-300:]!r}")
        seen += shell.read(0.1)
    return found


def sigint_as_a_terminal_sends(argv: list[str]) -> list[str]:
    """`argv` for a child the test sends Ctrl-C: run by a Python that first puts SIGINT back
    to its default, then execs it (so Python there installs its KeyboardInterrupt
    handler). A suite started in the background (`pytest &` in a script, nohup) runs with
    SIGINT ignored, the child inherits that, and Python then leaves it ignored: the child
    never sees the test's Ctrl-C.

    Not a `preexec_fn`: that runs Python in the forked child before exec, and in a worker
    that has loaded torch, pyarrow and the rest it crashed there with SIGSEGV (faulthandler
    showed the child in `_execute_child`), late in full suites."""
    import sys

    reset = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", reset, *argv]
