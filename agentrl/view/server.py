"""`agentrl view`'s HTTP side: an `App` on agentrl's own stdlib HTTP layer
(`agentrl.http`: keep-alive, bounded reads, a page that went away logged as a
debug line), on 127.0.0.1.

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

import json
import mimetypes
from pathlib import Path
from typing import Any

from agentrl.errors import AgentRLError, ConfigError
from agentrl.http import App, Listener, Request, Response, Route
from agentrl.view.folder import RunFolder

STATIC = Path(__file__).parent / "static"
NO_STORE = {"Cache-Control": "no-store"}


def _int(query: dict[str, str], name: str, default: int | None = None) -> int:
    value = query.get(name)
    if not value:
        if default is None:
            raise ConfigError(f"missing ?{name}=", fix=f"add {name}=N to the request")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"?{name}={value!r} is not an integer", fix=f"{name}=N") from None


def _str(query: dict[str, str], name: str) -> str:
    value = query.get(name)
    if not value:
        raise ConfigError(f"missing ?{name}=", fix=f"add {name}=... to the request")
    return value


def _json(body: Any, status: int = 200) -> Response:
    data = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
    return Response(status, data, "application/json; charset=utf-8", NO_STORE)


class ViewApp(App):
    """The viewer's routes over one run folder."""

    name = "agentrl-view"

    def __init__(self, folder: RunFolder) -> None:
        super().__init__()
        self.folder = folder
        api = {
            "run": self._run,
            "rows": self._rows,
            "search": self._search,
            "episode": self._episode,
            "stamp": self._stamp,
            "{route}": self._no_route,  # tried after the exact paths
        }
        self.routes = {("GET", f"/api/{name}"): Route(call) for name, call in api.items()}
        for path in ("/", "/index.html"):
            self.routes[("GET", path)] = Route(self._page)
        for pattern in ("/static/{a}", "/static/{a}/{b}"):  # app.js, vendor/uPlot.iife.min.js
            self.routes[("GET", pattern)] = Route(self._static)

    def _run(self, r: Request, _: None) -> Response:
        return _json(self.folder.run())

    def _rows(self, r: Request, _: None) -> Response:
        return _json(self.folder.rows(_str(r.query, "file"), _int(r.query, "since", 0)))

    def _search(self, r: Request, _: None) -> Response:
        file, since = _str(r.query, "file"), _int(r.query, "since", 0)
        return _json(self.folder.search(file, r.query.get("q", ""), since))

    def _episode(self, r: Request, _: None) -> Response:
        return _json(self.folder.episode(_str(r.query, "file"), _int(r.query, "row")))

    def _stamp(self, r: Request, _: None) -> Response:
        return _json(self.folder.stamp())

    def _no_route(self, r: Request, _: None) -> Response:
        raise ConfigError(
            f"no such route /api/{r.params['route']}", fix="see agentrl/view/server.py"
        )

    def _page(self, r: Request, _: None) -> Response:
        return _static_file(STATIC / "index.html")

    def _static(self, r: Request, _: None) -> Response:
        return _static_file(STATIC.joinpath(*r.params.values()))

    def error(self, status: int, message: str) -> Response:
        return _json({"error": message, "fix": None}, status)

    def refused(self, e: AgentRLError) -> Response:
        return _json({"error": e.message, "fix": e.fix}, 400)


def _static_file(path: Path) -> Response:
    """A file of static/ (nothing outside it), or 404."""
    try:
        resolved = path.resolve()
        resolved.relative_to(STATIC.resolve())
        data = resolved.read_bytes()
    except (ValueError, OSError):
        return Response(404, b"not found\n", "text/plain; charset=utf-8", NO_STORE)
    kind = mimetypes.guess_type(resolved.name)[0] or "application/octet-stream"
    textual = kind.startswith("text/") or kind == "application/json"
    return Response(200, data, f"{kind}; charset=utf-8" if textual else kind, NO_STORE)


class ViewServer:
    """The viewer of one run folder, serving on `host:port` in a thread from the moment it
    is made (`port` 0 picks a free one; `url` says which)."""

    def __init__(self, folder: RunFolder, host: str = "127.0.0.1", port: int = 0) -> None:
        self._listener = Listener(ViewApp(folder), host, port)
        self.url = self._listener.url + "/"

    def close(self) -> None:
        self._listener.close()

    def __enter__(self) -> ViewServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
