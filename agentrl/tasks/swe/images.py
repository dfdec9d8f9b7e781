"""Each instance's image: found under the names each harness gives it, or built from the
row's source (agentrl's own rows); then prepared once per image as the agent's start:
the repository at /testbed with no history after that state (tagged agentrl-base),
SWE-smith's bug applied and its failing tests removed, R2E-Gym's hidden tests removed.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from docker.errors import ImageNotFound

from agentrl import atomic
from agentrl.cache import cache_root
from agentrl.errors import ConfigError, ImageBuildError
from agentrl.sandbox.images import ImageInfo, build_recipe, docker_client, folder_hash, repo_slug
from agentrl.tasks.spec import DEFAULT_IMAGE, Instance
from agentrl.tasks.swe import BASE_TAG, R2E_RUNNER, R2E_TESTS, WORKDIR, Format
from agentrl.tasks.swe.rows import Source
from agentrl.tasks.swe.rules import files_of_tests

SDIST_TIMEOUT_S = 300.0


def standard_image_name(instance_id: str) -> str:
    """The name SWE-bench publishes an instance's evaluation image under (Docker Hub)."""
    key = instance_id.lower().replace("__", "_1776_")
    return f"swebench/sweb.eval.x86_64.{key}:latest"


def image_names(instance: Instance, fmt: Format) -> list[str]:
    """Where each harness looks for an instance's image, in order: the row's own name, the
    hub name, the name a local build of the harness gives it."""
    fields, iid = instance.fields, instance.id
    named = [str(fields[k]) for k in ("image", "image_name", "docker_image") if fields.get(k)]
    if fmt == "swe-gym":  # OpenHands' rule for SWE-Gym's images
        named.append(f"xingyaoww/sweb.eval.x86_64.{iid.replace('__', '_s_')}".lower())
    if fmt in ("swe-bench", "swe-gym"):
        named += [standard_image_name(iid), f"sweb.eval.x86_64.{iid.lower()}:latest"]
    return list(dict.fromkeys(n if ":" in n.rsplit("/", 1)[-1] else f"{n}:latest" for n in named))


def find_or_build_image(instance: Instance, base_dir: Path, fmt: Format = "swe-bench") -> str:
    """The instance's image: present locally under one of its names, or built from its
    source (agentrl's rows); ImageBuildError naming every name tried otherwise."""
    names = image_names(instance, fmt)
    for name in names:
        if _present(name):
            return name
    fields = instance.fields
    if fields.get("source") is None and not fields.get("repo_archive"):
        tried = ", ".join(names)
        raise ImageBuildError(
            f"instance {instance.id}: no image under any of its names ({tried}), and the row "
            "has no `source` or `repo_archive` to build one from",
            fix=f"docker pull {names[0]} (or docker load it, or `docker tag` a locally built "
            "image with one of those names), or add a `source` to the row",
        )
    return build_instance_image(instance, base_dir).tag


def build_instance_image(instance: Instance, base_dir: Path) -> ImageInfo:
    """Build (once per recipe hash) the base image plus the instance's repository at /testbed."""
    folder = prepare_context(instance, base_dir)
    name = repo_slug(instance.id, "instance")
    return build_recipe(folder, f"agentrl/swe-{name}:{folder_hash(folder)}")


def prepare_context(instance: Instance, base_dir: Path) -> Path:
    """The instance's build folder in the cache: a Dockerfile and the source archive."""
    fields = instance.fields
    source = Source.model_validate(fields.get("source") or {})
    if fields.get("repo_archive"):
        archive = base_dir / str(fields["repo_archive"])
        if not archive.is_file():
            raise ConfigError(f"instance {instance.id}: repo_archive {archive} does not exist")
    elif source.sdist:
        archive = fetch_sdist(source.sdist, source.sha256)
    else:
        raise ConfigError(f"instance {instance.id}: source: give `sdist` (or a repo_archive)")
    folder = cache_root() / "swe_bench" / "build" / instance.id
    folder.mkdir(parents=True, exist_ok=True)
    _write_if_changed(folder / "src.tar.gz", archive.read_bytes())
    dockerfile = _source_dockerfile(instance, source, strip=_single_top_folder(archive))
    _write_if_changed(folder / "Dockerfile", dockerfile.encode())
    return folder


def prepare_image(image: str, instance: Instance, fmt: Format) -> str:
    """The image the agent starts from, built once per (image, recipe) from `image`: the
    repository without history after the agent's starting state (tagged agentrl-base);
    SWE-smith's bug applied and its failing tests removed; R2E-Gym's hidden tests removed."""
    client = docker_client()
    try:
        image_id = str(client.images.get(image).id)
    finally:
        client.close()
    key = f"{fmt}-{instance.id}-{image_id}"
    folder = cache_root() / "swe_bench" / "prepare" / hashlib.sha256(key.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    files = {"prepare.sh": _prepare_script(instance, fmt)}
    if fmt == "swe-smith":
        files["bug.patch"] = str(instance.fields["patch"])
    for name, text in files.items():
        _write_if_changed(folder / name, text.encode())
    copies = "".join(f"COPY {name} /tmp/agentrl-prepare/{name}\n" for name in files)
    dockerfile = (
        f"FROM {image_id}\n{copies}"
        'RUN ["bash", "/tmp/agentrl-prepare/prepare.sh"]\n'
        'RUN ["rm", "-rf", "/tmp/agentrl-prepare"]\n'
    )
    _write_if_changed(folder / "Dockerfile", dockerfile.encode())
    name = repo_slug(instance.id, "instance")
    return build_recipe(folder, f"agentrl/swe-start-{name}:{folder_hash(folder)}").tag


def _prepare_script(instance: Instance, fmt: Format) -> str:
    """Bash, run at image build: the starting state, then no history beyond it."""
    lines = ["set -euo pipefail", f"cd {WORKDIR}", "git config --global --add safe.directory '*'"]
    lines += ["export GIT_AUTHOR_DATE=2000-01-01T00:00:00Z GIT_COMMITTER_DATE=2000-01-01T00:00:00Z"]
    lines += ["export GIT_AUTHOR_NAME=agentrl GIT_AUTHOR_EMAIL=agentrl@localhost"]
    lines += ["export GIT_COMMITTER_NAME=agentrl GIT_COMMITTER_EMAIL=agentrl@localhost"]
    if fmt == "swe-smith":  # offline: main + the bug, its failing tests gone, as one commit
        doomed = " ".join(shlex.quote(f) for f in files_of_tests(instance, fail_only=True)) or '""'
        lines += [
            "git apply /tmp/agentrl-prepare/bug.patch",
            f"rm -f -- {doomed}",
            "git checkout -q --orphan agentrl-start && git add -A"
            ' && git commit -qm "Initial commit"',
        ]
    if fmt == "r2e-gym":  # the hidden tests stay in the grading image only
        lines += [f"rm -rf {R2E_TESTS} {R2E_RUNNER} /root/r2e_tests /root/run_tests.sh"]
    lines += [
        # Keep HEAD (on its branch, if any) and tags older than HEAD that it contains;
        # delete every other ref (later commits, other branches, remotes, stash).
        "head=$(git rev-parse HEAD); branch=$(git symbolic-ref -q --short HEAD || true)",
        "ts=$(git show -s --format=%ct HEAD)",
        "git for-each-ref --format='%(refname)' | while read -r ref; do",
        '  case "$ref" in refs/tags/*)',
        '    c=$(git rev-list -n 1 "$ref")',
        '    if [ "$(git show -s --format=%ct "$c")" -le "$ts" ] &&'
        ' git merge-base --is-ancestor "$c" "$head"; then continue; fi;;',
        "  esac",
        '  git update-ref -d "$ref"',
        "done",
        'if [ -n "$branch" ]; then git update-ref "refs/heads/$branch" "$head"; fi',
        'for r in $(git remote); do git remote remove "$r"; done',
        "git stash clear 2>/dev/null || true",
        f'git tag -f {BASE_TAG} "$head" >/dev/null',
        "rm -f .git/FETCH_HEAD .git/ORIG_HEAD",
        "git reflog expire --expire=now --all",
        "git gc --prune=now --quiet",
        # Nothing is left that HEAD does not contain.
        'test -z "$(git rev-list --all --not "$head")"',
    ]
    return "\n".join(lines) + "\n"


def fetch_sdist(requirement: str, sha256: str | None = None) -> Path:
    """The sdist of NAME==VERSION from the cache, downloaded with pip the first time."""
    folder = cache_root() / "swe_bench" / "sdists" / requirement.replace("==", "-")
    found = sorted(folder.glob("*.tar.gz"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            cmd += ["--disable-pip-version-check", "--dest", tmp, requirement]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=SDIST_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise ImageBuildError(f"pip download {requirement} timed out") from None
            if done.returncode != 0:
                last = " | ".join(done.stderr.strip().splitlines()[-3:])
                raise ImageBuildError(
                    f"pip download {requirement} failed: {last[-400:]}",
                    fix="check that PyPI answers, and that the name and version exist",
                )
            got = sorted(Path(tmp).glob("*.tar.gz"))
            if len(got) != 1:
                names = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
                raise ImageBuildError(f"pip download {requirement} gave {names}, not one .tar.gz")
            got[0].replace(folder / got[0].name)  # atomic: a reader never sees half a file
        found = sorted(folder.glob("*.tar.gz"))
    path = found[0]
    if sha256 is not None and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
        raise ImageBuildError(
            f"{path} does not have the sha256 the row names ({sha256})",
            fix=f"delete {path.parent} to download it again, or fix the row's source.sha256",
        )
    return path


def _source_dockerfile(instance: Instance, source: Source, *, strip: bool) -> str:
    upstream = f"{instance.fields['repo']} at {instance.fields['base_commit']}"
    origin = f"the PyPI sdist {source.sdist}" if source.sdist else "the row's repo_archive"
    steps = [
        f"mkdir -p {WORKDIR}",
        f"tar -xzf /tmp/src.tar.gz -C {WORKDIR} --no-same-owner"
        + (" --strip-components=1" if strip else ""),
        "rm /tmp/src.tar.gz",
        f"cd {WORKDIR}",
        "git init -q",
        "git add -A",
        "git -c user.name=agentrl -c user.email=agentrl@localhost commit -q --no-verify "
        + shlex.quote(f"-m{upstream}, from {origin}"),
        f"git tag {BASE_TAG}",
        "printf '__pycache__/\\n*.pyc\\n.pytest_cache/\\n' >> .git/info/exclude",
        *source.install,
    ]
    run = json.dumps(["bash", "-euo", "pipefail", "-c", "\n".join(steps)])
    return (
        f"FROM {DEFAULT_IMAGE}\n"
        "COPY src.tar.gz /tmp/src.tar.gz\n"
        "ENV GIT_AUTHOR_DATE=2000-01-01T00:00:00Z GIT_COMMITTER_DATE=2000-01-01T00:00:00Z\n"
        f"RUN {run}\n"
        f"WORKDIR {WORKDIR}\n"
    )


def _single_top_folder(archive: Path) -> bool:
    """Whether every member of the archive lies under one top folder (as in an sdist)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tops = {m.name.lstrip("./").split("/", 1)[0] for m in tar.getmembers()}
    except (tarfile.TarError, OSError) as exc:
        raise ImageBuildError(f"{archive} is not a .tar.gz archive: {exc}") from None
    tops.discard("")
    return len(tops) == 1


def _write_if_changed(path: Path, data: bytes) -> None:
    if path.is_file() and path.read_bytes() == data:
        return
    atomic.write_bytes(path, data)


def _present(image: str) -> bool:
    client = docker_client()
    try:
        client.images.get(image)
    except ImageNotFound:
        return False
    finally:
        client.close()
    return True
