"""A scripted policy: plays a fixed list of replies through the real tokenizer.

For testing and debugging tasks without a model: each `generate` returns the next
reply's tokens (the tokenizer's own encoding, then the end-of-turn token), so the
episode, the chat template and the trajectory ledger all run for real. Its logprobs
are 0.0 (a point mass: the script is deterministic). A script is a YAML or JSON list
of strings, or a text file whose replies are separated by lines holding only `---`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import RootModel, ValidationError

from agentrl.errors import ConfigError
from agentrl.inference.base import Completion, FinishReason, SamplingParams
from agentrl.textfile import read_text
from agentrl.yamlfile import ConfigFileError, YamlFile, show

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


SCRIPT_FIX = (
    "write the script as a list of replies, one string each (quote a reply that holds "
    "`: ` or starts with a brace), or as text with replies between `---` lines"
)


class Script(RootModel[list[str]]):
    """A YAML or JSON script: the replies, in order."""


def load_script(path: str | Path) -> list[str]:
    """Replies from a .yaml/.yml/.json list, or a text file split on `---` lines. A YAML
    or JSON script is read as a task file is (`agentrl.yamlfile`): each problem is one
    `file:line: script: message`, with the fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such script file", fix="check the path after scripted:")
    if path.suffix == ".json":
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: json: {e.msg}", fix=SCRIPT_FIX) from None
        try:
            return Script.model_validate(data).root
        except ValidationError:
            got = show(data)
            raise ConfigError(
                f"{path}: script: should be a list of strings, got {got}", fix=SCRIPT_FIX
            ) from None
    if path.suffix in (".yaml", ".yml"):
        file = YamlFile(path, what="script")
        data = file.parse_document()
        script = file.validate(Script, data) if not file.problems else None
        if script is None or file.problems:
            error = ConfigFileError(file.sorted_problems())
            error.fix = SCRIPT_FIX
            raise error
        return script.root
    text = read_text(path)
    replies: list[str] = []
    current: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.strip() == "---":
            replies.append("".join(current).strip("\n"))
            current = []
        else:
            current.append(line)
    replies.append("".join(current).strip("\n"))
    return [r for r in replies if r]


class ScriptedSampler:
    """A Sampler that replies with the script, one entry per call and session, in order."""

    def __init__(self, replies: list[str], tokenizer: PreTrainedTokenizerBase) -> None:
        if not replies:
            raise ConfigError("a scripted policy needs at least one reply", fix=SCRIPT_FIX)
        self.replies = list(replies)
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        if not isinstance(eos, int):
            raise ConfigError("the tokenizer has no end-of-turn token for scripted replies")
        self.eos = eos
        self.calls: dict[str | None, int] = {}  # per session: episodes run concurrently

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Completion:
        # After the last entry the script repeats it (usually a finish call).
        n = self.calls.get(session_id, 0)
        reply = self.replies[min(n, len(self.replies) - 1)]
        self.calls[session_id] = n + 1
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos]
        # Stop strings end the reply where a model's would end: at the token completing one.
        if params.stop:
            for end in range(1, len(ids)):
                if any(stop in self.tokenizer.decode(ids[:end]) for stop in params.stop):
                    ids = ids[:end]
                    break
        finish: FinishReason = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        return Completion(
            token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish, policy_version=0
        )

    async def close(self) -> None:
        return None
