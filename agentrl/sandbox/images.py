# Over 400 lines: a recipe's hash and its three builds share one lock and one cache.
"""Sandbox images: find a recipe in `sandboxes/<name>/`, hash it, and build it once.

A recipe is a folder with a Dockerfile and, for package-list recipes, `packages.txt`.
Where the Dockerfile's base image is present or can be pulled, `docker build` makes the
image. On a machine without a registry, a `debian:bookworm` recipe is made offline:
debootstrap installs `packages.txt` from the machine's own apt mirror and the rootfs is
`docker import`ed with the Dockerfile's ENV/WORKDIR/CMD lines. Either way the image is
tagged `agentrl/<name>:bookworm` and labelled with the recipe hash, so an unchanged
recipe is never built twice. `build_recipe` does the same for any folder (a task's own
Dockerfile), tagged `agentrl/task-<folder>:<hash>`.

Published tasks build FROM registry images (`ubuntu:24.04`, `python:3.13-slim-bookworm`,
Terminal-Bench's `ghcr.io/...` bases). Where such a base is neither present nor pullable,
the recipe in `sandboxes/standins/` that is labelled `agentrl.stands-in-for=<that name>`
builds a stand-in under the same name: distribution roots by debootstrap from the
distribution's own archive (Debian and Ubuntu suites, `ROOTFS`), the rest by Dockerfile on
top of those. A stand-in keeps its label, so `agentrl check` can say a result was measured
on one; a real image present under the name is always used as it is. An image is up to
date when its recipe hash is unchanged and the base it was built on is still the base.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import docker
import requests
from docker.errors import DockerException, ImageNotFound
from docker.models.images import Image
from docker.utils import parse_repository_tag
from pydantic import BaseModel, ConfigDict

from agentrl import scratch
from agentrl.errors import DockerUnavailableError, ImageBuildError

logger = logging.getLogger(__name__)

SUITE = "bookworm"
RECIPE_LABEL = "agentrl.recipe"
METHOD_LABEL = "agentrl.method"
BASE_LABEL = "agentrl.base-id"
"""The id of the image a Dockerfile build started FROM: a rebuilt base makes it stale."""
STANDIN_LABEL = "agentrl.stands-in-for"
"""On a stand-in recipe (a Dockerfile LABEL) and its image: the registry name it replaces."""
UBUNTU_ARCHIVE = "http://archive.ubuntu.com/ubuntu"
UBUNTU_KEYRING_DEB = (
    "pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb",
    "36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8",
)
"""Ubuntu's archive keyring, pinned by hash; debootstrap checks the suite's Release with it."""
PULL_TIMEOUT_S = 30
# `docker import` sets no PATH, and these are the Dockerfile lines it can apply.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMPORTABLE = ("CMD", "ENTRYPOINT", "ENV", "EXPOSE", "LABEL", "USER", "VOLUME", "WORKDIR")
# Left by debootstrap; dropped before import to keep the image small (file names only).
APT_CACHES = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*")

ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")

Method = Literal["dockerfile", "debootstrap"]
Progress = Callable[[str], None]


class Rootfs(BaseModel):
    """A distribution root that debootstrap can make: which suite, from which archive."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    distro: Literal["debian", "ubuntu"]
    suite: str
    script: str
    """debootstrap's script for the suite (Ubuntu suites newer than debootstrap reuse one)."""


ROOTFS: dict[str, Rootfs] = {
    **{
        key: Rootfs(distro="debian", suite=suite, script=suite)
        for suite, number in (("bullseye", "11"), ("bookworm", "12"), ("trixie", "13"))
        for key in (suite, number)
    },
    **{
        key: Rootfs(distro="ubuntu", suite=suite, script="gutsy")
        for suite, number in (("jammy", "22.04"), ("noble", "24.04"))
        for key in (suite, number)
    },
}
"""What `debian:<suite|number>[.point][-slim]` and `ubuntu:<suite|number>` name."""


def rootfs_for(image: str) -> Rootfs | None:
    """The distribution root an image name stands for (`debian:13.0-slim` is trixie)."""
    name, _, tag = image.partition(":")
    if name not in ("debian", "ubuntu", "library/debian", "library/ubuntu"):
        return None
    tag = tag.removesuffix("-slim")
    found = ROOTFS.get(tag) or ROOTFS.get(tag.split(".")[0] if name.endswith("debian") else tag)
    return found if found is not None and name.endswith(found.distro) else None


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
    standin: str | None = None
    """The registry image this one is, or is built on, an agentrl stand-in for."""


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


def missing_image_fix(image: str) -> str:
    """What to do about `image` when the engine does not have it. An `agentrl/` name is
    built only by the recipe that makes exactly that image; any other (a typo) gets the
    images the recipes make and the nearest, never a build of a different image."""
    if not image.startswith("agentrl/"):
        return f"docker pull {image} (or docker load it)"
    root = sandboxes_dir()
    recipes = {image_tag(p.parent.name): p.parent.name for p in root.glob("*/Dockerfile")}
    repository, tag = parse_repository_tag(image)
    if (named := f"{repository}:{tag or 'latest'}") in recipes:
        return f"agentrl images build {recipes[named]}"
    if repository.startswith(("agentrl/task-", "agentrl/swe-")):  # tags of built task recipes
        return "name the task's recipe folder in sandbox.recipe: agentrl builds its image"
    made = sorted(recipes)
    recipes_make = f"the recipes in {root} make {', '.join(made) or 'nothing'}, not {image}"
    if close := difflib.get_close_matches(image, made, n=1):
        return f"correct the task's sandbox.image: did you mean {close[0]}? ({recipes_make})"
    return f"correct the task's sandbox.image, or docker build/load {image} ({recipes_make})"


def extra_cas() -> list[Path]:
    """The certificate authorities this machine adds to the system's (Debian's convention:
    `*.crt` under $AGENTRL_BUILD_CA_DIR, else /usr/local/share/ca-certificates). A machine
    behind a TLS-intercepting proxy reaches package indexes only with them."""
    folder = Path(os.environ.get("AGENTRL_BUILD_CA_DIR") or "/usr/local/share/ca-certificates")
    return sorted(p for p in folder.rglob("*.crt") if p.is_file()) if folder.is_dir() else []


def recipe_digest(folder: Path) -> str:
    """The hash an image of recipe `folder` is labelled with: its files', and for a stand-in
    distribution root also the machine's extra certificate authorities it is given."""
    digest = folder_hash(folder)
    if not _is_standin_root(folder) or not (cas := extra_cas()):
        return digest
    joined = digest + "".join(hashlib.sha256(p.read_bytes()).hexdigest() for p in cas)
    return hashlib.sha256(joined.encode()).hexdigest()[:12]


def _is_standin_root(folder: Path) -> bool:
    standins = (sandboxes_dir() / "standins").resolve()
    inside = folder.resolve().parent == standins
    return (
        inside
        and (folder / "packages.txt").is_file()
        and rootfs_for(_base_image(folder)) is not None
    )


def recipe_hash(name: str) -> str:
    """Short sha256 over the recipe's files: relative path and bytes, in sorted order."""
    return folder_hash(recipe_dir(name))


def folder_hash(folder: Path) -> str:
    """Short sha256 over a folder's files: relative path and bytes, in sorted order."""
    digest = hashlib.sha256()
    for rel in sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()):
        digest.update(rel.encode() + b"\0" + hashlib.sha256((folder / rel).read_bytes()).digest())
    return digest.hexdigest()[:12]


def standin_recipes() -> dict[str, Path]:
    """Registry image name -> the recipe folder under `sandboxes/standins/` that stands in
    for it (its Dockerfile's `LABEL agentrl.stands-in-for=<name>`)."""
    found: dict[str, Path] = {}
    for dockerfile in sorted((sandboxes_dir() / "standins").glob("*/Dockerfile")):
        for keyword, rest in _instructions(dockerfile.parent):
            match = re.search(rf"{re.escape(STANDIN_LABEL)}=(\"[^\"]+\"|\S+)", rest)
            if keyword == "LABEL" and match:
                found[match.group(1).strip('"')] = dockerfile.parent
    return found


def build_network() -> str:
    """The network `RUN` steps of image builds get: $AGENTRL_BUILD_NETWORK, else `host`.

    Task Dockerfiles install packages at build time (apt-get, pip), so builds need the
    network the machine has; `host` works on engines without a default bridge (dockerd
    --bridge=none) as well as on standard ones. `none` builds with no network at all.
    Sandboxes themselves always start with no network."""
    return os.environ.get("AGENTRL_BUILD_NETWORK") or "host"


def repo_slug(name: str, default: str) -> str:
    """`name` as a Docker repository name's last part (lower case, no odd characters);
    `default` where nothing is left."""
    return re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip(".-_") or default


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


def build_standin(name: str, *, force: bool = False, progress: Progress | None = None) -> ImageInfo:
    """Build the stand-in for registry image `name` (`ubuntu:24.04`) under that name."""
    recipes = standin_recipes()
    if name not in recipes:
        choices = ", ".join(recipes) or "none"
        raise ImageBuildError(
            f"no stand-in recipe for {name!r} in {sandboxes_dir() / 'standins'}",
            fix=f"use one of: {choices}",
        )
    return build_recipe(recipes[name], name, force=force, progress=progress)


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
    digest = recipe_digest(folder)
    if tag is None:
        tag = f"agentrl/task-{repo_slug(folder.resolve().name, 'recipe')}:{digest}"
    emit = progress or logger.debug
    client = docker_client(timeout=600)
    try:
        with _tag_lock(tag):
            return _build_locked(client, folder, tag, digest, method, force, emit, start)
    finally:
        client.close()


@contextlib.contextmanager
def _tag_lock(tag: str) -> Iterator[None]:
    """One build of a tag at a time on this machine (processes and threads alike): two
    tasks on one missing stand-in build it once; the second finds it up to date."""
    from agentrl.cache import cache_root

    name = hashlib.sha256(tag.encode()).hexdigest()[:16]
    with machine_lock(cache_root() / "image-locks" / f"{name}.lock"):
        yield


@contextlib.contextmanager
def machine_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on the file `path` (made with its folder if missing), held by one
    process or thread of this machine at a time; the others wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_locked(
    client: docker.DockerClient,
    folder: Path,
    tag: str,
    digest: str,
    method: str,
    force: bool,
    emit: Progress,
    start: float,
) -> ImageInfo:
    """build_recipe's work, under the tag's lock."""
    current = _find(client, tag)
    old_hash = current.labels.get(RECIPE_LABEL) if current is not None else None
    if (
        current is not None
        and old_hash == digest
        and not force
        and _base_unchanged(client, folder, current, emit)
    ):
        image_id, built = current.id or "", False
        chosen = current.labels.get(METHOD_LABEL, "dockerfile")
    else:
        chosen, base_id = _choose(client, folder, method, emit)
        logger.info("building %s with %s (recipe %s, was %s)", tag, chosen, digest, old_hash)
        build = _build_dockerfile if chosen == "dockerfile" else _build_debootstrap
        labels = {RECIPE_LABEL: digest, METHOD_LABEL: chosen}
        if base_id:
            labels[BASE_LABEL] = base_id
        try:
            image_id, built = build(client, folder, tag, labels, emit), True
        except DockerException as exc:
            raise ImageBuildError(f"building {tag} failed: {exc}") from exc
        if current is not None and current.id != image_id:
            _remove_quietly(client, current.id or "")
    seconds = time.monotonic() - start
    logger.info("%s: %s in %.1f s", tag, "built" if built else "up to date", seconds)
    made = _find(client, image_id)
    return ImageInfo(
        tag=tag,
        id=image_id,
        recipe_hash=digest,
        method=chosen,
        built=built,
        seconds=seconds,
        standin=made.labels.get(STANDIN_LABEL) if made is not None else None,
    )


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


def _choose(
    client: docker.DockerClient, folder: Path, method: str, emit: Progress
) -> tuple[Method, str | None]:
    """How to build `folder`, and the id of the base image a Dockerfile build starts from.

    A base that is present (a stale stand-in rebuilt first), pullable, or made from its
    stand-in recipe means a Dockerfile build; a package-list recipe FROM a distribution
    root is made by debootstrap where its base cannot be had."""
    base = _base_image(folder)
    standin = standin_recipes().get(base)
    own = standin is not None and standin.resolve() == folder.resolve()
    rooted = (folder / "packages.txt").is_file() and rootfs_for(base) is not None
    if method in ("auto", "dockerfile") and not own:
        image = _fresh_base(client, base, emit)
        if image is not None:
            return "dockerfile", image.id
        if base.startswith("sha256:"):  # an image id: it cannot be pulled or debootstrapped
            raise ImageBuildError(
                f"{folder.name} builds FROM image {base[:19]}, which no longer exists "
                "(removed while this build was starting?)",
                fix="build again; if it recurs, find what removes images during builds",
            )
        if _pull(base):
            pulled = _find(client, base)
            return "dockerfile", pulled.id if pulled is not None else None
        if standin is not None and not (rooted and method == "auto" and _can_debootstrap()):
            emit(f"{base} is not present and cannot be pulled: building its stand-in {standin}")
            return "dockerfile", build_recipe(standin, base, progress=emit).id
    if method == "dockerfile":
        raise ImageBuildError(
            f"base image {base} is not present and cannot be pulled",
            fix=f"`docker load` {base}, or build with method 'debootstrap'",
        )
    if _can_debootstrap():
        return "debootstrap", None
    missing = (
        "debootstrap needs root" if shutil.which("debootstrap") else "debootstrap is not installed"
    )
    prefix = "" if method == "debootstrap" else f"{base} cannot be pulled and "
    raise ImageBuildError(
        f"cannot build {folder.name}: {prefix}{missing}",
        fix=f"apt-get install debootstrap and build as root, or `docker load` {base}",
    )


def _can_debootstrap() -> bool:
    return shutil.which("debootstrap") is not None and os.geteuid() == 0


def _fresh_base(client: docker.DockerClient, base: str, emit: Progress) -> Image | None:
    """The base image if present; a stand-in whose recipe changed is rebuilt first."""
    image = _find(client, base)
    standin = standin_recipes().get(base)
    if image is None or standin is None or image.labels.get(STANDIN_LABEL) != base:
        return image
    if image.labels.get(RECIPE_LABEL) == recipe_digest(standin):
        return image
    emit(f"the stand-in for {base} is out of date: rebuilding it from {standin}")
    build_recipe(standin, base, progress=emit)
    return _find(client, base)


def _base_unchanged(
    client: docker.DockerClient, folder: Path, image: Image, emit: Progress
) -> bool:
    """Whether the base `image` was built on is still what its FROM names (a recorded base
    that is absent now, or a build that recorded none, counts as unchanged)."""
    recorded = image.labels.get(BASE_LABEL)
    if not recorded:
        return True
    base = _fresh_base(client, _base_image(folder), emit)
    return base is None or base.id == recorded


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


def build_context(
    context: Path,
    tag: str,
    *,
    dockerfile: str,
    bases: list[str],
    buildargs: dict[str, str],
    labels: dict[str, str],
    progress: Progress | None = None,
) -> str:
    """Build the Dockerfile at `dockerfile` (relative to `context`) into `tag`, its `bases`
    made present first (`ensure_base`); unless `tag` already carries `labels`' recipe hash.
    For folders that are not recipes (an imported format's own layout)."""
    emit = progress or logger.debug
    client = docker_client(timeout=1800)
    try:
        with _tag_lock(tag):
            # the bases first: a stand-in whose recipe changed is rebuilt, and so is this
            made = {**labels, BASE_LABEL: ",".join(ensure_base(client, b, emit) for b in bases)}
            found = _find(client, tag)
            if found is not None and all(found.labels.get(k) == v for k, v in made.items()):
                return found.id or ""
            try:
                image_id = _build_dockerfile(
                    client, context, tag, made, emit, dockerfile=dockerfile, buildargs=buildargs
                )
            except DockerException as exc:
                raise ImageBuildError(f"building {tag} failed: {exc}") from exc
            if found is not None and found.id != image_id:
                _remove_quietly(client, found.id or "")
            return image_id
    finally:
        client.close()


def ensure_base(client: docker.DockerClient, base: str, emit: Progress) -> str:
    """The id of image `base`, made present first: a stale stand-in rebuilt, pulled, or built
    from its stand-in recipe; ImageBuildError when none of them can."""
    image = _fresh_base(client, base, emit)
    if image is None and _pull(base):
        image = _find(client, base)
    if image is None and (standin := standin_recipes().get(base)) is not None:
        emit(f"{base} is not present and cannot be pulled: building its stand-in {standin}")
        return build_recipe(standin, base, progress=emit).id
    if image is None:
        raise ImageBuildError(
            f"base image {base} is not present and cannot be pulled",
            fix=f"`docker load` {base}, or add a stand-in recipe for it under "
            f"{sandboxes_dir() / 'standins'}",
        )
    return image.id or ""


def _build_dockerfile(
    client: docker.DockerClient,
    folder: Path,
    tag: str,
    labels: dict[str, str],
    emit: Progress,
    *,
    dockerfile: str | None = None,
    buildargs: dict[str, str] | None = None,
) -> str:
    tail = deque[str](maxlen=15)
    image_id = None
    # docker tags the image only once every step succeeded; forcerm drops failed steps.
    for chunk in client.api.build(
        path=str(folder),
        dockerfile=dockerfile,
        buildargs=buildargs,
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
    rootfs_of = rootfs_for(base)
    if rootfs_of is None or not packages_file.is_file():
        known = ", ".join(sorted({f"{r.distro}:{r.suite}" for r in ROOTFS.values()}))
        raise ImageBuildError(
            f"debootstrap makes only recipes FROM a distribution root ({known}) with a "
            f"packages.txt, and {folder.name} builds FROM {base}",
            fix=f"make {base} available (docker load, or build its recipe), then use 'dockerfile'",
        )
    lines = [ln.split("#", 1)[0].strip() for ln in packages_file.read_text().splitlines()]
    include = ",".join(p for p in lines if p)
    mirror, keyring = _archive(rootfs_of, emit)
    changes = [f"ENV PATH={DEFAULT_PATH}"]
    changes += [f"{kw} {rest}" for kw, rest in _instructions(folder) if kw in IMPORTABLE]
    changes += [f"LABEL {key}={value}" for key, value in labels.items()]
    work = scratch.make("debootstrap").resolve()
    rootfs, archive = work / "rootfs", work / "rootfs.tar"
    log_path = Path(tempfile.gettempdir()) / f"agentrl-{folder.name}-debootstrap.log"
    cmd = ["debootstrap", "--variant=minbase", *([f"--include={include}"] if include else [])]
    components = "main,universe" if rootfs_of.distro == "ubuntu" else "main"
    cmd += [f"--components={components}", f"--keyring={keyring}"]
    cmd += [rootfs_of.suite, str(rootfs), mirror]
    cmd += [f"/usr/share/debootstrap/scripts/{rootfs_of.script}"]
    emit(f"debootstrap {rootfs_of.distro} {rootfs_of.suite} from {mirror} (a minute or two)")
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
        (rootfs / "etc/apt/sources.list").write_text(apt_sources(rootfs_of, mirror))
        if _is_standin_root(folder):  # so builds on it reach PyPI where this machine does
            trusted = rootfs / "usr/local/share/ca-certificates"
            trusted.mkdir(parents=True, exist_ok=True)
            for ca in extra_cas():
                shutil.copyfile(ca, trusted / f"agentrl-host-{ca.name}")
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


def apt_sources(rootfs: Rootfs, mirror: str) -> str:
    """The apt sources a root is left with: the suites and components its official Docker
    image has (Ubuntu's universe included: published task Dockerfiles install from it)."""
    suite = rootfs.suite
    if rootfs.distro == "ubuntu":
        parts = "main restricted universe multiverse"
        suites = (suite, f"{suite}-updates", f"{suite}-security")
        return "".join(f"deb {mirror} {s} {parts}\n" for s in suites)
    security = mirror.rstrip("/").rsplit("/", 1)[0] + "/debian-security"
    return (
        f"deb {mirror} {suite} main\ndeb {mirror} {suite}-updates main\n"
        f"deb {security} {suite}-security main\n"
    )


def _archive(rootfs: Rootfs, emit: Progress) -> tuple[str, Path]:
    """The archive URL a root comes from, and the keyring that signs its Release file.

    Debian: this machine's own apt mirror and the host's `debian-archive-keyring`. Ubuntu:
    $AGENTRL_UBUNTU_MIRROR else archive.ubuntu.com, with Ubuntu's keyring package fetched
    from that archive once and checked against the hash pinned here."""
    if rootfs.distro == "debian":
        try:
            mirror = apt_mirror(rootfs.suite)
        except ImageBuildError:
            mirror = apt_mirror(SUITE)
        return mirror, Path("/usr/share/keyrings/debian-archive-keyring.gpg")
    from agentrl.cache import cache_root

    mirror = (os.environ.get("AGENTRL_UBUNTU_MIRROR") or UBUNTU_ARCHIVE).rstrip("/")
    path, sha256 = UBUNTU_KEYRING_DEB
    folder = cache_root() / "keyrings" / sha256[:16]
    keyring = folder / "usr/share/keyrings/ubuntu-archive-keyring.gpg"
    if keyring.is_file():
        return mirror, keyring
    emit(f"fetching Ubuntu's archive keyring from {mirror}")
    try:
        reply = requests.get(f"{mirror}/{path}", timeout=60)
        reply.raise_for_status()
    except requests.RequestException as exc:
        raise ImageBuildError(
            f"cannot fetch {mirror}/{path}: {exc}",
            fix="set AGENTRL_UBUNTU_MIRROR to an Ubuntu archive this machine can reach",
        ) from exc
    if hashlib.sha256(reply.content).hexdigest() != sha256:
        raise ImageBuildError(
            f"{mirror}/{path} does not have the pinned sha256 {sha256[:16]}...",
            fix="point AGENTRL_UBUNTU_MIRROR at a faithful Ubuntu mirror",
        )
    with tempfile.TemporaryDirectory() as tmp:
        deb = Path(tmp) / "keyring.deb"
        deb.write_bytes(reply.content)
        unpacked = Path(tmp) / "root"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(unpacked), str(folder))
    return mirror, keyring


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
