//! The content index: header, extent list and piece hashes of one partition's
//! content stream (byte layout in docs/content-format.md). Pure: `parse` and
//! `build` do no I/O.

use crate::extents::{Extent, ExtentError, validate_extents};
use sha2::Digest as _;

/// Version of the content format (index layout, stream definition, piece
/// hashing). Bumped on any incompatible change.
pub const CONTRACT_VERSION: u32 = 1;
/// Magic at offset 0 of a content index.
pub const MAGIC: &[u8; 8] = b"ANNLCONT";
/// Length of the fixed header.
pub const HEADER_LEN: usize = 256;
/// Default piece length (1 MiB). The pieces are the swarm's pieces
/// (docs/distribution.md): a piece is passed on only once whole, so a rack
/// deploying at once waits a piece's time at each hop. 16 hosts on 100
/// Mbit/s links took 37-41 s for 256 MiB in 4 MiB pieces and 32-38 s in 1
/// MiB pieces (swarm-bench, docs/bench/distribution.md); 256 and 512 KiB
/// were no faster. A 64 GiB partition is 65536 pieces (1.25 MiB of hashes).
pub const DEFAULT_PIECE_LENGTH: u32 = 1 << 20;
/// Smallest accepted piece length (BitTorrent clients expect >= 16 KiB).
pub const MIN_PIECE_LENGTH: u32 = 16 << 10;
/// Largest accepted piece length.
pub const MAX_PIECE_LENGTH: u32 = 64 << 20;
/// Smallest accepted block size.
pub const MIN_BLOCK_SIZE: u32 = 512;
/// Largest accepted block size.
pub const MAX_BLOCK_SIZE: u32 = 1 << 20;
/// Most extents an index may hold (bounds allocation on parse).
pub const MAX_EXTENTS: u64 = 1 << 26;
/// Length of a piece hash (SHA-1, as in BitTorrent v1).
pub const PIECE_HASH_LEN: usize = 20;
/// Flag: ranges outside the extents must read as zero on the target.
pub const FLAG_GAPS_ZERO: u8 = 0x01;

/// Errors of parsing or validating a content index.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Shorter than the fixed header or than its counts require.
    #[error("content index truncated: {have} bytes, need {need}")]
    Truncated {
        /// bytes present
        have: usize,
        /// bytes required
        need: u64,
    },
    /// Trailing bytes after the digest.
    #[error("content index has {0} trailing bytes")]
    Trailing(u64),
    /// Wrong magic.
    #[error("not a content index (bad magic)")]
    BadMagic,
    /// Unknown format version.
    #[error("unsupported content format version {0}")]
    Version(u32),
    /// Header length field is not the one of this version.
    #[error("bad header length {0}")]
    HeaderLen(u32),
    /// A field value out of its range.
    #[error("invalid {field}: {value}")]
    Field {
        /// field name
        field: &'static str,
        /// offending value
        value: u64,
    },
    /// Extent list rejected.
    #[error("invalid extent list")]
    Extents(#[source] ExtentError),
    /// The SHA-256 trailer does not match.
    #[error("content index digest mismatch")]
    Digest,
    /// Reserved bytes are not zero.
    #[error("reserved header bytes are not zero")]
    Reserved,
    /// fs type or label is not valid UTF-8/ASCII.
    #[error("invalid text field {0}")]
    Text(&'static str),
}

/// Header of a content index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Filesystem block size (granularity of the extents).
    pub block_size: u32,
    /// Piece length of the stream (power of two).
    pub piece_length: u32,
    /// Size of the partition the content came from.
    pub partition_size: u64,
    /// Bytes in the content stream (sum of extent lengths).
    pub used_bytes: u64,
    /// End of the last extent (0 when there is none).
    pub last_extent_end: u64,
    /// Filesystem type: `ext4`, `vfat`, `swap`, `raw`, ...
    pub fs_type: String,
    /// Flags (`FLAG_GAPS_ZERO`).
    pub flags: u8,
    /// Filesystem UUID as raw bytes (16 for ext/swap, 4 for vfat, 0 unknown).
    pub uuid: Vec<u8>,
    /// Filesystem label.
    pub label: String,
    /// SHA-256 of the content stream.
    pub stream_sha256: [u8; 32],
}

/// A parsed, validated content index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContentIndex {
    /// The header.
    pub header: Header,
    /// Sorted, non-overlapping used extents (disk offsets relative to the
    /// partition start).
    pub extents: Vec<Extent>,
    /// SHA-1 of each piece of the stream.
    pub piece_hashes: Vec<[u8; PIECE_HASH_LEN]>,
}

/// One contiguous range of a piece: `len` bytes at `stream_offset` of the
/// stream go to `disk_offset` (relative to the partition start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceRange {
    /// Offset on the partition.
    pub disk_offset: u64,
    /// Offset in the content stream.
    pub stream_offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Number of pieces for a stream of `used` bytes.
pub fn piece_count(used: u64, piece_length: u32) -> u64 {
    used.div_ceil(u64::from(piece_length))
}

fn check_pow2(field: &'static str, v: u32, min: u32, max: u32) -> Result<(), FormatError> {
    if !v.is_power_of_two() || v < min || v > max {
        return Err(FormatError::Field {
            field,
            value: u64::from(v),
        });
    }
    Ok(())
}

impl Header {
    /// Checks the header's own fields (not the extents).
    pub fn validate(&self) -> Result<(), FormatError> {
        check_pow2(
            "block size",
            self.block_size,
            MIN_BLOCK_SIZE,
            MAX_BLOCK_SIZE,
        )?;
        check_pow2(
            "piece length",
            self.piece_length,
            MIN_PIECE_LENGTH,
            MAX_PIECE_LENGTH,
        )?;
        if self.used_bytes > self.partition_size {
            return Err(FormatError::Field {
                field: "used bytes",
                value: self.used_bytes,
            });
        }
        if self.last_extent_end > self.partition_size {
            return Err(FormatError::Field {
                field: "last extent end",
                value: self.last_extent_end,
            });
        }
        if self.fs_type.len() > 16 || !self.fs_type.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(FormatError::Text("fs type"));
        }
        if self.uuid.len() > 16 {
            return Err(FormatError::Field {
                field: "uuid length",
                value: self.uuid.len() as u64,
            });
        }
        if self.label.len() > 64 || self.label.contains('\0') {
            return Err(FormatError::Text("label"));
        }
        if self.flags & !FLAG_GAPS_ZERO != 0 {
            return Err(FormatError::Field {
                field: "flags",
                value: u64::from(self.flags),
            });
        }
        Ok(())
    }

    /// UUID in the form `blkid` prints it.
    pub fn uuid_string(&self) -> String {
        uuid_string(&self.uuid)
    }
}

/// Formats a filesystem UUID the way `blkid` does: 16 bytes as
/// 8-4-4-4-12 lowercase hex, 4 bytes (FAT serial, stored little-endian) as
/// `XXXX-XXXX`.
pub fn uuid_string(u: &[u8]) -> String {
    match u.len() {
        16 => {
            let h = hex::encode(u);
            format!(
                "{}-{}-{}-{}-{}",
                &h[0..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..32]
            )
        }
        4 => format!("{:02X}{:02X}-{:02X}{:02X}", u[3], u[2], u[1], u[0]),
        _ => hex::encode(u),
    }
}

/// Parses a UUID string produced by [`uuid_string`] back to bytes.
pub fn parse_uuid_string(s: &str) -> Option<Vec<u8>> {
    let h: String = s.chars().filter(|c| *c != '-').collect();
    let b = hex::decode(h).ok()?;
    match b.len() {
        16 => Some(b),
        4 => Some(vec![b[3], b[2], b[1], b[0]]),
        _ => None,
    }
}

impl ContentIndex {
    /// Validates header, extents and counts together.
    pub fn validate(&self) -> Result<(), FormatError> {
        let h = &self.header;
        h.validate()?;
        validate_extents(&self.extents, u64::from(h.block_size), h.partition_size)
            .map_err(FormatError::Extents)?;
        let used: u64 = self.extents.iter().map(|e| e.len).sum();
        if used != h.used_bytes {
            return Err(FormatError::Field {
                field: "used bytes",
                value: h.used_bytes,
            });
        }
        let last = self.extents.last().map_or(0, Extent::end);
        if last != h.last_extent_end {
            return Err(FormatError::Field {
                field: "last extent end",
                value: h.last_extent_end,
            });
        }
        if self.piece_hashes.len() as u64 != piece_count(used, h.piece_length) {
            return Err(FormatError::Field {
                field: "piece count",
                value: self.piece_hashes.len() as u64,
            });
        }
        Ok(())
    }

    /// Serialises the index (validating it first).
    pub fn build(&self) -> Result<Vec<u8>, FormatError> {
        self.validate()?;
        let h = &self.header;
        let mut out = Vec::with_capacity(
            HEADER_LEN + self.extents.len() * 16 + self.piece_hashes.len() * PIECE_HASH_LEN + 32,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&CONTRACT_VERSION.to_le_bytes());
        out.extend_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        out.extend_from_slice(&h.block_size.to_le_bytes());
        out.extend_from_slice(&h.piece_length.to_le_bytes());
        out.extend_from_slice(&h.partition_size.to_le_bytes());
        out.extend_from_slice(&h.used_bytes.to_le_bytes());
        out.extend_from_slice(&h.last_extent_end.to_le_bytes());
        out.extend_from_slice(&(self.extents.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.piece_hashes.len() as u64).to_le_bytes());
        let mut fs = [0u8; 16];
        fs[..h.fs_type.len()].copy_from_slice(h.fs_type.as_bytes());
        out.extend_from_slice(&fs);
        out.push(h.flags);
        out.push(h.uuid.len() as u8);
        let mut uuid = [0u8; 16];
        uuid[..h.uuid.len()].copy_from_slice(&h.uuid);
        out.extend_from_slice(&uuid);
        out.extend_from_slice(&[0u8; 2]);
        let mut label = [0u8; 64];
        label[..h.label.len()].copy_from_slice(h.label.as_bytes());
        out.extend_from_slice(&label);
        out.extend_from_slice(&h.stream_sha256);
        out.resize(HEADER_LEN, 0);
        for e in &self.extents {
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
        }
        for p in &self.piece_hashes {
            out.extend_from_slice(p);
        }
        let digest = sha2::Sha256::digest(&out);
        out.extend_from_slice(&digest);
        Ok(out)
    }

    /// Parses and validates a serialised index.
    pub fn parse(b: &[u8]) -> Result<Self, FormatError> {
        if b.len() < HEADER_LEN {
            return Err(FormatError::Truncated {
                have: b.len(),
                need: HEADER_LEN as u64,
            });
        }
        if &b[0..8] != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = le32(b, 8);
        if version != CONTRACT_VERSION {
            return Err(FormatError::Version(version));
        }
        let hlen = le32(b, 12);
        if hlen as usize != HEADER_LEN {
            return Err(FormatError::HeaderLen(hlen));
        }
        let extent_count = le64(b, 48);
        let piece_count_field = le64(b, 56);
        if extent_count > MAX_EXTENTS {
            return Err(FormatError::Field {
                field: "extent count",
                value: extent_count,
            });
        }
        // piece hashes are bounded by the partition size / min piece length
        let max_pieces = (u64::MAX / 2) / (PIECE_HASH_LEN as u64);
        if piece_count_field > max_pieces {
            return Err(FormatError::Field {
                field: "piece count",
                value: piece_count_field,
            });
        }
        let need =
            HEADER_LEN as u64 + extent_count * 16 + piece_count_field * PIECE_HASH_LEN as u64 + 32;
        if (b.len() as u64) < need {
            return Err(FormatError::Truncated {
                have: b.len(),
                need,
            });
        }
        if b.len() as u64 > need {
            return Err(FormatError::Trailing(b.len() as u64 - need));
        }
        let body = need as usize - 32;
        let digest = sha2::Sha256::digest(&b[..body]);
        if digest.as_slice() != &b[body..] {
            return Err(FormatError::Digest);
        }
        let fs_raw = &b[64..80];
        let fs_len = fs_raw.iter().position(|c| *c == 0).unwrap_or(16);
        if fs_raw[fs_len..].iter().any(|c| *c != 0) {
            return Err(FormatError::Text("fs type"));
        }
        let fs_type = std::str::from_utf8(&fs_raw[..fs_len])
            .map_err(|_| FormatError::Text("fs type"))?
            .to_owned();
        let flags = b[80];
        let uuid_len = b[81] as usize;
        if uuid_len > 16 {
            return Err(FormatError::Field {
                field: "uuid length",
                value: uuid_len as u64,
            });
        }
        if b[82 + uuid_len..98].iter().any(|c| *c != 0) || b[98..100].iter().any(|c| *c != 0) {
            return Err(FormatError::Reserved);
        }
        let uuid = b[82..82 + uuid_len].to_vec();
        let label_raw = &b[100..164];
        let label_len = label_raw.iter().position(|c| *c == 0).unwrap_or(64);
        if label_raw[label_len..].iter().any(|c| *c != 0) {
            return Err(FormatError::Text("label"));
        }
        let label = std::str::from_utf8(&label_raw[..label_len])
            .map_err(|_| FormatError::Text("label"))?
            .to_owned();
        let mut stream_sha256 = [0u8; 32];
        stream_sha256.copy_from_slice(&b[164..196]);
        if b[196..HEADER_LEN].iter().any(|c| *c != 0) {
            return Err(FormatError::Reserved);
        }
        let header = Header {
            block_size: le32(b, 16),
            piece_length: le32(b, 20),
            partition_size: le64(b, 24),
            used_bytes: le64(b, 32),
            last_extent_end: le64(b, 40),
            fs_type,
            flags,
            uuid,
            label,
            stream_sha256,
        };
        let mut pos = HEADER_LEN;
        let mut extents = Vec::with_capacity(extent_count as usize);
        for _ in 0..extent_count {
            extents.push(Extent {
                offset: le64(b, pos),
                len: le64(b, pos + 8),
            });
            pos += 16;
        }
        let mut piece_hashes = Vec::with_capacity(piece_count_field as usize);
        for _ in 0..piece_count_field {
            let mut h = [0u8; PIECE_HASH_LEN];
            h.copy_from_slice(&b[pos..pos + PIECE_HASH_LEN]);
            piece_hashes.push(h);
            pos += PIECE_HASH_LEN;
        }
        let idx = ContentIndex {
            header,
            extents,
            piece_hashes,
        };
        idx.validate()?;
        Ok(idx)
    }

    /// Number of pieces.
    pub fn piece_count(&self) -> u64 {
        self.piece_hashes.len() as u64
    }

    /// Stream length of piece `i` (the last one may be short).
    pub fn piece_len(&self, i: u64) -> u64 {
        let pl = u64::from(self.header.piece_length);
        let start = i.saturating_mul(pl);
        self.header.used_bytes.saturating_sub(start).min(pl)
    }

    /// The disk ranges piece `i` covers, in stream order.
    pub fn piece_ranges(&self, i: u64) -> Vec<PieceRange> {
        let pl = u64::from(self.header.piece_length);
        let start = i.saturating_mul(pl);
        let end = start.saturating_add(self.piece_len(i));
        ranges_for(&self.extents, start, end)
    }

    /// The mapping of every piece to its disk ranges.
    pub fn piece_map(&self) -> Vec<Vec<PieceRange>> {
        let map = StreamMap::new(&self.extents);
        let pl = u64::from(self.header.piece_length);
        (0..self.piece_count())
            .map(|i| {
                let start = i * pl;
                map.ranges(start, start + self.piece_len(i))
            })
            .collect()
    }

    /// A JSON summary (the PartitionContent spec fields and status hashes).
    pub fn summary_json(&self, name: &str) -> String {
        let h = &self.header;
        let v = serde_json::json!({
            "name": name,
            "contractVersion": CONTRACT_VERSION,
            "fsType": h.fs_type,
            "uuid": h.uuid_string(),
            "label": h.label,
            "blockSize": h.block_size,
            "pieceLength": h.piece_length,
            "sizeBytes": h.partition_size,
            "usedBytes": h.used_bytes,
            "lastExtentEnd": h.last_extent_end,
            "extents": self.extents.len(),
            "pieces": self.piece_count(),
            "sha256": self.stream_sha256_hex(),
        });
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// Hex SHA-256 of the stream.
    pub fn stream_sha256_hex(&self) -> String {
        hex::encode(self.header.stream_sha256)
    }
}

/// Replaces the last 32 bytes of `index` with the SHA-256 of the bytes
/// before them (for tools and fuzzing that edit an index); shorter input is
/// returned unchanged.
pub fn reseal(mut index: Vec<u8>) -> Vec<u8> {
    if index.len() >= 32 {
        let n = index.len() - 32;
        let d = sha2::Sha256::digest(&index[..n]);
        index[n..].copy_from_slice(&d);
    }
    index
}

/// Maps stream intervals to disk ranges over a sorted extent list in
/// O(log n) per lookup.
#[derive(Debug, Clone)]
pub struct StreamMap<'a> {
    extents: &'a [Extent],
    starts: Vec<u64>,
}

impl<'a> StreamMap<'a> {
    /// Builds the prefix sums of `extents`.
    pub fn new(extents: &'a [Extent]) -> Self {
        StreamMap {
            extents,
            starts: extent_starts(extents),
        }
    }

    /// Disk ranges for the stream interval `[start, end)`.
    pub fn ranges(&self, start: u64, end: u64) -> Vec<PieceRange> {
        ranges_in(self.extents, &self.starts, start, end)
    }
}

/// The stream offset of each extent (prefix sums of their lengths), for
/// [`ranges_in`]: what a [`StreamMap`] keeps, for an owner of the extents.
pub fn extent_starts(extents: &[Extent]) -> Vec<u64> {
    let mut starts = Vec::with_capacity(extents.len());
    let mut s = 0u64;
    for e in extents {
        starts.push(s);
        s = s.saturating_add(e.len);
    }
    starts
}

/// Disk ranges for the stream interval `[start, end)` over `extents`,
/// whose stream offsets are `starts` ([`extent_starts`]), in O(log n).
pub fn ranges_in(extents: &[Extent], starts: &[u64], start: u64, end: u64) -> Vec<PieceRange> {
    let mut out = Vec::new();
    if start >= end {
        return out;
    }
    // first extent whose stream range ends after `start`
    let first = starts.partition_point(|s| *s <= start).saturating_sub(1);
    let extents = extents.get(first..).unwrap_or_default();
    let starts = starts.get(first..).unwrap_or_default();
    for (e, s0) in extents.iter().zip(starts) {
        let s0 = *s0;
        let s1 = s0 + e.len;
        if s1 <= start {
            continue;
        }
        if s0 >= end {
            break;
        }
        let a = start.max(s0);
        let b = end.min(s1);
        out.push(PieceRange {
            disk_offset: e.offset + (a - s0),
            stream_offset: a,
            len: b - a,
        });
    }
    out
}

/// Disk ranges for the stream interval `[start, end)` over `extents`.
pub fn ranges_for(extents: &[Extent], start: u64, end: u64) -> Vec<PieceRange> {
    StreamMap::new(extents).ranges(start, end)
}

fn le32(b: &[u8], o: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[o..o + 4]);
    u32::from_le_bytes(a)
}

fn le64(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ContentIndex {
        let extents = vec![
            Extent {
                offset: 0,
                len: 20 << 10,
            },
            Extent {
                offset: 64 << 10,
                len: 16 << 10,
            },
        ];
        ContentIndex {
            header: Header {
                block_size: 4096,
                piece_length: 16 << 10,
                partition_size: 1 << 20,
                used_bytes: 36 << 10,
                last_extent_end: 80 << 10,
                fs_type: "ext4".into(),
                flags: 0,
                uuid: vec![7; 16],
                label: "root".into(),
                stream_sha256: [1; 32],
            },
            extents,
            piece_hashes: vec![[2; 20], [3; 20], [4; 20]],
        }
    }

    #[test]
    fn round_trip() {
        let idx = sample();
        let b = idx.build().unwrap();
        assert_eq!(b.len(), 256 + 32 + 60 + 32);
        assert_eq!(ContentIndex::parse(&b).unwrap(), idx);
    }

    #[test]
    fn piece_mapping_splits_extents() {
        let idx = sample();
        assert_eq!(
            idx.piece_ranges(0),
            vec![PieceRange {
                disk_offset: 0,
                stream_offset: 0,
                len: 16 << 10
            }]
        );
        assert_eq!(
            idx.piece_ranges(1),
            vec![
                PieceRange {
                    disk_offset: 16 << 10,
                    stream_offset: 16 << 10,
                    len: 4 << 10
                },
                PieceRange {
                    disk_offset: 64 << 10,
                    stream_offset: 20 << 10,
                    len: 12 << 10
                }
            ]
        );
        assert_eq!(idx.piece_len(2), 4 << 10);
        assert_eq!(idx.piece_ranges(2)[0].disk_offset, 76 << 10);
    }

    #[test]
    fn rejects_corruption() {
        let b = sample().build().unwrap();
        for i in [0usize, 9, 13, 17, 30, 50, 100, 260, b.len() - 1] {
            let mut c = b.clone();
            c[i] ^= 0x40;
            assert!(ContentIndex::parse(&c).is_err(), "flip at {i} accepted");
        }
        assert!(ContentIndex::parse(&b[..b.len() - 1]).is_err());
        let mut longer = b.clone();
        longer.push(0);
        assert!(ContentIndex::parse(&longer).is_err());
    }

    #[test]
    fn rejects_lying_sizes() {
        let mut idx = sample();
        idx.header.used_bytes += 4096;
        assert!(idx.build().is_err());
        let mut idx = sample();
        idx.extents[1].offset = 8 << 10; // overlaps the first
        assert!(idx.build().is_err());
        let mut idx = sample();
        idx.header.partition_size = 64 << 10; // extent beyond the end
        assert!(idx.build().is_err());
        let mut idx = sample();
        idx.piece_hashes.pop();
        assert!(idx.build().is_err());
    }

    #[test]
    fn uuid_strings() {
        let u = parse_uuid_string("1234-ABCD").unwrap();
        assert_eq!(u, vec![0xCD, 0xAB, 0x34, 0x12]);
        assert_eq!(uuid_string(&u), "1234-ABCD");
        let s = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0";
        assert_eq!(uuid_string(&parse_uuid_string(s).unwrap()), s);
    }
}
