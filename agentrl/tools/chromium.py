"""Chromium for the browser tool: one process per event loop, shared by reference count.

A context costs ~0.5 s, a launch ~2 s, so the browser tools on one loop share one
Chromium; the last `release()` stops it. Each Chromium carries its launcher's pid on
its command line, so an `atexit` backstop kills those this process launched and a
later launch kills those whose launcher died. Every Chromium sends its traffic through
a proxy that refuses every connection (a bound, never-listening port); a context lets
only its allowed origins bypass it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import weakref
from pathlib import Path

from playwright.async_api import Browser, Playwright, async_playwright
from playwright.async_api import Error as PlaywrightError

from agentrl import errors
from agentrl.errors import BrowserError
from agentrl.scratch import pid_alive

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


class Chromium:
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
            raise BrowserError(f"Chromium at {path} did not start: {first_line(e)}") from e

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


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Chromium] = (
    weakref.WeakKeyDictionary()
)


@functools.cache
def _register_atexit() -> None:
    atexit.register(_reap, orphans_only=False)


def shared() -> Chromium:
    """The Chromium of the running event loop."""
    return _SHARED.setdefault(asyncio.get_running_loop(), Chromium())


def first_line(error: BaseException) -> str:
    """An error's first line without Playwright's prefix ("Locator.fill: Error: ...")."""
    return re.sub(r"^(\w+\.\w+: )?(Error: )?", "", errors.first_line(error))
