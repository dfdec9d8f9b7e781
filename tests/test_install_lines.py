"""The install lines the docs give are what CI resolves (.ci/resolve.py runs pip
--dry-run on each, and on every extra together, after the install)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _resolve_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("resolve", ROOT / ".ci" / "resolve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_documented_install_sequence_is_found_and_agrees_with_the_pins() -> None:
    resolve = _resolve_module()
    found = dict((where, wanted) for where, wanted in resolve.sequences() if "." in wanted[-1])
    # The GPU lines: the CUDA torch that vllm 0.33 needs, then agentrl with its extras.
    assert found["docs/swe.md"] == ["torch==2.14.0", ".[vllm,swebench]"]
    assert found["docs/ray.md"] == ["torch==2.14.0", ".[vllm]"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"torch>=2.13,<2.15"' in pyproject and 'vllm = ["vllm==0.33.0"]' in pyproject
    bootstrap = (ROOT / "bootstrap.sh").read_text()
    assert 'pip" install -q torch==2.13.0' in bootstrap  # the CPU wheel, within the range
    assert ["torch==2.13.0", ".[dev]"] in [w for _, w in resolve.EVERY_EXTRA]


def test_index_urls_and_options_are_left_out_of_what_is_resolved() -> None:
    resolve = _resolve_module()
    words = ["-q", "torch==2.14.0", "--index-url", "https://download.pytorch.org/whl/cu128"]
    assert resolve._requirements([*words, "-e", ".[vllm]"]) == ["torch==2.14.0", ".[vllm]"]
    text = "```yaml\npip install nope\n```\n```bash\n.venv/bin/pip install x==1 # c\n```\n"
    assert resolve._shell_blocks(text) == [[".venv/bin/pip install x==1 # c"]]
