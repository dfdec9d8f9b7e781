"""SWE-bench instance images built here, for rows whose published image cannot be pulled.

Two inputs, both recorded byte for byte: the repository archive (`make_archive`: a
depth-1 git repository whose HEAD is the row's base_commit, packed deterministically) and
the environment recipe (`Environment`: Debian bookworm's Python 3.11, exact pip pins,
the build backends an offline reinstall needs). The image is tagged with the name the
harness gives a local build, `sweb.eval.x86_64.<instance_id>:latest`, so `agentrl check`
finds it; it is built once per recipe hash.

What the eval scripts expect of an image, and how this one provides it: /testbed is the
repository at base_commit (they only `git checkout <base_commit> -- <test files>` and
`git apply`, so one commit is enough); `source /opt/miniconda3/bin/activate` then
`conda activate testbed` activates the environment (here a stand-in `conda` function and a
venv at /opt/miniconda3/envs/testbed); the install step they repeat works without a
network (the venv's pip.conf: no index, wheels from /opt/wheels).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from agentrl import atomic
from agentrl.cache import cache_root
from agentrl.errors import ImageBuildError
from agentrl.sandbox.images import ImageInfo, Progress, build_recipe, extra_cas
from agentrl.tasks.spec import DEFAULT_IMAGE
from agentrl.tasks.swe import WORKDIR

ENV_DIR = "/opt/miniconda3/envs/testbed"
WHEELS_DIR = "/opt/wheels"
GIT_TIMEOUT_S = 600
ACTIVATE = """\
# A stand-in for conda's activate script: `conda activate testbed` activates the venv at
# /opt/miniconda3/envs/testbed (agentrl's SWE-bench images have no conda).
conda() {
  if [ "${1:-}" = activate ]; then
    . "/opt/miniconda3/envs/${2:-testbed}/bin/activate"
  else
    echo "conda (stand-in): only 'conda activate ENV' works here" >&2
    return 1
  fi
}
if [ -n "${1:-}" ]; then conda activate "$1"; fi
"""
PIP_CONF = f"[global]\nno-index = true\nfind-links = {WHEELS_DIR}\n"
# Fixed git settings, so the same objects pack to the same bytes whatever the mirror's config.
PACK_CONFIG = (
    *("core.compression=9", "pack.compression=9", "pack.window=10", "pack.depth=50"),
    *("pack.threads=1", "pack.writeReverseIndex=false", "core.bigFileThreshold=512m"),
)


class Environment(BaseModel):
    """How an instance's Python environment is made (a manifest's `environments` entry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str = Field(
        default="3.11", pattern=r"^3\.11$", description="Debian bookworm's python3 (3.11)"
    )
    apt: list[str] = Field(default_factory=list, description="Debian packages installed first")
    pip: list[str] = Field(
        default_factory=list,
        description="NAME==VERSION of every package in the venv before the repository is "
        "installed, installed with --no-deps (the harness's requirements, resolved and frozen)",
    )
    wheels: list[str] = Field(
        default_factory=list,
        description="NAME==VERSION of the build backends put in /opt/wheels, for the eval "
        "script's install step without a network",
    )
    pre_install: list[str] = Field(
        default_factory=list, description="shell commands run in /testbed before `install`"
    )
    install: str = Field(description="the install step, as the harness's eval script repeats it")
    env: dict[str, str] = Field(default_factory=dict, description="variables set in the image")


def archive_name(repo: str, base_commit: str) -> str:
    """`<owner>__<name>-<base_commit[:12]>.tar.gz`."""
    return f"{repo.replace('/', '__')}-{base_commit[:12]}.tar.gz"


def testbed_tag(instance_id: str) -> str:
    """The name the harness gives a locally built instance image."""
    return f"sweb.eval.x86_64.{instance_id.lower()}:latest"


def make_archive(mirror: Path, commit: str, out: Path, *, branch: str = "main") -> str:
    """Write `out`: a .tar.gz of a depth-1 git repository (only `.git`, nothing checked out)
    whose branch `branch` and HEAD are `commit` from the git directory `mirror`; the sha256.

    The same objects give the same bytes (for one git version): one pack made with fixed
    settings and no reuse of the mirror's deltas, entries sorted, owners and mtimes zero.
    """
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(f"{commit!r} is not a full commit id")
    git = ["git", "-C", str(mirror), *(a for c in PACK_CONFIG for a in ("-c", c))]
    objects = _run([*git, "rev-list", "--objects", "--max-count=1", commit])
    with tempfile.TemporaryDirectory() as tmp:
        packs = Path(tmp) / "pack"
        packs.mkdir()
        name = _run([*git, "pack-objects", "--no-reuse-object", str(packs / "pack")], objects)
        files = {
            "HEAD": f"ref: refs/heads/{branch}\n".encode(),
            "config": b"[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n"
            b"\tbare = false\n\tlogallrefupdates = true\n",
            "shallow": f"{commit}\n".encode(),
            f"refs/heads/{branch}": f"{commit}\n".encode(),
        }
        for suffix in ("pack", "idx"):
            path = packs / f"pack-{name.strip()}.{suffix}"
            files[f"objects/pack/{path.name}"] = path.read_bytes()
        data = _targz({f".git/{k}": v for k, v in files.items()}, [".git/refs/tags"])
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(out, data)
    return hashlib.sha256(data).hexdigest()


def _targz(files: dict[str, bytes], empty_dirs: list[str]) -> bytes:
    """A gzipped tar of `files` and their folders: sorted, root-owned, mtime 0."""
    folders = set(empty_dirs)
    for name in files:
        parts = name.split("/")[:-1]
        folders |= {"/".join(parts[: i + 1]) for i in range(len(parts))}
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in sorted(folders | set(files)):
            info = tarfile.TarInfo(name)
            info.uid = info.gid = info.mtime = 0
            info.uname = info.gname = ""
            if name in files:
                info.mode, info.size = 0o644, len(files[name])
                tar.addfile(info, io.BytesIO(files[name]))
            else:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
    packed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=packed, compresslevel=9, mtime=0) as gz:
        gz.write(raw.getvalue())
    return packed.getvalue()


def build_testbed(
    instance_id: str,
    base_commit: str,
    archive: Path,
    environment: Environment,
    *,
    progress: Progress | None = None,
) -> ImageInfo:
    """Build (once per recipe hash) the instance's image, tagged `testbed_tag(instance_id)`."""
    if not archive.is_file():
        raise ImageBuildError(f"{instance_id}: repository archive {archive} does not exist")
    folder = cache_root() / "swe_bench" / "testbed" / instance_id
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "cas").mkdir(parents=True)
    cas = extra_cas()  # a machine behind a TLS-intercepting proxy reaches PyPI only with them
    for ca in cas:
        shutil.copyfile(ca, folder / "cas" / f"agentrl-build-{ca.name}")
    texts = {
        "activate": ACTIVATE,
        "pip.conf": PIP_CONF,
        "requirements.txt": "".join(f"{p}\n" for p in environment.pip),
        "wheels.txt": "".join(f"{w}\n" for w in environment.wheels),
        "Dockerfile": dockerfile(base_commit, environment, with_cas=bool(cas)),
    }
    for name, text in texts.items():
        (folder / name).write_text(text)
    shutil.copyfile(archive, folder / "testbed.tar.gz")
    return build_recipe(folder, testbed_tag(instance_id), progress=progress)


def dockerfile(base_commit: str, environment: Environment, *, with_cas: bool) -> str:
    """The instance image's Dockerfile. The steps up to the repository depend only on the
    environment, so instances that share one share those layers."""
    pip = f"{ENV_DIR}/bin/pip"
    quiet = "--no-cache-dir --disable-pip-version-check --no-input"
    cert = "PIP_CERT=/etc/ssl/certs/ca-certificates.crt"  # the system's, with any extra CAs
    apt = " ".join(["python3-venv", *map(shlex.quote, environment.apt)])
    lines = [f"FROM {DEFAULT_IMAGE}", "ARG DEBIAN_FRONTEND=noninteractive"]
    if with_cas:
        lines += [
            "COPY cas/ /usr/local/share/ca-certificates/",
            "RUN update-ca-certificates >/dev/null",
        ]
    lines += [
        "RUN apt-get update --error-on=any && apt-get install -y --no-install-recommends "
        f"{apt} && rm -rf /var/lib/apt/lists/*",
        "COPY requirements.txt wheels.txt /opt/miniconda3/",
        _run_bash(
            f"python{environment.python} -m venv {ENV_DIR}",
            f"if [ -s /opt/miniconda3/requirements.txt ]; then {cert} {pip} install {quiet} "
            "--no-deps -r /opt/miniconda3/requirements.txt; fi",
            f"mkdir -p {WHEELS_DIR}",
            f"if [ -s /opt/miniconda3/wheels.txt ]; then {cert} {pip} download {quiet} "
            f"--no-deps --only-binary=:all: --dest {WHEELS_DIR} -r /opt/miniconda3/wheels.txt; fi",
        ),
        "COPY activate /opt/miniconda3/bin/activate",
        f"COPY pip.conf {ENV_DIR}/pip.conf",
    ]
    if environment.env:
        lines.append("ENV " + " ".join(f"{k}={json.dumps(v)}" for k, v in environment.env.items()))
    lines += [
        "COPY testbed.tar.gz /tmp/testbed.tar.gz",
        _run_bash(
            f"mkdir {WORKDIR}",
            f"tar -xzf /tmp/testbed.tar.gz -C {WORKDIR} --no-same-owner",
            "rm /tmp/testbed.tar.gz",
            f"cd {WORKDIR}",
            "git reset -q --hard",
            f'test "$(git rev-parse HEAD)" = {base_commit}',
            *environment.pre_install,
            ". /opt/miniconda3/bin/activate testbed",
            environment.install,  # with pip.conf in place: the eval script's reinstall works
            'test -z "$(git status --porcelain)"',  # the install left the tree clean
        ),
        f"WORKDIR {WORKDIR}",
    ]
    return "\n".join(lines) + "\n"


def _run_bash(*steps: str) -> str:
    return "RUN " + json.dumps(["bash", "-euo", "pipefail", "-c", "\n".join(steps)])


def _run(cmd: list[str], stdin: str | None = None) -> str:
    try:
        done = subprocess.run(
            cmd, input=stdin, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageBuildError(f"{shlex.join(cmd[:6])} ...: {exc}") from None
    if done.returncode != 0:
        raise ImageBuildError(f"{shlex.join(cmd[:6])} ... failed: {done.stderr.strip()[-400:]}")
    return done.stdout
