"""The agent's changes as a patch: taken out of its sandbox (`git diff agentrl-base`,
binary-safe), stripped of changes to test files, and applied in a fresh container the
way the harness applies it (each fallback from a clean tree).
"""

from __future__ import annotations

import re
import shlex

from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.tasks.graders import DidNotRun, Evidence, listed_tests, ran, tail
from agentrl.tasks.spec import Instance
from agentrl.tasks.swe import BASE_TAG

PATCH = "/tmp/agentrl-patch.diff"
APPLY_COMMANDS = (  # the harness's order; each retry starts from a clean tree
    "git apply --verbose",
    "git apply --verbose --3way",
    "git apply --verbose --reject",
    "patch --batch --forward --fuzz=5 -p1 -i",
)
PATCH_TIMEOUT_S = 120.0
MAX_PATCH_BYTES = 50 << 20
_GIT_HEADER = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


async def agent_patch(sandbox: Sandbox, exclude: tuple[str, ...] = ()) -> str:
    """Everything the agent changed in /testbed since agentrl-base, as a binary git diff.

    Git runs with hooks, external diff drivers and filters of the repository's own config
    turned off; a repository the agent broke gives a DidNotRun with git's words."""
    safe = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c diff.external="
    base = (
        f"base=$(git rev-parse -q --verify {BASE_TAG}^{{commit}} || git rev-parse HEAD) && "
        f"{safe} add -A -- . {' '.join(shlex.quote(f':(exclude){p}') for p in exclude)} && "
        f'{safe} diff --cached --binary --no-color --no-ext-diff --no-textconv "$base" > {PATCH}'
    )
    done = await sandbox.exec(ExecRequest(command=base, timeout=PATCH_TIMEOUT_S))
    if done.exit_code != 0:
        evidence = ran(done, "git diff", "swe-bench", base)
        raise DidNotRun(f"cannot read the agent's changes: {tail(done.output)}", evidence)
    data = await sandbox.read_file(PATCH)
    if len(data) > MAX_PATCH_BYTES:
        evidence = Evidence(grader="swe-bench", command=base, notes=[f"{len(data)} bytes"])
        raise DidNotRun(f"the agent's changes are {len(data) >> 20} MiB", evidence)
    return data.decode(errors="surrogateescape")


def files_of_tests(instance: Instance, *, fail_only: bool = False) -> list[str]:
    """The files that hold the instance's FAIL_TO_PASS (and PASS_TO_PASS) tests."""
    ids = listed_tests("FAIL_TO_PASS", instance)
    if not fail_only:
        ids += listed_tests("PASS_TO_PASS", instance)
    files = (t.split("::", 1)[0] for t in ids if "::" in t)
    return list(dict.fromkeys(f for f in files if f.endswith(".py")))


def drop_test_changes(patch: str, instance: Instance) -> tuple[str, list[str]]:
    """`patch` without its changes to test files (test_patch's files, the files of the listed
    tests, any conftest.py, R2E's r2e_tests/); the paths dropped."""
    guarded = set(files_of_tests(instance)) | set(
        patch_files(str(instance.fields.get("test_patch", "")))
    )
    kept, dropped = [], []
    for chunk in re.split(r"(?=^diff --git )", patch, flags=re.MULTILINE):
        header = _GIT_HEADER.findall(chunk.split("\n", 1)[0])
        paths = set(header[0]) if header else set()
        if any(
            p in guarded or p.rsplit("/", 1)[-1] == "conftest.py" or p.startswith("r2e_tests/")
            for p in paths
        ):
            dropped += sorted(paths)
        else:
            kept.append(chunk)
    return "".join(kept), list(dict.fromkeys(dropped))


async def apply_patch(sandbox: Sandbox, patch: str) -> str | None:
    """Apply the agent's patch at /testbed as the harness does (each fallback from a clean
    tree; a patch the tree already holds counts as applied); the command that worked, ""
    for an empty patch, None if none did."""
    if not patch.strip():
        return ""
    await sandbox.write_file(PATCH, patch.encode(errors="surrogateescape"))
    for attempt, command in enumerate(APPLY_COMMANDS):
        if attempt:
            reset = "git checkout -- . ; git clean -fdq"
            await sandbox.exec(ExecRequest(command=reset, timeout=PATCH_TIMEOUT_S))
        done = await sandbox.exec(
            ExecRequest(command=f"{command} {PATCH}", timeout=PATCH_TIMEOUT_S)
        )
        if done.exit_code == 0:
            return command
    check = f"git apply --check --reverse {PATCH}"
    done = await sandbox.exec(ExecRequest(command=check, timeout=PATCH_TIMEOUT_S))
    return f"{check} (already applied)" if done.exit_code == 0 else None


def patch_files(diff: str, *, old: bool = False) -> list[str]:
    """The paths a diff touches: from its `diff --git` headers, else its `---`/`+++` pairs.

    `old`: only the `--- a/` side, as the harness's reset of test files reads them."""
    if old:
        return list(dict.fromkeys(re.findall(r"^--- a/(\S+)", diff, flags=re.MULTILINE)))
    paths = [p for pair in _GIT_HEADER.findall(diff) for p in pair]
    lines = diff.splitlines()
    if not paths:  # a plain unified diff: `---`, `+++`, then `@@` is a file header
        for old_line, new_line, hunk in zip(lines, lines[1:], lines[2:], strict=False):
            if (
                old_line.startswith("--- ")
                and new_line.startswith("+++ ")
                and hunk.startswith("@@")
            ):
                paths += [_strip_prefix(old_line[4:]), _strip_prefix(new_line[4:])]
    return list(dict.fromkeys(p for p in paths if p != "/dev/null"))


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    return path[2:] if path.startswith(("a/", "b/")) else path
