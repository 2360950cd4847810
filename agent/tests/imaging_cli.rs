//! `anneal-agent capture` of a qcow2 disk and `anneal-agent restore` onto a
//! larger file, through the binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::path::Path;
use std::process::Command;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_anneal-agent"))
}

#[test]
fn capture_qcow2_and_restore_through_the_cli() {
    let base = Path::new("/var/tmp/anneal-test");
    std::fs::create_dir_all(base).unwrap();
    let dir = tempfile::tempdir_in(base).unwrap();
    let d = dir.path();
    let raw = d.join("disk.raw");
    std::fs::File::create(&raw)
        .unwrap()
        .set_len(48 << 20)
        .unwrap();
    run(Command::new("sgdisk")
        .args(["-o", "-n", "1:2048:+16M", "-t", "1:ef00", "-n", "2:0:+24M"])
        .arg(&raw));
    run(Command::new("mkfs.vfat")
        .args(["--offset", "2048", "-n", "CLIESP"])
        .arg(&raw)
        .arg("16384"));
    let tree = d.join("tree");
    std::fs::create_dir_all(&tree).unwrap();
    std::fs::write(tree.join("motd"), b"restored through the cli\n").unwrap();
    run(Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-L", "clifs", "-E"])
        .arg(format!("offset={}", 34_816 * 512))
        .arg("-d")
        .arg(&tree)
        .arg(&raw)
        .arg("24M"));
    let qcow = d.join("disk.qcow2");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow));
    let out = d.join("captured");
    let json = run(agent().arg("capture").arg(&qcow).arg("--out").arg(&out));
    assert!(json.contains("\"fsType\": \"ext4\"") && json.contains("\"contentRef\": \"p2\""));
    assert!(!out.join("qcow2-scratch.raw").exists());

    let target = d.join("target.img");
    run(agent()
        .arg("restore")
        .arg(&target)
        .arg("--from")
        .arg(&out)
        .arg("--grow")
        .arg("--size")
        .arg((64u64 << 20).to_string()));
    assert_eq!(std::fs::metadata(&target).unwrap().len(), 64 << 20);
    let v = run(Command::new("sgdisk").arg("-v").arg(&target));
    assert!(v.contains("No problems found"), "{v}");
    // the ext4 partition, read at its offset, holds the file
    let part = d.join("p2.img");
    let data = std::fs::read(&target).unwrap();
    std::fs::write(&part, &data[34_816 * 512..(34_816 * 512 + (24 << 20))]).unwrap();
    run(Command::new("e2fsck").arg("-fn").arg(&part));
    let cat = run(Command::new("debugfs")
        .arg("-R")
        .arg("cat /motd")
        .arg(&part));
    assert_eq!(cat, "restored through the cli\n");

    // a capture directory whose layout does not fit is refused
    let small = d.join("small.img");
    std::fs::File::create(&small)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let o = agent()
        .arg("restore")
        .arg(&small)
        .arg("--from")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(std::fs::read(&small).unwrap().iter().all(|b| *b == 0));
}
