#!/usr/bin/env bash
# cargo deny check (deny.toml): licences, duplicate versions (each allowed
# duplicate carries its reason), sources, and RustSec advisories.
#
#   tests/deny.sh install   builds cargo-deny into ~/.cargo/bin if missing
#   tests/deny.sh           runs the checks (installs first if needed)
#
# The advisory database is a git repository on github.com that cargo-deny
# clones into ~/.cargo/advisory-dbs. When github.com cannot be reached the
# offline copy is used: the newest of the copy already there and the shared
# one ($ANNEAL_ADVISORY_DB, default ../shared/advisory-db/advisory-db.tar.zst
# beside the clone, then /work/shared/...), unpacked where cargo-deny looks;
# its last advisory date is printed. With no copy at all the check FAILS
# (the advisories are never silently skipped).
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
# where cargo-deny 0.20 keeps the default database (url_to_db_path: the
# URL's last segment and its XxHash64; pinned with the version above)
db="$HOME/.cargo/advisory-dbs/advisory-db-3157b0e258782691"
if timeout 30 git ls-remote -q "$db_url" HEAD >/dev/null 2>&1; then
  cargo deny --color never check advisories
  exit
fi
shared=""
for c in "${ANNEAL_ADVISORY_DB:-}" "$repo/../shared/advisory-db/advisory-db.tar.zst" \
  /work/shared/advisory-db/advisory-db.tar.zst; do
  if [ -n "$c" ] && [ -f "$c" ]; then shared=$c; break; fi
done
have_date() { git -C "$1" log -1 --format=%ct 2>/dev/null || echo 0; }
if [ -n "$shared" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  zstd -q -dc "$shared" | tar -x -C "$tmp"
  if [ "$(have_date "$tmp/adb")" -gt "$(have_date "$db")" ]; then
    mkdir -p "$(dirname "$db")"
    rm -rf "$db"
    mv "$tmp/adb" "$db"
  fi
fi
if ! git -C "$db" rev-parse -q --verify HEAD >/dev/null 2>&1; then
  echo "advisories: FAILED: $db_url cannot be reached, no copy in $db and no offline" \
    "copy (set ANNEAL_ADVISORY_DB to an advisory-db.tar.zst, or clone the database into $db)" >&2
  exit 1
fi
echo "advisories: $db_url cannot be reached; checking offline against $db" \
  "(last advisory commit $(git -C "$db" log -1 --format='%cs %h'))${shared:+, from $shared}"
# the crates are all downloaded by the checks above, so offline is safe
cargo deny --color never --offline check advisories
