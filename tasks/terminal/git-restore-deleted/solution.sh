#!/bin/bash
set -euo pipefail
cd /app/project
deleted_in=$(git rev-list -n 1 HEAD -- config/settings.ini)
git checkout "${deleted_in}^" -- config/settings.ini
git commit -q -m "Restore config/settings.ini"
