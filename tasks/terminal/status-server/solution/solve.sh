#!/bin/bash
set -euo pipefail
cat > /app/status.py <<'PY'
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def settings() -> dict[str, str]:
    pairs = {}
    for line in open("/app/settings.ini"):
        if "=" in line:
            key, value = line.split("=", 1)
            pairs[key.strip()] = value.strip()
    return pairs


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/status":
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps({**settings(), "pid": os.getpid()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


ThreadingHTTPServer(("127.0.0.1", 8765), Handler).serve_forever()
PY
# Started as a user would start it in the terminal: in the background, and left running.
python3 /app/status.py > /dev/null 2>&1 < /dev/null &
for _ in $(seq 50); do
  python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:8765/status")' \
    2>/dev/null && exit 0
  sleep 0.1
done
echo "the service did not come up" >&2
exit 1
