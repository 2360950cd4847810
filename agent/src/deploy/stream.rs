//! One content from the content server onto its slot: the index is fetched
//! and checked against its SHA-256, then the stream's HTTP ranges of whole
//! pieces ([`HttpRanges`], a `PieceSource`) are pumped into the content's
//! `SlotWriter` by `anneal_image::write::pump`, the pipeline a restore
//! from a stream file uses too (docs/content-format.md, "Writing a
//! content"): one fetcher thread (piece by piece into the huge-page
//! [`Arena`]'s buffers), two SHA-1 verifiers, the caller's thread as the
//! writer (pieces in stream order, runs of up to [`MAX_WRITE`] bytes,
//! progress and abort), one SHA-256 thread over the written pieces (the
//! whole-stream hash, compared with the plan's).
//!
//! A range that fails (connect, status, short read) is re-fetched from the
//! first piece not received; a piece that fails its SHA-1 makes the writer
//! bump the *epoch* and ask the fetcher to start again from the first piece
//! not written: everything of an older epoch still in flight is dropped.
//! Each piece gets `retries` attempts after the first with doubling backoff.

use std::io::{self, Read as _};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anneal_api::agent::PlannedContent;
use anneal_image::format::ContentIndex;
use anneal_image::restore::Target;
use anneal_image::write::{PieceSource, PumpError, PumpOptions, SlotRange, SlotWriter, pump};
use sha2::Digest as _;

use super::{DeployError, DeployOptions};
use crate::fetch::{self, FetchOptions, Url};

/// Pieces in memory at once (fetched, verifying, being written or hashed).
const BUFFERS_BYTES: usize = 64 << 20;
/// The largest write: a run of verified pieces contiguous on the disk goes
/// out as one vectored write of up to this many bytes (`dd bs=4M` writes
/// 4 MiB at a time; one write per 1 MiB piece was slower than it).
const MAX_WRITE: u64 = 8 << 20;
/// SHA-1 verifier threads.
const VERIFIERS: usize = 2;
/// Alignment of the piece arena: a transparent huge page.
const HUGE_PAGE: usize = 2 << 20;
/// `O_DIRECT` alignment of each piece buffer.
const DIRECT_ALIGN: usize = 4096;

/// One piece buffer: a window of the [`Arena`].
type Buf<'a> = &'a mut [u8];

/// The piece buffers, carved from one allocation aligned to a huge page
/// and advised `MADV_HUGEPAGE`. An `O_DIRECT` write pins its buffer's
/// pages and hands the device one segment per physically contiguous run:
/// from 4 KiB pages a 4 MiB write is 1024 segments, which the block layer
/// splits into requests of at most `max_segments` (254 on virtio-blk, so
/// ~1 MiB each); from huge pages a 1 MiB piece is one segment and an
/// 8 MiB write leaves in requests of `max_sectors_kb`. Where the kernel
/// has no transparent huge pages (or refuses), the buffers are ordinary
/// pages and only the advice is lost.
struct Arena {
    region: sys::Region,
    stride: usize,
    count: usize,
}

impl Arena {
    fn new(count: usize, piece: usize) -> io::Result<Self> {
        let stride = piece.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let region = sys::Region::new((stride * count).div_ceil(HUGE_PAGE) * HUGE_PAGE)?;
        Ok(Arena {
            region,
            stride,
            count,
        })
    }

    /// The buffers, each `stride` bytes at a 4096-aligned address.
    fn buffers(&mut self) -> Vec<Buf<'_>> {
        self.region.as_mut_slice()[..self.stride * self.count]
            .chunks_exact_mut(self.stride)
            .collect()
    }
}

#[allow(unsafe_code)]
mod sys {
    use std::ffi::c_void;
    use std::io;
    use std::ptr::NonNull;

    use rustix::mm::{Advice, MapFlags, ProtFlags, madvise, mmap_anonymous, munmap};

    use super::HUGE_PAGE;

    /// Anonymous private memory of `len` bytes (a multiple of
    /// [`HUGE_PAGE`]) at an address aligned to a huge page, advised
    /// `MADV_HUGEPAGE` before anything touches it, zero-filled, unmapped
    /// on drop. Its own mapping, so never memory malloc recycled (and
    /// already faulted in with small pages).
    pub(super) struct Region {
        map: NonNull<c_void>,
        map_len: usize,
        start: usize,
        len: usize,
    }

    // SAFETY: the region is plain memory owned by this value; access goes
    // through `&mut self` only.
    unsafe impl Send for Region {}

    impl Region {
        pub(super) fn new(len: usize) -> io::Result<Self> {
            let map_len = len + HUGE_PAGE;
            // SAFETY: a fresh anonymous private mapping at an address the
            // kernel chooses: nothing else refers to it.
            let ptr = unsafe {
                mmap_anonymous(
                    std::ptr::null_mut(),
                    map_len,
                    ProtFlags::READ | ProtFlags::WRITE,
                    MapFlags::PRIVATE,
                )
            }?;
            let map = NonNull::new(ptr).ok_or_else(|| io::Error::other("mmap returned null"))?;
            let start = (ptr as usize).next_multiple_of(HUGE_PAGE) - ptr as usize;
            let region = Region {
                map,
                map_len,
                start,
                len,
            };
            // SAFETY: `[start, start+len)` lies inside the mapping (the
            // mapping is `len + HUGE_PAGE` long and `start < HUGE_PAGE`);
            // the advice only changes how later faults are backed.
            let advised = unsafe {
                madvise(
                    ptr.cast::<u8>().add(start).cast(),
                    len,
                    Advice::LinuxHugepage,
                )
            };
            if let Err(e) = advised {
                tracing::debug!(error = %e, "MADV_HUGEPAGE refused; piece buffers on 4 KiB pages");
            }
            Ok(region)
        }

        pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
            // SAFETY: the range is inside the live mapping (see `new`),
            // readable and writable, zero-filled at first; the returned
            // borrow is tied to `&mut self`, so it is the only access.
            unsafe {
                std::slice::from_raw_parts_mut(
                    self.map.as_ptr().cast::<u8>().add(self.start),
                    self.len,
                )
            }
        }
    }

    impl Drop for Region {
        fn drop(&mut self) {
            // SAFETY: the whole mapping made in `new`; no borrow of it
            // outlives `self`.
            if let Err(e) = unsafe { munmap(self.map.as_ptr(), self.map_len) } {
                tracing::warn!(error = %e, "munmap of the piece buffers failed");
            }
        }
    }
}
/// The largest index accepted.
const MAX_INDEX_BYTES: u64 = 256 << 20;

/// Counters the writer reads for progress.
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Bytes fetched over HTTP (index and stream, retries included).
    pub http_bytes: AtomicU64,
}

/// Fetches the index of `c`, checks its SHA-256 and parses it.
/// Lowers the calling thread's priority (nice +5): the fetcher, verifiers
/// and the whole-stream hash keep both cores busy, and the writer, blocked
/// in its write while they run, then waited for a core when the write
/// completed: the disk sat idle for that time (our writes measured 0.8x
/// of `dd oflag=direct` on a quiet machine). The writer keeps its
/// priority, so its wake-up preempts them. Best effort.
fn yield_to_writer() {
    let tid = rustix::thread::gettid();
    let now = rustix::process::getpriority_process(Some(tid)).unwrap_or(0);
    let _ = rustix::process::setpriority_process(Some(tid), (now + 5).min(19));
}

pub(super) fn fetch_index(
    c: &PlannedContent,
    opts: &DeployOptions,
    tls: Option<&Arc<rustls::ClientConfig>>,
    counters: &Counters,
) -> Result<ContentIndex, DeployError> {
    let fopts = FetchOptions {
        timeout: opts.timeout,
        retries: opts.retries,
        ca_bundle: None,
        backoff: opts.backoff,
    };
    let fetch_err = |source| DeployError::Fetch {
        content: c.name.clone(),
        what: "index",
        source,
    };
    let body = fetch::get(&c.index_url, &fopts, tls).map_err(fetch_err)?;
    let mut bytes = Vec::new();
    body.take(MAX_INDEX_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| DeployError::ReadIndex {
            content: c.name.clone(),
            url: c.index_url.clone(),
            source,
        })?;
    counters
        .http_bytes
        .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    if bytes.len() as u64 > MAX_INDEX_BYTES {
        return Err(DeployError::Mismatch(format!(
            "the index of content {} at {} is larger than {MAX_INDEX_BYTES} bytes",
            c.name, c.index_url
        )));
    }
    let got = hex::encode(sha2::Sha256::digest(&bytes));
    if !got.eq_ignore_ascii_case(c.index_sha256.trim()) {
        return Err(DeployError::IndexHash {
            content: c.name.clone(),
            url: c.index_url.clone(),
            want: c.index_sha256.clone(),
            got,
        });
    }
    let index = ContentIndex::parse(&bytes).map_err(|source| DeployError::Index {
        content: c.name.clone(),
        source,
    })?;
    if index.header.used_bytes != c.stream_bytes {
        return Err(DeployError::Mismatch(format!(
            "content {}: the index describes {} stream bytes, the plan says {}",
            c.name, index.header.used_bytes, c.stream_bytes
        )));
    }
    Ok(index)
}

/// What the writer asks of its caller between pieces.
pub(super) trait Tick {
    /// Bytes of this content written so far; `log` is a line to report now.
    fn tick(&mut self, written: u64, log: Option<String>) -> Result<(), DeployError>;
}

/// One content's HTTP source: the plan's entry, its verified index and how
/// to fetch.
pub(super) struct HttpSource<'a> {
    /// The plan's entry (URLs, stream SHA-256).
    pub c: &'a PlannedContent,
    /// The index, already checked against the plan.
    pub index: &'a ContentIndex,
    /// Timeouts, retries, range size.
    pub opts: &'a DeployOptions,
    /// TLS for https URLs.
    pub tls: Option<&'a Arc<rustls::ClientConfig>>,
    /// Bytes fetched, for progress.
    pub counters: &'a Counters,
}

/// Streams content `src.c` (whose verified index is `src.index`) onto
/// `slot` of `target`: HTTP ranges pumped into the content's
/// [`SlotWriter`] (`anneal_image::write::pump`: the slot checked and the
/// gaps zeroed before the first piece, pieces verified, re-fetched with
/// backoff, written in order), then the stream's SHA-256 compared with the
/// plan's.
pub(super) fn write_content(
    target: &mut Target,
    slot: SlotRange,
    src: &HttpSource<'_>,
    tick: &mut dyn Tick,
) -> Result<(), DeployError> {
    let name = src.c.name.as_str();
    let url = Url::parse(&src.c.stream_url).map_err(|source| DeployError::Fetch {
        content: name.to_string(),
        what: "stream",
        source,
    })?;
    let writer = SlotWriter::open(&*target, slot, name, src.index).map_err(DeployError::Slot)?;
    let pl = src.index.header.piece_length as usize;
    let nbuf = BUFFERS_BYTES.div_ceil(pl).clamp(3, 16);
    let mut arena = Arena::new(nbuf, pl).map_err(|source| DeployError::Write {
        content: name.to_string(),
        what: format!("allocating {nbuf} piece buffers of {pl} bytes"),
        source,
    })?;
    let ranges = HttpRanges {
        src,
        url: &url,
        body: None,
    };
    let opts = PumpOptions {
        retries: src.opts.retries,
        backoff: src.opts.backoff,
        max_write: MAX_WRITE,
        verifiers: VERIFIERS,
        stream_sha256: true,
        helper_start: yield_to_writer,
    };
    let mut abort = None;
    let mut on_tick = |written: u64, log: Option<String>| match tick.tick(written, log) {
        Ok(()) => true,
        Err(e) => {
            abort = Some(e);
            false
        }
    };
    let began = Instant::now();
    let res = pump(&writer, ranges, arena.buffers(), &opts, &mut on_tick);
    let done = res.map_err(|e| pump_error(e, abort.take()))?;
    tracing::info!(
        content = %name,
        bytes = done.bytes,
        seconds = began.elapsed().as_secs_f64(),
        write_seconds = done.writing.as_secs_f64(),
        "content written"
    );
    let digest = done.stream_sha256.unwrap_or_default();
    if !digest.eq_ignore_ascii_case(src.c.stream_sha256.trim()) {
        return Err(DeployError::StreamHash {
            content: name.to_string(),
            want: src.c.stream_sha256.clone(),
            got: digest,
        });
    }
    Ok(())
}

/// The deploy's error for a pump that stopped (`abort`: the tick's own
/// error, when the tick stopped it).
fn pump_error(e: PumpError, abort: Option<DeployError>) -> DeployError {
    match e {
        PumpError::Read {
            content,
            piece,
            start,
            end,
            attempts,
            source,
        } => DeployError::Range {
            content,
            piece,
            start,
            end,
            attempts,
            reason: source.to_string(),
        },
        PumpError::PieceHash {
            content,
            piece,
            start,
            end,
            attempts,
        } => DeployError::PieceHash {
            content,
            piece,
            start,
            end,
            attempts,
        },
        PumpError::Slot(e) => DeployError::Slot(e),
        PumpError::Aborted => abort.unwrap_or_else(|| {
            DeployError::Mismatch("the content's write stopped on request".into())
        }),
        PumpError::Stopped {
            content,
            done,
            pieces,
        } => DeployError::Mismatch(format!(
            "content {content}: the fetcher stopped after {done} of {pieces} pieces"
        )),
    }
}

/// The content's stream as a [`PieceSource`]: HTTP ranges of
/// `opts.range_bytes` (whole pieces), read piece by piece; a range is
/// reopened where the pump asks for a piece the open one does not hold
/// next.
struct HttpRanges<'s> {
    src: &'s HttpSource<'s>,
    url: &'s Url,
    /// the open range: its body, its first piece, the next piece it holds
    body: Option<(fetch::Body, u64, u64)>,
}

impl PieceSource for HttpRanges<'_> {
    fn read_piece(&mut self, i: u64, buf: &mut [u8], len: usize) -> io::Result<()> {
        let src = self.src;
        let pl = u64::from(src.index.header.piece_length);
        let per_range = (src.opts.range_bytes / pl).max(1);
        if self.body.as_ref().is_some_and(|(_, _, next)| *next != i) {
            self.body = None;
        }
        let start = i * pl;
        if self.body.is_none() {
            let last = (i + per_range).min(src.index.piece_count());
            let range_end = ((last * pl).min(src.index.header.used_bytes)).max(start);
            let bd = fetch::get_range(self.url, start, range_end, src.opts.timeout, src.tls)
                .map_err(|e| io::Error::other(crate::jsonl::chain(&e)))?;
            self.body = Some((bd, i, i));
        }
        let Some((bd, first, next)) = self.body.as_mut() else {
            return Err(io::Error::other("no connection"));
        };
        let mut got = 0usize;
        while got < len {
            match bd.read(&mut buf[got..len]) {
                Ok(0) => {
                    return Err(io::Error::other(format!(
                        "connection closed after {got} of {len} bytes"
                    )));
                }
                Ok(n) => {
                    got += n;
                    src.counters
                        .http_bytes
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        *next = i + 1;
        if *next - *first >= per_range {
            self.body = None;
        }
        Ok(())
    }

    fn restart(&mut self) {
        self.body = None;
    }

    fn origin(&self) -> String {
        self.url.to_string()
    }
}
