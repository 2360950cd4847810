#!/usr/bin/env bash
# Installs what the image benchmarks (ingest-bench, content-bench) need and the
# machine may lack: nginx (the reference server, run by the benchmarks as their
# own child process with their own config; the system service is not used) and
# curl (the reference download). Idempotent: installs only what is missing.
set -euo pipefail

missing=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
command -v curl >/dev/null 2>&1 || missing+=(curl)

if [ "${#missing[@]}" -eq 0 ]; then
    echo "bench/setup.sh: nginx and curl present"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "bench/setup.sh: run as root to install: ${missing[*]}" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "bench/setup.sh: installed ${missing[*]}"
