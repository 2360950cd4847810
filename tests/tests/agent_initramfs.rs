//! The agent and its initramfs as the acceptance states them: a statically
//! linked agent of at most 12 MiB; an initramfs with the broad driver set of
//! at most 30 MiB whose two builds from the same inputs are byte-identical;
//! its contents are the agent as /init, the modules with their dependencies
//! and a module index restricted to them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_tests::artifacts;

use std::process::Command;

use anneal_testinfra::debian_kernel;

#[test]
fn static_agent_and_reproducible_initramfs() {
    let agent = artifacts::agent_musl();
    let file = Command::new("file").arg(&agent).output().unwrap();
    let file = String::from_utf8_lossy(&file.stdout);
    assert!(file.contains("statically linked"), "{file}");
    let agent_size = std::fs::metadata(&agent).unwrap().len();
    println!("agent: {agent_size} bytes; {}", file.trim());
    assert!(agent_size <= 12 << 20, "agent is {agent_size} bytes");

    let kernel = debian_kernel().unwrap();
    let tool = artifacts::initramfs_tool();
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.cpio.zst");
    let b = dir.path().join("b.cpio.zst");
    let ra = artifacts::build_initramfs(&tool, &agent, &kernel.modules, &a);
    let rb = artifacts::build_initramfs(&tool, &agent, &kernel.modules, &b);
    assert_eq!(ra["sha256"], rb["sha256"], "two builds differ");
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let size = std::fs::metadata(&a).unwrap().len();
    println!("initramfs: {size} bytes, sha256 {}", ra["sha256"]);
    assert!(size <= 30 << 20, "initramfs is {size} bytes");

    // The broad set is there, with dependencies, and nothing of USB storage.
    let modules: Vec<&str> = ra["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    for m in [
        "virtio_net",
        "virtio_blk",
        "nvme",
        "nvme_core",
        "ahci",
        "mpt3sas",
        "e1000e",
        "igb",
        "ixgbe",
        "i40e",
        "ice",
        "mlx5_core",
        "bnxt_en",
        "efivarfs",
        "ext4",
        "vfat",
        "jbd2",
        "crc32c_generic",
    ] {
        assert!(modules.contains(&m), "{m} missing from {modules:?}");
    }
    assert!(!modules.contains(&"usb_storage"));
    let pos = |n: &str| modules.iter().position(|m| *m == n).unwrap();
    assert!(pos("nvme_core") < pos("nvme"));
    assert!(pos("jbd2") < pos("ext4"));

    // Listing with GNU cpio: /init, the index files, and a module's path.
    let cpio = zstd_decode(&a);
    let list_path = dir.path().join("a.cpio");
    std::fs::write(&list_path, &cpio).unwrap();
    let out = Command::new("cpio")
        .args(["-t", "-F"])
        .arg(&list_path)
        .output()
        .unwrap();
    assert!(out.status.success());
    let listing = String::from_utf8_lossy(&out.stdout);
    let release = &kernel.version;
    for want in [
        "init".to_string(),
        "dev/console".to_string(),
        "bin/sh".to_string(),
        format!("lib/modules/{release}/modules.dep"),
        format!("lib/modules/{release}/modules.alias"),
        format!("lib/modules/{release}/kernel/drivers/nvme/host/nvme.ko"),
        "etc/anneal/modules.load".to_string(),
    ] {
        assert!(
            listing.lines().any(|l| l == want),
            "{want} not in the archive"
        );
    }
}

fn zstd_decode(path: &std::path::Path) -> Vec<u8> {
    let out = Command::new("zstd")
        .args(["-d", "-c"])
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success(), "zstd -d failed");
    out.stdout
}
