//! Reader of partclone images, format 0002 (header, bitmap, blocks with
//! checksums), written from the published format description; checked
//! against Debian's partclone 0.3.23.

use crate::extents::{Extent, from_bitmap};
use std::io::{self, Read};

/// Length of the 0002 header.
pub const HEADER_LEN: usize = 110;
/// Magic at offset 0 (NUL-terminated in the file).
pub const MAGIC: &[u8; 15] = b"partclone-image";
/// Checksum mode: none.
pub const CSM_NONE: u16 = 0x00;
/// Checksum mode: CRC32 (partclone's variant: no final inversion).
pub const CSM_CRC32: u16 = 0x20;
/// Bitmap mode: one bit per block.
pub const BM_BIT: u8 = 0x01;
/// Largest accepted block size.
pub const MAX_BLOCK_SIZE: u32 = 1 << 20;
/// Largest accepted bitmap: what a 64 TiB device at 4 KiB blocks needs
/// (2^34 blocks, 2 GiB of bitmap). A header claiming more is refused before
/// any of the bitmap is read, so a small compressed stream cannot make the
/// reader allocate more than this.
pub const MAX_BITMAP_BYTES: u64 = (64 << 40) / 4096 / 8;
/// Largest accepted number of used extents (runs of set bits) of a bitmap:
/// the content format's own limit ([`crate::format::MAX_EXTENTS`], 2^26,
/// 1 GiB of extent list). Counted on the bitmap before the list is built.
pub const MAX_EXTENTS: u64 = crate::format::MAX_EXTENTS;

/// Errors of reading a partclone image.
#[derive(Debug, thiserror::Error)]
pub enum PartcloneError {
    /// Reading failed (truncation included).
    #[error("reading the partclone {what}")]
    Io {
        /// section
        what: &'static str,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Not a partclone image.
    #[error("not a partclone image (bad magic)")]
    BadMagic,
    /// Image format other than 0002.
    #[error("unsupported partclone image version {0:?}")]
    Version(String),
    /// Big-endian or unknown endianness marker.
    #[error("unsupported endianness marker {0:#06x}")]
    Endianness(u16),
    /// Header CRC mismatch.
    #[error("partclone header checksum mismatch")]
    HeaderCrc,
    /// Bitmap CRC mismatch.
    #[error("partclone bitmap checksum mismatch")]
    BitmapCrc,
    /// A header field is out of range or inconsistent.
    #[error("invalid partclone header: {0}")]
    Header(String),
    /// A data checksum mismatch.
    #[error("partclone block checksum mismatch before block {block}")]
    BlockCrc {
        /// index (among used blocks) of the block after the strip
        block: u64,
    },
    /// Data after the last checksum.
    #[error("trailing data after the last partclone block")]
    Trailing,
    /// The image ends before all the used blocks of its bitmap.
    #[error(
        "partclone image ends after {have} of {used} used blocks (truncated: an incomplete \
         copy or a missing split part)"
    )]
    Truncated {
        /// complete used blocks read
        have: u64,
        /// used blocks the bitmap holds
        used: u64,
    },
    /// Caller asked for more blocks than the image holds.
    #[error("read past the last used block")]
    PastEnd,
}

/// The parsed 0002 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// partclone version that wrote the image.
    pub partclone_version: String,
    /// Filesystem name as partclone writes it (`EXTFS`, `FAT`, `raw`, ...).
    pub fs: String,
    /// Device (partition) size in bytes.
    pub device_size: u64,
    /// Total blocks of the filesystem.
    pub total_blocks: u64,
    /// Used blocks according to the superblock.
    pub used_blocks_sb: u64,
    /// Used blocks according to the bitmap.
    pub used_blocks: u64,
    /// Block size.
    pub block_size: u32,
    /// Checksum mode.
    pub checksum_mode: u16,
    /// Checksum size in bytes.
    pub checksum_size: u16,
    /// Blocks per checksum strip.
    pub blocks_per_checksum: u32,
    /// Reseed the checksum after each strip.
    pub reseed: bool,
}

impl Header {
    /// Length of the bitmap in bytes (without its CRC).
    pub fn bitmap_len(&self) -> u64 {
        self.total_blocks.div_ceil(8)
    }
}

/// partclone's CRC32 update: reflected CRC-32 (0xEDB88320) with the state
/// kept un-inverted between calls.
pub fn crc_update(state: u32, data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new_with_initial(!state);
    h.update(data);
    !h.finalize()
}

fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
fn le64(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}
fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// Parses and validates the 110-byte header.
pub fn parse_header(b: &[u8]) -> Result<Header, PartcloneError> {
    if b.len() < HEADER_LEN {
        return Err(PartcloneError::Io {
            what: "header",
            source: io::Error::from(io::ErrorKind::UnexpectedEof),
        });
    }
    if &b[0..15] != MAGIC {
        return Err(PartcloneError::BadMagic);
    }
    let version = &b[30..34];
    if version != b"0002" {
        return Err(PartcloneError::Version(cstr(version)));
    }
    let endian = le16(b, 34);
    if endian != 0xC0DE {
        return Err(PartcloneError::Endianness(endian));
    }
    if crc_update(0xFFFF_FFFF, &b[..106]) != le32(b, 106) {
        return Err(PartcloneError::HeaderCrc);
    }
    let h = Header {
        partclone_version: cstr(&b[16..30]),
        fs: cstr(&b[36..52]),
        device_size: le64(b, 52),
        total_blocks: le64(b, 60),
        used_blocks_sb: le64(b, 68),
        used_blocks: le64(b, 76),
        block_size: le32(b, 84),
        checksum_mode: le16(b, 96),
        checksum_size: le16(b, 98),
        blocks_per_checksum: le32(b, 100),
        reseed: b[104] != 0,
    };
    let bad = |s: String| Err(PartcloneError::Header(s));
    if le16(b, 92) != 2 {
        return bad(format!("binary image version {}", le16(b, 92)));
    }
    if b[105] != BM_BIT {
        return bad(format!("bitmap mode {}", b[105]));
    }
    if !h.block_size.is_power_of_two() || h.block_size < 512 || h.block_size > MAX_BLOCK_SIZE {
        return bad(format!("block size {}", h.block_size));
    }
    let bs = u64::from(h.block_size);
    match h.total_blocks.checked_mul(bs) {
        Some(total) if total >= h.device_size && total - h.device_size < bs => {}
        _ => {
            return bad(format!(
                "{} blocks of {} do not match the device size {}",
                h.total_blocks, h.block_size, h.device_size
            ));
        }
    }
    if h.bitmap_len() > MAX_BITMAP_BYTES {
        return bad(format!(
            "total blocks {} need a {}-byte bitmap, above the limit of {MAX_BITMAP_BYTES} bytes \
             (a 64 TiB device at 4 KiB blocks)",
            h.total_blocks,
            h.bitmap_len()
        ));
    }
    if h.used_blocks > h.total_blocks {
        return bad(format!(
            "{} used blocks of {}",
            h.used_blocks, h.total_blocks
        ));
    }
    match (h.checksum_mode, h.checksum_size) {
        (CSM_NONE, _) => {}
        (CSM_CRC32, 4) if h.blocks_per_checksum > 0 => {}
        (m, s) => {
            return bad(format!(
                "checksum mode {m:#x} size {s} per {} blocks",
                h.blocks_per_checksum
            ));
        }
    }
    Ok(h)
}

/// Checks the bitmap (with its trailing CRC) against the header and returns
/// the used extents (byte offsets, clipped to the device size).
pub fn parse_bitmap(h: &Header, b: &[u8]) -> Result<Vec<Extent>, PartcloneError> {
    let n = usize::try_from(h.bitmap_len()).map_err(|_| PartcloneError::Header("bitmap".into()))?;
    if b.len() != n + 4 {
        return Err(PartcloneError::Io {
            what: "bitmap",
            source: io::Error::from(io::ErrorKind::UnexpectedEof),
        });
    }
    let bitmap = &b[..n];
    if crc_update(0xFFFF_FFFF, bitmap) != le32(b, n) {
        return Err(PartcloneError::BitmapCrc);
    }
    // bits past the last block must be clear
    let tail = h.total_blocks % 8;
    if tail != 0 && n > 0 && bitmap[n - 1] >> tail != 0 {
        return Err(PartcloneError::Header(
            "bitmap bits past the last block".into(),
        ));
    }
    let count: u64 = bitmap.iter().map(|x| u64::from(x.count_ones())).sum();
    if count != h.used_blocks {
        return Err(PartcloneError::Header(format!(
            "bitmap holds {count} blocks, header says {}",
            h.used_blocks
        )));
    }
    let runs = count_runs(bitmap);
    if runs > MAX_EXTENTS {
        return Err(PartcloneError::Header(format!(
            "bitmap holds {runs} used extents, above the limit of {MAX_EXTENTS}"
        )));
    }
    Ok(from_bitmap(
        bitmap,
        h.total_blocks,
        u64::from(h.block_size),
        h.device_size,
    ))
}

/// Number of runs of set bits (extents before clipping) of a bitmap, least
/// significant bit first.
pub fn count_runs(bitmap: &[u8]) -> u64 {
    let mut prev_top = 0u8;
    let mut runs = 0u64;
    for &x in bitmap {
        // a run starts at every set bit whose lower neighbour is clear
        runs += u64::from((x & !((x << 1) | prev_top)).count_ones());
        prev_top = x >> 7;
    }
    runs
}

/// Streaming reader of a partclone image: header and bitmap on open, then
/// the used blocks in order with their checksums verified.
#[derive(Debug)]
pub struct Reader<R> {
    inner: R,
    header: Header,
    extents: Vec<Extent>,
    blocks_read: u64,
    strip_blocks: u32,
    crc: u32,
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> PartcloneError {
    move |source| PartcloneError::Io { what, source }
}

impl<R: Read> Reader<R> {
    /// Fills `buf` from the image; an end of file reports how many used
    /// blocks were complete (`partial` blocks of `buf` filled count too).
    fn read_data(&mut self, buf: &mut [u8], what: &'static str) -> Result<(), PartcloneError> {
        let mut n = 0usize;
        while n < buf.len() {
            match self.inner.read(&mut buf[n..]) {
                Ok(0) => {
                    let bs = self.header.block_size as usize;
                    let partial = if what == "blocks" { n / bs } else { 0 };
                    return Err(PartcloneError::Truncated {
                        have: self.blocks_read + partial as u64,
                        used: self.header.used_blocks,
                    });
                }
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(what)(e)),
            }
        }
        Ok(())
    }

    /// Reads and validates header and bitmap.
    pub fn open(mut inner: R) -> Result<Self, PartcloneError> {
        let mut hb = [0u8; HEADER_LEN];
        inner.read_exact(&mut hb).map_err(io_err("header"))?;
        let header = parse_header(&hb)?;
        let n = header.bitmap_len() as usize + 4;
        let mut bm = Vec::new();
        (&mut inner)
            .take(n as u64)
            .read_to_end(&mut bm)
            .map_err(io_err("bitmap"))?;
        let extents = parse_bitmap(&header, &bm)?;
        Ok(Reader {
            inner,
            header,
            extents,
            blocks_read: 0,
            strip_blocks: 0,
            crc: 0xFFFF_FFFF,
        })
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Used extents (byte offsets on the device).
    pub fn extents(&self) -> &[Extent] {
        &self.extents
    }

    /// Total bytes of used data (blocks, the last one possibly clipped to
    /// the device size, counted whole).
    pub fn data_bytes(&self) -> u64 {
        self.header.used_blocks * u64::from(self.header.block_size)
    }

    /// Reads the next `buf.len() / block_size` used blocks into `buf`,
    /// verifying checksums.
    pub fn read_blocks(&mut self, buf: &mut [u8]) -> Result<(), PartcloneError> {
        let bs = self.header.block_size as usize;
        let nblocks = (buf.len() / bs) as u64;
        if !buf.len().is_multiple_of(bs) || self.blocks_read + nblocks > self.header.used_blocks {
            return Err(PartcloneError::PastEnd);
        }
        if self.header.checksum_mode == CSM_NONE {
            self.read_data(buf, "blocks")?;
            self.blocks_read += nblocks;
            return Ok(());
        }
        let per = self.header.blocks_per_checksum;
        let mut pos = 0usize;
        while pos < buf.len() {
            let room = (per - self.strip_blocks) as usize;
            let take = room.min((buf.len() - pos) / bs);
            self.read_data(&mut buf[pos..pos + take * bs], "blocks")?;
            let chunk = &buf[pos..pos + take * bs];
            self.crc = crc_update(self.crc, chunk);
            self.strip_blocks += take as u32;
            self.blocks_read += take as u64;
            pos += take * bs;
            if self.strip_blocks == per {
                self.check_strip()?;
            }
        }
        Ok(())
    }

    fn check_strip(&mut self) -> Result<(), PartcloneError> {
        let mut c = [0u8; 4];
        self.read_data(&mut c, "checksum")?;
        if u32::from_le_bytes(c) != self.crc {
            return Err(PartcloneError::BlockCrc {
                block: self.blocks_read,
            });
        }
        self.strip_blocks = 0;
        if self.header.reseed {
            self.crc = 0xFFFF_FFFF;
        }
        Ok(())
    }

    /// After all used blocks: verifies the last partial strip's checksum and
    /// that nothing follows.
    pub fn finish(mut self) -> Result<(), PartcloneError> {
        if self.blocks_read != self.header.used_blocks {
            return Err(PartcloneError::PastEnd);
        }
        if self.header.checksum_mode != CSM_NONE && self.strip_blocks > 0 {
            self.check_strip()?;
        }
        let mut one = [0u8; 1];
        loop {
            match self.inner.read(&mut one) {
                Ok(0) => return Ok(()),
                Ok(_) => return Err(PartcloneError::Trailing),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err("trailer")(e)),
            }
        }
    }
}

/// Reads a whole in-memory image (header, bitmap, all blocks) and returns the
/// header, extents and the concatenated used data; for tests and fuzzing.
pub fn read_all(b: &[u8]) -> Result<(Header, Vec<Extent>, Vec<u8>), PartcloneError> {
    let mut r = Reader::open(b)?;
    let h = r.header().clone();
    let ext = r.extents().to_vec();
    let mut data = Vec::new();
    let bs = h.block_size as usize;
    let per = (1usize << 20).div_ceil(bs).max(1);
    let mut chunk = vec![0u8; bs * per];
    let mut left = h.used_blocks;
    while left > 0 {
        let n = left.min(per as u64) as usize;
        r.read_blocks(&mut chunk[..n * bs])?;
        data.extend_from_slice(&chunk[..n * bs]);
        left -= n as u64;
    }
    r.finish()?;
    Ok((h, ext, data))
}

/// Builds a 0002 image in memory (for tests, fuzz seeds and golden vectors).
pub fn build(
    fs: &str,
    block_size: u32,
    bitmap_blocks: &[bool],
    data: &[u8],
    blocks_per_checksum: u32,
) -> Vec<u8> {
    let mut h = vec![0u8; HEADER_LEN];
    h[..15].copy_from_slice(MAGIC);
    h[16..22].copy_from_slice(b"0.3.23");
    h[30..34].copy_from_slice(b"0002");
    h[34..36].copy_from_slice(&0xC0DEu16.to_le_bytes());
    let f = fs.as_bytes();
    h[36..36 + f.len().min(15)].copy_from_slice(&f[..f.len().min(15)]);
    let total = bitmap_blocks.len() as u64;
    let used = bitmap_blocks.iter().filter(|x| **x).count() as u64;
    h[52..60].copy_from_slice(&(total * u64::from(block_size)).to_le_bytes());
    h[60..68].copy_from_slice(&total.to_le_bytes());
    h[68..76].copy_from_slice(&used.to_le_bytes());
    h[76..84].copy_from_slice(&used.to_le_bytes());
    h[84..88].copy_from_slice(&block_size.to_le_bytes());
    h[88..92].copy_from_slice(&18u32.to_le_bytes());
    h[92..94].copy_from_slice(&2u16.to_le_bytes());
    h[94..96].copy_from_slice(&64u16.to_le_bytes());
    let (mode, size) = if blocks_per_checksum > 0 {
        (CSM_CRC32, 4u16)
    } else {
        (CSM_NONE, 0)
    };
    h[96..98].copy_from_slice(&mode.to_le_bytes());
    h[98..100].copy_from_slice(&size.to_le_bytes());
    h[100..104].copy_from_slice(&blocks_per_checksum.to_le_bytes());
    h[104] = 1;
    h[105] = BM_BIT;
    let c = crc_update(0xFFFF_FFFF, &h[..106]);
    h[106..110].copy_from_slice(&c.to_le_bytes());
    let mut bm = vec![0u8; total.div_ceil(8) as usize];
    for (i, b) in bitmap_blocks.iter().enumerate() {
        if *b {
            bm[i / 8] |= 1 << (i % 8);
        }
    }
    let c = crc_update(0xFFFF_FFFF, &bm);
    h.extend_from_slice(&bm);
    h.extend_from_slice(&c.to_le_bytes());
    let bs = block_size as usize;
    if blocks_per_checksum == 0 {
        h.extend_from_slice(data);
        return h;
    }
    for strip in data.chunks(bs * blocks_per_checksum as usize) {
        h.extend_from_slice(strip);
        h.extend_from_slice(&crc_update(0xFFFF_FFFF, strip).to_le_bytes());
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Vec<bool>, Vec<u8>) {
        let bitmap: Vec<bool> = (0..21).map(|i| i % 3 != 1).collect();
        let used = bitmap.iter().filter(|x| **x).count();
        let data: Vec<u8> = (0..used * 512).map(|i| (i * 7 % 251) as u8).collect();
        (bitmap, data)
    }

    #[test]
    fn build_read_round_trip() {
        let (bm, data) = sample();
        for per in [0u32, 1, 4, 100] {
            let img = build("EXTFS", 512, &bm, &data, per);
            let (h, ext, got) = read_all(&img).unwrap();
            assert_eq!(h.used_blocks, 14);
            assert_eq!(got, data);
            assert_eq!(
                ext[0],
                Extent {
                    offset: 0,
                    len: 512
                }
            );
            assert_eq!(
                ext[1],
                Extent {
                    offset: 1024,
                    len: 1024
                }
            );
        }
    }

    #[test]
    fn corrupt_images_are_refused() {
        let (bm, data) = sample();
        let img = build("EXTFS", 512, &bm, &data, 4);
        // truncation anywhere
        for cut in [0usize, 50, 109, 112, img.len() - 600, img.len() - 1] {
            assert!(read_all(&img[..cut]).is_err(), "cut at {cut} accepted");
        }
        // a flipped bit anywhere
        for pos in [3usize, 40, 60, 80, 100, 111, 114, 200, img.len() - 2] {
            let mut c = img.clone();
            c[pos] ^= 0x10;
            assert!(read_all(&c).is_err(), "flip at {pos} accepted");
        }
        let mut longer = img.clone();
        longer.push(0);
        assert!(matches!(read_all(&longer), Err(PartcloneError::Trailing)));
    }

    #[test]
    fn lying_used_count_is_refused() {
        let (bm, data) = sample();
        let mut img = build("EXTFS", 512, &bm, &data, 0);
        img[76..84].copy_from_slice(&13u64.to_le_bytes());
        let c = crc_update(0xFFFF_FFFF, &img[..106]);
        img[106..110].copy_from_slice(&c.to_le_bytes());
        assert!(matches!(read_all(&img), Err(PartcloneError::Header(_))));
    }

    #[test]
    fn count_runs_matches_the_extent_list() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for len in [0usize, 1, 2, 7, 64, 333] {
            let bm: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let blocks = len as u64 * 8;
            let ext = from_bitmap(&bm, blocks, 512, blocks * 512);
            assert_eq!(count_runs(&bm), ext.len() as u64, "{bm:?}");
        }
        assert_eq!(count_runs(&[0xff, 0xff, 0x01, 0x80, 0x01]), 2);
    }

    #[test]
    fn a_truncated_image_says_how_many_blocks_it_holds() {
        let bm = vec![true; 5000];
        let data: Vec<u8> = (0..5000 * 512).map(|i| (i * 13 % 251) as u8).collect();
        for per in [0u32, 64] {
            let img = build("EXTFS", 512, &bm, &data, per);
            let start = HEADER_LEN + 5000 / 8 + 4;
            // 1200 blocks (with checksums: the 18 whole strips' checksums
            // among them) and a part of the next block
            let sums = if per == 0 { 0 } else { (1200 / 64) * 4 };
            let cut = start + 1200 * 512 + sums + 100;
            let err = read_all(&img[..cut]).unwrap_err();
            assert_eq!(
                err.to_string().split(" (").next().unwrap(),
                "partclone image ends after 1200 of 5000 used blocks",
                "per {per}"
            );
        }
        // all blocks there, the last strip's checksum missing
        let img = build("EXTFS", 512, &bm, &data, 64);
        let err = read_all(&img[..img.len() - 2]).unwrap_err();
        assert!(matches!(
            err,
            PartcloneError::Truncated {
                have: 5000,
                used: 5000
            }
        ));
    }
}
