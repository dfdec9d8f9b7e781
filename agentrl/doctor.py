"""`agentrl doctor`: what this machine has, what is missing, the command that fixes it."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentrl.errors import AgentRLError


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def _python() -> Check:
    v = sys.version_info
    ok = v >= (3, 11)
    return Check(
        "python", ok, f"{v.major}.{v.minor}.{v.micro}", "" if ok else "install Python >= 3.11"
    )


def _torch() -> Check:
    try:
        import torch
    except ImportError:
        return Check("torch", False, "not installed", "pip install torch==2.13.0")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Check("torch", True, f"{torch.__version__}, {gpus} CUDA device(s)")


def _docker() -> Check:
    from agentrl.sandbox.images import docker_client

    try:
        client = docker_client(timeout=10)
    except AgentRLError as e:
        return Check("docker engine", False, str(e), e.fix)
    try:
        version = client.version().get("Version", "?")
    finally:
        client.close()
    return Check("docker engine", True, f"engine {version}")


def _base_image() -> Check:
    from agentrl.sandbox.images import RECIPE_LABEL, docker_client, image_tag, recipe_hash

    fix = "agentrl images build base"
    try:
        want = recipe_hash("base")
        client = docker_client(timeout=10)
    except AgentRLError as e:
        return Check("base image", False, str(e), e.fix or fix)
    try:
        tag = image_tag("base")
        images = client.images.list(name=tag)
    finally:
        client.close()
    if not images:
        return Check("base image", False, f"{tag} not built", fix)
    have = images[0].labels.get(RECIPE_LABEL)
    if have != want:
        return Check("base image", False, f"{tag} is stale (recipe {have}, want {want})", fix)
    return Check("base image", True, f"{tag} (recipe {want})")


def _chromium() -> Check:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        return Check("chromium", False, "not found on PATH", "sudo apt-get install -y chromium")
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=20, check=False
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check(
            "chromium",
            False,
            f"{path} does not run: {e}",
            "reinstall: apt-get install --reinstall chromium",
        )
    try:
        pw = importlib.metadata.version("playwright")
    except importlib.metadata.PackageNotFoundError:
        return Check("chromium", False, f"{out}; playwright missing", "pip install playwright")
    return Check("chromium", True, f"{out} at {path}; playwright {pw}")


def _model() -> Check:
    from agentrl.inference.embedded import INSTALL_HINT, gguf_path, model_dir

    try:
        src = gguf_path()
    except AgentRLError as e:
        return Check("embedded model", False, str(e), e.fix or INSTALL_HINT)
    cached = model_dir(convert=False)
    if (cached / "model.safetensors").is_file():
        return Check("embedded model", True, f"cached at {cached}")
    return Check(
        "embedded model",
        True,
        f"{src.name} found; converted to {cached} on first use (~35 s)",
    )


CHECKS: tuple[Callable[[], Check], ...] = (_python, _torch, _docker, _base_image, _chromium, _model)


def run_checks() -> list[Check]:
    results = []
    for check in CHECKS:
        try:
            results.append(check())
        except Exception as e:  # a broken probe is itself a finding, not a crash
            name = check.__name__.lstrip("_")
            results.append(Check(name, False, f"check failed: {type(e).__name__}: {e}"))
    return results


def print_report(checks: list[Check], console: Console) -> None:
    table = Table(title="agentrl doctor", show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail")
    for c in checks:
        status = Text("ok", "green") if c.ok else Text("missing", "red")
        table.add_row(c.name, status, c.detail)
    console.print(table)
    fixes = [c for c in checks if not c.ok and c.fix]
    for c in fixes:
        console.print(Text.assemble((f"fix {c.name}:", "yellow"), f" {c.fix}"))
    if not fixes:
        console.print("everything agentrl needs is here", style="green")
