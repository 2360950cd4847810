//! Hostile inputs that claim huge sizes in a few bytes: refused with an
//! error naming the field and the limit, before the allocation they would
//! cause (docs/content-format.md, "Input bounds (capture and ingest)").

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use anneal_image::capture::{self, Options};
use anneal_image::fs;
use anneal_image::partclone::{self, Reader};
use std::io::{self, Read, Write};

/// The documented limits (docs/content-format.md, "Input bounds"), written
/// out: a 64 TiB device at 4 KiB blocks, the content format's extents, 2^20
/// ext groups, FAT32's cluster maximum.
const MAX_BITMAP_BYTES: u64 = 2 << 30;
const MAX_EXTENTS: u64 = 1 << 26;
const MAX_EXT_GROUPS: u64 = 1 << 20;
const MAX_FAT_CLUSTERS: u64 = 0x0FFF_FFF5;

/// A 0002 header with the values given (as a hostile writer would put
/// them), its CRC right; no checksums on the blocks.
fn header(block_size: u32, total: u64, used: u64) -> Vec<u8> {
    let mut h = vec![0u8; partclone::HEADER_LEN];
    h[..15].copy_from_slice(partclone::MAGIC);
    h[30..34].copy_from_slice(b"0002");
    h[34..36].copy_from_slice(&0xC0DEu16.to_le_bytes());
    h[36..41].copy_from_slice(b"EXTFS");
    h[52..60].copy_from_slice(&(total * u64::from(block_size)).to_le_bytes());
    h[60..68].copy_from_slice(&total.to_le_bytes());
    h[68..76].copy_from_slice(&used.to_le_bytes());
    h[76..84].copy_from_slice(&used.to_le_bytes());
    h[84..88].copy_from_slice(&block_size.to_le_bytes());
    h[92..94].copy_from_slice(&2u16.to_le_bytes());
    h[105] = partclone::BM_BIT;
    let c = partclone::crc_update(0xFFFF_FFFF, &h[..106]);
    h[106..110].copy_from_slice(&c.to_le_bytes());
    h
}

/// A field of /proc/self/status in KiB.
fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Peak RSS growth allowed while refusing one hostile input (the tests of
/// this file run in one process, in parallel: this covers all of them).
const RSS_BOUND_KIB: u64 = 256 << 10;

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A header claiming 2^35 blocks of 4 KiB (128 TiB, a 4 GiB bitmap),
/// followed by an endless stream of zeros (what a tiny compressed input
/// expands to): refused on the header, nothing of the bitmap read.
#[test]
fn a_huge_bitmap_claim_is_refused_before_reading_it() {
    let before = status_kib("VmRSS:");
    let blocks = 1u64 << 35;
    let header = header(4096, blocks, 0);
    let err = Reader::open(io::Cursor::new(header).chain(io::repeat(0)))
        .expect_err("a 4 GiB bitmap was accepted");
    let m = err.to_string();
    assert!(
        m.contains(&format!("total blocks {blocks}")) && m.contains(&MAX_BITMAP_BYTES.to_string()),
        "{m}"
    );
    let grown = status_kib("VmHWM:").saturating_sub(before);
    assert!(grown < RSS_BOUND_KIB, "peak RSS grew by {grown} KiB");
}

/// A bitmap of alternating bits: 16 MiB of bitmap, 2^26 + 32 extents (more
/// than the content format holds): refused on the bitmap, the extent list
/// (1 GiB) never built.
#[test]
fn a_bitmap_with_too_many_extents_is_refused_before_building_them() {
    let blocks = (1u64 << 27) + 64;
    let used = blocks / 2;
    let mut img = header(512, blocks, used);
    let bitmap = vec![0x55u8; blocks.div_ceil(8) as usize];
    let crc = partclone::crc_update(0xFFFF_FFFF, &bitmap);
    img.extend_from_slice(&bitmap);
    img.extend_from_slice(&crc.to_le_bytes());
    drop(bitmap);
    let before = status_kib("VmRSS:");
    let err = Reader::open(&img[..]).expect_err("2^26 + 32 extents were accepted");
    let m = err.to_string();
    assert!(
        m.contains(&format!("{used} used extents")) && m.contains(&MAX_EXTENTS.to_string()),
        "{m}"
    );
    let grown = status_kib("VmHWM:").saturating_sub(before);
    assert!(grown < RSS_BOUND_KIB, "peak RSS grew by {grown} KiB");
}

/// The same claim in a gzip-compressed image split in two parts (as
/// Clonezilla stores them): the capture names the field and the limit.
#[test]
fn a_compressed_split_image_claiming_a_huge_bitmap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1u64 << 35;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&header(4096, blocks, 0)).unwrap();
    gz.write_all(&vec![0u8; 1 << 20]).unwrap();
    let gz = gz.finish().unwrap();
    let (a, b) = gz.split_at(gz.len() / 2);
    let first = dir.path().join("sda1.ext4-ptcl-img.gz.aa");
    std::fs::write(&first, a).unwrap();
    std::fs::write(dir.path().join("sda1.ext4-ptcl-img.gz.ab"), b).unwrap();
    let before = status_kib("VmRSS:");
    let err =
        capture::capture_partclone_file(&first, &dir.path().join("out"), "p1", Options::default())
            .expect_err("a 4 GiB bitmap was accepted");
    let m = chain(&err);
    assert!(
        m.contains(&format!("total blocks {blocks}")) && m.contains(&MAX_BITMAP_BYTES.to_string()),
        "{m}"
    );
    let grown = status_kib("VmHWM:").saturating_sub(before);
    assert!(grown < RSS_BOUND_KIB, "peak RSS grew by {grown} KiB");
}

/// A partition of `size` bytes whose first bytes are `head`, zeros after (a
/// sparse file, without the file).
struct Synthetic {
    head: Vec<u8>,
    size: u64,
}

impl fs::ReadAt for Synthetic {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        if off.saturating_add(buf.len() as u64) > self.size {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        for (i, b) in buf.iter_mut().enumerate() {
            let p = off as usize + i;
            *b = self.head.get(p).copied().unwrap_or(0);
        }
        Ok(())
    }
    fn size(&self) -> u64 {
        self.size
    }
}

/// An ext superblock claiming 2^24 one-block groups of 1 KiB (a 16 GiB
/// sparse partition): a 512 MiB descriptor table; refused on the group
/// count.
#[test]
fn an_ext_superblock_claiming_millions_of_groups_is_refused() {
    let mut head = vec![0u8; 4096];
    let sb = &mut head[1024..2048];
    sb[4..8].copy_from_slice(&(1u32 << 24).to_le_bytes()); // blocks
    sb[20..24].copy_from_slice(&1u32.to_le_bytes()); // first data block
    sb[24..28].copy_from_slice(&0u32.to_le_bytes()); // 1 KiB blocks
    sb[32..36].copy_from_slice(&1u32.to_le_bytes()); // blocks per group
    sb[40..44].copy_from_slice(&8u32.to_le_bytes()); // inodes per group
    sb[56..58].copy_from_slice(&0xEF53u16.to_le_bytes());
    let src = Synthetic {
        head,
        size: (1u64 << 24) * 1024,
    };
    let info = fs::probe(&src);
    assert_eq!(info.fs_type, "ext2");
    let before = status_kib("VmRSS:");
    let err = fs::used_extents(&src, &info).expect_err("2^24 groups were accepted");
    let m = err.to_string();
    assert!(
        m.contains(&format!("{} block groups", (1u64 << 24) - 1))
            && m.contains(&MAX_EXT_GROUPS.to_string()),
        "{m}"
    );
    let grown = status_kib("VmHWM:").saturating_sub(before);
    assert!(grown < RSS_BOUND_KIB, "peak RSS grew by {grown} KiB");
}

/// A FAT32 boot sector claiming 2^28 clusters of 512 bytes (more than
/// FAT32 allows; a 1 GiB FAT): refused on the cluster count.
#[test]
fn a_fat_boot_sector_claiming_too_many_clusters_is_refused() {
    let clusters = 1u64 << 28;
    let fat_sectors = ((clusters + 2) * 4).div_ceil(512);
    let reserved = 32u64;
    let total = reserved + fat_sectors + clusters;
    let mut head = vec![0u8; 4096];
    head[0] = 0xEB;
    head[11..13].copy_from_slice(&512u16.to_le_bytes());
    head[13] = 1;
    head[14..16].copy_from_slice(&(reserved as u16).to_le_bytes());
    head[16] = 1;
    head[32..36].copy_from_slice(&(total as u32).to_le_bytes());
    head[36..40].copy_from_slice(&(fat_sectors as u32).to_le_bytes());
    head[510] = 0x55;
    head[511] = 0xAA;
    let src = Synthetic {
        head,
        size: total * 512,
    };
    let info = fs::probe(&src);
    assert_eq!(info.fs_type, "vfat");
    let before = status_kib("VmRSS:");
    let err = fs::used_extents(&src, &info).expect_err("2^28 clusters were accepted");
    let m = err.to_string();
    assert!(
        m.contains(&format!("{clusters} clusters")) && m.contains(&MAX_FAT_CLUSTERS.to_string()),
        "{m}"
    );
    let grown = status_kib("VmHWM:").saturating_sub(before);
    assert!(grown < RSS_BOUND_KIB, "peak RSS grew by {grown} KiB");
}
