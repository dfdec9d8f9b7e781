"""The bash tool: one persistent shell per sandbox, driven through a pty with pexpect.

How a command runs: its text travels as short bash $'...' strings with every unusual
byte escaped (so no quoting, line-length or unbalanced-syntax problem can leave the
shell waiting for more input, and no process is forked to decode it); it is `eval`ed
in the shell itself (so `cd`, exports and an activated venv persist) with stdin from
/dev/null (so `cat`, `read` or a REPL get EOF instead of waiting), followed by a
sentinel line carrying a per-call nonce and `$?`. The reader keeps only the head and
tail of the output, so 100 MB of output costs no memory on either side.

On timeout the tool sends Ctrl-C and probes the shell with a fresh sentinel; if the
shell does not answer, it is killed (with everything in its session) and a new one is
started, and the observation says so. Pagers and editors are neutralised
(PAGER=cat, GIT_PAGER=cat, GIT_EDITOR=true, `less`/`vim` as shell functions); the tty's
settings are restored after every command (`stty sane -echo -onlcr`).

One guard keeps a command from starving the next: the sandbox's counters are read from
the host (`Metered.usage`: nothing runs inside) every ~0.5 s, while a command runs and
between commands, and right after each (watching a little longer while what it left
keeps multiplying: a fork bomb returns at once). When forks were refused at the pids
limit, the OOM killer ran, the sandbox wrote past its disk limit, or, with no command
running, more than `max_background` processes are left, every process the agent
started is stopped and a new shell started; the observation (the next one, if no
command was running) says why in one line.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from typing import Annotated, Any

import pexpect
from pexpect.spawnbase import SpawnBase
from pydantic import Field

from agentrl.errors import ConfigError, SandboxError
from agentrl.sandbox.base import HeadTail, Metered, Sandbox, Usage
from agentrl.tools.base import Observation

SHELL_ARGV = ["bash", "--norc", "--noprofile", "--noediting"]
_EDITOR_MSG = "interactive editors do not work here: use str_replace_editor, sed or cat"
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
        f"{e}() {{ echo '{_EDITOR_MSG}' >&2; return 1; }}" for e in ("vi", "vim", "nano", "emacs")
    )
    + "; "
)


_PLAIN = frozenset(
    b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-+=.,:;/@%^&*()[]{}<>|!?#~`$"'
)


def _ansi_c_chunks(command: str, width: int = 1000) -> list[str]:
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


def _sentinel_cmd(nonce: str, status: str = "$?") -> str:
    # The typed text never contains the finished sentinel: printf assembles it.
    return f"printf '\\n__AGENTRL_%s_%d__\\n' {nonce} {status}"


# After each command: a program (or `stty`) may have left the tty echoing, raw, or
# translating newlines, which would garble every later observation.
_TTY_RESET = "stty sane -echo -onlcr 2>/dev/null"
WATCH_S = 0.5  # usage is read this often while a command runs (less often if reading is slow)
SETTLE_S = 0.5  # after a command, how long to watch processes it left while they multiply
PAST_DISK = "the sandbox wrote past its disk limit"
CLEARED = (
    "every process the agent started was stopped and a new shell started (working "
    "directory and environment are reset)"
)


def _sentinel_re(nonce: str) -> re.Pattern[bytes]:
    return re.compile(rb"\n?__AGENTRL_" + nonce.encode() + rb"_(\d+)__\n")


_SENTINEL_MAX = 80  # bytes; longer than any sentinel line


class _Output:
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
            self.kept.feed(data[: self.match.start()])
            self.pending = b""
            return True
        self.kept.feed(data[:-_SENTINEL_MAX])
        self.pending = data[-_SENTINEL_MAX:]
        return False

    def text(self) -> str:
        self.kept.feed(self.pending)  # no sentinel is coming: the held bytes are output
        self.pending = b""
        return self.kept.text()


class BashTool:
    """Run a bash command in the sandbox's persistent shell."""

    name = "bash"
    description = (
        "Run a bash command in a persistent shell (cd, exported variables and activated "
        "virtualenvs persist between calls). stdin is empty: interactive programs get EOF. "
        "Long output keeps its head and tail."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the command to run"}},
        "required": ["command"],
    }

    def __init__(
        self,
        *,
        timeout: float = 60.0,
        max_output_bytes: int = 20_000,
        shell_argv: list[str] | None = None,
        max_background: Annotated[int, Field(ge=0)] | None = None,
    ) -> None:
        """`max_background`: processes (threads count too, as the pids limit counts them) a
        command may leave running once it returns, e.g. a server the task asks for; with
        more, every process the agent started is stopped. None: half the sandbox's pids."""
        if max_background is not None and max_background < 0:
            raise ConfigError(f"bash: max_background must be >= 0, got {max_background}")
        self.timeout = timeout
        self.keep_bytes = max_output_bytes // 2  # head and tail each
        self.shell_argv = shell_argv or SHELL_ARGV
        self.max_background = max_background
        self._shell: SpawnBase | None = None
        self._sandbox: Sandbox | None = None
        self._lock = asyncio.Lock()
        self._baseline: int | None = None  # processes with a fresh, idle shell
        self._seen: Usage | None = None  # the last look at the sandbox's usage
        self._idle: asyncio.Task[None] | None = None  # the watch between commands
        self._pending: list[str] = []  # what the idle watch did, for the next observation

    async def __call__(self, sandbox: Sandbox, **arguments: Any) -> Observation:
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return Observation(text="error: `command` must be a non-empty string", error=True)
        async with self._lock:
            return await self._run(sandbox, command, self.timeout)

    async def _run(self, sandbox: Sandbox, command: str, timeout: float) -> Observation:
        if self._shell is None or not self._shell.isalive() or self._sandbox is not sandbox:
            await self._start(sandbox)
        notes, self._pending = self._pending, []
        assert self._shell is not None
        # Something a previous command left may have ripened meanwhile (a fork bomb).
        if hazard := await self._hazard(sandbox, idle=True):
            await self._clear(sandbox)
            notes.append(f"before this command ran, {hazard}: {CLEARED}")
        started_with = self._seen.processes if self._seen else None
        nonce = secrets.token_hex(6)
        script = (
            "__agentrl_cmd=''\n"
            + "".join(f"__agentrl_cmd+=$'{chunk}'\n" for chunk in _ansi_c_chunks(command))
            + f'eval "$__agentrl_cmd" < /dev/null; __agentrl_rc=$?; {_TTY_RESET}; '
            + f"{_sentinel_cmd(nonce, '$__agentrl_rc')}\n"
        )
        out = _Output(self.keep_bytes, _sentinel_re(nonce))
        exchange = asyncio.ensure_future(asyncio.to_thread(self._exchange, script, out, timeout))
        hazard = await self._watch(sandbox, exchange)
        status = await exchange
        exit_code: int | None = None
        if status == "done":
            assert out.match is not None
            exit_code = int(out.match.group(1))
        if hazard:  # the watch stopped every process, the shell too
            notes.append(f"{hazard}: {CLEARED}")
            await self._restart(sandbox)
        elif status == "eof":
            notes.append(
                "the shell exited (did the command run `exit` or `exec`?); a new shell "
                "was started: working directory and environment are reset"
            )
            await self._restart(sandbox)
        elif status == "timeout":
            recovered = await asyncio.to_thread(self._interrupt)
            if recovered:
                notes.append(
                    f"the command timed out after {timeout:g} s and was interrupted (Ctrl-C)"
                )
            else:
                notes.append(
                    f"the command timed out after {timeout:g} s and the shell did not recover from "
                    "Ctrl-C; it was killed and a new shell started: working directory and "
                    "environment are reset"
                )
                await self._restart(sandbox)
        if not hazard and (hazard := await self._settle(sandbox, started_with)):
            await self._clear(sandbox)
            notes.append(f"{hazard}: {CLEARED}")
        if (over := self._disk_note(sandbox)) and not (hazard and hazard.startswith(PAST_DISK)):
            notes.append(over)
        text = out.text()
        if not text.strip():
            text = "(no output)"
        if exit_code not in (None, 0):
            text = text.rstrip("\n") + f"\n[exit code {exit_code}]"
        if notes:
            text = text.rstrip("\n") + "\n" + "\n".join(f"[{n}]" for n in notes)
        return Observation(text=text, exit_code=exit_code, error=status != "done" or bool(hazard))

    async def _hazard(self, sandbox: Sandbox, *, idle: bool) -> str | None:
        """Look at the sandbox's usage; why its processes must be stopped, or None.

        Counters are compared with the previous look. `idle`: the shell runs no command,
        so whatever runs beyond a fresh shell was left behind."""
        if not isinstance(sandbox, Metered):
            return None
        now = await sandbox.usage()
        seen, self._seen = self._seen, now
        spec = sandbox.spec
        if seen is not None:
            if _grew(seen.pids_refused, now.pids_refused):
                return f"the sandbox ran out of processes (its limit is {spec.pids})"
            if _grew(seen.oom_kills, now.oom_kills):
                return (
                    f"the sandbox ran out of memory (its limit is {spec.memory_mb} MiB) and the "
                    "kernel killed a process"
                )
            if _over_disk(now, spec.disk_mb) and _grew(seen.disk_bytes, now.disk_bytes):
                return (
                    f"{PAST_DISK} ({_mib(now.disk_bytes)} MiB of {spec.disk_mb} MiB; delete "
                    "files to go on)"
                )
        if idle and now.processes is not None and self._baseline is not None:
            left = now.processes - self._baseline
            allowed = self.max_background
            allowed = spec.pids // 2 if allowed is None else allowed
            if left > allowed:
                return f"{left} processes were left running (at most {allowed} may stay)"
        return None

    async def _watch(self, sandbox: Sandbox, exchange: asyncio.Future[str]) -> str | None:
        """While a command runs: stop every process the moment a limit is hit; the reason."""
        if not isinstance(sandbox, Metered):
            return None
        pause = WATCH_S
        while True:
            done, _ = await asyncio.wait({exchange}, timeout=pause)
            if done:
                return None
            looked = time.monotonic()
            hazard = await self._hazard(sandbox, idle=False)
            # A large writable layer is walked more rarely: the watch costs <= ~10% of a core.
            pause = max(WATCH_S, 10 * (time.monotonic() - looked))
            if hazard:
                await sandbox.stop_processes()
                return hazard

    async def _settle(self, sandbox: Sandbox, started_with: int | None) -> str | None:
        """After a command: look again, and while what it left keeps multiplying (a fork
        bomb returns at once), keep looking for up to SETTLE_S."""
        hazard = await self._hazard(sandbox, idle=True)
        previous = started_with
        deadline = time.monotonic() + SETTLE_S
        while hazard is None and self._seen is not None and time.monotonic() < deadline:
            current = self._seen.processes
            if current is None or previous is None or current <= previous:
                break  # nothing new is running, or it stopped growing
            previous = current
            await asyncio.sleep(0.05)
            hazard = await self._hazard(sandbox, idle=True)
        return hazard

    async def _watch_idle(self, sandbox: Sandbox) -> None:
        """Between commands, the same look every WATCH_S (a background writer filling the
        disk, a bomb ripening); what it does is told with the next observation."""
        pause = WATCH_S
        while True:
            await asyncio.sleep(pause)
            if self._lock.locked():  # a command runs: its own watch looks
                continue
            async with self._lock:
                if self._sandbox is not sandbox or self._shell is None:
                    return
                looked = time.monotonic()
                try:
                    if hazard := await self._hazard(sandbox, idle=True):
                        await self._clear(sandbox)
                        self._pending.append(f"while no command ran, {hazard}: {CLEARED}")
                except SandboxError:  # gone or closed: the next command reports it
                    return
                pause = max(WATCH_S, 10 * (time.monotonic() - looked))

    def _disk_note(self, sandbox: Sandbox) -> str | None:
        seen, limit = self._seen, sandbox.spec.disk_mb
        if seen is None or not _over_disk(seen, limit):
            return None
        return (
            f"the sandbox holds {_mib(seen.disk_bytes)} MiB, over its {limit} MiB disk limit: "
            "delete files before writing more (a command that writes more is stopped)"
        )

    async def _clear(self, sandbox: Sandbox) -> None:
        """Stop every process the agent started, then start a new shell."""
        if isinstance(sandbox, Metered):
            await sandbox.stop_processes()
        await self._restart(sandbox)

    def _exchange(self, script: str, out: _Output, timeout: float) -> str:
        """Send the script and read until the sentinel; 'done', 'timeout' or 'eof'."""
        shell = self._shell
        assert shell is not None
        shell.send(script.encode())
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            try:
                chunk = shell.read_nonblocking(size=1 << 16, timeout=min(left, 1.0))
            except pexpect.TIMEOUT:
                continue
            except pexpect.EOF:
                return "eof"
            if out.feed(chunk):
                return "done"

    def _interrupt(self) -> bool:
        """Ctrl-C, then probe: True when the shell answers a fresh sentinel."""
        shell = self._shell
        assert shell is not None
        nonce = secrets.token_hex(6)
        try:
            shell.send(b"\x03")
            time.sleep(0.2)
            shell.send(f"\n{_sentinel_cmd(nonce)}\n".encode())
        except OSError:
            return False
        probe = _Output(4096, _sentinel_re(nonce))
        # Generous: on a loaded machine a healthy shell can take seconds to answer, and a
        # needless restart loses its state; only a shell that ignores Ctrl-C waits it out.
        deadline = time.monotonic() + 8.0
        while time.monotonic() < deadline:
            try:
                chunk = shell.read_nonblocking(size=1 << 16, timeout=0.5)
            except pexpect.TIMEOUT:
                continue
            except pexpect.EOF:
                return False
            if probe.feed(chunk):
                return True
        return False

    async def _start(self, sandbox: Sandbox) -> None:
        if self._shell is not None:
            await self._kill(sandbox)
        if self._sandbox is not sandbox:
            self._baseline = self._seen = None
            self._stop_idle()
        self._sandbox = sandbox
        self._shell = await sandbox.shell(self.shell_argv)
        self._shell.delaybeforesend = None  # pexpect sleeps 50 ms before each send otherwise
        nonce = secrets.token_hex(6)
        workdir = sandbox.spec.workdir.replace("'", "'\\''")
        script = f"{SETUP}cd '{workdir}' 2>/dev/null; {_sentinel_cmd(nonce)}\n"
        out = _Output(1 << 16, _sentinel_re(nonce))
        status = await asyncio.to_thread(self._exchange, script, out, 30.0)
        if status != "done" or out.match is None:
            raise SandboxError(f"the bash shell in sandbox {sandbox.id} did not start ({status})")
        if isinstance(sandbox, Metered):
            self._seen = await sandbox.usage()
            if self._baseline is None:  # a fresh shell in a sandbox the agent has not used
                self._baseline = self._seen.processes
            if self._idle is None:
                self._idle = asyncio.create_task(self._watch_idle(sandbox))

    async def _restart(self, sandbox: Sandbox) -> None:
        await self._kill(sandbox)
        await self._start(sandbox)

    async def _kill(self, sandbox: Sandbox) -> None:
        """Kill the shell and everything in its session (a wedged `less`, `vim`...)."""
        shell, self._shell = self._shell, None
        if shell is not None:
            await sandbox.kill_shell(shell)

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    async def close(self) -> None:
        """Kill the shell; idempotent. The sandbox itself is closed by its owner."""
        self._stop_idle()
        if self._sandbox is not None and self._shell is not None:
            try:
                await self._kill(self._sandbox)
            except Exception:  # a sandbox that is already gone took the shell with it
                self._shell = None


def _grew(before: int | None, after: int | None) -> bool:
    return before is not None and after is not None and after > before


def _over_disk(usage: Usage, limit_mb: int) -> bool:
    return usage.disk_bytes is not None and usage.disk_bytes > limit_mb * 1024 * 1024


def _mib(n: int | None) -> int:
    return (n or 0) // (1024 * 1024)
