//! Read-only TFTP of the configured first-stage files only: a small transfer
//! engine of our own (RFC 1350; options per RFC 2347: `blksize` 2348,
//! `timeout` and `tsize` 2349, `windowsize` 7440).
//!
//! The listener is a task on the caller's tokio runtime; every transfer runs
//! on its own OS thread with a blocking UDP socket connected to the client
//! (the transfer ID), as tftpd-hpa does with a process. A lockstep block is
//! then one `send` and one blocking `recv`, with no executor in between.
//!
//! Why not async-tftp (used until 2026-11-30): it runs its transfers on its
//! own `async-executor` inside our task, driven by the `async-io` reactor
//! thread, so every ACK crossed threads twice and armed an `async-io` timer;
//! lockstep transfers were about 2x slower than tftpd-hpa on a veth
//! (8 MiB: 0.263 s against 0.092 s, docs/bench/bootd.md) and it could not be
//! tuned from outside the crate.
//!
//! Behaviour: only names in the snapshot's `files` are served (a leading `/`
//! is ignored; anything else, `..` included, gets ERROR 1 "File not found");
//! write requests get ERROR 4; `blksize` is capped at [`BLOCK_SIZE_LIMIT`],
//! `windowsize` at [`WINDOW_SIZE_LIMIT`]; a block is retransmitted (from the
//! first unacknowledged one) after the negotiated timeout (default
//! [`DEFAULT_TIMEOUT`]), at most [`MAX_RETRIES`] times in a row once the
//! client has acknowledged anything; until it has, the first packet (the
//! OACK, or DATA 1 without options) is sent at most [`UNACKED_SENDS`] times
//! in all and the transfer then ends silently (the request's source may be
//! forged: a spoofed request costs its victim at most 3x the first reply,
//! and no ERROR); an ERROR
//! from the client ends the transfer; a repeated request from a client whose
//! transfer is running is ignored; at most [`MAX_TRANSFERS`] transfers run at
//! once (beyond that: ERROR 0 "server busy"), at most
//! [`TftpLimits::per_source`] (default [`PER_SOURCE_TRANSFERS`]) from one
//! source address (beyond that: ERROR 0 naming the limit); a transfer that
//! has not ended within [`TftpLimits::deadline`] (default
//! [`TRANSFER_DEADLINE`]; longer for a file that takes longer at
//! [`MIN_TRANSFER_RATE`]) ends with ERROR 0 naming the deadline. Both `octet` and `netascii`
//! modes send the file's bytes unchanged (the files are binaries).
//!
//! Memory: a transfer streams its file from disk. It opens the file once,
//! and for each window (or retransmission) reads that window's blocks with
//! one `pread` at their offset into a buffer of `blksize x windowsize`
//! bytes at most ([`Source`]); no file is held whole, so a transfer costs
//! O(blksize x windowsize) whatever the file's size. A retransmitted block
//! is read again from the same open file. After each read the open file's
//! `stat` (device, inode, length, mtime) is compared with the one it
//! was opened under: a file rewritten in place (or truncated, or grown)
//! during a transfer ends it with ERROR 0 "file changed during the
//! transfer" before any byte read after the change is sent, so a client
//! never assembles a mix of two versions (it retries and gets the new one).
//! A file renamed over a running transfer's does not change the open file:
//! that transfer finishes with the old content, the next gets the new.

use std::collections::{HashMap, HashSet};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anneal_api::error_chain;

use crate::metrics::ReasonLabels;
use crate::script;
use crate::state::Shared;

/// Largest `blksize` granted (fits a 1500-byte Ethernet MTU).
pub const BLOCK_SIZE_LIMIT: u16 = 1468;
/// Largest `windowsize` granted.
pub const WINDOW_SIZE_LIMIT: u16 = 64;
/// Retransmission timeout unless the client negotiates one.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest client-requested `timeout` accepted (RFC 2349 lets the server
/// only accept or decline the value: a larger one is declined, left out of
/// the OACK, and the default applies), so one slow or hostile client holds
/// a transfer slot for at most `MAX_RETRIES` x 5 s.
pub const TIMEOUT_LIMIT: u8 = 5;
/// Consecutive retransmissions before a transfer is abandoned, once its
/// client has acknowledged something.
pub const MAX_RETRIES: u32 = 8;
/// Times the first packet of a transfer (OACK, or DATA 1) is sent in all
/// while no acknowledgement ever came: a request from a forged source
/// makes bootd send its victim at most this many times the first reply
/// (windows are only sent after the OACK is acknowledged).
pub const UNACKED_SENDS: u32 = 3;

/// How long a transfer polls its socket for the next ACK before it sleeps
/// in `recv`. A lockstep client on the same segment answers within tens of
/// microseconds, and a sleeping transfer pays a wake-up on every block (an
/// interrupt and a context switch; on a virtual machine an exit to the
/// host too), which is as long as the round trip itself: polling briefly
/// is what keeps lockstep transfers, what most firmware uses, as fast as
/// the fastest servers. Bounded three ways: [`SPIN`] per wait, at most one
/// polling transfer per two CPUs ([`SPINNING`]), and a transfer whose
/// client misses the window [`SPIN_GIVE_UP`] times in a row (a slow client
/// or a long path) stops polling.
const SPIN: Duration = Duration::from_micros(60);
/// Consecutive waits whose ACK came after [`SPIN`] before a transfer stops
/// polling.
const SPIN_GIVE_UP: u32 = 16;
/// Transfers polling right now.
static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// At most one polling transfer per two CPUs, at least one.
fn max_spinning() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .div_ceil(2)
    })
}
/// Transfers running at once.
pub const MAX_TRANSFERS: usize = 256;
/// Default total time one transfer may take ([`TftpLimits::deadline`]).
pub const TRANSFER_DEADLINE: Duration = Duration::from_secs(120);
/// The slowest rate a transfer's deadline allows for: a file that takes
/// longer than [`TftpLimits::deadline`] at this rate gets that longer time
/// ([`transfer_deadline`]). Firmware fetching a large kernel in lockstep
/// 512 or 1024-byte blocks (network GRUB on an arm64 machine: 33 MB) can
/// need more than the fixed default and is still a live client.
pub const MIN_TRANSFER_RATE: u64 = 64 << 10;

/// The total time a transfer of `size` bytes may take: `limit`, or the
/// time `size` takes at [`MIN_TRANSFER_RATE`] when that is longer.
pub fn transfer_deadline(limit: Duration, size: u64) -> Duration {
    limit.max(Duration::from_secs(size.div_ceil(MIN_TRANSFER_RATE)))
}

/// Default transfers running at once from one source address
/// ([`TftpLimits::per_source`]).
pub const PER_SOURCE_TRANSFERS: usize = 8;

/// Bounds on what one client can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TftpLimits {
    /// Total time one transfer may take, however fast its client ACKs
    /// (a client ACKing just before every timeout would otherwise hold a
    /// slot for blocks x timeout); beyond it the transfer ends with ERROR 0
    /// naming the deadline.
    pub deadline: Duration,
    /// Transfers running at once from one source address; the next request
    /// from it gets ERROR 0 naming the limit.
    pub per_source: usize,
}

impl Default for TftpLimits {
    fn default() -> TftpLimits {
        TftpLimits {
            deadline: TRANSFER_DEADLINE,
            per_source: PER_SOURCE_TRANSFERS,
        }
    }
}

/// The running transfers: by client (address and port) and per address.
#[derive(Debug, Default)]
struct Active {
    peers: HashSet<SocketAddr>,
    per_ip: HashMap<IpAddr, usize>,
}

impl Active {
    fn insert(&mut self, peer: SocketAddr) {
        if self.peers.insert(peer) {
            *self.per_ip.entry(peer.ip()).or_default() += 1;
        }
    }

    fn remove(&mut self, peer: &SocketAddr) {
        if self.peers.remove(peer)
            && let Some(n) = self.per_ip.get_mut(&peer.ip())
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_ip.remove(&peer.ip());
            }
        }
    }

    fn count_from(&self, ip: IpAddr) -> usize {
        self.per_ip.get(&ip).copied().unwrap_or(0)
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }
}

const OP_RRQ: u16 = 1;
const OP_WRQ: u16 = 2;
const OP_DATA: u16 = 3;
const OP_ACK: u16 = 4;
const OP_ERROR: u16 = 5;
const OP_OACK: u16 = 6;
const DEFAULT_BLOCK_SIZE: u16 = 512;

/// Errors of starting or running the TFTP server.
#[derive(Debug, thiserror::Error)]
pub enum TftpError {
    #[error("starting the tftp server")]
    Start(#[source] std::io::Error),
    #[error("receiving on the tftp socket")]
    Recv(#[source] std::io::Error),
}

/// Transfer mode of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Octet,
    Netascii,
}

/// A parsed read request (options as sent, not yet negotiated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    pub filename: String,
    pub mode: Mode,
    pub blksize: Option<u16>,
    pub timeout: Option<u8>,
    /// Present when the client asked for the size.
    pub tsize: bool,
    pub windowsize: Option<u16>,
}

/// What arrived on port 69.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Read(ReadRequest),
    Write {
        filename: String,
    },
    /// A request that cannot be served (unknown mode, missing fields).
    Malformed,
}

fn cstr(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let i = b.iter().position(|&c| c == 0)?;
    Some((&b[..i], &b[i + 1..]))
}

/// Parses a datagram sent to the server port; `None` for anything that is
/// not a request at all (ignored, as RFC 1350 allows).
pub fn parse_request(b: &[u8]) -> Option<Request> {
    if b.len() < 2 {
        return None;
    }
    let op = u16::from_be_bytes([b[0], b[1]]);
    if op != OP_RRQ && op != OP_WRQ {
        return None;
    }
    let Some((name, rest)) = cstr(&b[2..]) else {
        return Some(Request::Malformed);
    };
    let filename = String::from_utf8_lossy(name).into_owned();
    if op == OP_WRQ {
        return Some(Request::Write { filename });
    }
    let Some((mode, mut rest)) = cstr(rest) else {
        return Some(Request::Malformed);
    };
    let mode = match std::str::from_utf8(mode).map(str::to_ascii_lowercase) {
        Ok(m) if m == "octet" => Mode::Octet,
        Ok(m) if m == "netascii" => Mode::Netascii,
        _ => return Some(Request::Malformed),
    };
    let mut req = ReadRequest {
        filename,
        mode,
        blksize: None,
        timeout: None,
        tsize: false,
        windowsize: None,
    };
    // Options (RFC 2347): name/value pairs; unknown or invalid ones ignored.
    while let Some((k, r)) = cstr(rest) {
        let Some((v, r)) = cstr(r) else { break };
        rest = r;
        let k = String::from_utf8_lossy(k).to_ascii_lowercase();
        let v = std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.parse::<u64>().ok());
        match (k.as_str(), v) {
            ("blksize", Some(n)) if (8..=65464).contains(&n) => req.blksize = Some(n as u16),
            ("timeout", Some(n)) if (1..=255).contains(&n) => req.timeout = Some(n as u8),
            ("tsize", Some(_)) => req.tsize = true,
            ("windowsize", Some(n)) if (1..=65535).contains(&n) => {
                req.windowsize = Some(n as u16);
            }
            _ => {}
        }
    }
    Some(req.into())
}

impl From<ReadRequest> for Request {
    fn from(r: ReadRequest) -> Request {
        Request::Read(r)
    }
}

/// An ERROR packet.
pub fn error_packet(code: u16, msg: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(5 + msg.len());
    p.extend_from_slice(&OP_ERROR.to_be_bytes());
    p.extend_from_slice(&code.to_be_bytes());
    p.extend_from_slice(msg.as_bytes());
    p.push(0);
    p
}

/// Negotiated transfer parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Params {
    blksize: usize,
    window: u64,
    timeout: Duration,
    /// The OACK to send first, if the client asked for any option we grant.
    oack: Option<Vec<u8>>,
}

fn negotiate(req: &ReadRequest, size: u64) -> Params {
    let mut oack = Vec::new();
    let mut opt = |k: &str, v: u64| {
        oack.extend_from_slice(k.as_bytes());
        oack.push(0);
        oack.extend_from_slice(v.to_string().as_bytes());
        oack.push(0);
    };
    let blksize = req.blksize.map(|b| b.min(BLOCK_SIZE_LIMIT));
    if let Some(b) = blksize {
        opt("blksize", u64::from(b));
    }
    let timeout = req.timeout.filter(|t| *t <= TIMEOUT_LIMIT);
    if let Some(t) = timeout {
        opt("timeout", u64::from(t));
    }
    if req.tsize {
        opt("tsize", size);
    }
    let window = req.windowsize.map(|w| w.min(WINDOW_SIZE_LIMIT));
    if let Some(w) = window {
        opt("windowsize", u64::from(w));
    }
    let oack = (!oack.is_empty()).then(|| {
        let mut p = OP_OACK.to_be_bytes().to_vec();
        p.extend_from_slice(&oack);
        p
    });
    Params {
        blksize: usize::from(blksize.unwrap_or(DEFAULT_BLOCK_SIZE)),
        window: u64::from(window.unwrap_or(1)),
        timeout: timeout.map_or(DEFAULT_TIMEOUT, |t| Duration::from_secs(u64::from(t))),
        oack,
    }
}

fn count(shared: &Shared, reason: &str) {
    shared
        .metrics
        .tftp_requests
        .get_or_create(&ReasonLabels {
            reason: reason.into(),
        })
        .inc();
}

/// Identity of an open file's content as far as `stat` tells: a write, a
/// truncation or a `touch` changes it (to the file system's timestamp
/// granularity: a write within the same clock tick as the previous one,
/// with the length unchanged, is not seen). Not the ctime: a rename over
/// the file (or any unlink) changes the old inode's, and a transfer of it
/// goes on from the open file, unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileStamp {
    fn of(m: &std::fs::Metadata) -> FileStamp {
        FileStamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        }
    }
}

/// What a transfer sends: a rendered text (a GRUB config, a token cpio: a
/// few KiB) or a file opened once for the whole transfer and read a window
/// at a time.
#[derive(Debug)]
enum Source {
    Mem(Vec<u8>),
    File {
        file: std::fs::File,
        /// The open file's `stat` when the transfer began.
        stamp: FileStamp,
    },
}

impl Source {
    /// Opens a configured file (a regular file only).
    fn open(path: &Path) -> std::io::Result<Source> {
        let file = std::fs::File::open(path)?;
        let m = file.metadata()?;
        if !m.is_file() {
            return Err(std::io::Error::other(format!(
                "{} is not a regular file",
                path.display()
            )));
        }
        Ok(Source::File {
            file,
            stamp: FileStamp::of(&m),
        })
    }

    /// Length in bytes (a file's when the transfer began).
    fn len(&self) -> u64 {
        match self {
            Source::Mem(v) => v.len() as u64,
            Source::File { stamp, .. } => stamp.len,
        }
    }

    /// Fills `buf` with the bytes at `offset` (within [`Source::len`]).
    /// A file is read with one `pread`, then its `stat` compared with the
    /// one it was opened under: [`Abort::Changed`] when it differs (or the
    /// file ended early), so bytes read after a change are never sent.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), Abort> {
        use std::os::unix::fs::FileExt as _;
        match self {
            Source::Mem(v) => {
                let start = usize::try_from(offset).unwrap_or(usize::MAX).min(v.len());
                let stop = start.saturating_add(buf.len()).min(v.len());
                if stop - start != buf.len() {
                    return Err(Abort::Changed);
                }
                buf.copy_from_slice(&v[start..stop]);
                Ok(())
            }
            Source::File { file, stamp } => {
                match file.read_exact_at(buf, offset) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Err(Abort::Changed),
                    Err(e) => return Err(Abort::Read(e)),
                }
                let now = file.metadata().map_err(Abort::Read)?;
                if FileStamp::of(&now) != *stamp {
                    return Err(Abort::Changed);
                }
                Ok(())
            }
        }
    }
}

/// The TFTP server: the request socket and what transfers share.
#[derive(Debug)]
pub struct TftpServer {
    socket: tokio::net::UdpSocket,
    shared: Arc<Shared>,
    local_ip: IpAddr,
    active: Arc<Mutex<Active>>,
    stop: Arc<AtomicBool>,
    limits: TftpLimits,
}

/// Builds a server on an already bound socket.
pub async fn server(
    shared: Arc<Shared>,
    socket: std::net::UdpSocket,
) -> Result<TftpServer, TftpError> {
    let local_ip = socket.local_addr().map_err(TftpError::Start)?.ip();
    socket.set_nonblocking(true).map_err(TftpError::Start)?;
    let socket = tokio::net::UdpSocket::from_std(socket).map_err(TftpError::Start)?;
    Ok(TftpServer {
        socket,
        shared,
        local_ip,
        active: Arc::default(),
        stop: Arc::default(),
        limits: TftpLimits::default(),
    })
}

/// Tells running transfers to stop when `serve` returns or is dropped.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Removes a finished transfer's client from the active set.
struct ActiveGuard(Arc<Mutex<Active>>, SocketAddr);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        if let Ok(mut a) = self.0.lock() {
            a.remove(&self.1);
        }
    }
}

impl TftpServer {
    /// Replaces the default [`TftpLimits`].
    pub fn with_limits(mut self, limits: TftpLimits) -> TftpServer {
        self.limits = limits;
        self
    }

    /// The bound request address.
    pub fn listen_addr(&self) -> std::io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// Serves requests until an error on the request socket; dropping the
    /// future (or returning) stops running transfers at their next wake-up.
    pub async fn serve(self) -> Result<(), TftpError> {
        let _stop = StopOnDrop(self.stop.clone());
        let mut buf = vec![0u8; 2048];
        loop {
            let (n, peer) = match self.socket.recv_from(&mut buf).await {
                Ok(x) => x,
                // ICMP errors from earlier replies surface here on Linux.
                Err(e) if e.kind() == ErrorKind::ConnectionRefused => continue,
                Err(e) => return Err(TftpError::Recv(e)),
            };
            let Some(req) = parse_request(&buf[..n]) else {
                continue;
            };
            self.handle(peer, req).await;
        }
    }

    async fn handle(&self, peer: SocketAddr, req: Request) {
        let reply = |code: u16, msg: &str| {
            let p = error_packet(code, msg);
            async move {
                let _ = self.socket.send_to(&p, peer).await;
            }
        };
        let req = match req {
            Request::Read(r) => r,
            Request::Write { filename } => {
                count(&self.shared, "write_refused");
                tracing::info!(client = %peer, file = %filename, why = "read-only server", "tftp write refused");
                return reply(4, "Illegal operation").await;
            }
            Request::Malformed => {
                count(&self.shared, "refused");
                tracing::info!(client = %peer, why = "malformed request", "tftp read refused");
                return reply(4, "Illegal operation").await;
            }
        };
        let (busy, from_ip) = {
            let Ok(mut active) = self.active.lock() else {
                return;
            };
            if active.peers.contains(&peer) {
                return; // a retransmitted request: the transfer is running
            }
            let busy = active.peers.len() >= MAX_TRANSFERS;
            let from_ip = active.count_from(peer.ip());
            if !busy && from_ip < self.limits.per_source {
                active.insert(peer);
            }
            (busy, from_ip)
        };
        if busy {
            tracing::warn!(client = %peer, "tftp busy: {MAX_TRANSFERS} transfers running");
            return reply(0, "server busy").await;
        }
        if from_ip >= self.limits.per_source {
            count(&self.shared, "per_source_limit");
            let limit = self.limits.per_source;
            tracing::warn!(client = %peer, limit, "tftp read refused: too many transfers from this address");
            let msg = format!(
                "too many transfers from {}: the limit is {limit} at once per address",
                peer.ip()
            );
            return reply(0, &msg).await;
        }
        let guard = ActiveGuard(self.active.clone(), peer);
        // The socket is made here, in the namespace the listener runs in
        // (sockets belong to the namespace of the thread creating them).
        let sock = UdpSocket::bind(SocketAddr::new(self.local_ip, 0)).and_then(|s| {
            s.connect(peer)?;
            Ok(s)
        });
        let sock = match sock {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(client = %peer, error = %error_chain(&e), "tftp transfer socket");
                return reply(0, "server error").await;
            }
        };
        let shared = self.shared.clone();
        let stop = self.stop.clone();
        let deadline = self.limits.deadline;
        let spawned = std::thread::Builder::new()
            .name("bootd-tftp".into())
            .spawn(move || {
                let end = Instant::now() + deadline;
                let t = (&*shared, &sock, &*stop);
                transfer(t, peer, &req, (deadline, end), guard);
            });
        if let Err(e) = spawned {
            tracing::warn!(client = %peer, error = %error_chain(&e), "tftp transfer thread");
            reply(0, "server error").await;
        }
    }
}

/// Why a transfer ended early.
#[derive(Debug, thiserror::Error)]
enum Abort {
    #[error("client sent error {0}: {1}")]
    ClientError(u16, String),
    #[error("no acknowledgement after {MAX_RETRIES} retransmissions")]
    Timeout,
    #[error("never acknowledged: the first packet was sent {UNACKED_SENDS} times")]
    Unacknowledged,
    #[error("transfer deadline of {} s exceeded", .0.as_secs())]
    Deadline(Duration),
    #[error("the file changed during the transfer")]
    Changed,
    #[error("reading the file")]
    Read(#[source] std::io::Error),
    #[error("server stopping")]
    Stopped,
    #[error("socket")]
    Io(#[source] std::io::Error),
}

/// What a request names, resolved: a source to send, or a refusal
/// already answered.
fn resolve(
    (shared, sock): (&Shared, &UdpSocket),
    peer: SocketAddr,
    name: &str,
    guard: ActiveGuard,
) -> Option<(Source, ActiveGuard)> {
    let snap = shared.snapshot();
    // network GRUB (machines booting through the signed shim) fetches its
    // configs, the kernel and the initramfs over TFTP: rendered or mapped,
    // not configured files
    let read = if name == script::GRUB_CFG_PATH {
        script::grub_cfg()
            .map(|s| Source::Mem(s.into_bytes()))
            .map_err(|e| e.to_string())
    } else if let Some((mac, token)) = script::grub_config_mac(name)
        .map(|m| (m, false))
        .or_else(|| script::token_path_mac(name).map(|m| (m, true)))
    {
        // a machine's GRUB config and its token cpio: behind the gate of
        // its iPXE script (the leased address, an unused token)
        let what = if token { "boot token" } else { "GRUB config" };
        let enrolled = snap
            .machines
            .get(&mac)
            .filter(|_| snap.table.machines.contains_key(&mac));
        if let Some(m) = enrolled
            && let Err(r) = crate::http::gate(shared, &snap, mac, m, peer.ip(), crate::unix_now())
        {
            count(shared, "refused");
            tracing::info!(client = %peer, %mac, machine = %m.name, why = %r.why, "tftp {what} refused");
            drop(guard);
            let _ = sock.send(&error_packet(2, &r.why));
            return None;
        }
        let r = match (token, enrolled.and_then(|m| m.token.unused())) {
            (false, _) => script::grub_config(&snap, mac)
                .map(String::into_bytes)
                .map_err(|e| e.to_string()),
            (true, Some(t)) => script::token_cpio(t).map_err(|e| e.to_string()),
            (true, None) => Err(format!("{mac} has no unused boot token")),
        };
        if r.is_ok() {
            tracing::info!(client = %peer, %mac, "served {what}");
        }
        r.map(Source::Mem)
    } else if let Some((arch, kernel)) = crate::config::parse_boot_path(name) {
        match snap.artifacts.as_ref().and_then(|a| a.for_arch(arch)) {
            Some((k, _)) if kernel => Source::open(k),
            Some((_, i)) => Source::open(i),
            None => Err(std::io::Error::other(format!(
                "no {} kernel and initrd are configured",
                crate::config::arch_name(arch)
            ))),
        }
        .map_err(|e| error_chain(&e).to_string())
    } else if let Some(path) = snap.files.get(name) {
        Source::open(path).map_err(|e| error_chain(&e).to_string())
    } else {
        let why = if name.contains("..") {
            "path traversal refused"
        } else {
            "not a configured first-stage file"
        };
        count(shared, "refused");
        tracing::info!(client = %peer, file = %name, why, "tftp read refused");
        drop(guard);
        let _ = sock.send(&error_packet(1, "File not found"));
        return None;
    };
    match read {
        Ok(src) => Some((src, guard)),
        Err(e) => {
            count(shared, "error");
            tracing::warn!(client = %peer, file = %name, error = %e, "tftp file unreadable");
            drop(guard);
            let _ = sock.send(&error_packet(1, "File not found"));
            None
        }
    }
}

/// Opens the file and runs one read transfer on `sock` (connected to `peer`).
fn transfer(
    (shared, sock, stop): (&Shared, &UdpSocket, &AtomicBool),
    peer: SocketAddr,
    req: &ReadRequest,
    // the deadline's length (for the message) and the instant it ends
    (deadline, end): (Duration, Instant),
    // Held while the transfer runs; released before a refusal is sent, so
    // that the client's next request from the same port (right after the
    // ERROR) is a new request, not a retransmission of a running one.
    guard: ActiveGuard,
) {
    let name = req.filename.trim_start_matches('/');
    let Some((src, _guard)) = resolve((shared, sock), peer, name, guard) else {
        return;
    };
    let len = src.len();
    count(shared, "served");
    tracing::info!(client = %peer, file = %name, bytes = len, "tftp read");
    // a large file gets the time it takes at the slowest rate allowed
    let grown = transfer_deadline(deadline, len);
    let (deadline, end) = (grown, end + grown.saturating_sub(deadline));
    let params = negotiate(req, len);
    let window_bytes = params
        .blksize
        .saturating_mul(usize::try_from(params.window).unwrap_or(1));
    let mut t = Transfer {
        sock,
        src: &src,
        len,
        params: &params,
        stop,
        shared,
        deadline,
        end,
        sent_bytes: 0,
        rtimeout: None,
        spin_misses: 0,
        pkt: Vec::with_capacity(4 + params.blksize),
        buf: vec![0; window_bytes.min(usize::try_from(len).unwrap_or(usize::MAX))],
    };
    match t.run() {
        Ok(()) => tracing::debug!(client = %peer, file = %name, "tftp read done"),
        Err(Abort::ClientError(code, msg)) => {
            tracing::info!(client = %peer, file = %name, code, msg, "tftp read ended by the client");
        }
        Err(Abort::Unacknowledged) => {
            // the source may be forged: nothing more goes to it
            count(shared, "unacknowledged");
            tracing::info!(client = %peer, file = %name, error = %error_chain(&Abort::Unacknowledged), "tftp read abandoned");
        }
        Err(e) => {
            tracing::info!(client = %peer, file = %name, error = %error_chain(&e), "tftp read abandoned");
            let msg = match e {
                Abort::Timeout => "transfer timed out".to_owned(),
                Abort::Deadline(d) => {
                    count(shared, "deadline");
                    format!(
                        "transfer deadline of {} s exceeded: the whole file must be sent within it",
                        d.as_secs()
                    )
                }
                Abort::Changed => {
                    count(shared, "changed");
                    "file changed during the transfer: request it again".to_owned()
                }
                Abort::Read(_) => {
                    count(shared, "error");
                    "server error".to_owned()
                }
                _ => "server stopping".to_owned(),
            };
            if !matches!(e, Abort::Io(_)) {
                let _ = sock.send(&error_packet(0, &msg));
            }
        }
    }
}

/// What the client sent in answer to a window.
enum Reply {
    Ack(u16),
    TimedOut,
}

struct Transfer<'a> {
    sock: &'a UdpSocket,
    src: &'a Source,
    /// The source's length when the transfer began.
    len: u64,
    params: &'a Params,
    stop: &'a AtomicBool,
    shared: &'a Shared,
    /// The total time allowed ([`TftpLimits::deadline`]) and when it ends.
    deadline: Duration,
    end: Instant,
    /// Bytes counted into the metric (each byte once, retransmits not).
    sent_bytes: u64,
    /// The socket's read timeout as last set.
    rtimeout: Option<Duration>,
    /// Consecutive waits the ACK came after [`SPIN`].
    spin_misses: u32,
    pkt: Vec<u8>,
    /// One window's bytes, read from the source before it is sent.
    buf: Vec<u8>,
}

impl Transfer<'_> {
    /// Consecutive timeouts allowed: [`MAX_RETRIES`] once the client
    /// acknowledged anything, else what keeps the first packet's sends at
    /// [`UNACKED_SENDS`].
    fn give_up(retries: u32, confirmed: bool) -> Result<(), Abort> {
        match confirmed {
            true if retries > MAX_RETRIES => Err(Abort::Timeout),
            false if retries >= UNACKED_SENDS => Err(Abort::Unacknowledged),
            _ => Ok(()),
        }
    }

    fn run(&mut self) -> Result<(), Abort> {
        let bs = self.params.blksize as u64;
        // Blocks 1..=total; the last one is shorter than blksize (maybe empty).
        let total = self.len / bs + 1;
        // Whether the client acknowledged anything yet.
        let mut confirmed = false;
        if let Some(oack) = &self.params.oack {
            let mut retries = 0;
            loop {
                self.sock.send(oack).map_err(Abort::Io)?;
                match self.wait()? {
                    Reply::Ack(0) => break,
                    Reply::Ack(_) => {}
                    Reply::TimedOut => {
                        retries += 1;
                        Self::give_up(retries, false)?;
                    }
                }
            }
            confirmed = true;
        }
        // Highest block acknowledged (absolute number; the wire number is
        // its low 16 bits, so block numbers roll over 65535 -> 0).
        let mut acked: u64 = 0;
        let mut retries = 0;
        while acked < total {
            let end = total.min(acked + self.params.window);
            self.send_window(acked + 1, end)?;
            loop {
                match self.wait()? {
                    Reply::TimedOut => {
                        retries += 1;
                        Self::give_up(retries, confirmed)?;
                        break;
                    }
                    Reply::Ack(n) => {
                        // The acknowledged block within (acked, end], if any.
                        let ahead = u64::from(n.wrapping_sub(acked as u16));
                        if ahead >= 1 && acked + ahead <= end {
                            acked += ahead;
                            retries = 0;
                            confirmed = true;
                            break;
                        }
                        // a duplicate or stale ACK: keep waiting (no
                        // retransmission, or lockstep would double up)
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads blocks `first..=last` from the source (one read, checked
    /// against the file's stamp), then sends them.
    fn send_window(&mut self, first: u64, last: u64) -> Result<(), Abort> {
        let bs = self.params.blksize as u64;
        let start = ((first - 1) * bs).min(self.len);
        let stop = (last * bs).min(self.len);
        let n = usize::try_from(stop - start).map_err(|_| Abort::Changed)?;
        let Some(window) = self.buf.get_mut(..n) else {
            return Err(Abort::Changed);
        };
        self.src.read_at(start, window)?;
        for b in first..=last {
            let from = ((b - 1) * bs).min(self.len);
            let to = (b * bs).min(self.len);
            // within the window just read: offsets relative to `start`
            let (i, j) = ((from - start) as usize, (to - start) as usize);
            self.pkt.clear();
            self.pkt.extend_from_slice(&OP_DATA.to_be_bytes());
            self.pkt.extend_from_slice(&(b as u16).to_be_bytes());
            self.pkt.extend_from_slice(&self.buf[i..j]);
            // Counted before the send: once a client holds a block, the
            // counter already includes it (a reader after the client
            // finished sees every byte; retransmissions are not counted
            // again).
            if to > self.sent_bytes {
                self.shared.metrics.tftp_bytes.inc_by(to - self.sent_bytes);
                self.sent_bytes = to;
            }
            self.sock.send(&self.pkt).map_err(Abort::Io)?;
        }
        Ok(())
    }

    fn set_rtimeout(&mut self, d: Duration) -> Result<(), Abort> {
        let d = d.max(Duration::from_millis(1));
        if self.rtimeout != Some(d) {
            self.sock.set_read_timeout(Some(d)).map_err(Abort::Io)?;
            self.rtimeout = Some(d);
        }
        Ok(())
    }

    /// Waits up to the timeout for an ACK (ERROR ends the transfer; other
    /// packets are ignored). Polls first (see [`SPIN`]), then sleeps in
    /// `recv`, waking at least every second to notice a stop.
    fn wait(&mut self) -> Result<Reply, Abort> {
        let slice = Duration::from_secs(1);
        if Instant::now() >= self.end {
            return Err(Abort::Deadline(self.deadline));
        }
        let deadline = (Instant::now() + self.params.timeout).min(self.end);
        let mut buf = [0u8; 516];
        if self.spin_misses < SPIN_GIVE_UP {
            match self.spin(&mut buf)? {
                Some(n) => {
                    self.spin_misses = 0;
                    if let Some(r) = reply(&buf[..n])? {
                        return Ok(r);
                    }
                }
                None => self.spin_misses += 1,
            }
        }
        self.set_rtimeout(self.params.timeout.min(slice))?;
        loop {
            match self.sock.recv(&mut buf) {
                Ok(n) => {
                    if let Some(r) = reply(&buf[..n])? {
                        return Ok(r);
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Abort::Io(e)),
            }
            if self.stop.load(Ordering::Relaxed) {
                return Err(Abort::Stopped);
            }
            let now = Instant::now();
            if now >= self.end {
                return Err(Abort::Deadline(self.deadline));
            }
            if now >= deadline {
                return Ok(Reply::TimedOut);
            }
            self.set_rtimeout((deadline - now).min(slice))?;
        }
    }

    /// Polls the socket for up to [`SPIN`] without sleeping; the length of
    /// the datagram that came, or `None` (nothing came, or the polling
    /// transfers are already at [`max_spinning`]).
    fn spin(&self, buf: &mut [u8]) -> Result<Option<usize>, Abort> {
        use nix::errno::Errno;
        use nix::sys::socket::{MsgFlags, recv};
        if SPINNING.fetch_add(1, Ordering::AcqRel) >= max_spinning() {
            SPINNING.fetch_sub(1, Ordering::AcqRel);
            return Ok(None);
        }
        let start = Instant::now();
        let got = loop {
            match recv(self.sock.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => break Ok(Some(n)),
                Err(Errno::EAGAIN | Errno::EINTR) => {}
                Err(e) => break Err(Abort::Io(e.into())),
            }
            if start.elapsed() >= SPIN {
                break Ok(None);
            }
            std::thread::yield_now();
        };
        SPINNING.fetch_sub(1, Ordering::AcqRel);
        got
    }
}

/// What a datagram from the client means: an ACK, an ERROR (ends the
/// transfer), or nothing (anything else is ignored).
fn reply(p: &[u8]) -> Result<Option<Reply>, Abort> {
    if p.len() < 4 {
        return Ok(None);
    }
    let op = u16::from_be_bytes([p[0], p[1]]);
    let arg = u16::from_be_bytes([p[2], p[3]]);
    if op == OP_ACK {
        return Ok(Some(Reply::Ack(arg)));
    }
    if op == OP_ERROR {
        let msg = cstr(&p[4..]).map_or(&p[4..], |(m, _)| m);
        return Err(Abort::ClientError(
            arg,
            String::from_utf8_lossy(msg).into_owned(),
        ));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn rrq(name: &str, opts: &[(&str, &str)]) -> Vec<u8> {
        let mut p = OP_RRQ.to_be_bytes().to_vec();
        for s in [name, "octet"]
            .into_iter()
            .chain(opts.iter().flat_map(|(k, v)| [*k, *v]))
        {
            p.extend_from_slice(s.as_bytes());
            p.push(0);
        }
        p
    }

    #[test]
    fn parses_requests_and_options() {
        let r = parse_request(&rrq(
            "/f",
            &[
                ("BLKSIZE", "1468"),
                ("tsize", "0"),
                ("windowsize", "8"),
                ("timeout", "2"),
                ("x", "y"),
            ],
        ));
        assert_eq!(
            r,
            Some(Request::Read(ReadRequest {
                filename: "/f".into(),
                mode: Mode::Octet,
                blksize: Some(1468),
                timeout: Some(2),
                tsize: true,
                windowsize: Some(8),
            }))
        );
        // invalid values are ignored, not fatal
        let Some(Request::Read(r)) = parse_request(&rrq(
            "f",
            &[("blksize", "7"), ("timeout", "0"), ("windowsize", "x")],
        )) else {
            panic!("not a read request")
        };
        assert_eq!((r.blksize, r.timeout, r.windowsize), (None, None, None));
        let mut mail = OP_RRQ.to_be_bytes().to_vec();
        mail.extend_from_slice(b"f\0mail\0");
        assert_eq!(parse_request(&mail), Some(Request::Malformed));
        assert_eq!(parse_request(&[0, 1, b'f']), Some(Request::Malformed));
        assert_eq!(parse_request(&[0, 4, 0, 1]), None);
        assert_eq!(parse_request(&[0]), None);
        assert_eq!(
            parse_request(b"\0\x02up\0octet\0"),
            Some(Request::Write {
                filename: "up".into()
            })
        );
    }

    #[test]
    fn negotiation_caps_and_oack() {
        let Some(Request::Read(r)) = parse_request(&rrq(
            "f",
            &[("blksize", "9000"), ("tsize", "0"), ("windowsize", "500")],
        )) else {
            panic!()
        };
        let p = negotiate(&r, 1234);
        assert_eq!(
            (p.blksize, p.window, p.timeout),
            (1468, 64, DEFAULT_TIMEOUT)
        );
        assert_eq!(
            p.oack.unwrap(),
            b"\0\x06blksize\x001468\0tsize\x001234\0windowsize\x0064\0".to_vec()
        );
        let Some(Request::Read(r)) = parse_request(&rrq("f", &[])) else {
            panic!()
        };
        let p = negotiate(&r, 1);
        assert_eq!((p.blksize, p.window, p.oack), (512, 1, None));
    }

    #[test]
    fn a_timeout_above_the_limit_is_declined() {
        for (asked, want, oack) in [
            (
                "5",
                Duration::from_secs(5),
                Some(b"\0\x06timeout\x005\0".to_vec()),
            ),
            ("6", DEFAULT_TIMEOUT, None),
            ("255", DEFAULT_TIMEOUT, None),
        ] {
            let Some(Request::Read(r)) = parse_request(&rrq("f", &[("timeout", asked)])) else {
                panic!()
            };
            let p = negotiate(&r, 1);
            assert_eq!((p.timeout, p.oack), (want, oack), "timeout {asked}");
        }
    }

    struct Srv {
        addr: SocketAddr,
        shared: Arc<Shared>,
        active: Arc<Mutex<Active>>,
        rt: tokio::runtime::Runtime,
        task: tokio::task::JoinHandle<()>,
        _dir: tempfile::TempDir,
    }

    impl Drop for Srv {
        fn drop(&mut self) {
            self.task.abort();
            let _ = self.rt.block_on(&mut self.task);
        }
    }

    /// A server on 127.0.0.1 serving `files` (name, content).
    fn start(files: &[(&str, Vec<u8>)]) -> Srv {
        start_with(files, TftpLimits::default())
    }

    fn start_with(files: &[(&str, Vec<u8>)], limits: TftpLimits) -> Srv {
        let dir = tempfile::tempdir().unwrap();
        let mut yaml =
            String::from("serverIP: 127.0.0.1\ncidr: 127.0.0.0/8\ndhcp: {mode: proxy}\nfiles: {");
        for (i, (n, c)) in files.iter().enumerate() {
            let p = dir.path().join(n);
            std::fs::write(&p, c).unwrap();
            if i > 0 {
                yaml.push_str(", ");
            }
            yaml.push_str(&format!("{n}: {}", p.display()));
        }
        yaml.push_str("}\n");
        let snap = crate::StaticConfig::from_yaml(&yaml)
            .unwrap()
            .snapshot(8080, "t".into())
            .unwrap();
        let shared = Arc::new(Shared::new(snap, Default::default(), String::new()));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = sock.local_addr().unwrap();
        let srv = rt
            .block_on(server(shared.clone(), sock))
            .unwrap()
            .with_limits(limits);
        let active = srv.active.clone();
        let task = rt.spawn(async move {
            let _ = srv.serve().await;
        });
        Srv {
            addr,
            shared,
            active,
            rt,
            task,
            _dir: dir,
        }
    }

    fn client() -> UdpSocket {
        let c = UdpSocket::bind("127.0.0.1:0").unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c
    }

    fn recv(c: &UdpSocket) -> (Vec<u8>, SocketAddr) {
        let mut b = vec![0u8; 70000];
        let (n, from) = c.recv_from(&mut b).unwrap();
        b.truncate(n);
        (b, from)
    }

    fn ack(n: u16) -> [u8; 4] {
        let a = n.to_be_bytes();
        [0, 4, a[0], a[1]]
    }

    /// A windowed client: returns the file. `drop_once` names a block
    /// (absolute) whose first arrival is discarded.
    fn fetch(srv: &Srv, name: &str, opts: &[(&str, &str)], drop_once: Option<u64>) -> Vec<u8> {
        let c = client();
        c.send_to(&rrq(name, opts), srv.addr).unwrap();
        let get = |k: &str| {
            opts.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.parse::<usize>().unwrap())
        };
        let bs = get("blksize").unwrap_or(512).min(1468);
        let win = get("windowsize").unwrap_or(1).min(64);
        let mut out = Vec::new();
        let mut next: u64 = 1;
        let mut dropped = false;
        let mut in_window = 0;
        loop {
            let (p, from) = recv(&c);
            match u16::from_be_bytes([p[0], p[1]]) {
                OP_OACK => {
                    c.send_to(&ack(0), from).unwrap();
                }
                OP_DATA => {
                    let n = u16::from_be_bytes([p[2], p[3]]);
                    if drop_once == Some(next) && !dropped && n == next as u16 {
                        dropped = true;
                        continue;
                    }
                    if n != next as u16 {
                        // out of order: ACK what we have (RFC 7440)
                        c.send_to(&ack((next - 1) as u16), from).unwrap();
                        in_window = 0;
                        continue;
                    }
                    out.extend_from_slice(&p[4..]);
                    next += 1;
                    in_window += 1;
                    let last = p.len() - 4 < bs;
                    if last || in_window == win {
                        c.send_to(&ack(n), from).unwrap();
                        in_window = 0;
                    }
                    if last {
                        return out;
                    }
                }
                op => panic!("opcode {op}: {p:?}"),
            }
        }
    }

    fn content(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    fn metric(srv: &Srv, reason: &str) -> u64 {
        srv.shared
            .metrics
            .tftp_requests
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .get()
    }

    #[test]
    fn serves_lockstep_windowed_and_exact_multiples() {
        let a = content(1000);
        let b = content(1468 * 20); // ends with an empty block
        let srv = start(&[("a", a.clone()), ("b", b.clone())]);
        assert_eq!(fetch(&srv, "a", &[], None), a);
        assert_eq!(fetch(&srv, "/a", &[("blksize", "1468")], None), a);
        assert_eq!(
            fetch(
                &srv,
                "b",
                &[("blksize", "1468"), ("tsize", "0"), ("windowsize", "8")],
                None
            ),
            b
        );
        assert_eq!(fetch(&srv, "b", &[("windowsize", "3")], None), b);
        assert_eq!(metric(&srv, "served"), 4);
        assert_eq!(
            srv.shared.metrics.tftp_bytes.get(),
            (2 * a.len() + 2 * b.len()) as u64
        );
    }

    #[test]
    fn resends_from_the_first_missing_block() {
        let b = content(1468 * 30 + 5);
        let srv = start(&[("b", b.clone())]);
        // a block lost mid-window: the client ACKs the one before it
        let opts = [("blksize", "1468"), ("windowsize", "8")];
        assert_eq!(fetch(&srv, "b", &opts, Some(12)), b);
        // lost in lockstep: the server times out (1 s) and sends it again
        let t = Instant::now();
        assert_eq!(
            fetch(&srv, "b", &[("blksize", "1468"), ("timeout", "1")], Some(3)),
            b
        );
        assert!(
            t.elapsed() >= Duration::from_millis(900),
            "{:?}",
            t.elapsed()
        );
        // retransmits are not counted again
        assert_eq!(srv.shared.metrics.tftp_bytes.get(), 2 * b.len() as u64);
    }

    #[test]
    fn a_changed_file_is_served_fresh() {
        let srv = start(&[("a", content(3000))]);
        assert_eq!(fetch(&srv, "a", &[], None), content(3000));
        let path = srv.shared.snapshot().files["a"].clone();
        // same length, new bytes (rename over it: new inode)
        let new: Vec<u8> = content(3000).iter().map(|b| b ^ 0xff).collect();
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, &new).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        assert_eq!(fetch(&srv, "a", &[], None), new);
        // rewritten in place, longer
        std::fs::write(&path, content(4000)).unwrap();
        assert_eq!(fetch(&srv, "a", &[], None), content(4000));
    }

    #[test]
    fn block_numbers_roll_over() {
        let b = content(8 * 70_000);
        let srv = start(&[("b", b.clone())]);
        assert_eq!(
            fetch(&srv, "b", &[("blksize", "8"), ("windowsize", "64")], None),
            b
        );
    }

    #[test]
    fn refuses_unknown_traversal_writes_and_malformed() {
        let srv = start(&[("a", content(10))]);
        let c = client();
        for name in ["../../etc/passwd", "nothere", "a/../a"] {
            c.send_to(&rrq(name, &[]), srv.addr).unwrap();
            let (p, _) = recv(&c);
            assert_eq!(&p[..4], &[0, 5, 0, 1], "{name}: {p:?}");
        }
        c.send_to(b"\0\x02a\0octet\0", srv.addr).unwrap();
        assert_eq!(&recv(&c).0[..4], &[0, 5, 0, 4]);
        c.send_to(b"\0\x01a\0mail\0", srv.addr).unwrap();
        assert_eq!(&recv(&c).0[..4], &[0, 5, 0, 4]);
        assert_eq!(metric(&srv, "refused"), 4);
        assert_eq!(metric(&srv, "write_refused"), 1);
        assert_eq!(metric(&srv, "served"), 0);
        // and still serves
        assert_eq!(fetch(&srv, "a", &[], None), content(10));
    }

    #[test]
    fn client_error_after_oack_ends_the_transfer() {
        // what UEFI firmware does to learn the size: RRQ with tsize, then ERROR
        let srv = start(&[("a", content(5000))]);
        let c = client();
        c.send_to(&rrq("a", &[("tsize", "0")]), srv.addr).unwrap();
        let (p, from) = recv(&c);
        assert_eq!(p, b"\0\x06tsize\x005000\0".to_vec());
        c.send_to(&error_packet(8, "size only"), from).unwrap();
        let t = Instant::now();
        // The ERROR ends the transfer at once (well before a 1 s retransmit
        // would); the bound only stops a hung test.
        while !srv.active.lock().unwrap().is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "transfer still running"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        // nothing more is sent
        c.set_read_timeout(Some(Duration::from_millis(1300)))
            .unwrap();
        let mut b = [0u8; 600];
        assert!(c.recv_from(&mut b).is_err());
    }

    #[test]
    fn repeated_request_is_ignored_and_an_unacknowledged_transfer_ends_silently() {
        let srv = start(&[("a", content(5000))]);
        let c = client();
        let req = rrq("a", &[("timeout", "1")]);
        c.send_to(&req, srv.addr).unwrap();
        c.send_to(&req, srv.addr).unwrap();
        let (p, from) = recv(&c);
        assert_eq!(p, b"\0\x06timeout\x001\0".to_vec());
        // the second request started nothing: only OACK retransmissions
        // (one a second) arrive from the same transfer port (a second
        // transfer's OACK would come first, from another port). The read
        // timeout only stops a hung test: a loaded machine may be late.
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let (p2, from2) = recv(&c);
        assert_eq!((p2, from2), (p.clone(), from));
        assert_eq!(metric(&srv, "served"), 1);
        // never answered: the OACK goes UNACKED_SENDS times in all, then
        // the transfer ends with nothing more sent (no ERROR: the source
        // may be forged)
        let (p3, from3) = recv(&c);
        assert_eq!((p3, from3), (p, from));
        let t = Instant::now();
        while metric(&srv, "unacknowledged") == 0 || !srv.active.lock().unwrap().is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "transfer still running"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        c.set_nonblocking(true).unwrap();
        let mut b = [0u8; 600];
        assert!(c.recv_from(&mut b).is_err(), "sent after the third OACK");
    }

    /// A client that ACKs every block, but only just before the server's
    /// timeout, never trips a retransmission limit: the total deadline
    /// ends its transfer with an ERROR naming it.
    #[test]
    fn a_slow_client_is_cut_at_the_deadline() {
        let limits = TftpLimits {
            deadline: Duration::from_secs(2),
            ..TftpLimits::default()
        };
        let srv = start_with(&[("a", content(512 * 40))], limits);
        let c = client();
        c.send_to(&rrq("a", &[]), srv.addr).unwrap();
        let t = Instant::now();
        let mut blocks = 0;
        let msg = loop {
            let (p, from) = recv(&c);
            match u16::from_be_bytes([p[0], p[1]]) {
                OP_DATA => {
                    blocks += 1;
                    // slow on purpose (this is the client's behaviour, not a
                    // synchronisation): 41 blocks x 300 ms = 12 s in all
                    std::thread::sleep(Duration::from_millis(300));
                    c.send_to(&ack(u16::from_be_bytes([p[2], p[3]])), from)
                        .unwrap();
                }
                OP_ERROR => break String::from_utf8_lossy(&p[4..p.len() - 1]).into_owned(),
                op => panic!("opcode {op}: {p:?}"),
            }
        };
        assert_eq!(
            msg,
            "transfer deadline of 2 s exceeded: the whole file must be sent within it"
        );
        assert!(blocks < 41, "{blocks} blocks: the whole file was sent");
        assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
        assert_eq!(metric(&srv, "deadline"), 1);
    }

    /// The deadline grows with the file past what the limit allows at the
    /// slowest rate: the arm64 kernel (33 MB) gets 503 s, a first stage
    /// the limit.
    #[test]
    fn a_large_file_gets_the_time_it_takes_at_the_slowest_rate() {
        let limit = TRANSFER_DEADLINE;
        assert_eq!(transfer_deadline(limit, 1 << 20), limit);
        assert_eq!(transfer_deadline(limit, 120 * MIN_TRANSFER_RATE), limit);
        assert_eq!(
            transfer_deadline(limit, 120 * MIN_TRANSFER_RATE + 1),
            Duration::from_secs(121)
        );
        assert_eq!(
            transfer_deadline(limit, 32_956_352),
            Duration::from_secs(503)
        );
        assert_eq!(
            transfer_deadline(Duration::from_secs(2), 512 * 40),
            Duration::from_secs(2)
        );
    }

    /// At most `per_source` transfers run from one address: the next
    /// request from it gets an ERROR naming the limit; a transfer that
    /// ends frees its place.
    #[test]
    fn transfers_per_source_address_are_capped() {
        let limits = TftpLimits {
            per_source: 3,
            ..TftpLimits::default()
        };
        let srv = start_with(&[("a", content(5000))], limits);
        // three transfers running: each has sent its first block
        let held: Vec<(UdpSocket, SocketAddr)> = (0..3)
            .map(|_| {
                let c = client();
                c.send_to(&rrq("a", &[]), srv.addr).unwrap();
                let (p, from) = recv(&c);
                assert_eq!(&p[..4], &[0, 3, 0, 1], "{p:?}");
                (c, from)
            })
            .collect();
        let c = client();
        c.send_to(&rrq("a", &[]), srv.addr).unwrap();
        let (p, _) = recv(&c);
        assert_eq!(&p[..4], &[0, 5, 0, 0], "{p:?}");
        assert_eq!(
            String::from_utf8_lossy(&p[4..p.len() - 1]),
            "too many transfers from 127.0.0.1: the limit is 3 at once per address"
        );
        assert_eq!(metric(&srv, "per_source_limit"), 1);
        assert_eq!(metric(&srv, "served"), 3);
        // one client gives up: its place is free once its transfer ended
        let (c0, from0) = &held[0];
        c0.send_to(&error_packet(0, "bye"), from0).unwrap();
        let t = Instant::now();
        while srv
            .active
            .lock()
            .unwrap()
            .count_from(IpAddr::from([127, 0, 0, 1]))
            > 2
        {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "transfer still running"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(fetch(&srv, "a", &[], None), content(5000));
    }
}
