//! Shared by the agent_* tests: builds the artifacts they boot or inspect.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

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

fn cargo(args: &[&str]) {
    // `cargo` through PATH (the rustup proxy honours rust-toolchain.toml):
    // the CARGO the test binary was compiled with may be another toolchain,
    // whose builds would not share artifacts with the workspace's.
    let out = Command::new("cargo")
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

/// The static musl agent (release), built if needed.
pub fn agent_musl() -> PathBuf {
    cargo(&[
        "--release",
        "--target",
        "x86_64-unknown-linux-musl",
        "-p",
        "anneal-agent",
        "--bin",
        "anneal-agent",
    ]);
    target_dir().join("x86_64-unknown-linux-musl/release/anneal-agent")
}

/// The initramfs builder (debug build).
pub fn initramfs_tool() -> PathBuf {
    cargo(&["-p", "anneal-initramfs", "--bin", "anneal-initramfs"]);
    target_dir().join("debug/anneal-initramfs")
}

/// The agent-protocol test server (debug build of the agent's example).
pub fn fake_manager() -> PathBuf {
    cargo(&["-p", "anneal-agent", "--example", "fake_manager"]);
    target_dir().join("debug/examples/fake_manager")
}

/// Builds an initramfs with the broad default driver set and busybox;
/// returns (output path, report JSON).
pub fn build_initramfs(tool: &Path, agent: &Path, modules: &Path, out: &Path) -> serde_json::Value {
    let report = out.with_extension("report.json");
    let res = Command::new(tool)
        .arg("--agent")
        .arg(agent)
        .arg("--modules")
        .arg(modules)
        .args(["--busybox", "/bin/busybox", "--compression", "zstd", "-o"])
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

/// dnsmasq on `br0` of `ns`: addresses only (10.77.0.100-150, router
/// 10.77.0.1), no ping delay; its log and leases go to the namespace's
/// directory. Killed (by process group) on drop.
pub fn dnsmasq(ns: &anneal_testinfra::Netns) -> anneal_testinfra::ChildGroup {
    let dir = ns.dir();
    anneal_testinfra::ChildGroup::spawn(
        "dnsmasq",
        ns.exec("dnsmasq")
            .args([
                "--no-daemon",
                "--conf-file=/dev/null",
                "--port=0",
                "--interface=br0",
                "--bind-interfaces",
                "--no-ping",
                "--dhcp-range=10.77.0.100,10.77.0.150,255.255.255.0,10m",
                "--dhcp-option=option:router,10.77.0.1",
            ])
            .arg(format!(
                "--dhcp-leasefile={}",
                dir.join("dnsmasq.leases").display()
            ))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("dnsmasq.log")).unwrap()),
    )
    .unwrap()
}

/// `BOOTIF=` of a MAC (`01-aa-bb-…`).
pub fn bootif(mac: &str) -> String {
    format!("01-{}", mac.replace(':', "-"))
}

/// Boots the agent directly (-kernel/-initrd on OVMF, TCG, no NIC option
/// ROM, no disks) with `append` as the kernel command line, one virtio NIC
/// on a new tap of `ns`. The guest's reboot ends QEMU (`-no-reboot`).
pub fn launch_agent_vm(
    ns: &anneal_testinfra::Netns,
    kernel: &Path,
    initrd: &Path,
    mac: &str,
    cpus: u32,
    memory_mib: u32,
    append: String,
) -> anneal_testinfra::Vm {
    let tap = ns.add_tap().unwrap();
    let mut nic = anneal_testinfra::NicConfig::virtio(&tap, mac);
    nic.option_rom = false;
    nic.bootindex = None;
    let cfg = anneal_testinfra::VmConfig {
        firmware: anneal_testinfra::Firmware::Ovmf,
        memory_mib,
        cpus,
        nics: vec![nic],
        kernel: Some(kernel.to_path_buf()),
        initrd: Some(initrd.to_path_buf()),
        append: Some(append),
        no_reboot: true,
        ..anneal_testinfra::VmConfig::default()
    };
    anneal_testinfra::Vm::launch(&cfg, Some(ns)).unwrap()
}
