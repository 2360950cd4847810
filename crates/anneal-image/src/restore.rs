//! Restore: write contents at their disk offsets with large aligned writes,
//! each piece verified against its SHA-1 before any of its bytes is written;
//! on failure after the first write, the target's partition table (or the
//! partition's first bytes) is zeroed so it cannot boot half-written.

use crate::format::{ContentIndex, FormatError};
use crate::layout::{self, Layout, LayoutError};
use crate::write::{PieceSource, PumpError, PumpOptions, SlotRange, SlotWriter, WriteError, pump};
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt as _, FileTypeExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Alignment used for direct I/O.
pub const ALIGN: usize = 4096;

/// Threads verifying piece hashes during a restore.
const HASHERS: usize = 2;

/// The largest write of a restore: a run of pieces contiguous on the disk
/// goes out as one vectored write of up to this many bytes (the deploy's
/// figure: one write per 1 MiB piece was slower than `dd bs=4M`).
const MAX_WRITE: u64 = 8 << 20;

/// Errors of restoring.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// I/O before anything was written.
    #[error("{what} {path}")]
    Io {
        /// what was done
        what: &'static str,
        /// file
        path: PathBuf,
        /// cause
        #[source]
        source: io::Error,
    },
    /// A content index is invalid.
    #[error("content {name} is invalid")]
    Index {
        /// content name
        name: String,
        /// cause
        #[source]
        source: FormatError,
    },
    /// The layout is invalid or does not fit.
    #[error("layout refused")]
    Layout(#[source] LayoutError),
    /// layout.json unreadable.
    #[error("layout.json is invalid")]
    LayoutJson(#[source] serde_json::Error),
    /// Content and slot disagree, or the stream length lies.
    #[error("{0}")]
    Mismatch(String),
    /// A piece's SHA-1 does not match the index: nothing of it was written.
    #[error(
        "piece {piece} of {content} failed verification (stream bytes {stream_offset}..{stream_end})"
    )]
    PieceHash {
        /// content name
        content: String,
        /// piece index
        piece: u64,
        /// first stream byte
        stream_offset: u64,
        /// end of the piece in the stream
        stream_end: u64,
    },
    /// Reading the stream failed at a piece.
    #[error("reading piece {piece} of {content}")]
    PieceRead {
        /// content name
        content: String,
        /// piece index
        piece: u64,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The content does not fit its slot, or writing it failed.
    #[error(transparent)]
    Slot(WriteError),
    /// A content of the layout does not fit its slot (checked before the
    /// first write).
    #[error("slot {slot}")]
    SlotOf {
        /// partition number
        slot: u32,
        /// cause
        #[source]
        source: WriteError,
    },
    /// A later step failed (swap header, mkfs, table, flush).
    #[error("{step}")]
    Step {
        /// what failed
        step: String,
        /// cause
        #[source]
        source: io::Error,
    },
    /// The target was invalidated after `cause`.
    #[error("restore failed; the target's partition table was invalidated")]
    Invalidated(#[source] Box<RestoreError>),
    /// The target was invalidated after `cause`, but invalidation failed too.
    #[error("restore failed and invalidating the target failed too ({invalidate})")]
    InvalidateFailed {
        /// the invalidation error
        invalidate: io::Error,
        /// the original failure
        #[source]
        cause: Box<RestoreError>,
    },
}

/// A 4096-aligned buffer made without unsafe code: a larger vector and an
/// aligned window into it.
#[derive(Debug)]
pub struct AlignedBuf {
    v: Vec<u8>,
    off: usize,
    cap: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of `cap` bytes (rounded up to `ALIGN`).
    pub fn new(cap: usize) -> Self {
        let cap = cap.div_ceil(ALIGN) * ALIGN;
        let v = vec![0u8; cap + ALIGN];
        let off = v.as_ptr().align_offset(ALIGN);
        AlignedBuf { v, off, cap }
    }
    /// The aligned window.
    pub fn as_slice(&self) -> &[u8] {
        &self.v[self.off..self.off + self.cap]
    }
    /// The aligned window, mutable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.v[self.off..self.off + self.cap]
    }
}

/// The restore target: one buffered and (when possible) one `O_DIRECT`
/// descriptor of the same file or block device.
#[derive(Debug)]
pub struct Target {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    size: u64,
    block_device: bool,
    wrote: AtomicBool,
    direct_ok: AtomicBool,
    grow_to: Option<u64>,
}

impl Target {
    /// Opens `path`; a regular file is created or extended to `min_size`
    /// when given.
    pub fn open(path: &Path, min_size: Option<u64>) -> Result<Self, RestoreError> {
        let io = |what: &'static str| {
            let path = path.to_owned();
            move |source| RestoreError::Io { what, path, source }
        };
        let is_blk = std::fs::metadata(path)
            .map(|m| m.file_type().is_block_device())
            .unwrap_or(false);
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .create(!is_blk)
            .truncate(false)
            .open(path)
            .map_err(io("opening"))?;
        let meta = buffered.metadata().map_err(io("inspecting"))?;
        let mut size = if is_blk {
            use std::io::Seek as _;
            (&buffered)
                .seek(io::SeekFrom::End(0))
                .map_err(io("sizing"))?
        } else {
            meta.len()
        };
        // a regular file is extended lazily (at `sync`): writes past its end
        // then take the file system's extending-write path, which is cheaper
        // for direct I/O than filling holes inside the file
        let mut grow_to = None;
        if !is_blk
            && let Some(min) = min_size
            && size < min
        {
            grow_to = Some(min);
            size = min;
        }
        let direct = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok();
        Ok(Target {
            path: path.to_owned(),
            buffered,
            direct,
            size,
            block_device: is_blk,
            wrote: AtomicBool::new(false),
            direct_ok: AtomicBool::new(true),
            grow_to,
        })
    }

    /// A target already open for reading and writing (`file`, called
    /// `path` in messages): the `O_DIRECT` descriptor is the same file
    /// reopened through `/proc/self/fd` (none where that or direct I/O is
    /// refused: every write is buffered then). A block device bounds the
    /// writes; a regular file grows as written (its opener may extend it
    /// only at the end, as [`Target::open`] does).
    pub fn from_file(file: File, path: &Path) -> io::Result<Self> {
        use std::os::fd::AsRawFd as _;
        let block_device = file.metadata()?.file_type().is_block_device();
        let size = if block_device {
            use std::io::Seek as _;
            (&file).seek(io::SeekFrom::End(0))?
        } else {
            u64::MAX
        };
        let direct = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .ok();
        Ok(Target {
            path: path.to_owned(),
            buffered: file,
            direct,
            size,
            block_device,
            wrote: AtomicBool::new(false),
            direct_ok: AtomicBool::new(true),
            grow_to: None,
        })
    }

    /// Reads `buf.len()` bytes at `off` through the buffered descriptor
    /// (what an `O_DIRECT` write put there: the kernel drops the cached
    /// pages it covers).
    pub fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.buffered.read_exact_at(buf, off)
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the target is a block device.
    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    /// Writes `buf` at `off`: `O_DIRECT` when offset, length and address are
    /// aligned, buffered otherwise.
    pub fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let end = off
            .checked_add(buf.len() as u64)
            .ok_or_else(|| io::Error::other("offset overflow"))?;
        if end > self.size {
            return Err(io::Error::other("write past the end of the target"));
        }
        self.wrote.store(true, Ordering::Relaxed);
        let aligned = off.is_multiple_of(ALIGN as u64)
            && buf.len().is_multiple_of(ALIGN)
            && (buf.as_ptr() as usize).is_multiple_of(ALIGN);
        if aligned
            && self.direct_ok.load(Ordering::Relaxed)
            && let Some(d) = &self.direct
        {
            match d.write_all_at(buf, off) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::debug!(path = %self.path.display(), "direct i/o refused, using buffered writes");
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        self.buffered.write_all_at(buf, off)
    }

    /// Writes `bufs` one after the other from `off` in one `pwritev`
    /// through the `O_DIRECT` descriptor when every buffer is aligned
    /// (what a run of pieces contiguous on the disk becomes: one large
    /// write, as `dd bs=4M` does, instead of one per piece); piece by piece
    /// through [`Target::write_at`] otherwise, and for what a short write
    /// left.
    pub fn write_vectored_at(&self, bufs: &[&[u8]], off: u64) -> io::Result<()> {
        let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        let end = off
            .checked_add(total)
            .ok_or_else(|| io::Error::other("offset overflow"))?;
        if end > self.size {
            return Err(io::Error::other("write past the end of the target"));
        }
        let aligned = off.is_multiple_of(ALIGN as u64)
            && bufs.iter().all(|b| {
                b.len().is_multiple_of(ALIGN) && (b.as_ptr() as usize).is_multiple_of(ALIGN)
            });
        let mut done = 0u64;
        if bufs.len() > 1
            && aligned
            && self.direct_ok.load(Ordering::Relaxed)
            && let Some(d) = &self.direct
            && let Ok(at) = i64::try_from(off)
        {
            self.wrote.store(true, Ordering::Relaxed);
            let iov: Vec<io::IoSlice<'_>> = bufs.iter().map(|b| io::IoSlice::new(b)).collect();
            loop {
                match nix::sys::uio::pwritev(d, &iov, at) {
                    Ok(n) => done = n as u64,
                    Err(nix::errno::Errno::EINTR) => continue,
                    // EINVAL (direct I/O refused) and the rest: piece by
                    // piece below, where `write_at` decides
                    Err(_) => {}
                }
                break;
            }
        }
        // the rest (all of it unless the vectored write ran), buffer by buffer
        let mut pos = off;
        for b in bufs {
            let len = b.len() as u64;
            let skip = done.saturating_sub(pos - off).min(len);
            if skip < len {
                self.write_at(&b[skip as usize..], pos + skip)?;
            }
            pos += len;
        }
        Ok(())
    }

    /// Makes `[off, off+len)` read as zeros (fallocate zero-range or punch,
    /// else writes zeros).
    pub fn zero_range(&self, off: u64, len: u64) -> io::Result<()> {
        use nix::fcntl::{FallocateFlags, fallocate};
        if len == 0 {
            return Ok(());
        }
        self.wrote.store(true, Ordering::Relaxed);
        let (o, l) = (off as i64, len as i64);
        if fallocate(&self.buffered, FallocateFlags::FALLOC_FL_ZERO_RANGE, o, l).is_ok() {
            return Ok(());
        }
        let punch = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
        if fallocate(&self.buffered, punch, o, l).is_ok() {
            return Ok(());
        }
        let z = vec![0u8; (len.min(4 << 20)) as usize];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(z.len() as u64) as usize;
            self.buffered.write_all_at(&z[..n], off + done)?;
            done += n as u64;
        }
        Ok(())
    }

    /// fsync of both descriptors.
    pub fn sync(&self) -> io::Result<()> {
        if let Some(len) = self.grow_to
            && self.buffered.metadata()?.len() < len
        {
            self.buffered.set_len(len)?;
        }
        if let Some(d) = &self.direct {
            d.sync_all()?;
        }
        self.buffered.sync_all()
    }

    /// Whether anything has been written yet.
    pub fn wrote(&self) -> bool {
        self.wrote.load(Ordering::Relaxed)
    }

    /// The buffered descriptor (for partition-table writes).
    pub fn file(&self) -> &File {
        &self.buffered
    }
}

/// A content ready to restore: its index (validated) and stream file.
#[derive(Debug)]
pub struct Content {
    /// Name for messages.
    pub name: String,
    /// The index.
    pub index: ContentIndex,
    /// The stream file.
    pub stream: PathBuf,
}

impl Content {
    /// Loads `index_path` and checks `stream_path` holds exactly the bytes the
    /// index describes.
    pub fn load(name: &str, index_path: &Path, stream_path: &Path) -> Result<Self, RestoreError> {
        let b = std::fs::read(index_path).map_err(|source| RestoreError::Io {
            what: "reading",
            path: index_path.to_owned(),
            source,
        })?;
        let index = ContentIndex::parse(&b).map_err(|source| RestoreError::Index {
            name: name.to_string(),
            source,
        })?;
        let len = std::fs::metadata(stream_path)
            .map_err(|source| RestoreError::Io {
                what: "inspecting",
                path: stream_path.to_owned(),
                source,
            })?
            .len();
        if len != index.header.used_bytes {
            return Err(RestoreError::Mismatch(format!(
                "content {name}: stream holds {len} bytes, index says {}",
                index.header.used_bytes
            )));
        }
        Ok(Content {
            name: name.to_string(),
            index,
            stream: stream_path.to_owned(),
        })
    }
}

/// Writes `content` at `base` on `target`, verifying every piece first:
/// the stream file is a [`PieceSource`] pumped into the content's
/// [`SlotWriter`], which checks that the content fits `[base,
/// base+slot_size)` before anything is written and zeroes the gaps the
/// content's flags ask for.
pub fn write_content(
    target: &mut Target,
    base: u64,
    slot_size: u64,
    content: &Content,
) -> Result<(), RestoreError> {
    let slot = SlotRange {
        offset: base,
        size: slot_size,
    };
    let writer = SlotWriter::open(&*target, slot, &content.name, &content.index)
        .map_err(RestoreError::Slot)?;
    if content.index.piece_count() == 0 {
        return Ok(());
    }
    let piece_length = u64::from(content.index.header.piece_length);
    let source = FileSource::open(&content.stream, piece_length).map_err(|source| {
        RestoreError::PieceRead {
            content: content.name.clone(),
            piece: 0,
            source,
        }
    })?;
    let pl = content.index.header.piece_length as usize;
    // 32 MiB of pieces in flight whatever the piece length (8 of 4 MiB, 32
    // of the default 1 MiB: with 8 of 1 MiB a restore ran at 87 % of `dd`'s
    // rate, docs/bench/imaging.md)
    let nbuf = (32usize << 20).div_ceil(pl).clamp(3, 32);
    let mut bufs: Vec<AlignedBuf> = (0..nbuf).map(|_| AlignedBuf::new(pl)).collect();
    let buffers = bufs.iter_mut().map(AlignedBuf::as_mut_slice).collect();
    let opts = PumpOptions {
        // the stream file is local: a bad read or piece is final
        retries: 0,
        backoff: std::time::Duration::ZERO,
        max_write: MAX_WRITE,
        verifiers: HASHERS,
        stream_sha256: false,
        helper_start: || {},
    };
    pump(&writer, source, buffers, &opts, &mut |_, _| true)
        .map(drop)
        .map_err(|e| match e {
            PumpError::Read {
                content,
                piece,
                source,
                ..
            } => RestoreError::PieceRead {
                content,
                piece,
                source,
            },
            PumpError::PieceHash {
                content,
                piece,
                start,
                end,
                ..
            } => RestoreError::PieceHash {
                content,
                piece,
                stream_offset: start,
                stream_end: end,
            },
            PumpError::Slot(e) => RestoreError::Slot(e),
            other => RestoreError::Mismatch(other.to_string()),
        })
}

/// A content's stream file as a [`PieceSource`]: `O_DIRECT` reads of whole
/// pieces, buffered where direct reads are refused or a read ends off an
/// alignment boundary.
struct FileSource {
    path: PathBuf,
    piece_length: u64,
    file: File,
    buffered: Option<File>,
}

impl FileSource {
    fn open(path: &Path, piece_length: u64) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .or_else(|_| File::open(path))?;
        Ok(FileSource {
            path: path.to_owned(),
            piece_length,
            file,
            buffered: None,
        })
    }
}

impl PieceSource for FileSource {
    fn read_piece(&mut self, i: u64, buf: &mut [u8], len: usize) -> io::Result<()> {
        let start = i * self.piece_length;
        read_piece(&self.file, &mut self.buffered, &self.path, buf, start, len)
    }

    fn origin(&self) -> String {
        self.path.display().to_string()
    }
}

/// Reads `len` bytes at `start` of the stream into `buf` (aligned, at
/// least `len` rounded up to [`ALIGN`]).
fn read_piece(
    file: &File,
    buffered: &mut Option<File>,
    path: &Path,
    buf: &mut [u8],
    start: u64,
    len: usize,
) -> io::Result<()> {
    let want = (len.div_ceil(ALIGN) * ALIGN).min(buf.len());
    let dst = &mut buf[..want];
    let mut got = 0usize;
    while got < len {
        let r = match buffered {
            Some(b) => b.read_at(&mut dst[got..len], start + got as u64),
            None => file.read_at(&mut dst[got..], start + got as u64),
        };
        match r {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            Ok(n) => got += n,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && buffered.is_none() => {
                *buffered = Some(File::open(path)?);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if buffered.is_none() && !got.is_multiple_of(ALIGN) && got < len {
            // a short direct read not on an alignment boundary: finish buffered
            *buffered = Some(File::open(path)?);
        }
    }
    Ok(())
}

/// Runs `f`; on error after the first write, zeroes the partition table
/// area of `[0, size)` (whole disk) and wraps the error.
fn guarded(
    target: &mut Target,
    f: impl FnOnce(&mut Target) -> Result<(), RestoreError>,
    invalidate: impl FnOnce(&mut Target) -> io::Result<()>,
) -> Result<(), RestoreError> {
    match f(target) {
        Ok(()) => Ok(()),
        Err(e) if !target.wrote() => Err(e),
        Err(e) => {
            tracing::error!(error = %e, path = %target.path.display(), "restore failed, invalidating the target");
            match invalidate(target).and_then(|()| target.sync()) {
                Ok(()) => Err(RestoreError::Invalidated(Box::new(e))),
                Err(inv) => Err(RestoreError::InvalidateFailed {
                    invalidate: inv,
                    cause: Box::new(e),
                }),
            }
        }
    }
}

/// Restores one content at `offset` of `target` (a partition-level restore:
/// on failure the partition's first 1 MiB is zeroed, which removes every
/// superblock this crate knows).
pub fn restore_partition(
    target: &mut Target,
    offset: u64,
    content: &Content,
) -> Result<(), RestoreError> {
    let size = content.index.header.partition_size;
    guarded(
        target,
        |t| {
            write_content(t, offset, size, content)?;
            t.sync().map_err(|source| RestoreError::Step {
                step: "flushing the target".into(),
                source,
            })
        },
        |t| {
            let n = size.min(1 << 20) as usize;
            t.buffered.write_all_at(&vec![0u8; n], offset)
        },
    )
}

/// Reads `layout.json` from a capture directory.
pub fn read_layout_json(dir: &Path) -> Result<Layout, RestoreError> {
    let p = dir.join("layout.json");
    let b = std::fs::read(&p).map_err(|source| RestoreError::Io {
        what: "reading",
        path: p,
        source,
    })?;
    serde_json::from_slice(&b).map_err(RestoreError::LayoutJson)
}

/// Options of a whole-disk restore.
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// Grow the last slot to the end of the target.
    pub grow_last: bool,
    /// Size to create or extend a regular-file target to.
    pub target_size: Option<u64>,
}

/// Restores a capture directory (`layout.json` plus contents) onto a disk.
/// Everything is validated before the first write: layout against the
/// target, each index, each stream length, each content against its slot.
pub fn restore_image(
    dir: &Path,
    target_path: &Path,
    opts: &RestoreOptions,
) -> Result<(), RestoreError> {
    let mut layout = read_layout_json(dir)?;
    if opts.grow_last
        && let Some(last) = layout.slots.last_mut()
    {
        last.grow = true;
    }
    let mut target = Target::open(target_path, opts.target_size)?;
    let tsize = target.size();
    layout::validate(&layout, tsize).map_err(RestoreError::Layout)?;
    let sizes = layout::final_sizes(&layout, tsize);
    let mut contents = Vec::new();
    for (slot, size) in layout.slots.iter().zip(&sizes) {
        let c = match &slot.content_ref {
            Some(name) => {
                if name.is_empty()
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                {
                    return Err(RestoreError::Mismatch(format!("content name {name:?}")));
                }
                let (ip, sp) = crate::capture::content_paths(dir, name);
                let c = Content::load(name, &ip, &sp)?;
                let at = SlotRange {
                    offset: slot.start_bytes,
                    size: *size,
                };
                crate::write::check_slot(name, &c.index, at, tsize).map_err(|source| {
                    RestoreError::SlotOf {
                        slot: slot.number,
                        source,
                    }
                })?;
                Some(c)
            }
            None => None,
        };
        if c.is_none()
            && slot.fs_type.as_deref() == Some("swap")
            && *size < 2 * crate::fs::SWAP_PAGE
        {
            return Err(RestoreError::Mismatch(format!(
                "swap slot {} is too small",
                slot.number
            )));
        }
        contents.push(c);
    }
    tracing::info!(target = %target_path.display(), slots = layout.slots.len(), "restoring");
    guarded(
        &mut target,
        |t| {
            // first write: remove any old table so a crash leaves no table
            // (a file target still to be grown only has its current length)
            let existing = t.buffered.metadata().map_or(tsize, |m| m.len().min(tsize));
            layout::invalidate(&mut t.buffered, existing).map_err(|source| RestoreError::Step {
                step: "clearing the old partition table".into(),
                source,
            })?;
            t.wrote.store(true, Ordering::Relaxed);
            for ((slot, size), c) in layout.slots.iter().zip(&sizes).zip(&contents) {
                if let Some(c) = c {
                    tracing::info!(slot = slot.number, content = %c.name, bytes = c.index.header.used_bytes, "writing content");
                    write_content(t, slot.start_bytes, *size, c)?;
                } else if slot.fs_type.as_deref() == Some("swap") {
                    let uuid = slot
                        .uuid
                        .as_deref()
                        .and_then(crate::format::parse_uuid_string)
                        .unwrap_or_default();
                    let hdr =
                        crate::fs::swap_header(*size, &uuid, slot.label.as_deref().unwrap_or(""));
                    t.write_at(&hdr, slot.start_bytes)
                        .map_err(|source| RestoreError::Step {
                            step: format!("writing the swap header of slot {}", slot.number),
                            source,
                        })?;
                } else if let Some(fs) = slot.fs_type.as_deref() {
                    t.sync().map_err(|source| RestoreError::Step {
                        step: "flushing before mkfs".into(),
                        source,
                    })?;
                    mkfs(
                        target_path,
                        fs,
                        slot.start_bytes,
                        *size,
                        slot.label.as_deref(),
                    )
                    .map_err(|source| RestoreError::Step {
                        step: format!("mkfs {fs} on slot {}", slot.number),
                        source,
                    })?;
                }
            }
            t.sync().map_err(|source| RestoreError::Step {
                step: "flushing contents".into(),
                source,
            })?;
            let mut f = &t.buffered;
            layout::write_table(&layout, &mut f, tsize).map_err(|e| RestoreError::Step {
                step: "writing the partition table".into(),
                source: io::Error::other(e),
            })?;
            t.sync().map_err(|source| RestoreError::Step {
                step: "flushing the target".into(),
                source,
            })
        },
        |t| {
            let existing = t.buffered.metadata().map_or(tsize, |m| m.len().min(tsize));
            layout::invalidate(&mut t.buffered, existing)
        },
    )
}

/// Makes a blank filesystem in `[offset, offset+size)` of `target` with the
/// tools of the live image (restore and the agent's deploy path).
pub fn mkfs(
    target: &Path,
    fs: &str,
    offset: u64,
    size: u64,
    label: Option<&str>,
) -> io::Result<()> {
    let mut cmd = match fs {
        "ext2" | "ext3" | "ext4" => {
            let mut c = std::process::Command::new("mke2fs");
            c.args(["-q", "-F", "-t", fs, "-E"])
                .arg(format!("offset={offset}"));
            if let Some(l) = label {
                c.args(["-L", l]);
            }
            c.arg(target).arg(format!("{}k", size / 1024));
            c
        }
        "vfat" => {
            let mut c = std::process::Command::new("mkfs.vfat");
            c.arg("--offset").arg((offset / 512).to_string());
            if let Some(l) = label {
                c.args(["-n", l]);
            }
            c.arg(target).arg((size / 1024).to_string());
            c
        }
        other => {
            return Err(io::Error::other(format!("no mkfs for {other}")));
        }
    };
    let out = cmd.output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "mkfs exited with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Reads a whole small file (used by tools and tests).
pub fn read_all(path: &Path) -> io::Result<Vec<u8>> {
    let mut v = Vec::new();
    File::open(path)?.read_to_end(&mut v)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vectored write of aligned buffers lands as the buffers written one
    /// after the other; unaligned ones take the per-buffer path with the
    /// same result; past the end is refused before anything is written.
    #[test]
    fn vectored_writes_equal_sequential_writes() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.img");
        let t = Target::open(&path, Some(1 << 20)).unwrap();
        let mut a = AlignedBuf::new(8192);
        let mut b = AlignedBuf::new(4096);
        a.as_mut_slice().fill(0xa1);
        b.as_mut_slice().fill(0xb2);
        t.write_vectored_at(&[a.as_slice(), b.as_slice()], 4096)
            .unwrap();
        // unaligned: a slice of `b` starting one byte in, at an odd offset
        t.write_vectored_at(&[&b.as_slice()[1..], &a.as_slice()[..100]], 65_537)
            .unwrap();
        assert!(
            t.write_vectored_at(&[a.as_slice()], (1 << 20) - 4096)
                .is_err()
        );
        t.sync().unwrap();
        let got = std::fs::read(&path).unwrap();
        assert_eq!(got.len(), 1 << 20);
        assert!(got[..4096].iter().all(|&x| x == 0));
        assert!(got[4096..12_288].iter().all(|&x| x == 0xa1));
        assert!(got[12_288..16_384].iter().all(|&x| x == 0xb2));
        assert!(got[16_384..65_537].iter().all(|&x| x == 0));
        assert!(got[65_537..65_537 + 4095].iter().all(|&x| x == 0xb2));
        assert!(got[69_632..69_732].iter().all(|&x| x == 0xa1));
        assert!(got[69_732..].iter().all(|&x| x == 0));
    }

    /// A target made from an open file writes aligned and unaligned
    /// buffers where asked, reads them back through its buffered
    /// descriptor (what the direct one wrote, not a stale cached page), and
    /// grows a regular file past its length.
    #[test]
    fn a_target_from_an_open_file_writes_direct_and_reads_back() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("t.img");
        std::fs::write(&path, vec![0x55u8; 16_384]).unwrap();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let t = Target::from_file(f, &path).unwrap();
        // the page cache holds the old bytes of the first pages
        let mut old = vec![0u8; 8192];
        t.read_exact_at(&mut old, 0).unwrap();
        assert!(old.iter().all(|&x| x == 0x55));
        let mut a = AlignedBuf::new(8192);
        a.as_mut_slice().fill(0xa1);
        t.write_at(a.as_slice(), 0).unwrap();
        t.write_at(&[0xb2; 100], 20_000).unwrap();
        let mut back = vec![0u8; 8192];
        t.read_exact_at(&mut back, 0).unwrap();
        assert!(back.iter().all(|&x| x == 0xa1), "a stale page was read");
        t.sync().unwrap();
        let got = std::fs::read(&path).unwrap();
        assert_eq!(got.len(), 20_100);
        assert!(got[..8192].iter().all(|&x| x == 0xa1));
        assert!(got[8192..16_384].iter().all(|&x| x == 0x55));
        assert!(got[16_384..20_000].iter().all(|&x| x == 0));
        assert!(got[20_000..].iter().all(|&x| x == 0xb2));
    }
}
