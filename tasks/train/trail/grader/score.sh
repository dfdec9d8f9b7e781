#!/bin/sh
# score.sh OUT FINAL KEY...: the share of the trail the agent proved it walked, as JSON in
# OUT. A key counts if `clue` recorded it (only the note before it names it, so recording
# it proves that note was read) and FINAL if the file exists (only the last note names
# it): (keys + final) / (number of keys + 1).
out=$1; final=$2; shift 2
total=$(($# + 1)); keys=0; done=0
for k in "$@"; do
  grep -qxF -- "$k" /workspace/.trail 2>/dev/null && keys=$((keys + 1))
done
[ -f "/workspace/$final" ] && done=1
awk -v k=$keys -v d=$done -v t=$total \
  'BEGIN { printf "{\"reward\": %.6f, \"keys\": %d, \"final\": %d}\n", (k + d) / t, k, d }' > "$out"
