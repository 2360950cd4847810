#!/usr/bin/env bash
# cargo deny check (deny.toml): licences, duplicate versions (each allowed
# duplicate carries its reason), sources, and RustSec advisories.
#
#   tests/deny.sh install   builds cargo-deny into ~/.cargo/bin if missing
#   tests/deny.sh           runs the checks (installs first if needed)
#
# The advisory database is a git repository on github.com that cargo-deny
# clones into ~/.cargo/advisory-dbs. When github.com cannot be reached the
# copy already there is used (its date is printed); with no copy at all the
# advisories are reported NOT CHECKED and the other checks still decide.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PATH="$HOME/.cargo/bin:$PATH"
version=0.20.2

install() {
  if cargo deny --version 2>/dev/null | grep -qx "cargo-deny $version"; then
    return
  fi
  echo "building cargo-deny $version into ~/.cargo/bin"
  cargo install --locked --quiet cargo-deny --version "$version"
}

install
[ "${1:-}" = install ] && exit 0
cd "$repo"
cargo deny --color never check bans licenses sources
db_url=https://github.com/RustSec/advisory-db
if timeout 30 git ls-remote -q "$db_url" HEAD >/dev/null 2>&1; then
  cargo deny --color never check advisories
else
  db=$(ls -d "$HOME"/.cargo/advisory-dbs/advisory-db-*/ 2>/dev/null | head -n1 || true)
  if [ -n "$db" ] && git -C "$db" rev-parse -q --verify HEAD >/dev/null 2>&1; then
    echo "advisories: $db_url cannot be reached; checking against the copy in $db" \
      "(last advisory commit $(git -C "$db" log -1 --format=%cs))"
    # the crates are all downloaded by the check above, so offline is safe
    cargo deny --color never --offline check advisories
  else
    echo "advisories: NOT CHECKED: $db_url cannot be reached and ~/.cargo/advisory-dbs" \
      "holds no copy (clone it there by hand to check offline)"
  fi
fi
