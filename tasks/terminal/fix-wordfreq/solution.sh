#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
from pathlib import Path

path = Path("/app/wordfreq.py")
source = path.read_text()
fixes = [
    ("import argparse\n", "import argparse\nimport re\n"),
    ("    for word in text.split():\n", '    for word in re.findall(r"[a-z]+", text.lower()):\n'),
    (
        "    ranked = sorted(counts.items(), key=lambda item: (item[1], item[0]), reverse=True)\n"
        "    return ranked[: n - 1]\n",
        "    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))\n"
        "    return ranked[:n]\n",
    ),
]
for old, new in fixes:
    assert old in source, old
    source = source.replace(old, new)
path.write_text(source)
PY
