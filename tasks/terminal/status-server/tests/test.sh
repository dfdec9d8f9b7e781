#!/bin/bash
# Harbor runs this as /tests/test.sh and reads the reward from /logs/verifier/reward.txt.
# The service must be up already: the tests only talk to it.
mkdir -p /logs/verifier
export PYTHONDONTWRITEBYTECODE=1
python3 -m pytest /tests/test_outputs.py -rA -p no:cacheprovider
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
