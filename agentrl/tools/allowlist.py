"""The browser tool's URL allow-list: origins and file-path prefixes a page may load.

Enforced twice by the tool: `goto` and every request the page makes pass through a
route that asks `permits`, and the context's proxy lets only `bypass` through, which
catches what routes cannot see (redirect hops, websockets).
"""

from __future__ import annotations

import posixpath
import re
from urllib.parse import unquote, urlsplit

from agentrl.errors import ConfigError


class AllowList:
    """Origins (`http://127.0.0.1:8123`) and file-path prefixes (`file:///srv/site`)."""

    def __init__(self, entries: list[str]) -> None:
        self.entries = list(entries)
        self.origins: set[str] = set()
        self.dirs: list[str] = []
        for entry in entries:
            parts = urlsplit(entry)
            if parts.scheme == "file" and parts.path.startswith("/") and not parts.netloc:
                self.dirs.append(posixpath.normpath(unquote(parts.path)).rstrip("/") + "/")
            elif (origin := origin_of(entry)) and parts.path in ("", "/") and not parts.query:
                self.origins.add(origin)
            else:
                raise ConfigError(
                    f"allowed origin {entry!r} is neither scheme://host[:port] "
                    "nor file:///directory",
                    fix="e.g. allowed_origins: [http://127.0.0.1:8123, file:///srv/site]",
                )

    def permits(self, url: str) -> bool:
        """May the page load `url`? data:, blob: and about: never leave the browser."""
        parts = urlsplit(url)
        if parts.scheme == "file":
            path = posixpath.normpath(unquote(parts.path)) + "/"
            return parts.netloc in ("", "localhost") and any(path.startswith(d) for d in self.dirs)
        if parts.scheme in ("data", "blob", "about"):
            return True
        return origin_of(url) in self.origins

    def refusal(self, url: str) -> str | None:
        """Why `goto(url)` is refused, or None."""
        if re.search(r"[\\\x00-\x20\x7f]", url):  # parsed differently by Python and Chromium
            return f"refused: malformed URL {url[:100]!r}"
        if urlsplit(url).scheme not in ("http", "https", "file"):
            return f"refused: only http(s) and file URLs can be opened, not {url[:100]!r}"
        if not self.permits(url):
            return f"refused: {url[:200]} is outside the allowed origins ({self})"
        return None

    @property
    def bypass(self) -> str:
        """The proxy bypass list: host:port of each allowed origin."""
        return ",".join(o.split("://", 1)[1] for o in sorted(self.origins))

    def __str__(self) -> str:
        return ", ".join(self.entries) or "none: this task allows no sites"


def origin_of(url: str) -> str | None:
    """scheme://host:port with the default port filled in; ws(s) counts as http(s)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc:
        return None
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{scheme}://{host}:{port}"


def home(url: str) -> str:
    """What a lone start_url allows: its origin, or its directory for a file."""
    if urlsplit(url).scheme == "file":
        return "file://" + posixpath.dirname(urlsplit(url).path)
    return origin_of(url) or url
