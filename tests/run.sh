#!/usr/bin/env bash
# The README's test command: set-up (idempotent), then every test tier:
# formatting, clippy with -D warnings, and the tests of `cargo test
# --workspace` (unit tests, loopback/namespace integration, control-plane and
# VM tests, doctests), built once and run as concurrent lanes of test
# binaries (docs/testing.md).
#
#   ANNEAL_TEST_LANES    test binaries running at once (default 2)
#   ANNEAL_TAIL_LANES    ... once the long ones have all started (default 3)
#   ANNEAL_TEST_THREADS  --test-threads of each binary (default 4)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
start=$(date +%s)
bash "$here/setup.sh"
export PATH="$HOME/.cargo/bin:$PATH"
cd "$repo"
step() { printf '\n== %s (%ss elapsed)\n' "$*" "$(( $(date +%s) - start ))"; }
logdir=$(mktemp -d -t anneal-test.XXXXXX)

# The test build without debug info and without incremental state: ~127 test
# executables of ~200 MB each (150 MB of it DWARF) filled 13 GB of target/
# and a CI machine's disk (the linker died with SIGBUS); this way the whole
# target is ~3 GB and builds faster (docs/testing.md "Disk"). Every cargo
# below, and the builds the tests start (tests/src/artifacts.rs), inherit
# these, so nothing is compiled twice. Set them yourself to override.
export CARGO_PROFILE_DEV_DEBUG="${CARGO_PROFILE_DEV_DEBUG:-false}"
export CARGO_PROFILE_DEV_STRIP="${CARGO_PROFILE_DEV_STRIP:-debuginfo}"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
mkdir -p "$target_dir"
free_mib=$(df -Pm "$target_dir" | awk 'NR==2 {print $4}')
step "disk: ${free_mib} MiB free for $target_dir"
if [ "$free_mib" -lt 6144 ]; then
  echo "warning: under 6 GiB free for $target_dir; a cold build needs ~3 GiB plus the" \
    "VM disks and images the tests write under /tmp (set CARGO_TARGET_DIR elsewhere or free space)"
fi

step "cargo fmt --check"
cargo fmt --all -- --check

# clippy runs inside the test build, not as a build of its own: `cargo clippy`
# is `cargo check` with clippy-driver as the workspace members' compiler
# (RUSTC_WORKSPACE_WRAPPER, its arguments in CLIPPY_ARGS), so with the same
# two variables `cargo test --no-run` lints every target `clippy
# --all-targets` lints (libs with and without cfg(test), bins, integration
# tests, examples; there are no benches) with `-D warnings` while it compiles
# them, instead of checking every dependency a second time. Measured cold
# (2026-12-03): the first test ran at 716 s, against 706 s with the separate
# clippy (stop 28): no gain in time, one build fewer to keep in step. Exported
# for every cargo below and the builds the tests start, so their fingerprints
# agree and nothing is compiled twice. ANNEAL_SEPARATE_CLIPPY=1 runs the
# plain `cargo clippy` first instead.
if [ "${ANNEAL_SEPARATE_CLIPPY:-0}" = 1 ]; then
  step "cargo clippy -D warnings"
  cargo clippy --workspace --all-targets --locked -- -D warnings
else
  export RUSTC_WORKSPACE_WRAPPER
  RUSTC_WORKSPACE_WRAPPER=$(rustup which clippy-driver)
  export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
fi

# The static musl agent (release; what the VM tests boot) shares no unit with
# the debug builds below, and cargo locks target/debug and the release
# directories separately: it builds beside the test build, filling
# the cores it leaves idle. The exact command of tests/src/artifacts.rs
# `agent_musl`, so the tests find it fresh.
step "static agent (profile agent, musl, x86_64): building in the background"
musl_log="$logdir/agent-musl-build.log"
setsid cargo build --quiet --locked --profile agent --target x86_64-unknown-linux-musl \
  -p anneal-agent --bin anneal-agent >"$musl_log" 2>&1 &
musl_pid=$!
trap 'kill -- "-$musl_pid" 2>/dev/null || true' EXIT

step "cargo test --workspace: build (and clippy -D warnings)"
messages="$logdir/test-build.json"
cargo test --workspace --locked --no-run --message-format=json-render-diagnostics >"$messages"

# What the tests build on demand with `cargo build --workspace` (the same
# feature unification as the test build: only these binaries compile, the
# examples and the agent's binary are already fresh).
step "test artifacts (bootd, anneal-initramfs, examples)"
cargo build --workspace --locked --bin bootd --bin anneal-initramfs --bin anneal-agent \
  --bin anneal-oci --bin manager --example fake_manager --example posthook_run

step "static agent (profile agent, musl, x86_64): waiting for the background build"
musl_rc=0
wait "$musl_pid" || musl_rc=$?
trap - EXIT
cat "$musl_log"
if [ "$musl_rc" != 0 ]; then
  echo "the static agent did not build (exit $musl_rc): the VM and node tests that boot or run it will fail"
fi

# The aarch64 agent (e2e_arm64 boots it), cross-built with Debian's
# gcc-aarch64-linux-gnu (tests/setup.d/arm64.sh): `agent_musl_aarch64`'s
# command, in its own target directory (a cross build also locks its
# profile's host directory, target/agent, which every x86_64 agent build
# the tests start takes too). It builds while the tests run, at nice 10:
# the VM tests leave a core idle for minutes at a time (the deploys' first
# minutes, waits on timers), and this ~190 s, two-core build fills those
# gaps instead of lengthening the test build. e2e_arm64 waits on cargo's
# lock if it comes first. Measured cold on this machine: the build phase
# was 769 s with it beside the test build (docs/testing.md).
step "static agent (profile agent, musl, aarch64): building in the background, niced"
arm_log="$logdir/agent-musl-aarch64-build.log"
setsid nice -n 10 cargo build --quiet --locked --target-dir "$target_dir/cross-aarch64" \
  --profile agent --target aarch64-unknown-linux-musl \
  -p anneal-agent --bin anneal-agent >"$arm_log" 2>&1 &
arm_pid=$!
trap 'kill -- "-$arm_pid" 2>/dev/null || true' EXIT

# cargo-deny (tests/deny.sh): built once into ~/.cargo/bin, at nice 19 while
# the tests run (on a machine that has it, this is a version check); the
# checks run after the tests.
step "cargo-deny: installing in the background if missing, niced"
deny_log="$logdir/cargo-deny-install.log"
setsid nice -n 19 bash "$here/deny.sh" install >"$deny_log" 2>&1 &
deny_pid=$!
trap 'kill -- "-$arm_pid" 2>/dev/null || true; kill -- "-$deny_pid" 2>/dev/null || true' EXIT

# Longest first (measured cold in CI; docs/testing.md): with 2 lanes the
# longest binaries overlap and the short ones fill in at the end. A binary
# missing from this list runs after these; a name here that no longer exists
# is reported. Once the last of the many-VM binaries (e2e_arm64) is done
# starting and lifecycle_faults starts, a third lane opens: what is left is
# bound by start-up latency (control planes, namespaces, processes), and
# with two lanes the cores sat a third to two thirds idle for the last
# ~300-400 s (sampled from /proc/stat, docs/testing.md). node_failover
# (its takeover is timed) comes before that.
long=(
  e2e_deploy_faults e2e_day1 e2e_deploy node_install e2e_swarm bootd_vm e2e_inspect agent_vm node_failover
  e2e_arm64 lifecycle_faults agent_tokens agent_initramfs images_import lifecycle_ipmi
  manager_leader swarm_site redfish_conformance node_smoke dhcpv6_ovmf lifecycle_walk cli_import
  posthook_vm testos_boot manager_claims lifecycle_power_gate vm_smoke swarm_tracker
  cli_plugin cli_follow bootd_watch printer_columns controlplane
)
first=()
for t in "${long[@]}"; do first+=(--first "$t"); done
step "cargo test --workspace: run (${ANNEAL_TEST_LANES:-2} lanes)"
rc=0
arm_rc=0
python3 "$here/lanes.py" --messages "$messages" --root "$repo" --log-dir "$logdir" \
  --lanes "${ANNEAL_TEST_LANES:-2}" --tail-lanes "${ANNEAL_TAIL_LANES:-3}" --tail-after lifecycle_faults \
  --test-threads "${ANNEAL_TEST_THREADS:-4}" \
  "${first[@]}" || rc=$?
wait "$arm_pid" || arm_rc=$?
deny_rc=0
wait "$deny_pid" || deny_rc=$?
trap - EXIT
if [ "$arm_rc" != 0 ]; then
  cat "$arm_log"
  echo "the aarch64 agent did not build (exit $arm_rc)"
fi
step "cargo deny check (deny.toml: licences, duplicate versions, sources, advisories)"
if [ "$deny_rc" != 0 ]; then
  cat "$deny_log"
  echo "cargo-deny did not install (exit $deny_rc)"
else
  bash "$here/deny.sh" || deny_rc=$?
fi
if [ "$rc" != 0 ] || [ "$musl_rc" != 0 ] || [ "$arm_rc" != 0 ] || [ "$deny_rc" != 0 ]; then
  step "FAILED (the summary above; every log in $logdir)"
  exit 1
fi
rm -rf "$logdir"
step "all tiers passed"
