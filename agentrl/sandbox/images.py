"""Sandbox images: find a recipe in `sandboxes/<name>/`, hash it, and build it once.

A recipe is a folder with a Dockerfile and, for package-list recipes, `packages.txt`.
Where the Dockerfile's base image is present or can be pulled, `docker build` makes the
image. On a machine without a registry, a `debian:bookworm` recipe is made offline:
debootstrap installs `packages.txt` from the machine's own apt mirror and the rootfs is
`docker import`ed with the Dockerfile's ENV/WORKDIR/CMD lines. Either way the image is
tagged `agentrl/<name>:bookworm` and labelled with the recipe hash, so an unchanged
recipe is never built twice. `build_recipe` does the same for any folder (a task's own
Dockerfile), tagged `agentrl/task-<folder>:<hash>`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import docker
import requests
from docker.errors import DockerException, ImageNotFound
from docker.models.images import Image
from docker.utils import parse_repository_tag
from pydantic import BaseModel, ConfigDict

from agentrl.errors import DockerUnavailableError, ImageBuildError

logger = logging.getLogger(__name__)

SUITE = "bookworm"
RECIPE_LABEL = "agentrl.recipe"
METHOD_LABEL = "agentrl.method"
PULL_TIMEOUT_S = 30
# `docker import` sets no PATH, and these are the Dockerfile lines it can apply.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMPORTABLE = ("CMD", "ENTRYPOINT", "ENV", "EXPOSE", "LABEL", "USER", "VOLUME", "WORKDIR")
# Left by debootstrap; dropped before import to keep the image small (file names only).
APT_CACHES = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*")

ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")

Method = Literal["dockerfile", "debootstrap"]
Progress = Callable[[str], None]


class ImageInfo(BaseModel):
    """What `build_image` or `build_recipe` made, or found already up to date."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tag: str
    """Image tag: `agentrl/<name>:bookworm`, or the tag `build_recipe` was given."""
    id: str
    """Image id (`sha256:...`)."""
    recipe_hash: str
    """Short sha256 of the recipe folder; also the image's `agentrl.recipe` label."""
    method: Method
    """How the image was made."""
    built: bool
    """False when an image with this recipe hash already existed."""
    seconds: float
    """Wall time of the call."""


def docker_client(*, timeout: int = 60) -> docker.DockerClient:
    """A client for the engine named by DOCKER_HOST (else the default socket), pinged."""
    client = None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except (DockerException, requests.RequestException) as exc:
        if client is not None:
            client.close()
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise DockerUnavailableError(f"Docker engine at {host} does not answer: {reason}") from exc
    return client


def sandboxes_dir() -> Path:
    """Where recipes live: $AGENTRL_SANDBOXES, else the repository's `sandboxes/`."""
    override = os.environ.get("AGENTRL_SANDBOXES")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "sandboxes"


def recipe_dir(name: str) -> Path:
    """The folder of recipe `name`; an unknown name lists the available ones."""
    root = sandboxes_dir()
    available = sorted(p.parent.name for p in root.glob("*/Dockerfile"))
    if name not in available:
        choices = ", ".join(available) or "none"
        raise ImageBuildError(
            f"unknown sandbox recipe {name!r}; available in {root}: {choices}",
            fix=f"use one of: {choices} (or add {root}/{name}/Dockerfile)",
        )
    return root / name


def recipe_hash(name: str) -> str:
    """Short sha256 over the recipe's files: relative path and bytes, in sorted order."""
    return folder_hash(recipe_dir(name))


def folder_hash(folder: Path) -> str:
    """Short sha256 over a folder's files: relative path and bytes, in sorted order."""
    digest = hashlib.sha256()
    for rel in sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()):
        digest.update(rel.encode() + b"\0" + hashlib.sha256((folder / rel).read_bytes()).digest())
    return digest.hexdigest()[:12]


def build_network() -> str:
    """The network `RUN` steps of image builds get: $AGENTRL_BUILD_NETWORK, else `host`.

    Task Dockerfiles install packages at build time (apt-get, pip), so builds need the
    network the machine has; `host` works on engines without a default bridge (dockerd
    --bridge=none) as well as on standard ones. `none` builds with no network at all.
    Sandboxes themselves always start with no network."""
    return os.environ.get("AGENTRL_BUILD_NETWORK") or "host"


def image_tag(name: str) -> str:
    """The tag recipe `name` is built as."""
    return f"agentrl/{name}:{SUITE}"


def build_image(
    name: str,
    method: Literal["auto", "dockerfile", "debootstrap"] = "auto",
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> ImageInfo:
    """Build `agentrl/<name>:bookworm` unless an image with the same recipe hash exists."""
    return build_recipe(
        recipe_dir(name), image_tag(name), method=method, force=force, progress=progress
    )


def build_recipe(
    folder: Path,
    tag: str | None = None,
    *,
    method: Literal["auto", "dockerfile", "debootstrap"] = "auto",
    force: bool = False,
    progress: Progress | None = None,
) -> ImageInfo:
    """Build any recipe folder (a Dockerfile and its context) unless its hash is already built.

    The tag defaults to `agentrl/task-<folder name>:<recipe hash>`.
    """
    if method not in ("auto", "dockerfile", "debootstrap"):
        raise ImageBuildError(
            f"unknown build method {method!r}", fix="use auto, dockerfile or debootstrap"
        )
    if not (folder / "Dockerfile").is_file():
        raise ImageBuildError(f"{folder} has no Dockerfile", fix="add one, or name another folder")
    start = time.monotonic()
    digest = folder_hash(folder)
    if tag is None:
        slug = re.sub(r"[^a-z0-9_.-]+", "-", folder.resolve().name.lower()).strip(".-_")
        tag = f"agentrl/task-{slug or 'recipe'}:{digest}"
    client = docker_client(timeout=600)
    try:
        current = _find(client, tag)
        old_hash = current.labels.get(RECIPE_LABEL) if current is not None else None
        if current is not None and old_hash == digest and not force:
            image_id, built = current.id or "", False
            chosen = current.labels.get(METHOD_LABEL, "dockerfile")
        else:
            chosen = _choose(client, folder, method)
            logger.info("building %s with %s (recipe %s, was %s)", tag, chosen, digest, old_hash)
            build = _build_dockerfile if chosen == "dockerfile" else _build_debootstrap
            labels = {RECIPE_LABEL: digest, METHOD_LABEL: chosen}
            try:
                image_id, built = build(client, folder, tag, labels, progress or logger.debug), True
            except DockerException as exc:
                raise ImageBuildError(f"building {tag} failed: {exc}") from exc
            if current is not None and current.id != image_id:
                _remove_quietly(client, current.id or "")
        seconds = time.monotonic() - start
        logger.info("%s: %s in %.1f s", tag, "built" if built else "up to date", seconds)
        return ImageInfo(
            tag=tag, id=image_id, recipe_hash=digest, method=chosen, built=built, seconds=seconds
        )
    finally:
        client.close()


def apt_mirror(suite: str = SUITE, etc: Path = Path("/etc/apt")) -> str:
    """The first `deb` URI this machine's apt sources use for `suite` itself.

    Entries for `<suite>-security` or `<suite>-updates` do not count; $AGENTRL_DEBIAN_MIRROR
    overrides (a host whose apt does not point at Debian needs it).
    """
    if override := os.environ.get("AGENTRL_DEBIAN_MIRROR"):
        return override
    for path in [etc / "sources.list", *sorted(etc.glob("sources.list.d/*.list"))]:
        for line in path.read_text().splitlines() if path.is_file() else []:
            fields = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
            if len(fields) >= 3 and fields[0] == "deb" and fields[2] == suite:
                return fields[1]
    for path in sorted(etc.glob("sources.list.d/*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            keys: dict[str, list[str]] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ", "\t")):
                    key, _, value = line.partition(":")
                    keys[key.strip().lower()] = value.split()
            enabled = keys.get("enabled", ["yes"]) != ["no"]
            wanted = "deb" in keys.get("types", []) and suite in keys.get("suites", [])
            if enabled and wanted and keys.get("uris"):
                return keys["uris"][0]
    raise ImageBuildError(
        f"no apt source for Debian {suite} in {etc}/sources.list or {etc}/sources.list.d",
        fix="set AGENTRL_DEBIAN_MIRROR to a Debian mirror URL that this machine can reach",
    )


def _find(client: docker.DockerClient, ref: str) -> Image | None:
    try:
        return client.images.get(ref)
    except ImageNotFound:
        return None


def _instructions(folder: Path) -> list[tuple[str, str]]:
    """The Dockerfile's (KEYWORD, arguments) pairs, continuation lines joined."""
    text = (folder / "Dockerfile").read_text().replace("\\\n", " ")
    pairs = [line.strip().partition(" ") for line in text.splitlines()]
    return [(kw.upper(), rest.strip()) for kw, _, rest in pairs if kw and not kw.startswith("#")]


def _base_image(folder: Path) -> str:
    args = next((rest for kw, rest in _instructions(folder) if kw == "FROM"), "")
    refs = [a for a in args.split() if not a.startswith("--")]
    if not refs:
        raise ImageBuildError(f"{folder / 'Dockerfile'} has no FROM line")
    return refs[0]


def _choose(client: docker.DockerClient, folder: Path, method: str) -> Method:
    base = _base_image(folder)
    if method in ("auto", "dockerfile") and _find(client, base) is not None:
        return "dockerfile"
    if base.startswith("sha256:"):  # an image id: it cannot be pulled or debootstrapped
        raise ImageBuildError(
            f"{folder.name} builds FROM image {base[:19]}, which no longer exists "
            "(removed while this build was starting?)",
            fix="build again; if it recurs, find what removes images during builds",
        )
    if method in ("auto", "dockerfile") and _pull(base):
        return "dockerfile"
    if method == "dockerfile":
        raise ImageBuildError(
            f"base image {base} is not present and cannot be pulled",
            fix=f"`docker load` {base}, or build with method 'debootstrap'",
        )
    installed = shutil.which("debootstrap") is not None
    if installed and os.geteuid() == 0:
        return "debootstrap"
    missing = "debootstrap needs root" if installed else "debootstrap is not installed"
    prefix = "" if method == "debootstrap" else f"{base} cannot be pulled and "
    raise ImageBuildError(
        f"cannot build {folder.name}: {prefix}{missing}",
        fix=f"apt-get install debootstrap and build as root, or `docker load` {base}",
    )


def _pull(ref: str) -> bool:
    repo, tag = parse_repository_tag(ref)
    # A separate short-timeout client, so an unreachable registry cannot stall the build.
    puller = docker_client(timeout=PULL_TIMEOUT_S)
    try:
        puller.images.pull(repo, tag=tag or "latest")
    except (DockerException, requests.RequestException) as exc:
        reason = getattr(exc, "explanation", None) or str(exc)
        logger.info("cannot pull %s: %s", ref, (reason.splitlines() or [""])[0][:200])
        return False
    finally:
        puller.close()
    return True


def _build_dockerfile(
    client: docker.DockerClient, folder: Path, tag: str, labels: dict[str, str], emit: Progress
) -> str:
    tail = deque[str](maxlen=15)
    image_id = None
    # docker tags the image only once every step succeeded; forcerm drops failed steps.
    for chunk in client.api.build(
        path=str(folder),
        tag=tag,
        labels=labels,
        rm=True,
        forcerm=True,
        decode=True,
        network_mode=build_network(),
    ):
        for line in ANSI_COLOR.sub("", chunk.get("stream", "")).splitlines():
            if line.strip():
                tail.append(line)
                emit(line)
        if "error" in chunk:
            error = ANSI_COLOR.sub("", chunk["error"]).strip()
            raise ImageBuildError(f"docker build of {folder} failed: {error}\n" + "\n".join(tail))
        image_id = chunk.get("aux", {}).get("ID", image_id)
    if image_id is None:
        raise ImageBuildError(f"docker build of {folder} reported no image id")
    return image_id


def _build_debootstrap(
    client: docker.DockerClient, folder: Path, tag: str, labels: dict[str, str], emit: Progress
) -> str:
    base, packages_file = _base_image(folder), folder / "packages.txt"
    if not base.startswith(f"debian:{SUITE}") or not packages_file.is_file():
        raise ImageBuildError(
            f"debootstrap makes only debian:{SUITE} recipes with a packages.txt, "
            f"and {folder.name} builds FROM {base}",
            fix=f"make {base} available (docker load, or build its recipe), then use 'dockerfile'",
        )
    lines = [ln.split("#", 1)[0].strip() for ln in packages_file.read_text().splitlines()]
    mirror, include = apt_mirror(), ",".join(p for p in lines if p)
    changes = [f"ENV PATH={DEFAULT_PATH}"]
    changes += [f"{kw} {rest}" for kw, rest in _instructions(folder) if kw in IMPORTABLE]
    changes += [f"LABEL {key}={value}" for key, value in labels.items()]
    work = Path(tempfile.mkdtemp(prefix=f"agentrl-{folder.name}-")).resolve()
    rootfs, archive = work / "rootfs", work / "rootfs.tar"
    log_path = Path(tempfile.gettempdir()) / f"agentrl-{folder.name}-debootstrap.log"
    cmd = ["debootstrap", "--variant=minbase", f"--include={include}", SUITE, str(rootfs), mirror]
    emit(f"debootstrap {SUITE} from {mirror} (a minute or two)")
    proc, tail = None, deque[str](maxlen=15)
    try:
        with log_path.open("w") as log:
            # Own process group, so cleanup can stop dpkg and wget in the chroot too.
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            for line in proc.stdout or []:
                log.write(line)
                tail.append(line.rstrip())
                emit(line.rstrip())
            inner = rootfs / "debootstrap" / "debootstrap.log"
            if proc.wait() != 0 and inner.is_file():  # dpkg's output from the chroot is here
                log.write(f"--- {inner}\n{inner.read_text(errors='replace')}")
        if proc.returncode != 0:
            raise ImageBuildError(
                f"debootstrap exited {proc.returncode} (full log: {log_path}):\n" + "\n".join(tail),
                fix=f"check that {mirror} answers (apt-get update) and {packages_file}",
            )
        log_path.unlink()
        for path in (p for pattern in APT_CACHES for p in rootfs.glob(pattern)):
            path.unlink()
        emit("importing the rootfs into docker")
        packed = subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(archive), "."],
            capture_output=True,
            text=True,
        )
        if packed.returncode != 0:
            raise ImageBuildError(f"packing {rootfs} failed: {packed.stderr.strip()[-300:]}")
        with archive.open("rb") as stream:
            reply = client.api.import_image(src=stream, changes=changes)
        image_id = str(json.loads(reply.strip().splitlines()[-1]).get("status", ""))
        if not image_id.startswith("sha256:"):
            raise ImageBuildError(f"docker import failed: {reply.strip()[-300:]}")
        # Untagged until here, so a failed or killed build never leaves a half-made tag.
        client.images.get(image_id).tag(*tag.rsplit(":", 1))
        return image_id
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    """Detach what a killed debootstrap left mounted (/proc, /sys) before deleting `root`."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(f"{root}/")), reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def _remove_quietly(client: docker.DockerClient, image_id: str) -> None:
    """Drop the image a rebuild replaced; one still in use or tagged elsewhere stays."""
    try:
        client.images.remove(image_id)
    except DockerException as exc:
        logger.debug("kept old image %s: %s", image_id, exc)
