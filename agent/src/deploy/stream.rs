//! One content from the content server onto its slot: the index is fetched
//! and checked against its SHA-256, then the stream arrives in HTTP ranges of
//! whole pieces and goes straight into verified, ordered writes at the
//! slot's offset (the pipeline of `anneal_image::restore::write_content`,
//! fed by the network instead of a file).
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
use anneal_image::format::{ContentIndex, FLAG_GAPS_ZERO, StreamMap};
use anneal_image::restore::Target;
use sha1::Digest as _;

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

/// Streams content `c` (whose verified `index` is given) onto `target` at
/// `base`, inside a slot of `slot_size` bytes. Returns the stream's SHA-256
/// (already compared with the plan's).
#[allow(clippy::too_many_arguments)]
pub(super) fn write_content(
    target: &mut Target,
    base: u64,
    slot_size: u64,
    c: &PlannedContent,
    index: &ContentIndex,
    opts: &DeployOptions,
    tls: Option<&Arc<rustls::ClientConfig>>,
    counters: &Counters,
    tick: &mut dyn Tick,
) -> Result<(), DeployError> {
    let h = &index.header;
    if h.partition_size > slot_size {
        return Err(DeployError::Mismatch(format!(
            "content {} ({} bytes) is larger than its slot ({slot_size} bytes)",
            c.name, h.partition_size
        )));
    }
    if base
        .checked_add(slot_size)
        .is_none_or(|e| e > target.size())
    {
        return Err(DeployError::Mismatch(format!(
            "content {}: slot at {base}+{slot_size} is past the end of the target ({} bytes)",
            c.name,
            target.size()
        )));
    }
    let url = Url::parse(&c.stream_url).map_err(|source| DeployError::Fetch {
        content: c.name.clone(),
        what: "stream",
        source,
    })?;
    if h.flags & FLAG_GAPS_ZERO != 0 {
        let zero_err = |source| DeployError::Write {
            content: c.name.clone(),
            what: "zeroing the gaps between extents".into(),
            source,
        };
        let mut pos = 0u64;
        for e in &index.extents {
            target
                .zero_range(base + pos, e.offset - pos)
                .map_err(zero_err)?;
            pos = e.end();
        }
        target
            .zero_range(base + pos, h.partition_size - pos)
            .map_err(zero_err)?;
    }
    let pieces = index.piece_count();
    let used = h.used_bytes;
    let piece_length = u64::from(h.piece_length);
    let pl = h.piece_length as usize;
    let per_range = (opts.range_bytes / piece_length).max(1);
    let nbuf = BUFFERS_BYTES.div_ceil(pl).clamp(3, 16);
    let piece_end = |i: u64| ((i + 1) * piece_length).min(used);

    let mut arena = Arena::new(nbuf, pl).map_err(|source| DeployError::Write {
        content: c.name.clone(),
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
    let target_ref: &Target = target;
    let name = c.name.as_str();
    let hashes = &index.piece_hashes;
    let map = StreamMap::new(&index.extents);
    let (stop, read_rx) = (&stop, &read_rx);

    thread::scope(|s| -> Result<(), DeployError> {
        // fetcher
        let fetch_free_tx = free_tx.clone();
        let url = &url;
        s.spawn(move || {
            yield_to_writer();
            let mut next = 0u64;
            let mut epoch = 0u64;
            // failed attempts of the piece `fails.0`
            let mut fails: (u64, u32) = (u64::MAX, 0);
            let mut pending_refetch: Option<Refetch> = None;
            let mut body: Option<(fetch::Body, u64)> = None;
            loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let ctl = pending_refetch.take().or_else(|| ctl_rx.try_iter().last());
                if let Some(r) = ctl {
                    next = r.from;
                    epoch = r.epoch;
                    body = None;
                    sleep_unless(stop, backoff(opts.backoff, r.attempt));
                    continue;
                }
                if next >= pieces {
                    // everything sent: wait for a refetch or the end
                    match ctl_rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(r) => pending_refetch = Some(r),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                    continue;
                }
                let buf = loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    if let Some(r) = ctl_rx.try_iter().last() {
                        pending_refetch = Some(r);
                        break None;
                    }
                    match free_rx.recv_timeout(Duration::from_millis(20)) {
                        Ok(b) => break Some(b),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                };
                let Some(b) = buf else { continue };
                let start = next * piece_length;
                let end = piece_end(next);
                let len = (end - start) as usize;
                let res = (|| -> Result<(), String> {
                    if body.is_none() {
                        let last = (next + per_range).min(pieces);
                        let range_end = piece_end(last - 1);
                        let bd = fetch::get_range(url, start, range_end, opts.timeout, tls)
                            .map_err(|e| crate::jsonl::chain(&e))?;
                        body = Some((bd, next));
                    }
                    let Some((bd, _)) = body.as_mut() else {
                        return Err("no connection".into());
                    };
                    let dst = &mut b[..len];
                    let mut got = 0usize;
                    while got < len {
                        match bd.read(&mut dst[got..]) {
                            Ok(0) => {
                                return Err(format!(
                                    "connection closed after {got} of {len} bytes"
                                ));
                            }
                            Ok(n) => {
                                got += n;
                                counters.http_bytes.fetch_add(n as u64, Ordering::Relaxed);
                            }
                            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                            Err(e) => return Err(e.to_string()),
                        }
                    }
                    Ok(())
                })();
                match res {
                    Ok(()) => {
                        let i = next;
                        next += 1;
                        if body.as_ref().is_some_and(|(_, first)| next - first >= per_range) {
                            body = None;
                        }
                        if read_tx.send(Msg::Piece { epoch, i, buf: b }).is_err() {
                            return;
                        }
                    }
                    Err(reason) => {
                        let _ = fetch_free_tx.send(b);
                        body = None;
                        if fails.0 != next {
                            fails = (next, 0);
                        }
                        fails.1 += 1;
                        let (a, e) = (next * piece_length, piece_end(next));
                        if fails.1 > opts.retries {
                            let err = DeployError::Range {
                                content: name.to_string(),
                                piece: next,
                                start: a,
                                end: e,
                                attempts: fails.1,
                                reason,
                            };
                            let _ = read_tx.send(Msg::Fail { epoch, err });
                            return;
                        }
                        let d = backoff(opts.backoff, fails.1);
                        let _ = log_tx.send(format!(
                            "retry: content {name} piece {next} (stream bytes {a}..{e}) from {url}: {reason}; attempt {} of {} in {:.1} s",
                            fails.1 + 1,
                            opts.retries + 1,
                            d.as_secs_f64()
                        ));
                        sleep_unless(stop, d);
                    }
                }
            }
        });
        // verifiers
        for _ in 0..VERIFIERS {
            let ok_tx = ok_tx.clone();
            s.spawn(move || {
                yield_to_writer();
                loop {
                    let msg = match read_rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    let Ok(msg) = msg else { return };
                    let out = match msg {
                        Msg::Piece { epoch, i, buf } => {
                            let len = (piece_end(i) - i * piece_length) as usize;
                            let d: [u8; 20] = sha1::Sha1::digest(&buf[..len]).into();
                            if hashes.get(i as usize) == Some(&d) {
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
            });
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
        // writer: this thread
        let mut epoch = 0u64;
        let mut done = 0u64;
        let mut written = 0u64;
        let mut bad: (u64, u32) = (u64::MAX, 0);
        let mut pending: BTreeMap<u64, Buf<'_>> = BTreeMap::new();
        // time inside the target's writes: the restore part of the deploy
        let mut writing = Duration::ZERO;
        let began = Instant::now();
        let result = (|| -> Result<(), DeployError> {
            while done < pieces {
                for line in log_rx.try_iter() {
                    tick.tick(written, Some(line))?;
                }
                tick.tick(written, None)?;
                let first = match ok_rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(m) => m,
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(DeployError::Mismatch(format!(
                            "content {name}: the fetcher stopped after {done} of {pieces} pieces"
                        )));
                    }
                };
                // this message and every one already waiting: the pieces
                // ready in order then go out in as few writes as they can
                let mut next = Some(first);
                while let Some(msg) = next.take() {
                    match msg {
                        Msg::Piece { epoch: e, buf, .. } | Msg::Bad { epoch: e, buf, .. }
                            if e != epoch =>
                        {
                            let _ = free_tx.send(buf);
                        }
                        Msg::Fail { epoch: e, .. } if e != epoch => {}
                        Msg::Fail { err, .. } => return Err(err),
                        Msg::Bad { i, buf, .. } => {
                            let _ = free_tx.send(buf);
                            if bad.0 != i {
                                bad = (i, 0);
                            }
                            bad.1 += 1;
                            let (a, e) = (i * piece_length, piece_end(i));
                            if bad.1 > opts.retries {
                                return Err(DeployError::PieceHash {
                                    content: name.to_string(),
                                    piece: i,
                                    start: a,
                                    end: e,
                                    attempts: bad.1,
                                });
                            }
                            epoch += 1;
                            for (_, b) in std::mem::take(&mut pending) {
                                let _ = free_tx.send(b);
                            }
                            let d = backoff(opts.backoff, bad.1);
                            tick.tick(
                                written,
                                Some(format!(
                                    "retry: content {name} piece {i} (stream bytes {a}..{e}) failed its SHA-1; re-fetching from piece {done}, attempt {} of {} in {:.1} s",
                                    bad.1 + 1,
                                    opts.retries + 1,
                                    d.as_secs_f64()
                                )),
                            )?;
                            let _ = ctl_tx.send(Refetch {
                                from: done,
                                epoch,
                                attempt: bad.1,
                            });
                        }
                        Msg::Piece { i, buf, .. } => {
                            pending.insert(i, buf);
                        }
                    }
                    next = ok_rx.try_recv().ok();
                }
                while pending.contains_key(&done) {
                    // the run of pieces ready in order (up to MAX_WRITE bytes)
                    let mut batch: Vec<(u64, Buf<'_>)> = Vec::new();
                    let mut bytes = 0u64;
                    while bytes < MAX_WRITE
                        && let Some(buf) = pending.remove(&(done + batch.len() as u64))
                    {
                        let i = done + batch.len() as u64;
                        bytes += piece_end(i) - i * piece_length;
                        batch.push((i, buf));
                    }
                    let t = Instant::now();
                    // their ranges, one write per stretch contiguous on the disk
                    let mut seg: Vec<&[u8]> = Vec::new();
                    let (mut seg_at, mut seg_end, mut seg_pieces) = (0u64, 0u64, (done, done));
                    let write = |seg: &[&[u8]], at: u64, end: u64, (a, b): (u64, u64)| {
                        target_ref
                            .write_vectored_at(seg, at)
                            .map_err(|source| DeployError::Write {
                                content: name.to_string(),
                                what: if a == b {
                                    format!(
                                        "writing piece {a} at disk offset {at} ({} bytes)",
                                        end - at
                                    )
                                } else {
                                    format!(
                                        "writing pieces {a}..={b} at disk offset {at} ({} bytes)",
                                        end - at
                                    )
                                },
                                source,
                            })
                    };
                    for (i, buf) in &batch {
                        let start = i * piece_length;
                        let len = piece_end(*i) - start;
                        for r in map.ranges(start, start + len) {
                            let a = (r.stream_offset - start) as usize;
                            let data = &buf[a..a + r.len as usize];
                            let at = base + r.disk_offset;
                            if !seg.is_empty() && at != seg_end {
                                write(&seg, seg_at, seg_end, seg_pieces)?;
                                seg.clear();
                            }
                            if seg.is_empty() {
                                (seg_at, seg_end, seg_pieces.0) = (at, at, *i);
                            }
                            seg.push(data);
                            seg_end += r.len;
                            seg_pieces.1 = *i;
                        }
                    }
                    if !seg.is_empty() {
                        write(&seg, seg_at, seg_end, seg_pieces)?;
                    }
                    drop(seg);
                    writing += t.elapsed();
                    for (i, buf) in batch {
                        let len = piece_end(i) - i * piece_length;
                        let _ = sha_tx.send((buf, len as usize));
                        written += len;
                        done += 1;
                    }
                }
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        drop(ok_rx);
        drop(ctl_tx);
        drop(sha_tx);
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
        if !digest.eq_ignore_ascii_case(c.stream_sha256.trim()) {
            return Err(DeployError::StreamHash {
                content: name.to_string(),
                want: c.stream_sha256.clone(),
                got: digest,
            });
        }
        Ok(())
    })
}
