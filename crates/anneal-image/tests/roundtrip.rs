//! Round trips through real mkfs output: GPT and MBR disks with a vfat ESP,
//! an ext4 partition with files, swap and an unrecognised partition;
//! captured, restored to a larger target, checked with fsck, debugfs, mtools
//! and blkid.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::too_many_lines)]

mod common;

use anneal_image::capture::{self, Options};
use anneal_image::layout::{self, Role, TableKind};
use anneal_image::restore::{self, RestoreError, RestoreOptions};
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const SWAP_UUID: &str = "5a3c1e2f-0000-4000-8000-00000000abcd";
const ROOT_PARTUUID: &str = "7E6A2B9C-1D3F-4A5B-8C7D-9E0F1A2B3C4D";
const ODD_TYPE: &str = "8DA63339-0007-60C0-C436-083AC8230908";

// partition geometry in sectors: esp 32 MiB, root 64 MiB, swap 16 MiB, other 8 MiB
const PARTS: [(u64, u64); 4] = [
    (2048, 65536),
    (67584, 131072),
    (198656, 32768),
    (231424, 16384),
];

fn build_disk(dir: &Path, table: &str) -> PathBuf {
    let disk = dir.join(format!("{table}.img"));
    let f = std::fs::File::create(&disk).unwrap();
    f.set_len(128 * MIB).unwrap();
    drop(f);
    match table {
        "gpt" => {
            run(Command::new("sgdisk")
                .args([
                    "-o",
                    "-n",
                    "1:2048:+32M",
                    "-t",
                    "1:ef00",
                    "-c",
                    "1:EFI system",
                ])
                .args(["-n", "2:67584:+64M", "-t", "2:8300", "-c", "2:root"])
                .arg(format!("-u=2:{ROOT_PARTUUID}"))
                .args(["-n", "3:198656:+16M", "-t", "3:8200"])
                .args(["-n", "4:231424:+8M"])
                .arg(format!("-t=4:{ODD_TYPE}"))
                .arg(&disk));
        }
        _ => {
            sh(&format!(
                "printf 'label: dos\\nlabel-id: 0x1234abcd\\n\
                 start=2048, size=65536, type=ef, bootable\\n\
                 start=67584, size=131072, type=83\\n\
                 start=198656, size=32768, type=82\\n\
                 start=231424, size=16384, type=da\\n' | sfdisk -q {}",
                disk.display()
            ));
        }
    }
    let files = sample_files();
    let esp = dir.join("esp.part");
    make_vfat(&esp, 32, &files[..2]);
    place(&esp, &disk, PARTS[0].0 * 512);
    let root = dir.join("root.part");
    make_ext4(&root, 64, &files, "rootfs");
    place(&root, &disk, PARTS[1].0 * 512);
    let swap = dir.join("swap.part");
    make_swap(&swap, 16, SWAP_UUID);
    place(&swap, &disk, PARTS[2].0 * 512);
    // unrecognised: a few non-zero regions in zeros
    let other = dir.join("other.part");
    let mut o = vec![0u8; 8 * MIB as usize];
    o[..65536].copy_from_slice(&noise(9, 65536));
    o[5 * MIB as usize..5 * MIB as usize + 10_000].copy_from_slice(&noise(10, 10_000));
    std::fs::write(&other, &o).unwrap();
    place(&other, &disk, PARTS[3].0 * 512);
    for p in [esp, root, swap, other] {
        std::fs::remove_file(p).unwrap();
    }
    disk
}

fn check_restored(dir: &Path, source: &Path, target: &Path, table: TableKind) {
    let src_layout = layout::read_layout(&mut std::fs::File::open(source).unwrap()).unwrap();
    let got = layout::read_layout(&mut std::fs::File::open(target).unwrap()).unwrap();
    assert_eq!(got.partition_table, table);
    assert_eq!(got.slots.len(), 4);
    for (a, b) in src_layout.slots.iter().zip(&got.slots) {
        assert_eq!(a.number, b.number);
        assert_eq!(a.start_bytes, b.start_bytes);
        assert_eq!(a.type_guid, b.type_guid);
        assert_eq!(a.part_uuid, b.part_uuid);
        assert_eq!(a.mbr_type, b.mbr_type);
        assert_eq!(a.bootable, b.bootable);
        assert_eq!(a.name, b.name);
    }
    assert_eq!(src_layout.disk_guid, got.disk_guid);
    assert_eq!(src_layout.disk_signature, got.disk_signature);
    // the last partition grew to the end of the larger target
    assert!(got.slots[3].size_bytes > src_layout.slots[3].size_bytes);
    if table == TableKind::Gpt {
        let v = run(Command::new("sgdisk").arg("-v").arg(target));
        assert!(v.contains("No problems found"), "{v}");
        assert_eq!(got.slots[1].part_uuid.as_deref(), Some(ROOT_PARTUUID));
        assert_eq!(got.slots[3].type_guid.as_deref(), Some(ODD_TYPE));
    }
    let files = sample_files();
    let esp = dir.join("r-esp.part");
    extract(target, PARTS[0].0 * 512, PARTS[0].1 * 512, &esp);
    fsck_clean(&esp, "vfat");
    for (p, c) in &files[..2] {
        assert_eq!(sha256_hex(&vfat_file(&esp, p)), sha256_hex(c), "esp {p}");
    }
    let root = dir.join("r-root.part");
    extract(target, PARTS[1].0 * 512, PARTS[1].1 * 512, &root);
    fsck_clean(&root, "ext4");
    for (p, c) in &files {
        assert_eq!(sha256_hex(&ext4_file(&root, p)), sha256_hex(c), "root {p}");
    }
    assert_eq!(blkid(&root, "LABEL"), "rootfs");
    let swap = dir.join("r-swap.part");
    extract(target, PARTS[2].0 * 512, PARTS[2].1 * 512, &swap);
    assert_eq!(blkid(&swap, "TYPE"), "swap");
    assert_eq!(blkid(&swap, "UUID"), SWAP_UUID);
    // the unrecognised partition is byte-identical, zeros included
    let a = dir.join("s-other.part");
    let b = dir.join("r-other.part");
    extract(source, PARTS[3].0 * 512, PARTS[3].1 * 512, &a);
    extract(target, PARTS[3].0 * 512, PARTS[3].1 * 512, &b);
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap());
}

fn round_trip(table: &str, kind: TableKind) {
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d, table);
    let out = d.join("captured");
    let opts = Options {
        piece_length: 1 << 20,
    };
    let l = capture::capture_disk(&disk, &out, opts).unwrap();
    assert_eq!(l.partition_table, kind);
    let roles: Vec<Role> = l.slots.iter().map(|s| s.role).collect();
    assert_eq!(roles, [Role::Esp, Role::Data, Role::Swap, Role::Data]);
    let fs: Vec<&str> = l
        .slots
        .iter()
        .map(|s| s.fs_type.as_deref().unwrap())
        .collect();
    assert_eq!(fs, ["vfat", "ext4", "swap", "raw"]);
    assert_eq!(l.slots[2].uuid.as_deref(), Some(SWAP_UUID));
    assert!(l.slots[2].content_ref.is_none());
    assert_eq!(l.slots[0].uuid.as_deref(), Some("1234-ABCD"));
    // ext4 used far less than its 64 MiB
    let root = restore::Content::load("p2", &out.join("p2.index"), &out.join("p2.stream")).unwrap();
    assert!(
        root.index.header.used_bytes < 32 * MIB,
        "{}",
        root.index.header.used_bytes
    );
    assert_eq!(root.index.header.fs_type, "ext4");
    // larger target with garbage where the elided zeros must land
    let target = d.join("target.img");
    dirty_target(&target, 192 * MIB, PARTS[3].0 * 512, PARTS[3].1 * 512);
    restore::restore_image(
        &out,
        &target,
        &RestoreOptions {
            grow_last: true,
            target_size: None,
        },
    )
    .unwrap();
    check_restored(d, &disk, &target, kind);
}

#[test]
fn gpt_round_trip() {
    round_trip("gpt", TableKind::Gpt);
}

#[test]
fn mbr_round_trip() {
    round_trip("mbr", TableKind::Mbr);
}

#[test]
fn hostile_captures_are_refused_or_invalidate() {
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d, "gpt");
    let out = d.join("captured");
    let opts = Options {
        piece_length: 1 << 20,
    };
    capture::capture_disk(&disk, &out, opts).unwrap();

    // a layout larger than the target: refused, target untouched
    let small = d.join("small.img");
    dirty_target(&small, 64 * MIB, 0, MIB);
    let before = std::fs::read(&small).unwrap();
    let e = restore::restore_image(&out, &small, &RestoreOptions::default()).unwrap_err();
    assert!(matches!(e, RestoreError::Layout(_)), "{e:?}");
    assert!(std::fs::read(&small).unwrap() == before);

    // a stream whose length lies: refused before any write
    let target = d.join("target.img");
    dirty_target(&target, 160 * MIB, PARTS[1].0 * 512, 4 * MIB);
    let before = std::fs::read(&target).unwrap();
    let stream = out.join("p2.stream");
    let good = std::fs::read(&stream).unwrap();
    std::fs::write(&stream, &good[..good.len() - 4096]).unwrap();
    let e = restore::restore_image(&out, &target, &RestoreOptions::default()).unwrap_err();
    assert!(matches!(e, RestoreError::Mismatch(_)), "{e:?}");
    assert!(std::fs::read(&target).unwrap() == before);

    // an index whose extents overlap: refused before any write
    let idx_path = out.join("p2.index");
    let good_idx = std::fs::read(&idx_path).unwrap();
    let mut idx = anneal_image::ContentIndex::parse(&good_idx).unwrap();
    idx.extents[1].offset = idx.extents[0].offset;
    assert!(idx.build().is_err());
    let mut raw = good_idx.clone();
    raw[256 + 16..256 + 24].copy_from_slice(&good_idx[256..264]);
    std::fs::write(&idx_path, &raw).unwrap();
    std::fs::write(&stream, &good).unwrap();
    let e = restore::restore_image(&out, &target, &RestoreOptions::default()).unwrap_err();
    assert!(matches!(e, RestoreError::Index { .. }), "{e:?}");
    assert!(std::fs::read(&target).unwrap() == before);
    std::fs::write(&idx_path, &good_idx).unwrap();

    // a corrupt piece in the middle of the ext4 stream: restore aborts at that
    // piece and the target has no partition table left
    let mut bad = good.clone();
    let at = 2 * (1 << 20) + 100;
    bad[at] ^= 0xff;
    std::fs::write(&stream, &bad).unwrap();
    // first give the target a valid table, as a previous deploy would have
    restore::restore_image(&out, &target, &RestoreOptions::default()).unwrap_err();
    std::fs::write(&stream, &good).unwrap();
    restore::restore_image(&out, &target, &RestoreOptions::default()).unwrap();
    assert!(layout::read_layout(&mut std::fs::File::open(&target).unwrap()).is_ok());
    std::fs::write(&stream, &bad).unwrap();
    let e = restore::restore_image(&out, &target, &RestoreOptions::default()).unwrap_err();
    let msg = format!("{e:?}");
    assert!(matches!(e, RestoreError::Invalidated(_)), "{msg}");
    assert!(
        msg.contains("PieceHash") && msg.contains("piece: 2"),
        "{msg}"
    );
    assert!(layout::read_layout(&mut std::fs::File::open(&target).unwrap()).is_err());
    let head = std::fs::read(&target).unwrap();
    assert!(head[..34 * 512].iter().all(|b| *b == 0));
    assert!(head[head.len() - 33 * 512..].iter().all(|b| *b == 0));
}

/// A Clonezilla image directory made from the GPT disk with Debian's
/// partclone (gzip and zstd, split), imported, restored, checked like the
/// raw round trip.
#[test]
fn clonezilla_directory_round_trip() {
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d, "gpt");
    let cz = d.join("cz");
    std::fs::create_dir_all(&cz).unwrap();
    sh(&format!(
        "sfdisk -d {disk} | sed -E 's#^[^ ]*img([0-9]+) :#/dev/sda\\1 :#' > {cz}/sda-pt.sf && echo sda > {cz}/disk && echo 'sda1 sda2 sda3 sda4' > {cz}/parts",
        disk = disk.display(),
        cz = cz.display()
    ));
    let log = d.join("pc.log");
    for (n, (tool, comp)) in [
        (1usize, ("vfat", "gz")),
        (2, ("ext4", "zst")),
        (4, ("dd", "gz")),
    ] {
        let part = d.join(format!("p{n}.part"));
        extract(&disk, PARTS[n - 1].0 * 512, PARTS[n - 1].1 * 512, &part);
        let compress = if comp == "gz" {
            "gzip -c"
        } else {
            "zstd -q -c"
        };
        let clone = if tool == "dd" { "" } else { "-c" };
        sh(&format!(
            "partclone.{tool} {clone} -q -L {log} -s {part} -o - | {compress} > {d}/tmp && \
             split -n 2 {d}/tmp {cz}/sda{n}.{tool}-ptcl-img.{comp}. && rm {d}/tmp {part}",
            log = log.display(),
            part = part.display(),
            d = d.display(),
            cz = cz.display()
        ));
    }
    std::fs::write(
        cz.join("swappt-sda3.info"),
        format!("UUID=\"{SWAP_UUID}\"\nLABEL=\"swp\"\n"),
    )
    .unwrap();
    let out = d.join("captured");
    let l = capture::capture_clonezilla(
        &cz,
        &out,
        Options {
            piece_length: 1 << 20,
        },
    )
    .unwrap();
    assert_eq!(l.partition_table, TableKind::Gpt);
    let fs: Vec<&str> = l
        .slots
        .iter()
        .map(|s| s.fs_type.as_deref().unwrap())
        .collect();
    assert_eq!(fs, ["vfat", "ext4", "swap", "raw"]);
    // the table of the Clonezilla dump carries the disk GUID
    let src = layout::read_layout(&mut std::fs::File::open(&disk).unwrap()).unwrap();
    assert_eq!(l.disk_guid, src.disk_guid);
    let target = d.join("target.img");
    dirty_target(&target, 192 * MIB, PARTS[3].0 * 512, PARTS[3].1 * 512);
    restore::restore_image(
        &out,
        &target,
        &RestoreOptions {
            grow_last: true,
            target_size: None,
        },
    )
    .unwrap();
    check_restored(d, &disk, &target, TableKind::Gpt);
}

/// Blank slots (an `fsType` and no content) get a fresh filesystem from
/// mke2fs / mkfs.vfat at their offset.
#[test]
fn blank_slots_get_mkfs() {
    let dir = tmpdir();
    let d = dir.path();
    let disk = build_disk(d, "gpt");
    let out = d.join("captured");
    let mut l = capture::capture_disk(
        &disk,
        &out,
        Options {
            piece_length: 1 << 20,
        },
    )
    .unwrap();
    l.slots[0].content_ref = None;
    l.slots[0].label = Some("BLANKESP".into());
    l.slots[3].content_ref = None;
    l.slots[3].fs_type = Some("ext4".into());
    l.slots[3].label = Some("blank".into());
    capture::write_layout(&out, &l).unwrap();
    let target = d.join("target.img");
    dirty_target(&target, 160 * MIB, PARTS[3].0 * 512, PARTS[3].1 * 512);
    restore::restore_image(&out, &target, &RestoreOptions::default()).unwrap();
    let p4 = d.join("p4.part");
    extract(&target, PARTS[3].0 * 512, PARTS[3].1 * 512, &p4);
    fsck_clean(&p4, "ext4");
    assert_eq!(blkid(&p4, "LABEL"), "blank");
    let p1 = d.join("p1.part");
    extract(&target, PARTS[0].0 * 512, PARTS[0].1 * 512, &p1);
    fsck_clean(&p1, "vfat");
    assert_eq!(blkid(&p1, "LABEL"), "BLANKESP");
    // the ext4 content next to them is intact
    let p2 = d.join("p2.part");
    extract(&target, PARTS[1].0 * 512, PARTS[1].1 * 512, &p2);
    fsck_clean(&p2, "ext4");
    assert!(layout::read_layout(&mut std::fs::File::open(&target).unwrap()).is_ok());
}

/// A partition of `len` bytes that no probe of this crate recognises:
/// pseudo-random runs of 12-28 KiB at the start of every 64 KiB, zeros
/// between them (the holes a raw capture elides).
fn raw_partition(len: u64) -> Vec<u8> {
    let mut p = vec![0u8; len as usize];
    for (k, chunk) in p.chunks_mut(64 << 10).enumerate() {
        let n = ((12 + 4 * (k % 5)) << 10).min(chunk.len());
        chunk[..n].copy_from_slice(&noise(100 + k as u64, n));
    }
    p
}

/// A file of `len` bytes of 0xFF: a disk that held data.
fn filled(path: &Path, len: u64) {
    std::fs::write(path, vec![0xFFu8; len as usize]).unwrap();
}

/// A raw-captured content (`FLAG_GAPS_ZERO`) restored from its files onto
/// a target full of 0xFF: the slot equals the source partition byte for
/// byte (the gaps zeroed) and nothing outside it changes; a slot smaller
/// than the content is refused before any write (the target stays 0xFF).
#[test]
fn a_raw_content_from_its_files_zeroes_the_gaps_and_refuses_a_smaller_slot() {
    use anneal_image::format::FLAG_GAPS_ZERO;
    let dir = tmpdir();
    let d = dir.path();
    let len = 8 * MIB;
    let part = raw_partition(len);
    let p = d.join("raw.part");
    std::fs::write(&p, &part).unwrap();
    let (ip, sp) = (d.join("raw.index"), d.join("raw.stream"));
    let (index, info) = capture::capture_region(
        &std::fs::File::open(&p).unwrap(),
        0,
        len,
        &ip,
        &sp,
        Options {
            piece_length: 64 << 10,
        },
    )
    .unwrap();
    assert_eq!(info.fs_type, "raw");
    assert_ne!(index.header.flags & FLAG_GAPS_ZERO, 0);
    assert!(index.extents.len() > 100, "{}", index.extents.len());
    let c = restore::Content::load("raw", &ip, &sp).unwrap();
    let base = MIB;
    let t = d.join("t.img");
    filled(&t, base + len + MIB);
    let mut target = restore::Target::open(&t, None).unwrap();
    restore::write_content(&mut target, base, len, &c).unwrap();
    target.sync().unwrap();
    let got = std::fs::read(&t).unwrap();
    let (a, b) = (base as usize, (base + len) as usize);
    assert!(got[..a].iter().all(|x| *x == 0xFF), "before the slot");
    assert!(got[a..b] == part[..], "the slot differs from the source");
    assert!(got[b..].iter().all(|x| *x == 0xFF), "after the slot");

    let t = d.join("small.img");
    filled(&t, base + len + MIB);
    let mut target = restore::Target::open(&t, None).unwrap();
    let err = restore::write_content(&mut target, base, len - 4096, &c).unwrap_err();
    assert!(err.to_string().contains("larger than its slot"), "{err}");
    drop(target);
    let got = std::fs::read(&t).unwrap();
    assert!(got.iter().all(|x| *x == 0xFF), "the target was written");
}
