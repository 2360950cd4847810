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
# Every test binary runs even after a failure (--no-fail-fast); the output is
# kept in a log so one summary of every failure can be printed at the end.
log=$(mktemp -t anneal-test.XXXXXX.log)
set +e
cargo test --workspace --locked --no-fail-fast -- --test-threads="${ANNEAL_TEST_THREADS:-4}" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 0 ]; then
  step "FAILED: summary"
  echo "failed tests:"
  grep -E '^test .* \.\.\. FAILED$' "$log" | sed 's/^test /  /; s/ \.\.\. FAILED$//' | sort -u || true
  echo "failed test binaries (cargo's list; rerun one with the command shown):"
  sed -n '/^error: [0-9]* targets\? failed:/,/^[^ ]/p' "$log" | grep -E '^ +`' || \
    grep -E '^error: test failed' "$log" || true
  echo "full log: $log"
  exit "$rc"
fi
rm -f "$log"
step "all tiers passed"
