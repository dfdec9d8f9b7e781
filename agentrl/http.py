# Over 400 lines: the request skeleton (App) and the stdlib server that feeds it share one Handler.
"""The HTTP layer of every agentrl server (`agentrl serve`, `serve-tinker`, the gateway,
the viewer), at the bottom so any layer may serve; and free ports to listen on.

An `App` is a table of routes: `(method, path)` -> a handler and the pydantic model its
request is validated into (from the JSON body, or the query string). `App.answer`
is the one request skeleton: find the route, run the app's `before` check, validate,
call, and turn what went wrong into the app's error body: an `HTTPError` carries its
status, any other `AgentRLError` is the client's (400), anything else is a bug (500,
logged). Every error message is one line. A handler returns JSON-able data (200) or a
`Response`.

`Listener` serves an App from the standard library alone: a ThreadingHTTPServer with a
deep listen backlog, HTTP/1.1 keep-alive, bodies by Content-Length only and at most
`App.max_body_bytes`, each request whole within `read_timeout_s` of its first byte
(else 408: a client that trickles bytes lets go of its thread), and a client that went
away logged as one debug line instead of a traceback.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging
import select
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ValidationError

from agentrl.errors import AgentRLError, ConfigError, one_line

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

MAX_BODY_BYTES = 16 << 20
LISTEN_BACKLOG = 1024  # a burst of connections waits in the kernel instead of being dropped
READ_TIMEOUT_S = 30.0  # a request must arrive whole within this of its first byte
POLL_S = 0.1  # how often a request waiting on work elsewhere checks its client is there


class HTTPError(AgentRLError, ValueError):
    """An answer other than 200: its status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client disconnected while its request ran: nobody to answer."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string or a trailing slash
    query: dict[str, str]
    headers: Message
    body: bytes
    client_gone: Callable[[], bool] = lambda: False  # polled by long-running handlers
    params: dict[str, str] = field(default_factory=dict)  # the route's {name} segments


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str | None = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


def json_response(
    payload: object, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(status, json.dumps(payload).encode(), headers=headers or {})


Handler = Callable[[Request, Any], object]


@dataclass(frozen=True)
class Route:
    """A handler, called with the request and its validated `model` (None: no model).

    The model is read from the JSON body, or from the query string with `from_query`.
    """

    handler: Handler
    model: type[BaseModel] | None = None
    from_query: bool = False


class App:
    """Routes and how this server says an error; subclasses fill `routes`.

    A route path may hold `{name}` segments (`/sessions/{id}/finish`); what they match
    is `Request.params`.
    """

    name = "agentrl"  # the Server header
    max_body_bytes = MAX_BODY_BYTES
    idle_timeout_s = 60.0  # an idle keep-alive connection frees its thread after this long

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {}

    def error(self, status: int, message: str) -> Response:
        """This server's error body; `message` is one line."""
        return json_response({"error": message}, status)

    def refused(self, e: AgentRLError) -> Response:
        """The answer to a request that cannot be done (400); an app that shows its users
        the error's `fix` too says so here."""
        return self.error(400, one_line(e.message))

    def before(self, request: Request) -> None:
        """A check every request passes before its route runs (raise HTTPError to refuse)."""

    def answer(self, request: Request) -> Response:
        """The one request skeleton (see the module doc); raises only ClientGone."""
        try:
            self.before(request)
            route, params = self._resolve(request.method, request.path)
            request = replace(request, params=params)
            arg = None
            if route.model is not None:
                data = request.query if route.from_query else json_object(request.body)
                arg = validate(route.model, data)
            out = route.handler(request, arg)
        except ClientGone:
            raise
        except HTTPError as e:
            return self.error(e.status, one_line(e.message))
        except AgentRLError as e:  # what the client asked for cannot be done
            return self.refused(e)
        except Exception as e:  # the request boundary: one failed request, not a dead server
            log.exception("%s %s failed", request.method, request.path)
            return self.error(500, one_line(f"{type(e).__name__}: {e}"))
        return out if isinstance(out, Response) else json_response(out)

    def _resolve(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        route = self.routes.get((method, path))
        if route is not None:
            return route, {}
        parts = path.split("/")
        for (m, pattern), route in self.routes.items():
            want = pattern.split("/")
            if m != method or "{" not in pattern or len(want) != len(parts):
                continue
            params = {w[1:-1]: p for w, p in zip(want, parts, strict=True) if w.startswith("{")}
            if all(w == p or w.startswith("{") for w, p in zip(want, parts, strict=True)):
                return route, params
        raise HTTPError(404, f"no route {method} {path} in {self.name}")


def wait_while_connected(
    request: Request, future: concurrent.futures.Future[T], *, timeout: float | None = None
) -> T:
    """The result of `future` (work on an event loop in another thread, e.g. from
    `asyncio.run_coroutine_threadsafe`) while this request's thread waits. A client that
    goes away cancels it (ClientGone); past `timeout` it is cancelled and TimeoutError
    raised; cancelled where it runs: concurrent.futures.CancelledError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=POLL_S)
        except TimeoutError:
            pass
        if request.client_gone():
            future.cancel()
            raise ClientGone
        if deadline is not None and time.monotonic() > deadline:
            future.cancel()
            raise TimeoutError


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now ("": every interface); whoever binds them
    does so a moment later, so another process may take one first."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:  # all held open at once: never the same port twice
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on `host` now (see `free_ports`)."""
    return free_ports(1, host)[0]


def load_json(body: bytes) -> object:
    """Parse a request body: strict JSON (no NaN or Infinity); HTTPError 400 if it is not."""
    try:
        return json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # ValueError: also an int of 5000 digits
        raise HTTPError(400, f"the body is not JSON: {e}".splitlines()[0]) from None


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; an empty body is {}."""
    if not body.strip():
        return {}
    data = load_json(body)
    if not isinstance(data, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return data


def validate(model: type[M], data: Mapping[str, object]) -> M:
    """`data` as `model`; HTTPError 400 names the unknown fields, else every bad one."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        unknown = [str(x["loc"][0]) for x in errors if x["type"] == "extra_forbidden"]
        if unknown and all(len(x["loc"]) == 1 for x in errors if x["type"] == "extra_forbidden"):
            raise HTTPError(400, f"unknown fields: {', '.join(sorted(unknown))}") from e
        raise HTTPError(400, validation_message(e)) from e


def validation_message(e: ValidationError) -> str:
    """`field: what is wrong; ...` (a ValueError a validator raised: its own words)."""
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "body"
        cause = err.get("ctx", {}).get("error")
        parts.append(f"{where}: {cause if isinstance(cause, ValueError) else err['msg']}")
    return one_line("; ".join(parts))


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


class Listener:
    """Serves `app` on a background thread: `url` (http://host:port, or unix:PATH for a
    listener on the Unix socket `path`), idempotent close()."""

    def __init__(
        self,
        app: App,
        host: str,
        port: int,
        read_timeout_s: float = READ_TIMEOUT_S,
        *,
        path: str | None = None,
    ) -> None:
        self._httpd: _Server | _UnixServer
        try:
            if path is not None:
                self._httpd = _UnixServer(path, app, read_timeout_s)
            else:
                self._httpd = _Server((host, port), app, read_timeout_s)
        except OSError as e:
            where = path or f"{host}:{port}"
            raise ConfigError(
                f"cannot listen on {where}: {e.strerror or e} (--port 0 picks a free one)",
                fix="pick a free port with --port (0 picks one for you)",
            ) from e
        address = self._httpd.server_address
        if isinstance(address, tuple):
            self.url = f"http://{address[0]!s}:{address[1]}"
        else:
            self.url = f"unix:{path}"
        self._closed = False
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"{app.name}-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting and close the socket; requests in flight finish on their own."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)


def _handler(app: App) -> type[_Handler]:
    # The stdlib reads both from the handler class.
    limits = {"timeout": app.idle_timeout_s, "server_version": app.name}
    return type("Handler", (_Handler,), limits)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], app: App, read_timeout_s: float) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s
        super().__init__(address, _handler(app))

    def handle_error(self, request: object, client_address: object) -> None:
        _handle_error(client_address)


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    """The same server on a Unix socket (for a sandbox with no network: the socket is
    mounted into it)."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, path: str, app: App, read_timeout_s: float) -> None:
        self.app = app
        self.read_timeout_s = read_timeout_s
        super().__init__(path, _handler(app))

    def handle_error(self, request: object, client_address: object) -> None:
        _handle_error(client_address)


def _handle_error(client_address: object) -> None:
    """The servers' `handle_error`: a client that went away is a debug line, anything else
    an error with its traceback in the log (the stdlib's default prints to stderr)."""
    error = sys.exc_info()[1]
    if isinstance(error, ConnectionError | TimeoutError):
        log.debug("client %s went away: %r", client_address, error)
    else:
        log.error("a request from %s failed", client_address, exc_info=error)


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive with bounded reads; every answer, errors too, from the App."""

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn in front of vLLM does

    def setup(self) -> None:
        server = cast(_Server | _UnixServer, self.server)
        self.app = server.app
        super().setup()
        if self.connection.family != socket.AF_UNIX:
            # Headers and body leave in two writes: without this, Nagle holds the body back
            # until the client's delayed ACK (~40 ms per keep-alive request).
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.rfile.close()  # the stdlib's reader, replaced by one with a deadline
        idle_s = float(self.app.idle_timeout_s)
        self._reader = _RequestReader(self.connection, idle_s, server.read_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.next_request()
        # What an answer needs, should the request line itself never arrive.
        self.requestline, self.request_version, self.command = "", self.protocol_version, ""
        super().handle_one_request()  # a read past the deadline ends it (TimeoutError)
        if self._reader.expired:
            self.close_connection = True
            message = f"the request did not arrive within {self._reader.request_s:g} s"
            self._send(self.app.error(408, message))

    def do_GET(self) -> None:
        self._serve(b"")

    def do_POST(self) -> None:
        try:
            body = self._read_body()
        except HTTPError as e:
            self.close_connection = True  # the rest of the body is still on the wire
            self._send(self.app.error(e.status, e.message))
            return
        self._serve(body)

    def _serve(self, body: bytes) -> None:
        parts = urlsplit(self.path)
        request = Request(
            method=self.command,
            path=parts.path.rstrip("/") or "/",
            query={k: v[-1] for k, v in parse_qs(parts.query).items()},
            headers=self.headers,
            body=body,
            client_gone=self._client_gone,
        )
        try:
            self._send(self.app.answer(request))
        except ClientGone:
            self.close_connection = True
            log.debug("%s went away: its request was cancelled", self.address_string())

    def _client_gone(self) -> bool:
        """Whether the client closed or reset its connection (polled while it waits)."""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _send(self, response: Response) -> None:
        """Answer the request; a client that went away meanwhile is a debug line."""
        try:
            self.connection.settimeout(self.timeout)  # a client that never reads is gone too
            self.send_response(response.status)
            if response.content_type is not None:
                self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(response.body)))
            for name, value in response.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(response.body)
        except (ConnectionError, TimeoutError) as e:
            self.close_connection = True
            log.debug("%s went away before its answer: %r", self.address_string(), e)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own rejections (a bad request line, headers too long) as the App's."""
        self.close_connection = True
        self._send(self.app.error(code, one_line(message or HTTPStatus(code).phrase)))

    def address_string(self) -> str:
        address = self.client_address
        return str(address[0]) if isinstance(address, tuple) else "unix-socket client"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "send the body with a Content-Length, not chunked")
        limit = self.app.max_body_bytes
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= limit:
            raise HTTPError(413 if length > limit else 400, f"Content-Length must be 0..{limit}")
        body = self.rfile.read(length)
        if len(body) < length:
            raise HTTPError(400, f"the body ended after {len(body)} of {length} bytes")
        return body


class _RequestReader(io.RawIOBase):
    """A connection's reads: up to `idle_s` for a request's first byte, then all of it
    within `request_s`, so a client that trickles bytes (slowloris) or sends less body
    than its Content-Length lets go of its thread."""

    def __init__(self, sock: socket.socket, idle_s: float, request_s: float) -> None:
        self._sock = sock
        self.idle_s = idle_s
        self.request_s = request_s
        self.deadline: float | None = None
        self.expired = False

    def next_request(self) -> None:
        self.deadline, self.expired = None, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        timeout = self.idle_s if self.deadline is None else self.deadline - time.monotonic()
        if timeout <= 0:
            self.expired = True
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(timeout)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            self.expired = self.deadline is not None
            raise
        if self.deadline is None and n:
            self.deadline = time.monotonic() + self.request_s
        return n
