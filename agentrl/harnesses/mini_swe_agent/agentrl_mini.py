"""A mini-swe-agent environment that runs every command in an agentrl sandbox over HTTP.

Loaded by mini's own interpreter (`--environment-class agentrl_mini.SandboxEnvironment`
with this folder on PYTHONPATH), so it imports only the standard library, pydantic and
minisweagent, never agentrl. It behaves as mini's LocalEnvironment does (result dicts,
the submit sentinel, timeouts, template variables), but each command is a
`POST $AGENTRL_EXEC_URL` with `{"command", "cwd", "timeout"}`.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import urllib.error
import urllib.request
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, Field

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# The socket waits this much longer than the command may run, so the sandbox reports the timeout.
HTTP_GRACE_S = 30.0
_UNAME_FIELDS = ("system", "node", "release", "version", "machine")


class SandboxExecError(RuntimeError):
    """The exec endpoint refused a command or could not be reached: the episode is over."""


class SandboxEnvironmentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exec_url: str = Field(default_factory=lambda: os.environ.get("AGENTRL_EXEC_URL", ""))
    """agentrl's exec endpoint for this episode; `$AGENTRL_EXEC_URL` when not set."""
    cwd: str = ""
    """Folder in the sandbox to run commands in; empty means the sandbox's workdir."""
    env: dict[str, str] = {}
    """Variables exported before each command (mini.yaml sets PAGER=cat and the like)."""
    timeout: int | None = None
    """Seconds a command may run; None leaves it to the task's tool timeout."""


class SandboxEnvironment:
    def __init__(self, *, config_class: type = SandboxEnvironmentConfig, **kwargs: Any):
        self.config = config_class(**kwargs)
        if not self.config.exec_url:
            raise ValueError("no exec endpoint: set AGENTRL_EXEC_URL or environment.exec_url")
        # Proxy variables must not divert calls to agentrl on 127.0.0.1.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._uname: dict[str, str] | None = None

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Run one command in the sandbox; raises Submitted on the sentinel, as mini's own do."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        answer = self._exec(command, cwd or self.config.cwd or None, limit)
        output: dict[str, Any]
        if answer.get("timed_out"):
            # The message LocalEnvironment builds from subprocess.TimeoutExpired.
            after = f"after {limit} seconds" if limit else "(the task's tool timeout)"
            error = f"Command '{command}' timed out {after}"
            output = {
                "output": answer.get("output") or "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {error}",
                "extra": {"exception_type": "TimeoutExpired", "exception": error},
            }
        else:
            output = {
                "output": answer.get("output") or "",
                "returncode": answer.get("returncode"),
                "exception_info": "",
            }
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # uname comes from the sandbox: the prompts tell the model which system it works on.
        return recursive_merge(
            self.config.model_dump(), self._sandbox_uname(), dict(os.environ), kwargs
        )

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                }
            }
        }

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def _sandbox_uname(self) -> dict[str, str]:
        if self._uname is None:
            answer = self._exec("; ".join(f"uname -{f}" for f in "snrvm"), None, 30)
            lines = (answer.get("output") or "").splitlines()
            if answer.get("returncode") == 0 and len(lines) == len(_UNAME_FIELDS):
                self._uname = dict(zip(_UNAME_FIELDS, lines, strict=True))
            else:  # a sandbox without uname: say what mini's docker environment says
                self._uname = {k: getattr(platform.uname(), k) for k in _UNAME_FIELDS}
        return self._uname

    def _exec(self, command: str, cwd: str | None, timeout: int | None) -> dict[str, Any]:
        if self.config.env:  # a line of its own: the command stays as the model wrote it
            assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.config.env.items())
            command = f"export {assignments}\n{command}"
        body = json.dumps({"command": command, "cwd": cwd, "timeout": timeout})
        request = urllib.request.Request(
            self.config.exec_url,
            data=body.encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        wait = None if timeout is None else timeout + HTTP_GRACE_S
        try:
            with self._opener.open(request, timeout=wait) as response:
                answer: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise SandboxExecError(f"exec refused (HTTP {e.code}): {_error_message(e)}") from e
        except OSError as e:  # URLError, refused connections, socket timeouts
            raise SandboxExecError(f"exec endpoint unreachable: {e}") from e
        return answer


def _error_message(e: urllib.error.HTTPError) -> str:
    text = e.read().decode(errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]
