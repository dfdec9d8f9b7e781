#!/bin/bash
# usage: rotate.sh DIR KEEP
# Keeps the KEEP newest backups in DIR and deletes the older ones.
dir=$1
keep=$2
cd $dir
for f in $(ls -t backup-* | tail -n +$((keep + 1))); do
  rm $f
  echo "deleted $f"
done
