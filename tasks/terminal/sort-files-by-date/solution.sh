#!/bin/bash
set -euo pipefail
cd /app/inbox
shopt -s nullglob dotglob
date_re='(19|20)[0-9]{2}(-?)(0[1-9]|1[0-2])\2(0[1-9]|[12][0-9]|3[01])'
for f in *; do
  [ -f "$f" ] || continue
  name="$f"
  if [[ "$name" == ?*.* ]]; then
    ext="${name##*.}"
    name="${name%.*}.${ext,,}"
  fi
  if [[ "$f" =~ $date_re ]]; then
    stamp="${BASH_REMATCH[0]//-/}"
    dest="/app/sorted/${stamp:0:4}/${stamp:4:2}"
  else
    dest="/app/sorted/undated"
  fi
  mkdir -p "$dest"
  mv -- "$f" "$dest/$name"
done
