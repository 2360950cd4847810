//! The content server (`anneal-agent serve`): HTTP/1.1 with byte ranges over
//! a content store laid out `<namespace>/<content>/{index,stream}` (one
//! store per Site: a volume in a cluster, a directory on an appliance).
//!
//! - `GET|HEAD /content/<namespace>/<content>/index|stream` (docs/api.md,
//!   "Additions"): 200 with the
//!   whole file, or 206 for one `Range: bytes=…` (first-last, first-, -suffix);
//!   416 with `Content-Range: bytes */size` when the range starts past the
//!   end. A request with several ranges gets the whole file (RFC 9110 lets a
//!   server ignore Range).
//! - `GET|HEAD /content/<namespace>/<content>/torrent`: the content's
//!   BitTorrent v1 metainfo, made from its index (`anneal_image::torrent`;
//!   its info hash is the content's `status.infoHash`), with an `announce`
//!   key only when the server was given a tracker URL.
//! - Only complete, verified contents are visible: ingest writes a content
//!   under a temporary name and renames its directory into place, the store
//!   never overwrites a content, and `anneal-agent store verify` writes the
//!   `verified` marker once every piece checked out; a content without the
//!   marker is answered 404 ("not verified yet").
//! - Names are DNS-1123 labels / subdomains; anything else (`..`, `%2e`,
//!   slashes in a name) is refused with 400 before any file is touched.
//! - Files are streamed from disk with `sendfile(2)` (a read/write loop where
//!   the kernel refuses it): no whole-file reads into memory.
//! - Bounded: at most `max_connections` at once (the next one gets 503 and is
//!   closed), request heads of at most 8 KiB read within `header_timeout`,
//!   idle keep-alive connections closed after `idle_timeout`, a write that
//!   makes no progress for `write_timeout` ends the connection.
//!
//! Integrity does not come from this server: the agent verifies every piece
//! against the piece hashes it gets from the PartitionContent through the
//! agent API.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The largest request head read (request line and headers).
pub const MAX_HEAD: usize = 8 * 1024;

/// Settings of the content server.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The content store's root directory.
    pub dir: PathBuf,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time allowed to send a whole request head.
    pub header_timeout: Duration,
    /// An idle keep-alive connection is closed after this long.
    pub idle_timeout: Duration,
    /// A write that makes no progress for this long ends the connection.
    pub write_timeout: Duration,
    /// The tracker announce URL put in the torrents served (none: torrents
    /// without `announce`).
    pub tracker: Option<String>,
}

impl ServeConfig {
    /// Defaults for a store at `dir`: 256 connections, 10 s for a request
    /// head, 30 s idle, 60 s per stalled write.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(60),
            tracker: None,
        }
    }
}

/// Counters of a running server (fixed names, no per-content labels).
#[derive(Debug, Default)]
pub struct ServeStats {
    /// Requests answered 200 or 206.
    pub served: AtomicU64,
    /// Requests answered 206.
    pub partial: AtomicU64,
    /// Requests answered 4xx (malformed, not found, unsatisfiable range).
    pub refused: AtomicU64,
    /// Connections refused because `max_connections` were open.
    pub busy: AtomicU64,
    /// Body bytes written.
    pub bytes: AtomicU64,
    /// Connections open now.
    pub open: AtomicUsize,
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The listen address cannot be bound.
    #[error("binding {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The store directory is missing or not a directory.
    #[error("content store {0} is not a directory (create it, or pass --content-dir)")]
    NoStore(PathBuf),
}

/// A bound content server; [`Server::run`] serves until [`Server::stopper`]
/// is used.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    cfg: Arc<ServeConfig>,
    stats: Arc<ServeStats>,
    stop: Arc<AtomicBool>,
}

/// Stops a running [`Server`] (its accept loop returns; open connections
/// finish their current response).
#[derive(Debug, Clone)]
pub struct Stopper {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl Stopper {
    /// Asks the server to stop and wakes its accept loop.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

impl Server {
    /// Binds `addr` for the store of `cfg`.
    pub fn bind(addr: SocketAddr, cfg: ServeConfig) -> Result<Self, ServeError> {
        if !cfg.dir.is_dir() {
            return Err(ServeError::NoStore(cfg.dir));
        }
        let listener =
            TcpListener::bind(addr).map_err(|source| ServeError::Bind { addr, source })?;
        Ok(Self {
            listener,
            cfg: Arc::new(cfg),
            stats: Arc::default(),
            stop: Arc::default(),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The server's counters.
    pub fn stats(&self) -> Arc<ServeStats> {
        self.stats.clone()
    }

    /// A handle that stops [`Server::run`].
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
            let open = self.stats.open.fetch_add(1, Ordering::SeqCst);
            if open >= self.cfg.max_connections {
                self.stats.open.fetch_sub(1, Ordering::SeqCst);
                self.stats.busy.fetch_add(1, Ordering::Relaxed);
                busy(&mut stream);
                tracing::warn!(open, "content server: connection limit reached");
                continue;
            }
            let cfg = self.cfg.clone();
            let stats = self.stats.clone();
            let spawned = std::thread::Builder::new()
                .name("content-conn".into())
                .stack_size(128 * 1024)
                .spawn(move || {
                    let peer = stream.peer_addr().ok();
                    if let Err(e) = connection(&mut stream, &cfg, &stats) {
                        tracing::debug!(?peer, error = %e, "content connection ended");
                    }
                    stats.open.fetch_sub(1, Ordering::SeqCst);
                });
            if spawned.is_err() {
                self.stats.open.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}

/// Answers a connection over the bound with 503 without blocking the accept
/// loop: what the client already sent is drained first (closing with unread
/// data would reset the connection and lose the answer).
fn busy(stream: &mut TcpStream) {
    let _ = stream.set_nonblocking(true);
    let mut sink = [0u8; 4096];
    while let Ok(n) = stream.read(&mut sink) {
        if n == 0 {
            break;
        }
    }
    let _ = stream.write_all(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\nConnection: close\r\n\r\n",
    );
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// A parsed request that can be answered.
#[derive(Debug, PartialEq, Eq)]
struct Request {
    head_only: bool,
    path: String,
    range: Option<String>,
    close: bool,
}

/// What a request head was.
#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    Ok(Request),
    /// Answer with this status, then close.
    Bad(u16, &'static str),
}

fn parse_head(head: &[u8]) -> Parsed {
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) | Err(_) => return Parsed::Bad(400, "malformed request"),
    }
    let head_only = match req.method {
        Some("GET") => false,
        Some("HEAD") => true,
        _ => return Parsed::Bad(405, "only GET and HEAD"),
    };
    let http10 = req.version == Some(0);
    let mut range = None;
    let mut close = http10;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("range") {
            range = std::str::from_utf8(h.value).ok().map(str::to_string);
        } else if h.name.eq_ignore_ascii_case("connection") {
            let v = String::from_utf8_lossy(h.value).to_ascii_lowercase();
            if v.contains("close") {
                close = true;
            } else if v.contains("keep-alive") {
                close = false;
            }
        }
    }
    Parsed::Ok(Request {
        head_only,
        path: req.path.unwrap_or("").to_string(),
        range,
        close,
    })
}

/// A DNS-1123 label (namespace) or subdomain (object name).
fn valid_name(s: &str, subdomain: bool) -> bool {
    let max = if subdomain { 253 } else { 63 };
    !s.is_empty()
        && s.len() <= max
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || (subdomain && b == b'.')
        })
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
        && !s.contains("..")
}

/// The file a request path names in the store, or why not.
fn resolve(store: &Path, path: &str) -> Result<PathBuf, (u16, &'static str)> {
    let path = path.split('?').next().unwrap_or("");
    let rest = path.strip_prefix("/content/").ok_or((
        404,
        "no such path (use /content/<namespace>/<content>/index|stream|torrent)",
    ))?;
    let parts: Vec<&str> = rest.split('/').collect();
    let [ns, content, file] = parts.as_slice() else {
        return Err((
            400,
            "expected /content/<namespace>/<content>/index|stream|torrent",
        ));
    };
    if !valid_name(ns, false) || !valid_name(content, true) {
        return Err((
            400,
            "namespace or content name is not a valid Kubernetes name",
        ));
    }
    if !matches!(*file, "index" | "stream" | "torrent") {
        return Err((404, "only index, stream and torrent are served"));
    }
    Ok(store.join(ns).join(content).join(file))
}

/// A byte range of a file of `size` bytes: Ok(None) means the whole file.
fn parse_range(value: &str, size: u64) -> Result<Option<(u64, u64)>, ()> {
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return Ok(None); // another unit: ignored
    };
    if spec.contains(',') {
        return Ok(None); // several ranges: the whole file
    }
    let (a, b) = spec.trim().split_once('-').ok_or(())?;
    let (a, b) = (a.trim(), b.trim());
    let (first, last) = if a.is_empty() {
        let n: u64 = b.parse().map_err(|_| ())?;
        if n == 0 {
            return Err(());
        }
        (size.saturating_sub(n), size.saturating_sub(1))
    } else {
        let first: u64 = a.parse().map_err(|_| ())?;
        let last = if b.is_empty() {
            size.saturating_sub(1)
        } else {
            let l: u64 = b.parse().map_err(|_| ())?;
            if l < first {
                return Err(());
            }
            l.min(size.saturating_sub(1))
        };
        (first, last)
    };
    if size == 0 || first >= size {
        return Err(());
    }
    Ok(Some((first, last)))
}

/// Reads one request head (up to the blank line) into `buf`, keeping any
/// bytes after it for the next request. Ok(false): the peer closed cleanly
/// between requests.
fn read_head(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    cfg: &ServeConfig,
) -> io::Result<Option<usize>> {
    let mut first = buf.is_empty();
    let started = Instant::now();
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok(Some(end + 4));
        }
        if buf.len() >= MAX_HEAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request head too large",
            ));
        }
        let limit = if first {
            cfg.idle_timeout
        } else {
            cfg.header_timeout
                .checked_sub(started.elapsed())
                .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "request head too slow"))?
        };
        stream.set_read_timeout(Some(limit.max(Duration::from_millis(1))))?;
        let mut chunk = [0u8; 2048];
        let n = match stream.read(&mut chunk) {
            Ok(0) if buf.is_empty() => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => n,
            Err(e)
                if first
                    && matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
            {
                return Ok(None); // idle keep-alive connection: close quietly
            }
            Err(e) => return Err(e),
        };
        if first {
            first = false;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn status_text(code: u16) -> &'static str {
    match code {
        200 => "OK",
        206 => "Partial Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        416 => "Range Not Satisfiable",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    }
}

fn simple(
    stream: &mut TcpStream,
    code: u16,
    msg: &str,
    extra: &str,
    close: bool,
) -> io::Result<()> {
    let body = format!("{msg}\n");
    let head = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n{extra}{}\r\n",
        status_text(code),
        body.len(),
        if close { "Connection: close\r\n" } else { "" }
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())
}

/// Closes after a refusal without resetting the connection: the write side
/// is shut, then what the client still sends is read and dropped (at most
/// 1 MiB, for at most 2 s), so the answer reaches it.
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

fn connection(stream: &mut TcpStream, cfg: &ServeConfig, stats: &ServeStats) -> io::Result<()> {
    stream.set_write_timeout(Some(cfg.write_timeout))?;
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::with_capacity(1024);
    loop {
        let end = match read_head(stream, &mut buf, cfg) {
            Ok(Some(end)) => end,
            Ok(None) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                simple(stream, 431, "request head too large", "", true)?;
                return linger(stream);
            }
            Err(e) => return Err(e),
        };
        let head: Vec<u8> = buf.drain(..end).collect();
        let req = match parse_head(&head) {
            Parsed::Ok(r) => r,
            Parsed::Bad(code, msg) => {
                stats.refused.fetch_add(1, Ordering::Relaxed);
                simple(stream, code, msg, "", true)?;
                return linger(stream);
            }
        };
        answer(stream, &req, cfg, stats)?;
        if req.close {
            return Ok(());
        }
    }
}

fn answer(
    stream: &mut TcpStream,
    req: &Request,
    cfg: &ServeConfig,
    stats: &ServeStats,
) -> io::Result<()> {
    let path = match resolve(&cfg.dir, &req.path) {
        Ok(p) => p,
        Err((code, msg)) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            return simple(stream, code, msg, "", req.close);
        }
    };
    let verified = path
        .parent()
        .map(|d| d.join(crate::store::VERIFIED))
        .is_some_and(|m| m.is_file());
    if !verified {
        stats.refused.fetch_add(1, Ordering::Relaxed);
        let exists = path.parent().is_some_and(Path::is_dir);
        let msg = if exists {
            "content is not verified yet"
        } else {
            "no such content"
        };
        return simple(stream, 404, msg, "", req.close);
    }
    if path.file_name().is_some_and(|f| f == "torrent") {
        return answer_torrent(stream, req, &path, cfg, stats);
    }
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(_) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            return simple(stream, 404, "no such content", "", req.close);
        }
    };
    let size = file.metadata()?.len();
    let range = match req.range.as_deref().map(|r| parse_range(r, size)) {
        None | Some(Ok(None)) => None,
        Some(Ok(Some(r))) => Some(r),
        Some(Err(())) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            let extra = format!("Content-Range: bytes */{size}\r\n");
            return simple(stream, 416, "range not satisfiable", &extra, req.close);
        }
    };
    let (code, first, len, content_range) = match range {
        Some((a, b)) => (
            206,
            a,
            b - a + 1,
            format!("Content-Range: bytes {a}-{b}/{size}\r\n"),
        ),
        None => (200, 0, size, String::new()),
    };
    let head = format!(
        "HTTP/1.1 {code} {}\r\nContent-Type: application/octet-stream\r\nAccept-Ranges: bytes\r\nContent-Length: {len}\r\n{content_range}{}\r\n",
        status_text(code),
        if req.close {
            "Connection: close\r\n"
        } else {
            ""
        }
    );
    stream.write_all(head.as_bytes())?;
    stats.served.fetch_add(1, Ordering::Relaxed);
    if code == 206 {
        stats.partial.fetch_add(1, Ordering::Relaxed);
    }
    if req.head_only || len == 0 {
        return Ok(());
    }
    send_range(stream, &file, first, len, stats)
}

/// The torrent of the content whose `torrent` path is `path`, made from
/// the index beside it (a stored index is valid: ingest and verify checked
/// it; one that no longer parses is answered 500).
fn answer_torrent(
    stream: &mut TcpStream,
    req: &Request,
    path: &Path,
    cfg: &ServeConfig,
    stats: &ServeStats,
) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new(""));
    let content = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let index = std::fs::read(dir.join("index"))
        .ok()
        .and_then(|b| anneal_image::ContentIndex::parse(&b).ok());
    let Some(index) = index else {
        stats.refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(content = %dir.display(), "stored index unreadable or invalid: no torrent");
        return simple(
            stream,
            500,
            "the content's stored index is unreadable or invalid (verify the content again)",
            "",
            req.close,
        );
    };
    let body =
        anneal_image::torrent::Metainfo::from_index(&index, &content, cfg.tracker.as_deref())
            .to_bytes();
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: application/x-bittorrent\r\nContent-Length: {}\r\n{}\r\n",
        body.len(),
        if req.close {
            "Connection: close\r\n"
        } else {
            ""
        }
    );
    stream.write_all(head.as_bytes())?;
    stats.served.fetch_add(1, Ordering::Relaxed);
    if req.head_only {
        return Ok(());
    }
    stream.write_all(&body)?;
    stats.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
    Ok(())
}

/// Writes `len` bytes of `file` from `first` to the socket: sendfile(2),
/// or a buffered copy where the kernel refuses sendfile for this file.
fn send_range(
    stream: &mut TcpStream,
    file: &File,
    first: u64,
    len: u64,
    stats: &ServeStats,
) -> io::Result<()> {
    let mut offset =
        i64::try_from(first).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut left = len;
    while left > 0 {
        let chunk = usize::try_from(left.min(1 << 30)).unwrap_or(1 << 30);
        match nix::sys::sendfile::sendfile(&*stream, file, Some(&mut offset), chunk) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                left -= n as u64;
                stats.bytes.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOSYS) => {
                let pos = u64::try_from(offset).unwrap_or(0);
                return copy_range(stream, file, pos, left, stats);
            }
            Err(nix::errno::Errno::EAGAIN) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "peer stopped reading",
                ));
            }
            Err(e) => return Err(io::Error::from(e)),
        }
    }
    Ok(())
}

fn copy_range(
    stream: &mut TcpStream,
    file: &File,
    first: u64,
    len: u64,
    stats: &ServeStats,
) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 256 * 1024];
    let mut pos = first;
    let end = first + len;
    while pos < end {
        let want = usize::try_from((end - pos).min(buf.len() as u64)).unwrap_or(buf.len());
        let n = file.read_at(&mut buf[..want], pos)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        stream.write_all(&buf[..n])?;
        stats.bytes.fetch_add(n as u64, Ordering::Relaxed);
        pos += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), Ok(Some((0, 9))));
        assert_eq!(parse_range("bytes=90-", 100), Ok(Some((90, 99))));
        assert_eq!(parse_range("bytes=-10", 100), Ok(Some((90, 99))));
        assert_eq!(parse_range("bytes=-1000", 100), Ok(Some((0, 99))));
        assert_eq!(parse_range("bytes=50-1000", 100), Ok(Some((50, 99))));
        assert_eq!(parse_range("bytes=100-", 100), Err(()));
        assert_eq!(parse_range("bytes=9-3", 100), Err(()));
        assert_eq!(parse_range("bytes=-0", 100), Err(()));
        assert_eq!(parse_range("bytes=x-3", 100), Err(()));
        assert_eq!(parse_range("bytes=0-0", 0), Err(()));
        assert_eq!(parse_range("bytes=0-1,5-6", 100), Ok(None));
        assert_eq!(parse_range("items=0-1", 100), Ok(None));
    }

    #[test]
    fn names_and_paths() {
        let s = Path::new("/store");
        assert_eq!(
            resolve(s, "/content/lab/ubuntu-p1/stream"),
            Ok(PathBuf::from("/store/lab/ubuntu-p1/stream"))
        );
        assert_eq!(
            resolve(s, "/content/lab/img.v2-p1/index?x=1"),
            Ok(PathBuf::from("/store/lab/img.v2-p1/index"))
        );
        for bad in [
            "/content/../etc/passwd",
            "/content/lab/../stream",
            "/content/lab/a..b/stream",
            "/content/Lab/x/stream",
            "/content/lab/x/y/stream",
            "/content/lab/%2e%2e/stream",
            "/content/lab.x/c/stream",
        ] {
            assert_eq!(resolve(s, bad).map_err(|e| e.0), Err(400), "{bad}");
        }
        assert_eq!(
            resolve(s, "/content/lab/ubuntu-p1/torrent"),
            Ok(PathBuf::from("/store/lab/ubuntu-p1/torrent"))
        );
        assert_eq!(
            resolve(s, "/content/lab/x/layout.json").map_err(|e| e.0),
            Err(404)
        );
        assert_eq!(resolve(s, "/etc/passwd").map_err(|e| e.0), Err(404));
    }

    #[test]
    fn heads() {
        let Parsed::Ok(r) = parse_head(b"GET /a HTTP/1.1\r\nRange: bytes=1-2\r\n\r\n") else {
            panic!()
        };
        assert_eq!(r.range.as_deref(), Some("bytes=1-2"));
        assert!(!r.close && !r.head_only);
        let Parsed::Ok(r) = parse_head(b"HEAD /a HTTP/1.0\r\n\r\n") else {
            panic!()
        };
        assert!(r.close && r.head_only);
        assert_eq!(
            parse_head(b"PUT /a HTTP/1.1\r\n\r\n"),
            Parsed::Bad(405, "only GET and HEAD")
        );
        assert_eq!(
            parse_head(b"\x00\x01 garbage\r\n\r\n"),
            Parsed::Bad(400, "malformed request")
        );
    }
}
