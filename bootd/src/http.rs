//! HTTP: per-machine iPXE scripts and boot-token cpios (both behind
//! [`gate`]), kernel and initramfs (with Range), the first-stage files for
//! UEFI HTTP boot, and `/metrics`.
//!
//! Bounded: kernel, initrd and files are streamed from disk in
//! [`CHUNK`]-sized reads (a request holds one chunk, never the file; a
//! Range seeks to its start), at most [`HttpLimits::max_connections`]
//! connections are served at once (the next ones wait in the listen
//! backlog), a request head (and the wait for the next one on a kept-alive
//! connection) must arrive within [`HttpLimits::header_timeout`], a
//! connection on which nothing moves for [`HttpLimits::stall_timeout`] is
//! closed, and accept errors such as EMFILE back off instead of spinning.

use std::convert::Infallible;
use std::io::SeekFrom;
use std::net::IpAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use anneal_api::error_chain;
use anneal_dhcp::{Mac, Mode};
use bytes::Bytes;
use futures::TryStreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, RANGE};
use hyper::{Method, Request, Response, StatusCode};
use tokio::io::{AsyncRead, AsyncSeekExt, AsyncWrite, ReadBuf};
use tokio::sync::Semaphore;
use tokio_util::io::ReaderStream;
use tokio_util::sync::CancellationToken;

use crate::metrics::{HttpLabels, ReasonLabels};
use crate::script;
use crate::state::{BootToken, MachineBoot, PxeHostRefusal, Shared, Snapshot};

/// Bytes read from disk per step of a streamed file: what one download
/// holds in memory (plus hyper's write buffer).
pub const CHUNK: usize = 64 * 1024;
/// Default [`HttpLimits::max_connections`].
pub const MAX_CONNECTIONS: usize = 256;
/// Default [`HttpLimits::header_timeout`].
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`HttpLimits::stall_timeout`].
pub const STALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the accept loop pauses after an accept error that says a
/// resource ran out (EMFILE, ENFILE, ENOBUFS, ENOMEM): retrying at once
/// would spin on the same error.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Bounds of the HTTP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections served at once; further connections wait in the listen
    /// backlog until one ends (a booting machine is delayed, not refused).
    pub max_connections: usize,
    /// A request head must be complete within this long after the server
    /// starts waiting for it (on a new connection, or after the previous
    /// response on a kept-alive one); else the connection is closed.
    pub header_timeout: Duration,
    /// A connection on which no byte moves either way for this long is
    /// closed (a client that stopped reading a download).
    pub stall_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            max_connections: MAX_CONNECTIONS,
            header_timeout: HEADER_TIMEOUT,
            stall_timeout: STALL_TIMEOUT,
        }
    }
}

type Body = UnsyncBoxBody<Bytes, std::io::Error>;
type Resp = Response<Body>;

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

fn respond(code: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(full(body));
    *r.status_mut() = code;
    if let Ok(v) = ctype.parse() {
        r.headers_mut().insert(CONTENT_TYPE, v);
    }
    r
}

/// A range that cannot be served (416).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsatisfiable;

/// A parsed single `Range: bytes=` request, resolved against a length.
/// `Ok(None)`: no (usable) range, serve everything.
pub fn parse_range(header: Option<&str>, len: u64) -> Result<Option<(u64, u64)>, Unsatisfiable> {
    let Some(h) = header else { return Ok(None) };
    let Some(spec) = h.trim().strip_prefix("bytes=") else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None); // multiple ranges: serve the whole body (RFC 9110 allows it)
    }
    let Some((a, b)) = spec.split_once('-') else {
        return Ok(None);
    };
    let (a, b) = (a.trim(), b.trim());
    let (start, end) = if a.is_empty() {
        let n: u64 = b.parse().map_err(|_| Unsatisfiable)?;
        if n == 0 {
            return Err(Unsatisfiable);
        }
        (
            len.saturating_sub(n),
            len.checked_sub(1).ok_or(Unsatisfiable)?,
        )
    } else {
        let s: u64 = a.parse().map_err(|_| Unsatisfiable)?;
        let e: u64 = if b.is_empty() {
            len.saturating_sub(1)
        } else {
            b.parse::<u64>()
                .map_err(|_| Unsatisfiable)?
                .min(len.saturating_sub(1))
        };
        (s, e)
    };
    if start >= len || start > end {
        return Err(Unsatisfiable);
    }
    Ok(Some((start, end)))
}

fn not_found(path: &Path, why: &str) -> Resp {
    tracing::warn!(path = %path.display(), why, "artifact unreadable");
    respond(StatusCode::NOT_FOUND, "text/plain", "not found\n")
}

/// The file at `path`, whole or the requested range, streamed from disk
/// [`CHUNK`] bytes at a time. The length is the open file's, so a file
/// replaced (renamed over) meanwhile is served consistently from the old
/// one until the response ends.
async fn serve_file(path: &Path, req: &Request<Incoming>) -> Resp {
    let mut file = match tokio::fs::File::open(path).await {
        Ok(f) => f,
        Err(e) => return not_found(path, &error_chain(&e).to_string()),
    };
    let len = match file.metadata().await {
        Ok(m) if m.is_file() => m.len(),
        Ok(_) => return not_found(path, "not a regular file"),
        Err(e) => return not_found(path, &error_chain(&e).to_string()),
    };
    let range = req.headers().get(RANGE).and_then(|v| v.to_str().ok());
    let (status, start, count) = match parse_range(range, len) {
        Ok(None) => (StatusCode::OK, 0, len),
        Ok(Some((s, e))) => (StatusCode::PARTIAL_CONTENT, s, e - s + 1),
        Err(Unsatisfiable) => {
            let mut r = respond(StatusCode::RANGE_NOT_SATISFIABLE, "text/plain", "");
            if let Ok(v) = format!("bytes */{len}").parse() {
                r.headers_mut().insert(CONTENT_RANGE, v);
            }
            if let Ok(v) = "bytes".parse() {
                r.headers_mut().insert("accept-ranges", v);
            }
            return r;
        }
    };
    if start > 0
        && let Err(e) = file.seek(SeekFrom::Start(start)).await
    {
        tracing::warn!(path = %path.display(), error = %error_chain(&e), "artifact not seekable");
        return respond(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "");
    }
    let body = if req.method() == Method::HEAD {
        full(Bytes::new())
    } else {
        let stream = ReaderStream::with_capacity(tokio::io::AsyncReadExt::take(file, count), CHUNK)
            .map_ok(Frame::data);
        StreamBody::new(stream).boxed_unsync()
    };
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    if let Ok(v) = "application/octet-stream".parse() {
        h.insert(CONTENT_TYPE, v);
    }
    if let Ok(v) = count.to_string().parse() {
        h.insert(CONTENT_LENGTH, v);
    }
    if status == StatusCode::PARTIAL_CONTENT
        && let Ok(v) = format!("bytes {start}-{}/{len}", start + count - 1).parse()
    {
        h.insert(CONTENT_RANGE, v);
    }
    if let Ok(v) = "bytes".parse() {
        h.insert("accept-ranges", v);
    }
    r
}

/// Why a script or token request for an enrolled MAC is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// 403 (wrong address) or 410 (no unused token).
    pub status: StatusCode,
    /// What the log and the plain-text answer say.
    pub why: String,
}

/// The gate in front of a machine's script and token (docs/api.md, issue
/// 15): in lease mode only the address leased to `mac` (an unexpired
/// lease) may ask; in proxy mode, while the token is unused, only the host
/// that did the MAC's last PXE exchange with this bootd
/// ([`Shared::bind_pxe_host`]); in every mode only while the machine's
/// token is unused (a machine without any token, a static lab table, has
/// nothing to guard). `now` is Unix seconds.
pub fn gate(
    shared: &Shared,
    snap: &Snapshot,
    mac: Mac,
    m: &MachineBoot,
    peer: IpAddr,
    now: u64,
) -> Result<(), Refusal> {
    if snap.table.mode == Mode::Lease {
        // the address leased to the MAC, of the peer's family (DHCPv6 for
        // a machine that booted over IPv6)
        let (leased, from): (Option<IpAddr>, IpAddr) = match peer.to_canonical() {
            IpAddr::V4(a) => (
                shared
                    .leases()
                    .get(&mac)
                    .filter(|l| l.expires > now)
                    .map(|l| IpAddr::V4(l.address)),
                IpAddr::V4(a),
            ),
            IpAddr::V6(a) => (
                shared
                    .leases6
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .of(mac, now)
                    .map(IpAddr::V6),
                IpAddr::V6(a),
            ),
        };
        if leased != Some(from) {
            return Err(Refusal {
                status: StatusCode::FORBIDDEN,
                why: match leased {
                    Some(a) => format!(
                        "the boot script of {} ({mac}) is served only to {a}, the address leased to that MAC; {peer} asked",
                        m.name
                    ),
                    None => format!(
                        "the boot script of {} ({mac}) is served only to the address leased to that MAC, and it holds no lease; {peer} asked",
                        m.name
                    ),
                },
            });
        }
    }
    if m.token == BootToken::Spent {
        return Err(Refusal {
            status: StatusCode::GONE,
            why: format!(
                "{} ({mac}) has no unused boot token: its agent registered, or no net boot is armed; re-arm the Machine's net boot for a fresh one",
                m.name
            ),
        });
    }
    if snap.table.mode == Mode::Proxy && m.token.unused().is_some() {
        // no leases: the host that did the MAC's PXE exchange (docs/api.md, Boot token delivery)
        match shared.bind_pxe_host(mac, peer) {
            Ok(()) => {}
            Err(PxeHostRefusal::NoExchange) => {
                return Err(Refusal {
                    status: StatusCode::FORBIDDEN,
                    why: format!(
                        "the boot script of {} ({mac}) is served only to the host that did the PXE exchange for that MAC, and this bootd answered none; {peer} asked",
                        m.name
                    ),
                });
            }
            Err(PxeHostRefusal::Other(h)) => {
                return Err(Refusal {
                    status: StatusCode::FORBIDDEN,
                    why: format!(
                        "the boot script of {} ({mac}) is served only to {h}, the host that did the PXE exchange for that MAC; {peer} asked",
                        m.name
                    ),
                });
            }
        }
    }
    Ok(())
}

fn refused(r: &Refusal, mac: Mac, machine: &str, peer: IpAddr, what: &str) -> Resp {
    tracing::info!(%mac, %machine, %peer, status = r.status.as_u16(), why = %r.why, "{what} refused");
    respond(r.status, "text/plain", format!("{}\n", r.why))
}

fn script_response(shared: &Shared, mac_str: &str, peer: IpAddr) -> (Resp, &'static str) {
    let Ok(mac) = mac_str.parse::<Mac>() else {
        return (
            respond(StatusCode::BAD_REQUEST, "text/plain", "bad mac\n"),
            "script",
        );
    };
    let snap = shared.snapshot();
    let enrolled = snap.table.machines.contains_key(&mac);
    let Some(m) = snap.machines.get(&mac).filter(|_| enrolled) else {
        tracing::info!(%mac, why = "mac is not enrolled by any machine of this subnet", "served the unknown-machine script");
        return match script::unknown_script(mac) {
            Ok(s) => (respond(StatusCode::OK, "text/plain", s), "script"),
            Err(e) => {
                tracing::error!(%mac, error = %error_chain(&e), "unknown-machine template is broken");
                (
                    respond(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", ""),
                    "script",
                )
            }
        };
    };
    if let Err(r) = gate(shared, &snap, mac, m, peer, crate::unix_now()) {
        return (refused(&r, mac, &m.name, peer, "boot script"), "script");
    }
    // a script fetched over IPv6 names bootd's IPv6 address in its URLs
    let v6_base = match peer.to_canonical() {
        IpAddr::V6(_) => shared.http_base6.get().map(String::as_str),
        IpAddr::V4(_) => None,
    };
    let base = v6_base.unwrap_or(&snap.table.http_base);
    match script::boot_script_at(&shared.template, &snap, base, mac, m) {
        Ok(s) => {
            tracing::info!(%mac, machine = %m.name, %peer, "served boot script");
            (respond(StatusCode::OK, "text/plain", s), "script")
        }
        Err(e) => {
            tracing::error!(%mac, machine = %m.name, error = %error_chain(&e), "boot script not rendered; nothing sent");
            (
                respond(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    "#!ipxe\necho anneal: boot script could not be rendered\nexit 1\n",
                ),
                "script",
            )
        }
    }
}

/// `GET /token/<mac>`: the per-boot token cpio, behind the same gate as
/// the script.
fn token_response(shared: &Shared, mac_str: &str, peer: IpAddr) -> Resp {
    let Ok(mac) = mac_str.parse::<Mac>() else {
        return respond(StatusCode::BAD_REQUEST, "text/plain", "bad mac\n");
    };
    let snap = shared.snapshot();
    let enrolled = snap.table.machines.contains_key(&mac);
    let Some(m) = snap.machines.get(&mac).filter(|_| enrolled) else {
        tracing::info!(%mac, %peer, why = "mac is not enrolled by any machine of this subnet", "boot token refused");
        return respond(StatusCode::NOT_FOUND, "text/plain", "not found\n");
    };
    if let Err(r) = gate(shared, &snap, mac, m, peer, crate::unix_now()) {
        return refused(&r, mac, &m.name, peer, "boot token");
    }
    let Some(token) = m.token.unused() else {
        tracing::info!(%mac, machine = %m.name, %peer, why = "the machine has no boot token", "boot token refused");
        return respond(StatusCode::NOT_FOUND, "text/plain", "no boot token\n");
    };
    match script::token_cpio(token) {
        Ok(bytes) => {
            tracing::info!(%mac, machine = %m.name, %peer, "served the boot token cpio");
            respond(StatusCode::OK, "application/octet-stream", bytes)
        }
        Err(e) => {
            tracing::error!(%mac, machine = %m.name, error = %error_chain(&e), "boot token cpio not built");
            respond(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "")
        }
    }
}

async fn route(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    peer: IpAddr,
) -> Result<Resp, Infallible> {
    let path = req.uri().path().to_owned();
    let (resp, kind) = if req.method() != Method::GET && req.method() != Method::HEAD {
        (
            respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", ""),
            "other",
        )
    } else if let Some(mac) = path.strip_prefix("/ipxe/") {
        script_response(&shared, mac, peer)
    } else if let Some(mac) = path.strip_prefix("/token/") {
        (token_response(&shared, mac, peer), "token")
    } else if path == "/metrics" {
        // sets bootd_dhcp_leases_active: unexpired leases, O(expired)
        shared.collect_leases(crate::unix_now());
        (
            respond(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                shared.metrics.render(),
            ),
            "metrics",
        )
    } else if path == "/healthz" {
        (respond(StatusCode::OK, "text/plain", "ok\n"), "other")
    } else if let Some((arch, kernel)) = path
        .strip_prefix('/')
        .and_then(crate::config::parse_boot_path)
    {
        let snap = shared.snapshot();
        match snap.artifacts.as_ref().and_then(|a| a.for_arch(arch)) {
            Some((k, i)) => {
                let (p, what) = if kernel { (k, "kernel") } else { (i, "initrd") };
                (serve_file(p, &req).await, what)
            }
            None => (
                respond(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    format!(
                        "no {} kernel and initrd are configured\n",
                        crate::config::arch_name(arch)
                    ),
                ),
                "other",
            ),
        }
    } else if let Some(name) = path.strip_prefix("/files/") {
        let snap = shared.snapshot();
        match snap.files.get(name) {
            Some(p) => (serve_file(p, &req).await, "file"),
            None => {
                tracing::info!(file = %name, why = "not a configured first-stage file", "http file refused");
                (
                    respond(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
                    "file",
                )
            }
        }
    } else {
        (
            respond(StatusCode::NOT_FOUND, "text/plain", "not found\n"),
            "other",
        )
    };
    let len = resp
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| {
            hyper::body::Body::size_hint(resp.body())
                .exact()
                .unwrap_or(0)
        });
    shared.metrics.http_bytes.inc_by(len);
    shared
        .metrics
        .http_requests
        .get_or_create(&HttpLabels {
            kind: kind.into(),
            code: resp.status().as_u16(),
        })
        .inc();
    let resp = if req.method() == Method::HEAD {
        let (parts, _) = resp.into_parts();
        let mut r = Response::from_parts(parts, full(Bytes::new()));
        if let Ok(v) = len.to_string().parse() {
            r.headers_mut().insert(CONTENT_LENGTH, v);
        }
        r
    } else {
        resp
    };
    Ok(resp)
}

/// The stream of one connection, recording when a byte last moved either
/// way (milliseconds since `base`), for the stall deadline.
struct Watched<S> {
    io: S,
    base: tokio::time::Instant,
    last: Arc<AtomicU64>,
}

impl<S> Watched<S> {
    fn moved(&self) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.moved();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.moved();
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            this.moved();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// Resolves once nothing has moved on the connection for `limit`.
async fn stalled(base: tokio::time::Instant, last: Arc<AtomicU64>, limit: Duration) {
    loop {
        let at = base + Duration::from_millis(last.load(Ordering::Relaxed)) + limit;
        if tokio::time::Instant::now() >= at {
            return;
        }
        tokio::time::sleep_until(at).await;
    }
}

/// An accept error that repeats at once until something else frees a
/// resource (file descriptors, buffers, memory).
fn resource_exhausted(e: &std::io::Error) -> bool {
    use nix::errno::Errno;
    e.raw_os_error().is_some_and(|n| {
        [Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM]
            .iter()
            .any(|x| *x as i32 == n)
    })
}

/// Counts an open connection in `bootd_http_connections` while alive.
struct Open<'a>(&'a Shared);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.metrics.http_connections.dec();
    }
}

async fn connection(
    shared: Arc<Shared>,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    limits: HttpLimits,
    cancel: CancellationToken,
) {
    shared.metrics.http_connections.inc();
    let _open = Open(&shared);
    let base = tokio::time::Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let io = hyper_util::rt::TokioIo::new(Watched {
        io: stream,
        base,
        last: last.clone(),
    });
    let svc_shared = shared.clone();
    let peer_ip = peer.ip();
    let svc = hyper::service::service_fn(move |req| route(svc_shared.clone(), req, peer_ip));
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_headers(64)
        .serve_connection(io, svc);
    let closed = |reason: &str| {
        shared
            .metrics
            .http_closed
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    };
    tokio::select! {
        r = conn => match r {
            Ok(()) => {}
            Err(e) if e.is_timeout() => {
                closed("header_deadline");
                tracing::info!(%peer, deadline_secs = limits.header_timeout.as_secs_f64(), "http connection closed: no complete request head within the header deadline");
            }
            Err(e) => tracing::debug!(%peer, error = %error_chain(&e), "http connection ended"),
        },
        () = stalled(base, last, limits.stall_timeout) => {
            closed("stall");
            tracing::info!(%peer, stall_secs = limits.stall_timeout.as_secs_f64(), "http connection closed: nothing moved either way for the stall deadline");
        }
        () = cancel.cancelled() => {}
    }
}

/// Accepts connections until cancelled, at most `limits.max_connections`
/// at once.
pub async fn serve(
    shared: Arc<Shared>,
    listener: tokio::net::TcpListener,
    limits: HttpLimits,
    cancel: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let slot = tokio::select! {
            () = cancel.cancelled() => return,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => return,
            },
        };
        let (stream, peer) = tokio::select! {
            () = cancel.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) if resource_exhausted(&e) => {
                    tracing::warn!(error = %error_chain(&e), backoff_ms = ACCEPT_BACKOFF.as_millis() as u64, "http accept failed: out of a resource; pausing accepts");
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    }
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %error_chain(&e), "http accept failed");
                    continue;
                }
            },
        };
        let shared = shared.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            connection(shared, stream, peer, limits, cancel).await;
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::{Unsatisfiable, parse_range};

    #[test]
    fn ranges() {
        assert_eq!(parse_range(None, 10), Ok(None));
        assert_eq!(parse_range(Some("bytes=0-3"), 10), Ok(Some((0, 3))));
        assert_eq!(parse_range(Some("bytes=5-"), 10), Ok(Some((5, 9))));
        assert_eq!(parse_range(Some("bytes=-4"), 10), Ok(Some((6, 9))));
        assert_eq!(parse_range(Some("bytes=8-100"), 10), Ok(Some((8, 9))));
        assert_eq!(parse_range(Some("bytes=10-"), 10), Err(Unsatisfiable));
        assert_eq!(parse_range(Some("bytes=4-2"), 10), Err(Unsatisfiable));
        assert_eq!(parse_range(Some("bytes=0-1,3-4"), 10), Ok(None));
        assert_eq!(parse_range(Some("items=0-1"), 10), Ok(None));
    }
}
