"""The HTTP layer of agentrl's two servers (`agentrl serve`, `agentrl serve-tinker`).

Standard library only: a ThreadingHTTPServer with a deep listen backlog, whose handler
reads each request within a deadline (a client that trickles bytes lets go of its
thread), bounds bodies, answers every error as one line of JSON, and logs a client that
went away as one debug line instead of a traceback.
"""

from __future__ import annotations

import io
import json
import logging
import select
import socket
import sys
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
LISTEN_BACKLOG = 1024  # a burst of connections waits in the kernel instead of being dropped
READ_TIMEOUT_S = 30.0  # a request must arrive whole within this of its first byte


class HTTPError(Exception):
    """An answer other than 200: its status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def load_json(body: bytes) -> object:
    """Parse a request body: strict JSON (no NaN or Infinity); HTTPError 400 if it is not."""
    try:
        return json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # ValueError: also an int of 5000 digits
        raise HTTPError(400, f"the body is not JSON: {e}".splitlines()[0]) from None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


class QuietHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with a deep listen backlog, for JSONRequestHandler.

    A client that went away (reset, broken pipe, timeout) is one debug log line, not a
    traceback on stderr.
    """

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[JSONRequestHandler],
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.read_timeout_s = read_timeout_s
        super().__init__(address, handler)

    def handle_error(self, request: object, client_address: object) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            log.debug("client %s went away: %r", client_address, error)
        else:
            log.error("a request from %s failed", client_address, exc_info=error)


class JSONRequestHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 keep-alive with bounded reads and one-line JSON errors.

    Subclasses answer GETs in `do_GET` and POSTs in `handle_post(body)`, and say how an
    error looks in `reply_error`. The base reads every body (Content-Length only, at most
    `max_body_bytes`), answers 408 to a request that does not arrive within the server's
    `read_timeout_s` of its first byte, and turns the stdlib's own errors (a bad request
    line, headers too long) into `reply_error` too.
    """

    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn in front of vLLM does
    timeout = 60  # an idle keep-alive connection frees its thread after this long
    max_body_bytes = MAX_BODY_BYTES

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the stdlib's reader, replaced by one with a deadline
        read_s = cast(QuietHTTPServer, self.server).read_timeout_s
        self._reader = _RequestReader(self.connection, float(self.timeout), read_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.next_request()
        # What an answer needs, should the request line itself never arrive.
        self.requestline, self.request_version, self.command = "", self.protocol_version, ""
        super().handle_one_request()  # a read past the deadline ends it (TimeoutError)
        if self._reader.expired:
            self.close_connection = True
            self.reply_error(408, f"the request did not arrive within {self._reader.request_s:g} s")

    def do_POST(self) -> None:
        try:
            body = self._read_body()
        except HTTPError as e:
            self.close_connection = True  # the rest of the body is still on the wire
            self.reply_error(e.status, e.message)
            return
        self.handle_post(body)

    def handle_post(self, body: bytes) -> None:
        self.reply_error(405, f"no POST route {self.path}")

    def reply_error(self, status: int, message: str) -> None:
        self.send_body(status, json.dumps({"error": message}).encode())

    def client_gone(self) -> bool:
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

    def send_body(
        self,
        status: int,
        body: bytes,
        content_type: str | None = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Answer the request; a client that went away meanwhile is a debug line."""
        try:
            self.connection.settimeout(self.timeout)  # a client that never reads is gone too
            self.send_response(status)
            if content_type is not None:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except (ConnectionError, TimeoutError) as e:
            self.close_connection = True
            log.debug("%s went away before its answer: %r", self.address_string(), e)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        self.close_connection = True
        self.reply_error(code, message or HTTPStatus(code).phrase)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise HTTPError(411, "send the body with a Content-Length, not chunked")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= self.max_body_bytes:
            status = 413 if length > self.max_body_bytes else 400
            raise HTTPError(status, f"Content-Length must be 0..{self.max_body_bytes}")
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
