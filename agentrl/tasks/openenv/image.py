"""An OpenEnv environment folder's image, built as `openenv build` builds a standalone one:
the folder copied to a build context of its own, `server/Dockerfile` (else `Dockerfile`)
with build arguments `BUILD_MODE=standalone` and `ENV_NAME`.

Two differences, both of how and not of what: the build runs on the engine's own builder,
so the BuildKit cache mounts of the published Dockerfiles (`RUN --mount=type=cache,...`,
which only keep a download cache between builds) are left out of the copy's Dockerfile;
and a base image that can be neither found nor pulled (OpenEnv's
`ghcr.io/meta-pytorch/openenv-base`) is built from its stand-in recipe, as for every task
image (`agentrl.sandbox.images`). A Dockerfile that needs BuildKit for more than a cache
(a `# syntax=` line, another kind of mount, a heredoc) is refused, saying so.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from agentrl.errors import ImageBuildError
from agentrl.sandbox.images import RECIPE_LABEL, Progress, build_context, folder_hash, repo_slug

CACHE_MOUNT = re.compile(r"--mount=type=cache(?:,[^\s\\]*)?\s*")
BUILDKIT_ONLY = (
    (re.compile(r"^#\s*syntax\s*=", re.MULTILINE), "a `# syntax=` line"),
    (re.compile(r"--mount=(?!type=cache)"), "a mount other than a cache"),
    (re.compile(r"^\s*RUN\b[^\n]*<<-?\s*['\"]?\w+", re.MULTILINE), "a heredoc"),
)
_ARG = re.compile(r"^\s*ARG\s+(\w+)(?:=(\S*))?", re.IGNORECASE)
_FROM = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.IGNORECASE)


def dockerfile_of(folder: Path) -> Path:
    """The Dockerfile `openenv build` uses: `server/Dockerfile`, else one at the top."""
    for candidate in (folder / "server" / "Dockerfile", folder / "Dockerfile"):
        if candidate.is_file():
            return candidate
    raise ImageBuildError(
        f"{folder}: no server/Dockerfile (nor Dockerfile), so its image cannot be built",
        fix="an OpenEnv environment folder has its server's Dockerfile in server/",
    )


def env_image_tag(name: str, recipe: str) -> str:
    """The tag of environment `name`'s image built from files whose hash is `recipe`."""
    return f"agentrl/openenv-{repo_slug(name, 'env')}:{recipe}"


def build_env_image(folder: Path, name: str, progress: Progress | None = None) -> str:
    """The tag of `folder`'s image, built unless its files' hash is already built."""
    recipe = folder_hash(folder)  # read once: the tag and the label say the same files
    tag = env_image_tag(name, recipe)
    dockerfile = dockerfile_of(folder)
    text = dockerfile.read_text(errors="replace")
    for pattern, what in BUILDKIT_ONLY:
        if pattern.search(text):
            raise ImageBuildError(
                f"{dockerfile} needs BuildKit ({what}), which agentrl's builds do not use",
                fix="build the image yourself (docker buildx build) and name it in a task's "
                "sandbox.image",
            )
    with tempfile.TemporaryDirectory(prefix="agentrl-openenv-") as tmp:
        context = Path(tmp) / folder.name
        shutil.copytree(folder, context, symlinks=True)
        copy = context / dockerfile.relative_to(folder)
        copy.write_text(CACHE_MOUNT.sub("", text))
        build_context(
            context,
            tag,
            dockerfile=copy.relative_to(context).as_posix(),
            bases=bases(text),
            buildargs={"BUILD_MODE": "standalone", "ENV_NAME": env_name(folder)},
            labels={RECIPE_LABEL: recipe, "agentrl.openenv": name},
            progress=progress,
        )
    return tag


def env_name(folder: Path) -> str:
    """`ENV_NAME`, as `openenv build` passes it: the folder's name without `_env`."""
    return folder.resolve().name.replace("_env", "")


def bases(dockerfile: str) -> list[str]:
    """The images the Dockerfile builds FROM (build stages excepted), `ARG` defaults
    given before the first FROM filled in."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    found: list[str] = []
    seen_from = False
    for line in dockerfile.replace("\\\n", " ").splitlines():
        if not seen_from and (arg := _ARG.match(line)):
            args[arg.group(1)] = arg.group(2) or ""
            continue
        match = _FROM.match(line)
        if match is None:
            continue
        seen_from = True
        ref = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), match.group(1))
        if ref.lower() not in stages and ref != "scratch" and ref not in found:
            found.append(ref)
        if match.group(2):
            stages.add(match.group(2).lower())
    return found
