//! A small streaming HTTP/1.1 GET client for ingest sources: `http://` and
//! `https://` (rustls with ring; the system roots from rustls-native-certs,
//! or only the certificates of a PEM bundle), retries with backoff on
//! connect errors and 5xx, a stall timeout on connect and every read,
//! redirects followed (at most 5), `Content-Length`, chunked and
//! read-until-close bodies. The body is a `Read`: nothing is buffered
//! beyond one read.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};

/// Largest response head read.
const MAX_HEAD: usize = 64 * 1024;
/// Redirects followed before giving up.
const MAX_REDIRECTS: usize = 5;

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Not an `http://` or `https://` URL this client understands.
    #[error("invalid url {url}: {what}")]
    BadUrl {
        /// The URL.
        url: String,
        /// What is wrong.
        what: &'static str,
    },
    /// HTTP 404.
    #[error("{url} answered HTTP 404 (not found)")]
    NotFound {
        /// The URL.
        url: String,
    },
    /// Another non-success status (after retries for 5xx).
    #[error("{url} answered HTTP {status}")]
    Status {
        /// The URL.
        url: String,
        /// The status.
        status: u16,
    },
    /// The TLS handshake or certificate verification failed.
    #[error("TLS with {url} failed")]
    Tls {
        /// The URL.
        url: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The CA bundle or the system roots could not be loaded.
    #[error("loading CA certificates from {path}")]
    Roots {
        /// The bundle (or "the system store").
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// No connection or no answer, after every attempt.
    #[error("{url} unreachable after {attempts} attempts")]
    Unreachable {
        /// The URL.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last cause.
        #[source]
        source: io::Error,
    },
    /// The answer is not HTTP/1.x as expected.
    #[error("malformed HTTP answer from {url}: {what}")]
    Malformed {
        /// The URL.
        url: String,
        /// What was wrong.
        what: &'static str,
    },
}

/// A parsed `http(s)://host[:port]/path` URL.
#[derive(Clone, PartialEq, Eq)]
pub struct Url {
    /// `https`?
    pub tls: bool,
    /// Host name or address (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
    /// Path and query, starting with `/`.
    pub path: String,
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority(), self.path)
    }
}

impl fmt::Debug for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Url {
    /// Parses an absolute http(s) URL (no user info).
    pub fn parse(s: &str) -> Result<Self, FetchError> {
        let bad = |what| FetchError::BadUrl {
            url: s.to_owned(),
            what,
        };
        let (tls, rest) = if let Some(r) = s.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = s.strip_prefix("http://") {
            (false, r)
        } else {
            return Err(bad("scheme must be http or https"));
        };
        let (auth, path) = match rest.find(['/', '?']) {
            Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_owned()),
            Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
            None => (rest, "/".to_owned()),
        };
        let path = path.split('#').next().unwrap_or("/").to_owned();
        if auth.contains('@') {
            return Err(bad("user info is not supported"));
        }
        if path.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(bad("control characters or spaces in the path"));
        }
        let default_port = if tls { 443 } else { 80 };
        let (host, port) = if let Some(r) = auth.strip_prefix('[') {
            let (h, after) = r.split_once(']').ok_or_else(|| bad("unclosed ["))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad("bad port"))?,
                None if after.is_empty() => default_port,
                None => return Err(bad("garbage after ]")),
            };
            (h.to_owned(), port)
        } else {
            match auth.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), p.parse().map_err(|_| bad("bad port"))?),
                None => (auth.to_owned(), default_port),
            }
        };
        if host.is_empty()
            || !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b':' | b'_'))
        {
            return Err(bad("bad host"));
        }
        Ok(Self {
            tls,
            host,
            port,
            path,
        })
    }

    fn authority(&self) -> String {
        let default_port = if self.tls { 443 } else { 80 };
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == default_port {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// Resolves a `Location` against this URL.
    fn join(&self, location: &str) -> Result<Self, FetchError> {
        if location.starts_with("http://") || location.starts_with("https://") {
            return Self::parse(location);
        }
        if location.starts_with('/') && !location.starts_with("//") {
            return Self::parse(&format!(
                "{}://{}{location}",
                if self.tls { "https" } else { "http" },
                self.authority()
            ));
        }
        Err(FetchError::BadUrl {
            url: location.to_owned(),
            what: "unsupported redirect location",
        })
    }
}

/// Fetch settings.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// Connect timeout and read stall timeout.
    pub timeout: Duration,
    /// Retries after the first attempt (connect errors, 5xx).
    pub retries: u32,
    /// Trust only the certificates of this PEM file (else the system roots).
    pub ca_bundle: Option<PathBuf>,
    /// The first backoff delay (doubled on every retry).
    pub backoff: Duration,
}

/// The TLS client configuration for `ca_bundle` (or the system roots).
pub fn tls_config(ca_bundle: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, FetchError> {
    let mut roots = RootCertStore::empty();
    match ca_bundle {
        Some(p) => {
            let roots_err = |source| FetchError::Roots {
                path: p.to_owned(),
                source,
            };
            let iter = CertificateDer::pem_file_iter(p)
                .map_err(|e| roots_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
            for c in iter {
                let c = c.map_err(|e| roots_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
                roots
                    .add(c)
                    .map_err(|e| roots_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
            }
            if roots.is_empty() {
                return Err(roots_err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "no certificate in the bundle",
                )));
            }
        }
        None => {
            let res = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(res.certs);
            if added == 0 {
                return Err(FetchError::Roots {
                    path: PathBuf::from("the system certificate store"),
                    source: io::Error::new(io::ErrorKind::NotFound, "no usable root certificate"),
                });
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| FetchError::Roots {
            path: PathBuf::from("the TLS configuration"),
            source: io::Error::other(e),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

enum Conn {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Plain(s) => s.read(buf),
            // A peer closing without close_notify: treat as the end; the
            // framing (Content-Length, chunked) catches a truncated body.
            Conn::Tls(s) => match s.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(0),
                r => r,
            },
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Plain(s) => s.write(buf),
            Conn::Tls(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Plain(s) => s.flush(),
            Conn::Tls(s) => s.flush(),
        }
    }
}

enum Framing {
    Length(u64),
    Chunked { left: u64, done: bool },
    Close,
}

/// A response body being streamed.
pub struct Body {
    conn: Conn,
    pre: Vec<u8>,
    pre_pos: usize,
    framing: Framing,
    /// `Content-Length`, when the server sent one.
    pub content_length: Option<u64>,
    /// The URL finally fetched (after redirects).
    pub url: Url,
    /// The first byte of the resource this body starts at (a 206 answer
    /// to a range request; 0 otherwise).
    pub starts_at: u64,
    /// `ETag` (else `Last-Modified`) of the answer, to resume only the same
    /// version of the resource.
    pub validator: Option<String>,
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Body")
            .field("url", &self.url)
            .field("content_length", &self.content_length)
            .finish_non_exhaustive()
    }
}

impl Body {
    fn raw_read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pre_pos < self.pre.len() {
            let n = buf.len().min(self.pre.len() - self.pre_pos);
            buf[..n].copy_from_slice(&self.pre[self.pre_pos..self.pre_pos + n]);
            self.pre_pos += n;
            return Ok(n);
        }
        self.conn.read(buf)
    }

    fn raw_byte(&mut self) -> io::Result<u8> {
        let mut b = [0u8; 1];
        if self.raw_read(&mut b)? == 0 {
            return Err(truncated());
        }
        Ok(b[0])
    }

    fn raw_line(&mut self) -> io::Result<String> {
        let mut line = Vec::new();
        loop {
            let b = self.raw_byte()?;
            if b == b'\n' {
                break;
            }
            line.push(b);
            if line.len() > 4096 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "chunk header too long",
                ));
            }
        }
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        String::from_utf8(line)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "chunk header not text"))
    }
}

fn truncated() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "connection closed before the body was complete",
    )
}

impl Read for Body {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        match self.framing {
            Framing::Length(0) => Ok(0),
            Framing::Length(left) => {
                let want = (buf.len() as u64).min(left) as usize;
                let n = self.raw_read(&mut buf[..want])?;
                if n == 0 {
                    return Err(truncated());
                }
                self.framing = Framing::Length(left - n as u64);
                Ok(n)
            }
            Framing::Close => self.raw_read(buf),
            Framing::Chunked { done: true, .. } => Ok(0),
            Framing::Chunked { left, .. } => {
                let mut left = left;
                if left == 0 {
                    let line = self.raw_line()?;
                    let size = line.split(';').next().unwrap_or("").trim();
                    left = u64::from_str_radix(size, 16).map_err(|_| {
                        io::Error::new(io::ErrorKind::InvalidData, "bad chunk size")
                    })?;
                    if left == 0 {
                        // trailers until an empty line
                        while !self.raw_line()?.is_empty() {}
                        self.framing = Framing::Chunked {
                            left: 0,
                            done: true,
                        };
                        return Ok(0);
                    }
                }
                let want = (buf.len() as u64).min(left) as usize;
                let n = self.raw_read(&mut buf[..want])?;
                if n == 0 {
                    return Err(truncated());
                }
                left -= n as u64;
                if left == 0 {
                    let crlf = self.raw_line()?;
                    if !crlf.is_empty() {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "chunk not followed by CRLF",
                        ));
                    }
                }
                self.framing = Framing::Chunked { left, done: false };
                Ok(n)
            }
        }
    }
}

/// True when an i/o error came out of rustls (handshake, certificate).
fn is_tls(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|i| i.is::<rustls::Error>())
}

enum Attempt {
    Done(Body),
    Retry(io::Error),
    RetryStatus(u16),
    Redirect(Url),
}

/// Starts a GET of `url`: connects (retrying), follows redirects, and
/// returns the body of a 200 answer.
pub fn get(
    url: &str,
    opts: &FetchOptions,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Body, FetchError> {
    get_from(url, opts, tls, None)
}

/// [`get`] with `Range: bytes=<from>-` (and `If-Range` with the validator)
/// when `from` is given: the body of a 206 starting there, or of a 200 (the
/// whole resource: the server ignored the range or the resource changed).
fn get_from(
    url: &str,
    opts: &FetchOptions,
    tls: Option<&Arc<rustls::ClientConfig>>,
    from: Option<(u64, Option<&str>)>,
) -> Result<Body, FetchError> {
    let mut cur = Url::parse(url)?;
    let mut redirects = 0usize;
    let mut attempt = 0u32;
    let mut delay = opts.backoff;
    loop {
        match attempt_once(&cur, opts, tls, from)? {
            Attempt::Done(b) => return Ok(b),
            Attempt::Redirect(next) => {
                redirects += 1;
                if redirects > MAX_REDIRECTS {
                    return Err(FetchError::Malformed {
                        url: cur.to_string(),
                        what: "too many redirects",
                    });
                }
                tracing::info!(from = %cur, to = %next, "following a redirect");
                cur = next;
                continue;
            }
            Attempt::Retry(e) => {
                if attempt >= opts.retries {
                    return Err(FetchError::Unreachable {
                        url: cur.to_string(),
                        attempts: attempt + 1,
                        source: e,
                    });
                }
                tracing::warn!(url = %cur, error = %e, ?delay, "fetch failed, retrying");
            }
            Attempt::RetryStatus(status) => {
                if attempt >= opts.retries {
                    return Err(FetchError::Status {
                        url: cur.to_string(),
                        status,
                    });
                }
                tracing::warn!(url = %cur, status, ?delay, "server error, retrying");
            }
        }
        std::thread::sleep(delay);
        delay = delay.saturating_mul(2);
        attempt += 1;
    }
}

fn attempt_once(
    url: &Url,
    opts: &FetchOptions,
    tls: Option<&Arc<rustls::ClientConfig>>,
    from: Option<(u64, Option<&str>)>,
) -> Result<Attempt, FetchError> {
    let addrs: Vec<_> = match (url.host.as_str(), url.port).to_socket_addrs() {
        Ok(a) => a.collect(),
        Err(e) => return Ok(Attempt::Retry(e)),
    };
    let mut last = None;
    let mut tcp = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, opts.timeout) {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let Some(tcp) = tcp else {
        return Ok(Attempt::Retry(last.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "no address")
        })));
    };
    let setup = tcp
        .set_read_timeout(Some(opts.timeout))
        .and_then(|()| tcp.set_write_timeout(Some(opts.timeout)))
        .and_then(|()| tcp.set_nodelay(true));
    if let Err(e) = setup {
        return Ok(Attempt::Retry(e));
    }
    let mut conn = if url.tls {
        let Some(cfg) = tls else {
            return Err(FetchError::BadUrl {
                url: url.to_string(),
                what: "https without a TLS configuration",
            });
        };
        let name = ServerName::try_from(url.host.clone()).map_err(|_| FetchError::BadUrl {
            url: url.to_string(),
            what: "host is not a valid TLS server name",
        })?;
        let c = rustls::ClientConnection::new(cfg.clone(), name).map_err(|e| FetchError::Tls {
            url: url.to_string(),
            source: io::Error::other(e),
        })?;
        Conn::Tls(Box::new(rustls::StreamOwned::new(c, tcp)))
    } else {
        Conn::Plain(tcp)
    };
    let range = match from {
        Some((n, Some(v))) if is_header_value(v) => {
            format!("Range: bytes={n}-\r\nIf-Range: {v}\r\n")
        }
        Some((n, _)) => format!("Range: bytes={n}-\r\n"),
        None => String::new(),
    };
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: anneal-agent/{}\r\nAccept: */*\r\nAccept-Encoding: identity\r\n{range}Connection: close\r\n\r\n",
        url.path,
        url.authority(),
        env!("CARGO_PKG_VERSION")
    );
    if let Err(e) = conn.write_all(req.as_bytes()).and_then(|()| conn.flush()) {
        if is_tls(&e) {
            return Err(FetchError::Tls {
                url: url.to_string(),
                source: e,
            });
        }
        return Ok(Attempt::Retry(e));
    }
    // read the head
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_len = loop {
        if let Some(i) = find_head_end(&buf) {
            break i;
        }
        if buf.len() > MAX_HEAD {
            return Err(FetchError::Malformed {
                url: url.to_string(),
                what: "response head too large",
            });
        }
        match conn.read(&mut chunk) {
            Ok(0) => {
                return Ok(Attempt::Retry(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before the response head",
                )));
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if is_tls(&e) => {
                return Err(FetchError::Tls {
                    url: url.to_string(),
                    source: e,
                });
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Ok(Attempt::Retry(e)),
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let malformed = |what| FetchError::Malformed {
        url: url.to_string(),
        what,
    };
    match resp.parse(&buf[..head_len]) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return Err(malformed("unparsable response head")),
    }
    let status = resp.code.unwrap_or(0);
    let header = |name: &str| {
        resp.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .map(str::trim)
    };
    let mut starts_at = 0u64;
    match status {
        200 => {}
        206 if from.is_some() => {
            // `Content-Range: bytes <first>-<last>/<len>`
            let first = header("content-range")
                .and_then(|v| v.strip_prefix("bytes "))
                .and_then(|v| v.split('-').next())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| malformed("206 without a usable Content-Range"))?;
            starts_at = first;
        }
        301 | 302 | 303 | 307 | 308 => {
            let loc = header("location").ok_or_else(|| malformed("redirect without Location"))?;
            let next = url.join(loc)?;
            if url.tls && !next.tls {
                return Err(malformed("redirect from https to http refused"));
            }
            return Ok(Attempt::Redirect(next));
        }
        404 => {
            return Err(FetchError::NotFound {
                url: url.to_string(),
            });
        }
        500..=599 => return Ok(Attempt::RetryStatus(status)),
        s => {
            return Err(FetchError::Status {
                url: url.to_string(),
                status: s,
            });
        }
    }
    let chunked = header("transfer-encoding").is_some_and(|v| {
        v.to_ascii_lowercase()
            .split(',')
            .any(|t| t.trim() == "chunked")
    });
    let content_length = match header("content-length") {
        Some(v) => Some(
            v.parse::<u64>()
                .map_err(|_| malformed("bad Content-Length"))?,
        ),
        None => None,
    };
    let framing = if chunked {
        Framing::Chunked {
            left: 0,
            done: false,
        }
    } else if let Some(n) = content_length {
        Framing::Length(n)
    } else {
        Framing::Close
    };
    Ok(Attempt::Done(Body {
        conn,
        pre: buf[head_len..].to_vec(),
        pre_pos: 0,
        framing,
        content_length: if chunked { None } else { content_length },
        url: url.clone(),
        starts_at,
        validator: header("etag")
            .or_else(|| header("last-modified"))
            .map(str::to_owned),
    }))
}

/// Printable ASCII only: safe to send back in a header.
fn is_header_value(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|b| (0x20..0x7f).contains(&b))
}

fn find_head_end(b: &[u8]) -> Option<usize> {
    b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// Whether a read error of a body is worth resuming after: the connection
/// broke or stalled (not TLS, not a malformed body).
fn is_resumable(e: &io::Error) -> bool {
    !is_tls(e)
        && matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::TimedOut
                | io::ErrorKind::WouldBlock
        )
}

/// A body that survives a broken connection: after a read error that
/// [`is_resumable`], it reconnects (at most `retries` times in all, with
/// the backoff of the options) asking for the rest with
/// `Range: bytes=<read so far>-` and `If-Range`; a 206 from there goes on,
/// a 200 (no range support) is read from its start and the bytes already
/// delivered are skipped, unless its validator (ETag or Last-Modified)
/// differs from the first answer's: the resource changed, the original
/// error is returned. What a caller reads is the resource once, in order.
pub struct Resuming {
    body: Body,
    url: String,
    opts: FetchOptions,
    tls: Option<Arc<rustls::ClientConfig>>,
    pos: u64,
    left: u32,
    delay: Duration,
    validator: Option<String>,
    /// `Content-Length` of the first answer.
    pub content_length: Option<u64>,
}

impl fmt::Debug for Resuming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resuming")
            .field("url", &self.url)
            .field("pos", &self.pos)
            .field("left", &self.left)
            .finish_non_exhaustive()
    }
}

/// [`get`], as a body that resumes after a broken connection.
pub fn get_resuming(
    url: &str,
    opts: &FetchOptions,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Resuming, FetchError> {
    let body = get(url, opts, tls)?;
    Ok(Resuming {
        content_length: body.content_length,
        validator: body.validator.clone(),
        url: body.url.to_string(),
        body,
        opts: opts.clone(),
        tls: tls.cloned(),
        pos: 0,
        left: opts.retries,
        delay: opts.backoff,
    })
}

impl Resuming {
    /// Reconnects for the bytes from `self.pos`.
    fn resume(&mut self, cause: io::Error) -> io::Result<()> {
        tracing::warn!(url = %self.url, at = self.pos, error = %cause, delay = ?self.delay,
            "the connection broke, resuming");
        std::thread::sleep(self.delay);
        self.delay = self.delay.saturating_mul(2);
        self.left -= 1;
        let from = (self.pos, self.validator.as_deref());
        let mut body =
            get_from(&self.url, &self.opts, self.tls.as_ref(), Some(from)).map_err(|e| {
                io::Error::new(
                    cause.kind(),
                    format!("{cause}; resuming at byte {} failed: {e}", self.pos),
                )
            })?;
        let changed = |b: &Body| {
            self.validator.is_some() && b.validator.is_some() && b.validator != self.validator
        };
        if body.starts_at == self.pos && body.starts_at > 0 && !changed(&body) {
            self.body = body;
            return Ok(());
        }
        if body.starts_at != 0 || changed(&body) {
            return Err(io::Error::new(
                cause.kind(),
                format!(
                    "{cause}; {} changed or answered another range when resuming at byte {}",
                    self.url, self.pos
                ),
            ));
        }
        // a 200: skip what was delivered already
        let mut skip = self.pos;
        let mut buf = vec![0u8; 1 << 16];
        while skip > 0 {
            let n = (buf.len() as u64).min(skip) as usize;
            let k = body.read(&mut buf[..n])?;
            if k == 0 {
                return Err(truncated());
            }
            skip -= k as u64;
        }
        self.body = body;
        Ok(())
    }
}

impl Read for Resuming {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.body.read(buf) {
                Ok(n) => {
                    self.pos += n as u64;
                    return Ok(n);
                }
                Err(e) if self.left > 0 && is_resumable(&e) => match self.resume(e) {
                    Ok(()) => {}
                    Err(e) if self.left > 0 && is_resumable(&e) => {
                        tracing::warn!(url = %self.url, error = %e, "resuming failed");
                    }
                    Err(e) => return Err(e),
                },
                Err(e) => return Err(e),
            }
        }
    }
}

/// One `Range: bytes=start-(end-1)` GET of `url` on a fresh connection (no
/// retries, no redirects: the caller resumes from where a range stopped).
/// Only a 206 whose `Content-Range` names exactly `[start, end)` is
/// accepted; the body is streamed.
pub fn get_range(
    url: &Url,
    start: u64,
    end: u64,
    timeout: Duration,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<Body, FetchError> {
    let malformed = |what| FetchError::Malformed {
        url: url.to_string(),
        what,
    };
    if end <= start {
        return Err(malformed("empty byte range requested"));
    }
    let unreachable = |source| FetchError::Unreachable {
        url: url.to_string(),
        attempts: 1,
        source,
    };
    let addrs: Vec<_> = (url.host.as_str(), url.port)
        .to_socket_addrs()
        .map_err(unreachable)?
        .collect();
    let mut last = None;
    let mut tcp = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, timeout) {
            Ok(s) => {
                tcp = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let tcp = tcp.ok_or_else(|| {
        unreachable(last.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address")))
    })?;
    tcp.set_read_timeout(Some(timeout))
        .and_then(|()| tcp.set_write_timeout(Some(timeout)))
        .and_then(|()| tcp.set_nodelay(true))
        .map_err(unreachable)?;
    let mut conn = if url.tls {
        let Some(cfg) = tls else {
            return Err(FetchError::BadUrl {
                url: url.to_string(),
                what: "https without a TLS configuration",
            });
        };
        let name = ServerName::try_from(url.host.clone()).map_err(|_| FetchError::BadUrl {
            url: url.to_string(),
            what: "host is not a valid TLS server name",
        })?;
        let c = rustls::ClientConnection::new(cfg.clone(), name).map_err(|e| FetchError::Tls {
            url: url.to_string(),
            source: io::Error::other(e),
        })?;
        Conn::Tls(Box::new(rustls::StreamOwned::new(c, tcp)))
    } else {
        Conn::Plain(tcp)
    };
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: anneal-agent/{}\r\nAccept: */*\r\nAccept-Encoding: identity\r\nRange: bytes={start}-{}\r\nConnection: close\r\n\r\n",
        url.path,
        url.authority(),
        env!("CARGO_PKG_VERSION"),
        end - 1
    );
    conn.write_all(req.as_bytes())
        .and_then(|()| conn.flush())
        .map_err(unreachable)?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_len = loop {
        if let Some(i) = find_head_end(&buf) {
            break i;
        }
        if buf.len() > MAX_HEAD {
            return Err(malformed("response head too large"));
        }
        match conn.read(&mut chunk) {
            Ok(0) => {
                return Err(unreachable(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed before the response head",
                )));
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(unreachable(e)),
        }
    };
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    match resp.parse(&buf[..head_len]) {
        Ok(httparse::Status::Complete(_)) => {}
        _ => return Err(malformed("unparsable response head")),
    }
    let status = resp.code.unwrap_or(0);
    let header = |name: &str| {
        resp.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .map(str::trim)
    };
    match status {
        206 => {}
        404 => {
            return Err(FetchError::NotFound {
                url: url.to_string(),
            });
        }
        s => {
            return Err(FetchError::Status {
                url: url.to_string(),
                status: s,
            });
        }
    }
    let want = format!("bytes {start}-{}/", end - 1);
    if !header("content-range").is_some_and(|v| v.starts_with(&want)) {
        return Err(malformed("Content-Range differs from the range asked for"));
    }
    let len = end - start;
    if header("content-length").is_some_and(|v| v.parse::<u64>().ok() != Some(len)) {
        return Err(malformed("Content-Length differs from the range asked for"));
    }
    if header("transfer-encoding").is_some() {
        return Err(malformed("a chunked range answer"));
    }
    Ok(Body {
        conn,
        pre: buf[head_len..].to_vec(),
        pre_pos: 0,
        framing: Framing::Length(len),
        content_length: Some(len),
        url: url.clone(),
        starts_at: start,
        validator: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = Url::parse("http://127.0.0.1:8080/a/b?c=1#frag").unwrap();
        assert!(!u.tls);
        assert_eq!(
            (u.host.as_str(), u.port, u.path.as_str()),
            ("127.0.0.1", 8080, "/a/b?c=1")
        );
        let u = Url::parse("https://example.com").unwrap();
        assert_eq!((u.port, u.path.as_str()), (443, "/"));
        assert_eq!(u.to_string(), "https://example.com/");
        let u = Url::parse("http://[::1]:9/x").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("::1", 9));
        assert_eq!(u.to_string(), "http://[::1]:9/x");
        for bad in [
            "ftp://x/y",
            "http://",
            "http://u:p@host/",
            "http://host:port/",
            "http://ho st/",
            "http://host/a b",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
        let base = Url::parse("http://h:1/a").unwrap();
        assert_eq!(base.join("/b").unwrap().to_string(), "http://h:1/b");
        assert!(base.join("//evil/x").is_err());
    }
}
