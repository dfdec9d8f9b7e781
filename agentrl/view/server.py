"""`agentrl view`'s HTTP side: the standard library's threading server on 127.0.0.1.

    /                 the page (static/index.html)
    /static/<path>    its scripts, styles and the vendored chart library
    /api/run          the run: files, metrics, summary
    /api/rows         ?file=F&since=N: table rows of a file from row N on
    /api/search       ?file=F&q=TEXT&since=N: rows from N on whose turns hold TEXT
    /api/episode      ?file=F&row=N: one episode, its token texts, grade, branches
    /api/stamp        what changed (the page polls it: live updates)

Every /api answer is JSON; an error is `{"error": ..., "fix": ...}` with status 400
(bad input) or 500 (a bug, logged with its traceback).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mimetypes
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from agentrl.errors import AgentRLError, ConfigError
from agentrl.inference.httpd import log_request_error
from agentrl.view.folder import RunFolder

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


def _int(query: dict[str, list[str]], name: str, default: int | None = None) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise ConfigError(f"missing ?{name}=", fix=f"add {name}=N to the request")
        return default
    try:
        return int(values[0])
    except ValueError:
        raise ConfigError(f"?{name}={values[0]!r} is not an integer", fix=f"{name}=N") from None


def _str(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name)
    if not values:
        raise ConfigError(f"missing ?{name}=", fix=f"add {name}=... to the request")
    return values[0]


def answer(folder: RunFolder, route: str, query: dict[str, list[str]]) -> Any:
    """The JSON body of one /api route."""
    if route == "run":
        return folder.run()
    if route == "rows":
        return folder.rows(_str(query, "file"), _int(query, "since", 0))
    if route == "search":
        return folder.search(_str(query, "file"), query.get("q", [""])[0], _int(query, "since", 0))
    if route == "episode":
        return folder.episode(_str(query, "file"), _int(query, "row"))
    if route == "stamp":
        return folder.stamp()
    raise ConfigError(f"no such route /api/{route}", fix="see agentrl/view/server.py")


class _Handler(BaseHTTPRequestHandler):
    folder: RunFolder  # set on the subclass `serve` makes
    server_version = "agentrl-view"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path.startswith("/api/"):
            self._api(url.path.removeprefix("/api/"), parse_qs(url.query))
        elif url.path in ("/", "/index.html"):
            self._file(STATIC / "index.html")
        elif url.path.startswith("/static/"):
            self._file(STATIC / url.path.removeprefix("/static/"))
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def _api(self, route: str, query: dict[str, list[str]]) -> None:
        try:
            status, body = HTTPStatus.OK, answer(self.folder, route, query)
        except AgentRLError as e:
            status, body = HTTPStatus.BAD_REQUEST, {"error": e.message, "fix": e.fix}
        except Exception as e:  # a bug: logged whole, answered in one line
            log.exception("GET %s", self.path)
            status, body = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": repr(e), "fix": None}
        data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
        self._send(status, data, "application/json")

    def _file(self, path: Path) -> None:
        try:
            resolved = path.resolve()
            resolved.relative_to(STATIC.resolve())  # nothing outside static/
            data = resolved.read_bytes()
        except (ValueError, OSError):
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return
        kind = mimetypes.guess_type(resolved.name)[0] or "application/octet-stream"
        self._send(HTTPStatus.OK, data, kind)

    def _send(self, status: HTTPStatus, data: bytes, kind: str) -> None:
        self.send_response(status)
        textual = kind.startswith("text/") or kind == "application/json"
        self.send_header("Content-Type", f"{kind}; charset=utf-8" if textual else kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(data)  # (or the page went away mid-answer)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        log_request_error(client_address)  # a page closed mid-request prints no traceback


class ViewServer:
    """The viewer of one run folder, serving on `host:port` in a thread (`port` 0 picks
    a free one; `url` says which)."""

    def __init__(self, folder: RunFolder, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"folder": folder})
        try:
            self.httpd = _Server((host, port), handler)
        except OSError as e:
            raise ConfigError(
                f"cannot serve on {host}:{port}: {e.strerror or e}",
                fix="pick another --port (0 picks a free one)",
            ) from None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}/"

    def start(self) -> ViewServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="agentrl-view")
        self._thread.daemon = True
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> ViewServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
