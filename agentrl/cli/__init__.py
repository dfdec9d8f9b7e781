"""The `agentrl` command line: the one place errors become a line for a person.

Every command runs inside `main`, which turns an AgentRLError into `error: ...` plus
`fix: ...` and exit code 1, Ctrl-C into exit 130, and any other exception into one
line that points at `--debug` (which shows the traceback instead). The commands live
by what they work on: episodes.py (run, check, replay, failures), configs.py (train,
validate), serving.py (sample, serve, serve-tinker), machine.py (doctor, images, gc,
cluster); parser.py names them all.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from collections.abc import Sequence

from agentrl import scratch
from agentrl.cli.output import err_console, tag
from agentrl.cli.parser import build_parser
from agentrl.errors import AgentRLError

__all__ = ["build_parser", "main"]


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so every finally (sandbox close, temp dirs) runs.
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("urllib3", "docker", "filelock", "httpx", "httpx2", "openai", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    scratch.reap()  # what killed agentrl processes left in the temp dir (agentrl.scratch)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        err_console.print("interrupted")
        return 130
    except AgentRLError as e:
        if args.debug:
            traceback.print_exc()
        err_console.print(tag("error:", "red", str(e)))
        if e.fix:
            err_console.print(tag("fix:", "yellow", e.fix))
        return 1
    except Exception as e:  # the CLI boundary: one line, traceback only with --debug
        if args.debug:
            traceback.print_exc()
        err_console.print(
            tag(
                "internal error:",
                "red",
                f"{type(e).__name__}: {e} (rerun with --debug for the traceback, and report it)",
            )
        )
        return 2
