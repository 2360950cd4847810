//! The superblock prober (`anneal_image::fs::identify`, what the inventory
//! reports) against real mkfs output, cross-checked with
//! `blkid -p` (the tools come from tests/setup.d/agent.sh).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::process::Command;

use anneal_image::fs;

fn blkid(path: &std::path::Path) -> BTreeMap<String, String> {
    let out = Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(path)
        .output()
        .expect("blkid (util-linux) is installed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn case(kind: &str, size_mib: u64, mkfs: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join(format!("{kind}.raw"));
    let f = std::fs::File::create(&img).unwrap();
    f.set_len(size_mib << 20).unwrap();
    drop(f);
    let status = Command::new(mkfs[0])
        .args(&mkfs[1..])
        .arg(&img)
        .output()
        .unwrap_or_else(|e| panic!("{} missing ({e}): run tests/setup.d/agent.sh", mkfs[0]));
    assert!(
        status.status.success(),
        "{mkfs:?}: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let ours = fs::identify(&fs::FileRegion::whole(&std::fs::File::open(&img).unwrap()).unwrap())
        .unwrap()
        .unwrap_or_else(|| panic!("{kind}: nothing found"));
    let theirs = blkid(&img);
    assert_eq!(
        Some(ours.fs_type),
        theirs.get("TYPE").map(String::as_str),
        "{kind} type"
    );
    assert_eq!(ours.uuid.as_ref(), theirs.get("UUID"), "{kind} uuid");
    assert_eq!(ours.label.as_ref(), theirs.get("LABEL"), "{kind} label");
    assert!(ours.label.is_some(), "{kind}: every case sets a label");
}

#[test]
fn ext_family() {
    case("ext2", 8, &["mkfs.ext2", "-q", "-F", "-L", "bootfs"]);
    case("ext3", 8, &["mkfs.ext3", "-q", "-F", "-L", "old-root"]);
    case("ext4", 16, &["mkfs.ext4", "-q", "-F", "-L", "root"]);
}

#[test]
fn vfat_sizes() {
    case("fat12", 2, &["mkfs.vfat", "-F", "12", "-n", "SMALL"]);
    case("fat16", 32, &["mkfs.vfat", "-F", "16", "-n", "BOOT16"]);
    case("fat32", 64, &["mkfs.vfat", "-F", "32", "-n", "EFI"]);
}

#[test]
fn swap_xfs_btrfs_ntfs() {
    case("swap", 8, &["mkswap", "-L", "swap0"]);
    case("xfs", 320, &["mkfs.xfs", "-q", "-f", "-L", "data"]);
    case("btrfs", 128, &["mkfs.btrfs", "-q", "-f", "-L", "pool"]);
    case("ntfs", 16, &["mkntfs", "-q", "-F", "-f", "-L", "WinData"]);
}
