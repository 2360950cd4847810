//! The ordered half of the write pipeline: a [`PieceSource`] (the stream
//! file of a capture, HTTP ranges) read piece by piece into the caller's
//! buffers by one thread, each piece checked against the index's SHA-1 by
//! verifier threads, put back in stream order and handed to the
//! [`SlotWriter`] in runs contiguous on the disk (up to
//! [`PumpOptions::max_write`] bytes per write), optionally hashed in order
//! (the whole stream's SHA-256) after the write.
//!
//! A read that fails is retried from the first piece not received, a piece
//! that fails its SHA-1 makes the writer bump the *epoch* and ask the
//! reader to start again from the first piece not written (everything of an
//! older epoch still in flight is dropped); each piece gets
//! [`PumpOptions::retries`] attempts after the first, with doubling backoff.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use sha2::Digest as _;

use super::{SlotWriter, WriteError, piece_matches};
use crate::format::ContentIndex;
use crate::restore::Target;

/// Where the pieces of a content come from, in stream order.
pub trait PieceSource: Send {
    /// Reads piece `i` (`len` bytes) into `buf[..len]`; `buf` is a whole
    /// piece buffer, 4096-aligned, at least `len` rounded up to 4096 bytes
    /// (room for an `O_DIRECT` read of a short last piece). The pump asks
    /// for consecutive pieces; after a failure or a
    /// [`PieceSource::restart`] it may ask for any piece.
    fn read_piece(&mut self, i: u64, buf: &mut [u8], len: usize) -> io::Result<()>;
    /// Drops what the source holds open (the next read starts afresh).
    fn restart(&mut self) {}
    /// Where the pieces come from, for messages (`from <url>`).
    fn origin(&self) -> String;
}

/// How the pump runs.
#[derive(Debug, Clone, Copy)]
pub struct PumpOptions {
    /// Attempts of one piece after the first (a failed read, a SHA-1
    /// mismatch).
    pub retries: u32,
    /// The first backoff (doubled on every retry, at most 8 s).
    pub backoff: Duration,
    /// The largest write, in bytes.
    pub max_write: u64,
    /// SHA-1 verifier threads.
    pub verifiers: usize,
    /// Hash the whole stream (SHA-256) in order after the write.
    pub stream_sha256: bool,
    /// Run first in each helper thread (reader, verifiers, SHA-256): the
    /// agent lowers their priority there.
    pub helper_start: fn(),
}

/// Why the pump stopped.
#[derive(Debug, thiserror::Error)]
pub enum PumpError {
    /// A piece could not be read after every attempt.
    #[error(
        "piece {piece} of content {content} (stream bytes {start}..{end}) could not be read after {attempts} attempts"
    )]
    Read {
        /// content name
        content: String,
        /// piece index
        piece: u64,
        /// first stream byte
        start: u64,
        /// end of the piece in the stream
        end: u64,
        /// attempts made
        attempts: u32,
        /// the last failure
        #[source]
        source: io::Error,
    },
    /// A piece kept failing its SHA-1.
    #[error(
        "piece {piece} of content {content} (stream bytes {start}..{end}) failed its SHA-1 {attempts} times"
    )]
    PieceHash {
        /// content name
        content: String,
        /// piece index
        piece: u64,
        /// first stream byte
        start: u64,
        /// end of the piece in the stream
        end: u64,
        /// attempts made
        attempts: u32,
    },
    /// The writer refused or failed.
    #[error(transparent)]
    Slot(WriteError),
    /// The reader ended before the last piece (a thread died).
    #[error("the reader of content {content} stopped after {done} of {pieces} pieces")]
    Stopped {
        /// content name
        content: String,
        /// pieces written
        done: u64,
        /// pieces of the content
        pieces: u64,
    },
    /// The caller's tick asked to stop.
    #[error("stopped by the caller")]
    Aborted,
}

/// What a pump did.
#[derive(Debug, Clone)]
pub struct Pumped {
    /// Stream bytes written.
    pub bytes: u64,
    /// Time inside the target's writes.
    pub writing: Duration,
    /// The stream's SHA-256 (hex), when asked for.
    pub stream_sha256: Option<String>,
}

/// What the writer hears from the verifiers.
enum Msg<'b> {
    Piece {
        epoch: u64,
        i: u64,
        buf: &'b mut [u8],
    },
    Bad {
        epoch: u64,
        i: u64,
        buf: &'b mut [u8],
    },
    Fail {
        epoch: u64,
        err: PumpError,
    },
}

/// Writer → reader: start again at `from` (the first piece not written).
struct Restart {
    from: u64,
    epoch: u64,
    attempt: u32,
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

/// Stream bounds of piece `i`.
fn piece_span(index: &ContentIndex, i: u64) -> (u64, u64) {
    let start = i * u64::from(index.header.piece_length);
    (start, start + index.piece_len(i))
}

/// Pumps every piece of `writer`'s content from `source` through the
/// verifiers into `writer`, using `buffers` (each a piece length rounded
/// up to 4096 bytes, at 4096-aligned addresses; at least three). `tick(bytes written, log line)` runs on the caller's
/// thread between pieces; false stops the pump ([`PumpError::Aborted`]).
pub fn pump<S: PieceSource>(
    writer: &SlotWriter<&Target, &ContentIndex>,
    source: S,
    buffers: Vec<&mut [u8]>,
    opts: &PumpOptions,
    tick: &mut dyn FnMut(u64, Option<String>) -> bool,
) -> Result<Pumped, PumpError> {
    let nbuf = buffers.len();
    let (free_tx, free_rx) = mpsc::channel::<&mut [u8]>();
    for b in buffers {
        let _ = free_tx.send(b);
    }
    let (read_tx, read_rx) = mpsc::sync_channel::<Msg<'_>>(2);
    let read_rx = Mutex::new(read_rx);
    // room for every buffer: what the verifiers finish while a write runs
    // waits here, and the next write takes all of it at once
    let (ok_tx, ok_rx) = mpsc::sync_channel::<Msg<'_>>(nbuf.max(1));
    let (ctl_tx, ctl_rx) = mpsc::channel::<Restart>();
    let (log_tx, log_rx) = mpsc::channel::<String>();
    let (sha_tx, sha_rx) = mpsc::channel::<(&mut [u8], usize)>();
    let stop = AtomicBool::new(false);
    let (stop, read_rx) = (&stop, &read_rx);
    let index = writer.index();
    thread::scope(|s| -> Result<Pumped, PumpError> {
        let reader = Reader {
            index,
            content: writer.content(),
            opts,
            stop,
            free_rx,
            free_tx: free_tx.clone(),
            read_tx,
            ctl_rx,
            log_tx,
        };
        s.spawn(move || reader.run(source));
        for _ in 0..opts.verifiers.max(1) {
            let ok_tx = ok_tx.clone();
            s.spawn(move || verify(index, read_rx, &ok_tx, opts.helper_start));
        }
        drop(ok_tx);
        let sha_free_tx = free_tx.clone();
        let sha = s.spawn(move || {
            (opts.helper_start)();
            let mut h = sha2::Sha256::new();
            for (buf, len) in sha_rx {
                h.update(&buf[..len]);
                let _ = sha_free_tx.send(buf);
            }
            hex::encode(h.finalize())
        });
        let mut w = InOrder {
            writer,
            opts,
            tick,
            free_tx,
            sha_tx: opts.stream_sha256.then_some(sha_tx),
            ctl_tx,
            epoch: 0,
            done: 0,
            written: 0,
            bad: (u64::MAX, 0),
            pending: BTreeMap::new(),
            writing: Duration::ZERO,
        };
        let result = w.run(&ok_rx, &log_rx);
        stop.store(true, Ordering::Relaxed);
        drop(ok_rx);
        let (bytes, writing) = (w.written, w.writing);
        // the SHA-256 thread and the reader are let go (channels closed)
        drop(w);
        let digest = sha.join().map_err(|_| PumpError::Stopped {
            content: writer.content().to_string(),
            done: 0,
            pieces: index.piece_count(),
        })?;
        result?;
        Ok(Pumped {
            bytes,
            writing,
            stream_sha256: opts.stream_sha256.then_some(digest),
        })
    })
}

/// The reader thread of [`pump`]: piece by piece from the source into
/// free buffers, on to the verifiers; starts again where the writer asks
/// (a piece that failed its SHA-1); retries a failed read with backoff.
struct Reader<'s, 'b> {
    index: &'s ContentIndex,
    content: &'s str,
    opts: &'s PumpOptions,
    stop: &'s AtomicBool,
    free_rx: mpsc::Receiver<&'b mut [u8]>,
    free_tx: mpsc::Sender<&'b mut [u8]>,
    read_tx: mpsc::SyncSender<Msg<'b>>,
    ctl_rx: mpsc::Receiver<Restart>,
    log_tx: mpsc::Sender<String>,
}

/// Where the reader is.
struct ReadState {
    next: u64,
    epoch: u64,
    /// failed attempts of the piece `fails.0`
    fails: (u64, u32),
    pending_restart: Option<Restart>,
}

impl<'b> Reader<'_, 'b> {
    fn run<S: PieceSource>(self, mut source: S) {
        (self.opts.helper_start)();
        let pieces = self.index.piece_count();
        let mut st = ReadState {
            next: 0,
            epoch: 0,
            fails: (u64::MAX, 0),
            pending_restart: None,
        };
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let ctl = st
                .pending_restart
                .take()
                .or_else(|| self.ctl_rx.try_iter().last());
            if let Some(r) = ctl {
                st.next = r.from;
                st.epoch = r.epoch;
                source.restart();
                sleep_unless(self.stop, backoff(self.opts.backoff, r.attempt));
                continue;
            }
            if st.next >= pieces {
                // everything sent: wait for a restart or the end
                match self.ctl_rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(r) => st.pending_restart = Some(r),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                continue;
            }
            let Some(b) = self.free_buffer(&mut st) else {
                if self.stop.load(Ordering::Relaxed) || st.pending_restart.is_none() {
                    return;
                }
                continue;
            };
            if !self.read_next(&mut st, &mut source, b) {
                return;
            }
        }
    }

    /// A free buffer; none when stopping, when the buffers are gone, or
    /// when a restart arrived first (in `st.pending_restart`).
    fn free_buffer(&self, st: &mut ReadState) -> Option<&'b mut [u8]> {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            if let Some(r) = self.ctl_rx.try_iter().last() {
                st.pending_restart = Some(r);
                return None;
            }
            match self.free_rx.recv_timeout(Duration::from_millis(20)) {
                Ok(b) => return Some(b),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Reads piece `st.next` into `b` and sends it on, or counts the
    /// failure (backoff, or the error once the retries are spent). False
    /// when the reader must end.
    fn read_next<S: PieceSource>(
        &self,
        st: &mut ReadState,
        source: &mut S,
        b: &'b mut [u8],
    ) -> bool {
        let i = st.next;
        let (start, end) = piece_span(self.index, i);
        let len = (end - start) as usize;
        let res = if b.len() < len {
            Err(io::Error::other("a piece buffer is shorter than the piece"))
        } else {
            source.read_piece(i, b, len)
        };
        let source_err = match res {
            Ok(()) => {
                st.next += 1;
                let epoch = st.epoch;
                return self.read_tx.send(Msg::Piece { epoch, i, buf: b }).is_ok();
            }
            Err(e) => e,
        };
        let _ = self.free_tx.send(b);
        source.restart();
        if st.fails.0 != i {
            st.fails = (i, 0);
        }
        st.fails.1 += 1;
        if st.fails.1 > self.opts.retries {
            let err = PumpError::Read {
                content: self.content.to_string(),
                piece: i,
                start,
                end,
                attempts: st.fails.1,
                source: source_err,
            };
            let _ = self.read_tx.send(Msg::Fail {
                epoch: st.epoch,
                err,
            });
            return false;
        }
        let d = backoff(self.opts.backoff, st.fails.1);
        let _ = self.log_tx.send(format!(
            "retry: content {} piece {i} (stream bytes {start}..{end}) from {}: {source_err}; attempt {} of {} in {:.1} s",
            self.content,
            source.origin(),
            st.fails.1 + 1,
            self.opts.retries + 1,
            d.as_secs_f64()
        ));
        sleep_unless(self.stop, d);
        true
    }
}

/// A verifier thread of [`pump`]: each piece against the index's SHA-1,
/// good or bad, on to the writer.
fn verify<'b>(
    index: &ContentIndex,
    read_rx: &Mutex<mpsc::Receiver<Msg<'b>>>,
    ok_tx: &mpsc::SyncSender<Msg<'b>>,
    helper_start: fn(),
) {
    helper_start();
    loop {
        let msg = match read_rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(msg) = msg else { return };
        let out = match msg {
            Msg::Piece { epoch, i, buf } => {
                let len = index.piece_len(i) as usize;
                if buf.get(..len).is_some_and(|p| piece_matches(index, i, p)) {
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

/// The writer of [`pump`] (the caller's thread): puts the verified pieces
/// back in stream order and hands each run ready in order to the
/// [`SlotWriter`] at once; a bad piece bumps the epoch and asks the reader
/// to start again from the first piece not written.
struct InOrder<'s, 'w, 't, 'b> {
    writer: &'w SlotWriter<&'w Target, &'w ContentIndex>,
    opts: &'s PumpOptions,
    tick: &'t mut dyn FnMut(u64, Option<String>) -> bool,
    free_tx: mpsc::Sender<&'b mut [u8]>,
    sha_tx: Option<mpsc::Sender<(&'b mut [u8], usize)>>,
    ctl_tx: mpsc::Sender<Restart>,
    epoch: u64,
    /// pieces written (the first not written)
    done: u64,
    /// stream bytes written
    written: u64,
    /// failed attempts of piece `bad.0`
    bad: (u64, u32),
    pending: BTreeMap<u64, &'b mut [u8]>,
    /// time inside the target's writes
    writing: Duration,
}

impl<'b> InOrder<'_, '_, '_, 'b> {
    fn tick(&mut self, log: Option<String>) -> Result<(), PumpError> {
        if (self.tick)(self.written, log) {
            Ok(())
        } else {
            Err(PumpError::Aborted)
        }
    }

    fn run(
        &mut self,
        ok_rx: &mpsc::Receiver<Msg<'b>>,
        log_rx: &mpsc::Receiver<String>,
    ) -> Result<(), PumpError> {
        let pieces = self.writer.index().piece_count();
        while self.done < pieces {
            for line in log_rx.try_iter() {
                self.tick(Some(line))?;
            }
            self.tick(None)?;
            let first = match ok_rx.recv_timeout(Duration::from_millis(100)) {
                Ok(m) => m,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(PumpError::Stopped {
                        content: self.writer.content().to_string(),
                        done: self.done,
                        pieces,
                    });
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
        self.tick(None)
    }

    /// Files one verifier message: a piece of this epoch waits for its
    /// turn, a bad one asks for a restart (or fails once its retries are
    /// spent), anything of an older epoch is dropped.
    fn receive(&mut self, msg: Msg<'b>) -> Result<(), PumpError> {
        let epoch = self.epoch;
        match msg {
            Msg::Piece { epoch: e, buf, .. } | Msg::Bad { epoch: e, buf, .. } if e != epoch => {
                let _ = self.free_tx.send(buf);
            }
            Msg::Fail { epoch: e, .. } if e != epoch => {}
            Msg::Fail { err, .. } => return Err(err),
            Msg::Bad { i, buf, .. } => {
                let _ = self.free_tx.send(buf);
                self.restart(i)?;
            }
            Msg::Piece { i, buf, .. } => {
                self.pending.insert(i, buf);
            }
        }
        Ok(())
    }

    /// Piece `i` failed its SHA-1: a new epoch from the first piece not
    /// written, after a backoff.
    fn restart(&mut self, i: u64) -> Result<(), PumpError> {
        if self.bad.0 != i {
            self.bad = (i, 0);
        }
        self.bad.1 += 1;
        let (a, e) = piece_span(self.writer.index(), i);
        let content = self.writer.content().to_string();
        if self.bad.1 > self.opts.retries {
            return Err(PumpError::PieceHash {
                content,
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
        let d = backoff(self.opts.backoff, self.bad.1);
        self.tick(Some(format!(
            "retry: content {content} piece {i} (stream bytes {a}..{e}) failed its SHA-1; re-fetching from piece {}, attempt {} of {} in {:.1} s",
            self.done,
            self.bad.1 + 1,
            self.opts.retries + 1,
            d.as_secs_f64()
        )))?;
        let _ = self.ctl_tx.send(Restart {
            from: self.done,
            epoch: self.epoch,
            attempt: self.bad.1,
        });
        Ok(())
    }

    /// Writes the run of pieces ready in order from `done` (up to
    /// `max_write` bytes), then passes them to the SHA-256 thread (or back
    /// to the reader).
    fn write_ready(&mut self) -> Result<(), PumpError> {
        let index = self.writer.index();
        let mut batch: Vec<(u64, &'b mut [u8])> = Vec::new();
        let mut bytes = 0u64;
        while bytes < self.opts.max_write
            && let Some(buf) = self.pending.remove(&(self.done + batch.len() as u64))
        {
            bytes += index.piece_len(self.done + batch.len() as u64);
            batch.push((self.done + batch.len() as u64, buf));
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
            return Err(PumpError::Slot(e));
        }
        for (i, buf) in batch {
            let len = index.piece_len(i);
            match &self.sha_tx {
                Some(tx) => {
                    let _ = tx.send((buf, len as usize));
                }
                None => {
                    let _ = self.free_tx.send(buf);
                }
            }
            self.written += len;
            self.done += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extents::Extent;
    use crate::format::{FLAG_GAPS_ZERO, Header};
    use crate::restore::AlignedBuf;
    use crate::write::SlotRange;

    const PL: usize = 16_384;

    /// A content of two extents with a gap (5 pieces of 16 KiB, the last
    /// one short) and its stream.
    fn content() -> (ContentIndex, Vec<u8>) {
        let extents = vec![
            Extent {
                offset: 4096,
                len: 40_960,
            },
            Extent {
                offset: 131_072,
                len: 32_768,
            },
        ];
        let stream: Vec<u8> = (0..73_728u32).map(|i| (i % 251) as u8 + 1).collect();
        let piece_hashes = stream
            .chunks(PL)
            .map(|c| sha1::Sha1::digest(c).into())
            .collect();
        let index = ContentIndex {
            header: Header {
                block_size: 4096,
                piece_length: PL as u32,
                partition_size: 262_144,
                used_bytes: stream.len() as u64,
                last_extent_end: 163_840,
                fs_type: "raw".into(),
                flags: FLAG_GAPS_ZERO,
                uuid: Vec::new(),
                label: String::new(),
                stream_sha256: sha2::Sha256::digest(&stream).into(),
            },
            extents,
            piece_hashes,
        };
        index.validate().unwrap();
        (index, stream)
    }

    /// The stream in memory; `fail_read` pieces fail their first read,
    /// `corrupt` pieces come with a flipped byte the first time.
    struct Faulty {
        stream: Vec<u8>,
        fail_read: Vec<u64>,
        corrupt: Vec<u64>,
    }

    impl PieceSource for Faulty {
        fn read_piece(&mut self, i: u64, buf: &mut [u8], len: usize) -> io::Result<()> {
            if let Some(p) = self.fail_read.iter().position(|x| *x == i) {
                self.fail_read.remove(p);
                return Err(io::Error::other("connection reset"));
            }
            let start = i as usize * PL;
            buf[..len].copy_from_slice(&self.stream[start..start + len]);
            if let Some(p) = self.corrupt.iter().position(|x| *x == i) {
                self.corrupt.remove(p);
                buf[0] ^= 0xFF;
            }
            Ok(())
        }

        fn origin(&self) -> String {
            "memory".into()
        }
    }

    fn opts(retries: u32) -> PumpOptions {
        PumpOptions {
            retries,
            backoff: Duration::ZERO,
            max_write: 2 * PL as u64,
            verifiers: 2,
            stream_sha256: true,
            helper_start: || {},
        }
    }

    /// A read that fails once and a piece corrupt once: both fetched again,
    /// the slot holds the partition (gaps zeroed over 0xFF), the stream's
    /// SHA-256 is the index's, the log names both retries.
    #[test]
    fn a_failed_read_and_a_corrupt_piece_are_fetched_again() {
        let (ix, stream) = content();
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        std::fs::write(&p, vec![0xFFu8; 262_144]).unwrap();
        let t = Target::open(&p, None).unwrap();
        let slot = SlotRange {
            offset: 0,
            size: 262_144,
        };
        let w = SlotWriter::open(&t, slot, "c", &ix).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..3).map(|_| AlignedBuf::new(PL)).collect();
        let src = Faulty {
            stream: stream.clone(),
            fail_read: vec![1],
            corrupt: vec![3],
        };
        let mut logs = Vec::new();
        let done = pump(
            &w,
            src,
            bufs.iter_mut().map(AlignedBuf::as_mut_slice).collect(),
            &opts(2),
            &mut |_, l| {
                logs.extend(l);
                true
            },
        )
        .unwrap();
        assert_eq!(done.bytes, stream.len() as u64);
        assert_eq!(
            done.stream_sha256.as_deref(),
            Some(hex::encode(ix.header.stream_sha256).as_str())
        );
        assert!(
            logs.iter()
                .any(|l| l.contains("piece 1") && l.contains("connection reset")),
            "{logs:?}"
        );
        assert!(
            logs.iter()
                .any(|l| l.contains("piece 3") && l.contains("SHA-1")),
            "{logs:?}"
        );
        w.sync().unwrap();
        let got = std::fs::read(&p).unwrap();
        let mut want = vec![0u8; 262_144];
        want[4096..45_056].copy_from_slice(&stream[..40_960]);
        want[131_072..163_840].copy_from_slice(&stream[40_960..]);
        assert!(got == want);
    }

    /// Without retries the first failure is final and names the piece; a
    /// tick that answers false stops the pump.
    #[test]
    fn without_retries_the_first_failure_is_final() {
        let (ix, stream) = content();
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t");
        let t = Target::open(&p, Some(262_144)).unwrap();
        let slot = SlotRange {
            offset: 0,
            size: 262_144,
        };
        let w = SlotWriter::open(&t, slot, "c", &ix).unwrap();
        let mut bufs: Vec<AlignedBuf> = (0..3).map(|_| AlignedBuf::new(PL)).collect();
        let run = |bufs: &mut Vec<AlignedBuf>, fail: Vec<u64>, corrupt: Vec<u64>, stop: bool| {
            let src = Faulty {
                stream: stream.clone(),
                fail_read: fail,
                corrupt,
            };
            pump(
                &w,
                src,
                bufs.iter_mut().map(AlignedBuf::as_mut_slice).collect(),
                &opts(0),
                &mut |_, _| !stop,
            )
        };
        let e = run(&mut bufs, vec![2], vec![], false).unwrap_err();
        assert!(
            matches!(
                e,
                PumpError::Read {
                    piece: 2,
                    attempts: 1,
                    ..
                }
            ),
            "{e}"
        );
        let e = run(&mut bufs, vec![], vec![4], false).unwrap_err();
        assert!(
            matches!(
                e,
                PumpError::PieceHash {
                    piece: 4,
                    attempts: 1,
                    ..
                }
            ),
            "{e}"
        );
        let e = run(&mut bufs, vec![], vec![], true).unwrap_err();
        assert!(matches!(e, PumpError::Aborted), "{e}");
    }
}
