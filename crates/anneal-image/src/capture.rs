//! Capture: turn a partition (raw region of a disk image, partclone image)
//! into a content stream plus its index, and a whole disk into a layout with
//! one content per partition.

use crate::extents::{Extent, total_len};
use crate::format::{ContentIndex, FLAG_GAPS_ZERO, FormatError, Header, PIECE_HASH_LEN};
use crate::fs::{self, FileRegion, FsError, FsInfo, ReadAt};
use crate::layout::{self, Layout, LayoutError, Role};
use crate::partclone::{self, PartcloneError};
use crate::source::{self, SourceError};
use sha1::Digest as _;
use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;

/// Errors of capturing.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// I/O on the source or the output.
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
    /// Used-block detection failed.
    #[error("used-block detection of partition {partition}")]
    Fs {
        /// partition number (0: a single partition)
        partition: u32,
        /// cause
        #[source]
        source: FsError,
    },
    /// Partition table.
    #[error("reading the partition table")]
    Layout(#[source] LayoutError),
    /// partclone image.
    #[error("reading the partclone image")]
    Partclone(#[source] PartcloneError),
    /// Source container (compression, split, directory).
    #[error("opening the source")]
    Source(#[source] SourceError),
    /// Index building.
    #[error("building the content index")]
    Format(#[source] FormatError),
    /// The source holds nothing to capture: zero bytes, or a Clonezilla
    /// directory without partitions.
    #[error("{what}: source is empty")]
    Empty {
        /// the source and what is missing
        what: String,
    },
    /// The hashing/writing pipeline stopped.
    #[error("the stream writer stopped")]
    Pipeline,
}

/// Capture options.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Piece length of the produced streams.
    pub piece_length: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            piece_length: crate::format::DEFAULT_PIECE_LENGTH,
        }
    }
}

/// Paths of one content: `<dir>/<name>.index` and `<dir>/<name>.stream`.
pub fn content_paths(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("{name}.index")),
        dir.join(format!("{name}.stream")),
    )
}

type WriterResult = io::Result<(Vec<[u8; PIECE_HASH_LEN]>, u64)>;

struct SinkResult {
    piece_hashes: Vec<[u8; PIECE_HASH_LEN]>,
    sha256: [u8; 32],
    bytes: u64,
}

/// Writes the content stream on two worker threads (SHA-256 in one; SHA-1 per
/// piece, write and fsync in the other) while the caller reads.
struct StreamSink {
    tx: Option<mpsc::SyncSender<Vec<u8>>>,
    free: mpsc::Receiver<Vec<u8>>,
    piece_length: usize,
    h256: Option<thread::JoinHandle<[u8; 32]>>,
    writer: Option<thread::JoinHandle<WriterResult>>,
    path: PathBuf,
}

impl StreamSink {
    fn new(path: &Path, piece_length: u32) -> Result<Self, CaptureError> {
        let mut file = File::create(path).map_err(|source| CaptureError::Io {
            what: "creating",
            path: path.to_owned(),
            source,
        })?;
        let pl = piece_length as usize;
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(2);
        let (tx2, rx2) = mpsc::sync_channel::<Vec<u8>>(2);
        let (free_tx, free) = mpsc::channel::<Vec<u8>>();
        for _ in 0..5 {
            let _ = free_tx.send(Vec::with_capacity(pl));
        }
        let h256 = thread::Builder::new()
            .name("capture-sha256".into())
            .spawn(move || {
                let mut h = sha2::Sha256::new();
                for buf in rx {
                    h.update(&buf);
                    if tx2.send(buf).is_err() {
                        break;
                    }
                }
                h.finalize().into()
            })
            .map_err(|source| CaptureError::Io {
                what: "spawning a thread for",
                path: path.to_owned(),
                source,
            })?;
        let writer = thread::Builder::new()
            .name("capture-write".into())
            .spawn(move || {
                let mut hashes = Vec::new();
                let mut bytes = 0u64;
                for buf in rx2 {
                    hashes.push(sha1::Sha1::digest(&buf).into());
                    file.write_all(&buf)?;
                    bytes += buf.len() as u64;
                    let _ = free_tx.send(buf);
                }
                file.sync_all()?;
                Ok((hashes, bytes))
            })
            .map_err(|source| CaptureError::Io {
                what: "spawning a thread for",
                path: path.to_owned(),
                source,
            })?;
        Ok(StreamSink {
            tx: Some(tx),
            free,
            piece_length: pl,
            h256: Some(h256),
            writer: Some(writer),
            path: path.to_owned(),
        })
    }

    fn buffer(&mut self) -> Result<Vec<u8>, CaptureError> {
        let mut b = self.free.recv().map_err(|_| CaptureError::Pipeline)?;
        b.clear();
        Ok(b)
    }

    fn submit(&mut self, buf: Vec<u8>) -> Result<(), CaptureError> {
        let tx = self.tx.as_ref().ok_or(CaptureError::Pipeline)?;
        tx.send(buf).map_err(|_| CaptureError::Pipeline)
    }

    fn finish(mut self) -> Result<SinkResult, CaptureError> {
        drop(self.tx.take());
        let sha256 = self
            .h256
            .take()
            .ok_or(CaptureError::Pipeline)?
            .join()
            .map_err(|_| CaptureError::Pipeline)?;
        let (piece_hashes, bytes) = self
            .writer
            .take()
            .ok_or(CaptureError::Pipeline)?
            .join()
            .map_err(|_| CaptureError::Pipeline)?
            .map_err(|source| CaptureError::Io {
                what: "writing",
                path: self.path.clone(),
                source,
            })?;
        Ok(SinkResult {
            piece_hashes,
            sha256,
            bytes,
        })
    }
}

/// Feeds bytes into piece-sized buffers of a sink.
struct PieceFiller {
    sink: StreamSink,
    cur: Vec<u8>,
}

impl PieceFiller {
    fn new(mut sink: StreamSink) -> Result<Self, CaptureError> {
        let cur = sink.buffer()?;
        Ok(PieceFiller { sink, cur })
    }

    /// Calls `fill(dst)` with slices to fill until `len` bytes are supplied.
    fn feed(
        &mut self,
        mut len: u64,
        mut fill: impl FnMut(&mut [u8]) -> Result<(), CaptureError>,
    ) -> Result<(), CaptureError> {
        let pl = self.sink.piece_length;
        while len > 0 {
            let room = pl - self.cur.len();
            let n = (room as u64).min(len) as usize;
            let old = self.cur.len();
            self.cur.resize(old + n, 0);
            fill(&mut self.cur[old..])?;
            len -= n as u64;
            if self.cur.len() == pl {
                let next = self.sink.buffer()?;
                let full = std::mem::replace(&mut self.cur, next);
                self.sink.submit(full)?;
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<SinkResult, CaptureError> {
        if !self.cur.is_empty() {
            let last = std::mem::take(&mut self.cur);
            self.sink.submit(last)?;
        }
        self.sink.finish()
    }
}

fn write_index(
    index_path: &Path,
    info: &FsInfo,
    partition_size: u64,
    extents: Vec<Extent>,
    res: SinkResult,
    piece_length: u32,
) -> Result<ContentIndex, CaptureError> {
    let used = total_len(&extents);
    if used != res.bytes {
        return Err(CaptureError::Pipeline);
    }
    let idx = ContentIndex {
        header: Header {
            block_size: info.block_size,
            piece_length,
            partition_size,
            used_bytes: used,
            last_extent_end: extents.last().map_or(0, Extent::end),
            fs_type: info.fs_type.clone(),
            flags: if info.gaps_zero { FLAG_GAPS_ZERO } else { 0 },
            uuid: info.uuid.clone(),
            label: info.label.chars().take(64).collect(),
            stream_sha256: res.sha256,
        },
        extents,
        piece_hashes: res.piece_hashes,
    };
    let bytes = idx.build().map_err(CaptureError::Format)?;
    std::fs::write(index_path, bytes).map_err(|source| CaptureError::Io {
        what: "writing",
        path: index_path.to_owned(),
        source,
    })?;
    Ok(idx)
}

/// A whole disk image read at offsets: a file, or a source that is still
/// arriving (ingest streams an HTTP body through a sparse spool and blocks a
/// read until its bytes are there). Partitions are captured in offset order,
/// each one's data read front to back once its used blocks are known;
/// `release` tells the source which bytes will not be read again.
pub trait DiskSource: ReadAt + Sync {
    /// The bytes `[start, end)` of the disk will not be read again.
    fn release(&self, start: u64, end: u64) {
        let _ = (start, end);
    }
}

/// A whole file as a [`DiskSource`] (nothing is released).
#[derive(Debug)]
pub struct FileDisk<'a> {
    /// The file.
    pub file: &'a File,
    /// Its size.
    pub len: u64,
}

impl ReadAt for FileDisk<'_> {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        FileRegion {
            file: self.file,
            start: 0,
            len: self.len,
        }
        .read_exact_at(buf, off)
    }
    fn size(&self) -> u64 {
        self.len
    }
}

impl DiskSource for FileDisk<'_> {}

/// `[start, start+len)` of a disk source.
struct Region<'a, S: ?Sized> {
    disk: &'a S,
    start: u64,
    len: u64,
}

impl<S: ReadAt + ?Sized> ReadAt for Region<'_, S> {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let end = off
            .checked_add(buf.len() as u64)
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        if end > self.len {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        self.disk.read_exact_at(buf, self.start + off)
    }
    fn size(&self) -> u64 {
        self.len
    }
}

/// A [`DiskSource`] as `Read + Seek` (for the partition table reader).
struct Cursor<'a, S: ?Sized> {
    disk: &'a S,
    pos: u64,
}

impl<S: ReadAt + ?Sized> Read for Cursor<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.disk.size().saturating_sub(self.pos);
        let n = (buf.len() as u64).min(left) as usize;
        if n == 0 {
            return Ok(0);
        }
        self.disk.read_exact_at(&mut buf[..n], self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl<S: ReadAt + ?Sized> io::Seek for Cursor<'_, S> {
    fn seek(&mut self, to: io::SeekFrom) -> io::Result<u64> {
        let bad = || io::Error::new(io::ErrorKind::InvalidInput, "seek out of range");
        self.pos = match to {
            io::SeekFrom::Start(o) => o,
            io::SeekFrom::End(d) => self.disk.size().checked_add_signed(d).ok_or_else(bad)?,
            io::SeekFrom::Current(d) => self.pos.checked_add_signed(d).ok_or_else(bad)?,
        };
        Ok(self.pos)
    }
}

/// Release the captured front of a partition every this many bytes.
const RELEASE_STEP: u64 = 16 << 20;

/// Captures the partition `[start, start+len)` of `file` into
/// `index_path`/`stream_path`.
pub fn capture_region(
    file: &File,
    start: u64,
    len: u64,
    index_path: &Path,
    stream_path: &Path,
    opts: Options,
) -> Result<(ContentIndex, FsInfo), CaptureError> {
    if len == 0 {
        return Err(CaptureError::Empty {
            what: format!("the partition at offset {start} has 0 bytes"),
        });
    }
    advise_sequential(file);
    let disk = FileDisk {
        file,
        len: start.saturating_add(len),
    };
    capture_region_of(&disk, start, len, index_path, stream_path, opts)
}

/// Captures the partition `[start, start+len)` of a disk source: probe and
/// used-block detection first (the filesystem's metadata, at any offset of
/// the partition), then the used blocks front to back, releasing what was
/// read as it goes.
pub fn capture_region_of<S: DiskSource + ?Sized>(
    disk: &S,
    start: u64,
    len: u64,
    index_path: &Path,
    stream_path: &Path,
    opts: Options,
) -> Result<(ContentIndex, FsInfo), CaptureError> {
    let region = Region { disk, start, len };
    let info = fs::probe(&region);
    let extents = fs::used_extents(&region, &info).map_err(|source| CaptureError::Fs {
        partition: 0,
        source,
    })?;
    let mut filler = PieceFiller::new(StreamSink::new(stream_path, opts.piece_length)?)?;
    // the extents are in offset order: nothing below `off` is read again
    let mut released = 0u64;
    for e in &extents {
        let mut off = e.offset;
        filler.feed(e.len, |dst| {
            region
                .read_exact_at(dst, off)
                .map_err(|source| CaptureError::Io {
                    what: "reading the source at",
                    path: PathBuf::from(format!("offset {}", start + off)),
                    source,
                })?;
            off += dst.len() as u64;
            if off >= released + RELEASE_STEP {
                disk.release(start + released, start + off);
                released = off;
            }
            Ok(())
        })?;
    }
    let res = filler.finish()?;
    disk.release(start + released, start + len);
    let idx = write_index(index_path, &info, len, extents, res, opts.piece_length)?;
    Ok((idx, info))
}

fn advise_sequential(file: &File) {
    use std::os::fd::AsFd as _;
    let _ = nix::fcntl::posix_fadvise(
        file.as_fd(),
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_SEQUENTIAL,
    );
}

/// Imports a partclone image (already decompressed and joined) into a
/// content; the used blocks are exactly partclone's bitmap.
pub fn capture_partclone<R: Read>(
    input: R,
    index_path: &Path,
    stream_path: &Path,
    opts: Options,
) -> Result<(ContentIndex, FsInfo), CaptureError> {
    let mut r = partclone::Reader::open(input).map_err(CaptureError::Partclone)?;
    let h = r.header().clone();
    let extents = r.extents().to_vec();
    let bs = u64::from(h.block_size);
    let mut filler = PieceFiller::new(StreamSink::new(stream_path, opts.piece_length)?)?;
    let mut scratch = vec![0u8; (1u64 << 20).max(bs) as usize];
    // the first blocks carry the superblock: keep up to 64 KiB for probing
    let mut head = Vec::new();
    for e in &extents {
        let blocks = e.len.div_ceil(bs);
        let mut left_blocks = blocks;
        let mut left_bytes = e.len;
        let mut disk = e.offset;
        while left_blocks > 0 {
            let n = left_blocks.min(scratch.len() as u64 / bs);
            let chunk = &mut scratch[..(n * bs) as usize];
            r.read_blocks(chunk).map_err(CaptureError::Partclone)?;
            let keep = left_bytes.min(n * bs) as usize;
            if disk < 65536 {
                let want = (65536 - disk).min(keep as u64) as usize;
                head.resize(disk as usize, 0);
                head.extend_from_slice(&chunk[..want]);
            }
            let mut pos = 0usize;
            filler.feed(keep as u64, |dst| {
                dst.copy_from_slice(&chunk[pos..pos + dst.len()]);
                pos += dst.len();
                Ok(())
            })?;
            left_blocks -= n;
            left_bytes -= keep as u64;
            disk += keep as u64;
        }
    }
    r.finish().map_err(CaptureError::Partclone)?;
    let res = filler.finish()?;
    head.resize(65536.min(h.device_size) as usize, 0);
    let mut info = probe_head(&head, h.device_size);
    // the used-block map is partclone's, at its block size
    info.block_size = h.block_size;
    info.gaps_zero = info.fs_type == "raw";
    if info.fs_type == "raw" && !h.fs.eq_ignore_ascii_case("raw") {
        info.fs_type = h.fs.to_ascii_lowercase();
    }
    let idx = write_index(
        index_path,
        &info,
        h.device_size,
        extents,
        res,
        opts.piece_length,
    )?;
    Ok((idx, info))
}

/// Captures raw partition bytes from a stream (`partclone.dd` output),
/// eliding zero blocks of `fs::RAW_BLOCK` bytes; the partition size is the
/// stream length.
pub fn capture_raw_stream<R: Read>(
    mut input: R,
    index_path: &Path,
    stream_path: &Path,
    opts: Options,
) -> Result<(ContentIndex, FsInfo), CaptureError> {
    let block = fs::RAW_BLOCK as usize;
    let mut filler = PieceFiller::new(StreamSink::new(stream_path, opts.piece_length)?)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut head = Vec::new();
    let mut b = crate::extents::ExtentBuilder::new();
    let mut size = 0u64;
    loop {
        let mut n = 0usize;
        while n < buf.len() {
            match input.read(&mut buf[n..]) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(CaptureError::Io {
                        what: "reading",
                        path: PathBuf::from("the raw image"),
                        source,
                    });
                }
            }
        }
        if n == 0 {
            break;
        }
        if head.len() < 65536 {
            let want = (65536 - head.len()).min(n);
            head.extend_from_slice(&buf[..want]);
        }
        for (i, blk) in buf[..n].chunks(block).enumerate() {
            if blk.iter().any(|x| *x != 0) {
                b.push(size + (i * block) as u64, blk.len() as u64);
                let mut pos = 0usize;
                filler.feed(blk.len() as u64, |dst| {
                    dst.copy_from_slice(&blk[pos..pos + dst.len()]);
                    pos += dst.len();
                    Ok(())
                })?;
            }
        }
        size += n as u64;
        if b.len() as u64 > crate::format::MAX_EXTENTS {
            return Err(CaptureError::Fs {
                partition: 0,
                source: FsError::Corrupt {
                    fs: "raw",
                    detail: format!(
                        "more than {} used extents (the content format's limit) after {size} bytes",
                        crate::format::MAX_EXTENTS
                    ),
                },
            });
        }
        if n < buf.len() {
            break;
        }
    }
    if size == 0 {
        return Err(CaptureError::Empty {
            what: "the raw image (decompressed) has 0 bytes".into(),
        });
    }
    let res = filler.finish()?;
    let extents = b.finish();
    head.resize(65536.min(size) as usize, 0);
    let mut info = probe_head(&head, size);
    // the used-block map is zero elision, whatever the filesystem
    info.block_size = fs::RAW_BLOCK;
    info.gaps_zero = true;
    let idx = write_index(index_path, &info, size, extents, res, opts.piece_length)?;
    Ok((idx, info))
}

/// A probe on the first bytes of a partition, as if it were `size` long.
struct Head<'a> {
    b: &'a [u8],
    size: u64,
}

impl ReadAt for Head<'_> {
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.b.read_exact_at(buf, off)
    }
    fn size(&self) -> u64 {
        self.size
    }
}

fn probe_head(head: &[u8], size: u64) -> FsInfo {
    fs::probe(&Head { b: head, size })
}

/// Captures every partition of a raw disk image into `out_dir`:
/// `layout.json` plus `p<N>.index`/`p<N>.stream` per partition with content.
pub fn capture_disk(source: &Path, out_dir: &Path, opts: Options) -> Result<Layout, CaptureError> {
    let file = File::open(source).map_err(|source_err| CaptureError::Io {
        what: "opening",
        path: source.to_owned(),
        source: source_err,
    })?;
    let len = file
        .metadata()
        .map_err(|source_err| CaptureError::Io {
            what: "reading the size of",
            path: source.to_owned(),
            source: source_err,
        })?
        .len();
    if len == 0 {
        return Err(CaptureError::Empty {
            what: format!("{} has 0 bytes", source.display()),
        });
    }
    advise_sequential(&file);
    capture_disk_of(&FileDisk { file: &file, len }, out_dir, opts)
}

/// [`capture_disk`] of a disk source: the partition table first (the
/// primary GPT at the start; the end of the disk only when the primary is
/// unreadable, as `layout::read_layout` does), then the partitions in offset
/// order (the table's validation requires numbers and offsets to rise
/// together), each captured front to back.
pub fn capture_disk_of<S: DiskSource + ?Sized>(
    disk: &S,
    out_dir: &Path,
    opts: Options,
) -> Result<Layout, CaptureError> {
    let mut layout =
        layout::read_layout(&mut Cursor { disk, pos: 0 }).map_err(CaptureError::Layout)?;
    std::fs::create_dir_all(out_dir).map_err(|source| CaptureError::Io {
        what: "creating",
        path: out_dir.to_owned(),
        source,
    })?;
    let mut order: Vec<usize> = (0..layout.slots.len()).collect();
    order.sort_by_key(|i| layout.slots[*i].start_bytes);
    for i in order {
        let slot = &mut layout.slots[i];
        let region = Region {
            disk,
            start: slot.start_bytes,
            len: slot.size_bytes,
        };
        let info = fs::probe(&region);
        tracing::info!(partition = slot.number, fs = %info.fs_type, "capturing partition");
        slot.fs_type = Some(info.fs_type.clone());
        if !info.uuid.is_empty() {
            slot.uuid = Some(crate::format::uuid_string(&info.uuid));
        }
        if !info.label.is_empty() {
            slot.label = Some(info.label.clone());
        }
        if info.fs_type == "swap" {
            slot.role = Role::Swap;
            disk.release(slot.start_bytes, slot.start_bytes + slot.size_bytes);
            continue;
        }
        let name = format!("p{}", slot.number);
        let (ip, sp) = content_paths(out_dir, &name);
        capture_region_of(disk, slot.start_bytes, slot.size_bytes, &ip, &sp, opts).map_err(
            |e| match e {
                CaptureError::Fs { source, .. } => CaptureError::Fs {
                    partition: slot.number,
                    source,
                },
                other => other,
            },
        )?;
        slot.content_ref = Some(name);
    }
    write_layout(out_dir, &layout)?;
    Ok(layout)
}

/// Writes `layout.json` into `dir`.
pub fn write_layout(dir: &Path, layout: &Layout) -> Result<(), CaptureError> {
    let p = dir.join("layout.json");
    let json = serde_json::to_vec_pretty(layout).map_err(|e| CaptureError::Io {
        what: "serialising",
        path: p.clone(),
        source: io::Error::other(e),
    })?;
    std::fs::write(&p, json).map_err(|source| CaptureError::Io {
        what: "writing",
        path: p,
        source,
    })
}

/// Converts a qcow2 image to a sparse raw file `scratch` (read natively by
/// [`crate::qcow2`]: backing files, external data files and encryption are
/// refused), then captures it like a raw disk; `scratch` is removed after.
pub fn capture_qcow2(
    source: &Path,
    scratch: &Path,
    out_dir: &Path,
    opts: Options,
) -> Result<Layout, CaptureError> {
    let len = std::fs::metadata(source)
        .map_err(|source_err| CaptureError::Io {
            what: "reading the size of",
            path: source.to_owned(),
            source: source_err,
        })?
        .len();
    if len == 0 {
        return Err(CaptureError::Empty {
            what: format!("{} has 0 bytes", source.display()),
        });
    }
    source::qcow2_to_raw(source, scratch).map_err(CaptureError::Source)?;
    let r = capture_disk(scratch, out_dir, opts);
    let _ = std::fs::remove_file(scratch);
    r
}

/// Captures a single partclone image file (plain, `.gz`, `.zst`, or the
/// first of split parts `.aa`, `.ab`, ...) into `<out_dir>/<name>.*`.
pub fn capture_partclone_file(
    path: &Path,
    out_dir: &Path,
    name: &str,
    opts: Options,
) -> Result<(ContentIndex, FsInfo), CaptureError> {
    std::fs::create_dir_all(out_dir).map_err(|source| CaptureError::Io {
        what: "creating",
        path: out_dir.to_owned(),
        source,
    })?;
    let (input, kind) = source::open_partclone(path).map_err(CaptureError::Source)?;
    let (ip, sp) = content_paths(out_dir, name);
    match kind {
        source::ImageKind::Partclone => capture_partclone(input, &ip, &sp, opts),
        source::ImageKind::Raw => capture_raw_stream(input, &ip, &sp, opts),
    }
}

/// Captures a Clonezilla image directory: the partition table from
/// `<disk>-pt.sf`, each partition from its partclone image (swap from
/// `swappt-<part>.info`).
pub fn capture_clonezilla(
    dir: &Path,
    out_dir: &Path,
    opts: Options,
) -> Result<Layout, CaptureError> {
    let cz = source::read_clonezilla(dir).map_err(CaptureError::Source)?;
    if cz.images.is_empty() && cz.swaps.is_empty() {
        return Err(CaptureError::Empty {
            what: format!(
                "clonezilla image {} holds no partition image (no <part>.*-ptcl-img.* \
                 nor swappt-<part>.info)",
                dir.display()
            ),
        });
    }
    let mut layout = cz.layout;
    std::fs::create_dir_all(out_dir).map_err(|source| CaptureError::Io {
        what: "creating",
        path: out_dir.to_owned(),
        source,
    })?;
    for slot in &mut layout.slots {
        if let Some(sw) = cz.swaps.iter().find(|s| s.number == slot.number) {
            slot.role = Role::Swap;
            slot.fs_type = Some("swap".into());
            slot.uuid = sw.uuid.clone();
            slot.label = sw.label.clone();
            continue;
        }
        let Some(img) = cz.images.iter().find(|i| i.number == slot.number) else {
            continue;
        };
        let name = format!("p{}", slot.number);
        let (idx, info) = capture_partclone_file(&img.path, out_dir, &name, opts)?;
        if idx.header.partition_size > slot.size_bytes {
            return Err(CaptureError::Layout(LayoutError::Invalid(format!(
                "partition {} image is larger than its slot",
                slot.number
            ))));
        }
        slot.fs_type = Some(info.fs_type.clone());
        if !info.uuid.is_empty() {
            slot.uuid = Some(crate::format::uuid_string(&info.uuid));
        }
        if !info.label.is_empty() {
            slot.label = Some(info.label.clone());
        }
        slot.content_ref = Some(name);
    }
    write_layout(out_dir, &layout)?;
    Ok(layout)
}
