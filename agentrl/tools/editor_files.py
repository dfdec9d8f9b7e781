"""What the `str_replace_editor` tool does to files: bytes in and out of the sandbox, the
text of a file as lines, and what is shown of it.

Files are read and written as bytes, so an edit changes exactly the edited text: no
tab expansion, CRLF line endings and a missing final newline are kept, and a file that
is not UTF-8 text is never rewritten. What goes wrong because of the agent (a missing
file, a directory, no permission) raises `Refused`, which the tool shows as an error
observation; only sandbox failures raise anything else.
"""

from __future__ import annotations

import posixpath
import shlex

from agentrl.errors import SandboxError
from agentrl.sandbox.base import ExecRequest, ExecResult, Sandbox


class Refused(Exception):
    """An agent mistake; the tool turns it into an error observation (never escapes)."""


class Missing(Refused):
    pass


class Directory(Refused):
    pass


class Text:
    """A UTF-8 file split into lines; CRLF files are edited as LF and written back as CRLF."""

    def __init__(self, path: str, data: bytes) -> None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or "\x00" in text:
            raise Refused(
                f"{path} is a binary file ({len(data)} bytes), not UTF-8 text; "
                "str_replace_editor does not change binary files. Use bash to inspect it."
            )
        # Only a file whose every line ends in CRLF is normalised; mixed files stay as is.
        self.crlf = "\r\n" in text and text.count("\r\n") == text.count("\n")
        self.text = text.replace("\r\n", "\n") if self.crlf else text

    def lines(self) -> list[str]:
        return lines(self.text)

    def normalise(self, s: str) -> str:
        return s.replace("\r\n", "\n") if self.crlf else s

    def encode(self, text: str) -> bytes:
        return (text.replace("\n", "\r\n") if self.crlf else text).encode("utf-8")


def lines(text: str) -> list[str]:
    """The lines as `cat -n` counts them (no phantom line after a final newline)."""
    if not text:
        return []
    return (text[:-1] if text.endswith("\n") else text).split("\n")


def number(rows: list[str], first: int) -> str:
    """Lines numbered like `cat -n`: six-wide right-aligned number, a tab, the line."""
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(rows, start=first))


def clip(text: str, limit: int) -> str:
    """At most `limit` characters: head and tail kept around an elision marker."""
    if len(text) <= limit:
        return text
    keep = max(limit - 60, 0)  # room for the marker
    head = text[: keep * 2 // 3]
    tail = text[len(text) - keep // 3 :] if keep // 3 else ""
    elided = len(text) - len(head) - len(tail)
    return f"{head}\n<response clipped: {elided} characters elided>\n{tail}"


def occurrences(text: str, sub: str) -> list[int]:
    """Start offsets of every occurrence of `sub`, overlapping ones included."""
    starts, i = [], text.find(sub)
    while i != -1:
        starts.append(i)
        i = text.find(sub, i + 1)
    return starts


async def read(sandbox: Sandbox, path: str) -> bytes:
    try:
        return await sandbox.read_file(path)
    except FileNotFoundError as e:
        raise Missing(f"The path {path} does not exist. Please provide a valid path.") from e
    except PermissionError as e:
        raise Refused(f"Permission denied reading {path}.") from e
    except IsADirectoryError as e:
        raise Directory(f"{path} is a directory; this command works on files.") from e
    except SandboxError as e:
        # Providers may report a directory as a plain SandboxError: ask before blaming it.
        if (await sh(sandbox, f"test -d {quoted(sandbox, path)}")).exit_code == 0:
            raise Directory(f"{path} is a directory; this command works on files.") from e
        raise


async def write(sandbox: Sandbox, path: str, data: bytes, *, keep_mode: bool = True) -> None:
    mode = 0o644
    if keep_mode:  # write_file sets the mode, so read it first: scripts stay executable
        name = quoted(sandbox, path)
        stat = await sh(sandbox, f"stat -c %a -- {name} 2>/dev/null || stat -f %Lp -- {name}")
        digits = stat.output.strip()
        if stat.exit_code == 0 and digits and set(digits) <= set("01234567"):
            mode = int(digits, 8)
    try:
        await sandbox.write_file(path, data, mode)
    except PermissionError as e:
        raise Refused(f"Permission denied writing {path}.") from e


def quoted(sandbox: Sandbox, path: str) -> str:
    """`path` quoted for a command run in the workdir; relative when under the workdir,
    because the local provider redirects the workdir for file calls but not for commands."""
    relative = posixpath.relpath(path, sandbox.spec.workdir)
    if relative == ".." or relative.startswith("../"):
        return shlex.quote(path)
    return shlex.quote(relative if relative == "." else "./" + relative)


async def sh(sandbox: Sandbox, script: str) -> ExecResult:
    return await sandbox.exec(ExecRequest(command=script, timeout=30))


async def list_directory(sandbox: Sandbox, path: str) -> str:
    # -prune (not -path '*/.*') so that a hidden directory can itself be listed.
    name = quoted(sandbox, path)
    result = await sh(
        sandbox,
        f"find {name} -mindepth 1 -maxdepth 2 -name '.*' -prune -o "
        r"\( -type d -exec printf '%s/\n' {} + \) -o -print",
    )
    if result.exit_code is None:
        raise Refused(f"Listing {path} timed out; use bash with a narrower `find`.")
    prefix = shlex.split(name)[0].rstrip("/")
    entries, problems = [], []
    for line in result.output.splitlines():
        if line.startswith(prefix + "/"):
            entries.append(path.rstrip("/") + line[len(prefix) :])
        elif line:
            problems.append(line)
    listing = "\n".join([path.rstrip("/") + "/", *sorted(entries), *problems])
    return (
        f"Here's the files and directories up to 2 levels deep in {path}, "
        f"excluding hidden items:\n{listing}"
    )
