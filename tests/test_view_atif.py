"""`agentrl view` opens ATIF trajectories another tool wrote (issue 43): a .json file or a
folder of them is read into a view folder of its own (`agentrl.view.imported`), and the
page shows each document's opening steps as the task prompt and its agent steps as turns.
The genuine one is the OpenAgents qa-runner's published sample (tests/corpus-atif.json);
another is written here with the `atif` package's own models, as a third tool would."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import atif
import pytest
from clirun import agentrl

from agentrl import corpus
from agentrl.view.folder import RunFolder
from agentrl.view.imported import import_atif, is_foreign
from agentrl.view.server import ViewServer

MANIFEST = corpus.manifest("corpus-atif.json")
(LOGIN,) = MANIFEST["documents"]
DOCS_IMAGE = Path(__file__).parent.parent / "docs" / "images" / "viewer-atif.png"


def _third_tool_document() -> dict[str, Any]:
    """Two agent steps with token ids (the second's logprobs do not align: shown as 0),
    two tool calls in one step, a user message between them."""
    steps = [
        atif.Step(step_id=1, source="system", message="You are a shell agent."),
        atif.Step(step_id=2, source="user", message="Count the files."),
        atif.Step(
            step_id=3,
            source="agent",
            message="Listing and counting.",
            tool_calls=[
                atif.ToolCall(tool_call_id="a", function_name="ls", arguments={"path": "."}),
                atif.ToolCall(tool_call_id="b", function_name="wc", arguments={"path": "."}),
            ],
            observation=atif.Observation(
                results=[
                    atif.ObservationResult(source_call_id="a", content="x y"),
                    atif.ObservationResult(source_call_id="b", content="2"),
                ]
            ),
            metrics=atif.Metrics(
                prompt_token_ids=[5, 6, 7], completion_token_ids=[8, 9], logprobs=[-0.5, -0.25]
            ),
        ),
        atif.Step(step_id=4, source="user", message="And the hidden ones?"),
        atif.Step(
            step_id=5,
            source="agent",
            message="Two, none hidden.",
            metrics=atif.Metrics(completion_token_ids=[10, 11, 12], logprobs=[-1.0]),
        ),
    ]
    doc = atif.Trajectory(
        schema_version="ATIF-v1.8",
        session_id="count-1",
        agent=atif.Agent(name="some-agent", version="2.0"),
        steps=steps,
        final_metrics=atif.FinalMetrics(extra={"reward": 1.0}),
    )
    return doc.to_json_dict()


def test_another_tools_document_becomes_turns_and_keeps_its_tokens(tmp_path: Path) -> None:
    path = tmp_path / "count.json"
    path.write_text(json.dumps(_third_tool_document()))
    assert is_foreign(path) and is_foreign(tmp_path)
    folder = RunFolder(import_atif(path))
    folder.refresh()
    assert folder.rows("train")["total"] == 1
    ep = folder.episode("train", 0)
    t = ep["trajectory"]
    assert ep["prompt_text"] == "[system] You are a shell agent.\n\n[user] Count the files."
    assert [turn["action"] for turn in t["turns"]] == ["Listing and counting.", "Two, none hidden."]
    assert t["turns"][0]["tool_call"] == {"name": "ls", "arguments": {"path": "."}}
    assert t["turns"][0]["observation"] == "[ls] x y\n[wc] 2\n[user] And the hidden ones?"
    assert (t["prompt_ids"], t["response_ids"]) == ([5, 6, 7], [8, 9, 10, 11, 12])
    assert t["logprobs"] == [-0.5, -0.25, 0.0, 0.0, 0.0]  # the second step's do not align
    assert (t["reward"], t["task"], t["group_id"]) == (1.0, "some-agent", "count-1")
    assert ep["replay"] == [] and "imported from" in (ep["token_note"] or "")


def test_what_is_not_atif_is_refused_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "notes.json"
    bad.write_text('{"steps": []}')
    done = agentrl("view", bad, "--export", tmp_path / "out")
    assert done.returncode == 1
    assert "not an ATIF trajectory" in done.stderr and "fix:" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def login() -> Path:
    path = corpus.find(LOGIN["local_path"])
    assert path is not None
    assert hashlib.sha256(path.read_bytes()).hexdigest() == LOGIN["sha256"]
    return path


@pytest.mark.corpus(LOGIN["local_path"])
def test_a_genuine_atif_file_opens_through_the_cli(login: Path, tmp_path: Path) -> None:
    """The real CLI: `agentrl view FILE --export DIR` reads it and writes the page."""
    done = agentrl("view", login, "--export", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "exported 1 episodes" in done.stdout
    assert (tmp_path / "out" / "index.html").is_file()


@pytest.mark.corpus(LOGIN["local_path"])
def test_the_page_shows_the_genuine_documents_steps(
    login: Path, browser: Any, tmp_path: Path
) -> None:
    """In Chromium: the episode shows the document's user step as the task prompt and one
    card per agent step with its tool call. With AGENTRL_DOCS_IMAGES=1 its screenshot
    replaces the one docs/viewer.md shows."""
    doc = json.loads(login.read_text())
    agent_steps = [s for s in doc["steps"] if s["source"] == "agent"]
    folder = RunFolder(import_atif(login))
    folder.refresh()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    with ViewServer(folder) as server:
        page.goto(server.url + "#/episode/train/0")
        page.wait_for_selector("#task-prompt pre")
        prompt = page.text_content("#task-prompt pre") or ""
        assert prompt.startswith("[user] Verify the login page works")
        cards = page.locator("#turns .turn").count()
        assert cards == len(agent_steps)
        text = page.text_content("#turns") or ""
        assert agent_steps[0]["tool_calls"][0]["function_name"] in text
        shot = DOCS_IMAGE if os.environ.get("AGENTRL_DOCS_IMAGES") == "1" else tmp_path / "a.png"
        page.screenshot(path=str(shot))
    page.close()
    assert errors == []
