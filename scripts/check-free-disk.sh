#!/usr/bin/env bash
# Say how much disk an install needs against what is free where it installs, and warn
# (without failing) when it is short, so that an install that then dies with
# "No space left on device" has its reason printed above it. pip unpacks into TMPDIR, so
# both the target's filesystem and TMPDIR's are checked.
#
#   check-free-disk.sh WHAT NEED_GIB DIR
set -euo pipefail
what=$1 need=$2 dir=$3
mkdir -p "$dir"
for where in "$dir" "${TMPDIR:-/tmp}"; do
  free=$(df -Pk "$where" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
  if [ "$free" -lt "$need" ]; then
    echo "check-free-disk: WARNING: $what needs about $need GiB free; $where has $free GiB" >&2
  fi
done
