"""SWE-style instances built here from a tiny local repository, for the tests that need
a real image without a registry: `calc.py` (add, sub) with its pytest file, in the
layouts the datasets publish (test_swe_formats, test_swe_recipe).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentrl.sandbox.images import docker_client

CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
BUG = (
    "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
    "@@ -1,5 +1,5 @@\n def add(a, b):\n-    return a + b\n+    return a - b\n"
    " \n \n def sub(a, b):\n"
)
"""A SWE-smith bug patch: add() subtracts."""
SUB_BUG = (
    "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n"
    "@@ -3,4 +3,4 @@ def add(a, b):\n \n \n def sub(a, b):\n-    return a - b\n+    return a + b\n"
)
"""Another: sub() adds."""
TESTS = (
    "from calc import add, sub\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "class TestCalc:\n    def test_sub(self):\n        assert sub(3, 2) == 1\n\n\n"
    "def test_known_bad():\n    assert False\n"
)


def write_rows(tmp_path: Path, rows: list[dict[str, Any]], name: str = "rows.jsonl") -> Path:
    """`rows` as a JSONL file in `tmp_path`."""
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_image(tmp_path: Path, tag: str, files: dict[str, str], run: str) -> str:
    """An image FROM the base with `files` and `run` (a shell line) in /testbed."""
    context = tmp_path / tag.replace("/", "_").replace(":", "_")
    for name, text in files.items():
        (context / "files" / name).parent.mkdir(parents=True, exist_ok=True)
        (context / "files" / name).write_text(text)
    (context / "Dockerfile").write_text(
        "FROM agentrl/base:bookworm\nCOPY files /testbed\nWORKDIR /testbed\n"
        f'RUN ["bash", "-c", {json.dumps(run)}]\n'
    )
    client = docker_client()
    try:
        client.images.build(path=str(context), tag=tag, rm=True, network_mode="none")
    finally:
        client.close()
    return tag


def git_init() -> str:
    """The shell line that makes /testbed a repository of one commit."""
    return (
        "git init -q -b main && git add -A && git -c user.name=u -c user.email=u@u "
        "commit -qm 'Initial commit'"
    )


def swe_smith_calc(tmp_path: Path, tag: str) -> str:
    """The clean calc repository as a SWE-smith image (its bugs come as patches)."""
    tests = TESTS.replace("def test_known_bad", "def _x")
    return build_image(tmp_path, tag, {"calc.py": CALC, "test_calc.py": tests}, git_init())


def swe_smith_row(
    instance_id: str, image: str, bug: str, fail: str, passing: str
) -> dict[str, Any]:
    """A SWE-smith row of the calc image: `bug` breaks the test `fail`; `passing` still passes."""
    return {
        "instance_id": instance_id,
        "repo": "swesmith/" + instance_id.rsplit(".", 1)[0],
        "patch": bug,
        "FAIL_TO_PASS": [fail],
        "PASS_TO_PASS": [passing],
        "image_name": image,
        "problem_statement": f"{fail.rsplit('::', 1)[-1]} fails: calc.py computes the wrong result",
    }


def remove_images(*names: str) -> None:
    """Remove the tags of these repositories (`repo` or `repo:tag`), children first.

    Only the named tags go: the build cache gives two tests' identical recipes one image id,
    so removing every tag of a matched image would delete another test's image mid-run."""
    client = docker_client()
    try:
        for name in names:
            for image in client.images.list(name=name):
                for tag in image.tags:  # untag: layers a failed build left stay dangling
                    if tag == name or tag.rsplit(":", 1)[0] == name:
                        client.images.remove(tag)
    finally:
        client.close()
