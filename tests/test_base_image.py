"""The base sandbox image: built once per recipe hash, works offline, has no network."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from pathlib import Path

import pytest
from docker.errors import DockerException

from agentrl.errors import DockerUnavailableError, ImageBuildError
from agentrl.sandbox.images import (
    RECIPE_LABEL,
    ROOTFS,
    STANDIN_LABEL,
    ImageInfo,
    _base_image,
    apt_mirror,
    apt_sources,
    build_image,
    build_recipe,
    docker_client,
    folder_hash,
    recipe_hash,
    rootfs_for,
    sandboxes_dir,
    standin_recipes,
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


def test_image_names_map_to_the_distribution_roots_debootstrap_makes() -> None:
    assert rootfs_for("debian:13.0-slim") == ROOTFS["trixie"]
    assert rootfs_for("debian:bookworm-slim") == ROOTFS["bookworm"]
    assert rootfs_for("ubuntu:24.04") == ROOTFS["noble"]
    assert ROOTFS["noble"].distro == "ubuntu"
    for name in ("python:3.13-slim-bookworm", "ubuntu:13", "debian:24.04", "alpine:3.20"):
        assert rootfs_for(name) is None, name
    ubuntu = apt_sources(ROOTFS["noble"], "http://archive.example/ubuntu")
    assert "noble-security main restricted universe multiverse" in ubuntu  # tasks use universe
    debian = apt_sources(ROOTFS["trixie"], "http://mirror.example/debian")
    assert "deb http://mirror.example/debian-security trixie-security main" in debian


def test_every_base_image_of_the_corpus_has_a_stand_in_recipe() -> None:
    """A fresh machine without a registry builds every base the genuine tasks name."""
    from agentrl.corpus import manifest

    bases = {t["base_image"] for t in manifest("corpus.json")["tasks"]}
    recipes = standin_recipes()
    assert bases <= set(recipes), bases - set(recipes)
    for name, folder in recipes.items():  # and each stand-in's own base has one too
        base = _base_image(folder)
        assert base == name and rootfs_for(name) or base in recipes, (name, base)


@pytest.mark.docker
def test_a_missing_base_is_built_from_its_stand_in_and_a_rebuilt_one_rebuilds_its_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base_image: ImageInfo
) -> None:
    name = f"agentrl-test/standin-{uuid.uuid4().hex[:8]}:1"
    standin = tmp_path / "standins" / "fake"
    standin.mkdir(parents=True)
    dockerfile = f"FROM {base_image.tag}\nLABEL {STANDIN_LABEL}={name}\n"
    (standin / "Dockerfile").write_text(dockerfile + "RUN echo one > /stood-in\n")
    task = tmp_path / "task"
    task.mkdir()
    (task / "Dockerfile").write_text(f"FROM {name}\nRUN cat /stood-in\n")
    monkeypatch.setenv("AGENTRL_SANDBOXES", str(tmp_path))
    client = docker_client()
    try:
        first = build_recipe(task, f"{name}-task")
        assert first.built and first.standin == name  # the label says what it stands in for
        assert client.images.get(name).labels[RECIPE_LABEL] == folder_hash(standin)
        assert not build_recipe(task, f"{name}-task").built

        (standin / "Dockerfile").write_text(dockerfile + "RUN echo two > /stood-in\n")
        again = build_recipe(task, f"{name}-task")  # the task's recipe did not change
        assert again.built and again.id != first.id
        out = client.containers.run(again.tag, ["cat", "/stood-in"], remove=True)
        assert out == b"two\n"
    finally:
        for ref in (f"{name}-task", name):
            with contextlib.suppress(DockerException):
                client.images.remove(ref, force=True)
        client.close()
