"""The rules of what a grader may see of an agent's work (`agentrl.sandbox.seal`), without
an engine; `tests/redteam/` shows them against real graders in Docker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentrl.sandbox.docker.grading import _layer_changes
from agentrl.sandbox.seal import (
    GradeScope,
    drop_reason,
    executable_pth_lines,
    named_paths,
    scope_for,
)

TESTS = """
import subprocess
from pathlib import Path

OUT = Path("/app/out.txt")

def test_it():
    assert open("/etc/service_config.ini").read()
    assert not Path('/tmp/service.pid').exists()
    subprocess.run(["/usr/bin/python3", "/tests/helper.py"])
    assert Path("~/.bashrc").expanduser()
    assert open("~/notes.txt")
"""


def test_the_paths_tests_name_are_outputs_but_never_the_runtime() -> None:
    named = named_paths(TESTS)
    assert named == [
        *("/app/out.txt", "/etc/service_config.ini", "/tmp/service.pid"),
        *("/root/.bashrc", "/root/notes.txt"),
    ]


@pytest.mark.parametrize(
    ("path", "covered"),
    [
        ("/app", True),
        ("/app/solution.py", True),
        ("/app/tests/test_x.py", False),  # the grader's own folder
        ("/etc/service_config.ini", True),
        ("/etc/passwd", False),
        ("/usr/local/bin/pytest", False),
        ("/usr/local/lib/python3.11/dist-packages/__editable__.pkg-1.0.pth", True),
        ("/usr/local/lib/python3.11/dist-packages/evil.pth", False),
        ("/application", False),
    ],
)
def test_a_scope_covers_its_outputs_and_nothing_else(path: str, covered: bool) -> None:
    scope = scope_for(
        "/app",
        ["/usr/local/lib/python3*/dist-packages/__editable__.*.pth"],
        ['open("/etc/service_config.ini")'],
        ["/app/tests"],
    )
    assert scope.covers(path) is covered


@pytest.mark.parametrize(
    ("path", "dropped"),
    [
        ("/app/sitecustomize.py", True),
        ("/app/lib/usercustomize.pyc", True),
        ("/app/__pycache__/sitecustomize.cpython-311.pyc", True),
        ("/app/conftest.py", True),  # above /app/tests, where pytest looks
        ("/app/pyproject.toml", True),
        ("/app/tests/../conftest.py", True),
        ("/conftest.py", True),
        ("/app/pkg/conftest.py", False),  # a project's own, beside the tests, not above
        ("/app/json.py", True),  # shadows the stdlib's json in the cwd
        ("/app/pytest/__init__.py", True),  # a package shadowing pytest
        ("/app/ssl", False),  # a folder alone: a namespace portion, the stdlib's ssl wins
        ("/app/ssl/server.crt", False),
        ("/app/solution.py", False),
        ("/app/sub/json.py", False),  # not in the cwd
    ],
)
def test_what_the_grader_would_run_is_dropped_even_inside_the_outputs(
    path: str, dropped: bool
) -> None:
    scope = GradeScope(outputs=("/app", "/"), tests=("/app/tests",), cwd="/app")
    why = drop_reason(
        path, scope, shadowable=["json", "pytest", "os", "ssl"], is_dir=path == "/app/ssl"
    )
    assert (why is not None) is dropped, why


def test_a_pth_keeps_its_paths_and_loses_what_it_would_execute() -> None:
    text = "/app/src\nimport os; os.system('evil')\n  import\tsys\n# a comment\n"
    kept, dropped = executable_pth_lines(text)
    assert kept == "/app/src\n# a comment\n"
    assert dropped == ["import os; os.system('evil')", "  import\tsys"]


def test_overlay_layers_read_as_one_diff_against_the_origin(tmp_path: Path) -> None:
    """The upper layer over a snapshot's layer over the image's: whiteouts, folders made
    again (opaque), and a file a later layer deleted again."""
    image, snapshot, upper = tmp_path / "image", tmp_path / "snapshot", tmp_path / "upper"
    for path in ("usr/bin/python3", "etc/os-release", "app/old/a", "app/data"):
        (image / path).parent.mkdir(parents=True, exist_ok=True)
        (image / path).write_text("image")
    (snapshot / "usr/bin").mkdir(parents=True)
    (snapshot / "usr/bin/python3").write_text("fake")  # changed before the snapshot
    (snapshot / "tmp").mkdir()
    (snapshot / "tmp/scratch").write_text("x")  # added, then deleted after it
    (upper / "app/old").mkdir(parents=True)
    os.setxattr(upper / "app/old", "trusted.overlay.opaque", b"y")  # rm -rf, mkdir again
    (upper / "app/old/b").write_text("new")
    (upper / "tmp").mkdir()
    os.mknod(upper / "tmp/scratch", 0o600 | 0o020000, 0)  # whiteout of a snapshot's file
    os.mknod(upper / "etc", 0o600 | 0o020000, 0)  # whiteout of an image folder
    changes = {(c.path, c.kind) for c in _layer_changes([upper, snapshot], [image])}
    assert changes == {
        ("/app", "changed"),
        ("/app/old", "replaced"),
        ("/app/old/b", "added"),
        ("/etc", "deleted"),
        ("/tmp", "added"),
        ("/usr", "changed"),
        ("/usr/bin", "changed"),
        ("/usr/bin/python3", "changed"),
    }


def test_a_module_the_image_already_had_in_the_cwd_is_the_module_not_a_shadow() -> None:
    """A repository's own `inflection.py` in /testbed, changed by the agent, is carried."""
    scope = GradeScope(outputs=("/testbed",), cwd="/testbed")
    names = ["inflection", "json"]
    assert drop_reason("/testbed/inflection.py", scope, shadowable=names, added=False) is None
    assert drop_reason("/testbed/json.py", scope, shadowable=names) is not None
