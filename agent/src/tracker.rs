//! A minimal HTTP BitTorrent tracker (`anneal-agent tracker`): the Site's
//! tracker, which only hands out peers (BEP 3 announce, BEP 23 compact peer
//! lists); it never sees a piece.
//!
//! - `GET /announce?info_hash=…&peer_id=…&port=…&uploaded=…&downloaded=…&left=…[&event=started|completed|stopped][&compact=1][&numwant=N]`:
//!   a bencoded `{complete, incomplete, interval, min interval, peers[, peers6]}`;
//!   `peers` is the compact string (6 bytes per IPv4 peer) when `compact=1`,
//!   else a list of `{ip, peer id, port}` dictionaries. A peer is its source
//!   address (the `ip` parameter is ignored: a client cannot register
//!   somebody else) with the announced port, keyed by (address, peer id). A
//!   seeder (`left=0`) is sent only leechers; the requester is never sent
//!   itself; at most `numwant` (default 50, at most 200), chosen at random.
//! - Anything the tracker refuses gets `{failure reason}` (bencoded, status
//!   200 as BEP 3 has it; 400/431 with the same body when the HTTP request
//!   itself is malformed or too large).
//! - A peer that has not announced for two intervals is dropped; `stopped`
//!   drops it at once. A torrent with no peers left is forgotten after the
//!   same time.
//! - Bounded: `max_torrents` torrents, `max_peers` per torrent (expired peers
//!   are swept before a newcomer is refused), request heads of at most 8 KiB
//!   read within `header_timeout`, at most `max_connections` at once (the
//!   next one gets 503), one request per connection.
//! - Optional allow-list: a file of hex info hashes, one per line (`#`
//!   comments), re-read when it changes, or a content store (the torrents
//!   of its verified contents, rescanned every 5 s and on an unknown hash
//!   at most once a second); a torrent not in it is
//!   refused. An unreadable allow-list refuses everything (it fails closed).
//! - `GET /stats`: JSON counters and, per torrent, seeders, leechers and the
//!   `started`/`completed`/`stopped` events seen.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use anneal_image::torrent::Value;

/// The largest request head read (request line and headers).
pub const MAX_HEAD: usize = 8 * 1024;
/// Peers sent when the client does not say (`numwant`).
pub const DEFAULT_NUMWANT: usize = 50;
/// Most peers sent in one answer.
pub const MAX_NUMWANT: usize = 200;

/// Settings of the tracker.
#[derive(Debug, Clone)]
pub struct TrackerConfig {
    /// Announce interval told to clients; peers expire after two of them.
    pub interval: Duration,
    /// Torrents tracked at once.
    pub max_torrents: usize,
    /// Peers per torrent.
    pub max_peers: usize,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time allowed to send a whole request head.
    pub header_timeout: Duration,
    /// Only these info hashes are tracked (a file re-read when it changes).
    pub allow_file: Option<PathBuf>,
    /// Only the torrents of this content store's verified contents are
    /// tracked ([`store_info_hashes`], rescanned every [`STORE_RESCAN`]).
    pub allow_store: Option<PathBuf>,
}

/// How often an `allow_store` allow-list is rescanned.
pub const STORE_RESCAN: Duration = Duration::from_secs(5);

/// The info hashes of the verified contents of a content store
/// (`<store>/<namespace>/<content>/` with its `verified` marker): the
/// torrents the Site's seeders can serve. `known` caches each content's
/// hash by its marker's modification time, so an unchanged content's index
/// is not read again.
pub fn store_info_hashes(
    store: &Path,
    known: &mut HashMap<PathBuf, (SystemTime, [u8; 20])>,
) -> io::Result<HashSet<[u8; 20]>> {
    let mut set = HashSet::new();
    let mut seen = HashSet::new();
    for ns in std::fs::read_dir(store)? {
        let ns = ns?;
        // not a namespace (no namespace name starts with a dot): bootd's
        // leases (`.bootd`, root's, 0700), staging
        if !ns.file_type()?.is_dir() || ns.file_name().as_encoded_bytes().starts_with(b".") {
            continue;
        }
        for c in std::fs::read_dir(ns.path())? {
            let c = c?;
            let dir = c.path();
            let Ok(marked) =
                std::fs::metadata(dir.join(crate::store::VERIFIED)).and_then(|m| m.modified())
            else {
                continue;
            };
            let Some(name) = c.file_name().to_str().map(str::to_string) else {
                continue;
            };
            seen.insert(dir.clone());
            if let Some((t, h)) = known.get(&dir)
                && *t == marked
            {
                set.insert(*h);
                continue;
            }
            let Ok(index) = std::fs::read(dir.join("index"))
                .map_err(|e| e.to_string())
                .and_then(|raw| {
                    anneal_image::format::ContentIndex::parse(&raw).map_err(|e| e.to_string())
                })
            else {
                continue;
            };
            let h = anneal_image::torrent::Metainfo::from_index(&index, &name, None).info_hash();
            known.insert(dir, (marked, h));
            set.insert(h);
        }
    }
    known.retain(|d, _| seen.contains(d));
    Ok(set)
}

impl Default for TrackerConfig {
    /// 60 s interval, 1024 torrents of at most 1024 peers, 256
    /// connections, 5 s for a request head, every torrent allowed.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            max_torrents: 1024,
            max_peers: 1024,
            max_connections: 256,
            header_timeout: Duration::from_secs(5),
            allow_file: None,
            allow_store: None,
        }
    }
}

/// Errors starting the tracker.
#[derive(Debug, thiserror::Error)]
pub enum TrackerError {
    /// The listen address cannot be bound.
    #[error("binding {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// An announce the tracker refuses; the message is the `failure reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnounceError {
    /// A required parameter is absent.
    #[error("missing parameter {0}")]
    Missing(&'static str),
    /// A parameter is present but not valid.
    #[error("invalid parameter {0}: {1}")]
    Invalid(&'static str, &'static str),
    /// The info hash is not in the allow-list.
    #[error("torrent {0} is not tracked here (not published by the manager)")]
    NotAllowed(String),
    /// The allow-list file cannot be read.
    #[error("the tracker's allow-list is unreadable; nothing is tracked until it is fixed")]
    AllowListUnreadable,
    /// `max_torrents` reached.
    #[error("tracker full: {0} torrents tracked already")]
    TooManyTorrents(usize),
    /// `max_peers` reached for this torrent.
    #[error("torrent full: {0} peers already")]
    TooManyPeers(usize),
}

/// The `event` of an announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A regular (periodic) announce.
    None,
    /// The first announce of a download.
    Started,
    /// The download just completed.
    Completed,
    /// The client stops.
    Stopped,
}

/// A parsed announce request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announce {
    /// The torrent.
    pub info_hash: [u8; 20],
    /// The client's id.
    pub peer_id: [u8; 20],
    /// The client's listening port.
    pub port: u16,
    /// Bytes uploaded so far.
    pub uploaded: u64,
    /// Bytes downloaded so far.
    pub downloaded: u64,
    /// Bytes still missing (0: a seeder).
    pub left: u64,
    /// What happened.
    pub event: Event,
    /// Compact peer list wanted (BEP 23).
    pub compact: bool,
    /// Peers wanted, if said.
    pub numwant: Option<usize>,
}

/// Decodes `%XX` escapes (`+` stays `+`: a binary info hash is always
/// escaped by clients).
pub fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

fn id20(v: Option<Vec<u8>>, what: &'static str) -> Result<[u8; 20], AnnounceError> {
    let v = v.ok_or(AnnounceError::Missing(what))?;
    <[u8; 20]>::try_from(v.as_slice())
        .map_err(|_| AnnounceError::Invalid(what, "must be 20 bytes, percent-encoded"))
}

fn number(v: Option<Vec<u8>>, what: &'static str) -> Result<u64, AnnounceError> {
    let v = v.ok_or(AnnounceError::Missing(what))?;
    std::str::from_utf8(&v)
        .ok()
        .filter(|s| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit()))
        .and_then(|s| s.parse().ok())
        .ok_or(AnnounceError::Invalid(what, "must be a decimal number"))
}

/// Parses the query string of an announce (without the `?`).
pub fn parse_announce(query: &str) -> Result<Announce, AnnounceError> {
    let mut params: HashMap<&str, Vec<u8>> = HashMap::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        const KNOWN: [&str; 9] = [
            "info_hash",
            "peer_id",
            "port",
            "uploaded",
            "downloaded",
            "left",
            "event",
            "compact",
            "numwant",
        ];
        // key, ip, no_peer_id, supportcrypto, …: ignored
        let Some(key) = KNOWN.into_iter().find(|n| *n == k) else {
            continue;
        };
        let v = percent_decode(v).ok_or(AnnounceError::Invalid(
            "query",
            "bad percent-encoding (%XX with two hex digits)",
        ))?;
        if params.insert(key, v).is_some() {
            return Err(AnnounceError::Invalid(key, "given more than once"));
        }
    }
    let info_hash = id20(params.remove("info_hash"), "info_hash")?;
    let peer_id = id20(params.remove("peer_id"), "peer_id")?;
    let port = u16::try_from(number(params.remove("port"), "port")?)
        .ok()
        .filter(|&p| p != 0)
        .ok_or(AnnounceError::Invalid("port", "must be 1..65535"))?;
    let uploaded = number(params.remove("uploaded"), "uploaded")?;
    let downloaded = number(params.remove("downloaded"), "downloaded")?;
    let left = number(params.remove("left"), "left")?;
    let event = match params.remove("event").as_deref() {
        None | Some(b"") | Some(b"empty") => Event::None,
        Some(b"started") => Event::Started,
        Some(b"completed") => Event::Completed,
        Some(b"stopped") => Event::Stopped,
        Some(_) => {
            return Err(AnnounceError::Invalid(
                "event",
                "must be started, completed or stopped",
            ));
        }
    };
    let compact = match params.remove("compact").as_deref() {
        None | Some(b"0") => false,
        Some(b"1") => true,
        Some(_) => return Err(AnnounceError::Invalid("compact", "must be 0 or 1")),
    };
    let numwant = match params.remove("numwant") {
        None => None,
        Some(v) => Some(usize::try_from(number(Some(v), "numwant")?).unwrap_or(usize::MAX)),
    };
    Ok(Announce {
        info_hash,
        peer_id,
        port,
        uploaded,
        downloaded,
        left,
        event,
        compact,
        numwant,
    })
}

/// One peer of a torrent.
#[derive(Debug, Clone)]
struct Peer {
    addr: SocketAddr,
    left: u64,
    last: Instant,
}

/// One torrent's peers and the events seen for it.
#[derive(Debug, Clone)]
struct Swarm {
    peers: HashMap<(IpAddr, [u8; 20]), Peer>,
    last: Instant,
    started: u64,
    completed: u64,
    stopped: u64,
}

impl Swarm {
    fn counts(&self) -> (usize, usize) {
        let seeders = self.peers.values().filter(|p| p.left == 0).count();
        (seeders, self.peers.len() - seeders)
    }
}

/// The answer to an accepted announce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Seeders of the torrent (after this announce).
    pub complete: usize,
    /// Leechers of the torrent.
    pub incomplete: usize,
    /// The peers handed out.
    pub peers: Vec<SocketAddr>,
    /// Their peer ids (for the non-compact form).
    pub peer_ids: Vec<[u8; 20]>,
}

/// A torrent's numbers (`/stats`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SwarmStats {
    /// Lowercase hex.
    pub info_hash: String,
    /// Peers with nothing left to download.
    pub seeders: usize,
    /// The other peers.
    pub leechers: usize,
    /// `started` events seen.
    pub started: u64,
    /// `completed` events seen.
    pub completed: u64,
    /// `stopped` events seen.
    pub stopped: u64,
}

/// The peers of every torrent, with expiry and bounds. Pure: the caller
/// passes the time, so tests move the clock.
#[derive(Debug)]
pub struct PeerTable {
    swarms: HashMap<[u8; 20], Swarm>,
    expiry: Duration,
    max_torrents: usize,
    max_peers: usize,
}

impl PeerTable {
    /// A table whose peers expire after `expiry` without an announce.
    pub fn new(expiry: Duration, max_torrents: usize, max_peers: usize) -> Self {
        Self {
            swarms: HashMap::new(),
            expiry,
            max_torrents: max_torrents.max(1),
            max_peers: max_peers.max(1),
        }
    }

    /// Drops expired peers and forgotten torrents.
    pub fn sweep(&mut self, now: Instant) {
        let expiry = self.expiry;
        self.swarms.retain(|_, s| {
            s.peers
                .retain(|_, p| now.saturating_duration_since(p.last) < expiry);
            !s.peers.is_empty() || now.saturating_duration_since(s.last) < expiry
        });
    }

    /// Records an announce from `ip` and chooses the peers to send back.
    pub fn announce(
        &mut self,
        a: &Announce,
        ip: IpAddr,
        now: Instant,
    ) -> Result<Reply, AnnounceError> {
        if !self.swarms.contains_key(&a.info_hash) {
            if a.event == Event::Stopped {
                return Ok(Reply {
                    complete: 0,
                    incomplete: 0,
                    peers: Vec::new(),
                    peer_ids: Vec::new(),
                });
            }
            if self.swarms.len() >= self.max_torrents {
                self.sweep(now);
                if self.swarms.len() >= self.max_torrents {
                    return Err(AnnounceError::TooManyTorrents(self.swarms.len()));
                }
            }
        }
        let expiry = self.expiry;
        let max_peers = self.max_peers;
        let swarm = self.swarms.entry(a.info_hash).or_insert_with(|| Swarm {
            peers: HashMap::new(),
            last: now,
            started: 0,
            completed: 0,
            stopped: 0,
        });
        swarm.last = now;
        let key = (ip, a.peer_id);
        match a.event {
            Event::Started => swarm.started += 1,
            Event::Completed => swarm.completed += 1,
            Event::Stopped => swarm.stopped += 1,
            Event::None => {}
        }
        if a.event == Event::Stopped {
            swarm.peers.remove(&key);
            let (complete, incomplete) = swarm.counts();
            return Ok(Reply {
                complete,
                incomplete,
                peers: Vec::new(),
                peer_ids: Vec::new(),
            });
        }
        if !swarm.peers.contains_key(&key) && swarm.peers.len() >= max_peers {
            swarm
                .peers
                .retain(|_, p| now.saturating_duration_since(p.last) < expiry);
            if swarm.peers.len() >= max_peers {
                return Err(AnnounceError::TooManyPeers(swarm.peers.len()));
            }
        }
        swarm.peers.insert(
            key,
            Peer {
                addr: SocketAddr::new(ip, a.port),
                left: a.left,
                last: now,
            },
        );
        let seeder = a.left == 0;
        let mut candidates: Vec<(&(IpAddr, [u8; 20]), &Peer)> = swarm
            .peers
            .iter()
            .filter(|(k, p)| {
                **k != key
                    && now.saturating_duration_since(p.last) < expiry
                    && !(seeder && p.left == 0)
            })
            .collect();
        {
            use rand::seq::SliceRandom as _;
            candidates.shuffle(&mut rand::rng());
        }
        candidates.truncate(a.numwant.unwrap_or(DEFAULT_NUMWANT).min(MAX_NUMWANT));
        let (complete, incomplete) = swarm.counts();
        Ok(Reply {
            complete,
            incomplete,
            peers: candidates.iter().map(|(_, p)| p.addr).collect(),
            peer_ids: candidates.iter().map(|(k, _)| k.1).collect(),
        })
    }

    /// Every torrent's numbers, by info hash.
    pub fn stats(&self) -> Vec<SwarmStats> {
        let mut out: Vec<SwarmStats> = self
            .swarms
            .iter()
            .map(|(h, s)| {
                let (seeders, leechers) = s.counts();
                SwarmStats {
                    info_hash: hex::encode(h),
                    seeders,
                    leechers,
                    started: s.started,
                    completed: s.completed,
                    stopped: s.stopped,
                }
            })
            .collect();
        out.sort_by(|a, b| a.info_hash.cmp(&b.info_hash));
        out
    }
}

/// The bencoded answer to an accepted announce.
pub fn encode_reply(r: &Reply, interval: Duration, compact: bool) -> Vec<u8> {
    let secs = i64::try_from(interval.as_secs()).unwrap_or(i64::MAX);
    let count = |n: usize| Value::Int(i64::try_from(n).unwrap_or(i64::MAX));
    let mut d = BTreeMap::new();
    d.insert(b"complete".to_vec(), count(r.complete));
    d.insert(b"incomplete".to_vec(), count(r.incomplete));
    d.insert(b"interval".to_vec(), Value::Int(secs));
    d.insert(b"min interval".to_vec(), Value::Int(secs));
    if compact {
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        for p in &r.peers {
            match p.ip() {
                IpAddr::V4(ip) => {
                    v4.extend_from_slice(&ip.octets());
                    v4.extend_from_slice(&p.port().to_be_bytes());
                }
                IpAddr::V6(ip) => {
                    v6.extend_from_slice(&ip.octets());
                    v6.extend_from_slice(&p.port().to_be_bytes());
                }
            }
        }
        d.insert(b"peers".to_vec(), Value::Bytes(v4));
        if !v6.is_empty() {
            d.insert(b"peers6".to_vec(), Value::Bytes(v6));
        }
    } else {
        let list = r
            .peers
            .iter()
            .zip(&r.peer_ids)
            .map(|(p, id)| {
                Value::dict([
                    ("ip", Value::str(&p.ip().to_string())),
                    ("peer id", Value::Bytes(id.to_vec())),
                    ("port", Value::Int(i64::from(p.port()))),
                ])
            })
            .collect();
        d.insert(b"peers".to_vec(), Value::List(list));
    }
    Value::Dict(d).encode()
}

/// `{failure reason: msg}`, bencoded.
pub fn encode_failure(msg: &str) -> Vec<u8> {
    Value::dict([("failure reason", Value::str(msg))]).encode()
}

/// The allow-list (a file, or a content store when `store`) and what it
/// held when last read.
#[derive(Debug)]
struct AllowList {
    path: PathBuf,
    store: bool,
    seen: Option<(SystemTime, u64)>,
    scanned: Option<Instant>,
    known: HashMap<PathBuf, (SystemTime, [u8; 20])>,
    hashes: Option<HashSet<[u8; 20]>>,
}

impl AllowList {
    fn new(path: PathBuf, store: bool) -> Self {
        Self {
            path,
            store,
            seen: None,
            scanned: None,
            known: HashMap::new(),
            hashes: None,
        }
    }

    /// Rescans the store when the last scan is older than [`STORE_RESCAN`].
    fn refresh_store(&mut self) {
        if self.scanned.is_some_and(|t| t.elapsed() < STORE_RESCAN) {
            return;
        }
        self.scanned = Some(Instant::now());
        match store_info_hashes(&self.path, &mut self.known) {
            Ok(set) => {
                if self.hashes.as_ref() != Some(&set) {
                    tracing::info!(store = %self.path.display(), torrents = set.len(), "allow-list: the store's verified contents");
                }
                self.hashes = Some(set);
            }
            Err(e) => {
                tracing::warn!(store = %self.path.display(), error = %e, "allow-list: the content store is unreadable; every announce is refused until it is readable");
                self.hashes = None;
            }
        }
    }

    /// Re-reads the file when its modification time or size changed.
    fn refresh(&mut self) {
        if self.store {
            return self.refresh_store();
        }
        let meta = std::fs::metadata(&self.path)
            .ok()
            .and_then(|m| Some((m.modified().ok()?, m.len())));
        if meta.is_some() && meta == self.seen {
            return;
        }
        self.seen = meta;
        match std::fs::read_to_string(&self.path) {
            Ok(text) => {
                let mut set = HashSet::new();
                for (n, line) in text.lines().enumerate() {
                    let line = line.split('#').next().unwrap_or("").trim();
                    if line.is_empty() {
                        continue;
                    }
                    match hex::decode(line)
                        .ok()
                        .and_then(|v| <[u8; 20]>::try_from(v).ok())
                    {
                        Some(h) => {
                            set.insert(h);
                        }
                        None => tracing::warn!(
                            file = %self.path.display(), line = n + 1,
                            "allow-list line is not a 40-hex-digit info hash; skipped"
                        ),
                    }
                }
                tracing::info!(file = %self.path.display(), torrents = set.len(), "allow-list read");
                self.hashes = Some(set);
            }
            Err(e) => {
                tracing::warn!(file = %self.path.display(), error = %e, "allow-list unreadable: every announce is refused until it is readable");
                self.hashes = None;
            }
        }
    }

    fn check(&mut self, h: &[u8; 20]) -> Result<(), AnnounceError> {
        self.refresh();
        // A content that became Ready since the last scan is tracked at
        // once: an unknown hash rescans the store (at most once a second;
        // unchanged contents cost a stat each).
        if self.store
            && !self.hashes.as_ref().is_some_and(|set| set.contains(h))
            && self
                .scanned
                .is_some_and(|t| t.elapsed() >= Duration::from_secs(1))
        {
            self.scanned = None;
            self.refresh();
        }
        match &self.hashes {
            None => Err(AnnounceError::AllowListUnreadable),
            Some(set) if set.contains(h) => Ok(()),
            Some(_) => Err(AnnounceError::NotAllowed(hex::encode(h))),
        }
    }
}

/// Counters of a running tracker.
#[derive(Debug, Default)]
pub struct TrackerStats {
    /// Announces answered with peers.
    pub announces: AtomicU64,
    /// Requests answered with a failure reason or an HTTP error.
    pub failures: AtomicU64,
    /// Connections refused because `max_connections` were open.
    pub busy: AtomicU64,
    /// Connections open now.
    pub open: AtomicUsize,
}

#[derive(Debug)]
struct State {
    table: PeerTable,
    allow: Option<AllowList>,
    last_sweep: Instant,
}

#[derive(Debug)]
struct Shared {
    cfg: TrackerConfig,
    state: Mutex<State>,
    stats: TrackerStats,
}

/// A bound tracker; [`Tracker::run`] serves until [`Stopper::stop`].
#[derive(Debug)]
pub struct Tracker {
    listener: TcpListener,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
}

/// Stops a running [`Tracker`].
#[derive(Debug, Clone)]
pub struct Stopper {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl Stopper {
    /// Asks the tracker to stop and wakes its accept loop.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

impl Tracker {
    /// Binds `addr`.
    pub fn bind(addr: SocketAddr, cfg: TrackerConfig) -> Result<Self, TrackerError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| TrackerError::Bind { addr, source })?;
        let now = Instant::now();
        let state = State {
            table: PeerTable::new(cfg.interval * 2, cfg.max_torrents, cfg.max_peers),
            allow: match (&cfg.allow_file, &cfg.allow_store) {
                (Some(f), _) => Some(AllowList::new(f.clone(), false)),
                (None, Some(s)) => Some(AllowList::new(s.clone(), true)),
                (None, None) => None,
            },
            last_sweep: now,
        };
        Ok(Self {
            listener,
            shared: Arc::new(Shared {
                cfg,
                state: Mutex::new(state),
                stats: TrackerStats::default(),
            }),
            stop: Arc::default(),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// A handle that stops [`Tracker::run`].
    pub fn stopper(&self) -> io::Result<Stopper> {
        Ok(Stopper {
            stop: self.stop.clone(),
            addr: self.local_addr()?,
        })
    }

    /// Serves until stopped: one thread per connection, at most
    /// `max_connections` of them.
    pub fn run(self) {
        for conn in self.listener.incoming() {
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            let Ok(mut stream) = conn else { continue };
            let stats = &self.shared.stats;
            let open = stats.open.fetch_add(1, Ordering::SeqCst);
            if open >= self.shared.cfg.max_connections {
                stats.open.fetch_sub(1, Ordering::SeqCst);
                stats.busy.fetch_add(1, Ordering::Relaxed);
                busy(&mut stream);
                tracing::warn!(open, "tracker: connection limit reached");
                continue;
            }
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new()
                .name("tracker-conn".into())
                .stack_size(128 * 1024)
                .spawn(move || {
                    let peer = stream.peer_addr().ok();
                    if let Err(e) = connection(&mut stream, &shared) {
                        tracing::debug!(?peer, error = %e, "tracker connection ended");
                    }
                    shared.stats.open.fetch_sub(1, Ordering::SeqCst);
                });
            if spawned.is_err() {
                self.shared.stats.open.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

/// 503 without blocking the accept loop (what was sent is drained first).
fn busy(stream: &mut TcpStream) {
    let _ = stream.set_nonblocking(true);
    let mut sink = [0u8; 4096];
    while let Ok(n) = stream.read(&mut sink) {
        if n == 0 {
            break;
        }
    }
    let body = encode_failure("tracker busy: too many connections, retry");
    let _ = respond(stream, 503, "text/plain", &body);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // A request that arrives after the first drain would make the close
    // send a reset, which can discard the 503 before the client reads it:
    // drain once more, briefly (at most 50 ms of the accept loop, and only
    // for connections over the limit).
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(Duration::from_millis(50)));
    let mut drained = 0usize;
    while drained < 64 * 1024 {
        match stream.read(&mut sink) {
            Ok(n) if n > 0 => drained += n,
            _ => break,
        }
    }
}

/// Reads one request head within the deadline. Err(InvalidData): too large.
fn read_head(stream: &mut TcpStream, timeout: Duration) -> io::Result<Vec<u8>> {
    let started = Instant::now();
    let mut buf = Vec::with_capacity(512);
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.truncate(end + 4);
            return Ok(buf);
        }
        if buf.len() >= MAX_HEAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request head too large",
            ));
        }
        let left = timeout
            .checked_sub(started.elapsed())
            .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "request head too slow"))?;
        stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let mut chunk = [0u8; 2048];
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn respond(stream: &mut TcpStream, code: u16, ctype: &str, body: &[u8]) -> io::Result<()> {
    let text = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    };
    let head = format!(
        "HTTP/1.1 {code} {text}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)
}

/// Shuts the write side and drops what the client still sends (at most
/// 1 MiB, 2 s), so a refusal reaches it instead of a reset.
fn linger(stream: &mut TcpStream) -> io::Result<()> {
    stream.shutdown(std::net::Shutdown::Write)?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut sink = [0u8; 8192];
    let mut total = 0usize;
    while total < 1 << 20 {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n,
        }
    }
    Ok(())
}

const BENCODE: &str = "text/plain";

fn connection(stream: &mut TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let _ = stream.set_nodelay(true);
    let stats = &shared.stats;
    let head = match read_head(stream, shared.cfg.header_timeout) {
        Ok(h) => h,
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            stats.failures.fetch_add(1, Ordering::Relaxed);
            let body = encode_failure("request too large (at most 8 KiB of request head)");
            respond(stream, 431, BENCODE, &body)?;
            return linger(stream);
        }
        Err(e) => return Err(e),
    };
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    let path = match req.parse(&head) {
        Ok(httparse::Status::Complete(_)) if req.method == Some("GET") => {
            req.path.unwrap_or("").to_string()
        }
        Ok(httparse::Status::Complete(_)) => {
            stats.failures.fetch_add(1, Ordering::Relaxed);
            return respond(stream, 405, BENCODE, &encode_failure("only GET"));
        }
        _ => {
            stats.failures.fetch_add(1, Ordering::Relaxed);
            respond(
                stream,
                400,
                BENCODE,
                &encode_failure("malformed HTTP request"),
            )?;
            return linger(stream);
        }
    };
    let (route, query) = path.split_once('?').unwrap_or((path.as_str(), ""));
    match route {
        "/announce" => {
            let ip = match stream.peer_addr()?.ip() {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
                v4 => v4,
            };
            let body = match announce(shared, query, ip) {
                Ok(b) => {
                    stats.announces.fetch_add(1, Ordering::Relaxed);
                    b
                }
                Err(e) => {
                    stats.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%ip, error = %e, "announce refused");
                    encode_failure(&e.to_string())
                }
            };
            respond(stream, 200, BENCODE, &body)
        }
        "/stats" => {
            let body = stats_json(shared);
            respond(stream, 200, "application/json", body.as_bytes())
        }
        _ => {
            stats.failures.fetch_add(1, Ordering::Relaxed);
            respond(
                stream,
                404,
                BENCODE,
                &encode_failure("no such path (use /announce or /stats)"),
            )
        }
    }
}

fn announce(shared: &Shared, query: &str, ip: IpAddr) -> Result<Vec<u8>, AnnounceError> {
    let a = parse_announce(query)?;
    let now = Instant::now();
    let mut st = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(allow) = st.allow.as_mut() {
        allow.check(&a.info_hash)?;
    }
    if now.saturating_duration_since(st.last_sweep) >= shared.cfg.interval {
        st.table.sweep(now);
        st.last_sweep = now;
    }
    let reply = st.table.announce(&a, ip, now)?;
    drop(st);
    tracing::debug!(
        info_hash = %hex::encode(a.info_hash), %ip, port = a.port, left = a.left,
        event = ?a.event, peers = reply.peers.len(), "announce"
    );
    Ok(encode_reply(&reply, shared.cfg.interval, a.compact))
}

fn stats_json(shared: &Shared) -> String {
    let torrents = {
        let mut st = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.table.sweep(Instant::now());
        st.table.stats()
    };
    let s = &shared.stats;
    serde_json::json!({
        "intervalSeconds": shared.cfg.interval.as_secs(),
        "announces": s.announces.load(Ordering::Relaxed),
        "failures": s.failures.load(Ordering::Relaxed),
        "busy": s.busy.load(Ordering::Relaxed),
        "torrents": torrents,
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use anneal_image::torrent::decode;

    const HASH: [u8; 20] = [
        0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf1, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
        0x12, 0x34, 0x56, 0x78, 0x9a,
    ];

    fn enc(b: &[u8]) -> String {
        b.iter().map(|c| format!("%{c:02X}")).collect()
    }

    fn query(peer: u8, port: u16, left: u64, event: &str) -> String {
        format!(
            "info_hash={}&peer_id={}&port={port}&uploaded=0&downloaded=0&left={left}&event={event}&compact=1",
            enc(&HASH),
            enc(&[peer; 20])
        )
    }

    #[test]
    fn parses_binary_info_hash() {
        // as clients send it: unreserved bytes as is, the rest escaped
        let q = "info_hash=%124Vx%9A%BC%DE%F1%23Eg%89%AB%CD%EF%124Vx%9A&peer_id=-AR1360-abcdefghijkl\
                 &port=6881&uploaded=1&downloaded=2&left=3&event=started&compact=1&numwant=7&key=x&ip=10.9.9.9";
        let a = parse_announce(q).unwrap();
        assert_eq!(a.info_hash, HASH);
        assert_eq!(&a.peer_id, b"-AR1360-abcdefghijkl");
        assert_eq!((a.port, a.uploaded, a.downloaded, a.left), (6881, 1, 2, 3));
        assert_eq!(a.event, Event::Started);
        assert!(a.compact);
        assert_eq!(a.numwant, Some(7));
        let a = parse_announce(&query(1, 1, 0, "")).unwrap();
        assert_eq!(a.event, Event::None);
    }

    #[test]
    fn refuses_bad_announces() {
        let ok = query(1, 6881, 0, "started");
        let cases: Vec<(String, AnnounceError)> = vec![
            (
                ok.replace(&enc(&HASH), &enc(&HASH[..19])),
                AnnounceError::Invalid("info_hash", "must be 20 bytes, percent-encoded"),
            ),
            (
                ok.replace(&enc(&HASH), &format!("{}%00", enc(&HASH))),
                AnnounceError::Invalid("info_hash", "must be 20 bytes, percent-encoded"),
            ),
            (
                ok.replace("info_hash=", "x="),
                AnnounceError::Missing("info_hash"),
            ),
            (
                ok.replace("port=6881", "port=0"),
                AnnounceError::Invalid("port", "must be 1..65535"),
            ),
            (
                ok.replace("port=6881", "port=70000"),
                AnnounceError::Invalid("port", "must be 1..65535"),
            ),
            (
                ok.replace("left=0", "left=-1"),
                AnnounceError::Invalid("left", "must be a decimal number"),
            ),
            (
                ok.replace("event=started", "event=paused"),
                AnnounceError::Invalid("event", "must be started, completed or stopped"),
            ),
            (
                format!("{ok}&port=1"),
                AnnounceError::Invalid("port", "given more than once"),
            ),
            (
                format!("{ok}&numwant=%G1"),
                AnnounceError::Invalid("query", "bad percent-encoding (%XX with two hex digits)"),
            ),
            (
                ok.replace(&enc(&HASH), "%1"),
                AnnounceError::Invalid("query", "bad percent-encoding (%XX with two hex digits)"),
            ),
        ];
        for (q, want) in cases {
            assert_eq!(parse_announce(&q), Err(want), "{q}");
        }
        // the failure body is bencoded
        let body = encode_failure(
            &AnnounceError::Invalid("info_hash", "must be 20 bytes, percent-encoded").to_string(),
        );
        let v = decode(&body).unwrap();
        assert_eq!(
            v.get("failure reason").and_then(Value::as_bytes),
            Some(&b"invalid parameter info_hash: must be 20 bytes, percent-encoded"[..])
        );
    }

    fn ann(t: &mut PeerTable, peer: u8, port: u16, left: u64, event: &str, now: Instant) -> Reply {
        t.announce(
            &parse_announce(&query(peer, port, left, event)).unwrap(),
            IpAddr::from([127, 0, 0, peer]),
            now,
        )
        .unwrap()
    }

    #[test]
    fn peer_table_hands_out_others() {
        let t0 = Instant::now();
        let mut t = PeerTable::new(Duration::from_secs(120), 8, 8);
        let r = ann(&mut t, 1, 6001, 0, "started", t0);
        assert!(r.peers.is_empty());
        assert_eq!((r.complete, r.incomplete), (1, 0));
        let r = ann(&mut t, 2, 6002, 100, "started", t0);
        assert_eq!(r.peers, vec!["127.0.0.1:6001".parse().unwrap()]);
        assert_eq!((r.complete, r.incomplete), (1, 1));
        let r = ann(&mut t, 3, 6003, 100, "started", t0);
        assert_eq!(r.peers.len(), 2);
        assert!(!r.peers.contains(&"127.0.0.3:6003".parse().unwrap()));
        // a seeder gets leechers only
        let r = ann(&mut t, 1, 6001, 0, "", t0);
        let mut got = r.peers.clone();
        got.sort();
        assert_eq!(
            got,
            vec![
                "127.0.0.2:6002".parse().unwrap(),
                "127.0.0.3:6003".parse().unwrap()
            ]
        );
        // numwant bounds the answer
        let mut a = parse_announce(&query(2, 6002, 100, "")).unwrap();
        a.numwant = Some(1);
        let r = t.announce(&a, IpAddr::from([127, 0, 0, 2]), t0).unwrap();
        assert_eq!(r.peers.len(), 1);
        // completed makes a seeder, stopped removes
        let r = ann(&mut t, 2, 6002, 0, "completed", t0);
        assert_eq!((r.complete, r.incomplete), (2, 1));
        let r = ann(&mut t, 3, 6003, 100, "stopped", t0);
        assert!(r.peers.is_empty());
        assert_eq!((r.complete, r.incomplete), (2, 0));
        let s = &t.stats()[0];
        assert_eq!(s.info_hash, hex::encode(HASH));
        assert_eq!(
            (s.seeders, s.leechers, s.started, s.completed, s.stopped),
            (2, 0, 3, 1, 1)
        );
        // the compact answer: 6 bytes per peer, port big-endian
        let body = encode_reply(
            &Reply {
                complete: 1,
                incomplete: 0,
                peers: vec!["127.0.0.1:6881".parse().unwrap()],
                peer_ids: vec![[b'a'; 20]],
            },
            Duration::from_secs(30),
            true,
        );
        assert_eq!(
            body,
            b"d8:completei1e10:incompletei0e8:intervali30e12:min intervali30e5:peers6:\x7f\x00\x00\x01\x1a\xe1e"
        );
        let body = encode_reply(
            &Reply {
                complete: 1,
                incomplete: 0,
                peers: vec!["127.0.0.1:6881".parse().unwrap()],
                peer_ids: vec![[b'a'; 20]],
            },
            Duration::from_secs(30),
            false,
        );
        let v = decode(&body).unwrap();
        let Some(Value::List(l)) = v.get("peers") else {
            panic!("{v:?}")
        };
        assert_eq!(l[0].get("port").and_then(Value::as_int), Some(6881));
        assert_eq!(
            l[0].get("ip").and_then(Value::as_bytes),
            Some(&b"127.0.0.1"[..])
        );
    }

    #[test]
    fn peers_expire_and_tables_are_bounded() {
        let t0 = Instant::now();
        let exp = Duration::from_secs(120);
        let mut t = PeerTable::new(exp, 1, 2);
        ann(&mut t, 1, 6001, 0, "started", t0);
        ann(&mut t, 2, 6002, 10, "started", t0 + Duration::from_secs(60));
        // peer 1 silent for two intervals: not handed out, then swept
        let r = ann(&mut t, 2, 6002, 10, "", t0 + exp);
        assert!(r.peers.is_empty(), "{r:?}");
        // table full: a third peer is refused while both are live...
        let a3 = parse_announce(&query(3, 6003, 10, "started")).unwrap();
        let ip3 = IpAddr::from([127, 0, 0, 3]);
        let mut t2 = PeerTable::new(exp, 1, 2);
        ann(&mut t2, 1, 6001, 0, "started", t0);
        ann(&mut t2, 2, 6002, 10, "started", t0);
        assert_eq!(
            t2.announce(&a3, ip3, t0 + Duration::from_secs(1)),
            Err(AnnounceError::TooManyPeers(2))
        );
        // ...and accepted once they expired
        let r = t2.announce(&a3, ip3, t0 + exp).unwrap();
        assert_eq!((r.complete, r.incomplete), (0, 1));
        // one torrent at most
        let mut other = parse_announce(&query(4, 6004, 10, "started")).unwrap();
        other.info_hash = [9; 20];
        assert_eq!(
            t2.announce(&other, IpAddr::from([127, 0, 0, 4]), t0 + exp),
            Err(AnnounceError::TooManyTorrents(1))
        );
        // the first torrent is forgotten once empty and idle for the expiry
        t2.sweep(t0 + exp * 3);
        assert!(t2.stats().is_empty());
        assert!(
            t2.announce(&other, IpAddr::from([127, 0, 0, 4]), t0 + exp * 3)
                .is_ok()
        );
        // the same peer id from another address is another peer: it cannot
        // stop somebody else
        let mut t3 = PeerTable::new(exp, 4, 4);
        ann(&mut t3, 1, 6001, 0, "started", t0);
        let stop = parse_announce(&query(1, 6001, 0, "stopped")).unwrap();
        t3.announce(&stop, IpAddr::from([10, 0, 0, 9]), t0).unwrap();
        assert_eq!(t3.stats()[0].seeders, 1);
    }

    #[test]
    fn allow_list_fails_closed_and_reloads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("allow");
        let mut allow = AllowList::new(path.clone(), false);
        assert_eq!(allow.check(&HASH), Err(AnnounceError::AllowListUnreadable));
        std::fs::write(&path, "# published\nnot-hex\n").unwrap();
        assert_eq!(
            allow.check(&HASH),
            Err(AnnounceError::NotAllowed(hex::encode(HASH)))
        );
        std::fs::write(&path, format!("# published\n{}  # p1\n", hex::encode(HASH))).unwrap();
        assert_eq!(allow.check(&HASH), Ok(()));
    }

    /// A content store as the allow-list: the torrents of its verified
    /// contents (the hash the agent makes from the index), nothing of an
    /// unverified one; a marker removed takes the torrent out at the next
    /// scan; no store refuses everything.
    #[test]
    fn a_store_allows_the_torrents_of_its_verified_contents() {
        use anneal_image::capture::{Options, capture_region};
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let mut allow = AllowList::new(store.clone(), true);
        assert_eq!(allow.check(&HASH), Err(AnnounceError::AllowListUnreadable));
        let raw = dir.path().join("raw");
        std::fs::write(&raw, vec![7u8; 1 << 20]).unwrap();
        let mut hashes = Vec::new();
        for (ns, name) in [("lab", "root"), ("lab", "draft"), (".bootd", "leases")] {
            let c = crate::store::content_dir(&store, ns, name);
            std::fs::create_dir_all(&c).unwrap();
            let (index, _) = capture_region(
                &std::fs::File::open(&raw).unwrap(),
                0,
                1 << 20,
                &c.join("index"),
                &c.join("stream"),
                Options {
                    piece_length: 256 << 10,
                },
            )
            .unwrap();
            hashes
                .push(anneal_image::torrent::Metainfo::from_index(&index, name, None).info_hash());
        }
        let root = crate::store::content_dir(&store, "lab", "root");
        std::fs::write(root.join(crate::store::VERIFIED), "ab\n").unwrap();
        // a dot directory is no namespace (bootd's `.bootd`, root's and
        // unreadable to the tracker): never scanned, whatever it holds
        let hidden = crate::store::content_dir(&store, ".bootd", "leases");
        std::fs::write(hidden.join(crate::store::VERIFIED), "ab\n").unwrap();
        allow.scanned = None;
        assert_eq!(allow.check(&hashes[0]), Ok(()));
        assert_eq!(
            allow.check(&hashes[2]),
            Err(AnnounceError::NotAllowed(hex::encode(hashes[2]))),
            "a dot directory is not a namespace"
        );
        assert_eq!(
            allow.check(&hashes[1]),
            Err(AnnounceError::NotAllowed(hex::encode(hashes[1]))),
            "an unverified content is not tracked"
        );
        // Unchanged contents are not read again: their hash is cached.
        std::fs::write(root.join("index"), b"garbage").unwrap();
        allow.scanned = None;
        assert_eq!(allow.check(&hashes[0]), Ok(()));
        std::fs::remove_file(root.join(crate::store::VERIFIED)).unwrap();
        allow.scanned = None;
        assert_eq!(
            allow.check(&hashes[0]),
            Err(AnnounceError::NotAllowed(hex::encode(hashes[0])))
        );
        assert!(allow.known.is_empty(), "{:?}", allow.known);
    }
}
