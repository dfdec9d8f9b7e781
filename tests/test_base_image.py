"""The base sandbox image: built once per recipe hash, works offline, has no network."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from agentrl.errors import DockerUnavailableError, ImageBuildError
from agentrl.sandbox.images import (
    RECIPE_LABEL,
    ImageInfo,
    apt_mirror,
    build_image,
    build_recipe,
    docker_client,
    recipe_hash,
    sandboxes_dir,
)

RUN_ID = f"test-base-image-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def base_image() -> ImageInfo:
    # About 90 s the first time on a machine without a registry (debootstrap).
    return build_image("base")


@pytest.mark.docker
@pytest.mark.slow
def test_build_labels_the_image_and_skips_an_unchanged_recipe(base_image: ImageInfo) -> None:
    assert base_image.tag == "agentrl/base:bookworm"
    assert base_image.recipe_hash == recipe_hash("base")
    client = docker_client()
    try:
        image = client.images.get(base_image.tag)
        assert image.id == base_image.id
        assert image.labels[RECIPE_LABEL] == base_image.recipe_hash
    finally:
        client.close()

    again = build_image("base")
    assert not again.built
    assert again.id == base_image.id
    assert again.method == base_image.method


@pytest.mark.docker
@pytest.mark.slow
def test_container_runs_python_and_git_with_no_network(base_image: ImageInfo) -> None:
    client = docker_client()
    labels = {"agentrl.run": RUN_ID}
    try:
        container = client.containers.run(
            base_image.tag, ["sleep", "120"], detach=True, network_mode="none", labels=labels
        )
        try:
            code, out = container.exec_run(["python3", "-c", "print(1+1)"])
            assert (code, out.decode().strip()) == (0, "2")
            code, out = container.exec_run(["git", "--version"])
            assert code == 0
            assert out.decode().startswith("git version")
            code, out = container.exec_run(["cat", "/proc/net/dev"])
            assert code == 0
            # Two header lines, then one line per interface: only loopback may exist.
            interfaces = [line.split(":")[0].strip() for line in out.decode().splitlines()[2:]]
            assert interfaces == ["lo"]
        finally:
            container.remove(force=True)
        leftovers = client.containers.list(all=True, filters={"label": f"agentrl.run={RUN_ID}"})
        assert leftovers == []
    finally:
        client.close()


def test_unknown_recipe_lists_the_available_ones() -> None:
    with pytest.raises(ImageBuildError) as caught:
        build_image("no-such-recipe")
    assert "no-such-recipe" in str(caught.value)
    assert "base" in str(caught.value)
    assert "base" in caught.value.fix


@pytest.mark.docker
def test_a_recipe_from_a_vanished_image_id_says_so(tmp_path: Path) -> None:
    """An image id cannot be pulled or debootstrapped: a base removed under a build is named
    as gone, not sent to debootstrap (which failed with a message about bookworm)."""
    (tmp_path / "Dockerfile").write_text("FROM sha256:" + "0" * 64 + "\nRUN true\n")
    with pytest.raises(ImageBuildError) as caught:
        build_recipe(tmp_path, "agentrl-test/vanished:latest")
    assert "sha256:000000000000 which no longer exists" in str(caught.value).replace(",", "")
    assert "debootstrap" not in str(caught.value)


def test_a_dead_engine_is_one_line_with_a_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'nonexistent.sock'}")
    for call in (docker_client, lambda: build_image("base")):
        with pytest.raises(DockerUnavailableError) as caught:
            call()
        assert "\n" not in str(caught.value)
        assert "nonexistent.sock" in str(caught.value)
        assert caught.value.fix.strip()


def test_recipe_hash_follows_the_recipe_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = recipe_hash("base")
    shutil.copytree(sandboxes_dir() / "base", tmp_path / "base")
    monkeypatch.setenv("AGENTRL_SANDBOXES", str(tmp_path))
    assert recipe_hash("base") == original

    with (tmp_path / "base" / "packages.txt").open("a") as packages:
        packages.write("less\n")
    changed = recipe_hash("base")
    assert changed != original

    (tmp_path / "base" / "extra.conf").write_text("x = 1\n")
    assert recipe_hash("base") not in (original, changed)


def test_apt_mirror_takes_the_plain_suite_not_security(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGENTRL_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    deb822 = tmp_path / "sources.list.d" / "debian.sources"
    deb822.write_text(
        "Types: deb\n"
        "URIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\n"
        "Components: main\n"
        "\n"
        "Types: deb\n"
        "# a comment line\n"
        "URIs: http://main.example/debian\n"
        "Suites: bookworm bookworm-updates\n"
        "Components: main\n"
    )
    assert apt_mirror("bookworm", etc=tmp_path) == "http://main.example/debian"

    (tmp_path / "sources.list").write_text(
        "deb http://security.example/debian-security bookworm-security main\n"
        "deb [signed-by=/usr/share/keyrings/k.gpg] http://one-line.example/debian bookworm main\n"
    )
    assert apt_mirror("bookworm", etc=tmp_path) == "http://one-line.example/debian"

    with pytest.raises(ImageBuildError) as caught:
        apt_mirror("trixie", etc=tmp_path)
    assert "AGENTRL_DEBIAN_MIRROR" in caught.value.fix
