"""How a command and its exit status travel through the bash tool's tty: the shell's
start-up settings, the command as short $'...' pieces, and the sentinel line that ends
its output. Apart from `bash.py`, which decides when to run, interrupt or restart."""

from __future__ import annotations

import re

from agentrl.sandbox.base import HeadTail

SHELL_ARGV = ["bash", "--norc", "--noprofile", "--noediting"]
EDITOR_MSG = "interactive editors do not work here: use str_replace_editor, sed or cat"
SETUP = (
    "stty -echo -onlcr cols 200 rows 50 2>/dev/null; "
    # Prompts would land in the output: keep them empty even after `activate` sets PS1.
    "export PS1='' PS2='' PROMPT_COMMAND='PS1= PS2=' VIRTUAL_ENV_DISABLE_PROMPT=1 TERM=dumb "
    "PAGER=cat GIT_PAGER=cat MANPAGER=cat SYSTEMD_PAGER=cat LESS=-FRX "
    "GIT_EDITOR=true EDITOR=true VISUAL=true GIT_TERMINAL_PROMPT=0 "
    "DEBIAN_FRONTEND=noninteractive PIP_NO_INPUT=1 PYTHONUNBUFFERED=1; "
    "unset HISTFILE; "
    'less() { cat "$@"; }; more() { cat "$@"; }; '
    + "; ".join(
        f"{e}() {{ echo '{EDITOR_MSG}' >&2; return 1; }}" for e in ("vi", "vim", "nano", "emacs")
    )
    + "; "
)


_PLAIN = frozenset(
    b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-+=.,:;/@%^&*()[]{}<>|!?#~`$"'
)


def ansi_c_chunks(command: str, width: int = 1000) -> list[str]:
    """The command as bash $'...' bodies (\\xHH for anything not plain), in short pieces:
    each typed line stays far below the tty's 4096-byte line limit, and nothing in the
    command can end the quoting or leave the shell waiting for more input."""
    tokens = [chr(b) if b in _PLAIN else f"\\x{b:02x}" for b in command.encode()]
    chunks, current = [], ""
    for token in tokens:
        if len(current) + len(token) > width:
            chunks.append(current)
            current = ""
        current += token
    return [*chunks, current]


def sentinel_cmd(nonce: str, status: str = "$?") -> str:
    # The typed text never contains the finished sentinel: printf assembles it.
    return f"printf '\\n__AGENTRL_%s_%d__\\n' {nonce} {status}"


# After each command: a program (or `stty`) may have left the tty echoing, raw, or
# translating newlines, which would garble every later observation.
TTY_RESET = "stty sane -echo -onlcr 2>/dev/null"

# The shell's working directory and exported variables (an activated venv's PATH too),
# saved in the sandbox after every command with builtins only, so a snapshot holds them;
# the first shell a tool starts in a sandbox restored from one (a resume, a branch, a
# replay) takes them back, as the agent left them. A restart after a hazard does not: it
# is meant to reset. Processes (a server started with `&`) are not in a snapshot. A
# sandbox whose /tmp is not its own (the local provider's) names a file of its own.
STATE_FILE = '"${AGENTRL_SHELL_STATE:-/tmp/.agentrl-shell-state}"'
SAVE_STATE = f"{{ printf 'cd -- %q\\n' \"$PWD\"; export -p; }} > {STATE_FILE} 2>/dev/null"
RESTORE_STATE = (
    f'if [ -r {STATE_FILE} ]; then __agentrl_h="$HOSTNAME"; . {STATE_FILE} >/dev/null 2>&1; '
    'HOSTNAME="$__agentrl_h"; unset __agentrl_h; fi; '
)


def sentinel_re(nonce: str) -> re.Pattern[bytes]:
    # No leading `\n?`: a pattern that starts with a literal is searched ~30x faster (100 MB
    # of output cost ~5 s of CPU with it); `Output.feed` drops the newline before it.
    return re.compile(rb"__AGENTRL_" + nonce.encode() + rb"_(\d+)__\n")


_SENTINEL_MAX = 80  # bytes; longer than any sentinel line


class Output:
    """The command's output (head and tail, bounded) up to the sentinel line.

    The last few bytes are held back until it is clear they are not the start of
    the sentinel, so the sentinel never leaks into what the agent sees."""

    def __init__(self, keep: int, pattern: re.Pattern[bytes]) -> None:
        self.kept = HeadTail(keep)
        self.pattern = pattern
        self.pending = b""
        self.match: re.Match[bytes] | None = None

    def feed(self, chunk: bytes) -> bool:
        """Add bytes; True once the sentinel has been seen."""
        data = self.pending + chunk
        self.match = self.pattern.search(data)
        if self.match is not None:
            start = self.match.start()
            self.kept.feed(data[: start - 1 if data[start - 1 : start] == b"\n" else start])
            self.pending = b""
            return True
        self.kept.feed(data[:-_SENTINEL_MAX])
        self.pending = data[-_SENTINEL_MAX:]
        return False

    def text(self) -> str:
        self.kept.feed(self.pending)  # no sentinel is coming: the held bytes are output
        self.pending = b""
        return self.kept.text()
