"""The gateway's HTTP side: OpenAI-compatible routes in front of the episodes' recorders.

Every episode of an external agent gets a session: an unguessable id, which is both a
path (`/sessions/{sid}/v1/...`, the base URL its harness is given) and an API key (a
harness that cannot change its path sends `Authorization: Bearer {sid}` to `/v1/...`).
Concurrent harnesses never mix: a session reaches only its own episode.

Routes: `POST .../v1/chat/completions` (tools, streaming), `POST .../v1/completions`,
`GET .../v1/models`, `POST /sessions/{sid}/exec` (a command in the episode's sandbox,
for harnesses beside it), `GET /health`. Requests arrive on server threads; each is
handed to the event loop its episode runs on, and cancelled if its client goes away.
Errors have OpenAI's body. One gateway serves a process (`shared`), on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Coroutine
from http import HTTPStatus
from typing import Any

from agentrl import scratch
from agentrl.gateway import wire
from agentrl.gateway.recorder import OVER, Recorder
from agentrl.http import (
    App,
    HTTPError,
    Listener,
    Request,
    Response,
    Route,
    json_response,
    wait_while_connected,
)

log = logging.getLogger(__name__)

MODEL_NAME = "agentrl-policy"
"""What /v1/models lists; a request may name any model: it gets the episode's policy."""
HOST_ENV, PORT_ENV = "AGENTRL_GATEWAY_HOST", "AGENTRL_GATEWAY_PORT"
SANDBOX_SOCKET_DIR = "/run/agentrl-gateway"
"""Where a Docker sandbox of a harness that runs inside it has the gateway's socket."""
SOCKET_NAME = "gateway.sock"


class Gateway(App):
    """The gateway's routes and its session table; `url` is where it listens."""

    name = "agentrl-gateway"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__()
        self.sessions: dict[str, Recorder] = {}
        self._lock = threading.Lock()
        chat = Route(self._chat, wire.ChatRequest)
        complete = Route(self._complete, wire.CompletionRequest)
        self.routes = {
            ("GET", "/health"): Route(lambda r, _: Response(200, b"", None)),
            ("GET", "/v1/models"): Route(self._models),
            ("GET", "/sessions/{sid}/v1/models"): Route(self._models),
            ("POST", "/v1/chat/completions"): chat,
            ("POST", "/sessions/{sid}/v1/chat/completions"): chat,
            ("POST", "/v1/completions"): complete,
            ("POST", "/sessions/{sid}/v1/completions"): complete,
            ("POST", "/sessions/{sid}/exec"): Route(self._exec, wire.ExecRequest),
        }
        self._listener = Listener(self, host, port)
        self.url = self._listener.url
        self._unix: Listener | None = None
        self._socket_dir: str | None = None

    def open(self, recorder: Recorder) -> str:
        """A new session for `recorder`; returns its id."""
        sid = secrets.token_urlsafe(18)
        with self._lock:
            self.sessions[sid] = recorder
        return sid

    def close_session(self, sid: str) -> None:
        with self._lock:
            self.sessions.pop(sid, None)

    def socket_dir(self) -> str:
        """A folder holding the gateway's Unix socket (`gateway.sock`), listening from the
        first call on: mounted into Docker sandboxes whose harness runs inside."""
        with self._lock:
            if self._socket_dir is None:
                folder = scratch.make("gateway")
                folder.chmod(0o755)
                path = folder / SOCKET_NAME
                self._unix = Listener(self, "", 0, path=str(path))
                path.chmod(0o666)  # whatever user the sandbox runs as
                self._socket_dir = str(folder)
            return self._socket_dir

    def close(self) -> None:
        self._listener.close()
        if self._unix is not None:
            self._unix.close()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def error(self, status: int, message: str) -> Response:
        """OpenAI's error body."""
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
        code = "context_length_exceeded" if "context_length_exceeded" in message else None
        error = {
            "message": message,
            "type": kind.get(status, HTTPStatus(status).phrase.lower().replace(" ", "_")),
            "param": None,
            "code": code,
        }
        return json_response({"error": error}, status)

    # -- routes -------------------------------------------------------------------------

    def _models(self, request: Request, _: None) -> object:
        model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "agentrl"}
        return {"object": "list", "data": [model]}

    def _chat(self, request: Request, body: wire.ChatRequest) -> Response:
        session = self._session(request)
        answer = self._on_loop(request, session, session.chat_completion(body))
        if body.stream:
            include = bool((body.stream_options or {}).get("include_usage"))
            return Response(200, wire.chat_stream(answer, include), "text/event-stream")
        return json_response(answer)

    def _complete(self, request: Request, body: wire.CompletionRequest) -> Response:
        session = self._session(request)
        answer = self._on_loop(request, session, session.completion(body))
        if body.stream:
            return Response(200, wire.completion_stream(answer), "text/event-stream")
        return json_response(answer)

    def _exec(self, request: Request, body: wire.ExecRequest) -> object:
        session = self._session(request)
        return self._on_loop(request, session, session.exec(body))

    # -- plumbing -------------------------------------------------------------------------

    def _session(self, request: Request) -> Recorder:
        sid = request.params.get("sid")
        if sid is None:  # the API-key form
            auth = str(request.headers.get("Authorization") or "")
            sid = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
            if sid is None:
                raise HTTPError(
                    401, "no session: use the base URL /sessions/<id>/v1 or the API key"
                )
        with self._lock:
            session = self.sessions.get(sid)
        if session is None:
            raise HTTPError(401, "unknown or finished session (its episode is over)")
        return session

    def _on_loop(
        self, request: Request, session: Recorder, call: Coroutine[Any, Any, dict[str, Any]]
    ) -> dict[str, Any]:
        """Run `call` on the episode's loop; cancelled when the client goes away."""
        try:
            future = asyncio.run_coroutine_threadsafe(call, session.loop)
        except RuntimeError:  # the loop is closed: the run is over
            call.close()
            raise HTTPError(OVER, "the episode is over: stop the agent") from None
        try:
            return wait_while_connected(request, future)
        except concurrent.futures.CancelledError:  # RUN ended while it was answered
            raise HTTPError(OVER, "the episode is over: stop the agent") from None


_shared: Gateway | None = None
_shared_lock = threading.Lock()


def shared() -> Gateway:
    """This process's gateway, started on first use (on $AGENTRL_GATEWAY_HOST and
    $AGENTRL_GATEWAY_PORT when set, else 127.0.0.1 and a free port)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            host = os.environ.get(HOST_ENV) or "127.0.0.1"
            port = int(os.environ.get(PORT_ENV) or 0)
            _shared = Gateway(host, port)
            atexit.register(_shared.close)  # its socket folder too
            log.info("agent gateway listening at %s", _shared.url)
        return _shared
