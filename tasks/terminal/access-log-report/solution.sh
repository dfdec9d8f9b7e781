#!/bin/bash
set -euo pipefail
log=/app/logs/access.log
{
  echo "total_requests: $(wc -l < "$log")"
  echo "unique_ips: $(awk '{print $1}' "$log" | sort -u | wc -l)"
  echo "server_errors: $(awk '$9 ~ /^5[0-9][0-9]$/' "$log" | wc -l)"
  top=$(awk '{split($7, p, "?"); print p[1]}' "$log" | sort | uniq -c \
        | sort -k1,1nr -k2,2 | head -n 3 | awk '{printf "%s%s=%s", sep, $2, $1; sep=","}')
  echo "top_paths: $top"
  echo "bytes_2xx: $(awk '$9 ~ /^2/ && $10 != "-" {s += $10} END {print s + 0}' "$log")"
} > /app/report.txt
