//! One content from the content server onto its slot: the index is fetched
//! and checked against its SHA-256, then the stream arrives in HTTP ranges of
//! whole pieces, verified and put in order, and goes to the content's
//! `SlotWriter` (`anneal_image::write`, the one write pipeline: slot check,
//! gaps zeroed, `O_DIRECT` writes at the slot's offset).
//!
//! Threads: one fetcher (ranges, piece by piece into aligned buffers), two
//! SHA-1 verifiers (each piece against the index), the caller's thread as
//! the writer (pieces in stream order, progress and abort), and one
//! SHA-256 thread over the written pieces in order (the whole-stream hash).
//! At most `BUFFERS` pieces are in memory.
//!
//! A range that fails (connect, status, short read) is re-fetched from the
//! first piece not received; a piece that fails its SHA-1 makes the writer
//! bump the *epoch* and ask the fetcher to start again from the first piece
//! not written: everything of an older epoch still in flight is dropped.
//! Each piece gets `retries` attempts after the first with doubling backoff.

use std::collections::BTreeMap;
use std::io::{self, Read as _};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use anneal_api::agent::PlannedContent;
use anneal_image::format::ContentIndex;
use anneal_image::restore::Target;
use anneal_image::write::{SlotRange, SlotWriter, piece_matches};
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

/// What the writer hears from the verifiers.
enum Msg<'a> {
    Piece { epoch: u64, i: u64, buf: Buf<'a> },
    Bad { epoch: u64, i: u64, buf: Buf<'a> },
    Fail { epoch: u64, err: DeployError },
}

/// Writer → fetcher: start again at `from` (the first piece not written).
struct Refetch {
    from: u64,
    epoch: u64,
    attempt: u32,
}

/// What the writer asks of its caller between pieces.
pub(super) trait Tick {
    /// Bytes of this content written so far; `log` is a line to report now.
    fn tick(&mut self, written: u64, log: Option<String>) -> Result<(), DeployError>;
}

/// The doubling backoff before attempt `attempt` (1-based), capped at 8 s.
fn backoff(first: Duration, attempt: u32) -> Duration {
    first
        .saturating_mul(1u32 << (attempt.saturating_sub(1)).min(10))
        .min(Duration::from_secs(8))
}

/// Sleeps `d` unless `stop` is raised first.
fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let end = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= end {
            return;
        }
        thread::sleep((end - now).min(Duration::from_millis(20)));
    }
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

impl HttpSource<'_> {
    fn name(&self) -> &str {
        &self.c.name
    }

    fn piece_length(&self) -> u64 {
        u64::from(self.index.header.piece_length)
    }

    /// End (in the stream) of piece `i`.
    fn piece_end(&self, i: u64) -> u64 {
        ((i + 1) * self.piece_length()).min(self.index.header.used_bytes)
    }
}

/// Streams content `src.c` (whose verified index is `src.index`) onto
/// `slot` of `target` through the content's [`SlotWriter`] (the slot
/// checked and the gaps zeroed before the first piece), then compares the
/// stream's SHA-256 with the plan's.
pub(super) fn write_content(
    target: &mut Target,
    slot: SlotRange,
    src: &HttpSource<'_>,
    tick: &mut dyn Tick,
) -> Result<(), DeployError> {
    let name = src.name();
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
    let (free_tx, free_rx) = mpsc::channel::<Buf<'_>>();
    for b in arena.buffers() {
        let _ = free_tx.send(b);
    }
    let (read_tx, read_rx) = mpsc::sync_channel::<Msg>(2);
    let read_rx = Mutex::new(read_rx);
    // room for every buffer: what the verifiers finish while a write runs
    // waits here, and the next write takes all of it at once
    let (ok_tx, ok_rx) = mpsc::sync_channel::<Msg>(nbuf);
    let (ctl_tx, ctl_rx) = mpsc::channel::<Refetch>();
    let (log_tx, log_rx) = mpsc::channel::<String>();
    let (sha_tx, sha_rx) = mpsc::channel::<(Buf<'_>, usize)>();
    let stop = AtomicBool::new(false);
    let (stop, read_rx) = (&stop, &read_rx);

    thread::scope(|s| -> Result<(), DeployError> {
        let fetcher = Fetcher {
            src,
            url: &url,
            stop,
            free_rx,
            free_tx: free_tx.clone(),
            read_tx,
            ctl_rx,
            log_tx,
        };
        s.spawn(move || fetcher.run());
        for _ in 0..VERIFIERS {
            let ok_tx = ok_tx.clone();
            s.spawn(move || verify(src.index, read_rx, &ok_tx));
        }
        drop(ok_tx);
        // whole-stream SHA-256, in order, after the write
        let sha_free_tx = free_tx.clone();
        let sha = s.spawn(move || {
            yield_to_writer();
            let mut h = sha2::Sha256::new();
            for (buf, len) in sha_rx {
                h.update(&buf[..len]);
                let _ = sha_free_tx.send(buf);
            }
            hex::encode(h.finalize())
        });
        let mut w = InOrder {
            src,
            writer: &writer,
            tick,
            free_tx,
            sha_tx,
            ctl_tx,
            epoch: 0,
            done: 0,
            written: 0,
            bad: (u64::MAX, 0),
            pending: BTreeMap::new(),
            writing: Duration::ZERO,
        };
        let began = Instant::now();
        let result = w.run(&ok_rx, &log_rx);
        stop.store(true, Ordering::Relaxed);
        drop(ok_rx);
        let (written, writing) = (w.written, w.writing);
        let tick = w.finish();
        let digest = sha.join().map_err(|_| {
            DeployError::Mismatch(format!("content {name}: the SHA-256 thread panicked"))
        })?;
        result?;
        tracing::info!(
            content = %name,
            bytes = written,
            seconds = began.elapsed().as_secs_f64(),
            write_seconds = writing.as_secs_f64(),
            "content written"
        );
        tick.tick(written, None)?;
        if !digest.eq_ignore_ascii_case(src.c.stream_sha256.trim()) {
            return Err(DeployError::StreamHash {
                content: name.to_string(),
                want: src.c.stream_sha256.clone(),
                got: digest,
            });
        }
        Ok(())
    })
}

/// The fetcher thread of [`write_content`]: ranges of `src.opts.range_bytes`,
/// piece by piece into free buffers, to the verifiers; starts again where
/// the writer asks (a piece that failed its SHA-1), retries a failed range
/// with backoff.
struct Fetcher<'s, 'b> {
    src: &'s HttpSource<'s>,
    url: &'s Url,
    stop: &'s AtomicBool,
    free_rx: mpsc::Receiver<Buf<'b>>,
    free_tx: mpsc::Sender<Buf<'b>>,
    read_tx: mpsc::SyncSender<Msg<'b>>,
    ctl_rx: mpsc::Receiver<Refetch>,
    log_tx: mpsc::Sender<String>,
}

/// Where the fetcher is.
struct FetchState {
    next: u64,
    epoch: u64,
    /// failed attempts of the piece `fails.0`
    fails: (u64, u32),
    pending_refetch: Option<Refetch>,
    /// the open range and its first piece
    body: Option<(fetch::Body, u64)>,
}

impl<'b> Fetcher<'_, 'b> {
    fn run(self) {
        yield_to_writer();
        let pieces = self.src.index.piece_count();
        let mut st = FetchState {
            next: 0,
            epoch: 0,
            fails: (u64::MAX, 0),
            pending_refetch: None,
            body: None,
        };
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let ctl = st
                .pending_refetch
                .take()
                .or_else(|| self.ctl_rx.try_iter().last());
            if let Some(r) = ctl {
                st.next = r.from;
                st.epoch = r.epoch;
                st.body = None;
                sleep_unless(self.stop, backoff(self.src.opts.backoff, r.attempt));
                continue;
            }
            if st.next >= pieces {
                // everything sent: wait for a refetch or the end
                match self.ctl_rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(r) => st.pending_refetch = Some(r),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                continue;
            }
            let Some(b) = self.free_buffer(&mut st) else {
                if self.stop.load(Ordering::Relaxed) || st.pending_refetch.is_none() {
                    return;
                }
                continue;
            };
            if !self.fetch_piece(&mut st, b) {
                return;
            }
        }
    }

    /// A free buffer; none when stopping, when the buffers are gone, or
    /// when a refetch arrived first (in `st.pending_refetch`).
    fn free_buffer(&self, st: &mut FetchState) -> Option<Buf<'b>> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            if let Some(r) = self.ctl_rx.try_iter().last() {
                st.pending_refetch = Some(r);
                return None;
            }
            match self.free_rx.recv_timeout(Duration::from_millis(20)) {
                Ok(b) => return Some(b),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Fetches piece `st.next` into `b` and sends it on, or counts the
    /// failure (backoff, or the error once the retries are spent). False
    /// when the fetcher must end.
    fn fetch_piece(&self, st: &mut FetchState, b: Buf<'b>) -> bool {
        let src = self.src;
        let opts = src.opts;
        match self.read_piece(st, b) {
            Ok(b) => {
                let i = st.next;
                st.next += 1;
                let per_range = (opts.range_bytes / src.piece_length()).max(1);
                if st
                    .body
                    .as_ref()
                    .is_some_and(|(_, first)| st.next - first >= per_range)
                {
                    st.body = None;
                }
                let epoch = st.epoch;
                self.read_tx.send(Msg::Piece { epoch, i, buf: b }).is_ok()
            }
            Err((b, reason)) => {
                let _ = self.free_tx.send(b);
                st.body = None;
                let next = st.next;
                if st.fails.0 != next {
                    st.fails = (next, 0);
                }
                st.fails.1 += 1;
                let (a, e) = (next * src.piece_length(), src.piece_end(next));
                if st.fails.1 > opts.retries {
                    let err = DeployError::Range {
                        content: src.name().to_string(),
                        piece: next,
                        start: a,
                        end: e,
                        attempts: st.fails.1,
                        reason,
                    };
                    let _ = self.read_tx.send(Msg::Fail {
                        epoch: st.epoch,
                        err,
                    });
                    return false;
                }
                let d = backoff(opts.backoff, st.fails.1);
                let _ = self.log_tx.send(format!(
                    "retry: content {} piece {next} (stream bytes {a}..{e}) from {}: {reason}; attempt {} of {} in {:.1} s",
                    src.name(),
                    self.url,
                    st.fails.1 + 1,
                    opts.retries + 1,
                    d.as_secs_f64()
                ));
                sleep_unless(self.stop, d);
                true
            }
        }
    }

    /// Reads piece `st.next` from the open range (opening the next range
    /// first when none is open).
    fn read_piece(&self, st: &mut FetchState, b: Buf<'b>) -> Result<Buf<'b>, (Buf<'b>, String)> {
        let src = self.src;
        let pieces = src.index.piece_count();
        let start = st.next * src.piece_length();
        let len = (src.piece_end(st.next) - start) as usize;
        if st.body.is_none() {
            let per_range = (src.opts.range_bytes / src.piece_length()).max(1);
            let last = (st.next + per_range).min(pieces);
            let range_end = src.piece_end(last - 1);
            match fetch::get_range(self.url, start, range_end, src.opts.timeout, src.tls) {
                Ok(bd) => st.body = Some((bd, st.next)),
                Err(e) => return Err((b, crate::jsonl::chain(&e))),
            }
        }
        let Some((bd, _)) = st.body.as_mut() else {
            return Err((b, "no connection".into()));
        };
        let mut got = 0usize;
        while got < len {
            match bd.read(&mut b[got..len]) {
                Ok(0) => {
                    return Err((b, format!("connection closed after {got} of {len} bytes")));
                }
                Ok(n) => {
                    got += n;
                    src.counters
                        .http_bytes
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err((b, e.to_string())),
            }
        }
        Ok(b)
    }
}

/// A verifier thread of [`write_content`]: each piece against the index's
/// SHA-1, good or bad, on to the writer.
fn verify<'b>(
    index: &ContentIndex,
    read_rx: &Mutex<mpsc::Receiver<Msg<'b>>>,
    ok_tx: &mpsc::SyncSender<Msg<'b>>,
) {
    yield_to_writer();
    loop {
        let msg = match read_rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(msg) = msg else { return };
        let out = match msg {
            Msg::Piece { epoch, i, buf } => {
                let len = index.piece_len(i) as usize;
                if piece_matches(index, i, &buf[..len]) {
                    Msg::Piece { epoch, i, buf }
                } else {
                    Msg::Bad { epoch, i, buf }
                }
            }
            other => other,
        };
        if ok_tx.send(out).is_err() {
            return;
        }
    }
}

/// The writer of [`write_content`] (the caller's thread): puts the
/// verified pieces back in stream order and hands each run ready in order
/// (up to [`MAX_WRITE`] bytes) to the [`SlotWriter`] at once; a bad piece
/// bumps the epoch and asks the fetcher to start again from the first
/// piece not written.
struct InOrder<'s, 'w, 't, 'b> {
    src: &'s HttpSource<'s>,
    writer: &'w SlotWriter<&'w Target, &'w ContentIndex>,
    tick: &'t mut dyn Tick,
    free_tx: mpsc::Sender<Buf<'b>>,
    sha_tx: mpsc::Sender<(Buf<'b>, usize)>,
    ctl_tx: mpsc::Sender<Refetch>,
    epoch: u64,
    /// pieces written (the first not written)
    done: u64,
    /// stream bytes written
    written: u64,
    /// failed attempts of piece `bad.0`
    bad: (u64, u32),
    pending: BTreeMap<u64, Buf<'b>>,
    /// time inside the target's writes: the restore part of the deploy
    writing: Duration,
}

impl<'t, 'b> InOrder<'_, '_, 't, 'b> {
    fn run(
        &mut self,
        ok_rx: &mpsc::Receiver<Msg<'b>>,
        log_rx: &mpsc::Receiver<String>,
    ) -> Result<(), DeployError> {
        let pieces = self.src.index.piece_count();
        while self.done < pieces {
            for line in log_rx.try_iter() {
                self.tick.tick(self.written, Some(line))?;
            }
            self.tick.tick(self.written, None)?;
            let first = match ok_rx.recv_timeout(Duration::from_millis(100)) {
                Ok(m) => m,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(DeployError::Mismatch(format!(
                        "content {}: the fetcher stopped after {} of {pieces} pieces",
                        self.src.name(),
                        self.done
                    )));
                }
            };
            // this message and every one already waiting: the pieces
            // ready in order then go out in as few writes as they can
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                self.receive(msg)?;
                next = ok_rx.try_recv().ok();
            }
            while self.pending.contains_key(&self.done) {
                self.write_ready()?;
            }
        }
        Ok(())
    }

    /// Files one verifier message: a piece of this epoch waits for its
    /// turn, a bad one asks for a refetch (or fails once its retries are
    /// spent), anything of an older epoch is dropped.
    fn receive(&mut self, msg: Msg<'b>) -> Result<(), DeployError> {
        let epoch = self.epoch;
        match msg {
            Msg::Piece { epoch: e, buf, .. } | Msg::Bad { epoch: e, buf, .. } if e != epoch => {
                let _ = self.free_tx.send(buf);
            }
            Msg::Fail { epoch: e, .. } if e != epoch => {}
            Msg::Fail { err, .. } => return Err(err),
            Msg::Bad { i, buf, .. } => {
                let _ = self.free_tx.send(buf);
                self.refetch(i)?;
            }
            Msg::Piece { i, buf, .. } => {
                self.pending.insert(i, buf);
            }
        }
        Ok(())
    }

    /// Piece `i` failed its SHA-1: a new epoch from the first piece not
    /// written, after a backoff.
    fn refetch(&mut self, i: u64) -> Result<(), DeployError> {
        let src = self.src;
        if self.bad.0 != i {
            self.bad = (i, 0);
        }
        self.bad.1 += 1;
        let (a, e) = (i * src.piece_length(), src.piece_end(i));
        if self.bad.1 > src.opts.retries {
            return Err(DeployError::PieceHash {
                content: src.name().to_string(),
                piece: i,
                start: a,
                end: e,
                attempts: self.bad.1,
            });
        }
        self.epoch += 1;
        for (_, b) in std::mem::take(&mut self.pending) {
            let _ = self.free_tx.send(b);
        }
        let d = backoff(src.opts.backoff, self.bad.1);
        self.tick.tick(
            self.written,
            Some(format!(
                "retry: content {} piece {i} (stream bytes {a}..{e}) failed its SHA-1; re-fetching from piece {}, attempt {} of {} in {:.1} s",
                src.name(),
                self.done,
                self.bad.1 + 1,
                src.opts.retries + 1,
                d.as_secs_f64()
            )),
        )?;
        let _ = self.ctl_tx.send(Refetch {
            from: self.done,
            epoch: self.epoch,
            attempt: self.bad.1,
        });
        Ok(())
    }

    /// Writes the run of pieces ready in order from `done` (up to
    /// [`MAX_WRITE`] bytes), then passes them to the SHA-256 thread.
    fn write_ready(&mut self) -> Result<(), DeployError> {
        let src = self.src;
        let mut batch: Vec<(u64, Buf<'b>)> = Vec::new();
        let mut bytes = 0u64;
        while bytes < MAX_WRITE
            && let Some(buf) = self.pending.remove(&(self.done + batch.len() as u64))
        {
            let i = self.done + batch.len() as u64;
            bytes += src.piece_end(i) - i * src.piece_length();
            batch.push((i, buf));
        }
        let t = Instant::now();
        let bufs: Vec<&[u8]> = batch.iter().map(|(_, b)| &b[..]).collect();
        let res = self.writer.write_pieces(self.done, &bufs);
        drop(bufs);
        self.writing += t.elapsed();
        if let Err(e) = res {
            for (_, b) in batch {
                let _ = self.free_tx.send(b);
            }
            return Err(DeployError::Slot(e));
        }
        for (i, buf) in batch {
            let len = src.piece_end(i) - i * src.piece_length();
            let _ = self.sha_tx.send((buf, len as usize));
            self.written += len;
            self.done += 1;
        }
        Ok(())
    }

    /// Ends the writer's part: the SHA-256 thread and the fetcher are let
    /// go (their channels closed); gives the caller's tick back.
    fn finish(self) -> &'t mut dyn Tick {
        self.tick
    }
}
