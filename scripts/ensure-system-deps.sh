#!/usr/bin/env bash
# Install the system programs that tierkv's tests run for real (Redis, headless Chromium
# for the dashboard test, ip and iptables for the network-namespace partition test) and what
# its C helpers are built with (a C compiler, OpenSSL's and xxHash's headers, and Python's:
# tierkv._keychain, tierkv._streamcopy, tierkv._fileio), using the system package
# manager, only when they are missing. Idempotent and silent when everything is present;
# run by `make venv` / `make test` before the Python dependencies, with the Python the venv
# is made from.
#
# To require another program, add one line to REQUIRED: "<command on PATH> <apt package>";
# a file instead: "</absolute/path> <apt package>".
#
# Usage: ensure-system-deps.sh [PYTHON]
set -euo pipefail
PYTHON=${1:-python3}

REQUIRED=(
  "redis-server redis-server"
  "chromium chromium"
  "cc gcc"
  "/usr/include/openssl/evp.h libssl-dev"
  "/usr/include/xxhash.h libxxhash-dev"
  "ip iproute2"
  "iptables iptables"
)

have() {
  if [[ $1 == /* ]]; then
    [ -e "$1" ]
    return
  fi
  # Debian installs some daemons to /usr/sbin, which a non-root PATH may lack.
  command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]
}

# Python's headers: with the interpreter (pyenv, python.org builds) or, for Debian's own
# python3, in python3-dev.
python_h=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h
REQUIRED+=("$python_h python3-dev")

missing=()
for entry in "${REQUIRED[@]}"; do
  read -r cmd pkg <<<"$entry"
  have "$cmd" || missing+=("$pkg")
done
[ "${#missing[@]}" -eq 0 ] && exit 0

fail() {
  echo "ensure-system-deps: $*" >&2
  echo "ensure-system-deps: install these packages by hand, then re-run: ${missing[*]}" >&2
  exit 1
}

if ! command -v apt-get >/dev/null 2>&1; then
  fail "missing ${missing[*]} and no apt-get on this system (tierkv's scripts know Debian/Ubuntu)"
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  fail "missing ${missing[*]}: installing needs root, and sudo is not available without a password"
fi

echo "ensure-system-deps: installing ${missing[*]} ..." >&2
export DEBIAN_FRONTEND=noninteractive
# A fresh machine often has apt busy at boot (unattended-upgrades), and two setups may run
# at once: wait for the package manager's locks rather than fail.
wait_lock=(-o DPkg::Lock::Timeout=600)
${as_root[@]+"${as_root[@]}"} apt-get "${wait_lock[@]}" update -qq >/dev/null || fail "apt-get update failed"
${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive \
  apt-get "${wait_lock[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || fail "apt-get install ${missing[*]} failed"
for entry in "${REQUIRED[@]}"; do
  read -r cmd pkg <<<"$entry"
  have "$cmd" || fail "installed $pkg, but there is still no '$cmd' command"
done
echo "ensure-system-deps: installed ${missing[*]}" >&2
