"""The browser tool: Playwright driving Debian's Chromium, one browser context per episode.

Owns three things. Launching Chromium: one process per event loop, shared by the tools on
that loop through a reference count (a context costs ~0.5 s, a launch ~2 s); the last
`close()` stops it, and an `atexit` backstop kills any Chromium this process launched.
The URL allow-list, enforced twice: `goto` and every request the page makes pass through
a route that refuses other origins, and each context sends its traffic through a proxy
that refuses every connection (a bound, never-listening port) with only the allowed
origins bypassing it, which catches what routes cannot see (redirect hops, websockets).
The observation: a walk of the DOM that writes one line per heading, text run and
interactive element, giving each interactive element a ref (`[3] button "Sign in"`)
stored as a `data-agentrl-ref` attribute, so `click`/`type` find it with a locator.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import posixpath
import re
import shutil
import signal
import socket
import weakref
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from playwright.async_api import (
    Browser,
    BrowserContext,
    Locator,
    Page,
    Playwright,
    Request,
    Route,
    async_playwright,
)
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeoutError
from pydantic import BaseModel

from agentrl.errors import BrowserError, ConfigError
from agentrl.sandbox.base import Sandbox
from agentrl.sandbox.procs import pid_alive
from agentrl.tools.base import Observation

ACTIONS = ("goto", "click", "type", "press", "scroll", "back", "read")
_ARGUMENTS = ("action", "url", "ref", "text", "submit", "key", "direction")
# Chromium's own background traffic (updates, sync, metrics, pings) stays off.
_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--disable-domain-reliability",
    "--disable-breakpad",
    "--no-pings",
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
]
_OWNER = "--agentrl-owner="  # a label on the command line: which process launched this Chromium
_MAX_TEXT = 1000  # characters of one text line
_ERROR_PAGE = re.compile(r"^chrome-error://")


class _Refused(Exception):
    """An agent mistake; `__call__` turns it into an error observation (never escapes)."""


def chromium_path() -> str:
    """The Chromium to launch: $AGENTRL_CHROMIUM, else `chromium` on PATH."""
    path = os.environ.get("AGENTRL_CHROMIUM") or shutil.which("chromium")
    path = path or shutil.which("chromium-browser")
    if not path or not os.access(path, os.X_OK):
        raise BrowserError(f"no Chromium executable found (looked for {path or 'chromium'})")
    debian = Path("/usr/lib/chromium/chromium")
    if Path(path).resolve() == Path("/usr/bin/chromium").resolve() and debian.exists():
        # Debian's wrapper script adds API keys and remote-extension flags; the binary does not.
        return str(debian)
    return path


def _reap(*, orphans_only: bool) -> None:
    """SIGKILL the Chromiums this process launched (or those whose launcher is dead)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        owner = next((a[len(_OWNER) :] for a in argv if a.startswith(_OWNER.encode())), b"")
        if not owner.isdigit():
            continue
        keep = pid_alive(int(owner)) if orphans_only else int(owner) != me
        if keep:
            continue
        pid = int(entry.name)
        with contextlib.suppress(OSError):  # Playwright makes Chromium a process-group leader
            if os.getpgid(pid) == pid and pid != os.getpgrp():
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


class _Chromium:
    """One Chromium per event loop, shared by reference count; the last release stops it."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._users = 0
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._dead_port: socket.socket | None = None
        self.proxy = ""
        """A proxy that refuses every connection: where traffic to other origins ends."""

    async def acquire(self) -> Browser:
        async with self._lock:
            if self._browser is None or not self._browser.is_connected():
                await self._stop()
                self._browser = await self._start()
            self._users += 1
            return self._browser

    async def release(self) -> None:
        async with self._lock:
            self._users -= 1
            if self._users <= 0:
                self._users = 0
                await self._stop()

    async def _start(self) -> Browser:
        path = chromium_path()
        _register_atexit()
        _reap(orphans_only=True)  # what a killed driver left behind
        self._dead_port = socket.socket()
        self._dead_port.bind(("127.0.0.1", 0))  # bound but never listening: connections refused
        self.proxy = f"http://127.0.0.1:{self._dead_port.getsockname()[1]}"
        try:
            self._playwright = await async_playwright().start()
            return await self._playwright.chromium.launch(
                executable_path=path,
                headless=True,
                args=[*_FLAGS, f"{_OWNER}{os.getpid()}"],
                proxy={"server": self.proxy},
                timeout=60_000,
            )
        except (PlaywrightError, OSError) as e:
            await self._stop()
            raise BrowserError(f"Chromium at {path} did not start: {_first_line(e)}") from e

    async def _stop(self) -> None:
        browser, playwright, port = self._browser, self._playwright, self._dead_port
        self._browser = self._playwright = self._dead_port = None
        if browser is not None:
            with contextlib.suppress(PlaywrightError):
                await browser.close()
        if playwright is not None:
            with contextlib.suppress(PlaywrightError, OSError):
                await playwright.stop()
        if port is not None:
            port.close()


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Chromium] = (
    weakref.WeakKeyDictionary()
)


@functools.cache
def _register_atexit() -> None:
    atexit.register(_reap, orphans_only=False)


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
            elif (origin := _origin(entry)) and parts.path in ("", "/") and not parts.query:
                self.origins.add(origin)
            else:
                raise ConfigError(
                    f"browser: allowed origin {entry!r} is neither scheme://host[:port] "
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
        return _origin(url) in self.origins

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


def _origin(url: str) -> str | None:
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


def _home(url: str) -> str:
    """What a lone start_url allows: its origin, or its directory for a file."""
    if urlsplit(url).scheme == "file":
        return "file://" + posixpath.dirname(urlsplit(url).path)
    return _origin(url) or url


def _first_line(error: BaseException) -> str:
    text = getattr(error, "message", None) or str(error)
    line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return re.sub(r"^(\w+\.\w+: )?(Error: )?", "", line)  # "Locator.fill: Error: ..."


class _Snapshot(BaseModel):
    lines: list[tuple[str, bool]]
    """(line, the element is above the viewport)"""
    title: str
    scroll_y: int
    height: int
    viewport: int


class BrowserTool:
    """A Chromium page the agent reads as text and acts on by numbered refs."""

    name = "browser"
    description = (
        "Use a web browser. Every action returns the page as text: title, URL, then one "
        "line per heading, text and element; interactive elements carry a ref such as "
        '[3] button "Sign in". Actions: goto(url), click(ref), type(ref, text, submit), '
        "press(key, ref optional), scroll(direction), back, read (show the page again). "
        "Refs change whenever the page is shown. Only the task's own sites can be opened."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": list(ACTIONS), "description": "what to do"},
            "url": {"type": "string", "description": "goto: a URL, absolute or relative"},
            "ref": {"type": "integer", "description": "click/type/press: the [n] of an element"},
            "text": {"type": "string", "description": "type: text that replaces the field's value"},
            "submit": {"type": "boolean", "description": "type: press Enter afterwards"},
            "key": {"type": "string", "description": "press: e.g. Enter, Tab, Escape, ArrowDown"},
            "direction": {"type": "string", "enum": ["up", "down"], "description": "scroll"},
        },
        "required": ["action"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        *,
        allowed_origins: list[str] | None = None,
        start_url: str | None = None,
        max_chars: int = 6000,
        timeout_s: float = 10.0,
        viewport: tuple[int, int] = (1280, 720),
    ) -> None:
        """`allowed_origins` defaults to the origin (or directory) of `start_url`, else none."""
        if not allowed_origins and start_url:
            allowed_origins = [_home(start_url)]
        self.allow = AllowList(allowed_origins or [])
        if start_url is not None and (why := self.allow.refusal(start_url)):
            raise ConfigError(f"browser: start_url {why}", fix="add its origin to allowed_origins")
        if max_chars < 200 or timeout_s <= 0 or min(viewport) < 100:
            raise ConfigError("browser: need max_chars >= 200, timeout_s > 0, viewport >= 100x100")
        self.start_url = start_url
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.viewport = viewport
        self._chromium: _Chromium | None = None
        self._context: BrowserContext | None = None
        self._pages: list[Page] = []
        self._blocked: list[str] = []  # main-frame navigations refused during this action
        self._cancelled: set[str] = set()  # those of them the route cancelled (no error page)
        self._blocked_requests: list[str] = []  # other requests refused since the last view
        self._closed = False
        self._lock = asyncio.Lock()

    async def __call__(self, sandbox: Sandbox, **arguments: Any) -> Observation:
        if self._closed:
            raise BrowserError("browser tool used after close()", fix="build one tool per episode")
        async with self._lock:
            try:
                return Observation(text=await self._act(arguments))
            except _Refused as e:
                return Observation(text=f"error: {e}", error=True)
            except PlaywrightError as e:
                if not self._chromium_alive():
                    raise BrowserError(f"Chromium died: {_first_line(e)}") from e
                return Observation(text=f"error: {_first_line(e)}", error=True)

    async def close(self) -> None:
        """Close this episode's context; the last tool on the loop also stops Chromium."""
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._teardown())

    async def _teardown(self) -> None:
        context, chromium = self._context, self._chromium
        self._context = self._chromium = None
        self._pages.clear()
        if context is not None:
            with contextlib.suppress(PlaywrightError):
                await context.close()
        if chromium is not None:
            await chromium.release()

    def _chromium_alive(self) -> bool:
        browser = self._context.browser if self._context is not None else None
        return browser is not None and browser.is_connected()

    # -- actions ---------------------------------------------------------------------

    async def _act(self, arguments: dict[str, Any]) -> str:
        action = arguments.get("action")
        if action not in ACTIONS:
            raise _Refused(f"unknown action {action!r}; use one of: {', '.join(ACTIONS)}")
        unknown = sorted(set(arguments) - set(_ARGUMENTS))
        if unknown:
            raise _Refused(f"unknown argument(s) {', '.join(unknown)}; use {', '.join(_ARGUMENTS)}")
        page = await self._page()
        self._blocked.clear()
        self._cancelled.clear()
        try:
            await getattr(self, f"_{action}")(page, arguments)
        except PlaywrightError:
            if not self._blocked:  # a refused redirect makes navigation fail: reported below
                raise
        page = await self._settle()
        if self._blocked:
            if set(self._blocked) - self._cancelled:  # the proxy refused a redirect hop
                with contextlib.suppress(PlaywrightError):  # Chromium then shows an error page
                    await page.wait_for_url(_ERROR_PAGE, timeout=min(self.timeout_s, 5) * 1000)
                    await page.go_back(timeout=self.timeout_s * 1000)
            raise _Refused(
                f"refused to open {self._blocked[0][:200]}: it is outside the allowed origins "
                f"({self.allow}); the page did not change"
            )
        return await self._observe(page)

    async def _goto(self, page: Page, arguments: dict[str, Any]) -> None:
        url = urljoin(page.url, _text(arguments, "url").strip())
        if why := self.allow.refusal(url):
            raise _Refused(why)
        try:
            await page.goto(url, timeout=self.timeout_s * 1000, wait_until="load")
        except PlaywrightTimeoutError as e:
            raise _Refused(f"{url[:200]} did not load within {self.timeout_s:g} s") from e
        except PlaywrightError as e:
            if self._blocked:
                raise
            net = re.search(r"net::ERR_\w+", str(e))
            raise _Refused(f"cannot open {url[:200]}: {net[0] if net else _first_line(e)}") from e

    async def _click(self, page: Page, arguments: dict[str, Any]) -> None:
        ref, element = await self._element(page, arguments)
        try:
            await element.click(timeout=self.timeout_s * 1000)
        except PlaywrightTimeoutError as e:
            raise _Refused(
                f"[{ref}] could not be clicked within {self.timeout_s:g} s "
                "(hidden, disabled or covered by another element)"
            ) from e

    async def _type(self, page: Page, arguments: dict[str, Any]) -> None:
        ref, element = await self._element(page, arguments)
        text = arguments.get("text")
        if not isinstance(text, str):
            raise _Refused("type needs `text` (a string)")
        ms = self.timeout_s * 1000
        options: list[str] | None = await element.evaluate(
            "e => e.localName === 'select' ? Array.from(e.options, o => o.text.trim()) : null"
        )
        try:
            if options is None:
                await element.fill(text, timeout=ms)
            elif text.strip() in options:
                await element.select_option(label=text.strip(), timeout=ms)
            else:
                raise _Refused(f"[{ref}] has no option {text!r}; options: {options[:20]}")
            if arguments.get("submit") is True:
                await element.press("Enter", timeout=ms)
        except PlaywrightTimeoutError as e:
            raise _Refused(f"[{ref}] did not accept text within {self.timeout_s:g} s") from e
        except PlaywrightError as e:
            if self._blocked:
                raise
            raise _Refused(f"cannot type into [{ref}]: {_first_line(e)}") from e

    async def _press(self, page: Page, arguments: dict[str, Any]) -> None:
        key = _text(arguments, "key")
        try:
            if arguments.get("ref") is not None:
                _, element = await self._element(page, arguments)
            elif await (element := page.locator("*:focus")).count() != 1:
                await page.keyboard.press(key)
                return
            # Locator.press (unlike keyboard.press) waits for a navigation it starts.
            await element.press(key, timeout=self.timeout_s * 1000)
        except PlaywrightError as e:
            if "Unknown key" in str(e):
                raise _Refused(f"unknown key {key!r}; e.g. Enter, Tab, Escape, ArrowDown") from e
            raise

    async def _scroll(self, page: Page, arguments: dict[str, Any]) -> None:
        direction = arguments.get("direction", "down")
        if direction not in ("up", "down"):
            raise _Refused(f"scroll direction must be up or down, not {direction!r}")
        step = int(self.viewport[1] * 0.8) * (1 if direction == "down" else -1)
        await page.evaluate(_SCROLL_JS, step)

    async def _back(self, page: Page, arguments: dict[str, Any]) -> None:
        before = page.url
        response = await page.go_back(timeout=self.timeout_s * 1000, wait_until="load")
        if response is None and page.url == before:
            raise _Refused("there is no previous page to go back to")

    async def _read(self, page: Page, arguments: dict[str, Any]) -> None:
        return None

    async def _element(self, page: Page, arguments: dict[str, Any]) -> tuple[int, Locator]:
        raw = arguments.get("ref")
        match = re.fullmatch(r"\s*\[?(\d+)\]?\s*", str(raw)) if raw is not None else None
        if match is None:
            raise _Refused(f"{arguments['action']} needs `ref`: the number [n] of an element")
        ref = int(match[1])
        element = page.locator(f'[data-agentrl-ref="{ref}"]')
        if await element.count() == 0:
            raise _Refused(f"no element [{ref}] on the page; use a ref from the latest page view")
        return ref, element.first

    # -- pages and observation -------------------------------------------------------

    async def _page(self) -> Page:
        """The current tab (the newest open one), starting the context on first use."""
        if self._context is None:
            self._chromium = _SHARED.setdefault(asyncio.get_running_loop(), _Chromium())
            browser = await self._chromium.acquire()
            self._context = await browser.new_context(
                viewport={"width": self.viewport[0], "height": self.viewport[1]},
                proxy={"server": self._chromium.proxy, "bypass": self.allow.bypass},
                service_workers="block",  # their requests would bypass the route
                accept_downloads=False,
            )
            await self._context.route("**/*", self._route)
            self._context.on("request", self._on_request)
            self._context.on("page", self._on_page)
        while self._pages and self._pages[-1].is_closed():
            self._pages.pop()
        if self._pages:
            return self._pages[-1]
        page = await self._context.new_page()
        if page not in self._pages:
            self._pages.append(page)
        if self.start_url:
            await page.goto(self.start_url, timeout=self.timeout_s * 1000, wait_until="load")
        return page

    def _on_page(self, page: Page) -> None:
        if page not in self._pages:
            self._pages.append(page)
        page.on("crash", self._on_crash)

    def _on_crash(self, page: Page) -> None:
        if page in self._pages:  # the next action opens a fresh tab
            self._pages.remove(page)

    async def _route(self, route: Route) -> None:
        request = route.request
        with contextlib.suppress(PlaywrightError):  # the page may be gone meanwhile
            if self.allow.permits(request.url):
                await route.continue_()
            elif request.is_navigation_request():
                self._cancelled.add(request.url)
                await route.fulfill(status=204)  # cancels the navigation; the page stays
            else:
                await route.abort("blockedbyclient")

    def _on_request(self, request: Request) -> None:
        if self.allow.permits(request.url):
            return
        main_frame = False
        with contextlib.suppress(PlaywrightError):
            main_frame = request.is_navigation_request() and request.frame.parent_frame is None
        (self._blocked if main_frame else self._blocked_requests).append(request.url)

    async def _settle(self) -> Page:
        await asyncio.sleep(0)  # let a popup's "page" event arrive
        page = await self._page()
        with contextlib.suppress(PlaywrightError):  # still loading: show what is there
            await page.wait_for_load_state("load", timeout=self.timeout_s * 1000)
        return page

    async def _observe(self, page: Page) -> str:
        try:
            raw = await page.evaluate(_SNAPSHOT_JS, _MAX_TEXT)
        except PlaywrightError:  # a navigation replaced the document mid-walk
            with contextlib.suppress(PlaywrightError):
                await page.wait_for_load_state("load", timeout=self.timeout_s * 1000)
            raw = await page.evaluate(_SNAPSHOT_JS, _MAX_TEXT)
        snap = _Snapshot.model_validate(raw)
        header = [f"Title: {snap.title}", f"URL: {page.url}"]
        if snap.height > snap.viewport + 1:
            bottom = min(snap.scroll_y + snap.viewport, snap.height)
            header.append(f"Scroll: {snap.scroll_y}-{bottom} of {snap.height} px")
        if self._blocked_requests:
            n, first = len(self._blocked_requests), self._blocked_requests[0][:200]
            header.append(f"Blocked: {n} request(s) outside the allowed origins, e.g. {first}")
            self._blocked_requests.clear()
        return _render("\n".join(header) + "\n\n", snap, self.max_chars)


def _render(header: str, snap: _Snapshot, max_chars: int) -> str:
    """Header and lines within max_chars; a long page is shown from the viewport down."""
    lines = [line for line, _ in snap.lines] or ["(no visible content)"]
    if len(header) + sum(len(line) + 1 for line in lines) <= max_chars:
        return header + "\n".join(lines)
    start = next((i for i, (_, above) in enumerate(snap.lines) if not above), 0)
    out = [header.rstrip("\n"), ""]
    if start:
        out.append(f"[... {start} lines above the viewport; scroll up to see them]")
    budget = max_chars - sum(len(line) + 1 for line in out) - 80  # room for the marker below
    shown = start
    for line in lines[start:]:
        if len(line) + 1 > budget:
            if shown == start:  # one huge line: show its beginning
                out.append(line[: max(budget - 1, 0)] + "…")
                shown += 1
            break
        out.append(line)
        budget -= len(line) + 1
        shown += 1
    if shown < len(lines):
        rest = len(lines) - shown
        out.append(f"[... truncated: {rest} more lines below; scroll down to see them]")
    return "\n".join(out)


def _text(arguments: dict[str, Any], key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _Refused(f"{arguments['action']} needs `{key}` (a non-empty string)")
    return value


def _script(name: str) -> str:
    """A page function shipped beside this module (package data), as Playwright evaluates it."""
    text = resources.files("agentrl.tools").joinpath(name).read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("//"))


_SCROLL_JS = _script("browser_scroll.js")
_SNAPSHOT_JS = _script("browser_snapshot.js")  # the page, one line per element in order
