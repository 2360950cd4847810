//! `anneal-agent capture` of qcow2 sources through the binary
//! (docs/content-format.md, "qcow2 sources"):
//! the image is read natively (the capture runs with no `qemu-img`
//! reachable and gives the raw disk's layout), and a qcow2 whose backing
//! file is a host file is refused with the reason, writing nothing (with
//! `qemu-img convert` the host file's partitions were captured as the
//! tenant's). qemu-img (tests/setup.sh, Debian's qemu-utils) only builds
//! the inputs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("{cmd:?}: {e} (tests/setup.sh installs qemu-utils, gdisk, dosfstools)")
    });
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

/// A 32 MiB GPT disk with a FAT ESP.
fn gpt_disk(d: &Path) -> PathBuf {
    let raw = d.join("host-disk.raw");
    std::fs::File::create(&raw)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    run(Command::new("sgdisk")
        .args(["-o", "-n", "1:2048:+16M", "-t", "1:ef00"])
        .arg(&raw));
    run(Command::new("mkfs.vfat")
        .args(["--offset", "2048", "-n", "HOSTESP"])
        .arg(&raw)
        .arg("16384"));
    raw
}

fn capture(src: &Path, out: &Path, path_env: Option<&str>) -> Output {
    let mut c = agent();
    c.arg("capture").arg(src).arg("--out").arg(out);
    if let Some(p) = path_env {
        c.env("PATH", p);
    }
    c.output().unwrap()
}

#[test]
fn qcow2_capture_runs_without_qemu_img() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let raw = gpt_disk(d);
    let qcow = d.join("disk.qcow2");
    run(Command::new("qemu-img")
        .args(["convert", "-c", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow));
    let empty = d.join("no-tools");
    std::fs::create_dir(&empty).unwrap();
    let o = capture(&qcow, &d.join("from-qcow2"), Some(empty.to_str().unwrap()));
    assert!(
        o.status.success(),
        "capture with no qemu-img on PATH: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o2 = capture(&raw, &d.join("from-raw"), None);
    assert!(
        o2.status.success(),
        "{}",
        String::from_utf8_lossy(&o2.stderr)
    );
    let a = std::fs::read(d.join("from-qcow2/layout.json")).unwrap();
    let b = std::fs::read(d.join("from-raw/layout.json")).unwrap();
    assert!(a == b, "the qcow2 and the raw disk give different layouts");
    assert!(String::from_utf8_lossy(&a).contains("HOSTESP"));
    let p1 = |w: &str| std::fs::read(d.join(w).join("p1.stream")).unwrap();
    assert!(p1("from-qcow2") == p1("from-raw"));
}

#[test]
fn qcow2_with_a_backing_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = gpt_disk(d);
    let overlay = d.join("tenant.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(&host)
        .arg(&overlay));
    let out = d.join("captured");
    let o = capture(&overlay, &out, None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "the host disk was captured: {err}");
    assert!(
        err.contains(&format!(
            "has a backing file ({:?})",
            host.to_str().unwrap()
        )),
        "{err}"
    );
    assert!(err.contains("flatten it"), "{err}");
    assert!(!out.join("layout.json").exists());
    assert!(!out.join("p1.stream").exists());
    assert!(!out.join("qcow2-scratch.raw").exists());
}
