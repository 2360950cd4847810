//! qcow2 reader: turns a qcow2 image (version 2 or 3) into raw disk bytes,
//! without `qemu-img` and without following anything outside the file.
//!
//! The core works over any [`ReadAt`] (a file, a byte slice): [`Image::open`]
//! parses and checks the header, its extensions and the active L1 table;
//! [`Image::for_each_extent`] walks the L2 tables (one at a time) and yields
//! the guest disk as extents in order (data at a host offset, compressed,
//! or zero); [`convert`] reads them and hands the non-zero bytes to a
//! [`WriteAt`]. [`convert_file`] is the thin file shell: a sparse raw file
//! of the virtual size, byte-identical to `qemu-img convert -O raw`.
//!
//! Read: standard, zero (v3 flag) and unallocated clusters, compressed
//! clusters (raw deflate, or zstd with `compression_type` 1), extended L2
//! entries (32 subclusters per cluster), cluster sizes 512 B to 2 MiB,
//! header extensions (unknown ones skipped). Refused, each with the reason
//! and what to do: a backing file, an external data file, encryption, the
//! corrupt bit, unknown incompatible features, and any table or cluster
//! offset that is misaligned or beyond the end of the file. The dirty bit
//! (lazy refcounts) is accepted: refcounts are never read. Internal
//! snapshots are ignored: only the active L1 table is read.
//!
//! Memory is bounded whatever the header claims: the L1 table is read only
//! as far as the virtual size needs it, at most [`MAX_L1_BYTES`], and only
//! from bytes the file holds; one L2 table (one cluster, at most 2 MiB) at a
//! time; data in runs of at most [`MAX_RUN`]; a compressed cluster's input
//! is at most two clusters and its output exactly one.
//!
//! Format: QEMU's `docs/interop/qcow2.txt`.

use crate::fs::{FileRegion, ReadAt};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// `QFI\xfb`.
pub const MAGIC: [u8; 4] = *b"QFI\xfb";
/// The largest virtual size read (64 TiB, the device bound of
/// docs/content-format.md "Input bounds").
pub const MAX_VIRTUAL_SIZE: u64 = 64 << 40;
/// The largest L1 table read (QEMU's own limit, 32 MiB).
pub const MAX_L1_BYTES: u64 = 32 << 20;
/// The longest run of host-contiguous data read at once.
pub const MAX_RUN: u64 = 4 << 20;
/// Smallest and largest `cluster_bits`.
pub const CLUSTER_BITS: std::ops::RangeInclusive<u32> = 9..=21;
/// Smallest `cluster_bits` with extended L2 entries (16 KiB clusters, 512 B
/// subclusters).
pub const EXTENDED_L2_MIN_CLUSTER_BITS: u32 = 14;

const V2_HEADER_LEN: u64 = 72;
const V3_HEADER_MIN: u64 = 104;
/// The header extension area is read from at most this many bytes (the
/// largest cluster).
const HEAD_MAX: u64 = 1 << 21;

const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTENDED_L2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 = 0x1f;

const EXT_END: u32 = 0;
const EXT_FEATURE_NAMES: u32 = 0x6803_f857;
const EXT_CRYPTO: u32 = 0x0537_be77;
const EXT_DATA_FILE: u32 = 0x4441_5441;

/// Bits 9-55 of L1 and standard L2 entries: a host offset.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const L2_COMPRESSED: u64 = 1 << 62;
const L2_ZERO: u64 = 1;
/// Host offsets end below 2^56 (64 PiB).
const HOST_LIMIT: u64 = 1 << 56;
/// Zero detection granularity of the output (and of `qemu-img convert -S`).
const ZERO_BLOCK: usize = 4096;
/// zstd window cap for compressed clusters (8 MiB: four 2 MiB clusters).
const ZSTD_WINDOW_LOG_MAX: u32 = 23;

/// Errors of reading a qcow2 image.
#[derive(Debug, thiserror::Error)]
pub enum Qcow2Error {
    /// Shorter than its own header.
    #[error(
        "qcow2 image is truncated: {len} bytes, its header needs {need}: \
         check that the whole file was copied"
    )]
    Truncated {
        /// bytes needed
        need: u64,
        /// file length
        len: u64,
    },
    /// Not `QFI\xfb`.
    #[error(
        "not a qcow2 image (magic {found:02x?}, expected 51 46 49 fb): \
         check the source format (raw, qcow2, partclone)"
    )]
    Magic {
        /// the first four bytes
        found: [u8; 4],
    },
    /// Not version 2 or 3.
    #[error(
        "qcow2 version {0} is not supported (2 or 3): convert it with \
         `qemu-img convert -O qcow2` before importing"
    )]
    Version(u32),
    /// cluster_bits out of 9..=21.
    #[error(
        "qcow2 cluster_bits {0} is out of range (9 to 21, 512 bytes to 2 MiB): \
         convert it with `qemu-img convert -O qcow2` before importing"
    )]
    ClusterBits(u32),
    /// header_length not a multiple of 8 in 104..=cluster size.
    #[error(
        "qcow2 header_length {len} is invalid (a multiple of 8, 104 to the cluster size {cluster})"
    )]
    HeaderLength {
        /// header_length
        len: u32,
        /// cluster size
        cluster: u64,
    },
    /// backing_file_offset != 0.
    #[error(
        "qcow2 image has a backing file ({}): flatten it with `qemu-img convert -O qcow2` \
         before importing (an import reads nothing outside its own file)",
        show_name(.0.as_deref())
    )]
    BackingFile(Option<String>),
    /// Incompatible bit 2 or the data file name extension.
    #[error(
        "qcow2 image keeps its data in an external data file ({}): convert it into a \
         self-contained image with `qemu-img convert -O qcow2` before importing",
        show_name(.0.as_deref())
    )]
    DataFile(Option<String>),
    /// crypt_method != 0 (or an encryption header without it).
    #[error(
        "qcow2 image is encrypted ({}): decrypt it with `qemu-img convert --object \
         secret,... --image-opts ... -O qcow2` before importing (keys are never handed to an import)",
        crypt_name(*.0)
    )]
    Encrypted(u32),
    /// Incompatible bit 1.
    #[error(
        "qcow2 image is marked corrupt: check and repair it with `qemu-img check -r all` \
         before importing"
    )]
    Corrupt,
    /// Incompatible bits this reader does not know.
    #[error(
        "qcow2 image uses incompatible features this reader does not know \
         (bits {bits:#x}{names}): convert it with `qemu-img convert -O qcow2 -o compat=1.1` \
         before importing"
    )]
    UnknownFeatures {
        /// the unknown bits
        bits: u64,
        /// their names from the feature name table, `: name, ...` or empty
        names: String,
    },
    /// compression_type other than 0 (zlib) and 1 (zstd), or inconsistent
    /// with incompatible bit 3.
    #[error(
        "qcow2 compression_type {value} is not supported{detail}: convert it with \
         `qemu-img convert -O qcow2` (zlib or zstd) before importing"
    )]
    CompressionType {
        /// the field
        value: u8,
        /// why
        detail: &'static str,
    },
    /// Extended L2 entries with clusters under 16 KiB.
    #[error("qcow2 image has extended L2 entries with {0}-byte clusters (at least 16384)")]
    ExtendedL2ClusterSize(u64),
    /// A header extension runs past the header cluster.
    #[error("qcow2 header extension {kind:#010x} at byte {offset} runs past the header cluster")]
    HeaderExtension {
        /// extension type
        kind: u32,
        /// where it starts
        offset: u64,
    },
    /// Virtual size 0 or over the limit.
    #[error(
        "qcow2 virtual size {0} bytes is not importable (1 byte to 64 TiB, whole 512-byte sectors)"
    )]
    VirtualSize(u64),
    /// The active L1 table is unusable.
    #[error("qcow2 L1 table ({entries} entries at byte {offset}) {reason}")]
    L1Table {
        /// l1_table_offset
        offset: u64,
        /// l1_size
        entries: u64,
        /// what is wrong
        reason: &'static str,
    },
    /// An L2 table offset is unusable.
    #[error("qcow2 L2 table at byte {host} (for guest byte {guest}) {reason}")]
    L2Table {
        /// guest offset the table maps
        guest: u64,
        /// host offset
        host: u64,
        /// what is wrong
        reason: &'static str,
    },
    /// A data cluster's descriptor is unusable.
    #[error("qcow2 cluster for guest byte {guest} (host byte {host}) {reason}")]
    Cluster {
        /// guest offset
        guest: u64,
        /// host offset
        host: u64,
        /// what is wrong
        reason: &'static str,
    },
    /// A compressed cluster does not decompress.
    #[error(
        "qcow2 compressed cluster for guest byte {guest} (host byte {host}) does not decompress"
    )]
    Decompress {
        /// guest offset
        guest: u64,
        /// host offset
        host: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// A compressed cluster decompresses to less than a cluster.
    #[error(
        "qcow2 compressed cluster for guest byte {guest} (host byte {host}) decompresses \
         to {got} bytes, not a whole cluster ({cluster})"
    )]
    ShortCluster {
        /// guest offset
        guest: u64,
        /// host offset
        host: u64,
        /// bytes produced
        got: u64,
        /// cluster size
        cluster: u64,
    },
    /// Reading the image.
    #[error("reading {len} bytes at byte {offset} of the qcow2 image")]
    Read {
        /// where
        offset: u64,
        /// how many
        len: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Writing the output.
    #[error("writing {len} bytes at byte {offset} of the raw output")]
    Write {
        /// where
        offset: u64,
        /// how many
        len: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// Opening, creating or sizing a file.
    #[error("{what} {path}")]
    File {
        /// what was done
        what: &'static str,
        /// file
        path: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
}

fn show_name(n: Option<&str>) -> String {
    match n {
        Some(n) => format!("{n:?}"),
        None => "name unreadable".to_owned(),
    }
}

fn crypt_name(m: u32) -> String {
    match m {
        1 => "aes".to_owned(),
        2 => "luks".to_owned(),
        m => format!("method {m}"),
    }
}

/// Compression of compressed clusters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Raw deflate (type 0, "zlib").
    Deflate,
    /// zstd (type 1).
    Zstd,
}

/// The parts of the header the reader uses, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// 9..=21.
    pub cluster_bits: u32,
    /// Virtual size in bytes (the header's, rounded down to 512 bytes as
    /// QEMU does).
    pub virtual_size: u64,
    /// l1_size.
    pub l1_size: u32,
    /// l1_table_offset.
    pub l1_table_offset: u64,
    /// Incompatible feature bits (only known, accepted ones remain).
    pub incompatible: u64,
    /// How compressed clusters are compressed.
    pub compression: Compression,
    /// 128-bit L2 entries with 32 subclusters.
    pub extended_l2: bool,
}

impl Header {
    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }
    /// Bytes per L2 entry (8, or 16 with extended L2 entries).
    pub fn l2_entry_len(&self) -> u64 {
        if self.extended_l2 { 16 } else { 8 }
    }
    /// Entries per L2 table.
    pub fn l2_entries(&self) -> u64 {
        self.cluster_size() / self.l2_entry_len()
    }
    /// Guest bytes one L1 entry maps.
    pub fn l1_span(&self) -> u64 {
        self.cluster_size() * self.l2_entries()
    }
    /// L1 entries the virtual size needs.
    pub fn l1_needed(&self) -> u64 {
        self.virtual_size.div_ceil(self.l1_span())
    }
    /// The dirty bit (refcounts may be stale; data is readable).
    pub fn dirty(&self) -> bool {
        self.incompatible & INCOMPAT_DIRTY != 0
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    if let Some(s) = at.checked_add(4).and_then(|end| b.get(at..end)) {
        a.copy_from_slice(s);
    }
    u32::from_be_bytes(a)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = at.checked_add(8).and_then(|end| b.get(at..end)) {
        a.copy_from_slice(s);
    }
    u64::from_be_bytes(a)
}

/// A string field `[off, off+len)` of `head`, if it lies inside and is at
/// most `max` bytes long.
fn string_at(head: &[u8], off: u64, len: u64, max: u64) -> Option<String> {
    if len > max {
        return None;
    }
    let start = usize::try_from(off).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    head.get(start..end)
        .map(|b| String::from_utf8_lossy(b).into_owned())
}

/// What the header extensions say.
#[derive(Default)]
struct Extensions {
    /// The external data file's name, when the extension names one.
    data_file_name: Option<String>,
    /// An external data file extension is present.
    data_file: bool,
    /// A full disk encryption extension is present.
    crypto: bool,
    /// The feature name table: (type, bit, name).
    feature_names: Vec<(u8, u8, String)>,
}

/// Reads the header extensions of the header cluster `head`.
fn parse_extensions(head: &[u8], header_len: u64, cluster: u64) -> Result<Extensions, Qcow2Error> {
    // Header extensions: [header_len, cluster end), 8-byte aligned records
    // until type 0; bytes past the end of the file read as zero (the end).
    let mut ext = Extensions::default();
    let mut pos = header_len;
    while pos < cluster {
        let p = usize::try_from(pos).unwrap_or(usize::MAX);
        let kind = be32(head, p);
        if kind == EXT_END {
            break;
        }
        let ext_len = u64::from(be32(head, p.saturating_add(4)));
        let data = pos + 8;
        let end = data + ext_len;
        if end > cluster {
            return Err(Qcow2Error::HeaderExtension { kind, offset: pos });
        }
        match kind {
            EXT_DATA_FILE => {
                ext.data_file = true;
                ext.data_file_name = string_at(head, data, ext_len, 4096);
            }
            EXT_CRYPTO => ext.crypto = true,
            EXT_FEATURE_NAMES => {
                let mut e = data;
                while e + 48 <= end {
                    let i = usize::try_from(e).unwrap_or(usize::MAX);
                    if let Some(rec) = head.get(i..i + 48) {
                        let name = rec[2..]
                            .split(|&b| b == 0)
                            .next()
                            .map(|n| String::from_utf8_lossy(n).into_owned())
                            .unwrap_or_default();
                        ext.feature_names.push((rec[0], rec[1], name));
                    }
                    e += 48;
                }
            }
            _ => {}
        }
        pos = end.next_multiple_of(8);
    }

    Ok(ext)
}

/// Refuses the features this reader does not handle (external data file,
/// encryption, the corrupt bit, unknown incompatible bits) and returns the
/// compression the header names.
fn check_features(
    incompatible: u64,
    ext: &Extensions,
    compression_type: u8,
) -> Result<Compression, Qcow2Error> {
    if incompatible & INCOMPAT_DATA_FILE != 0 || ext.data_file {
        return Err(Qcow2Error::DataFile(ext.data_file_name.clone()));
    }
    if ext.crypto {
        return Err(Qcow2Error::Encrypted(0));
    }
    if incompatible & INCOMPAT_CORRUPT != 0 {
        return Err(Qcow2Error::Corrupt);
    }
    let unknown = incompatible & !INCOMPAT_KNOWN;
    if unknown != 0 {
        let mut names: Vec<String> = ext
            .feature_names
            .iter()
            .filter(|(t, b, _)| *t == 0 && *b < 64 && unknown & (1u64 << b) != 0)
            .map(|(_, b, n)| format!("{b} {n:?}"))
            .collect();
        names.dedup();
        let names = if names.is_empty() {
            String::new()
        } else {
            format!(": {}", names.join(", "))
        };
        return Err(Qcow2Error::UnknownFeatures {
            bits: unknown,
            names,
        });
    }
    let compression = match (incompatible & INCOMPAT_COMPRESSION != 0, compression_type) {
        (false, 0) => Compression::Deflate,
        (false, v) => {
            return Err(Qcow2Error::CompressionType {
                value: v,
                detail: " (set without the compression type feature bit)",
            });
        }
        (true, 1) => Compression::Zstd,
        (true, 0) => {
            return Err(Qcow2Error::CompressionType {
                value: 0,
                detail: " (the compression type feature bit needs a non-zero type)",
            });
        }
        (true, v) => {
            return Err(Qcow2Error::CompressionType {
                value: v,
                detail: " (0 zlib and 1 zstd are)",
            });
        }
    };
    Ok(compression)
}

/// Checks that the L1 table is bounded, large enough, aligned, and inside
/// the file.
fn check_l1(h: &Header, cluster: u64, file_len: u64) -> Result<(), Qcow2Error> {
    let l1_err = |reason| Qcow2Error::L1Table {
        offset: h.l1_table_offset,
        entries: u64::from(h.l1_size),
        reason,
    };
    let needed = h.l1_needed();
    if u64::from(h.l1_size) * 8 > MAX_L1_BYTES {
        return Err(l1_err("is larger than 32 MiB"));
    }
    if u64::from(h.l1_size) < needed {
        return Err(l1_err("is too small for the virtual size"));
    }
    if !h.l1_table_offset.is_multiple_of(cluster) {
        return Err(l1_err("is not aligned to a cluster"));
    }
    if h.l1_table_offset == 0 {
        return Err(l1_err("overlaps the header"));
    }
    if h.l1_table_offset >= HOST_LIMIT || h.l1_table_offset + needed * 8 > file_len {
        return Err(l1_err("lies beyond the end of the file"));
    }
    Ok(())
}

/// Parses and checks the header and its extensions. `head` is the start of
/// the file (at least the header; the header cluster when the file has it,
/// at most 2 MiB), `file_len` the file's length.
pub fn parse_header(head: &[u8], file_len: u64) -> Result<Header, Qcow2Error> {
    let len = file_len.min(head.len() as u64);
    if len < V2_HEADER_LEN {
        if len >= 4 && head.get(..4) != Some(&MAGIC[..]) {
            return Err(Qcow2Error::Magic {
                found: be32(head, 0).to_be_bytes(),
            });
        }
        return Err(Qcow2Error::Truncated {
            need: V2_HEADER_LEN,
            len,
        });
    }
    if head.get(..4) != Some(&MAGIC[..]) {
        return Err(Qcow2Error::Magic {
            found: be32(head, 0).to_be_bytes(),
        });
    }
    let version = be32(head, 4);
    if version != 2 && version != 3 {
        return Err(Qcow2Error::Version(version));
    }
    let cluster_bits = be32(head, 20);
    if !CLUSTER_BITS.contains(&cluster_bits) {
        return Err(Qcow2Error::ClusterBits(cluster_bits));
    }
    let cluster = 1u64 << cluster_bits;
    let (header_len, incompatible, compression_type) = if version == 2 {
        (V2_HEADER_LEN, 0, 0u8)
    } else {
        if len < V3_HEADER_MIN {
            return Err(Qcow2Error::Truncated {
                need: V3_HEADER_MIN,
                len,
            });
        }
        let hl = be32(head, 100);
        let hl64 = u64::from(hl);
        if hl64 < V3_HEADER_MIN || !hl64.is_multiple_of(8) || hl64 > cluster {
            return Err(Qcow2Error::HeaderLength { len: hl, cluster });
        }
        if len < hl64 {
            return Err(Qcow2Error::Truncated { need: hl64, len });
        }
        let ct = if hl64 > 104 {
            head.get(104).copied().unwrap_or(0)
        } else {
            0
        };
        (hl64, be64(head, 72), ct)
    };
    // Only the bytes the file has, up to one cluster.
    let head = &head[..usize::try_from(len.min(cluster)).unwrap_or(0)];

    let crypt = be32(head, 32);
    if crypt != 0 {
        return Err(Qcow2Error::Encrypted(crypt));
    }
    let backing_off = be64(head, 8);
    if backing_off != 0 {
        let backing_len = u64::from(be32(head, 16));
        return Err(Qcow2Error::BackingFile(string_at(
            head,
            backing_off,
            backing_len,
            1023,
        )));
    }

    let ext = parse_extensions(head, header_len, cluster)?;
    let compression = check_features(incompatible, &ext, compression_type)?;
    let extended_l2 = incompatible & INCOMPAT_EXTENDED_L2 != 0;
    if extended_l2 && cluster_bits < EXTENDED_L2_MIN_CLUSTER_BITS {
        return Err(Qcow2Error::ExtendedL2ClusterSize(cluster));
    }

    let size = be64(head, 24);
    let virtual_size = size & !511;
    if virtual_size == 0 || virtual_size > MAX_VIRTUAL_SIZE {
        return Err(Qcow2Error::VirtualSize(size));
    }

    let h = Header {
        version,
        cluster_bits,
        virtual_size,
        l1_size: be32(head, 36),
        l1_table_offset: be64(head, 40),
        incompatible,
        compression,
        extended_l2,
    };
    check_l1(&h, cluster, file_len)?;
    Ok(h)
}

/// Where a run of guest bytes comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Reads as zeros (unallocated, zero flag, or zero subclusters).
    Zero,
    /// Uncompressed bytes at this host offset (the run is host-contiguous;
    /// bytes past the end of the file read as zeros).
    Data {
        /// host offset
        host: u64,
    },
    /// One compressed cluster: `len` compressed bytes at `host` (those past
    /// the end of the file are not there), decompressing to one cluster of
    /// which the extent is the start.
    Compressed {
        /// host offset
        host: u64,
        /// compressed bytes
        len: u64,
    },
}

/// A run of guest bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Guest offset.
    pub guest: u64,
    /// Length (never 0).
    pub len: u64,
    /// Where the bytes come from.
    pub map: Mapping,
}

/// An opened image: the checked header and the active L1 table entries the
/// virtual size needs.
#[derive(Debug, Clone)]
pub struct Image {
    header: Header,
    file_len: u64,
    l1: Vec<u64>,
}

fn read_at<R: ReadAt + ?Sized>(src: &R, buf: &mut [u8], offset: u64) -> Result<(), Qcow2Error> {
    src.read_exact_at(buf, offset)
        .map_err(|source| Qcow2Error::Read {
            offset,
            len: buf.len() as u64,
            source,
        })
}

impl Image {
    /// Reads and checks the header and the L1 table.
    pub fn open<R: ReadAt + ?Sized>(src: &R) -> Result<Image, Qcow2Error> {
        let file_len = src.size();
        let mut head = vec![0u8; usize::try_from(file_len.min(HEAD_MAX)).unwrap_or(0)];
        read_at(src, &mut head, 0)?;
        let header = parse_header(&head, file_len)?;
        drop(head);
        // parse_header checked needed * 8 <= min(32 MiB, file_len - offset).
        let n = usize::try_from(header.l1_needed()).unwrap_or(0);
        let mut raw = vec![0u8; n * 8];
        read_at(src, &mut raw, header.l1_table_offset)?;
        let l1 = raw.chunks_exact(8).map(|c| be64(c, 0)).collect();
        Ok(Image {
            header,
            file_len,
            l1,
        })
    }

    /// The checked header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Virtual size in bytes.
    pub fn virtual_size(&self) -> u64 {
        self.header.virtual_size
    }

    /// Length of the image file.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Yields the guest disk as extents, in order, tiling
    /// `[0, virtual_size)`: adjacent zero runs merged, host-contiguous data
    /// merged up to [`MAX_RUN`]. Reads one L2 table at a time; stops at the
    /// first bad table or entry (or the first error of `f`).
    pub fn for_each_extent<R, F>(&self, src: &R, mut f: F) -> Result<(), Qcow2Error>
    where
        R: ReadAt + ?Sized,
        F: FnMut(Extent) -> Result<(), Qcow2Error>,
    {
        let h = &self.header;
        let cs = h.cluster_size();
        let vsize = h.virtual_size;
        let span = h.l1_span();
        let entry_len = h.l2_entry_len();
        let mut pending: Option<Extent> = None;
        let mut l2 = Vec::new();
        let mut emit = |e: Extent| -> Result<(), Qcow2Error> {
            if let Some(p) = &mut pending {
                let merge = match (p.map, e.map) {
                    (Mapping::Zero, Mapping::Zero) => true,
                    (Mapping::Data { host: a }, Mapping::Data { host: b }) => {
                        a + p.len == b && p.len + e.len <= MAX_RUN
                    }
                    _ => false,
                };
                if merge {
                    p.len += e.len;
                    return Ok(());
                }
                f(*p)?;
            }
            pending = Some(e);
            Ok(())
        };
        for (i, &entry) in self.l1.iter().enumerate() {
            let base = i as u64 * span;
            let table_span = span.min(vsize - base);
            let l2_off = entry & OFFSET_MASK;
            if l2_off == 0 {
                emit(Extent {
                    guest: base,
                    len: table_span,
                    map: Mapping::Zero,
                })?;
                continue;
            }
            let table_err = |reason| Qcow2Error::L2Table {
                guest: base,
                host: l2_off,
                reason,
            };
            if !l2_off.is_multiple_of(cs) {
                return Err(table_err("is not aligned to a cluster"));
            }
            let entries = table_span.div_ceil(cs);
            let bytes = entries * entry_len;
            if l2_off + bytes > self.file_len {
                return Err(table_err("lies beyond the end of the file"));
            }
            // bytes <= one cluster (2 MiB)
            l2.resize(usize::try_from(bytes).unwrap_or(0), 0);
            read_at(src, &mut l2, l2_off)?;
            for j in 0..entries {
                let guest = base + j * cs;
                let at = usize::try_from(j * entry_len).unwrap_or(usize::MAX);
                let e = be64(&l2, at);
                let bitmap = if h.extended_l2 {
                    be64(&l2, at.saturating_add(8))
                } else {
                    0
                };
                self.cluster_extents(guest, e, bitmap, &mut emit)?;
            }
        }
        if let Some(p) = pending {
            f(p)?;
        }
        Ok(())
    }

    /// Emits the extents of one L2 entry `e` (and its subcluster `bitmap`
    /// in an extended L2 table) mapping the cluster at `guest`.
    fn cluster_extents<E>(
        &self,
        guest: u64,
        e: u64,
        bitmap: u64,
        emit: &mut E,
    ) -> Result<(), Qcow2Error>
    where
        E: FnMut(Extent) -> Result<(), Qcow2Error>,
    {
        let h = &self.header;
        let cs = h.cluster_size();
        let cb = h.cluster_bits;
        let vsize = h.virtual_size;
        let len = cs.min(vsize - guest);
        let cluster_err = |host, reason| Qcow2Error::Cluster {
            guest,
            host,
            reason,
        };
        if e & L2_COMPRESSED != 0 {
            // Compressed: x = 62 - (cluster_bits - 8) offset bits,
            // then (cluster_bits - 8) bits of additional sectors.
            let x = 62 - (cb - 8);
            let host = e & ((1u64 << x) - 1);
            let sectors = ((e >> x) & ((1u64 << (cb - 8)) - 1)) + 1;
            if bitmap != 0 {
                return Err(cluster_err(
                    host,
                    "is compressed but has a subcluster bitmap",
                ));
            }
            if host >= HOST_LIMIT || host >= self.file_len {
                return Err(cluster_err(
                    host,
                    "is compressed beyond the end of the file",
                ));
            }
            let clen = sectors * 512 - (host % 512);
            emit(Extent {
                guest,
                len,
                map: Mapping::Compressed { host, len: clen },
            })?;
            return Ok(());
        }
        let host = e & OFFSET_MASK;
        if !host.is_multiple_of(cs) {
            return Err(cluster_err(host, "is not aligned to a cluster"));
        }
        if !h.extended_l2 {
            if e & L2_ZERO != 0 && h.version == 2 {
                // QEMU marks such an image corrupt and fails the read.
                return Err(cluster_err(
                    host,
                    "has the zero flag, which version 2 images do not have",
                ));
            }
            if e & L2_ZERO != 0 || host == 0 {
                emit(Extent {
                    guest,
                    len,
                    map: Mapping::Zero,
                })?;
                return Ok(());
            }
            if host >= self.file_len {
                return Err(cluster_err(host, "lies beyond the end of the file"));
            }
            emit(Extent {
                guest,
                len,
                map: Mapping::Data { host },
            })?;
            return Ok(());
        }
        // Extended: bits 0-31 allocated, 32-63 reads as zeros.
        let alloc = (bitmap & 0xffff_ffff) as u32;
        let zero = (bitmap >> 32) as u32;
        if alloc & zero != 0 {
            return Err(cluster_err(host, "has subclusters both allocated and zero"));
        }
        if alloc != 0 && host == 0 {
            return Err(cluster_err(
                host,
                "has allocated subclusters but no host offset",
            ));
        }
        if alloc != 0 && host >= self.file_len {
            return Err(cluster_err(host, "lies beyond the end of the file"));
        }
        let sc = cs / 32;
        for k in 0..32u64 {
            let g = guest + k * sc;
            if g >= vsize {
                break;
            }
            let l = sc.min(vsize - g);
            let map = if alloc & (1 << k) != 0 {
                Mapping::Data {
                    host: host + k * sc,
                }
            } else {
                Mapping::Zero
            };
            emit(Extent {
                guest: g,
                len: l,
                map,
            })?;
        }
        Ok(())
    }
}

/// Random-access output.
pub trait WriteAt {
    /// Writes all of `buf` at `offset`.
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()>;
}

impl WriteAt for Vec<u8> {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(io::Error::other)?;
        let end = start
            .checked_add(buf.len())
            .ok_or_else(|| io::Error::other("offset overflow"))?;
        if self.len() < end {
            self.resize(end, 0);
        }
        self[start..end].copy_from_slice(buf);
        Ok(())
    }
}

impl WriteAt for File {
    fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, buf, offset)
    }
}

/// Writes the non-zero bytes of `data` (which belongs at `offset`) to
/// `dst` in runs of whole 4 KiB blocks of the output (aligned to the
/// output's offsets, so they match its filesystem blocks); all-zero blocks
/// are left as holes.
fn write_nonzero<W: WriteAt + ?Sized>(
    dst: &mut W,
    offset: u64,
    data: &[u8],
) -> Result<(), Qcow2Error> {
    let mut run: Option<usize> = None;
    let mut flush = |from: usize, to: usize| -> Result<(), Qcow2Error> {
        let at = offset + from as u64;
        dst.write_all_at(&data[from..to], at)
            .map_err(|source| Qcow2Error::Write {
                offset: at,
                len: (to - from) as u64,
                source,
            })
    };
    let block = ZERO_BLOCK as u64;
    let mut i = 0;
    while i < data.len() {
        // to the next block boundary of the output
        let to_boundary = block - (offset + i as u64) % block;
        let end = data
            .len()
            .min(i.saturating_add(usize::try_from(to_boundary).unwrap_or(ZERO_BLOCK)));
        let zero = data[i..end].iter().all(|&b| b == 0);
        match (zero, run) {
            (true, Some(s)) => {
                flush(s, i)?;
                run = None;
            }
            (false, None) => run = Some(i),
            _ => {}
        }
        i = end;
    }
    if let Some(s) = run {
        flush(s, data.len())?;
    }
    Ok(())
}

/// Decompressor of compressed clusters, made on first use and reused.
enum Decompressor {
    Deflate(flate2::Decompress),
    Zstd(Box<zstd::stream::raw::Decoder<'static>>),
}

impl std::fmt::Debug for Decompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Decompressor::Deflate(_) => "Deflate",
            Decompressor::Zstd(_) => "Zstd",
        })
    }
}

impl Decompressor {
    fn new(c: Compression) -> io::Result<Decompressor> {
        Ok(match c {
            Compression::Deflate => Decompressor::Deflate(flate2::Decompress::new(false)),
            Compression::Zstd => {
                let mut d = zstd::stream::raw::Decoder::new()?;
                d.set_parameter(zstd::stream::raw::DParameter::WindowLogMax(
                    ZSTD_WINDOW_LOG_MAX,
                ))?;
                Decompressor::Zstd(Box::new(d))
            }
        })
    }

    /// Decompresses `input` into `out` until `out` is full (trailing input,
    /// such as the next cluster's bytes in the same sector, is left).
    /// Returns the bytes produced: less than `out.len()` when the input ran
    /// out or the stream ended first.
    fn run(&mut self, input: &[u8], out: &mut [u8]) -> io::Result<usize> {
        match self {
            Decompressor::Deflate(d) => {
                d.reset(false);
                let (mut read, mut written) = (0usize, 0usize);
                while written < out.len() {
                    let (i0, o0) = (d.total_in(), d.total_out());
                    let st = d
                        .decompress(
                            &input[read..],
                            &mut out[written..],
                            flate2::FlushDecompress::None,
                        )
                        .map_err(io::Error::other)?;
                    let di = usize::try_from(d.total_in() - i0).unwrap_or(0);
                    let dout = usize::try_from(d.total_out() - o0).unwrap_or(0);
                    read += di;
                    written += dout;
                    if st == flate2::Status::StreamEnd || (di == 0 && dout == 0) {
                        break;
                    }
                }
                Ok(written)
            }
            Decompressor::Zstd(d) => {
                use zstd::stream::raw::{InBuffer, Operation as _, OutBuffer};
                d.reinit()?;
                let mut ib = InBuffer::around(input);
                let mut ob = OutBuffer::around(out);
                loop {
                    let (i0, o0) = (ib.pos(), ob.pos());
                    let hint = d.run(&mut ib, &mut ob)?;
                    if ob.pos() == ob.capacity() || hint == 0 || (ib.pos() == i0 && ob.pos() == o0)
                    {
                        break;
                    }
                }
                Ok(ob.pos())
            }
        }
    }
}

/// Converts the qcow2 image in `src` to raw bytes written to `dst` (only
/// non-zero 4 KiB blocks are written: `dst` must read as zeros where
/// nothing is written, as a new file does). Returns the virtual size, the
/// length the output must be given.
pub fn convert<R, W>(src: &R, dst: &mut W) -> Result<u64, Qcow2Error>
where
    R: ReadAt + ?Sized,
    W: WriteAt + ?Sized,
{
    let img = Image::open(src)?;
    let file_len = img.file_len;
    let cs = img.header.cluster_size();
    let compression = img.header.compression;
    let mut buf: Vec<u8> = Vec::new();
    let mut cbuf: Vec<u8> = Vec::new();
    let mut cluster: Vec<u8> = Vec::new();
    let mut dec: Option<Decompressor> = None;
    img.for_each_extent(src, |e| match e.map {
        Mapping::Zero => Ok(()),
        Mapping::Data { host } => {
            // Bytes past the end of the file read as zeros (a last,
            // partly written cluster): they stay holes.
            let avail = e.len.min(file_len.saturating_sub(host));
            let n = usize::try_from(avail).unwrap_or(0); // <= MAX_RUN
            if buf.len() < n {
                buf.resize(n, 0);
            }
            read_at(src, &mut buf[..n], host)?;
            write_nonzero(dst, e.guest, &buf[..n])
        }
        Mapping::Compressed { host, len } => {
            let avail = len.min(file_len.saturating_sub(host));
            let n = usize::try_from(avail).unwrap_or(0); // <= 2 clusters
            if cbuf.len() < n {
                cbuf.resize(n, 0);
            }
            read_at(src, &mut cbuf[..n], host)?;
            let c = usize::try_from(cs).unwrap_or(0);
            if cluster.len() < c {
                cluster.resize(c, 0);
            }
            let d = match &mut dec {
                Some(d) => d,
                None => dec.insert(Decompressor::new(compression).map_err(|source| {
                    Qcow2Error::Decompress {
                        guest: e.guest,
                        host,
                        source,
                    }
                })?),
            };
            let got =
                d.run(&cbuf[..n], &mut cluster[..c])
                    .map_err(|source| Qcow2Error::Decompress {
                        guest: e.guest,
                        host,
                        source,
                    })?;
            if got < c {
                return Err(Qcow2Error::ShortCluster {
                    guest: e.guest,
                    host,
                    got: got as u64,
                    cluster: cs,
                });
            }
            let l = usize::try_from(e.len).unwrap_or(0).min(c);
            write_nonzero(dst, e.guest, &cluster[..l])
        }
    })?;
    Ok(img.virtual_size())
}

/// Converts the qcow2 file `src` into a new sparse raw file `dst` (created
/// or truncated; removed again on error) of the virtual size. Returns the
/// virtual size.
pub fn convert_file(src: &Path, dst: &Path) -> Result<u64, Qcow2Error> {
    let file_err = |what, path: &Path| {
        let path = path.to_owned();
        move |source| Qcow2Error::File { what, path, source }
    };
    let input = File::open(src).map_err(file_err("opening", src))?;
    let len = input
        .metadata()
        .map_err(file_err("reading the size of", src))?
        .len();
    let mut out = File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dst)
        .map_err(file_err("creating", dst))?;
    let r = convert(
        &FileRegion {
            file: &input,
            start: 0,
            len,
        },
        &mut out,
    )
    .and_then(|size| {
        out.set_len(size)
            .map_err(file_err("setting the size of", dst))?;
        Ok(size)
    });
    if r.is_err() {
        drop(out);
        let _ = std::fs::remove_file(dst);
    }
    r
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::io::Write as _;

    fn put32(b: &mut [u8], at: usize, v: u32) {
        b[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }
    fn put64(b: &mut [u8], at: usize, v: u64) {
        b[at..at + 8].copy_from_slice(&v.to_be_bytes());
    }

    const CB: u32 = 9;
    const CS: usize = 512;
    const L1: usize = CS;
    const L2: usize = 2 * CS;
    const DATA: usize = 3 * CS;
    /// 32 clusters of 512 bytes.
    const VSIZE: u64 = 16 << 10;

    /// A valid image: header at 0, L1 (one entry) at 512, an empty L2
    /// table at 1024, no data; `version` 2 or 3 (header_length 104, or
    /// `hl` for room for compression_type and extensions).
    fn base(version: u32) -> Vec<u8> {
        let mut b = vec![0u8; DATA];
        b[..4].copy_from_slice(&MAGIC);
        put32(&mut b, 4, version);
        put32(&mut b, 20, CB);
        put64(&mut b, 24, VSIZE);
        put32(&mut b, 36, 1);
        put64(&mut b, 40, L1 as u64);
        put64(&mut b, 48, 0); // refcounts are never read
        if version == 3 {
            put32(&mut b, 96, 4);
            put32(&mut b, 100, 104);
        }
        put64(&mut b, L1, L2 as u64 | 1 << 63);
        b
    }

    fn l2(b: &mut [u8], i: usize, e: u64) {
        put64(b, L2 + i * 8, e);
    }

    fn open_err(b: &[u8]) -> Qcow2Error {
        match Image::open(b) {
            Ok(_) => panic!("accepted"),
            Err(e) => e,
        }
    }

    fn convert_vec(b: &[u8]) -> Result<Vec<u8>, Qcow2Error> {
        let mut out = Vec::new();
        let n = convert(b, &mut out)?;
        out.resize(usize::try_from(n).unwrap(), 0);
        Ok(out)
    }

    fn compressed_entry(host: u64, extra_sectors: u64) -> u64 {
        let x = 62 - (CB - 8);
        L2_COMPRESSED | (extra_sectors << x) | host
    }

    fn deflate(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn empty_v2_and_v3_read_as_zeros() {
        for v in [2, 3] {
            let out = convert_vec(&base(v)).unwrap();
            assert_eq!(out.len() as u64, VSIZE);
            assert!(out.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn data_zero_unallocated_compressed_and_partial_last_cluster() {
        let mut b = base(3);
        let mut want = vec![0u8; VSIZE as usize];
        // cluster 0: data at DATA
        b.resize(DATA + 2 * CS, 0);
        for (i, x) in b[DATA..DATA + CS].iter_mut().enumerate() {
            *x = (i * 7 + 1) as u8;
        }
        want[..CS].copy_from_slice(&b[DATA..DATA + CS]);
        l2(&mut b, 0, DATA as u64 | 1 << 63);
        // cluster 1: zero flag over preallocated (non-zero) host bytes
        b[DATA + CS..DATA + 2 * CS].fill(0xee);
        l2(&mut b, 1, (DATA + CS) as u64 | 1 << 63 | L2_ZERO);
        // cluster 2: unallocated. cluster 3: compressed, unaligned host
        let pattern: Vec<u8> = (0..CS).map(|i| b"qcow2 "[i % 6]).collect();
        let z = deflate(&pattern);
        let host = b.len() + 7;
        b.resize(host, 0x55);
        b.extend_from_slice(&z);
        b.extend_from_slice(&[0x99; 9]); // the next cluster's bytes
        l2(&mut b, 3, compressed_entry(host as u64, 0));
        want[3 * CS..4 * CS].copy_from_slice(&pattern);
        // cluster 31: data cluster cut short by the end of the file
        let host = b.len().next_multiple_of(CS);
        b.resize(host, 0);
        b.extend_from_slice(&[0x42; 100]);
        l2(&mut b, 31, host as u64);
        want[31 * CS..31 * CS + 100].fill(0x42);
        assert!(convert_vec(&b).unwrap() == want);
        // the extents tile the disk, zeros merged
        let img = Image::open(&b[..]).unwrap();
        let mut ext = Vec::new();
        img.for_each_extent(&b[..], |e| {
            ext.push(e);
            Ok(())
        })
        .unwrap();
        assert_eq!(ext.len(), 5, "{ext:?}");
        assert_eq!(
            ext[1],
            Extent {
                guest: 512,
                len: 1024,
                map: Mapping::Zero
            }
        );
        assert_eq!(ext[3].len, 27 * 512);
    }

    #[test]
    fn zero_flag_only_in_version_3() {
        let mut b = base(2);
        l2(&mut b, 1, L2_ZERO);
        let e = convert_vec(&b).err().unwrap();
        assert!(e.to_string().contains("zero flag"), "{e}");
        put32(&mut b, 4, 3);
        put32(&mut b, 100, 104);
        assert!(convert_vec(&b).unwrap().iter().all(|&x| x == 0));
    }

    #[test]
    fn zstd_compressed_cluster() {
        let mut b = base(3);
        put32(&mut b, 100, 112);
        b[104] = 1;
        put64(&mut b, 72, INCOMPAT_COMPRESSION);
        let pattern: Vec<u8> = (0..CS).map(|i| (i / 3) as u8).collect();
        let z = zstd::bulk::compress(&pattern, 3).unwrap();
        let host = DATA + 3;
        b.resize(host, 0);
        b.extend_from_slice(&z);
        let extra = (3 + z.len() as u64).div_ceil(512) - 1;
        l2(&mut b, 5, compressed_entry(host as u64, extra));
        let out = convert_vec(&b).unwrap();
        assert!(out[5 * CS..6 * CS] == pattern[..]);
        assert!(out[..5 * CS].iter().all(|&x| x == 0));
        // the same bytes read as deflate: refused, no panic
        put32(&mut b, 100, 104);
        b[104] = 0;
        put64(&mut b, 72, 0);
        assert!(matches!(
            convert_vec(&b),
            Err(Qcow2Error::Decompress { .. } | Qcow2Error::ShortCluster { .. })
        ));
    }

    #[test]
    fn extended_l2_subclusters() {
        // 16 KiB clusters, 512-byte subclusters, 16-byte entries.
        let cs = 16 << 10;
        let mut b = vec![0u8; 4 * cs];
        b[..4].copy_from_slice(&MAGIC);
        put32(&mut b, 4, 3);
        put32(&mut b, 20, 14);
        put64(&mut b, 24, 4 * cs as u64);
        put32(&mut b, 36, 1);
        put64(&mut b, 40, cs as u64);
        put64(&mut b, 72, INCOMPAT_EXTENDED_L2);
        put32(&mut b, 100, 104);
        put64(&mut b, cs, 2 * cs as u64);
        // cluster 1 at host 3*cs: subclusters 0 and 5 allocated, 1 zero.
        for (i, x) in b[3 * cs..4 * cs].iter_mut().enumerate() {
            *x = (i % 251) as u8 | 1;
        }
        put64(&mut b, 2 * cs + 16, (3 * cs as u64) | L2_ZERO);
        put64(&mut b, 2 * cs + 24, 1u64 << 33 | 1 | 1 << 5);
        let mut want = vec![0u8; 4 * cs];
        want[cs..cs + 512].copy_from_slice(&b[3 * cs..3 * cs + 512]);
        want[cs + 5 * 512..cs + 6 * 512].copy_from_slice(&b[3 * cs + 5 * 512..3 * cs + 6 * 512]);
        assert!(convert_vec(&b).unwrap() == want);
        // allocated and zero at once: refused
        put64(&mut b, 2 * cs + 24, 1u64 << 32 | 1);
        assert!(matches!(convert_vec(&b), Err(Qcow2Error::Cluster { .. })));
        // allocated without a host offset
        put64(&mut b, 2 * cs + 16, 0);
        put64(&mut b, 2 * cs + 24, 1);
        assert!(matches!(convert_vec(&b), Err(Qcow2Error::Cluster { .. })));
        // a data cluster not aligned to 16 KiB
        put64(&mut b, 2 * cs + 16, 3 * cs as u64 + 512);
        let e = convert_vec(&b).err().unwrap();
        assert!(e.to_string().contains("not aligned"), "{e}");
        // compressed with a subcluster bitmap
        put64(&mut b, 2 * cs + 16, L2_COMPRESSED | (3 * cs as u64));
        assert!(
            convert_vec(&b)
                .err()
                .unwrap()
                .to_string()
                .contains("subcluster bitmap")
        );
        // an L2 table not aligned to 16 KiB
        put64(&mut b, cs, 2 * cs as u64 + 512);
        let e = convert_vec(&b).err().unwrap();
        assert!(
            matches!(e, Qcow2Error::L2Table { .. }) && e.to_string().contains("not aligned"),
            "{e}"
        );
        // extended L2 needs 16 KiB clusters
        put32(&mut b, 20, 13);
        assert!(matches!(
            open_err(&b),
            Qcow2Error::ExtendedL2ClusterSize(8192)
        ));
    }

    #[test]
    fn truncated_and_bad_magic() {
        let b = base(3);
        for n in [0, 3, 4, 71] {
            assert!(
                matches!(
                    open_err(&b[..n]),
                    Qcow2Error::Truncated { .. } | Qcow2Error::Read { .. }
                ),
                "{n}"
            );
        }
        assert!(matches!(
            open_err(&b[..80]),
            Qcow2Error::Truncated { need: 104, len: 80 }
        ));
        let mut m = b.clone();
        m[..4].copy_from_slice(b"\x7fELF");
        let e = open_err(&m);
        assert!(matches!(e, Qcow2Error::Magic { found } if &found == b"\x7fELF"));
        assert!(matches!(
            open_err(&b"QFI"[..]),
            Qcow2Error::Truncated { .. }
        ));
        assert!(matches!(
            open_err(&b"QFIX and more"[..]),
            Qcow2Error::Magic { .. }
        ));
        // the header fits but its L1 table was cut off
        assert!(matches!(open_err(&b[..L1 + 4]), Qcow2Error::L1Table { .. }));
    }

    #[test]
    fn version_cluster_bits_and_header_length() {
        for v in [0, 1, 4, u32::MAX] {
            let mut b = base(3);
            put32(&mut b, 4, v);
            assert!(matches!(open_err(&b), Qcow2Error::Version(x) if x == v));
        }
        for cb in [0, 8, 22, 63, u32::MAX] {
            let mut b = base(3);
            put32(&mut b, 20, cb);
            assert!(matches!(open_err(&b), Qcow2Error::ClusterBits(x) if x == cb));
        }
        for hl in [0, 72, 103, 108, 513, u32::MAX] {
            let mut b = base(3);
            put32(&mut b, 100, hl);
            assert!(
                matches!(open_err(&b), Qcow2Error::HeaderLength { .. }),
                "{hl}"
            );
        }
    }

    #[test]
    fn backing_file_refused_with_its_name() {
        let mut b = base(3);
        b[200..212].copy_from_slice(b"/etc/shadow\n");
        put64(&mut b, 8, 200);
        put32(&mut b, 16, 12);
        let e = open_err(&b);
        assert!(matches!(&e, Qcow2Error::BackingFile(Some(n)) if n == "/etc/shadow\n"));
        let msg = e.to_string();
        assert!(msg.contains("backing file (\"/etc/shadow\\n\")"), "{msg}");
        assert!(msg.contains("qemu-img convert -O qcow2"), "{msg}");
        // a name outside the header or too long: still refused
        for (off, len) in [(1 << 40, 4), (200, 4096), (u64::MAX, u32::MAX)] {
            put64(&mut b, 8, off);
            put32(&mut b, 16, len);
            assert!(matches!(open_err(&b), Qcow2Error::BackingFile(None)));
        }
        // also in version 2
        let mut b = base(2);
        put64(&mut b, 8, 100);
        put32(&mut b, 16, 21);
        b[100..121].copy_from_slice(b"http://10.0.0.1/x.img");
        assert!(
            matches!(open_err(&b), Qcow2Error::BackingFile(Some(n)) if n == "http://10.0.0.1/x.img")
        );
    }

    fn ext(b: &mut [u8], at: usize, kind: u32, data: &[u8]) -> usize {
        put32(b, at, kind);
        put32(b, at + 4, data.len() as u32);
        b[at + 8..at + 8 + data.len()].copy_from_slice(data);
        (at + 8 + data.len()).next_multiple_of(8)
    }

    #[test]
    fn data_file_refused_by_bit_or_extension() {
        let mut b = base(3);
        put64(&mut b, 72, INCOMPAT_DATA_FILE);
        assert!(matches!(open_err(&b), Qcow2Error::DataFile(None)));
        let at = ext(&mut b, 104, 0x1234_5678, b"unknown, skipped");
        ext(&mut b, at, EXT_DATA_FILE, b"other-tenant.raw");
        let e = open_err(&b);
        assert!(matches!(&e, Qcow2Error::DataFile(Some(n)) if n == "other-tenant.raw"));
        assert!(
            e.to_string()
                .contains("external data file (\"other-tenant.raw\")")
        );
        put64(&mut b, 72, 0);
        assert!(matches!(open_err(&b), Qcow2Error::DataFile(Some(_))));
    }

    #[test]
    fn encryption_refused() {
        for m in [1, 2, 7] {
            let mut b = base(3);
            put32(&mut b, 32, m);
            let e = open_err(&b);
            assert!(matches!(e, Qcow2Error::Encrypted(x) if x == m));
        }
        let mut b = base(3);
        put32(&mut b, 32, 2);
        assert!(open_err(&b).to_string().contains("encrypted (luks)"));
        // an encryption header without crypt_method
        let mut b = base(3);
        ext(&mut b, 104, EXT_CRYPTO, &[0; 16]);
        assert!(matches!(open_err(&b), Qcow2Error::Encrypted(0)));
    }

    #[test]
    fn corrupt_refused_dirty_accepted() {
        let mut b = base(3);
        put64(&mut b, 72, INCOMPAT_CORRUPT);
        assert!(matches!(open_err(&b), Qcow2Error::Corrupt));
        put64(&mut b, 72, INCOMPAT_DIRTY);
        let img = Image::open(&b[..]).unwrap();
        assert!(img.header().dirty());
    }

    #[test]
    fn unknown_incompatible_bits_refused_with_their_names() {
        let mut b = base(3);
        put64(&mut b, 72, 1 << 5 | 1 << 63);
        assert!(
            matches!(open_err(&b), Qcow2Error::UnknownFeatures { bits, .. } if bits == 1 << 5 | 1 << 63)
        );
        let mut names = vec![0u8; 96];
        names[0] = 0;
        names[1] = 5;
        names[2..11].copy_from_slice(b"time warp");
        names[48] = 1; // a compatible feature: not listed
        names[49] = 5;
        names[50..53].copy_from_slice(b"foo");
        ext(&mut b, 104, EXT_FEATURE_NAMES, &names);
        let msg = open_err(&b).to_string();
        assert!(
            msg.contains("bits 0x8000000000000020: 5 \"time warp\")"),
            "{msg}"
        );
        // compatible and autoclear bits are ignored
        let mut b = base(3);
        put64(&mut b, 80, u64::MAX);
        put64(&mut b, 88, u64::MAX);
        Image::open(&b[..]).unwrap();
    }

    #[test]
    fn compression_type_checked() {
        let mut b = base(3);
        put32(&mut b, 100, 112);
        b[104] = 1; // zstd without the feature bit
        assert!(matches!(
            open_err(&b),
            Qcow2Error::CompressionType { value: 1, .. }
        ));
        put64(&mut b, 72, INCOMPAT_COMPRESSION);
        b[104] = 0;
        assert!(matches!(
            open_err(&b),
            Qcow2Error::CompressionType { value: 0, .. }
        ));
        b[104] = 2;
        assert!(matches!(
            open_err(&b),
            Qcow2Error::CompressionType { value: 2, .. }
        ));
        // the byte is not part of a 104-byte header
        put32(&mut b, 100, 104);
        put64(&mut b, 72, 0);
        Image::open(&b[..]).unwrap();
    }

    #[test]
    fn header_extension_overrun() {
        let mut b = base(3);
        put32(&mut b, 104, 0xdead_beef);
        put32(&mut b, 108, 512);
        assert!(matches!(
            open_err(&b),
            Qcow2Error::HeaderExtension {
                kind: 0xdead_beef,
                offset: 104
            }
        ));
        put32(&mut b, 108, u32::MAX);
        assert!(matches!(open_err(&b), Qcow2Error::HeaderExtension { .. }));
        put32(&mut b, 108, 400 - 8);
        Image::open(&b[..]).unwrap();
    }

    #[test]
    fn virtual_sizes() {
        for s in [0, 511, MAX_VIRTUAL_SIZE + 512, 1 << 62, u64::MAX] {
            let mut b = base(3);
            put64(&mut b, 24, s);
            assert!(
                matches!(open_err(&b), Qcow2Error::VirtualSize(x) if x == s),
                "{s}"
            );
        }
        // not a multiple of 512: rounded down, as QEMU does
        let mut b = base(3);
        put64(&mut b, 24, 1000);
        assert_eq!(Image::open(&b[..]).unwrap().virtual_size(), 512);
        // 64 TiB at 512-byte clusters needs 2^31 L1 entries, not 1
        put64(&mut b, 24, MAX_VIRTUAL_SIZE);
        assert!(matches!(open_err(&b), Qcow2Error::L1Table { .. }));
    }

    #[test]
    fn l1_table_checks() {
        let mut b = base(3);
        put32(&mut b, 36, 0);
        assert!(open_err(&b).to_string().contains("too small"));
        put32(&mut b, 36, u32::MAX);
        assert!(open_err(&b).to_string().contains("larger than 32 MiB"));
        put32(&mut b, 36, 1);
        for (off, why) in [
            (513, "not aligned"),
            (0, "overlaps the header"),
            (b.len() as u64, "beyond the end"),
            (1 << 60, "beyond the end"),
            (!511, "beyond the end"),
        ] {
            put64(&mut b, 40, off);
            let msg = open_err(&b).to_string();
            assert!(msg.contains(why), "{off}: {msg}");
        }
        // more L1 entries than needed: only the needed ones are read
        let mut b = base(3);
        put32(&mut b, 36, 1000);
        Image::open(&b[..]).unwrap();
    }

    #[test]
    fn l2_and_cluster_offsets_checked() {
        let mut b = base(3);
        // bits 0-8 of an L1 entry are reserved: ignored
        put64(&mut b, L1, L2 as u64 + 8);
        convert_vec(&b).unwrap();
        put64(&mut b, L1, 1 << 50);
        let e = convert_vec(&b).err().unwrap();
        assert!(
            e.to_string().contains("L2 table at byte 1125899906842624"),
            "{e}"
        );
        assert!(e.to_string().contains("beyond the end"), "{e}");
        put64(&mut b, L1, L2 as u64);
        l2(&mut b, 2, DATA as u64 + 512 * 1000);
        let e = convert_vec(&b).err().unwrap();
        assert!(matches!(e, Qcow2Error::Cluster { guest: 1024, .. }), "{e}");
        // reserved bits 1-8 ignored, the offset still aligned
        l2(&mut b, 2, L2 as u64 | 0x1fe);
        convert_vec(&b).unwrap();
        // compressed beyond the end, or with reserved upper offset bits
        let end = b.len() as u64;
        l2(&mut b, 2, compressed_entry(end, 1));
        assert!(matches!(convert_vec(&b), Err(Qcow2Error::Cluster { .. })));
        l2(&mut b, 2, compressed_entry(1 << 57, 0));
        assert!(matches!(convert_vec(&b), Err(Qcow2Error::Cluster { .. })));
        // compressed garbage, or a stream that ends early
        l2(&mut b, 2, compressed_entry(8, 1));
        assert!(convert_vec(&b).is_err());
        let z = deflate(&[1; 100]);
        let host = b.len();
        b.extend_from_slice(&z);
        l2(&mut b, 2, compressed_entry(host as u64, 0));
        assert!(matches!(
            convert_vec(&b),
            Err(Qcow2Error::ShortCluster { got: 100, .. })
        ));
    }

    #[test]
    fn messages_are_lowercase_and_say_what_to_do() {
        let errs = [
            Qcow2Error::BackingFile(None),
            Qcow2Error::DataFile(None),
            Qcow2Error::Encrypted(1),
            Qcow2Error::Corrupt,
            Qcow2Error::Version(1),
            Qcow2Error::UnknownFeatures {
                bits: 32,
                names: String::new(),
            },
        ];
        for e in errs {
            let m = e.to_string();
            assert!(m.starts_with(|c: char| c.is_lowercase()), "{m}");
            assert!(m.contains("qemu-img"), "{m}");
        }
    }

    #[test]
    fn write_nonzero_leaves_holes() {
        #[derive(Default)]
        struct Log(Vec<(u64, usize)>);
        impl WriteAt for Log {
            fn write_all_at(&mut self, buf: &[u8], offset: u64) -> io::Result<()> {
                self.0.push((offset, buf.len()));
                Ok(())
            }
        }
        let mut d = vec![0u8; 5 * 4096 + 100];
        d[4096] = 1;
        d[2 * 4096 + 5] = 1;
        d[5 * 4096 + 99] = 1;
        let mut log = Log::default();
        write_nonzero(&mut log, 8192, &d).unwrap();
        assert_eq!(log.0, vec![(8192 + 4096, 8192), (8192 + 5 * 4096, 100)]);
        // blocks follow the output's 4 KiB grid: [1000, 4096) is the first
        let mut log = Log::default();
        write_nonzero(&mut log, 1000, &d).unwrap();
        assert_eq!(log.0, vec![(4096, 8192), (20480, 1100)]);
    }

    /// Every truncation and every single-byte corruption of a valid image:
    /// an error or a result, never a panic.
    #[test]
    fn hostile_mutations_never_panic() {
        let mut b = base(3);
        b.resize(DATA + CS, 0xab);
        l2(&mut b, 0, DATA as u64);
        l2(&mut b, 1, compressed_entry(DATA as u64 + 3, 1));
        for n in 0..b.len() {
            let _ = convert_vec(&b[..n]);
        }
        for i in (0..L2 + 24).filter(|i| *i < 112 || *i >= L1) {
            for v in [0x00, 0x01, 0x80, 0xff] {
                let mut m = b.clone();
                m[i] = v;
                if let Ok(img) = Image::open(&m[..])
                    && img.virtual_size() <= 1 << 20
                {
                    let _ = convert_vec(&m);
                }
            }
        }
    }
}
