//! Filesystem probing (type, UUID, label) and used-block detection: ext2/3/4
//! from the block-group bitmaps, vfat from the FAT, swap (no content), and a
//! zero-block elision fallback for anything else. The one filesystem probe
//! of anneal: capture uses [`probe`] and [`used_extents`], the agent's
//! inventory [`identify`] (what `blkid -p` reports, xfs, btrfs and ntfs
//! included), both through [`ReadAt`].

use crate::extents::{Extent, ExtentBuilder};
use std::io;

mod identify;
pub use identify::{Identity, ext_kind, identify};

/// Random-access byte source (a partition of a disk image, a buffer).
pub trait ReadAt {
    /// Reads exactly `buf.len()` bytes at `off`.
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    /// Size in bytes.
    fn size(&self) -> u64;
}

impl ReadAt for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let start = usize::try_from(off).map_err(|_| eof())?;
        let end = start.checked_add(buf.len()).ok_or_else(eof)?;
        let src = self.get(start..end).ok_or_else(eof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn size(&self) -> u64 {
        self.len() as u64
    }
}

impl ReadAt for Vec<u8> {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.as_slice().read_exact_at(buf, off)
    }
    fn size(&self) -> u64 {
        self.len() as u64
    }
}

/// A byte range of a file.
#[derive(Debug)]
pub struct FileRegion<'a> {
    /// The file.
    pub file: &'a std::fs::File,
    /// Start offset in the file.
    pub start: u64,
    /// Length.
    pub len: u64,
}

impl<'a> FileRegion<'a> {
    /// The whole of `file`, a regular file or a block device (its length:
    /// where a seek to its end lands).
    pub fn whole(file: &'a std::fs::File) -> io::Result<Self> {
        use std::io::Seek as _;
        let mut f = file;
        let len = f.seek(io::SeekFrom::End(0))?;
        Ok(FileRegion {
            file,
            start: 0,
            len,
        })
    }
}

impl ReadAt for FileRegion<'_> {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let end = off.checked_add(buf.len() as u64).ok_or_else(eof)?;
        if end > self.len {
            return Err(eof());
        }
        self.file.read_exact_at(buf, self.start + off)
    }
    fn size(&self) -> u64 {
        self.len
    }
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end")
}

/// Errors of used-block detection.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// Reading the source failed.
    #[error("reading {what} at {offset}")]
    Read {
        /// what was read
        what: &'static str,
        /// where
        offset: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The superblock or a descriptor is inconsistent.
    #[error("corrupt {fs} metadata: {detail}")]
    Corrupt {
        /// filesystem
        fs: &'static str,
        /// what is wrong
        detail: String,
    },
}

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsInfo {
    /// `ext2`, `ext3`, `ext4`, `vfat`, `swap` or `raw`.
    pub fs_type: String,
    /// UUID bytes (16, 4 for vfat, empty if none).
    pub uuid: Vec<u8>,
    /// Label.
    pub label: String,
    /// Granularity of the used-block map.
    pub block_size: u32,
    /// Whether unused ranges must read as zero after restore.
    pub gaps_zero: bool,
}

/// Block size of the zero-elision fallback.
pub const RAW_BLOCK: u32 = 4096;

/// Most ext block groups accepted: 2^20, a 128 TiB filesystem at 4 KiB
/// blocks (32768 blocks per group; 64 TiB needs 2^19). Bounds the group
/// descriptor table read into memory to 64 MiB (64-byte descriptors).
pub const MAX_EXT_GROUPS: u64 = 1 << 20;
/// Largest ext group descriptor table read (2^20 groups of 64 bytes).
pub const MAX_EXT_GDT_BYTES: u64 = MAX_EXT_GROUPS * 64;
/// Most FAT clusters accepted: FAT32's own maximum (0x0FFFFFF5), a FAT of
/// at most 1 GiB.
pub const MAX_FAT_CLUSTERS: u64 = 0x0FFF_FFF5;
/// Most used extents of one partition: the content format's limit
/// ([`crate::format::MAX_EXTENTS`], 2^26, 1 GiB of extent list).
pub const MAX_EXTENTS: u64 = crate::format::MAX_EXTENTS;

fn too_many_extents(fs: &'static str) -> FsError {
    FsError::Corrupt {
        fs,
        detail: format!(
            "more than {MAX_EXTENTS} used extents (the content format's limit): \
             the metadata is corrupt or hostile"
        ),
    }
}

fn rd(src: &dyn ReadAt, what: &'static str, off: u64, len: usize) -> Result<Vec<u8>, FsError> {
    let mut v = vec![0u8; len];
    src.read_exact_at(&mut v, off)
        .map_err(|source| FsError::Read {
            what,
            offset: off,
            source,
        })?;
    Ok(v)
}

fn u16le(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn u32le(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn text(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).trim_end().to_string()
}

/// Identifies the filesystem on `src`; never fails: unknown content is `raw`.
pub fn probe(src: &dyn ReadAt) -> FsInfo {
    if let Ok(Some(i)) = probe_ext(src) {
        return i;
    }
    if let Ok(Some(i)) = probe_swap(src) {
        return i;
    }
    if let Ok(Some(i)) = probe_vfat(src) {
        return i;
    }
    FsInfo {
        fs_type: "raw".into(),
        uuid: Vec::new(),
        label: String::new(),
        block_size: RAW_BLOCK,
        gaps_zero: true,
    }
}

/// Used extents of `src` according to `info` (as returned by [`probe`]).
pub fn used_extents(src: &dyn ReadAt, info: &FsInfo) -> Result<Vec<Extent>, FsError> {
    match info.fs_type.as_str() {
        "ext2" | "ext3" | "ext4" => ext_used(src),
        "vfat" => vfat_used(src),
        "swap" => Ok(Vec::new()),
        _ => zero_elide(src, u64::from(info.block_size)),
    }
}

// ---------------------------------------------------------------- ext2/3/4

struct ExtSb {
    blocks: u64,
    first_data_block: u64,
    block_size: u64,
    blocks_per_group: u64,
    inodes_per_group: u64,
    inode_size: u64,
    desc_size: usize,
    groups: u64,
    reserved_gdt: u64,
    sparse_super: bool,
    sparse_super2: Option<[u32; 2]>,
    meta_bg: bool,
    uuid: Vec<u8>,
    label: String,
    kind: &'static str,
}

fn ext_corrupt(detail: impl Into<String>) -> FsError {
    FsError::Corrupt {
        fs: "ext",
        detail: detail.into(),
    }
}

fn ext_sb(src: &dyn ReadAt) -> Result<Option<ExtSb>, FsError> {
    if src.size() < 2048 {
        return Ok(None);
    }
    let sb = rd(src, "ext superblock", 1024, 1024)?;
    if u16le(&sb, 56) != 0xEF53 {
        return Ok(None);
    }
    let log = u32le(&sb, 24);
    if log > 6 {
        return Err(ext_corrupt(format!("log block size {log}")));
    }
    let block_size = 1024u64 << log;
    let compat = u32le(&sb, 92);
    let incompat = u32le(&sb, 96);
    let ro_compat = u32le(&sb, 100);
    let is64 = incompat & 0x80 != 0;
    let mut blocks = u64::from(u32le(&sb, 4));
    if is64 {
        blocks |= u64::from(u32le(&sb, 336)) << 32;
    }
    let desc_size = if is64 {
        usize::from(u16le(&sb, 254))
    } else {
        32
    };
    if !(32..=1024).contains(&desc_size) || !desc_size.is_power_of_two() {
        return Err(ext_corrupt(format!("descriptor size {desc_size}")));
    }
    let first_data_block = u64::from(u32le(&sb, 20));
    let blocks_per_group = u64::from(u32le(&sb, 32));
    if blocks_per_group == 0 || blocks_per_group > block_size * 8 {
        return Err(ext_corrupt(format!("blocks per group {blocks_per_group}")));
    }
    if blocks <= first_data_block || first_data_block > 1 {
        return Err(ext_corrupt(format!("block count {blocks}")));
    }
    if blocks
        .checked_mul(block_size)
        .is_none_or(|b| b > src.size())
    {
        return Err(ext_corrupt(format!(
            "{blocks} blocks of {block_size} exceed the partition ({} bytes)",
            src.size()
        )));
    }
    let groups = (blocks - first_data_block).div_ceil(blocks_per_group);
    let kind = ext_kind(compat, incompat, ro_compat);
    let sparse_super2 = if compat & 0x200 != 0 {
        Some([u32le(&sb, 588), u32le(&sb, 592)])
    } else {
        None
    };
    Ok(Some(ExtSb {
        blocks,
        first_data_block,
        block_size,
        blocks_per_group,
        inodes_per_group: u64::from(u32le(&sb, 40)),
        inode_size: u64::from(u16le(&sb, 88)).max(128),
        desc_size,
        groups,
        reserved_gdt: u64::from(u16le(&sb, 206)),
        sparse_super: ro_compat & 0x1 != 0,
        sparse_super2,
        meta_bg: incompat & 0x10 != 0,
        uuid: sb[104..120].to_vec(),
        label: text(&sb[120..136]),
        kind,
    }))
}

fn probe_ext(src: &dyn ReadAt) -> Result<Option<FsInfo>, FsError> {
    Ok(ext_sb(src)?.map(|s| FsInfo {
        fs_type: s.kind.to_string(),
        uuid: s.uuid,
        label: s.label,
        block_size: s.block_size as u32,
        gaps_zero: false,
    }))
}

fn is_power_of(mut n: u64, p: u64) -> bool {
    while n > 1 && n.is_multiple_of(p) {
        n /= p;
    }
    n == 1
}

impl ExtSb {
    fn has_super(&self, g: u64) -> bool {
        if g == 0 {
            return true;
        }
        if let Some(b) = self.sparse_super2 {
            return g == u64::from(b[0]) || g == u64::from(b[1]);
        }
        if !self.sparse_super {
            return true;
        }
        g == 1 || is_power_of(g, 3) || is_power_of(g, 5) || is_power_of(g, 7)
    }
    fn gdt_blocks(&self) -> u64 {
        (self.groups * self.desc_size as u64).div_ceil(self.block_size)
    }
}

fn ext_used(src: &dyn ReadAt) -> Result<Vec<Extent>, FsError> {
    let sb = ext_sb(src)?.ok_or_else(|| ext_corrupt("no superblock"))?;
    let bs = sb.block_size;
    if sb.groups > MAX_EXT_GROUPS {
        return Err(ext_corrupt(format!(
            "superblock claims {} block groups ({} blocks, {} per group), above the limit of \
             {MAX_EXT_GROUPS} (a 128 TiB filesystem at 4 KiB blocks)",
            sb.groups, sb.blocks, sb.blocks_per_group
        )));
    }
    let gdt_len = sb.groups * sb.desc_size as u64;
    if gdt_len > MAX_EXT_GDT_BYTES {
        return Err(ext_corrupt(format!(
            "group descriptor table of {gdt_len} bytes ({} groups of {} bytes), above the \
             limit of {MAX_EXT_GDT_BYTES} bytes",
            sb.groups, sb.desc_size
        )));
    }
    let gdt = rd(
        src,
        "ext group descriptors",
        (sb.first_data_block + 1) * bs,
        gdt_len as usize,
    )?;
    let mut ranges: Vec<(u64, u64)> = Vec::new(); // block ranges [start, end)
    // block 0 (boot area and, with 1 KiB blocks, outside any group)
    ranges.push((0, 1));
    let mut meta: Vec<(u64, u64)> = Vec::new();
    let it_blocks = (sb.inodes_per_group * sb.inode_size).div_ceil(bs);
    let mut descs = Vec::with_capacity(sb.groups as usize);
    for g in 0..sb.groups {
        let d = &gdt[(g as usize) * sb.desc_size..(g as usize + 1) * sb.desc_size];
        let mut bb = u64::from(u32le(d, 0));
        let mut ib = u64::from(u32le(d, 4));
        let mut it = u64::from(u32le(d, 8));
        if sb.desc_size >= 64 {
            bb |= u64::from(u32le(d, 0x20)) << 32;
            ib |= u64::from(u32le(d, 0x24)) << 32;
            it |= u64::from(u32le(d, 0x28)) << 32;
        }
        let flags = u16le(d, 0x12);
        for (what, b, n) in [
            ("block bitmap", bb, 1),
            ("inode bitmap", ib, 1),
            ("inode table", it, it_blocks),
        ] {
            if b == 0 || b.checked_add(n).is_none_or(|e| e > sb.blocks) {
                return Err(ext_corrupt(format!("group {g} {what} at block {b}")));
            }
        }
        meta.push((bb, bb + 1));
        meta.push((ib, ib + 1));
        meta.push((it, it + it_blocks));
        descs.push((bb, flags));
    }
    let mut bitmap = vec![0u8; bs as usize];
    for (g, (bb, flags)) in descs.iter().enumerate() {
        let g = g as u64;
        let start = sb.first_data_block + g * sb.blocks_per_group;
        let count = sb.blocks_per_group.min(sb.blocks - start);
        if flags & 0x2 != 0 {
            // BLOCK_UNINIT: only the group's own superblock copy and
            // descriptors are used; bitmaps and inode tables anywhere are
            // added from `meta` below.
            if sb.meta_bg {
                ranges.push((start, start + count));
            } else if sb.has_super(g) {
                let n = 1 + sb.gdt_blocks() + sb.reserved_gdt;
                ranges.push((start, start + n.min(count)));
            }
            continue;
        }
        src.read_exact_at(&mut bitmap, bb * bs)
            .map_err(|source| FsError::Read {
                what: "ext block bitmap",
                offset: bb * bs,
                source,
            })?;
        let mut run: Option<u64> = None;
        for j in 0..count {
            let used = bitmap[(j / 8) as usize] & (1 << (j % 8)) != 0;
            match (used, run) {
                (true, None) => run = Some(j),
                (false, Some(r)) => {
                    ranges.push((start + r, start + j));
                    run = None;
                }
                _ => {}
            }
        }
        if let Some(r) = run {
            ranges.push((start + r, start + count));
        }
        if ranges.len() as u64 > MAX_EXTENTS {
            return Err(too_many_extents("ext"));
        }
    }
    ranges.extend(meta);
    ranges.sort_unstable();
    let mut b = ExtentBuilder::new();
    for (s, e) in ranges {
        b.push(s * bs, (e - s) * bs);
    }
    Ok(b.finish())
}

// ---------------------------------------------------------------- vfat

struct Fat {
    bps: u64,
    spc: u64,
    data_start: u64, // sectors
    clusters: u64,
    fat_start: u64, // sectors
    fat_bytes: u64,
    bits: u32,
    uuid: Vec<u8>,
    label: String,
}

fn fat_corrupt(detail: impl Into<String>) -> FsError {
    FsError::Corrupt {
        fs: "vfat",
        detail: detail.into(),
    }
}

fn fat_bs(src: &dyn ReadAt) -> Result<Option<Fat>, FsError> {
    if src.size() < 512 {
        return Ok(None);
    }
    let b = rd(src, "fat boot sector", 0, 512)?;
    if b[510] != 0x55 || b[511] != 0xAA || !(b[0] == 0xEB || b[0] == 0xE9) {
        return Ok(None);
    }
    let bps = u64::from(u16le(&b, 11));
    let spc = u64::from(b[13]);
    let reserved = u64::from(u16le(&b, 14));
    let nfats = u64::from(b[16]);
    let root_entries = u64::from(u16le(&b, 17));
    let total16 = u64::from(u16le(&b, 19));
    let fatsz16 = u64::from(u16le(&b, 22));
    let total32 = u64::from(u32le(&b, 32));
    let fatsz32 = u64::from(u32le(&b, 36));
    if !bps.is_power_of_two() || !(512..=4096).contains(&bps) || !spc.is_power_of_two() {
        return Ok(None);
    }
    if reserved == 0 || nfats == 0 {
        return Ok(None);
    }
    let fatsz = if fatsz16 != 0 { fatsz16 } else { fatsz32 };
    let total = if total16 != 0 { total16 } else { total32 };
    let root_sectors = (root_entries * 32).div_ceil(bps);
    let data_start = reserved + nfats * fatsz + root_sectors;
    if fatsz == 0 || total <= data_start {
        return Err(fat_corrupt("sizes"));
    }
    if total * bps > src.size() {
        return Err(fat_corrupt(format!(
            "{total} sectors exceed the partition ({} bytes)",
            src.size()
        )));
    }
    let clusters = (total - data_start) / spc;
    let bits = if clusters < 4085 {
        12
    } else if clusters < 65525 {
        16
    } else {
        32
    };
    let (id_off, label_off) = if bits == 32 { (67, 71) } else { (39, 43) };
    let sig_off = if bits == 32 { 66 } else { 38 };
    let (uuid, label) = if b[sig_off] == 0x29 {
        (
            b[id_off..id_off + 4].to_vec(),
            text(&b[label_off..label_off + 11]),
        )
    } else {
        (Vec::new(), String::new())
    };
    let label = if label == "NO NAME" {
        String::new()
    } else {
        label
    };
    let fat_bytes = ((clusters + 2) * u64::from(bits)).div_ceil(8);
    if fat_bytes > fatsz * bps {
        return Err(fat_corrupt("fat too small for the cluster count"));
    }
    Ok(Some(Fat {
        bps,
        spc,
        data_start,
        clusters,
        fat_start: reserved,
        fat_bytes,
        bits,
        uuid,
        label,
    }))
}

fn probe_vfat(src: &dyn ReadAt) -> Result<Option<FsInfo>, FsError> {
    Ok(fat_bs(src)?.map(|f| FsInfo {
        fs_type: "vfat".into(),
        uuid: f.uuid,
        label: f.label,
        block_size: f.bps as u32,
        gaps_zero: false,
    }))
}

fn vfat_used(src: &dyn ReadAt) -> Result<Vec<Extent>, FsError> {
    let f = fat_bs(src)?.ok_or_else(|| fat_corrupt("no boot sector"))?;
    if f.clusters > MAX_FAT_CLUSTERS {
        return Err(fat_corrupt(format!(
            "boot sector claims {} clusters, above the FAT32 limit of {MAX_FAT_CLUSTERS}",
            f.clusters
        )));
    }
    let fat = rd(src, "fat", f.fat_start * f.bps, f.fat_bytes as usize)?;
    let mut b = ExtentBuilder::new();
    b.push(0, f.data_start * f.bps);
    let cl = f.spc * f.bps;
    for c in 2..f.clusters + 2 {
        let v = match f.bits {
            12 => {
                let o = (c + c / 2) as usize;
                let x = u16le(&fat, o);
                if c % 2 == 0 { x & 0x0fff } else { x >> 4 }.into()
            }
            16 => u32::from(u16le(&fat, (c * 2) as usize)),
            _ => u32le(&fat, (c * 4) as usize) & 0x0fff_ffff,
        };
        if v != 0 {
            b.push(f.data_start * f.bps + (c - 2) * cl, cl);
            if b.len() as u64 > MAX_EXTENTS {
                return Err(too_many_extents("vfat"));
            }
        }
    }
    Ok(b.finish())
}

// ---------------------------------------------------------------- swap

/// Page size of the swap header this crate reads and writes.
pub const SWAP_PAGE: u64 = 4096;

fn probe_swap(src: &dyn ReadAt) -> Result<Option<FsInfo>, FsError> {
    if src.size() < SWAP_PAGE * 2 {
        return Ok(None);
    }
    let p = rd(src, "swap header", 0, SWAP_PAGE as usize)?;
    if &p[4086..4096] != b"SWAPSPACE2" {
        return Ok(None);
    }
    Ok(Some(FsInfo {
        fs_type: "swap".into(),
        uuid: p[1036..1052].to_vec(),
        label: text(&p[1052..1068]),
        block_size: SWAP_PAGE as u32,
        gaps_zero: false,
    }))
}

/// Builds a version-1 swap header page (what `mkswap` writes) for a swap area
/// of `size` bytes.
pub fn swap_header(size: u64, uuid: &[u8], label: &str) -> Vec<u8> {
    let mut p = vec![0u8; SWAP_PAGE as usize];
    let pages = size / SWAP_PAGE;
    let last = u32::try_from(pages.saturating_sub(1)).unwrap_or(u32::MAX);
    p[1024..1028].copy_from_slice(&1u32.to_le_bytes());
    p[1028..1032].copy_from_slice(&last.to_le_bytes());
    let n = uuid.len().min(16);
    p[1036..1036 + n].copy_from_slice(&uuid[..n]);
    let l = label.as_bytes();
    let n = l.len().min(16);
    p[1052..1052 + n].copy_from_slice(&l[..n]);
    p[4086..4096].copy_from_slice(b"SWAPSPACE2");
    p
}

// ---------------------------------------------------------------- raw

/// Extents of the non-zero `block`-sized blocks of `src`.
pub fn zero_elide(src: &dyn ReadAt, block: u64) -> Result<Vec<Extent>, FsError> {
    let size = src.size();
    let chunk = (4u64 << 20).max(block);
    let mut buf = vec![0u8; chunk as usize];
    let mut b = ExtentBuilder::new();
    let mut off = 0u64;
    while off < size {
        let n = chunk.min(size - off) as usize;
        src.read_exact_at(&mut buf[..n], off)
            .map_err(|source| FsError::Read {
                what: "raw data",
                offset: off,
                source,
            })?;
        for (i, blk) in buf[..n].chunks(block as usize).enumerate() {
            if blk.iter().any(|x| *x != 0) {
                b.push(off + i as u64 * block, blk.len() as u64);
            }
        }
        if b.len() as u64 > MAX_EXTENTS {
            return Err(too_many_extents("raw"));
        }
        off += n as u64;
    }
    Ok(b.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_elision_keeps_nonzero_blocks() {
        let mut d = vec![0u8; 64 * 1024 + 100];
        d[5000] = 1;
        d[64 * 1024 + 99] = 2;
        let info = probe(&d);
        assert_eq!(info.fs_type, "raw");
        let e = used_extents(&d, &info).unwrap();
        assert_eq!(
            e,
            vec![
                Extent {
                    offset: 4096,
                    len: 4096
                },
                Extent {
                    offset: 64 * 1024,
                    len: 100
                }
            ]
        );
    }

    #[test]
    fn swap_header_round_trips_through_probe() {
        let mut d = swap_header(1 << 20, &[9; 16], "sw");
        d.resize(1 << 20, 0);
        let info = probe(&d);
        assert_eq!(info.fs_type, "swap");
        assert_eq!(info.uuid, vec![9; 16]);
        assert_eq!(info.label, "sw");
        assert!(used_extents(&d, &info).unwrap().is_empty());
    }

    #[test]
    fn lying_ext_superblock_is_refused() {
        let mut d = vec![0u8; 64 * 1024];
        d[1024 + 56] = 0x53;
        d[1024 + 57] = 0xEF;
        d[1024 + 4..1024 + 8].copy_from_slice(&1_000_000u32.to_le_bytes());
        d[1024 + 32..1024 + 36].copy_from_slice(&8192u32.to_le_bytes());
        assert!(ext_used(&d).is_err());
    }
}
