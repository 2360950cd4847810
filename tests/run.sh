#!/usr/bin/env bash
# The README's test command: set-up (idempotent), then every test tier:
# formatting, clippy with -D warnings, and `cargo test --workspace`
# (unit tests, loopback/namespace integration, control-plane and VM tests).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
start=$(date +%s)
bash "$here/setup.sh"
export PATH="$HOME/.cargo/bin:$PATH"
cd "$repo"
step() { printf '\n== %s (%ss elapsed)\n' "$*" "$(( $(date +%s) - start ))"; }
step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
step "cargo test --workspace"
cargo test --workspace --locked -- --test-threads="${ANNEAL_TEST_THREADS:-4}"
step "all tiers passed"
