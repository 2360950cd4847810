//! Test infrastructure shared by the end-to-end tests: a real local control
//! plane (etcd + kube-apiserver built from Go modules), network namespaces
//! with a bridge and taps, QEMU VMs on OVMF or SeaBIOS with their serial
//! console captured, and the Debian guest kernel.
//!
//! Everything started here is torn down on `Drop` (also when a test panics),
//! by process group; names are unique per process so tests run in parallel.
#![cfg_attr(test, allow(clippy::too_many_lines))]

mod controlplane;
mod kernel;
mod netns;
mod node;
mod pki;
mod procs;
mod table;
mod tmux;
mod vm;

pub use controlplane::{ControlPlane, NODE_IP, NODE_NAME};
pub use kernel::{
    Arm64Pieces, DebianKernel, arm64_pieces, debian_kernel, debian_kernel_arm64, smoke_initramfs,
    smoke_initramfs_with,
};
pub use netns::{BRIDGE_IP, Netns, TcpForward, forward_host_tcp};
pub use node::{CNI_BRIDGE, Leftovers, NODE_DIR, Node, PAUSE_IMAGE};
pub use pki::{TestPki, test_pki};
pub use procs::{ChildGroup, accept_failure_span, kill_process_group, process_alive};
pub use table::{get_table, table_row, table_row_named};
pub use tmux::Tmux;
pub use vm::{DiskBus, DiskConfig, Firmware, NicConfig, SNAKEOIL_CERT, SNAKEOIL_KEY, Vm, VmConfig};

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// Where the set-up caches built binaries, the guest kernel and downloads
/// (`$ANNEAL_CACHE`, default `/var/cache/anneal`).
pub fn cache_dir() -> PathBuf {
    std::env::var_os("ANNEAL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/anneal"))
}

/// Path of a cached control-plane binary (etcd, kube-apiserver, kubectl, ...).
pub fn cached_bin(name: &str) -> anyhow::Result<PathBuf> {
    let path = cache_dir().join("bin").join(name);
    if path.is_file() {
        Ok(path)
    } else {
        anyhow::bail!(
            "{} is missing: run `bash tests/setup.sh` (it builds the control plane from Go modules)",
            path.display()
        )
    }
}

/// Runs `BIN run ARGS` (the manager) with no cluster to reach: a
/// kubeconfig path that does not exist, no in-cluster environment, warnings
/// only. Its start-up check refuses before connecting anywhere; a run past
/// the check fails connecting instead.
pub fn manager_without_cluster<I, S>(
    bin: &std::path::Path,
    args: I,
) -> std::io::Result<std::process::Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let dir = tempfile::tempdir()?;
    std::process::Command::new(bin)
        .arg("run")
        .args(args)
        .env("KUBECONFIG", dir.path().join("no-such-kubeconfig"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("RUST_LOG", "warn")
        .output()
}

/// A free TCP port on 127.0.0.1 (bound, then released).
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// A name unique to this process and call: `<prefix><pid36><n>`, at most
/// 15 characters so it is also a valid interface name.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = format!("{prefix}{}x{n}", radix36(std::process::id()));
    name.chars().take(15).collect()
}

fn radix36(mut v: u32) -> String {
    let digits = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(digits[(v % 36) as usize]);
        v /= 36;
        if v == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8_lossy(&out).into_owned()
}

/// `cargo` (through PATH: the rustup proxy honours rust-toolchain.toml) for
/// a build started from inside a test, with the variables `cargo test` set
/// for the test removed. Build scripts track some of them (ring's reruns on
/// `CARGO_PKG_NAME`, `CARGO_MANIFEST_DIR`, `OUT_DIR`, ...), so a build that
/// inherited them would rebuild ring and everything above it, and the next
/// `cargo test` from a shell would rebuild them back.
pub fn cargo_command() -> std::process::Command {
    let mut cmd = std::process::Command::new("cargo");
    for (k, _) in std::env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        let keep = matches!(k, "CARGO_HOME" | "CARGO_TARGET_DIR")
            || [
                "CARGO_BUILD_",
                "CARGO_TERM_",
                "CARGO_NET_",
                "CARGO_REGISTRIES_",
                "CARGO_PROFILE_",
            ]
            .iter()
            .any(|p| k.starts_with(p));
        if (k.starts_with("CARGO_") && !keep) || matches!(k, "CARGO" | "OUT_DIR" | "RUSTC") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Runs a command to completion and fails with its stderr when it fails.
pub fn run(cmd: &mut std::process::Command) -> anyhow::Result<String> {
    let out = cmd
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {cmd:?}: {e}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The last lines of a log file (for error messages).
pub fn tail_file(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A binary of the workspace (debug build), built with `cargo build
/// --workspace --bin NAME` if needed (the same feature unification as the
/// test build, so nothing compiles twice).
pub fn workspace_bin(name: &str) -> anyhow::Result<PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = cargo_command()
        .current_dir(&root)
        .args(["build", "--quiet", "--workspace", "--bin", name])
        .output()?;
    if !out.status.success() {
        anyhow::bail!(
            "cargo build --workspace --bin {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    Ok(target.join("debug").join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_names_fit_interface_names_and_differ() {
        let a = unique_name("anl");
        let b = unique_name("anl");
        assert_ne!(a, b);
        assert!(a.len() <= 15 && a.starts_with("anl"));
    }
}
