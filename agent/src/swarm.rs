//! Partition content over BitTorrent (docs/distribution.md, "The agent's
//! swarm fetch"): a leecher that writes each
//! verified piece straight onto its slot, and a seeder that serves content
//! streams from a content store. Both run the vendored librqbit
//! (vendor/librqbit: rarest-first piece selection) with DHT, local service
//! discovery and UPnP off; peers come from the plan (the seeder, the other
//! machines of the run) and from a tracker.
//!
//! The content format's pieces are the torrent's pieces
//! (`anneal_image::torrent`), so a piece librqbit has checked against the
//! torrent's SHA-1 is a piece of the index (a torrent that disagrees with the
//! index is refused at the start). Every byte goes to the target through
//! the content's [`SlotWriter`] (`anneal_image::write`, the one write
//! pipeline): the slot is checked and, for a `FLAG_GAPS_ZERO` content, the
//! gaps between its extents zeroed before the session starts.
//! [`SlotStorage`] keeps the chunks of a piece in memory (a 4096-aligned
//! buffer) until librqbit has verified it, and only then hands the piece
//! to the writer, which writes its disk ranges at `slot + disk offset`,
//! `O_DIRECT` where offset and length are aligned (no copy into the page
//! cache): a corrupt chunk from a peer is never written (the peer is dropped
//! by librqbit and the piece fetched again). Verified pieces serve other
//! peers from a piece cache sized from the machine's memory, or else read
//! back from the target. A thread hashes the stream in order while the
//! pieces arrive (each piece from the cache, else read back from the
//! target), and once every piece is written its SHA-256 is compared with
//! the index's.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::net::SocketAddr;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anneal_image::format::ContentIndex;
use anneal_image::restore::{AlignedBuf, Target};
use anneal_image::write::{SlotRange, SlotWriter, WriteError, piece_matches};
use librqbit::storage::{StorageFactory, StorageFactoryExt as _, TorrentStorage};
use librqbit::{
    AddTorrent, AddTorrentOptions, ListenerMode, ListenerOptions, ManagedTorrent,
    ManagedTorrentShared, PeerStatsFilter, PeerStatsFilterState, PeerStatsSnapshot, Session,
    SessionOptions, TorrentMetadata,
};
use librqbit_core::lengths::ValidPieceIndex;
use sha1::Digest as _;

/// Why a swarm fetch did not complete.
#[derive(Debug, thiserror::Error)]
pub enum SwarmError {
    /// librqbit could not start (listen address, runtime).
    #[error("starting the BitTorrent session: {0:#}")]
    Start(anyhow::Error),
    /// The torrent was refused.
    #[error("adding the torrent: {0:#}")]
    Torrent(anyhow::Error),
    /// The target could not be opened.
    #[error("opening the target {path}: {source}")]
    Target {
        /// target path
        path: PathBuf,
        /// cause
        source: std::io::Error,
    },
    /// No piece completed for the stall timeout.
    #[error(
        "the swarm stalled: no piece for {secs} s with {have} of {total} pieces written (peers: {peers})"
    )]
    Stalled {
        /// seconds without progress
        secs: u64,
        /// pieces written
        have: u64,
        /// pieces in the content
        total: u64,
        /// peers known
        peers: usize,
    },
    /// Writing or reading the target failed.
    #[error("{0}")]
    Io(String),
    /// The content does not fit its slot, or the slot's gaps could not
    /// be zeroed: nothing of the content was written.
    #[error(transparent)]
    Slot(WriteError),
    /// The caller's progress callback asked to stop.
    #[error("stopped on request")]
    Aborted,
    /// The stream written does not hash to the index's SHA-256.
    #[error("the stream written has SHA-256 {got}, the index says {want}")]
    StreamHash {
        /// from the index
        want: String,
        /// of the pieces written
        got: String,
    },
}

/// How a leecher joins its swarm.
#[derive(Debug, Clone)]
pub struct SwarmConfig {
    /// Where this peer listens for other peers (port 0: any).
    pub listen: SocketAddr,
    /// Peers known from the start (the seeder, the run's other machines).
    pub peers: Vec<SocketAddr>,
    /// Seeders' addresses: bytes from their IP addresses (any port) count as
    /// "from the seeders" in the stats.
    pub seeders: Vec<SocketAddr>,
    /// Tracker announce URLs (none: peers only from `peers`).
    pub trackers: Vec<String>,
    /// Rarest-first piece selection (the stock order when false, for the
    /// benchmark's comparison).
    pub rarest_first: bool,
    /// With rarest-first, ask seeders only for this leecher's stripe of the
    /// pieces (the leechers connected to each other split them by peer id;
    /// vendored librqbit's `seeder_stripes`), the rest from the leechers.
    pub seeder_stripes: bool,
    /// No piece completed for this long: the swarm has stalled (no peer
    /// delivers, the seeder or the tracker is down).
    pub stall_timeout: Duration,
    /// The content's stream over HTTP (the seeder's or the content server's
    /// `/content/<namespace>/<content>/stream`): after a stall, the pieces
    /// still missing are fetched from it in byte ranges, verified the same
    /// way, while the swarm goes on. None: a stall fails the fetch.
    pub http_fallback: Option<String>,
    /// Bytes of verified pieces kept in memory to serve other peers (reads
    /// from the target otherwise). None: an eighth of the memory available
    /// at the start ([`piece_cache_budget`]).
    pub piece_cache: Option<u64>,
    /// Most peer connections (None: librqbit's default).
    pub peer_limit: Option<usize>,
    /// Most peers uploaded to at once (upload slots; 0: none; None: every
    /// peer that asks).
    pub max_uploads: Option<usize>,
    /// Chunk requests (16 KiB) kept outstanding per peer (None:
    /// [`REQUEST_WINDOW`]).
    pub request_window: Option<usize>,
}

/// Chunk requests (16 KiB each) a leecher keeps outstanding per peer: 256
/// KiB, where stock librqbit keeps 128 (2 MiB). An uploader serves its
/// requesters' queues side by side, so with 2 MiB asked of each of 15 busy
/// peers a piece stayed reserved (asked of no other peer) for seconds while
/// it waited its turn; the 16-leecher round of swarm-bench went from 41.6 s
/// to 37-38 s (docs/bench/distribution.md, "2026-12-06, 13:30 UTC"). 256
/// KiB in flight still fills 100 Mbit/s at a 20 ms round trip, and 10
/// Gbit/s at 0.2 ms.
pub const REQUEST_WINDOW: usize = 16;

/// What a swarm fetch did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SwarmStats {
    /// Pieces written to the target.
    pub pieces: u64,
    /// Stream bytes written to the target.
    pub bytes_written: u64,
    /// Bytes received from the seeders (`SwarmConfig::seeders`).
    pub bytes_from_seeders: u64,
    /// Bytes received from other peers.
    pub bytes_from_peers: u64,
    /// Bytes received over HTTP ranges after a stall.
    pub bytes_over_http: u64,
    /// Bytes sent to other peers.
    pub bytes_uploaded: u64,
    /// Why the HTTP fallback was used (the stall), when it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
    /// Peers that sent at least one byte.
    pub peers: usize,
    /// Seconds from start to the last piece written.
    pub seconds: f64,
}

/// Shared state of a leecher's storage: the writer of the slot (target,
/// index, pieces written) and the pieces in progress.
#[derive(Debug)]
struct Slot {
    writer: SlotWriter<Target, ContentIndex>,
    partial: Mutex<HashMap<u64, AlignedBuf>>,
    cache: Mutex<PieceCache>,
    /// Piece buffers written and out of the cache, for the next pieces:
    /// memory touched once is reused, never given back and faulted in
    /// again.
    spare: Mutex<Vec<AlignedBuf>>,
    bytes_over_http: AtomicU64,
    error: Mutex<Option<String>>,
}

impl Slot {
    fn index(&self) -> &ContentIndex {
        self.writer.index()
    }

    fn piece_of(&self, offset: u64) -> (u64, usize) {
        let pl = u64::from(self.index().header.piece_length);
        (offset / pl, (offset % pl) as usize)
    }

    fn fail(&self, msg: String) {
        if let Ok(mut e) = self.error.lock() {
            e.get_or_insert(msg);
        }
    }

    fn is_written(&self, piece: u64) -> bool {
        self.writer.is_written(piece)
    }

    /// Reads stream bytes `[offset, offset+buf.len())` back from the target.
    fn read_back(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.writer.read_stream(offset, buf)
    }

    /// Piece `i` verified by librqbit: check it against the index and write
    /// its ranges.
    fn complete(&self, i: u64) -> Result<(), String> {
        let Some(buf) = self.partial.lock().map_err(|_| "poisoned")?.remove(&i) else {
            return if self.is_written(i) {
                Ok(())
            } else {
                Err(format!("piece {i} completed with no data received"))
            };
        };
        // librqbit checked it against the torrent's SHA-1, which is the
        // index's (`fetch_file_to_slot` refuses a torrent that disagrees).
        self.write_piece(i, buf, Checked::Already)
    }

    /// Copies bytes `[at, at + buf.len())` of piece `piece` from the piece
    /// cache; false when the piece is not cached.
    fn read_cached(&self, piece: u64, at: usize, buf: &mut [u8]) -> anyhow::Result<bool> {
        let cache = self.cache.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        let Some(p) = cache.get(piece) else {
            return Ok(false);
        };
        let src = p
            .as_slice()
            .get(at..at + buf.len())
            .ok_or_else(|| anyhow::anyhow!("read past piece {piece}"))?;
        buf.copy_from_slice(src);
        Ok(true)
    }

    /// Checks piece `i` against the index's SHA-1 (unless `checked` says it
    /// was) and hands it to the writer (once: a piece already written is
    /// left alone; the writer counts a piece two paths brought once).
    fn write_piece(&self, i: u64, piece: AlignedBuf, checked: Checked) -> Result<(), String> {
        if self.is_written(i) {
            return Ok(());
        }
        let len = self.index().piece_len(i) as usize;
        let buf = piece
            .as_slice()
            .get(..len)
            .ok_or_else(|| format!("piece {i} is shorter than the index says"))?;
        if checked == Checked::No && !piece_matches(self.index(), i, buf) {
            return Err(format!("piece {i} does not match the index's SHA-1"));
        }
        self.writer
            .write_piece(i, buf)
            .map_err(|e| crate::jsonl::chain(&e))?;
        let dropped = match self.cache.lock() {
            Ok(mut c) => c.insert(i, piece),
            Err(_) => vec![piece],
        };
        self.recycle(dropped);
        Ok(())
    }

    /// Keeps `bufs` for the next pieces (at most [`SPARE_BUFFERS`]).
    fn recycle(&self, bufs: Vec<AlignedBuf>) {
        if let Ok(mut s) = self.spare.lock() {
            for b in bufs {
                if s.len() < SPARE_BUFFERS {
                    s.push(b);
                }
            }
        }
    }

    /// A buffer for a piece of `len` bytes: a spare one when it is large
    /// enough (its old bytes are overwritten by the chunks before librqbit
    /// reads the piece), else a new one.
    fn buffer(&self, len: usize) -> AlignedBuf {
        let spare = self.spare.lock().ok().and_then(|mut s| {
            let i = s.iter().position(|b| b.as_slice().len() >= len)?;
            Some(s.swap_remove(i))
        });
        spare.unwrap_or_else(|| AlignedBuf::new(len))
    }
}

/// Verified pieces kept in memory to serve other peers, the oldest dropped
/// first past the budget: a swarm asks most for the pieces that arrived
/// last (rarest first).
#[derive(Debug)]
struct PieceCache {
    budget: u64,
    bytes: u64,
    pieces: HashMap<u64, AlignedBuf>,
    order: VecDeque<u64>,
}

impl PieceCache {
    fn new(budget: u64) -> Self {
        Self {
            budget,
            bytes: 0,
            pieces: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn get(&self, piece: u64) -> Option<&AlignedBuf> {
        self.pieces.get(&piece)
    }

    /// Keeps `buf` as piece `piece` if it fits the budget, dropping the
    /// oldest pieces to make room; returns the buffers no longer kept.
    #[must_use]
    fn insert(&mut self, piece: u64, buf: AlignedBuf) -> Vec<AlignedBuf> {
        let len = buf.as_slice().len() as u64;
        if len > self.budget || self.pieces.contains_key(&piece) {
            return vec![buf];
        }
        let mut dropped = Vec::new();
        while self.bytes + len > self.budget {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(b) = self.pieces.remove(&old) {
                self.bytes -= b.as_slice().len() as u64;
                dropped.push(b);
            }
        }
        self.bytes += len;
        self.pieces.insert(piece, buf);
        self.order.push_back(piece);
        dropped
    }
}

/// The piece cache's default size: an eighth of `MemAvailable` in
/// /proc/meminfo (64 MiB when it cannot be read). The agent's machine does
/// nothing else while it deploys; the rest stays for the initramfs, the
/// pieces in flight and the page cache.
pub fn piece_cache_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(64 << 20, |kib| kib * 1024 / 8)
}

/// Spare piece buffers a leecher keeps for reuse.
const SPARE_BUFFERS: usize = 16;

/// Whether a piece's SHA-1 was checked before [`Slot::write_piece`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checked {
    /// By librqbit, against the torrent's hash (the index's).
    Already,
    /// Not yet (bytes over HTTP).
    No,
}

/// The `TorrentStorage` methods about files, for a storage that is no
/// file tree (a slot on a disk, a stream of a content store): nothing to
/// remove or size; `take` shares the same state.
macro_rules! no_files {
    () => {
        fn remove_file(&self, _: usize, _: &Path) -> anyhow::Result<()> {
            Ok(())
        }

        fn remove_directory_if_empty(&self, _: &Path) -> anyhow::Result<()> {
            Ok(())
        }

        fn ensure_file_length(&self, _: usize, _: u64) -> anyhow::Result<()> {
            Ok(())
        }

        fn take(&self) -> anyhow::Result<Box<dyn TorrentStorage>> {
            Ok(Box::new(self.clone()))
        }
    };
}

/// librqbit storage of a leecher: one file (the content stream) mapped onto
/// the slot through the index.
#[derive(Debug, Clone)]
struct SlotStorage(Arc<Slot>);

impl TorrentStorage for SlotStorage {
    fn init(&mut self, _: &ManagedTorrentShared, _: &TorrentMetadata) -> anyhow::Result<()> {
        Ok(())
    }

    fn pread_exact(&self, file_id: usize, offset: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        anyhow::ensure!(file_id == 0, "a content torrent has one file");
        let (piece, at) = self.0.piece_of(offset);
        if let Some(p) = self
            .0
            .partial
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .get(&piece)
        {
            let src = p
                .as_slice()
                .get(at..at + buf.len())
                .ok_or_else(|| anyhow::anyhow!("read past piece {piece}"))?;
            buf.copy_from_slice(src);
            return Ok(());
        }
        // Only pieces written in this run are served: the target's old
        // bytes are never offered (and librqbit's start-up check finds none).
        anyhow::ensure!(self.0.is_written(piece), "piece {piece} is not here yet");
        if self.0.read_cached(piece, at, buf)? {
            return Ok(());
        }
        self.0.read_back(offset, buf)?;
        Ok(())
    }

    fn pwrite_all(&self, file_id: usize, offset: u64, buf: &[u8]) -> anyhow::Result<()> {
        anyhow::ensure!(file_id == 0, "a content torrent has one file");
        let (piece, at) = self.0.piece_of(offset);
        if self.0.is_written(piece) {
            return Ok(());
        }
        let len = self.0.index().piece_len(piece) as usize;
        let mut partial = self
            .0
            .partial
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?;
        let p = match partial.entry(piece) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(self.0.buffer(len)),
        };
        p.as_mut_slice()
            .get_mut(at..at + buf.len())
            .ok_or_else(|| anyhow::anyhow!("chunk past the end of piece {piece}"))?
            .copy_from_slice(buf);
        Ok(())
    }

    no_files!();

    fn on_piece_completed(&self, piece: ValidPieceIndex) -> anyhow::Result<()> {
        let i = u64::from(piece.get());
        if let Err(e) = self.0.complete(i) {
            // librqbit only logs this error: the fetch loop reads it and
            // fails the run.
            self.0.fail(e.clone());
            anyhow::bail!(e);
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct SlotFactory(Arc<Slot>);

impl StorageFactory for SlotFactory {
    type Storage = SlotStorage;

    fn create(&self, _: &ManagedTorrentShared, _: &TorrentMetadata) -> anyhow::Result<SlotStorage> {
        Ok(SlotStorage(self.0.clone()))
    }

    fn clone_box(&self) -> librqbit::storage::BoxStorageFactory {
        self.clone().boxed()
    }
}

/// librqbit storage of a seeder: the content stream file, read only.
#[derive(Debug, Clone)]
struct StreamStorage(Arc<File>);

impl TorrentStorage for StreamStorage {
    fn init(&mut self, _: &ManagedTorrentShared, _: &TorrentMetadata) -> anyhow::Result<()> {
        Ok(())
    }

    fn pread_exact(&self, _: usize, offset: u64, buf: &mut [u8]) -> anyhow::Result<()> {
        self.0.read_exact_at(buf, offset)?;
        Ok(())
    }

    fn pwrite_all(&self, _: usize, _: u64, _: &[u8]) -> anyhow::Result<()> {
        anyhow::bail!("a seeder does not write its content store")
    }

    no_files!();
}

#[derive(Debug, Clone)]
struct StreamFactory(Arc<File>);

impl StorageFactory for StreamFactory {
    type Storage = StreamStorage;

    fn create(
        &self,
        _: &ManagedTorrentShared,
        _: &TorrentMetadata,
    ) -> anyhow::Result<StreamStorage> {
        Ok(StreamStorage(self.0.clone()))
    }

    fn clone_box(&self) -> librqbit::storage::BoxStorageFactory {
        self.clone().boxed()
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, SwarmError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("swarm")
        .build()
        .map_err(|e| SwarmError::Start(e.into()))
}

/// A librqbit session: TCP only, no DHT, no local discovery, no UPnP, no
/// persistence. Its output folder is never written (every torrent has its
/// own storage).
async fn session(listen: SocketAddr, upload_bps: Option<u32>) -> Result<Arc<Session>, SwarmError> {
    Session::new_with_opts(
        PathBuf::from("/nonexistent/anneal-swarm"),
        SessionOptions {
            dht: None,
            disable_local_service_discovery: true,
            listen: Some(ListenerOptions {
                mode: ListenerMode::TcpOnly,
                listen_addr: listen,
                // Behind no NAT: announce the port we listen on, loopback
                // too (0: the port bound; a change of our librqbit).
                announce_port: Some(listen.port()),
                ..Default::default()
            }),
            ratelimits: librqbit::limits::LimitsConfig {
                upload_bps: upload_bps.and_then(std::num::NonZeroU32::new),
                download_bps: None,
            },
            ..Default::default()
        },
    )
    .await
    .map_err(SwarmError::Start)
}

/// A content fetched: the stats at the last piece, and the session that
/// goes on serving the other peers from the target until dropped.
#[derive(Debug)]
pub struct Leeched {
    /// The swarm's figures when the last piece was written and the stream
    /// verified.
    pub stats: SwarmStats,
    /// Serves the pieces to the other peers until dropped.
    pub seeding: Seeding,
}

/// A leecher that has every piece and keeps serving them (the run's other
/// machines fetch from it) until dropped.
pub struct Seeding {
    rt: Option<tokio::runtime::Runtime>,
    session: Arc<Session>,
    handle: Arc<ManagedTorrent>,
    seeders: Vec<SocketAddr>,
    shared: Arc<Slot>,
    seconds: f64,
}

impl Seeding {
    /// The figures now (bytes uploaded grow while it serves).
    pub fn stats(&self) -> SwarmStats {
        stats_of(&self.handle, &self.shared, &self.seeders, self.seconds)
    }
}

impl std::fmt::Debug for Seeding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seeding")
            .field("seconds", &self.seconds)
            .finish()
    }
}

impl Drop for Seeding {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.block_on(self.session.stop());
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

fn stats_of(
    handle: &ManagedTorrent,
    shared: &Slot,
    seeders: &[SocketAddr],
    seconds: f64,
) -> SwarmStats {
    let mut stats = handle
        .live()
        .map(|l| peer_stats(&l.per_peer_stats_snapshot(all_peers()), seeders))
        .unwrap_or_default();
    let written = shared.writer.progress();
    stats.pieces = written.pieces;
    stats.bytes_written = written.bytes;
    stats.bytes_over_http = shared.bytes_over_http.load(Ordering::Relaxed);
    stats.seconds = seconds;
    stats
}

/// Fetches the content described by `index` (torrent `torrent`, made from
/// the same index) onto the slot of `slot_size` bytes at byte `slot` of
/// `target`, from the swarm of `cfg`; returns once every piece is written,
/// the target flushed and the stream's SHA-256 checked, with the session
/// still serving the other peers. A content larger than the slot is
/// refused before anything is written.
pub fn fetch_to_slot(
    torrent: &[u8],
    index: &ContentIndex,
    target: &Path,
    slot: u64,
    slot_size: u64,
    cfg: &SwarmConfig,
) -> Result<Leeched, SwarmError> {
    let slot = SlotRange {
        offset: slot,
        size: slot_size,
    };
    fetch_file_to_slot(torrent, index, open_target(target)?, slot, cfg, &mut |_| {
        true
    })
}

fn open_target(target: &Path) -> Result<File, SwarmError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(target)
        .map_err(|source| SwarmError::Target {
            path: target.to_path_buf(),
            source,
        })
}

/// [`fetch_to_slot`], printing `{"event":"progress","ms":…,"stats":…}`
/// every `every` (none: never) while it fetches.
fn fetch_to_slot_reporting(
    torrent: &[u8],
    index: &ContentIndex,
    target: &Path,
    slot: SlotRange,
    cfg: &SwarmConfig,
    every: Option<Duration>,
) -> Result<Leeched, SwarmError> {
    let start = Instant::now();
    let mut next = Duration::ZERO;
    let mut report = |stats: &SwarmStats| {
        let at = start.elapsed();
        if let Some(every) = every
            && at >= next
        {
            next = at + every;
            print_json(&serde_json::json!({
                "event": "progress",
                "ms": u64::try_from(at.as_millis()).unwrap_or(u64::MAX),
                "stats": stats,
            }));
        }
        true
    };
    fetch_file_to_slot(torrent, index, open_target(target)?, slot, cfg, &mut report)
}

/// Refuses a torrent whose pieces are not the index's: librqbit checks each
/// piece against the torrent, so the pieces it hands over are the index's
/// only when the two agree. Returns the content's name (the torrent's,
/// without `.stream`).
fn torrent_matches(torrent: &[u8], index: &ContentIndex) -> anyhow::Result<String> {
    let meta = anneal_image::torrent::Metainfo::parse(torrent)?;
    anyhow::ensure!(
        meta.length == index.header.used_bytes
            && meta.piece_length == u64::from(index.header.piece_length)
            && meta.pieces == index.piece_hashes,
        "the torrent ({} bytes in {} pieces of {}) does not match the content's index \
         ({} bytes in {} pieces of {}, or other piece hashes): it was made from another content",
        meta.length,
        meta.pieces.len(),
        meta.piece_length,
        index.header.used_bytes,
        index.piece_hashes.len(),
        index.header.piece_length,
    );
    Ok(meta
        .name
        .strip_suffix(".stream")
        .unwrap_or(&meta.name)
        .to_string())
}

/// [`fetch_to_slot`] onto `slot` of an open target (read and write),
/// calling `progress` with the figures every 100 ms while it fetches (over
/// the swarm or HTTP); `progress` returning false stops the fetch
/// ([`SwarmError::Aborted`]).
pub fn fetch_file_to_slot(
    torrent: &[u8],
    index: &ContentIndex,
    file: File,
    slot: SlotRange,
    cfg: &SwarmConfig,
    progress: &mut dyn FnMut(&SwarmStats) -> bool,
) -> Result<Leeched, SwarmError> {
    let total = index.piece_count();
    let name = torrent_matches(torrent, index).map_err(SwarmError::Torrent)?;
    let target = Target::from_file(file, Path::new("the target"))
        .map_err(|e| SwarmError::Io(format!("opening the target for direct writes: {e}")))?;
    // The slot checked and its gaps zeroed before the session starts.
    let writer = SlotWriter::open(target, slot, &name, index.clone()).map_err(SwarmError::Slot)?;
    let cache_bytes = cfg.piece_cache.unwrap_or_else(piece_cache_budget);
    let shared = Arc::new(Slot {
        writer,
        partial: Mutex::new(HashMap::new()),
        cache: Mutex::new(PieceCache::new(cache_bytes)),
        spare: Mutex::new(Vec::new()),
        bytes_over_http: AtomicU64::new(0),
        error: Mutex::new(None),
    });
    let hasher = StreamHasher::start(shared.clone())?;
    let rt = runtime()?;
    let session = rt.block_on(session(cfg.listen, None))?;
    let start = Instant::now();
    let leeched = rt.block_on(leech(&session, torrent, &shared, total, cfg, progress));
    let (handle, stalled) = match leeched {
        Ok(h) => h,
        Err(e) => {
            rt.block_on(session.stop());
            rt.shutdown_timeout(Duration::from_secs(5));
            return Err(e);
        }
    };
    let mut seeding = Seeding {
        rt: Some(rt),
        session,
        handle,
        seeders: cfg.seeders.clone(),
        shared: shared.clone(),
        seconds: 0.0,
    };
    // From here, dropping `seeding` on an error stops the session.
    let mut reason = None;
    if let Some(stall) = stalled {
        let Some(url) = cfg.http_fallback.as_deref() else {
            return Err(stall);
        };
        tracing::warn!(reason = %stall, url, "the swarm stalled: fetching the missing pieces over HTTP");
        reason = Some(stall.to_string());
        // The swarm goes on meanwhile: whichever path brings a piece first
        // writes it.
        http_fallback(&shared, url, cfg.stall_timeout, &mut || {
            progress(&stats_of(&seeding.handle, &shared, &cfg.seeders, 0.0))
        })?;
    }
    shared.writer.sync().map_err(SwarmError::Slot)?;
    seeding.seconds = start.elapsed().as_secs_f64();
    let verify = Instant::now();
    hasher.finish()?;
    tracing::info!(
        seconds = verify.elapsed().as_secs_f64(),
        "the stream's SHA-256 verified"
    );
    let mut stats = seeding.stats();
    stats.fallback_reason = reason;
    if let Some(live) = seeding.handle.live() {
        // What the swarm cost beyond the content: chunks received twice (a
        // piece taken over from a slower peer, or finished meanwhile).
        let snap = live.per_peer_stats_snapshot(all_peers());
        let stolen: u32 = snap.peers.values().map(|p| p.counters.times_i_stole).sum();
        let received = stats.bytes_from_peers + stats.bytes_from_seeders;
        tracing::info!(
            pieces_taken_over = stolen,
            bytes_received = received,
            bytes_received_twice = received.saturating_sub(stats.bytes_written),
            "the swarm's overhead"
        );
    }
    Ok(Leeched { stats, seeding })
}

/// Attempts per piece over HTTP before the fetch fails.
const HTTP_ATTEMPTS: u32 = 4;

/// Fetches every piece not written yet from `url` in byte ranges (runs of
/// consecutive missing pieces), each checked against the index's SHA-1
/// before it is written; a range that fails or a piece that does not match
/// is fetched again, up to [`HTTP_ATTEMPTS`] times.
fn http_fallback(
    shared: &Slot,
    url: &str,
    timeout: Duration,
    progress: &mut dyn FnMut() -> bool,
) -> Result<(), SwarmError> {
    use std::io::Read as _;
    let url = crate::fetch::Url::parse(url)
        .map_err(|e| SwarmError::Io(format!("the HTTP fallback URL {url}: {e}")))?;
    let tls = if url.to_string().starts_with("https") {
        Some(
            crate::fetch::tls_config(None)
                .map_err(|e| SwarmError::Io(format!("TLS for the HTTP fallback: {e}")))?,
        )
    } else {
        None
    };
    let pl = u64::from(shared.index().header.piece_length);
    let total = shared.index().piece_count();
    let mut attempts: HashMap<u64, u32> = HashMap::new();
    let mut i = 0;
    while i < total {
        if shared.is_written(i) {
            i += 1;
            continue;
        }
        if !progress() {
            return Err(SwarmError::Aborted);
        }
        // A run of missing pieces, at most 16 MiB.
        let mut end = i + 1;
        while end < total && !shared.is_written(end) && (end - i) * pl < (16 << 20) {
            end += 1;
        }
        let start_b = i * pl;
        let end_b = (start_b + (end - i) * pl).min(shared.index().header.used_bytes);
        let got = crate::fetch::get_range(&url, start_b, end_b, timeout, tls.as_ref());
        let mut failed = None;
        match got {
            Ok(mut body) => {
                let mut p = i;
                while p < end {
                    let len = shared.index().piece_len(p) as usize;
                    let mut buf = shared.buffer(len);
                    if let Err(e) = body.read_exact(&mut buf.as_mut_slice()[..len]) {
                        failed = Some(format!("reading piece {p} from {url}: {e}"));
                        break;
                    }
                    shared
                        .bytes_over_http
                        .fetch_add(len as u64, Ordering::Relaxed);
                    if let Err(e) = shared.write_piece(p, buf, Checked::No) {
                        if e.contains("SHA-1") {
                            failed = Some(format!("piece {p} from {url}: {e}"));
                            break;
                        }
                        return Err(SwarmError::Io(e));
                    }
                    p += 1;
                }
                if failed.is_none() {
                    i = end;
                    continue;
                }
                i = p;
            }
            Err(e) => failed = Some(format!("fetching bytes {start_b}-{end_b} of {url}: {e}")),
        }
        let n = attempts.entry(i).or_insert(0);
        *n += 1;
        if *n >= HTTP_ATTEMPTS {
            return Err(SwarmError::Io(format!(
                "the HTTP fallback gave up after {HTTP_ATTEMPTS} attempts: {}",
                failed.unwrap_or_default()
            )));
        }
        tracing::warn!(
            attempt = *n,
            error = failed.as_deref().unwrap_or(""),
            "HTTP fallback: retrying"
        );
        std::thread::sleep(Duration::from_millis(200 << *n));
    }
    Ok(())
}

async fn leech(
    session: &Arc<Session>,
    torrent: &[u8],
    shared: &Arc<Slot>,
    total: u64,
    cfg: &SwarmConfig,
    progress: &mut dyn FnMut(&SwarmStats) -> bool,
) -> Result<(Arc<ManagedTorrent>, Option<SwarmError>), SwarmError> {
    let handle = session
        .add_torrent(
            AddTorrent::TorrentFileBytes(torrent.to_vec().into()),
            Some(AddTorrentOptions {
                overwrite: true,
                initial_peers: Some(cfg.peers.clone()),
                trackers: Some(cfg.trackers.clone()),
                disable_trackers: cfg.trackers.is_empty(),
                rarest_first: cfg.rarest_first,
                seeder_stripes: cfg.seeder_stripes,
                peer_limit: cfg.peer_limit,
                max_uploads: cfg.max_uploads,
                peer_opts: Some(librqbit::PeerConnectionOptions {
                    max_request_window: Some(cfg.request_window.unwrap_or(REQUEST_WINDOW).max(1)),
                    ..Default::default()
                }),
                storage_factory: Some(SlotFactory(shared.clone()).boxed()),
                ..Default::default()
            }),
        )
        .await
        .map_err(SwarmError::Torrent)?
        .into_handle()
        .ok_or_else(|| SwarmError::Torrent(anyhow::anyhow!("the torrent was only listed")))?;
    let mut last = (0u64, Instant::now());
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        if let Some(e) = shared.error.lock().ok().and_then(|e| e.clone()) {
            return Err(SwarmError::Io(e));
        }
        let have = shared.writer.progress().pieces;
        if have == total {
            return Ok((handle, None));
        }
        if !progress(&stats_of(&handle, shared, &cfg.seeders, 0.0)) {
            return Err(SwarmError::Aborted);
        }
        if have != last.0 {
            last = (have, Instant::now());
        } else if last.1.elapsed() >= cfg.stall_timeout {
            let peers = handle
                .live()
                .map(|l| peer_stats(&l.per_peer_stats_snapshot(all_peers()), &cfg.seeders).peers)
                .unwrap_or(0);
            return Ok((
                handle,
                Some(SwarmError::Stalled {
                    secs: cfg.stall_timeout.as_secs(),
                    have,
                    total,
                    peers,
                }),
            ));
        }
    }
}

fn all_peers() -> PeerStatsFilter {
    PeerStatsFilter {
        state: PeerStatsFilterState::All,
    }
}

fn peer_stats(snap: &PeerStatsSnapshot, seeders: &[SocketAddr]) -> SwarmStats {
    let mut s = SwarmStats::default();
    for (addr, p) in &snap.peers {
        let c = &p.counters;
        s.bytes_uploaded += c.uploaded_bytes;
        if c.fetched_bytes > 0 {
            s.peers += 1;
        }
        // By address, not port: a seeder that connects to us comes from an
        // ephemeral port.
        let from_seeder = addr
            .parse::<SocketAddr>()
            .is_ok_and(|a| seeders.iter().any(|s| s.ip() == a.ip()));
        if from_seeder {
            s.bytes_from_seeders += c.fetched_bytes;
        } else {
            s.bytes_from_peers += c.fetched_bytes;
        }
    }
    s
}

/// The stream's SHA-256, computed in order in a thread of its own while the
/// pieces arrive: each piece is hashed as soon as every piece before it is
/// written, from the piece cache while it is there (the bytes that were
/// checked and written), else read back from the target. At the end only
/// the pieces past the first one written late are left to hash: with 16
/// machines on one host (2 cores), hashing every stream after its last
/// piece took 1.5-2 s of a 32 s run; what is left then, 0-0.6 s.
struct StreamHasher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), SwarmError>>>,
}

impl StreamHasher {
    fn start(shared: Arc<Slot>) -> Result<Self, SwarmError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("stream-sha256".into())
            .spawn(move || hash_stream(&shared, &flag))
            .map_err(|e| SwarmError::Io(format!("starting the stream's hash: {e}")))?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }

    /// Waits for the last pieces' hash (every piece must be written) and
    /// compares the stream's SHA-256 with the index's.
    fn finish(mut self) -> Result<(), SwarmError> {
        let Some(thread) = self.thread.take() else {
            return Err(SwarmError::Io("the stream's hash thread is gone".into()));
        };
        thread
            .join()
            .map_err(|_| SwarmError::Io("the stream's hash thread panicked".into()))?
    }
}

impl Drop for StreamHasher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The hashing thread of [`StreamHasher`]: Ok once the stream's SHA-256
/// matches the index's; an error when it does not, or when `stop` is set
/// before every piece was written.
fn hash_stream(shared: &Slot, stop: &AtomicBool) -> Result<(), SwarmError> {
    let mut h = sha2::Sha256::new();
    let pl = u64::from(shared.index().header.piece_length);
    let mut buf = vec![0u8; pl as usize];
    for i in 0..shared.index().piece_count() {
        while !shared.writer.wait_written(i, Duration::from_millis(100)) {
            if stop.load(Ordering::Relaxed) {
                return Err(SwarmError::Aborted);
            }
        }
        let n = shared.index().piece_len(i) as usize;
        let piece = &mut buf[..n];
        let cached = shared
            .read_cached(i, 0, piece)
            .map_err(|e| SwarmError::Io(format!("piece {i} from the cache: {e}")))?;
        if !cached {
            shared.read_back(i * pl, piece).map_err(|e| {
                SwarmError::Io(format!("reading piece {i} back from the target: {e}"))
            })?;
        }
        sha2::Digest::update(&mut h, &*piece);
    }
    let got: [u8; 32] = sha2::Digest::finalize(h).into();
    if got != shared.index().header.stream_sha256 {
        return Err(SwarmError::StreamHash {
            want: hex::encode(shared.index().header.stream_sha256),
            got: hex::encode(got),
        });
    }
    Ok(())
}

/// How long a seeder's start-up check of one stream may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(600);

/// A seeder: serves content streams of a content store to a swarm until
/// dropped.
pub struct Seeder {
    rt: Option<tokio::runtime::Runtime>,
    session: Arc<Session>,
    addr: SocketAddr,
    handles: Vec<Arc<ManagedTorrent>>,
}

impl Seeder {
    /// Starts seeding each `(torrent, stream file)` on `listen`, announcing
    /// to `trackers`, sending at most `upload_bps` bytes per second in all
    /// (none: no cap).
    pub fn start(
        listen: SocketAddr,
        contents: &[(Vec<u8>, PathBuf)],
        trackers: &[String],
        upload_bps: Option<u32>,
    ) -> Result<Self, SwarmError> {
        let rt = runtime()?;
        let (session, handles) = rt.block_on(async {
            let session = session(listen, upload_bps).await?;
            let mut handles = Vec::new();
            for (torrent, stream) in contents {
                let file = File::open(stream).map_err(|source| SwarmError::Target {
                    path: stream.clone(),
                    source,
                })?;
                let handle = session
                    .add_torrent(
                        AddTorrent::TorrentFileBytes(torrent.clone().into()),
                        Some(AddTorrentOptions {
                            overwrite: true,
                            trackers: Some(trackers.to_vec()),
                            disable_trackers: trackers.is_empty(),
                            storage_factory: Some(StreamFactory(Arc::new(file)).boxed()),
                            ..Default::default()
                        }),
                    )
                    .await
                    .map_err(SwarmError::Torrent)?
                    .into_handle()
                    .ok_or_else(|| {
                        SwarmError::Torrent(anyhow::anyhow!("the torrent was only listed"))
                    })?;
                // The start-up check hashes the stream once: a store whose
                // stream does not match its torrent is refused here.
                tokio::time::timeout(CHECK_TIMEOUT, handle.wait_until_completed())
                    .await
                    .map_err(|_| {
                        SwarmError::Torrent(anyhow::anyhow!(
                            "{} does not match its torrent (checked for {} s)",
                            stream.display(),
                            CHECK_TIMEOUT.as_secs()
                        ))
                    })?
                    .map_err(SwarmError::Torrent)?;
                if !handle.stats().finished {
                    return Err(SwarmError::Torrent(anyhow::anyhow!(
                        "{} does not match its torrent",
                        stream.display()
                    )));
                }
                handles.push(handle);
            }
            Ok::<_, SwarmError>((session, handles))
        })?;
        let addr = session
            .listen_addr()
            .ok_or_else(|| SwarmError::Start(anyhow::anyhow!("the seeder does not listen")))?;
        Ok(Self {
            rt: Some(rt),
            session,
            addr,
            handles,
        })
    }

    /// Bytes sent to peers so far, all contents together.
    pub fn uploaded_bytes(&self) -> u64 {
        self.handles.iter().map(|h| h.stats().uploaded_bytes).sum()
    }

    /// The address peers reach it at.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl std::fmt::Debug for Seeder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seeder").field("addr", &self.addr).finish()
    }
}

impl Drop for Seeder {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.block_on(self.session.stop());
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

/// `anneal-agent seed`: seeds contents of a content store until killed.
#[derive(Debug, clap::Args)]
pub struct SeedArgs {
    /// The content store: `<namespace>/<content>/{index,stream}`.
    #[arg(long)]
    pub content_dir: PathBuf,
    /// A content to seed, `<namespace>/<content>` (repeat for more).
    #[arg(long = "content", required = true)]
    pub contents: Vec<String>,
    /// Listen address for peers (announced as is: no NAT in front).
    #[arg(long, default_value = "0.0.0.0:6881")]
    pub listen: SocketAddr,
    /// Tracker announce URL (repeat for more; none: peers must know us).
    #[arg(long = "tracker")]
    pub trackers: Vec<String>,
    /// Upload cap in bytes per second, all contents together.
    #[arg(long)]
    pub upload_bps: Option<u32>,
    /// Print `{"event":"uploaded","bytes":N}` (bytes sent to peers since
    /// the start, closed connections included) every this many seconds
    /// (0: never).
    #[arg(long, default_value_t = 0)]
    pub report_uploads_secs: u64,
}

/// `anneal-agent swarm-fetch`: one content from its swarm onto a slot.
#[derive(Debug, clap::Args)]
pub struct FetchArgs {
    /// The content's index (the torrent is made from it and `--name`).
    #[arg(long)]
    pub index: PathBuf,
    /// The content's name (the torrent's file is `<name>.stream`).
    #[arg(long)]
    pub name: String,
    /// The disk or file to write.
    #[arg(long)]
    pub target: PathBuf,
    /// Byte offset of the slot on the target.
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    /// Bytes in the slot (default: from `--offset` to the target's end): a
    /// content larger than the slot is refused before anything is written.
    #[arg(long)]
    pub slot_size: Option<u64>,
    /// Listen address for peers.
    #[arg(long, default_value = "0.0.0.0:6881")]
    pub listen: SocketAddr,
    /// A seeder's address (repeat for more).
    #[arg(long = "seeder")]
    pub seeders: Vec<SocketAddr>,
    /// Another peer's address (repeat for more).
    #[arg(long = "peer")]
    pub peers: Vec<SocketAddr>,
    /// Tracker announce URL (repeat for more).
    #[arg(long = "tracker")]
    pub trackers: Vec<String>,
    /// librqbit's stock piece order instead of rarest-first.
    #[arg(long)]
    pub stock_order: bool,
    /// Ask the seeders for any piece no leecher has, not only this
    /// leecher's stripe.
    #[arg(long)]
    pub no_seeder_stripes: bool,
    /// Seconds without a piece before giving up.
    #[arg(long, default_value_t = 60)]
    pub stall_timeout: u64,
    /// Seconds to go on serving the other peers once written.
    #[arg(long, default_value_t = 0)]
    pub seed_after: u64,
    /// The content's stream over HTTP, for the pieces missing after a stall.
    #[arg(long)]
    pub http_fallback: Option<String>,
    /// MiB of verified pieces kept in memory to serve the other peers
    /// (default: sized from the memory available).
    #[arg(long)]
    pub piece_cache_mib: Option<u64>,
    /// Most peer connections (default: librqbit's).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Most peers uploaded to at once (0: none; default: every peer that
    /// asks).
    #[arg(long)]
    pub max_uploads: Option<usize>,
    /// Chunk requests (16 KiB) kept outstanding per peer (default 16).
    #[arg(long)]
    pub request_window: Option<usize>,
    /// Print `{"event":"progress",…}` with the figures every this many
    /// milliseconds while fetching (0: never).
    #[arg(long, default_value_t = 0)]
    pub report_ms: u64,
}

/// Bytes of the disk or file at `path`.
fn target_len(path: &Path) -> anyhow::Result<u64> {
    use std::io::Seek as _;
    let mut f = File::open(path)
        .map_err(|e| anyhow::anyhow!("opening the target {}: {e}", path.display()))?;
    f.seek(std::io::SeekFrom::End(0))
        .map_err(|e| anyhow::anyhow!("sizing the target {}: {e}", path.display()))
}

fn print_json(v: &serde_json::Value) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// Runs `anneal-agent seed`: prints `{"event":"seeding",...}` once every
/// content is checked, then serves until killed. Errors name the content.
pub fn run_seed(a: &SeedArgs) -> anyhow::Result<()> {
    let mut items = Vec::new();
    let mut listed = Vec::new();
    for c in &a.contents {
        let (ns, name) = c
            .split_once('/')
            .ok_or_else(|| anyhow::anyhow!("--content {c}: expected <namespace>/<content>"))?;
        let dir = crate::store::content_dir(&a.content_dir, ns, name);
        let raw = std::fs::read(dir.join("index")).map_err(|e| {
            anyhow::anyhow!("content {c}: reading {}: {e}", dir.join("index").display())
        })?;
        let index = ContentIndex::parse(&raw).map_err(|e| anyhow::anyhow!("content {c}: {e}"))?;
        let meta = anneal_image::torrent::Metainfo::from_index(
            &index,
            name,
            a.trackers.first().map(String::as_str),
        );
        listed.push(serde_json::json!({"content": c, "infoHash": meta.info_hash_hex(), "pieces": index.piece_count()}));
        items.push((meta.to_bytes(), dir.join("stream")));
    }
    let seeder = Seeder::start(a.listen, &items, &a.trackers, a.upload_bps)?;
    print_json(
        &serde_json::json!({"event": "seeding", "addr": seeder.addr().to_string(), "contents": listed}),
    );
    // The workload protocol's form of the same news (the manager reads the
    // last `progress` line: the seeder is ready).
    print_json(
        &serde_json::json!({"event": "progress", "state": "seeding", "addr": seeder.addr().to_string()}),
    );
    if a.report_uploads_secs > 0 {
        loop {
            std::thread::sleep(Duration::from_secs(a.report_uploads_secs));
            print_json(&serde_json::json!({"event": "uploaded", "bytes": seeder.uploaded_bytes()}));
        }
    }
    loop {
        std::thread::park();
    }
}

/// Runs `anneal-agent swarm-fetch`: prints `{"event":"written",...}` when
/// the content is on the target and verified, serves the others for
/// `--seed-after` seconds, then prints `{"event":"done",...}`.
pub fn run_fetch(a: &FetchArgs) -> anyhow::Result<()> {
    let raw = std::fs::read(&a.index)
        .map_err(|e| anyhow::anyhow!("reading the index {}: {e}", a.index.display()))?;
    let index = ContentIndex::parse(&raw)
        .map_err(|e| anyhow::anyhow!("the index {}: {e}", a.index.display()))?;
    let torrent = anneal_image::torrent::Metainfo::from_index(&index, &a.name, None).to_bytes();
    let mut peers = a.seeders.clone();
    peers.extend(a.peers.iter().copied());
    let cfg = SwarmConfig {
        listen: a.listen,
        peers,
        seeders: a.seeders.clone(),
        trackers: a.trackers.clone(),
        rarest_first: !a.stock_order,
        seeder_stripes: !a.no_seeder_stripes,
        stall_timeout: Duration::from_secs(a.stall_timeout.max(1)),
        http_fallback: a.http_fallback.clone(),
        piece_cache: a.piece_cache_mib.map(|m| m << 20),
        peer_limit: a.max_connections,
        max_uploads: a.max_uploads,
        request_window: a.request_window,
    };
    let every = (a.report_ms > 0).then(|| Duration::from_millis(a.report_ms));
    let slot_size = match a.slot_size {
        Some(n) => n,
        None => target_len(&a.target)?.saturating_sub(a.offset),
    };
    let slot = SlotRange {
        offset: a.offset,
        size: slot_size,
    };
    let leeched = fetch_to_slot_reporting(&torrent, &index, &a.target, slot, &cfg, every)?;
    print_json(&serde_json::json!({"event": "written", "stats": leeched.stats}));
    if a.seed_after > 0 {
        std::thread::sleep(Duration::from_secs(a.seed_after));
    }
    print_json(&serde_json::json!({"event": "done", "stats": leeched.seeding.stats()}));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(byte: u8) -> AlignedBuf {
        let mut b = AlignedBuf::new(4096);
        b.as_mut_slice().fill(byte);
        b
    }

    #[test]
    fn the_piece_cache_drops_the_oldest_piece_past_its_budget() {
        let mut c = PieceCache::new(2 * 4096);
        assert!(c.insert(7, piece(7)).is_empty());
        assert!(c.insert(3, piece(3)).is_empty());
        let dropped = c.insert(9, piece(9));
        assert_eq!(dropped.len(), 1);
        assert_eq!(
            dropped[0].as_slice()[0],
            7,
            "the oldest piece is handed back"
        );
        assert!(c.get(7).is_none(), "the oldest piece stays");
        assert_eq!(c.get(3).map(|b| b.as_slice()[0]), Some(3));
        assert_eq!(c.get(9).map(|b| b.as_slice()[4095]), Some(9));
        assert_eq!(c.bytes, 2 * 4096);
        // A piece larger than the whole budget is not kept, and evicts
        // nothing.
        let mut small = PieceCache::new(1024);
        assert_eq!(small.insert(1, piece(1)).len(), 1);
        assert!(small.get(1).is_none());
        assert_eq!(small.bytes, 0);
        assert!(piece_cache_budget() > 0);
    }
}
