"""The browser tool: Playwright driving Debian's Chromium, one browser context per episode.

Chromium itself (one process per event loop, shared, reaped) is `chromium`; the URL
allow-list is `allowlist`, enforced by a route on every request and by the context's
proxy. This module owns the actions and the observation: a walk of the DOM that writes
one line per heading, text run and interactive element, giving each interactive
element a ref (`[3] button "Sign in"`) stored as a `data-agentrl-ref` attribute, so
`click`/`type` find it with a locator.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from importlib import resources
from typing import Any, Literal, get_args
from urllib.parse import urljoin

from playwright.async_api import BrowserContext, Locator, Page, Request, Route
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import TimeoutError as PlaywrightTimeoutError
from pydantic import BaseModel, Field, field_validator, model_validator

from agentrl.errors import BrowserError
from agentrl.sandbox.base import Sandbox
from agentrl.tools.allowlist import AllowList, home
from agentrl.tools.base import ModelTool, Observation, ToolArgs, ToolOptions
from agentrl.tools.chromium import Chromium, first_line, shared

__all__ = ["ACTIONS", "BrowserArgs", "BrowserOptions", "BrowserTool"]

Action = Literal["goto", "click", "type", "press", "scroll", "back", "read"]
ACTIONS: tuple[str, ...] = get_args(Action)
_MAX_TEXT = 1000  # characters of one text line
_ERROR_PAGE = re.compile(r"^chrome-error://")


class _Refused(Exception):
    """An agent mistake; `run` turns it into an error observation (never escapes)."""


class BrowserArgs(ToolArgs):
    action: Action = Field(description="what to do")
    url: str | None = Field(default=None, description="goto: a URL, absolute or relative")
    ref: int | None = Field(default=None, description="click/type/press: the [n] of an element")
    text: str | None = Field(default=None, description="type: text that replaces the field's value")
    submit: bool = Field(default=False, description="type: press Enter afterwards")
    key: str | None = Field(default=None, description="press: e.g. Enter, Tab, Escape, ArrowDown")
    direction: Literal["up", "down"] = Field(default="down", description="scroll")

    @field_validator("ref", mode="before")
    @classmethod
    def _ref(cls, value: Any) -> Any:
        if value is None or isinstance(value, int) and not isinstance(value, bool):
            return value
        match = re.fullmatch(r"\s*\[?(\d+)\]?\s*", str(value))  # "[3]", as the page shows it
        if match is None:
            raise ValueError(f"`ref` must be the number [n] of an element, got {value!r}")
        return int(match[1])


class BrowserOptions(ToolOptions):
    allowed_origins: list[str] | None = Field(
        default=None,
        description="origins (scheme://host[:port]) and file:///directory prefixes the page "
        "may load; default: the origin (or directory) of start_url, else none",
    )
    start_url: str | None = Field(default=None, description="opened before the first action")
    max_chars: int = Field(default=6000, ge=200, description="longest observation")
    timeout_s: float = Field(default=10.0, gt=0, description="seconds an action may wait")
    viewport: tuple[int, int] = Field(default=(1280, 720), description="width, height (px)")

    @field_validator("viewport")
    @classmethod
    def _big_enough(cls, value: tuple[int, int]) -> tuple[int, int]:
        if min(value) < 100:
            raise ValueError(f"viewport {value} is too small: at least 100x100")
        return value

    @model_validator(mode="after")
    def _start_is_allowed(self) -> BrowserOptions:
        allow = self.allow()  # an entry that is no origin raises (ConfigError is a ValueError)
        if self.start_url is not None and (why := allow.refusal(self.start_url)):
            raise ValueError(f"start_url {why}: add its origin to allowed_origins")
        return self

    def allow(self) -> AllowList:
        origins = self.allowed_origins
        if not origins and self.start_url:
            origins = [home(self.start_url)]
        return AllowList(origins or [])


class _Snapshot(BaseModel):
    lines: list[tuple[str, bool]]
    """(line, the element is above the viewport)"""
    title: str
    scroll_y: int
    height: int
    viewport: int


class BrowserTool(ModelTool[BrowserArgs, BrowserOptions]):
    """A Chromium page the agent reads as text and acts on by numbered refs."""

    name = "browser"
    description = (
        "Use a web browser. Every action returns the page as text: title, URL, then one "
        "line per heading, text and element; interactive elements carry a ref such as "
        '[3] button "Sign in". Actions: goto(url), click(ref), type(ref, text, submit), '
        "press(key, ref optional), scroll(direction), back, read (show the page again). "
        "Refs change whenever the page is shown. Only the task's own sites can be opened."
    )
    Args = BrowserArgs
    Options = BrowserOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.allow = self.options.allow()
        self.timeout_s = self.options.timeout_s
        self._chromium: Chromium | None = None
        self._context: BrowserContext | None = None
        self._pages: list[Page] = []
        self._blocked: list[str] = []  # main-frame navigations refused during this action
        self._cancelled: set[str] = set()  # those of them the route cancelled (no error page)
        self._blocked_requests: list[str] = []  # other requests refused since the last view
        self._closed = False
        self._lock = asyncio.Lock()

    async def run(self, sandbox: Sandbox, args: BrowserArgs) -> Observation:
        if self._closed:
            raise BrowserError("browser tool used after close()", fix="build one tool per episode")
        async with self._lock:
            try:
                return Observation(text=await self._act(args))
            except _Refused as e:
                return Observation(text=f"error: {e}", error=True)
            except PlaywrightError as e:
                if not self._chromium_alive():
                    raise BrowserError(f"Chromium died: {first_line(e)}") from e
                return Observation(text=f"error: {first_line(e)}", error=True)

    async def close(self, *, keep_processes: bool = False) -> None:
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

    async def _act(self, args: BrowserArgs) -> str:
        page = await self._page()
        self._blocked.clear()
        self._cancelled.clear()
        try:
            await getattr(self, f"_{args.action}")(page, args)
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

    async def _goto(self, page: Page, args: BrowserArgs) -> None:
        url = urljoin(page.url, _given(args, args.url, "url").strip())
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
            raise _Refused(f"cannot open {url[:200]}: {net[0] if net else first_line(e)}") from e

    async def _click(self, page: Page, args: BrowserArgs) -> None:
        ref, element = await self._element(page, args)
        try:
            await element.click(timeout=self.timeout_s * 1000)
        except PlaywrightTimeoutError as e:
            raise _Refused(
                f"[{ref}] could not be clicked within {self.timeout_s:g} s "
                "(hidden, disabled or covered by another element)"
            ) from e

    async def _type(self, page: Page, args: BrowserArgs) -> None:
        ref, element = await self._element(page, args)
        text = args.text
        if text is None:
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
            if args.submit:
                await element.press("Enter", timeout=ms)
        except PlaywrightTimeoutError as e:
            raise _Refused(f"[{ref}] did not accept text within {self.timeout_s:g} s") from e
        except PlaywrightError as e:
            if self._blocked:
                raise
            raise _Refused(f"cannot type into [{ref}]: {first_line(e)}") from e

    async def _press(self, page: Page, args: BrowserArgs) -> None:
        key = _given(args, args.key, "key")
        try:
            if args.ref is not None:
                _, element = await self._element(page, args)
            elif await (element := page.locator("*:focus")).count() != 1:
                await page.keyboard.press(key)
                return
            # Locator.press (unlike keyboard.press) waits for a navigation it starts.
            await element.press(key, timeout=self.timeout_s * 1000)
        except PlaywrightError as e:
            if "Unknown key" in str(e):
                raise _Refused(f"unknown key {key!r}; e.g. Enter, Tab, Escape, ArrowDown") from e
            raise

    async def _scroll(self, page: Page, args: BrowserArgs) -> None:
        step = int(self.options.viewport[1] * 0.8) * (1 if args.direction == "down" else -1)
        await page.evaluate(_SCROLL_JS, step)

    async def _back(self, page: Page, args: BrowserArgs) -> None:
        before = page.url
        response = await page.go_back(timeout=self.timeout_s * 1000, wait_until="load")
        if response is None and page.url == before:
            raise _Refused("there is no previous page to go back to")

    async def _read(self, page: Page, args: BrowserArgs) -> None:
        return None

    async def _element(self, page: Page, args: BrowserArgs) -> tuple[int, Locator]:
        ref = args.ref
        if ref is None:
            raise _Refused(f"{args.action} needs `ref`: the number [n] of an element")
        element = page.locator(f'[data-agentrl-ref="{ref}"]')
        if await element.count() == 0:
            raise _Refused(f"no element [{ref}] on the page; use a ref from the latest page view")
        return ref, element.first

    # -- pages and observation -------------------------------------------------------

    async def _page(self) -> Page:
        """The current tab (the newest open one), starting the context on first use."""
        if self._context is None:
            self._chromium = shared()
            browser = await self._chromium.acquire()
            self._context = await browser.new_context(
                viewport={"width": self.options.viewport[0], "height": self.options.viewport[1]},
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
        if self.options.start_url:
            await page.goto(
                self.options.start_url, timeout=self.timeout_s * 1000, wait_until="load"
            )
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
        return _render("\n".join(header) + "\n\n", snap, self.options.max_chars)


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


def _given(args: BrowserArgs, value: str | None, key: str) -> str:
    if value is None or not value.strip():
        raise _Refused(f"{args.action} needs `{key}` (a non-empty string)")
    return value


def _script(name: str) -> str:
    """A page function shipped beside this module (package data), as Playwright evaluates it."""
    text = resources.files("agentrl.tools").joinpath(name).read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("//"))


_SCROLL_JS = _script("browser_scroll.js")
_SNAPSHOT_JS = _script("browser_snapshot.js")  # the page, one line per element in order
