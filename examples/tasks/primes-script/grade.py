"""The python grader of primes-script: `grader.function: grade:score` is `score` here.

It runs on the machine that runs agentrl, once per episode at EVAL, and reaches the
sandbox only through its coroutines (`exec`, `read_file`, `write_file`). It returns a
number, or a dict with a numeric "reward" ("output" becomes the evidence's output, other
keys the trajectory's reward components).
"""

from __future__ import annotations

from typing import Any

from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.tasks.spec import Instance


def first_primes(n: int) -> list[int]:
    found: list[int] = []
    candidate = 2
    while len(found) < n:
        if all(candidate % p for p in found if p * p <= candidate):
            found.append(candidate)
        candidate += 1
    return found


async def score(sandbox: Sandbox, instance: Instance) -> dict[str, Any]:
    """The fraction of the asked counts for which the agent's script prints the right primes:
    the instance's count and one the agent was not told."""
    counts = [int(instance.fields["count"]), 17]
    right, output = 0, []
    for n in counts:
        done = await sandbox.exec(ExecRequest(command=f"python3 primes.py {n}", timeout=30))
        printed = done.output.split()
        ok = done.exit_code == 0 and printed == [str(p) for p in first_primes(n)]
        right += ok
        output.append(f"primes.py {n}: exit {done.exit_code}, {'right' if ok else 'wrong'}")
    return {"reward": right / len(counts), "output": "\n".join(output), "right": right}
