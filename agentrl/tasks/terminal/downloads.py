"""What the offline test runtime brings, fetched on this machine and cached: uv from its
PyPI wheel, wheels of what the tests install (for the sandbox's Python, every platform's
markers resolved as uv locks them; a project published only as source gets its pure-Python
wheel built here), and a relocatable CPython for sandboxes that have none.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from docker import DockerClient

from agentrl.atomic import atomic_file, atomic_folder
from agentrl.cache import cache_root
from agentrl.errors import GraderError

PROVIDED_PYTHON = "3.13"
"""The Python brought for sandboxes without one (the version Terminal-Bench 2 tests ask uv
for): CPython built by agentrl's recipe `sandboxes/eval-python/`."""
PYTHON_GLIBC = "2.31"
"""The oldest C library the brought Python runs on (it is built on Debian bullseye)."""
DOWNLOAD_TIMEOUT_S = 600.0


def python_archive() -> Path:
    """A .tar.gz of the brought CPython (`python/` inside: bin/, lib/ with its own libraries;
    it runs from any folder): the image of `sandboxes/eval-python/` is built once per recipe
    (a few minutes; `agentrl images build eval-python` does it ahead of time) and its
    /python folder cached here."""
    from agentrl.sandbox.images import (
        build_image,
        docker_client,
        machine_lock,
        recipe_digest,
        recipe_dir,
    )

    digest = recipe_digest(recipe_dir("eval-python"))
    folder = cache_root() / "eval-runtime" / f"python-{PROVIDED_PYTHON}-{digest}"
    archive = folder / "python.tar.gz"
    with machine_lock(folder / ".lock"):  # episodes grade concurrently
        if archive.is_file():
            return archive
        info = build_image("eval-python")
        client = docker_client(timeout=600)
        container = client.containers.create(info.tag, ["true"])
        try:
            stream, _ = container.get_archive("/python")
            with tempfile.TemporaryFile() as raw, atomic_file(archive) as partial:
                for chunk in stream:
                    raw.write(chunk)
                raw.seek(0)
                with tarfile.open(fileobj=raw) as src, tarfile.open(partial, "w:gz") as dst:
                    for member in src:
                        dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        finally:
            container.remove(force=True)
            client.close()
    return archive


def apt_packages(image: str, packages: list[str]) -> tuple[list[Path], str]:
    """The .deb files `apt-get install packages` would install in `image` (what it lacks,
    with what that depends on), downloaded by the image's own apt in a throwaway container
    of it on the build network, cached per (image, packages); and why some are missing."""
    from agentrl.sandbox.images import docker_client, machine_lock

    client = docker_client(timeout=600)
    try:
        image_id = str(client.images.get(image).id)
        key = hashlib.sha256(f"{image_id}|{sorted(packages)}".encode()).hexdigest()[:16]
        folder = cache_root() / "eval-runtime" / "apt" / key
        # One download per key at a time (episodes grade concurrently), made in a scratch
        # folder and renamed into place, so nobody reads a half-filled folder.
        with machine_lock(folder.parent / f"{key}.lock"):
            if not (folder / ".complete").is_file():
                _download_debs(client, image_id, packages, folder)
        return sorted(folder.glob("*.deb")), (folder / ".complete").read_text().strip()
    finally:
        client.close()


def _download_debs(client: DockerClient, image_id: str, packages: list[str], folder: Path) -> None:
    from docker.errors import DockerException

    from agentrl.sandbox.images import build_network

    names = " ".join(shlex.quote(p) for p in packages)
    script = (
        "apt-get update -qq >/dev/null 2>&1; "
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --download-only "
        f"-o Dir::Cache::Archives=/agentrl-debs {names} 2>&1 | tail -3"
    )
    with atomic_folder(folder, replace=True) as scratch:
        (scratch / "partial").mkdir()
        try:
            out = client.containers.run(
                image_id,
                ["-c", script],
                entrypoint=["sh"],
                user="0",
                network_mode=build_network(),
                volumes={str(scratch): {"bind": "/agentrl-debs", "mode": "rw"}},
                remove=True,
            )
        except DockerException as exc:
            out = str(exc).encode()
        text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        found = any(scratch.glob("*.deb"))
        why = "" if found or "E:" not in text else " | ".join(text.strip().splitlines()[-2:])
        shutil.rmtree(scratch / "partial", ignore_errors=True)
        (scratch / ".complete").write_text(why[:300] + "\n")


def uv_binaries(version: str) -> Path:
    """A folder with `uv` and `uvx` of `version`, from the PyPI wheel (cached)."""
    folder = cache_root() / "eval-runtime" / f"uv-{version}-{platform.machine()}"
    if (folder / "uvx").is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        _pip_download([f"uv=={version}", "--no-deps", *_binary_flags(None)], Path(tmp))
        wheel = next(Path(tmp).glob("uv-*.whl"))
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as archive:
            for name in ("uv", "uvx"):
                member = next(n for n in archive.namelist() if n.endswith(f".data/scripts/{name}"))
                with atomic_file(folder / name) as target:
                    target.write_bytes(archive.read(member))
                    target.chmod(0o755)
    return folder


def wheelhouse(requirements: list[str], python: str) -> Path:
    """A folder of wheels for `requirements` and their dependencies, for CPython `python`
    (X.Y) on this machine's architecture; downloaded once per (requirements, python)."""
    key = hashlib.sha256(f"{sorted(requirements)}|{python}".encode()).hexdigest()[:16]
    folder = cache_root() / "eval-runtime" / "wheels" / f"py{python}-{key}"
    if (folder / ".complete").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    try:
        _pip_download([*requirements, *_binary_flags(python)], folder)
    except GraderError as binary_only:
        # Some project is published only as source: build its wheel here; a pure-Python
        # wheel serves every Python and platform, so the resolve for the sandbox can use it.
        _pure_wheels_from_source(requirements, folder, binary_only)
        _pip_download([*requirements, *_binary_flags(python), f"--find-links={folder}"], folder)
    # uv locks for every platform at once, so a dependency only Windows or macOS needs
    # (pytest's colorama) must be there too, though it is never installed here.
    others = _other_platform_requirements(folder)
    if others:
        _pip_download(["--no-deps", *others, *_binary_flags(python, platform_free=True)], folder)
    (folder / ".complete").write_text("\n".join(requirements) + "\n")
    return folder


def _pure_wheels_from_source(requirements: list[str], folder: Path, cause: GraderError) -> None:
    """Wheels built on this machine for what `requirements` need that has no wheel on the
    index, kept in `folder` when pure Python; GraderError (with `cause`) otherwise."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--quiet"]
        cmd += ["--wheel-dir", tmp, *requirements]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, env=os.environ
            )
        except subprocess.TimeoutExpired:
            raise cause from None
        if done.returncode != 0:
            raise cause
        built = [w for w in Path(tmp).glob("*.whl") if w.name.endswith("-none-any.whl")]
        for wheel in built:
            shutil.copy2(wheel, folder / wheel.name)
    if not built:
        raise cause


def _other_platform_requirements(folder: Path) -> list[str]:
    """Requirements of the wheels in `folder` that only apply off Linux (markers on
    sys_platform, platform_system or os_name), as `name<spec>` strings."""
    found: list[str] = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = archive.read(name).decode(errors="replace") if name else ""
        for line in text.splitlines():
            if not line.startswith("Requires-Dist:") or ";" not in line:
                continue
            requirement, marker = line[len("Requires-Dist:") :].split(";", 1)
            elsewhere = re.search(r"sys_platform|platform_system|os_name", marker)
            if elsewhere and "extra" not in marker and not re.search(r"linux|posix", marker):
                found.append(requirement.strip().replace(" ", ""))
    return list(dict.fromkeys(found))


def _binary_flags(python: str | None, *, platform_free: bool = False) -> list[str]:
    arch = platform.machine()
    tags = ["manylinux_2_28", "manylinux_2_17", "manylinux2014", "linux"]
    flags = ["--only-binary=:all:"]
    if not platform_free:
        flags += [f"--platform={t}_{arch}" for t in tags]
    if python:
        flags += [f"--python-version={python}", "--implementation=cp"]
    return flags


def _pip_download(args: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet"]
    cmd += ["--dest", str(dest), *args]
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, env=os.environ.copy()
        )
    except subprocess.TimeoutExpired:
        raise GraderError(
            f"preparing the offline test runtime: {' '.join(args)} timed out"
        ) from None
    if done.returncode != 0:
        last = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise GraderError(
            f"preparing the offline test runtime: pip download {' '.join(args)} failed: "
            f"{last[-400:]}",
            fix="check that this machine's package index (PyPI or its mirror) answers and "
            "has wheels for what the tests install",
        )
