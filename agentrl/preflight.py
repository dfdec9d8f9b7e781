"""Before the first episode: refuse a run that cannot work, with one line and its fix.

What can be known before any episode starts is checked once, so a missing image, a
setup command that fails, a policy server that is not up, or a prompt longer than the
context is one error and exit 1 instead of a run of N infrastructure failures:

1. every instance's first prompt fits `limits.context_length` (the run's tokenizer, on
   the instances whose prompt could come near it: the cost does not grow per instance
   beyond rendering its two prompts);
2. the policy answers, for samplers that talk to a server (`check()`);
3. each task's first instance goes through INIT (image, files, setup; tried as often as
   an episode's INIT) and is closed, a few tasks at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from agentrl.episode.conversation import PROMPT_FIX, open_chat, prompt_overflow
from agentrl.errors import AgentRLError, ConfigError, SandboxError
from agentrl.inference.base import Answering
from agentrl.tasks.env import build_tools
from agentrl.tasks.load import first_prompts
from agentrl.tasks.spec import Instance, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agentrl.chat import ChatSession
    from agentrl.inference.base import Sampler
    from agentrl.tasks.env import EpisodeEnv
    from agentrl.tools.base import Tool

log = logging.getLogger(__name__)

INIT_TIMEOUT = 900.0
"""Seconds the trial INIT may take (an image built from a recipe, a long setup)."""
INIT_ATTEMPTS = 3
"""Tries of the trial INIT: the dispatchers' default `init_attempts`."""
TRIALS_AT_ONCE = 4
"""Trial INITs run side by side (each task's first builds its image where it must)."""


def check_prompts(task: Task, tokenizer: PreTrainedTokenizerBase) -> None:
    """ConfigError naming the instances whose first prompt leaves no room to sample (an
    external harness writes its own prompts: the gateway refuses one that does not fit).

    The tools, their schemas and the chat template around the prompts are rendered once
    per task; an instance is tokenized only when its prompt could reach the limit."""
    if task.spec.agent is not None:
        return
    tools = build_tools(task)
    over = []
    for instance in _could_overflow(task, tools, tokenizer):
        overflow = prompt_overflow(task, open_chat(task, instance, tools, tokenizer))
        if overflow is not None:
            over.append(f"{instance.id}: {overflow}")
    if over:
        more = f" (and {len(over) - 1} more instance(s))" if len(over) > 1 else ""
        raise ConfigError(f"{task.path}: instance {over[0]}{more}", fix=PROMPT_FIX)


_PROBE = ("\x00agentrl-system\x00", "\x00agentrl-instance\x00")
"""Stand-ins for the two prompts, to render the chat template around them once."""
_ESCAPABLE = " \n\t\"'<>&\\[]%#`\r "
"""Characters a template that escapes or quotes its content would lengthen."""
_SLACK = 32
"""Tokens a tokenizer may add beyond one per byte (SentencePiece's prefix markers)."""


def _could_overflow(
    task: Task, tools: dict[str, Tool], tokenizer: PreTrainedTokenizerBase
) -> Iterator[Instance]:
    """The instances whose first prompt may not fit `limits.context_length`.

    When the chat template puts the two prompts in at most verbatim (checked once, with
    stand-ins that a template which escapes or quotes would lengthen), an instance's
    rendered prompt is the template's text around the stand-ins plus its own two prompts.
    In ASCII every token covers at least one byte, so an instance whose prompts are ASCII
    and whose rendered prompt has fewer bytes than the limit (less `_SLACK`) fits without
    being tokenized. Every other instance is yielded, to be counted."""
    limit = task.spec.limits.context_length - _SLACK
    around = _around(task, tools, tokenizer) if task.instances else None
    for instance in task.instances:
        if around is not None:
            system, user = first_prompts(instance, task.spec.prompt)
            if around + len(system) + len(user) < limit and system.isascii() and user.isascii():
                continue
        yield instance


def _around(task: Task, tools: dict[str, Tool], tokenizer: PreTrainedTokenizerBase) -> int | None:
    """Bytes of the task's first prompt besides its two prompts, when the template puts
    them in at most verbatim and its own text takes no more tokens than bytes; else None
    (every instance is tokenized)."""

    def rendered(system: str, user: str) -> ChatSession:
        texts = {"system": system, "instance": user}
        spec = task.spec.model_copy(update={"prompt": task.spec.prompt.model_copy(update=texts)})
        probe = task.model_copy(update={"spec": spec})
        return open_chat(probe, Instance(id="probe"), tools, tokenizer)

    system, user = _PROBE
    chat = rendered(system, user)
    plain = chat.covered
    size = len(plain.encode())
    if plain.count(system) != 1 or plain.count(user) != 1 or len(chat) > size:
        return None
    special = rendered(system + _ESCAPABLE, user + _ESCAPABLE).covered
    if len(special.encode()) > size + 2 * len(_ESCAPABLE):  # it escapes or quotes content
        return None
    return size - len(system) - len(user)


async def preflight(
    envs: Sequence[EpisodeEnv], sampler: Sampler, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Raise the first reason the run cannot work (an AgentRLError with its fix)."""
    for env in envs:
        check_prompts(env.task, tokenizer)
    if isinstance(sampler, Answering):  # samplers behind HTTP say whether they answer
        await sampler.check()
    # Side by side, a few at a time: a dataset's first INITs build its images.
    slots = asyncio.Semaphore(TRIALS_AT_ONCE)

    async def trial(env: EpisodeEnv) -> None:
        async with slots:
            await _trial_init(env)

    done = await asyncio.gather(*(trial(env) for env in envs), return_exceptions=True)
    for outcome in done:  # the first task's failure, in the order given
        if isinstance(outcome, BaseException):
            raise outcome


async def _trial_init(env: EpisodeEnv) -> None:
    task = env.task
    instance = task.instances[0]
    sandbox = None
    # Tried as often as an episode's INIT is (the dispatchers' init_attempts), so an
    # engine hiccup at this moment does not stop a run that would have worked.
    retrying = AsyncRetrying(
        retry=retry_if_exception_type((SandboxError, TimeoutError)),
        stop=stop_after_attempt(INIT_ATTEMPTS),
        wait=wait_exponential(multiplier=0.2, max=2.0),
        reraise=True,
    )
    try:
        async for attempt in retrying:
            with attempt:
                async with asyncio.timeout(INIT_TIMEOUT):
                    sandbox = await env.init(instance, name=f"preflight-{instance.id}")
    except TimeoutError:
        raise SandboxError(
            f"{task.spec.name}: INIT of instance {instance.id} took over {INIT_TIMEOUT:g} s "
            "before any episode started",
            fix="check the task's image and setup commands (agentrl check TASK runs them)",
        ) from None
    except AgentRLError as e:
        raise SandboxError(
            f"{task.spec.name}: INIT of instance {instance.id} failed before any episode "
            f"started: {e}",
            fix=e.fix or "check the task's image and setup commands",
        ) from e
    finally:
        if sandbox is not None:
            try:
                await sandbox.close()
            except AgentRLError as e:  # the reaper removes it; the run can still go
                log.warning("preflight sandbox of %s did not close: %s", task.spec.name, e)
