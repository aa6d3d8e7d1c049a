#!/bin/sh
# Installs the Debian packages kscore needs, only when one is missing, then
# does nothing else. Non-interactive; safe to run again and again.
#   KSCORE_PROFILE=1  also installs the profilers (linux-perf, heaptrack).
#   KSCORE_FUZZ=1     also installs clang and its libFuzzer runtime
#                     (libclang_rt.fuzzer-x86_64.a), for `make fuzz`.
set -eu

PKGS="nats-server postgresql libnats-dev libpq-dev libprotobuf-c-dev
protobuf-c-compiler check libsubunit-dev cmake pkg-config gcc make
libjansson-dev uuid-dev libssl-dev openssl procps iproute2 scdoc libmicrohttpd-dev
dpkg-dev"
# the services' configuration files (kscore.conf(5)) are read with inih
PKGS="$PKGS libinih-dev"
if [ "${KSCORE_PROFILE:-0}" = 1 ]; then
    PKGS="$PKGS linux-perf heaptrack valgrind"
fi
if [ "${KSCORE_FUZZ:-0}" = 1 ]; then
    PKGS="$PKGS clang libclang-rt-14-dev"
fi

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0

SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "bootstrap: need root (or sudo) to install:$missing" >&2; exit 1
    fi
fi
echo "bootstrap: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends keeps it small; postgresql's own cluster is not
# used (kscore makes its own with initdb), so it is not started here.
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
