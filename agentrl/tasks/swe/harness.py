"""The classic SWE-bench harness's rules: per repository and version, the test command,
the log parser and the install step (swebench 4.1's MAP_REPO_VERSION_TO_SPECS and
MAP_REPO_TO_PARSER; SWE-Gym's fork for its repositories), and the eval script it
generates from them; `eval_spec` turns a row into the swebench TestSpec that grades it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from agentrl.errors import ConfigError
from agentrl.tasks.spec import Instance
from agentrl.tasks.swe import BASE_TAG, WORKDIR
from agentrl.tasks.swe.rules import patch_files

DEFAULT_TEST_CMD = "python3 -m pytest -rA -p no:cacheprovider"
CONDA = "if [ -f /opt/miniconda3/bin/activate ]; then . /opt/miniconda3/bin/activate testbed; fi; "
START, END = ">>>>> Start Test Output", ">>>>> End Test Output"
NON_TEST_EXTS = (
    *(".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml"),
    ".toml",
)
"""Files of test_patch that are no test directives (the harness's list, `csv` included)."""

# `_classic_spec` applies the version differences to these.
# MAP_REPO_TO_PARSER; SWE-Gym's fork for its repositories): the test command, the log
# parser, the install step its eval script repeats, extra commands; `_classic_spec` applies
# the version differences.
_PYTEST, _EDITABLE = "pytest -rA", "python -m pip install -e ."


@dataclass(frozen=True)
class ClassicSpec:
    test_cmd: str
    parser: str
    install: str | None = _EDITABLE
    eval_commands: tuple[str, ...] = ()


CLASSIC: dict[str, ClassicSpec] = {
    "astropy/astropy": ClassicSpec(
        _PYTEST, "parse_log_astropy", "python -m pip install -e .[test] --verbose"
    ),
    "django/django": ClassicSpec(
        "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1", "parse_log_django"
    ),
    "marshmallow-code/marshmallow": ClassicSpec(
        _PYTEST, "parse_log_marshmallow", "python -m pip install -e '.[dev]'"
    ),
    "matplotlib/matplotlib": ClassicSpec(_PYTEST, "parse_log_matplotlib"),
    "mwaskom/seaborn": ClassicSpec(
        "pytest --no-header -rA", "parse_log_seaborn", f"{_EDITABLE}[dev]"
    ),
    "pallets/flask": ClassicSpec(_PYTEST, "parse_log_flask"),
    "psf/requests": ClassicSpec(_PYTEST, "parse_log_requests", "python -m pip install ."),
    "pvlib/pvlib-python": ClassicSpec(_PYTEST, "parse_log_pvlib", f"{_EDITABLE}[all]"),
    "pydata/xarray": ClassicSpec(_PYTEST, "parse_log_xarray"),
    "pydicom/pydicom": ClassicSpec(_PYTEST, "parse_log_pydicom"),
    "pylint-dev/astroid": ClassicSpec(_PYTEST, "parse_log_astroid"),
    "pylint-dev/pylint": ClassicSpec(_PYTEST, "parse_log_pylint"),
    "pytest-dev/pytest": ClassicSpec(_PYTEST, "parse_log_pytest"),
    "pyvista/pyvista": ClassicSpec(_PYTEST, "parse_log_pyvista"),
    "scikit-learn/scikit-learn": ClassicSpec(
        _PYTEST,
        "parse_log_scikit",
        "python -m pip install -v --no-use-pep517 --no-build-isolation -e .",
    ),
    "sqlfluff/sqlfluff": ClassicSpec(_PYTEST, "parse_log_sqlfluff"),
    "sphinx-doc/sphinx": ClassicSpec(
        "tox --current-env -epy39 -v --", "parse_log_sphinx", f"{_EDITABLE}[test]"
    ),
    "sympy/sympy": ClassicSpec(
        "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
        "parse_log_sympy",
    ),
}
SWE_GYM: dict[str, ClassicSpec] = {  # SWE-Gym's fork (its install steps are not known here)
    "getmoto/moto": ClassicSpec("pytest -n0 -rA", "parse_log_pytest", None),
    "conan-io/conan": ClassicSpec("pytest -n0 -rA", "parse_log_pytest", None),
    "dask/dask": ClassicSpec("pytest -n0 -rA  --color=no", "parse_log_pytest", None),
    "Project-MONAI/MONAI": ClassicSpec("pytest -rA ", "parse_log_pytest", None),
    "iterative/dvc": ClassicSpec(_PYTEST, "parse_log_pytest", None),
    "bokeh/bokeh": ClassicSpec("pytest -rA -n0", "parse_log_pytest", None),
    "modin-project/modin": ClassicSpec("pytest -n0 -rA", "parse_log_pytest", None),
    "pydantic/pydantic": ClassicSpec(
        "pytest -rA --tb=short -vv -o console_output_style=classic --no-header",
        "parse_log_pytest",
        None,
    ),
    "pandas-dev/pandas": ClassicSpec("pytest -rA --tb=long", "parse_log_pytest", None),
    "facebookresearch/hydra": ClassicSpec("pytest -rA --tb=long", "parse_log_pytest", None),
    "python/mypy": ClassicSpec("pytest -n0 -rA -k", "parse_log_pytest", None),
}
SWE_GYM_REPOS = frozenset(SWE_GYM)
_DJANGO_LOCALE = (
    *("export LANG=en_US.UTF-8", "export LC_ALL=en_US.UTF-8"),
    *("export PYTHONIOENCODING=utf8", "export LANGUAGE=en_US:en"),
)
_DJANGO_LOCALE_GEN = (
    "sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen && locale-gen",
    *("export LANG=en_US.UTF-8", "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8"),
)


def eval_spec(instance: Instance) -> Any:
    """The swebench TestSpec of a row: its own eval script (2026 datasets), or the one the
    classic harness generates for it."""
    from swebench.harness.utils import make_test_spec

    fields = instance.fields
    if fields.get("eval_script"):
        row = {**fields, "image": fields.get("image") or ""}
        row.setdefault("log_parser", _classic(fields)[1])
        row.setdefault("eval_type", "pass_and_fail")
        row.setdefault("version", "")
        return make_test_spec(row)
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", *classic_eval_script(instance)])
    row = {
        **fields,
        "image": "",
        "version": fields.get("version") or "",
        "eval_script": script,
        "log_parser": _classic(fields)[1],
        "eval_type": "pass_and_fail",
    }
    return make_test_spec(row)


def _classic_spec(fields: dict[str, Any]) -> ClassicSpec | None:
    """The classic harness's spec of a row's repository and version (None: no harness
    repository, e.g. agentrl's own rows)."""
    repo, version = str(fields.get("repo", "")), str(fields.get("version", ""))
    spec = CLASSIC.get(repo) or SWE_GYM.get(repo)
    if spec is None:
        return None
    major = _version(version)
    if repo == "django/django":
        install = "python setup.py install" if major < (3, 0) else _EDITABLE
        extra = _DJANGO_LOCALE if (1, 7) <= major < (3, 0) else ()
        extra = _DJANGO_LOCALE_GEN if (3, 0) <= major < (4, 0) else extra
        command = "./tests/runtests.py --verbosity 2" if version == "1.9" else spec.test_cmd
        return ClassicSpec(command, spec.parser, install, extra)
    if repo == "matplotlib/matplotlib" and major < (3, 0):
        return replace(spec, install="python setup.py build; python setup.py install")
    if repo == "matplotlib/matplotlib" and major >= (3, 8):
        return replace(spec, install='python -m pip install --no-build-isolation -e ".[dev]"')
    if repo == "mwaskom/seaborn" and major < (0, 12):
        return replace(spec, install=_EDITABLE)
    if repo == "astropy/astropy" and major < (3, 0):
        return replace(spec, test_cmd="pytest -rA -vv -o console_output_style=classic --tb=no")
    return spec


def _version(text: str) -> tuple[int, ...]:
    numbers = re.findall(r"\d+", text)
    return tuple(int(n) for n in numbers[:2]) or (0,)


def _classic(fields: dict[str, Any]) -> tuple[str, str]:
    """(test command, log parser) of a classic row: its own `test_cmd`, else the harness's."""
    spec = _classic_spec(fields)
    command = spec.test_cmd if spec else DEFAULT_TEST_CMD
    return str(fields.get("test_cmd") or command), spec.parser if spec else "parse_log_pytest"


def classic_eval_script(instance: Instance) -> list[str]:
    """The eval script the classic harness generates for a row (swebench 4.1's
    make_eval_script_list_py). agentrl's own rows (no harness repository) run the same
    steps without an install, from the tagged base when the upstream commit is unknown."""
    fields = instance.fields
    spec = _classic_spec(fields)
    base, test_patch = str(fields["base_commit"]), str(fields["test_patch"])
    files = " ".join(patch_files(test_patch, old=True))
    command, _ = _classic(fields)
    if fields.get("repo") == "python/mypy":  # SWE-Gym's mypy: the cases the test patch adds
        cases = re.findall(r"\[case ([^\]]+)\]", test_patch)
        test = f'{command} "{" or ".join(cases)}"'
    else:
        test = " ".join([command, *directives(instance)])
    if spec is None:
        base = f"$(git rev-parse -q --verify {base}^{{commit}} || echo {BASE_TAG})"
        activate = [CONDA.strip()]
    else:
        activate = ["source /opt/miniconda3/bin/activate", "conda activate testbed"]
    return [
        *activate,
        f"cd {WORKDIR}",
        *(spec.eval_commands if spec else ()),
        f"git config --global --add safe.directory {WORKDIR}",
        f"cd {WORKDIR}",
        "git status",
        "git show",
        f"git -c core.fileMode=false diff {base}",
        *(activate if spec else ()),
        *([spec.install] if spec and spec.install else []),
        f"git checkout {base} {files}",
        f"git apply -v - <<'EOF_114329324912'\n{test_patch}\nEOF_114329324912",
        f": '{START}'",
        test,
        f": '{END}'",
        f"git checkout {base} {files}",
    ]


def directives(instance: Instance) -> list[str]:
    """The test directives of the classic harness: test_patch's files, less non-test files;
    Django's as dotted module names."""
    paths = re.findall(r"diff --git a/.* b/(.*)", str(instance.fields["test_patch"]))
    paths = [p for p in paths if not any(p.endswith(ext) for ext in NON_TEST_EXTS)]
    if instance.fields.get("repo") == "django/django":
        paths = [p.removesuffix(".py").removeprefix("tests/").replace("/", ".") for p in paths]
    return paths


def needs_swebench(instances: list[Instance]) -> bool:
    """Whether grading needs the swebench package: agentrl's own rows (a `source` to build
    from, no harness repository) do not."""
    return not all(
        i.fields.get("source") is not None and _classic_spec(i.fields) is None for i in instances
    )


def require_swebench() -> None:
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"grading SWE-bench rows needs the official swebench package ({exc})",
            fix="pip install 'agentrl[swebench]'",
        ) from None
