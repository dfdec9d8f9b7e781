"""mini-swe-agent, unmodified, drives an episode through the two endpoints agentrl gives a
harness that runs beside the sandbox: chat completions and exec.

The endpoints are a stdlib fake here (scripted chat.completion replies, commands run with
bash in a temp folder); mini is the real `mini` CLI from .venv-mini (bootstrap.sh makes
it) with agentrl/harnesses/mini_swe_agent on its PYTHONPATH. What mini sends is recorded
and checked, since agentrl's gateway must accept exactly that."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import agentrl

REPO = Path(__file__).resolve().parent.parent
MINI = REPO / ".venv-mini" / "bin" / "mini"
HARNESSES = Path(agentrl.__file__).resolve().parent / "harnesses"
MODEL = "agentrl-policy"
TASK = "Create made.txt holding the word hello, then submit."
TEXT_MODE = ["--model-class", "litellm_textbased", "-c", "mini_textbased.yaml"]
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
CREATE = "echo hello > made.txt"
CONTEXT_LENGTH = (
    "This model's maximum context length is 4096 tokens. However, your messages resulted in "
    "5000 tokens. Please reduce the length of the messages."
)

pytestmark = pytest.mark.skipif(
    not MINI.exists(), reason="no .venv-mini/bin/mini (bash bootstrap.sh --install-only makes it)"
)


@dataclass
class Reply:
    """One scripted answer of the chat endpoint: a status and its JSON body."""

    status: int
    body: dict[str, Any]


@dataclass
class Seen:
    """One request as the fake received it."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def completion(n: int, finish_reason: str, content: str | None, **message: Any) -> Reply:
    return Reply(
        200,
        {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, **message},
                    "finish_reason": finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
        },
    )


def text_reply(n: int, command: str) -> Reply:
    return completion(n, "stop", f"THOUGHT: step {n}.\n\n```mswea_bash_command\n{command}\n```")


def tool_reply(n: int, command: str) -> Reply:
    call = {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "bash", "arguments": json.dumps({"command": command})},
    }
    return completion(n, "tool_calls", f"Step {n}.", tool_calls=[call])


def error(status: int, message: str, code: str | None = None) -> Reply:
    return Reply(status, {"error": {"message": message, "type": "request_error", "code": code}})


@dataclass
class FakeAgentrl:
    """agentrl's chat and exec endpoints for one session, on 127.0.0.1.

    Chat answers the scripted replies in order (403 once they run out, as agentrl does
    when an episode is over); exec runs `bash -c` in `sandbox`, killing the command's
    process group at its timeout."""

    sandbox: Path
    replies: list[Reply]
    exec_budget: int | None = None
    """Exec calls answered before exec refuses with 403; None answers all."""
    sid: str = field(default_factory=lambda: "sess-" + secrets.token_hex(6))
    chats: list[Seen] = field(default_factory=list)
    execs: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen = Seen(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                if self.path == f"/sessions/{fake.sid}/v1/chat/completions":
                    fake.chats.append(seen)
                    reply = fake.replies.pop(0) if fake.replies else error(403, "episode over")
                    self._answer(reply.status, reply.body)
                elif self.path == f"/sessions/{fake.sid}/exec":
                    fake.execs.append(seen)
                    if fake.exec_budget is not None and len(fake.execs) > fake.exec_budget:
                        self._answer(403, error(403, "episode over").body)
                    else:
                        self._answer(200, fake.run(body))
                else:
                    self._answer(404, error(404, f"no route {self.path}").body)

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def run(self, request: dict[str, Any]) -> dict[str, Any]:
        process = subprocess.Popen(
            ["bash", "-c", request["command"]],
            cwd=request["cwd"] or self.sandbox,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=request["timeout"] or 30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return {"output": output, "returncode": None, "timed_out": True}
        return {"output": output, "returncode": process.returncode, "timed_out": False}

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/sessions/{self.sid}"

    def commands(self) -> list[str]:
        """The commands mini ran, without the line that exports its config's `env`."""
        return [s.body["command"].split("\n", 1)[1] for s in self.execs]


@pytest.fixture
def sandbox(tmp_path: Path) -> Path:
    path = tmp_path / "sandbox"
    path.mkdir()
    return path


@pytest.fixture
def serve() -> Iterator[Any]:
    fakes: list[FakeAgentrl] = []

    def start(fake: FakeAgentrl) -> FakeAgentrl:
        fake.thread.start()
        fakes.append(fake)
        return fake

    yield start
    for fake in fakes:
        fake.server.shutdown()
        fake.server.server_close()


@dataclass
class MiniRun:
    returncode: int
    output: str
    seconds: float
    trajectory: dict[str, Any]


def run_mini(fake: FakeAgentrl, tmp_path: Path, *args: str, retries: int | None = 1) -> MiniRun:
    """The real `mini` CLI, unattended and offline, as an agentrl task's command runs it;
    `retries` None keeps mini's own default (10 attempts, 4-60 s apart)."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "task.txt").write_text(TASK)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(agent_dir),
        # The contract agentrl gives a harness process.
        "OPENAI_BASE_URL": f"{fake.root}/v1",
        "OPENAI_API_BASE": f"{fake.root}/v1",
        "OPENAI_API_KEY": fake.sid,
        "AGENTRL_MODEL": MODEL,
        "AGENTRL_TASK": TASK,
        "AGENTRL_TASK_FILE": str(agent_dir / "task.txt"),
        "AGENTRL_AGENT_DIR": str(agent_dir),
        "AGENTRL_EXEC_URL": f"{fake.root}/exec",
        "AGENTRL_HARNESSES": str(HARNESSES),
        # What mini needs on top, to find the environment and to run unattended and offline.
        "PYTHONPATH": str(HARNESSES / "mini_swe_agent"),
        "MSWEA_CONFIGURED": "1",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(agent_dir / "mswea"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    if retries is not None:
        env["MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT"] = str(retries)
    trajectory = agent_dir / "mini.traj.json"
    command = [
        str(MINI),
        "-m", f"openai/{MODEL}",
        "-t", TASK,
        "-y", "--exit-immediately",
        "-o", str(trajectory),
        "--environment-class", "agentrl_mini.SandboxEnvironment",
        *args,
    ]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(
        command,
        cwd=agent_dir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - start
    saved = json.loads(trajectory.read_text()) if trajectory.exists() else {}
    return MiniRun(done.returncode, done.stdout, seconds, saved)


def exit_status(run: MiniRun) -> str:
    return str(run.trajectory.get("info", {}).get("exit_status"))


def check_first_request(fake: FakeAgentrl, keys: set[str]) -> list[dict[str, Any]]:
    """What both modes send first: the model without litellm's `openai/`, the session id as
    the bearer key, no streaming and no sampling parameters; returns its messages."""
    first = fake.chats[0]
    assert first.path == f"/sessions/{fake.sid}/v1/chat/completions"
    assert first.headers["authorization"] == f"Bearer {fake.sid}"
    assert set(first.body) == keys, first.body.keys()
    assert first.body["model"] == MODEL
    messages: list[dict[str, Any]] = first.body["messages"]
    assert [m["role"] for m in messages] == ["system", "user"]
    assert TASK in messages[1]["content"]
    return messages


def test_text_mode_creates_the_file_and_submits(sandbox: Path, tmp_path: Path, serve: Any) -> None:
    first_reply = text_reply(1, CREATE)
    fake = serve(FakeAgentrl(sandbox, [first_reply, text_reply(2, SUBMIT)]))
    run = run_mini(fake, tmp_path, *TEXT_MODE)

    assert run.returncode == 0, run.output
    assert (sandbox / "made.txt").read_text() == "hello\n"
    assert exit_status(run) == "Submitted"
    assert len(fake.chats) == 2
    # One exec reads the sandbox's uname for the prompt, then one per action.
    assert fake.commands()[1:] == [CREATE, SUBMIT]
    assert all(e.body["cwd"] is None and e.body["timeout"] is None for e in fake.execs[1:])
    assert fake.execs[1].body["command"].startswith("export PAGER=cat ")

    sent = check_first_request(fake, {"model", "messages"})  # no tools in text mode
    later = fake.chats[1].body["messages"]
    assert later[:2] == sent  # history only grows
    # The assistant message comes back as the gateway sent it; the observation is a user turn.
    assert later[2] == first_reply.body["choices"][0]["message"]
    assert later[3] == {
        "role": "user",
        "content": "<returncode>0</returncode>\n<output>\n</output>",
    }
    assert len(later) == 4


def test_tool_mode_creates_the_file_and_submits(sandbox: Path, tmp_path: Path, serve: Any) -> None:
    first_reply = tool_reply(1, CREATE)
    # A reasoning model's extra key comes back; null keys do not.
    first_reply.body["choices"][0]["message"] |= {"reasoning_content": "Hm.", "refusal": None}
    fake = serve(FakeAgentrl(sandbox, [first_reply, tool_reply(2, SUBMIT)]))
    run = run_mini(fake, tmp_path)

    assert run.returncode == 0, run.output
    assert (sandbox / "made.txt").read_text() == "hello\n"
    assert exit_status(run) == "Submitted"
    assert len(fake.chats) == 2
    assert fake.commands()[1:] == [CREATE, SUBMIT]

    # One tool, and no tool_choice or parallel_tool_calls.
    sent = check_first_request(fake, {"model", "messages", "tools"})
    (tool,) = fake.chats[0].body["tools"]
    assert tool["type"] == "function" and tool["function"]["name"] == "bash"
    assert tool["function"]["parameters"]["required"] == ["command"]
    assert fake.chats[1].body["tools"] == fake.chats[0].body["tools"]
    later = fake.chats[1].body["messages"]
    assert later[:2] == sent
    echoed = dict(first_reply.body["choices"][0]["message"])
    del echoed["refusal"]
    assert later[2] == echoed
    assert later[3] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": '{\n  "returncode": 0,\n  "output": ""\n}',
    }
    assert len(later) == 4


def test_a_timed_out_command_is_an_observation(sandbox: Path, tmp_path: Path, serve: Any) -> None:
    replies = [tool_reply(1, "echo partial; sleep 5"), tool_reply(2, SUBMIT)]
    fake = serve(FakeAgentrl(sandbox, replies))
    run = run_mini(fake, tmp_path, "-c", "mini.yaml", "-c", "environment.timeout=1")

    assert run.returncode == 0, run.output
    assert fake.execs[1].body["timeout"] == 1
    observation = json.loads(fake.chats[1].body["messages"][3]["content"])
    assert observation["returncode"] == -1
    assert observation["output"] == "partial\n"
    assert observation["exception_info"] == (
        "An error occurred while executing the command: "
        "Command 'echo partial; sleep 5' timed out after 1 seconds"
    )


def test_a_refused_exec_stops_mini(sandbox: Path, tmp_path: Path, serve: Any) -> None:
    # The uname exec is answered; the first action's exec is refused, as after an episode ends.
    fake = serve(FakeAgentrl(sandbox, [tool_reply(1, CREATE)], exec_budget=1))
    run = run_mini(fake, tmp_path)

    assert run.returncode == 1
    assert exit_status(run) == "SandboxExecError"
    assert "exec refused (HTTP 403): episode over" in run.output
    assert len(fake.chats) == 1
    assert not (sandbox / "made.txt").exists()


@pytest.mark.parametrize(
    ("reply", "raised"),
    [
        (error(404, "no such session"), "NotFoundError"),
        (error(400, CONTEXT_LENGTH, "context_length_exceeded"), "ContextWindowExceededError"),
    ],
    ids=["404", "400-context-length"],
)
def test_a_fatal_gateway_answer_stops_mini_at_once(
    reply: Reply, raised: str, sandbox: Path, tmp_path: Path, serve: Any
) -> None:
    fake = serve(FakeAgentrl(sandbox, [reply, tool_reply(2, CREATE)]))
    run = run_mini(fake, tmp_path, retries=None)  # mini's own retry policy

    assert run.returncode == 1
    assert exit_status(run) == raised
    # Not retried: a retry (4 s later) would have got the scripted second reply.
    assert len(fake.chats) == 1


def test_a_403_is_retried_by_mini(sandbox: Path, tmp_path: Path, serve: Any) -> None:
    # litellm maps an OpenAI-style 403 to a plain APIError, which mini retries.
    replies = [error(403, "episode over"), error(403, "episode over")]
    fake = serve(FakeAgentrl(sandbox, replies))
    run = run_mini(fake, tmp_path, retries=2)

    assert run.returncode == 1
    assert exit_status(run) == "APIError"
    assert len(fake.chats) == 2
    assert run.seconds > 4  # tenacity waited between the two attempts
