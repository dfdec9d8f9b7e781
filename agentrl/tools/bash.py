"""The bash tool: one persistent shell per sandbox, driven through its pty (`Sandbox.shell`).

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
the host (`Metered.usage`: nothing runs inside) every ~0.5 s while a command runs, before
and right after each (watching a little longer while what it left keeps multiplying: a
fork bomb returns at once), and between commands by one watch for all idle shells
(`IdleWatch`: a fixed share of a core, whatever the fleet). When forks were refused at
the pids limit, the OOM killer ran, the sandbox wrote past its disk limit, or, with no
command running, more than `max_background` processes are left, every process the agent
started is stopped and a new shell started; the observation (the next one, if no
command was running) says why in one line.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from agentrl.errors import SandboxError
from agentrl.sandbox.base import ExecRequest, Metered, Sandbox, Shell, Usage
from agentrl.tools.base import ModelTool, Observation, ToolArgs, ToolOptions
from agentrl.tools.bash_watch import WATCH_S, IdleWatch, grew, mib, over_disk
from agentrl.tools.bash_wire import (
    RESTORE_STATE,
    SAVE_STATE,
    SETUP,
    SHELL_ARGV,
    TTY_RESET,
    Output,
    ansi_c_chunks,
    sentinel_cmd,
    sentinel_re,
)

SETTLE_S = 0.5  # after a command, how long to watch processes it left while they multiply
PAST_DISK = "the sandbox wrote past its disk limit"
CLEARED = (
    "every process the agent started was stopped and a new shell started (working "
    "directory and environment are reset)"
)


class BashArgs(ToolArgs):
    # Other arguments are ignored, as they always were (the schema shows no
    # additionalProperties: what models were shown stays as it was).
    model_config = ConfigDict(extra="ignore")

    command: str = Field(description="the command to run")

    @field_validator("command")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("`command` must be a non-empty string")
        return value


class BashOptions(ToolOptions):
    timeout: float = Field(default=60.0, gt=0, description="seconds a command may run")
    max_output_bytes: int = Field(
        default=20_000, gt=0, description="output kept per command (head and tail)"
    )
    shell_argv: list[str] | None = Field(default=None, description="the shell to start")
    max_background: int | None = Field(
        default=None,
        ge=0,
        description="processes (threads count too, as the pids limit counts them) a command "
        "may leave running once it returns, e.g. a server the task asks for; with more, every "
        "process the agent started is stopped. None: half the sandbox's pids",
    )
    interrupt_grace: float = Field(
        default=8.0,
        gt=0,
        description="seconds a shell may take to answer after Ctrl-C before it is restarted "
        "(generous: on a loaded machine a healthy shell can take seconds, and a needless "
        "restart loses its state)",
    )


class BashTool(ModelTool[BashArgs, BashOptions]):
    """Run a bash command in the sandbox's persistent shell."""

    name = "bash"
    description = (
        "Run a bash command in a persistent shell (cd, exported variables and activated "
        "virtualenvs persist between calls). stdin is empty: interactive programs get EOF. "
        "Long output keeps its head and tail."
    )
    Args = BashArgs
    Options = BashOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.timeout = self.options.timeout
        self.keep_bytes = self.options.max_output_bytes // 2  # head and tail each
        self.shell_argv = self.options.shell_argv or SHELL_ARGV
        self.max_background = self.options.max_background
        self._shell: Shell | None = None
        self._sandbox: Sandbox | None = None
        self._lock = asyncio.Lock()
        self._baseline: int | None = None  # processes with a fresh, idle shell
        self._seen: Usage | None = None  # the last look at the sandbox's usage
        self._idle: IdleWatch | None = None  # the watch between commands, shared
        self._pending: list[str] = []  # what the idle watch did, for the next observation

    async def run(self, sandbox: Sandbox, args: BashArgs) -> Observation:
        async with self._lock:
            return await self._run(sandbox, args.command, self.timeout)

    async def _run(self, sandbox: Sandbox, command: str, timeout: float) -> Observation:
        if self._shell is None or not self._shell.alive() or self._sandbox is not sandbox:
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
            + "".join(f"__agentrl_cmd+=$'{chunk}'\n" for chunk in ansi_c_chunks(command))
            + f'eval "$__agentrl_cmd" < /dev/null; __agentrl_rc=$?; {SAVE_STATE}; {TTY_RESET}; '
            + f"{sentinel_cmd(nonce, '$__agentrl_rc')}\n"
        )
        out = Output(self.keep_bytes, sentinel_re(nonce))
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
            if grew(seen.pids_refused, now.pids_refused):
                return f"the sandbox ran out of processes (its limit is {spec.pids})"
            if grew(seen.oom_kills, now.oom_kills):
                return (
                    f"the sandbox ran out of memory (its limit is {spec.memory_mb} MiB) and the "
                    "kernel killed a process"
                )
            if over_disk(now, spec.disk_mb) and grew(seen.disk_bytes, now.disk_bytes):
                return (
                    f"{PAST_DISK} ({mib(now.disk_bytes)} MiB of {spec.disk_mb} MiB; delete "
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

    async def look_idle(self, sandbox: Sandbox) -> bool:
        """Between commands, the same look (a background writer filling the disk, a bomb
        ripening); what it does is told with the next observation. False: stop watching
        (the shell or the sandbox is gone)."""
        if self._lock.locked():  # a command runs: its own watch looks
            return True
        async with self._lock:
            if self._sandbox is not sandbox or self._shell is None:
                return False
            try:
                if hazard := await self._hazard(sandbox, idle=True):
                    await self._clear(sandbox)
                    self._pending.append(f"while no command ran, {hazard}: {CLEARED}")
            except SandboxError:  # gone or closed: the next command reports it
                return False
            return True

    def _disk_note(self, sandbox: Sandbox) -> str | None:
        seen, limit = self._seen, sandbox.spec.disk_mb
        if seen is None or not over_disk(seen, limit):
            return None
        return (
            f"the sandbox holds {mib(seen.disk_bytes)} MiB, over its {limit} MiB disk limit: "
            "delete files before writing more (a command that writes more is stopped)"
        )

    async def _clear(self, sandbox: Sandbox) -> None:
        """Stop every process the agent started, then start a new shell."""
        if isinstance(sandbox, Metered):
            await sandbox.stop_processes()
        await self._restart(sandbox)

    def _exchange(self, script: str, out: Output, timeout: float) -> str:
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
                chunk = shell.read(min(left, 1.0))
            except EOFError:
                return "eof"
            if chunk and out.feed(chunk):
                return "done"

    def _interrupt(self) -> bool:
        """Ctrl-C, then probe: True when the shell answers a fresh sentinel."""
        shell = self._shell
        assert shell is not None
        nonce = secrets.token_hex(6)
        try:
            shell.send(b"\x03")
            time.sleep(0.2)
            shell.send(f"\n{sentinel_cmd(nonce)}\n".encode())
        except OSError:
            return False
        probe = Output(4096, sentinel_re(nonce))
        # Only a shell that ignores Ctrl-C waits the whole grace out.
        deadline = time.monotonic() + self.options.interrupt_grace
        while time.monotonic() < deadline:
            try:
                chunk = shell.read(0.5)
            except EOFError:
                return False
            if chunk and probe.feed(chunk):
                return True
        return False

    async def _start(self, sandbox: Sandbox) -> None:
        if self._shell is not None:
            await self._kill()
        first = self._sandbox is not sandbox  # this tool's first shell in this sandbox
        if first:
            self._baseline = self._seen = None
            self._stop_idle()
        self._sandbox = sandbox
        self._shell = await sandbox.shell(self.shell_argv)
        nonce = secrets.token_hex(6)
        workdir = sandbox.spec.workdir.replace("'", "'\\''")
        restore = RESTORE_STATE if first else ""  # a restored sandbox: the shell as it was
        script = f"{SETUP}cd '{workdir}' 2>/dev/null; {restore}{sentinel_cmd(nonce)}\n"
        out = Output(1 << 16, sentinel_re(nonce))
        status = await asyncio.to_thread(self._exchange, script, out, 30.0)
        if status != "done" or out.match is None:
            why = f"the bash shell in sandbox {sandbox.id} did not start ({status})"
            raise await _why_not_started(sandbox, SandboxError(why))
        if isinstance(sandbox, Metered):
            self._seen = await sandbox.usage()
            if self._baseline is None:  # a fresh shell in a sandbox the agent has not used
                self._baseline = self._seen.processes
            if self._idle is None:
                self._idle = IdleWatch.of_loop()
                self._idle.add(self, sandbox)

    async def _restart(self, sandbox: Sandbox) -> None:
        await self._kill()
        await self._start(sandbox)

    async def _kill(self) -> None:
        """Kill the shell and everything in its session (a wedged `less`, `vim`...)."""
        shell, self._shell = self._shell, None
        if shell is not None:
            await shell.close()

    def _stop_idle(self) -> None:
        if self._idle is not None:
            self._idle.remove(self)
            self._idle = None

    async def close(self, *, keep_processes: bool = False) -> None:
        """Kill the shell; idempotent. The sandbox itself is closed by its owner.
        `keep_processes`: only stop watching; the shell and its jobs (a server started with
        `&`) live on, untouched, until a plain `close()`."""
        self._stop_idle()
        if keep_processes:
            return
        if self._shell is not None:
            try:
                await self._kill()
            except Exception:  # a sandbox that is already gone took the shell with it
                self._shell = None


async def _why_not_started(sandbox: Sandbox, failed: SandboxError) -> SandboxError:
    """Why a shell did not start: where the container stopped under it (an agent's
    `kill -9 -1` stops it a moment after its command returns), the sandbox's own account
    of the stop (SandboxBroken when the agent did it); else `failed`. The engine gets a
    few seconds to finish stopping it."""
    for _ in range(6):
        try:
            await sandbox.exec(ExecRequest(command=["true"], timeout=10))
        except SandboxError as stopped:
            return stopped
        await asyncio.sleep(0.5)
    return failed
