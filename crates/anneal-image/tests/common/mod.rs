//! Helpers shared by the imaging integration tests: build partitions and
//! disks with the real mkfs tools, read files back out of them.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use sha2::Digest as _;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const MIB: u64 = 1 << 20;

pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawning {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn sh(script: &str) -> String {
    run(Command::new("bash").args(["-euo", "pipefail", "-c", script]))
}

/// Deterministic pseudo-random bytes.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = vec![0u8; len.div_ceil(8) * 8];
    for c in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A sparse file of `size` bytes with garbage in its first MiB, its last
/// MiB and `[garbage_at, garbage_at + garbage_len)`.
pub fn dirty_target(path: &Path, size: u64, garbage_at: u64, garbage_len: u64) {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    f.write_all_at(&noise(11, MIB as usize), 0).unwrap();
    f.write_all_at(&noise(12, MIB as usize), size - MIB)
        .unwrap();
    f.write_all_at(&noise(13, garbage_len as usize), garbage_at)
        .unwrap();
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex::encode(sha2::Sha256::digest(b))
}

/// The files put into the test filesystems: (path inside the fs, content).
pub fn sample_files() -> Vec<(String, Vec<u8>)> {
    vec![
        ("hello.txt".into(), b"hello from anneal\n".to_vec()),
        ("big.bin".into(), noise(1, 3 * MIB as usize + 123)),
        ("dir/nested.bin".into(), noise(2, 200_000)),
        ("dir/sub/small.bin".into(), noise(3, 4097)),
    ]
}

pub fn write_tree(root: &Path, files: &[(String, Vec<u8>)]) {
    for (p, c) in files {
        let f = root.join(p);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, c).unwrap();
    }
}

pub fn make_ext4(path: &Path, size_mib: u64, files: &[(String, Vec<u8>)], label: &str) {
    let tree = path.with_extension("tree");
    write_tree(&tree, files);
    run(Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-L", label, "-U"])
        .arg("0b1c2d3e-4f50-4172-8394-a5b6c7d8e9f0")
        .arg("-d")
        .arg(&tree)
        .arg(path)
        .arg(format!("{size_mib}M")));
    std::fs::remove_dir_all(&tree).unwrap();
}

pub fn make_vfat(path: &Path, size_mib: u64, files: &[(String, Vec<u8>)]) {
    let _ = std::fs::remove_file(path);
    run(Command::new("mkfs.vfat")
        .args(["-i", "1234ABCD", "-n", "ESP", "-C"])
        .arg(path)
        .arg((size_mib * 1024).to_string()));
    let tree = path.with_extension("tree");
    write_tree(&tree, files);
    for entry in std::fs::read_dir(&tree).unwrap() {
        run(Command::new("mcopy")
            .arg("-s")
            .arg("-i")
            .arg(path)
            .arg(entry.unwrap().path())
            .arg("::/"));
    }
    std::fs::remove_dir_all(&tree).unwrap();
}

pub fn make_swap(path: &Path, size_mib: u64, uuid: &str) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size_mib * MIB).unwrap();
    run(Command::new("mkswap")
        .args(["-U", uuid, "-L", "swp"])
        .arg(path));
}

/// Reads a file from an ext4 image with debugfs.
pub fn ext4_file(img: &Path, p: &str) -> Vec<u8> {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat /{p}"))
        .arg(img)
        .output()
        .unwrap();
    assert!(out.status.success());
    out.stdout
}

/// Reads a file from a FAT image with mtools.
pub fn vfat_file(img: &Path, p: &str) -> Vec<u8> {
    let out = Command::new("mcopy")
        .arg("-n")
        .arg("-i")
        .arg(img)
        .arg(format!("::/{p}"))
        .arg("-")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Copies `[off, off+len)` of `src` into a new file.
pub fn extract(src: &Path, off: u64, len: u64, dst: &Path) {
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::File::open(src).unwrap();
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, off).unwrap();
    std::fs::write(dst, buf).unwrap();
}

/// Copies `src` into `dst` at `off` (dst must exist).
pub fn place(src: &Path, dst: &Path, off: u64) {
    use std::os::unix::fs::FileExt as _;
    let data = std::fs::read(src).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(dst).unwrap();
    f.write_all_at(&data, off).unwrap();
}

pub fn fsck_clean(part: &Path, fs: &str) {
    match fs {
        "ext4" => {
            run(Command::new("e2fsck").arg("-fn").arg(part));
        }
        "vfat" => {
            run(Command::new("fsck.vfat").arg("-n").arg(part));
        }
        _ => panic!("no fsck for {fs}"),
    }
}

pub fn blkid(part: &Path, tag: &str) -> String {
    run(Command::new("blkid")
        .args(["-p", "-s", tag, "-o", "value"])
        .arg(part))
    .trim()
    .to_string()
}

pub fn tmpdir() -> tempfile::TempDir {
    let base = PathBuf::from("/var/tmp/anneal-test");
    std::fs::create_dir_all(&base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}
