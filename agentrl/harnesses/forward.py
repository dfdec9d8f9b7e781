"""Inside a sandbox with no network: listen on 127.0.0.1:PORT and pass each connection
to the agent gateway's Unix socket (mounted read-only from the host), so a harness in the
sandbox reaches its session at http://127.0.0.1:PORT. Python standard library only; it
runs on the sandbox's python3.

usage: python3 forward.py HOST PORT SOCKET READY_FILE
"""

import contextlib
import socket
import sys
import threading
from pathlib import Path


def pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def serve(client: socket.socket, path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(path)
    except OSError:
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
    back.start()
    pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main() -> None:
    host, port, path, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(64)
    Path(ready).touch()
    while True:
        client, _ = listener.accept()
        threading.Thread(target=serve, args=(client, path), daemon=True).start()


if __name__ == "__main__":
    main()
