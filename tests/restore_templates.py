"""Restore tests/corpus/templates/ (published chat templates; git-ignored) from GitHub.

Reads tests/corpus-templates.json, downloads each file from its repository at the
commit named there (taking out the one template string where `extract` names an entry
of a JSON registry), checks its sha256 and writes it under tests/corpus/. Files already
present with the right hash are left alone. Needs network access to GitHub.

    .venv/bin/python tests/restore_templates.py
"""

from __future__ import annotations

import hashlib
import json
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAW = "https://raw.githubusercontent.com/{repository}/{commit}/{source_path}"


def main() -> int:
    manifest = json.loads((HERE / "corpus-templates.json").read_text())
    failed = 0
    for entry in manifest["templates"]:
        target = HERE / "corpus" / entry["local_path"]
        if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == entry["sha256"]:
            continue
        url = RAW.format(**entry)
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        except OSError as e:
            print(f"error: cannot download {url} ({e})\nfix: run it where GitHub can be reached")
            return 1
        if "extract" in entry:
            want = entry["extract"]
            rows = [r for r in json.loads(data) if r.get("model_name") == want["model_name"]]
            data = rows[0][want["field"]].encode() if rows else b""
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            print(f"error: {url} does not match its sha256 in the manifest; not written")
            failed += 1
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        print(f"restored {entry['local_path']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
