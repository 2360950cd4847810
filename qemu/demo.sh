#!/usr/bin/env bash
# The README's main job: set-up (idempotent), then the QEMU demo with its
# serial console shown: import the test OS image, enrol and inspect a VM,
# claim it, deploy it, boot the deployed OS (tests/examples/demo.rs,
# docs/testing.md "The demo"). Arguments go to the demo: --inspect-only stops
# after inspection, --help lists them.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
bash "$repo/tests/setup.sh"
export PATH="$HOME/.cargo/bin:$PATH"
cd "$repo"
cargo run -q -p anneal-tests --example demo -- "$@"
