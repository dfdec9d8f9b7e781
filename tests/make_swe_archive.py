"""Make the repository archive an SWE-bench instance image is built from.

    python tests/make_swe_archive.py MIRROR REPO BASE_COMMIT [--branch B] [--out DIR]

MIRROR is a git directory holding BASE_COMMIT (a clone or bare mirror of REPO, e.g. what
`git clone --mirror https://github.com/REPO` makes). Writes
`DIR/<owner>__<name>-<base_commit[:12]>.tar.gz` (DIR defaults to ./swe-repos): a depth-1
git repository (`.git` only; the image build checks it out) whose branch B and HEAD are
BASE_COMMIT. The SWE-bench eval scripts only `git checkout BASE_COMMIT -- <test files>`
and `git apply`, so the one commit is all they need. The bytes are the same on every run
for the same git version; prints the sha256, size and path, the values
tests/corpus-swe.json records under `archives`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agentrl.tasks.swe.testbed import archive_name, make_archive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mirror", type=Path, help="git directory that holds BASE_COMMIT")
    parser.add_argument("repo", help="owner/name, as the rows' `repo` column")
    parser.add_argument("base_commit", help="the rows' base_commit (40 hex digits)")
    parser.add_argument("--branch", default="main", help="the branch HEAD is on (main)")
    parser.add_argument("--out", type=Path, default=Path("swe-repos"), help="output folder")
    args = parser.parse_args()
    out = args.out / archive_name(args.repo, args.base_commit)
    digest = make_archive(args.mirror, args.base_commit, out, branch=args.branch)
    record = {"local_path": f"swe-repos/{out.name}", "sha256": digest}
    print(json.dumps({**record, "size": out.stat().st_size, "path": str(out)}))


if __name__ == "__main__":
    main()
