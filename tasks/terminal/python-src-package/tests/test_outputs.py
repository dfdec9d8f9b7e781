"""textkit is a src-layout package, installed in development mode for the system python3."""

import subprocess
import tomllib
from pathlib import Path

PROJECT = Path("/app/textkit-project")


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    # From /tmp, so nothing is importable just because it sits in the current folder.
    return subprocess.run(argv, cwd="/tmp", capture_output=True, text=True, timeout=30)


def python(code: str) -> str:
    done = run("python3", "-c", code)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_package_is_imported_from_the_src_folder() -> None:
    where = python("import textkit; print(textkit.__file__)")
    assert where == str(PROJECT / "src/textkit/__init__.py")


def test_version_and_exports() -> None:
    code = (
        "import textkit; print(textkit.__version__); "
        "print(textkit.slugify('Hello, World!')); print(textkit.word_count('a b  c'))"
    )
    assert python(code).splitlines() == ["0.3.0", "hello-world", "3"]


def test_python_dash_m() -> None:
    slug = run("python3", "-m", "textkit", "slug", "Ready, Set -- Go!")
    assert (slug.returncode, slug.stdout) == (0, "ready-set-go\n")
    count = run("python3", "-m", "textkit", "count", "/tests/sample.txt")
    assert (count.returncode, count.stdout) == (0, "6\n")
    bad = run("python3", "-m", "textkit")
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_console_script_on_path() -> None:
    done = run("textkit", "slug", "Console Script")
    assert (done.returncode, done.stdout) == (0, "console-script\n")


def test_pyproject() -> None:
    data = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    assert data["build-system"]["build-backend"] == "setuptools.build_meta"
    assert any(r.startswith("setuptools") for r in data["build-system"]["requires"])
    project = data["project"]
    assert (project["name"], project["version"]) == ("textkit", "0.3.0")
    assert project["requires-python"] == ">=3.9"
    assert project["scripts"] == {"textkit": "textkit.cli:main"}
    assert data["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]


def test_modules_moved_not_copied() -> None:
    assert sorted(p.name for p in PROJECT.glob("*.py")) == []
    for name in ("slugify", "wordcount", "cli"):
        assert (PROJECT / "src/textkit" / f"{name}.py").is_file()
    # the old flat modules are not importable on their own any more
    assert run("python3", "-c", "import wordcount").returncode != 0
