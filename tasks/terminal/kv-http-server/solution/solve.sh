#!/bin/bash
set -euo pipefail
cat > /app/kvserver.py <<'PY'
#!/usr/bin/env python3
"""An in-memory key-value store over HTTP on 127.0.0.1."""

import argparse
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEY = re.compile(r"^/kv/([A-Za-z0-9._-]+)$")
store: dict[str, bytes] = {}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def reply(self, status: int, body: bytes = b"", kind: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            return self.reply(200, b"ok")
        if self.path == "/kv":
            with lock:
                keys = sorted(store)
            return self.reply(200, json.dumps(keys).encode(), "application/json")
        match = KEY.match(self.path)
        with lock:
            value = store.get(match.group(1)) if match else None
        if value is None:
            return self.reply(404, b"not found")
        return self.reply(200, value, "application/octet-stream")

    def do_PUT(self) -> None:
        match = KEY.match(self.path)
        if not match:
            return self.reply(404, b"not found")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with lock:
            new = match.group(1) not in store
            store[match.group(1)] = body
        return self.reply(201 if new else 200)

    def do_DELETE(self) -> None:
        match = KEY.match(self.path)
        with lock:
            found = bool(match) and store.pop(match.group(1), None) is not None
        return self.reply(204) if found else self.reply(404, b"not found")

    def do_POST(self) -> None:
        self.reply(404, b"not found")

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
PY
