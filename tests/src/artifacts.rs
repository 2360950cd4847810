//! The artifacts the agent tests boot or inspect, built with cargo on
//! demand: the static musl agent (x86_64 and aarch64), the initramfs
//! builder, the fake manager, bootd's binary.
//!
//! Every host (debug) artifact is built with `--workspace`, so that cargo
//! unifies dependency features across the whole workspace exactly as
//! `cargo test --workspace` did: the dependencies that build compiled are
//! reused and only the artifact itself is compiled (or nothing, when cargo
//! test already built it: the examples, the agent's binary). A `-p` build
//! would resolve features for one package only and compile half the
//! dependency tree again. cargo is always asked (never a file found on
//! disk), so a stale artifact is rebuilt, never used.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The cargo target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Host artifacts: `--workspace` (see the module comment) plus `args`.
fn cargo_host(args: &[&str]) {
    let mut all = vec!["--workspace"];
    all.extend_from_slice(args);
    cargo(&all);
}

fn cargo(args: &[&str]) {
    // `anneal_testinfra::cargo_command`: cargo through PATH (the rustup
    // proxy honours rust-toolchain.toml) without the variables cargo test
    // set for this process, so the build finds fresh what run.sh built.
    let out = anneal_testinfra::cargo_command()
        .current_dir(root())
        .args(["build", "--quiet"])
        .args(args)
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo build {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The static musl agent (release), built if needed: the production build
/// (`-p`: its features are the agent's own, not the workspace's). No test
/// build shares its profile or target; `tests/run.sh` starts this exact
/// command early, beside the test build, so the tests find it fresh.
pub fn agent_musl() -> PathBuf {
    cargo(&[
        "--profile",
        "agent",
        "--target",
        "x86_64-unknown-linux-musl",
        "-p",
        "anneal-agent",
        "--bin",
        "anneal-agent",
    ]);
    target_dir().join("x86_64-unknown-linux-musl/agent/anneal-agent")
}

/// The static musl agent for aarch64 (the arm64 boot matrix), built if
/// needed with Debian's cross toolchain (`.cargo/config.toml`;
/// `tests/setup.d/arm64.sh` installs it): the command of `agent_musl` with
/// the other target, in a target directory of its own,
/// [`AARCH64_TARGET_SUBDIR`] under the main one. A cross build locks the
/// host directory of its profile (`target/agent`, its build scripts and
/// proc macros) as well as its target's, so in the shared directory it
/// would hold up every x86_64 agent build while it runs: `tests/run.sh`
/// starts this exact command in the background while the tests run, and
/// only the tests that boot the arm64 agent wait for it (on cargo's lock).
pub fn agent_musl_aarch64() -> PathBuf {
    let dir = target_dir().join(AARCH64_TARGET_SUBDIR);
    let dir_s = dir.to_string_lossy().into_owned();
    cargo(&[
        "--target-dir",
        &dir_s,
        "--profile",
        "agent",
        "--target",
        "aarch64-unknown-linux-musl",
        "-p",
        "anneal-agent",
        "--bin",
        "anneal-agent",
    ]);
    dir.join("aarch64-unknown-linux-musl/agent/anneal-agent")
}

/// Where [`agent_musl_aarch64`] builds, under the main target directory.
pub const AARCH64_TARGET_SUBDIR: &str = "cross-aarch64";

/// The manager (debug build): what the node tests run in their manager
/// pods (packed with its shared libraries by `node::manager_image`).
pub fn manager_host() -> PathBuf {
    cargo_host(&["--bin", "manager"]);
    target_dir().join("debug/manager")
}

/// The initramfs builder (debug build).
pub fn initramfs_tool() -> PathBuf {
    cargo_host(&["--bin", "anneal-initramfs"]);
    target_dir().join("debug/anneal-initramfs")
}

/// The agent-protocol test server (debug build of the agent's example).
pub fn fake_manager() -> PathBuf {
    cargo_host(&["--example", "fake_manager"]);
    target_dir().join("debug/examples/fake_manager")
}

/// Builds an initramfs with the broad default driver set and busybox;
/// returns (output path, report JSON).
pub fn build_initramfs(tool: &Path, agent: &Path, modules: &Path, out: &Path) -> serde_json::Value {
    // growLastPartition's tools, with their libraries.
    let tools = ["/usr/sbin/e2fsck", "/usr/sbin/resize2fs"];
    run_initramfs_tool(
        tool,
        agent,
        modules,
        Path::new("/bin/busybox"),
        None,
        &tools,
        out,
    )
}

/// `build_initramfs` for arm64: `agent` from `agent_musl_aarch64`, `modules`
/// from `debian_kernel_arm64`, busybox and e2fsprogs (with their libraries,
/// found by the tool in the sysroot) from Debian's arm64 packages
/// (`anneal_testinfra::arm64_pieces`).
pub fn build_initramfs_arm64(
    tool: &Path,
    agent: &Path,
    modules: &Path,
    out: &Path,
) -> serde_json::Value {
    let arm64 = anneal_testinfra::arm64_pieces().unwrap();
    let tools = ["/sbin/e2fsck", "/sbin/resize2fs"];
    run_initramfs_tool(
        tool,
        agent,
        modules,
        &arm64.busybox,
        Some(&arm64.sysroot),
        &tools,
        out,
    )
}

fn run_initramfs_tool(
    tool: &Path,
    agent: &Path,
    modules: &Path,
    busybox: &Path,
    sysroot: Option<&Path>,
    binaries: &[&str],
    out: &Path,
) -> serde_json::Value {
    let report = out.with_extension("report.json");
    let mut cmd = Command::new(tool);
    cmd.arg("--agent")
        .arg(agent)
        .arg("--modules")
        .arg(modules)
        .arg("--busybox")
        .arg(busybox)
        .args(["--compression", "zstd"]);
    if let Some(root) = sysroot {
        cmd.arg("--sysroot").arg(root);
    }
    for b in binaries {
        cmd.args(["--binary", b]);
    }
    let res = cmd
        .arg("-o")
        .arg(out)
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "anneal-initramfs failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    println!("{}", String::from_utf8_lossy(&res.stderr));
    serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap()
}

/// The host (debug) `anneal-agent`, built if needed: the ingest and store
/// workloads of the `process` executor.
pub fn agent_host() -> PathBuf {
    cargo_host(&["--bin", "anneal-agent"]);
    target_dir().join("debug/anneal-agent")
}

/// The `kubectl-anneal` plugin (debug build).
pub fn kubectl_anneal() -> PathBuf {
    cargo_host(&["--bin", "kubectl-anneal"]);
    target_dir().join("debug/kubectl-anneal")
}

/// bootd's binary (debug build).
pub fn bootd() -> PathBuf {
    cargo_host(&["--bin", "bootd"]);
    target_dir().join("debug/bootd")
}

/// `anneal-oci`, the image builder of `deploy/images` (debug build).
pub fn oci_tool() -> PathBuf {
    cargo_host(&["--bin", "anneal-oci"]);
    target_dir().join("debug/anneal-oci")
}
