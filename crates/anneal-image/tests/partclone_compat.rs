//! Compatibility with Debian's partclone: images written by
//! `partclone.ext4 -c`, `partclone.vfat -c` and `partclone.dd` are imported
//! (plain, gzip, zstd, split), restored, and compared with what
//! `partclone.restore` / `partclone.dd` produce from the same image.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::too_many_lines)]

mod common;

use anneal_image::capture::{self, Options};
use anneal_image::extents::Extent;
use anneal_image::restore::{self, Content, Target};
use common::*;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::process::Command;

const OPTS: Options = Options {
    piece_length: 1 << 20,
};

fn read_range(p: &Path, off: u64, len: u64) -> Vec<u8> {
    let f = std::fs::File::open(p).unwrap();
    let mut b = vec![0u8; len as usize];
    let n = f.read_at(&mut b, off).unwrap();
    // partclone.restore stops its output file after the last used block
    b.truncate(n);
    b.resize(len as usize, 0);
    b
}

fn covered(outer: &[Extent], inner: &[Extent]) -> bool {
    inner.iter().all(|e| {
        outer
            .iter()
            .any(|o| o.offset <= e.offset && e.end() <= o.end())
    })
}

/// Captures `part` with `tool`, imports the image, restores it with anneal
/// and with partclone, and compares every used block.
fn compat(d: &Path, part: &Path, tool: &str, fs: &str) {
    let img = d.join("part.pcl");
    let log = d.join("partclone.log");
    let mut c = Command::new(format!("partclone.{tool}"));
    if tool != "dd" {
        c.arg("-c");
    }
    run(c
        .arg("-q")
        .arg("-L")
        .arg(&log)
        .arg("-s")
        .arg(part)
        .arg("-o")
        .arg(&img));

    let out = d.join("content");
    let (idx, info) = capture::capture_partclone_file(&img, &out, "p1", OPTS).unwrap();
    assert_eq!(info.fs_type, fs);
    let size = std::fs::metadata(part).unwrap().len();
    assert_eq!(idx.header.partition_size, size);

    // restore with anneal
    let ours = d.join("ours.img");
    let content = Content::load("p1", &out.join("p1.index"), &out.join("p1.stream")).unwrap();
    let mut t = Target::open(&ours, Some(size)).unwrap();
    restore::restore_partition(&mut t, 0, &content).unwrap();
    drop(t);

    // restore with partclone
    let theirs = d.join("theirs.img");
    std::fs::File::create(&theirs)
        .unwrap()
        .set_len(size)
        .unwrap();
    if tool == "dd" {
        run(Command::new("partclone.dd")
            .arg("-q")
            .arg("-L")
            .arg(&log)
            .arg("-s")
            .arg(&img)
            .arg("-O")
            .arg(&theirs));
    } else {
        run(Command::new("partclone.restore")
            .args(["-q", "-C", "-L"])
            .arg(&log)
            .arg("-s")
            .arg(&img)
            .arg("-O")
            .arg(&theirs));
    }
    assert!(!idx.extents.is_empty());
    for e in &idx.extents {
        let a = read_range(&ours, e.offset, e.len);
        let b = read_range(&theirs, e.offset, e.len);
        let o = read_range(part, e.offset, e.len);
        assert!(
            a == b,
            "{tool}: extent {e:?} differs from partclone.restore"
        );
        assert!(a == o, "{tool}: extent {e:?} differs from the source");
    }
    if fs == "ext4" || fs == "vfat" {
        fsck_clean(&ours, fs);
    }

    // our own used-block detection covers partclone's bitmap
    if tool != "dd" {
        let f = std::fs::File::open(part).unwrap();
        let (own, _) = capture::capture_region(
            &f,
            0,
            size,
            &d.join("own.index"),
            &d.join("own.stream"),
            OPTS,
        )
        .unwrap();
        assert!(
            covered(&own.extents, &idx.extents),
            "{fs}: own map misses partclone blocks"
        );
        // and is not much larger (only metadata of uninitialised groups)
        assert!(own.header.used_bytes <= idx.header.used_bytes + 2 * MIB);
    }

    // gzip and zstd, split into parts as Clonezilla writes them: same content
    for (comp, ext) in [("gzip -c", "gz"), ("zstd -q -c", "zst")] {
        let prefix = d.join(format!("part.{tool}-ptcl-img.{ext}."));
        sh(&format!(
            "{comp} {img} > {img}.c && split -n 3 {img}.c {prefix} && rm {img}.c",
            img = img.display(),
            prefix = prefix.display()
        ));
        let first = d.join(format!("part.{tool}-ptcl-img.{ext}.aa"));
        assert!(d.join(format!("part.{tool}-ptcl-img.{ext}.ab")).exists());
        let out2 = d.join(format!("content-{ext}"));
        let (idx2, _) = capture::capture_partclone_file(&first, &out2, "p1", OPTS).unwrap();
        assert_eq!(idx2, idx, "{ext}");
        // a truncated compressed image is refused
        let last = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.to_string_lossy()
                    .contains(&format!("part.{tool}-ptcl-img.{ext}."))
            })
            .max()
            .unwrap();
        std::fs::remove_file(&last).unwrap();
        if tool != "dd" {
            assert!(capture::capture_partclone_file(&first, &d.join("trunc"), "p1", OPTS).is_err());
        }
    }
}

#[test]
fn partclone_ext4_1k_blocks() {
    let dir = tmpdir();
    let part = dir.path().join("ext4.part");
    make_ext4(&part, 48, &sample_files(), "small");
    compat(dir.path(), &part, "ext4", "ext4");
}

#[test]
fn partclone_ext4_flex_bg_uninit_groups() {
    let dir = tmpdir();
    let d = dir.path();
    let part = d.join("ext4.part");
    let tree = d.join("tree");
    write_tree(&tree, &sample_files());
    run(Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-g", "2048", "-d"])
        .arg(&tree)
        .arg(&part)
        .arg("96M"));
    compat(d, &part, "ext4", "ext4");
}

#[test]
fn partclone_vfat() {
    let dir = tmpdir();
    let part = dir.path().join("vfat.part");
    make_vfat(&part, 40, &sample_files());
    compat(dir.path(), &part, "vfat", "vfat");
}

#[test]
fn partclone_vfat32() {
    let dir = tmpdir();
    let part = dir.path().join("vfat.part");
    let _ = std::fs::remove_file(&part);
    run(Command::new("mkfs.vfat")
        .args(["-F", "32", "-s", "1", "-C"])
        .arg(&part)
        .arg((40 * 1024).to_string()));
    for (p, c) in &sample_files()[..2] {
        let f = dir.path().join(p.replace('/', "_"));
        std::fs::write(&f, c).unwrap();
        run(Command::new("mcopy")
            .arg("-i")
            .arg(&part)
            .arg(&f)
            .arg("::/"));
    }
    compat(dir.path(), &part, "vfat", "vfat");
}

#[test]
fn partclone_dd() {
    let dir = tmpdir();
    let part = dir.path().join("raw.part");
    let mut b = vec![0u8; 6 * MIB as usize];
    b[4096..70_000].copy_from_slice(&noise(4, 70_000 - 4096));
    b[3 * MIB as usize..3 * MIB as usize + 1000].copy_from_slice(&noise(5, 1000));
    std::fs::write(&part, &b).unwrap();
    compat(dir.path(), &part, "dd", "raw");
}
