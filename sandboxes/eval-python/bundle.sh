#!/usr/bin/env bash
# Copy the shared libraries that the ELF files under $1 need (but the C library's own,
# which every sandbox has) into $1/lib, and point every ELF file's RPATH at $1/lib
# relative to itself.
set -euo pipefail
root="$1"
lib="$root/lib"
system='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libutil|libresolv|libnsl|libanl)\.so'
elfs() { find "$root" -type f \( -perm -u+x -o -name '*.so*' \) -exec sh -c \
  'head -c4 "$1" | grep -q "ELF" && echo "$1"' _ {} \; ; }
for _ in 1 2 3; do  # bundled libraries may need others
  elfs | xargs -r ldd 2>/dev/null | awk '/=> \// { print $1, $3 }' | sort -u |
    while read -r name path; do
      [[ "$name" =~ $system ]] && continue
      [[ "$path" == "$root"/* ]] && continue
      [ -e "$lib/$name" ] || cp -L "$path" "$lib/$name"
    done
done
elfs | while read -r file; do
  rel="$(realpath --relative-to="$(dirname "$file")" "$lib")"
  patchelf --set-rpath "\$ORIGIN/$rel" "$file"
done
