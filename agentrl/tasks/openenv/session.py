"""One episode's session with an OpenEnv environment server: its WebSocket protocol, spoken
from this machine to the server inside the sandbox.

The sandbox has no network, so the server's port is reached through a relay: a few lines
of the image's own Python, started as the sandbox's interactive process (`Sandbox.shell`),
that put their terminal in raw mode (every byte passes unchanged), connect to the server's
port on the sandbox's loopback and copy bytes both ways. The WebSocket runs over that byte
stream with `websockets`' sans-I/O client, so it works wherever the sandbox's provider can
start an interactive process (a cluster node's sandbox too), with no port, socket file or
mount.

The messages are OpenEnv's (`openenv.core.env_server.http_server`, `/ws`): `reset`,
`step`, `state`, `mcp` (JSON-RPC `tools/list`), `close`; the server answers each with one
`observation`, `state`, `mcp` or `error` message.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from agentrl.sandbox.base import Shell

READY = b"AGENTRL-RELAY-READY"
RELAY = r"""
import os, select, socket, sys, termios, tty
if os.isatty(0):
    tty.setraw(0, termios.TCSANOW)
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.settimeout(None)
os.write(1, b"\nAGENTRL-RELAY-READY\n")
while True:
    ready, _, _ = select.select([0, s], [], [])
    if 0 in ready:
        data = os.read(0, 65536)
        if not data:
            break
        s.sendall(data)
    if s in ready:
        data = s.recv(65536)
        if not data:
            break
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]
"""
"""The relay, run by the image's `python3 -c`: stdin to the port, the port to stdout."""


class SessionLost(Exception):
    """The byte stream or the WebSocket ended: the server, or the relay, is gone."""


class EnvError(Exception):
    """The server answered a message with an error (`code`: OpenEnv's WSErrorCode)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


AGENT_ERRORS = frozenset({"VALIDATION_ERROR", "EXECUTION_ERROR", "INVALID_JSON"})
"""Error codes that answer what the agent sent (a bad action, an action the environment
refused or raised on); any other (CAPACITY_REACHED, FACTORY_ERROR, SESSION_ERROR,
UNKNOWN_TYPE) is the server's or agentrl's."""


class EnvSession:
    """A WebSocket session with one environment server, over a relay's byte stream."""

    def __init__(self, shell: Shell, *, timeout: float) -> None:
        self._shell = shell
        self._timeout = timeout
        self._ws = ClientProtocol(parse_uri("ws://localhost/ws"), max_size=None)
        self._buffer = b""

    async def open(self) -> None:
        """Wait for the relay, then the WebSocket handshake."""
        deadline = time.monotonic() + self._timeout
        while READY not in self._buffer:
            if time.monotonic() > deadline:
                raise SessionLost(
                    f"the relay did not start within {self._timeout:g} s: "
                    f"{self._buffer[-300:].decode(errors='replace')!r}"
                )
            self._buffer += await self._read(deadline)
        rest = self._buffer.split(READY, 1)[1].removeprefix(b"\r\n").removeprefix(b"\n")
        self._ws.send_request(self._ws.connect())
        await self._flush()
        if rest:
            self._ws.receive_data(rest)
        while self._ws.state is State.CONNECTING:
            self._feed(await self._read(deadline))
        if self._ws.handshake_exc is not None or self._ws.state is not State.OPEN:
            raise SessionLost(f"the WebSocket handshake failed: {self._ws.handshake_exc}")

    async def reset(self, **kwargs: Any) -> dict[str, Any]:
        return await self._expect({"type": "reset", "data": kwargs}, "observation")

    async def step(self, action: dict[str, Any]) -> dict[str, Any]:
        return await self._expect({"type": "step", "data": action}, "observation")

    async def state(self) -> dict[str, Any]:
        return await self._expect({"type": "state"}, "state")

    async def list_tools(self) -> list[dict[str, Any]]:
        """The environment's MCP tools (JSON-RPC `tools/list`; not a step)."""
        request = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
        reply = await self._expect({"type": "mcp", "data": request}, "mcp")
        if reply.get("error"):
            raise EnvError("MCP_ERROR", json.dumps(reply["error"])[:300])
        tools = (reply.get("result") or {}).get("tools")
        if not isinstance(tools, list):
            raise EnvError("MCP_ERROR", f"tools/list answered {json.dumps(reply)[:300]}")
        return tools

    async def close(self) -> None:
        """Say goodbye (best effort) and end the relay."""
        try:
            if self._ws.state is State.OPEN:
                self._send({"type": "close"})
                await self._flush()
        except Exception:  # the session is ending either way
            pass
        await self._shell.close()

    # ---- the wire --------------------------------------------------------------------

    async def _expect(self, message: dict[str, Any], kind: str) -> dict[str, Any]:
        self._send(message)
        await self._flush()
        reply = await self._reply(time.monotonic() + self._timeout)
        if reply.get("type") == "error":
            data = reply.get("data") or {}
            detail = str(data.get("message", ""))
            if isinstance(data.get("errors"), list):  # pydantic's, for an action that does not fit
                detail = "; ".join(
                    f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg', '')}"
                    for e in data["errors"]
                    if isinstance(e, dict)
                )
            raise EnvError(str(data.get("code", "UNKNOWN")), detail)
        if reply.get("type") != kind:
            raise EnvError("UNEXPECTED", f"expected {kind}, got {json.dumps(reply)[:300]}")
        data = reply.get("data")
        return data if isinstance(data, dict) else {}

    def _send(self, message: dict[str, Any]) -> None:
        self._ws.send_text(json.dumps(message).encode())

    async def _reply(self, deadline: float) -> dict[str, Any]:
        while True:
            for event in self._ws.events_received():
                if isinstance(event, Frame) and event.opcode is Opcode.TEXT:
                    try:
                        parsed = json.loads(bytes(event.data))
                    except json.JSONDecodeError as e:
                        raise SessionLost(f"the server sent a message that is no JSON: {e}") from e
                    return parsed if isinstance(parsed, dict) else {"type": "unexpected"}
            await self._flush()  # pongs, the closing handshake
            if self._ws.state is State.CLOSED or self._ws.close_rcvd is not None:
                raise SessionLost(f"the server closed the session ({self._ws.close_rcvd})")
            self._feed(await self._read(deadline))

    def _feed(self, data: bytes) -> None:
        self._ws.receive_data(data)

    async def _read(self, deadline: float) -> bytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SessionLost(f"no answer from the environment within {self._timeout:g} s")
        try:
            return await asyncio.to_thread(self._shell.read, min(left, 1.0))
        except EOFError as e:
            raise SessionLost("the relay to the environment's server ended") from e

    async def _flush(self) -> None:
        for data in self._ws.data_to_send():
            if data:
                await asyncio.to_thread(self._shell.send, data)
