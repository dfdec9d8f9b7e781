#!/bin/bash
# Terminal-Bench runs this as `bash /tests/run-tests.sh` with TEST_DIR=/tests.
# Offline: the image's own pytest, no package downloads.
export PYTHONDONTWRITEBYTECODE=1
python3 -m pytest "${TEST_DIR:-/tests}/test_outputs.py" -rA -p no:cacheprovider
