"""The browser tool against real Chromium and real HTTP servers on 127.0.0.1.

Two servers run for the module: `site` (the task's own origin, the only one allowed) and
`other` (a live server on another port that the browser must never reach: each refusal
test asserts it received zero requests; one also shows it answers when asked directly, so
the refusal is the allow-list's, not a dead server's).
"""

from __future__ import annotations

import asyncio
import html
import http.server
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs

import pytest

from agentrl.errors import BrowserError, ConfigError
from agentrl.sandbox.base import Sandbox
from agentrl.tools.allowlist import AllowList
from agentrl.tools.base import Observation
from agentrl.tools.browser import BrowserTool
from agentrl.tools.chromium import chromium_path

pytestmark = pytest.mark.timeout(120)
T = TypeVar("T")
NO_SANDBOX = cast(Sandbox, None)  # the browser runs on the host and never uses its sandbox


class Server:
    """A threaded HTTP server on 127.0.0.1 serving `pages`; `hits` lists the paths asked."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {}
        self.hits: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.hits.append(self.path)
                path, _, query = self.path.partition("?")
                if path == "/echo":
                    said = html.escape(parse_qs(query).get("q", [""])[0])
                    return self._send(200, f"<title>Echo</title><h1>You said: {said}</h1>")
                if path == "/redirect":
                    return self._send(302, "", {"Location": server.pages["redirect-target"]})
                if path in server.pages:
                    return self._send(200, server.pages[path])
                return self._send(404, "<title>Missing</title><h1>Not found</h1>")

            def _send(self, status: int, body: str, headers: dict[str, str] | None = None) -> None:
                data = body.encode()
                self.send_response(status)
                for name, value in {"Content-Type": "text/html", **(headers or {})}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._httpd.server_address[1])
        self.origin = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def get(self, path: str) -> int:
        """Ask directly (not through Chromium); no proxy from the environment."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.origin + path, timeout=5) as response:
            return int(response.status)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture(scope="module")
def chromium() -> str:
    try:
        return chromium_path()
    except BrowserError:
        pytest.fail("no Chromium here: apt-get install -y chromium (bootstrap.sh does)")


@pytest.fixture(scope="module")
def servers(chromium: str) -> Iterator[tuple[Server, Server]]:
    site, other = Server(), Server()
    elsewhere = other.origin
    site.pages.update(
        {
            "/": (
                "<title>Home</title><h1>Welcome home</h1>"
                '<p>See the <a href="/second">Second page</a> for more.</p>'
                '<form action="/echo"><label for="q">Query</label><input id="q" name="q">'
                '<button type="submit">Send</button></form>'
                "<button onclick=\"document.getElementById('msg').textContent='Clicked!'\">"
                'Change</button><p id="msg">Not clicked</p>'
                f'<a href="{elsewhere}/secret">Elsewhere</a>'
                '<a href="/redirect">Detour</a>'
            ),
            "/second": "<title>Second</title><h1>Second page</h1>",
            "/long": "<title>Long</title>"
            + "".join(f'<p style="margin:40px">Paragraph {i}</p>' for i in range(400)),
            "/huge": "<title>Huge</title>"
            + "".join(f"<p>Line number {i} of a very large page</p>" for i in range(5000)),
            "/leaky": (
                "<title>Leaky</title>"
                f'<img src="{elsewhere}/pixel.png" alt="pixel">'
                '<p id="result">waiting</p><script>'
                f'fetch("{elsewhere}/api").then(() => result.textContent = "fetch worked",'
                ' () => result.textContent = "fetch failed");</script>'
            ),
            "/storage": (
                '<title>Storage</title><p id="v"></p><script>'
                "v.textContent = 'stored=' + (localStorage.getItem('k') || 'none')"
                " + ' cookie=' + (document.cookie || 'none');"
                "localStorage.setItem('k', 'yes'); document.cookie = 'c=1';</script>"
            ),
            "redirect-target": f"{elsewhere}/after-redirect",
        }
    )
    other.pages["/secret"] = "<title>Secret</title><h1>Secret</h1>"
    yield site, other
    site.stop()
    other.stop()


def run(body: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """pytest-asyncio is not installed: each test runs its own event loop."""
    return asyncio.run(body())


def ref(obs: Observation, line: str) -> int:
    """The [n] of the first line that ends with `line` (e.g. 'link "Second page"')."""
    match = re.search(r"^\[(\d+)\] " + re.escape(line), obs.text, re.MULTILINE)
    assert match, f"no {line!r} in:\n{obs.text}"
    return int(match[1])


def tool(site: Server, **options: object) -> BrowserTool:
    return BrowserTool(allowed_origins=[site.origin], **options)  # type: ignore[arg-type]


def test_goto_shows_title_heading_and_numbered_refs(servers):
    site, _ = servers

    async def body() -> Observation:
        browser = tool(site)
        try:
            return await browser(NO_SANDBOX, action="goto", url=site.origin + "/")
        finally:
            await browser.close()

    obs = run(body)
    assert not obs.error
    lines = obs.text.splitlines()
    assert lines[:2] == ["Title: Home", f"URL: {site.origin}/"]
    assert 'heading "Welcome home" level=1' in lines
    assert re.search(r'^\[\d+\] link "Second page" -> /second$', obs.text, re.MULTILINE)
    assert re.search(r'^\[\d+\] textbox "Query"$', obs.text, re.MULTILINE)
    assert re.search(r'^\[\d+\] button "Send"$', obs.text, re.MULTILINE)
    assert 'text "Not clicked"' in lines


def test_click_type_press_back_and_a_script_button(servers):
    site, _ = servers

    async def body() -> list[Observation]:
        browser = tool(site, start_url=site.origin + "/")
        try:
            home = await browser(NO_SANDBOX, action="read")
            second = await browser(NO_SANDBOX, action="click", ref=ref(home, 'link "Second page"'))
            back = await browser(NO_SANDBOX, action="back")
            query = ref(back, 'textbox "Query"')
            typed = await browser(NO_SANDBOX, action="type", ref=query, text="hi", submit=True)
            await browser(NO_SANDBOX, action="back")
            home = await browser(NO_SANDBOX, action="read")
            await browser(
                NO_SANDBOX, action="type", ref=ref(home, 'textbox "Query"'), text="by key"
            )
            pressed = await browser(NO_SANDBOX, action="press", key="Enter")
            home = await browser(NO_SANDBOX, action="back")
            changed = await browser(NO_SANDBOX, action="click", ref=ref(home, 'button "Change"'))
            return [second, back, typed, pressed, changed]
        finally:
            await browser.close()

    second, back, typed, pressed, changed = run(body)
    assert 'heading "Second page" level=1' in second.text
    assert second.text.startswith(f"Title: Second\nURL: {site.origin}/second")
    assert "Title: Home" in back.text
    assert 'heading "You said: hi" level=1' in typed.text
    assert 'heading "You said: by key" level=1' in pressed.text
    assert 'text "Clicked!"' in changed.text and "Not clicked" not in changed.text
    assert not any(o.error for o in (second, back, typed, pressed, changed))


def test_scroll_moves_the_view_on_a_long_page(servers):
    site, _ = servers

    async def body() -> list[Observation]:
        browser = tool(site, max_chars=1500)
        try:
            top = await browser(NO_SANDBOX, action="goto", url=site.origin + "/long")
            down = [await browser(NO_SANDBOX, action="scroll", direction="down") for _ in range(3)]
            up = await browser(NO_SANDBOX, action="scroll", direction="up")
            return [top, down[-1], up]
        finally:
            await browser.close()

    top, down, up = run(body)
    assert re.search(r"^Scroll: 0-720 of \d+ px$", top.text, re.MULTILINE)
    assert 'text "Paragraph 0"' in top.text and "lines above the viewport" not in top.text
    assert re.search(r"^Scroll: 1728-2448 of \d+ px$", down.text, re.MULTILINE)
    assert 'text "Paragraph 0"' not in down.text and "lines above the viewport" in down.text
    assert "scroll down to see them" in top.text
    assert re.search(r"^Scroll: 1152-1872 of \d+ px$", up.text, re.MULTILINE)


def test_a_huge_page_is_truncated_with_a_marker(servers):
    site, _ = servers

    async def body() -> Observation:
        browser = tool(site, max_chars=3000)
        try:
            return await browser(NO_SANDBOX, action="goto", url=site.origin + "/huge")
        finally:
            await browser.close()

    obs = run(body)
    assert len(obs.text) <= 3000
    assert 'text "Line number 0 of a very large page"' in obs.text
    assert re.search(r"^\[\.\.\. truncated: \d+ more lines below; scroll down", obs.text, re.M)
    assert "Line number 4999" not in obs.text


def test_goto_outside_the_allowed_origins_is_refused(servers):
    site, other = servers
    other.hits.clear()

    async def body() -> list[Observation]:
        browser = tool(site, start_url=site.origin + "/")
        try:
            return [
                await browser(NO_SANDBOX, action="goto", url=other.origin + "/secret"),
                await browser(NO_SANDBOX, action="goto", url=f"http://localhost:{other.port}/"),
                await browser(NO_SANDBOX, action="goto", url=site.origin + "/redirect"),
                await browser(NO_SANDBOX, action="goto", url="javascript:alert(1)"),
                await browser(NO_SANDBOX, action="goto", url="chrome://version"),
                await browser(NO_SANDBOX, action="read"),
            ]
        finally:
            await browser.close()

    *refused, after = run(body)
    assert all(o.error and len(o.text.splitlines()) == 1 for o in refused), refused
    assert refused[0].text == (
        f"error: refused: {other.origin}/secret is outside the allowed origins ({site.origin})"
    )
    assert f"refused to open {other.origin}/after-redirect" in refused[2].text
    assert "only http(s) and file URLs" in refused[3].text
    assert "only http(s) and file URLs" in refused[4].text
    assert after.text.startswith(f"Title: Home\nURL: {site.origin}/\n")  # never left home
    assert other.hits == []  # refused by the allow-list: the server is alive...
    assert other.get("/secret") == 200  # ...and answers when asked directly


def test_a_clicked_link_to_another_origin_is_refused_and_the_page_stays(servers):
    site, other = servers
    other.hits.clear()

    async def body() -> list[Observation]:
        browser = tool(site, start_url=site.origin + "/")
        try:
            home = await browser(NO_SANDBOX, action="read")
            await browser(NO_SANDBOX, action="click", ref=ref(home, 'button "Change"'))
            home = await browser(NO_SANDBOX, action="read")
            away = await browser(NO_SANDBOX, action="click", ref=ref(home, 'link "Elsewhere"'))
            stayed = await browser(NO_SANDBOX, action="read")
            detour = await browser(NO_SANDBOX, action="click", ref=ref(stayed, 'link "Detour"'))
            return [away, stayed, detour, await browser(NO_SANDBOX, action="read")]
        finally:
            await browser.close()

    away, stayed, detour, after = run(body)
    assert away.error and away.text.startswith(f"error: refused to open {other.origin}/secret")
    assert f"URL: {site.origin}/\n" in stayed.text
    assert 'text "Clicked!"' in stayed.text  # the page kept its state: it was never left
    # A redirect hop is refused by the proxy: Chromium shows an error page, the tool goes back.
    assert detour.error and f"refused to open {other.origin}/after-redirect" in detour.text
    assert f"URL: {site.origin}/\n" in after.text
    assert other.hits == []


def test_subresources_and_fetches_from_another_origin_are_blocked(servers):
    site, other = servers
    other.hits.clear()

    async def body() -> list[Observation]:
        browser = tool(site)
        try:
            loaded = await browser(NO_SANDBOX, action="goto", url=site.origin + "/leaky")
            await asyncio.sleep(0.3)  # the page's fetch settles
            return [loaded, await browser(NO_SANDBOX, action="read")]
        finally:
            await browser.close()

    loaded, later = run(body)
    assert 'text "fetch failed"' in later.text
    assert re.search(rf"^Blocked: \d request\(s\) .* e\.g\. {other.origin}/", loaded.text, re.M)
    assert other.hits == []


def test_agent_mistakes_come_back_as_one_line_errors(servers):
    site, _ = servers

    async def body() -> list[Observation]:
        browser = tool(site, start_url=site.origin + "/", timeout_s=2)
        try:
            home = await browser(NO_SANDBOX, action="read")
            return [
                await browser(NO_SANDBOX, action="click"),
                await browser(NO_SANDBOX, action="click", ref=999),
                await browser(NO_SANDBOX, action="fly"),
                await browser(NO_SANDBOX, action="goto"),
                await browser(NO_SANDBOX, action="press", key="NoSuchKey"),
                await browser(NO_SANDBOX, action="type", ref=ref(home, 'button "Send"'), text="x"),
                await browser(NO_SANDBOX, action="scroll", direction="sideways"),
                await browser(NO_SANDBOX, action="read", colour="red"),
            ]
        finally:
            await browser.close()

    errors = run(body)
    assert all(o.error and len(o.text.splitlines()) == 1 for o in errors), errors
    texts = [o.text for o in errors]
    assert "click needs `ref`" in texts[0]
    assert "no element [999] on the page" in texts[1]
    assert "unknown action 'fly'" in texts[2] and "goto, click, type" in texts[2]
    assert "goto needs `url`" in texts[3]
    assert "unknown key 'NoSuchKey'" in texts[4]
    assert texts[5].startswith("error: cannot type into [")
    assert "up or down" in texts[6]
    assert "unknown argument(s) colour" in texts[7]


def test_file_urls_are_allowed_only_under_the_allowed_directory(chromium, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "page.html").write_text("<title>Local</title><h1>From a file</h1>")
    (tmp_path / "outside.html").write_text("<h1>Outside</h1>")

    async def body() -> list[Observation]:
        browser = BrowserTool(start_url=(site / "page.html").as_uri())
        try:
            return [
                await browser(NO_SANDBOX, action="read"),
                await browser(NO_SANDBOX, action="goto", url=(tmp_path / "outside.html").as_uri()),
                await browser(NO_SANDBOX, action="goto", url=site.as_uri() + "/../outside.html"),
            ]
        finally:
            await browser.close()

    page, outside, dotdot = run(body)
    assert 'heading "From a file" level=1' in page.text
    assert outside.error and "outside the allowed origins" in outside.text
    assert dotdot.error and "outside the allowed origins" in dotdot.text


def test_two_tools_have_independent_cookies_and_storage(servers):
    site, _ = servers

    async def body() -> list[Observation]:
        first, second = tool(site), tool(site)
        try:
            url = site.origin + "/storage"
            await first(NO_SANDBOX, action="goto", url=url)
            again = await first(NO_SANDBOX, action="goto", url=url)
            fresh = await second(NO_SANDBOX, action="goto", url=url)
            return [again, fresh]
        finally:
            await first.close()
            await second.close()

    again, fresh = run(body)
    assert 'text "stored=yes cookie=c=1"' in again.text
    assert 'text "stored=none cookie=none"' in fresh.text


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process that is not a zombie."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
            if stat[0] != "Z":
                found[int(entry.name)] = (int(stat[1]), cmdline)
    return found


def _chromiums() -> set[int]:
    """Chromium processes of this test: descendants of pytest, or orphans adopted by init
    (where a crash handler would end up); those of other sessions have other parents."""
    procs, me, found = _processes(), os.getpid(), set()
    for pid, (ppid, cmdline) in procs.items():
        if "chromium" not in cmdline:
            continue
        parent = ppid
        while parent not in (me, 0, 1) and parent in procs:
            parent = procs[parent][0]
        if parent == me or ppid == 1:
            found.add(pid)
    return found


def test_close_leaves_no_chromium_behind_and_tools_share_one_browser(servers):
    site, _ = servers
    before = _chromiums()  # orphans of someone else, if any
    seen: set[int] = set()
    owner = f"--agentrl-owner={os.getpid()}"

    def browsers() -> set[int]:
        return {pid for pid, (_, cmdline) in _processes().items() if owner in cmdline}

    async def body() -> None:
        first, second = tool(site), tool(site)
        await first(NO_SANDBOX, action="goto", url=site.origin + "/")
        await second(NO_SANDBOX, action="goto", url=site.origin + "/second")
        seen.update(_chromiums() - before)
        assert len(browsers()) == 1  # two tools, one browser process
        await first.close()
        await first.close()  # idempotent
        assert len(browsers()) == 1  # the second tool still uses it
        await second(NO_SANDBOX, action="read")
        await second.close()

    run(body)
    assert len(seen) >= 3  # the browser and its helpers (zygotes, renderers...)
    deadline = time.monotonic() + 5
    while (left := (_chromiums() - before) | (seen & set(_processes()))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert left == set() and browsers() == set()


def test_a_missing_chromium_raises_browser_error_with_the_fix(monkeypatch):
    monkeypatch.setenv("AGENTRL_CHROMIUM", "/nonexistent/chromium")

    async def body() -> None:
        browser = BrowserTool(start_url="http://127.0.0.1:9/")
        try:
            await browser(NO_SANDBOX, action="read")
        finally:
            await browser.close()

    with pytest.raises(BrowserError) as caught:
        run(body)
    assert "/nonexistent/chromium" in str(caught.value)
    assert caught.value.fix.startswith("apt-get install -y chromium")


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="allowed origin"):
        BrowserTool(allowed_origins=["127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="start_url"):
        BrowserTool(allowed_origins=["http://127.0.0.1:8000"], start_url="http://127.0.0.1:9/")
    assert BrowserTool(start_url="http://127.0.0.1:8000/a/b").allow.permits(
        "http://127.0.0.1:8000/other"
    )
    assert "allows no sites" in (BrowserTool().allow.refusal("http://127.0.0.1:1/") or "")


def test_the_allow_list_compares_origins_and_normalised_file_paths():
    allow = AllowList(["http://127.0.0.1:8123", "file:///srv/site"])
    for url in [
        "http://127.0.0.1:8123/a?b#c",
        "HTTP://127.0.0.1:8123/",
        "ws://127.0.0.1:8123/socket",
        "file:///srv/site/page.html",
        "file:///srv/site",
        "data:text/plain,hi",
    ]:
        assert allow.permits(url), url
    for url in [
        "http://127.0.0.1:8124/",
        "https://127.0.0.1:8123/",
        "http://localhost:8123/",
        "http://x@127.0.0.1:8123/",
        "file:///srv/site/../secret",
        "file:///srv/site%2f..%2fsecret",
        "file:///srv/sitex/page.html",
        "file://otherhost/srv/site/page.html",
        "chrome://version",
    ]:
        assert not allow.permits(url), url
    assert "malformed" in (allow.refusal("http://evil.example\\@127.0.0.1:8123/") or "")
    assert "only http(s) and file" in (allow.refusal("javascript:alert(1)") or "")
    assert allow.bypass == "127.0.0.1:8123"
