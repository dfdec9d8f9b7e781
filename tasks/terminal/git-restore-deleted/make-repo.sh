#!/bin/bash
# Builds /app/project: a small history in which config/settings.ini is edited, then
# deleted by mistake, then buried under a later commit. Fixed dates keep it reproducible.
set -euo pipefail
git config --global user.name "Dev Agent"
git config --global user.email "dev@example.com"
git config --global init.defaultBranch main
mkdir -p /app/project && cd /app/project
git init -q
n=0
commit() {
  n=$((n + 1))
  export GIT_AUTHOR_DATE="2024-01-0${n}T10:00:00Z" GIT_COMMITTER_DATE="2024-01-0${n}T10:00:00Z"
  git add -A && git commit -q -m "$1"
}
mkdir -p config src
printf 'def main():\n    print("hello")\n' > src/app.py
printf '[server]\nport = 8000\n' > config/settings.ini
commit "Initial commit"
printf '[server]\nport = 8080\nhost = 127.0.0.1\n\n[cache]\nenabled = true\nttl_seconds = 300\n' > config/settings.ini
commit "Tune server and cache settings"
printf 'def main():\n    print("hello, world")\n' > src/app.py
git rm -q config/settings.ini
commit "Clean up old files"
printf '# Changelog\n\n- 0.2: friendlier greeting\n' > CHANGELOG.md
commit "Add changelog"
