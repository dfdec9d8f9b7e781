"""The agent's changes as a patch: taken out of its sandbox (`git diff agentrl-base`,
binary-safe, with the repository's own diff-shaping config overridden), stripped of
changes to test files, and applied in a fresh container the way the harness applies it
(each fallback from the tree as it was before the first try).

What a patch changed is decided from the paths git itself lists, never from the diff's
text: in the agent's sandbox `git diff --name-only -z`, in the grading container the
trees git writes of the repository before and after the patch went in (`snapshot`,
`changed_paths`). A change that decides how the tests are configured, collected,
installed or reported (`how_tests_run_reason`) is put back before they run (`put_back`).
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass

from agentrl.errors import SandboxFileNotFound
from agentrl.sandbox.base import ExecRequest, Sandbox
from agentrl.tasks.evidence import DidNotRun, Evidence, ran, tail
from agentrl.tasks.spec import Instance
from agentrl.tasks.swe import BASE_TAG, WORKDIR
from agentrl.tasks.swe.rules import TEST_FILE, row_test_files

PATCH = "/tmp/agentrl-patch.diff"
PATCH_PATHS = "/tmp/agentrl-patch.paths"
APPLY_COMMANDS = (  # the harness's order; each retry starts from the tree before the first
    "git apply --verbose",
    "git apply --verbose --3way",
    "git apply --verbose --reject",
    "patch --batch --forward --fuzz=5 -p1 -i",
)
PATCH_TIMEOUT_S = 120.0
MAX_PATCH_BYTES = 50 << 20
GIT_ENV = {"GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1", "GIT_PAGER": "cat"}
"""No global or system git config; the repository's own is overridden key by key (GIT)."""
GIT = " ".join(
    [
        "git",
        *(f"-c {shlex.quote(kv)}" for kv in ("safe.directory=*", "core.hooksPath=/dev/null")),
        *("-c core.fsmonitor=false -c core.autocrlf=false -c core.safecrlf=false",),
        *("-c core.quotePath=true -c diff.external= -c diff.noprefix=false",),
        *("-c diff.mnemonicPrefix=false -c diff.relative=false -c diff.renames=false",),
    ]
)
"""git with every diff-shaping key of the repository's config (the agent's, in its
sandbox) overridden, and no hooks, fsmonitor or external diff."""


@dataclass(frozen=True)
class AgentPatch:
    """The agent's changes: the diff, and the paths it changes as git listed them."""

    diff: str
    paths: tuple[str, ...]


async def agent_patch(sandbox: Sandbox, exclude: tuple[str, ...] = ()) -> AgentPatch:
    """Everything the agent changed in /testbed since agentrl-base, as a binary git diff
    with a/ b/ prefixes and no renames, and the paths it changes (`--name-only -z`).

    Git runs without global or system config, every diff-shaping key of the repository's
    config (the agent's) overridden, and no hooks, fsmonitor, external diff drivers or
    textconv; a repository the agent broke gives a DidNotRun with git's words."""
    diff = "--no-renames --no-relative --no-ext-diff --no-textconv"
    base = (
        f"base=$({GIT} rev-parse -q --verify {BASE_TAG}^{{commit}} || {GIT} rev-parse HEAD) && "
        f"{GIT} add -A -- . {' '.join(shlex.quote(f':(exclude){p}') for p in exclude)} && "
        f'{GIT} diff --cached --name-only -z {diff} "$base" > {PATCH_PATHS} && '
        f"{GIT} diff --cached --binary --no-color {diff} -O/dev/null --src-prefix=a/ "
        f'--dst-prefix=b/ "$base" > {PATCH}'
    )
    done = await sandbox.exec(ExecRequest(command=base, timeout=PATCH_TIMEOUT_S, env=GIT_ENV))
    if done.exit_code != 0:
        evidence = ran(done, "git diff", "swe-bench", base)
        raise DidNotRun(f"cannot read the agent's changes: {tail(done.output)}", evidence)
    data = await sandbox.read_file(PATCH)
    if len(data) > MAX_PATCH_BYTES:
        evidence = Evidence(grader="swe-bench", command=base, notes=[f"{len(data)} bytes"])
        raise DidNotRun(f"the agent's changes are {len(data) >> 20} MiB", evidence)
    paths = _nul_list(await sandbox.read_file(PATCH_PATHS))
    return AgentPatch(diff=data.decode(errors="surrogateescape"), paths=tuple(paths))


def drop_test_changes(patch: AgentPatch, instance: Instance) -> tuple[str, list[str]]:
    """`patch`'s diff without its changes to test files (test_patch's files, the files of
    the listed tests, any conftest.py, R2E's r2e_tests/); what was dropped, for `tampered`
    (bare paths, as ever; what the grading container puts back comes as `path: why`).

    Each file's part of the diff is told by its header as `agent_patch` shapes it (a/ b/
    prefixes, git's quoting, no renames) and must be one of the paths git listed; a part
    that is not is dropped too."""
    guarded, listed = row_test_files(instance), set(patch.paths)
    kept, dropped = [], []
    for path, chunk in split_diff(patch.diff):
        if path is None or path not in listed:
            dropped.append(f"{path or chunk.split(chr(10), 1)[0][:200]}: not a path git listed")
        elif (
            path in guarded
            or path.rsplit("/", 1)[-1] == "conftest.py"
            or path.startswith("r2e_tests/")
        ):
            dropped.append(path)  # the bare path, as these were always listed
        else:
            kept.append(chunk)
    return "".join(kept), list(dict.fromkeys(dropped))


def tampered_entry(path: str, reason: str) -> str:
    """An entry of Evidence.tampered for what the grading container put back: the bare
    path for the row's test files (as they were always listed), `path: why` for the rest."""
    return path if reason == TEST_FILE else f"{path}: {reason}"


def split_diff(diff: str) -> list[tuple[str | None, str]]:
    """Each file's part of a diff that `agent_patch` made, with its path (None: the header
    is not one git writes with a/ b/ prefixes and no renames)."""
    parts = re.split(r"(?=^diff --git )", diff, flags=re.MULTILINE)
    return [(_header_path(p.split("\n", 1)[0]), p) for p in parts if p]


def _header_path(line: str) -> str | None:
    """The path of `diff --git a/PATH b/PATH` (both C-quoted when git quotes PATH)."""
    if not line.startswith("diff --git "):
        return None
    rest = line.removeprefix("diff --git ")
    if rest.startswith('"'):
        quoted = re.fullmatch(r'"a/((?:[^"\\]|\\.)*)" "b/((?:[^"\\]|\\.)*)"', rest)
        if quoted is None or quoted[1] != quoted[2]:
            return None
        return _unquote(quoted[1])
    path = rest[2 : 2 + (len(rest) - 5) // 2]
    return path if path and rest == f"a/{path} b/{path}" else None


_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


def _unquote(text: str) -> str | None:
    """git's C-style quoting undone (bytes as git wrote them, decoded as paths are)."""
    out, i = bytearray(), 0
    raw = text.encode(errors="surrogateescape")
    while i < len(raw):
        if raw[i] != 92:
            out.append(raw[i])
            i += 1
            continue
        nxt = chr(raw[i + 1]) if i + 1 < len(raw) else ""
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif re.fullmatch(r"[0-3][0-7]{2}", raw[i + 1 : i + 4].decode("latin-1")):
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            return None
    return out.decode(errors="surrogateescape")


def _nul_list(data: bytes) -> list[str]:
    return [p.decode(errors="surrogateescape") for p in data.split(b"\0") if p]


# ------------------------------------------------------------- the grading container


@dataclass(frozen=True)
class Change:
    """One path a patch changed, from `git diff-tree --raw` of the trees before and after."""

    path: str
    old_mode: str
    new_mode: str
    old_blob: str
    new_blob: str

    @property
    def added(self) -> bool:
        return self.old_mode == "000000"


def _script(*lines: str) -> str:
    return "\n".join(["set -e", f"cd {WORKDIR}", *lines])


async def _git(sandbox: Sandbox, what: str, script: str) -> str:
    """Run `script` (git plumbing) in the grading container; its output, or DidNotRun."""
    done = await sandbox.exec(ExecRequest(command=script, timeout=PATCH_TIMEOUT_S, env=GIT_ENV))
    if done.exit_code != 0:
        evidence = ran(done, what, "swe-bench", script)
        raise DidNotRun(f"{what} failed: {tail(done.output)}", evidence)
    return done.output


async def patch_paths(sandbox: Sandbox, patch: str) -> list[str]:
    """The paths `patch` touches as git apply reads it (`--numstat -z`) and as GNU patch,
    the harness's last fallback, reads it (`--dry-run`): the two can differ on a diff
    that git did not write."""
    await sandbox.write_file(PATCH, patch.encode(errors="surrogateescape"))
    listing, paths = f"{PATCH}.numstat", []
    command = f"git apply --numstat -z {PATCH} > {listing}"
    done = await sandbox.exec(ExecRequest(command=command, timeout=PATCH_TIMEOUT_S, env=GIT_ENV))
    if done.exit_code == 0:
        tokens = (await sandbox.read_file(listing)).split(b"\0")
        while tokens:
            token = tokens.pop(0)
            if token.endswith(b"\t"):  # a rename or copy: `added\tdeleted\t` old new
                paths += [t.decode(errors="surrogateescape") for t in tokens[:2]]
                del tokens[:2]
            elif token:
                paths.append(token.split(b"\t", 2)[-1].decode(errors="surrogateescape"))
    dry = f"patch --dry-run --batch --forward --fuzz=5 -p1 -i {PATCH}"
    done = await sandbox.exec(ExecRequest(command=dry, timeout=PATCH_TIMEOUT_S))
    found = re.findall(r"^checking file (.+)$", done.output, flags=re.MULTILINE)
    return list(dict.fromkeys(paths + [_shell_unquote(p) for p in found]))


def _shell_unquote(text: str) -> str:
    try:
        words = shlex.split(text)
    except ValueError:
        return text
    return words[0] if len(words) == 1 else text


def snapshot_index(name: str) -> str:
    """The private index file of the snapshot `name`."""
    return f"/tmp/agentrl-{name}.index"


async def snapshot(sandbox: Sandbox, paths: Iterable[str], name: str, start: str = "") -> str:
    """The tree of /testbed as it stands (git's object id): every file git does not ignore,
    plus `paths` (the patch's own) even if ignored. A private index (`snapshot_index`) is
    used, so neither the repository's index nor its files change; `start` names an earlier
    snapshot whose index is copied first (its stat data spares rehashing what did not
    change)."""
    listed = f"/tmp/agentrl-{name}.paths"
    await sandbox.write_file(
        listed, b"".join(p.encode(errors="surrogateescape") + b"\0" for p in paths)
    )
    index, present = snapshot_index(name), f"/tmp/agentrl-{name}.present"
    script = _script(
        f"export GIT_INDEX_FILE={index} GIT_LITERAL_PATHSPECS=1",
        f"cp {snapshot_index(start)} {index}" if start else f"rm -f {index}; {GIT} read-tree HEAD",
        f"{GIT} add -A .",
        f": > {present}",
        "while IFS= read -r -d '' p; do",
        f'  if [ -e "$p" ] || [ -L "$p" ]; then printf \'%s\\0\' "$p" >> {present}; fi',
        f"done < {listed}",
        f"if [ -s {present} ]; then {GIT} add -f --pathspec-from-file={present} "
        "--pathspec-file-nul 2>/dev/null || while IFS= read -r -d '' p; do",
        f'  {GIT} add -f -- "$p" 2>/dev/null || true; done < {present}; fi',
        f"{GIT} write-tree",
    )
    tree = (await _git(sandbox, "recording the repository's tree", script)).strip().split()
    if not tree or not re.fullmatch(r"[0-9a-f]{40,64}", tree[-1]):
        raise DidNotRun(f"git wrote no tree: {' '.join(tree)[-200:]}", Evidence(grader="swe-bench"))
    return tree[-1]


def reset_to(tree: str) -> str:
    """Shell that puts /testbed back as `tree` has it (files git does not ignore): what
    each retry of the harness's apply starts from."""
    return _script(
        "export GIT_INDEX_FILE=/tmp/agentrl-reset.index",
        f"rm -f /tmp/agentrl-reset.index; {GIT} read-tree {tree}",
        f"{GIT} checkout-index -a -f -q",
        f"{GIT} clean -fdq",
    )


async def changed_paths(sandbox: Sandbox, before: str, after: str) -> list[Change]:
    """What differs between two trees of `snapshot`, path by path (no renames)."""
    listing = "/tmp/agentrl-changes"
    await _git(
        sandbox,
        "listing the patch's changes",
        _script(f"{GIT} diff-tree -r -z --no-renames --raw {before} {after} > {listing}"),
    )
    tokens = (await sandbox.read_file(listing)).split(b"\0")
    changes = []
    for meta, path in zip(tokens[::2], tokens[1::2], strict=False):
        fields = meta.decode().lstrip(":").split()
        if len(fields) >= 4:
            changes.append(
                Change(
                    path=path.decode(errors="surrogateescape"),
                    old_mode=fields[0],
                    new_mode=fields[1],
                    old_blob=fields[2],
                    new_blob=fields[3],
                )
            )
    return changes


async def blob(sandbox: Sandbox, name: str) -> bytes | None:
    """The bytes of a blob git recorded: an object id, or `tree:path` (None: the all-zero
    id of a path absent on that side, or no such path in the tree)."""
    if set(name) <= {"0"}:
        return None
    path, quoted = "/tmp/agentrl-blob", shlex.quote(name)
    script = (
        f"if {GIT} cat-file -e {quoted} 2>/dev/null; then {GIT} cat-file blob {quoted} > {path}; "
        f"else rm -f {path}; fi"
    )
    await _git(sandbox, "reading a file git recorded", _script(script))
    try:
        return await sandbox.read_file(path)
    except SandboxFileNotFound:
        return None


async def put_back(sandbox: Sandbox, before: str, changes: list[Change]) -> None:
    """Put these changed paths back as the tree `before` has them: a changed or deleted
    file restored, an added one removed (and the folders it alone made)."""
    if not changes:
        return
    restore = [c.path for c in changes if not c.added]
    remove = [c.path for c in changes if c.added]
    folders = sorted(_ancestors(remove), key=lambda d: d.count("/"), reverse=True)
    files = {"restore": restore, "remove": remove, "folders": folders}
    for name, paths in files.items():
        data = b"".join(p.encode(errors="surrogateescape") + b"\0" for p in paths)
        await sandbox.write_file(f"/tmp/agentrl-putback.{name}", data)
    listing = "/tmp/agentrl-putback"
    script = _script(
        "export GIT_INDEX_FILE=/tmp/agentrl-putback.index",
        f"rm -f /tmp/agentrl-putback.index; {GIT} read-tree {before}",
        f"while IFS= read -r -d '' p; do rm -rf -- \"$p\"; done < {listing}.restore",
        f"if [ -s {listing}.restore ]; then {GIT} checkout-index -f -z --stdin "
        f"< {listing}.restore; fi",
        f"while IFS= read -r -d '' p; do rm -f -- \"$p\"; done < {listing}.remove",
        "while IFS= read -r -d '' d; do",
        f'  {GIT} cat-file -e "{before}:$d" 2>/dev/null || rmdir -- "$d" 2>/dev/null || true',
        f"done < {listing}.folders",
    )
    await _git(sandbox, "putting back the test configuration", script)


def _ancestors(paths: Iterable[str]) -> set[str]:
    found = set()
    for path in paths:
        folder = posixpath.dirname(path)
        while folder:
            found.add(folder)
            folder = posixpath.dirname(folder)
    return found


async def apply_patch(sandbox: Sandbox, patch: str, clean: str | None = None) -> str | None:
    """Apply the agent's patch at /testbed as the harness does (each fallback from a clean
    tree: `clean`, a tree of `snapshot`, else `git checkout -- . ; git clean -fdq`; a patch
    the tree already holds counts as applied); the command that worked, "" for an empty
    patch, None if none did."""
    if not patch.strip():
        return ""
    await sandbox.write_file(PATCH, patch.encode(errors="surrogateescape"))
    for attempt, command in enumerate(APPLY_COMMANDS):
        if attempt:
            reset = reset_to(clean) if clean else "git checkout -- . ; git clean -fdq"
            env = GIT_ENV if clean else {}
            await sandbox.exec(ExecRequest(command=reset, timeout=PATCH_TIMEOUT_S, env=env))
        done = await sandbox.exec(
            ExecRequest(command=f"{command} {PATCH}", timeout=PATCH_TIMEOUT_S)
        )
        if done.exit_code == 0:
            return command
    check = f"git apply --check --reverse {PATCH}"
    done = await sandbox.exec(ExecRequest(command=check, timeout=PATCH_TIMEOUT_S))
    return f"{check} (already applied)" if done.exit_code == 0 else None
