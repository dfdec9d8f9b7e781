#!/bin/bash
set -euo pipefail
cat > /app/rotate.sh <<'SH'
#!/bin/bash
# usage: rotate.sh DIR KEEP
# Keeps the KEEP newest backups in DIR (by the timestamp in their names) and deletes
# the older ones, oldest first.
set -euo pipefail
if [ $# -ne 2 ] || [ ! -d "$1" ] || ! [[ $2 =~ ^[0-9]+$ ]]; then
  echo "usage: rotate.sh DIR KEEP" >&2
  exit 2
fi
dir=$1
keep=$((10#$2))
mapfile -t backups < <(
  find "$dir" -mindepth 1 -maxdepth 1 -type f -printf '%f\n' \
    | grep -E '^backup-[0-9]{8}-[0-9]{6}\.tar\.gz$' | LC_ALL=C sort
)
for ((i = 0; i < ${#backups[@]} - keep; i++)); do
  rm -- "$dir/${backups[i]}"
  echo "deleted ${backups[i]}"
done
SH
