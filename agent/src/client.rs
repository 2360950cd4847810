//! The agent side of the agent API: HTTPS (rustls, ring) to `anneal.api`,
//! trusting only a CA whose SHA-256 is `anneal.ca`, HTTP/1.1 with one
//! connection per request (`Connection: close`), bounded bodies.
//!
//! The CA certificate itself is not on the command line, only its digest, so
//! the server must send it in its chain: [`PinnedCaVerifier`] finds the chain
//! certificate whose SHA-256 equals the pin and then verifies the server
//! certificate against it as the only root (names, validity, signatures:
//! webpki's full verification).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use anneal_api::agent::{
    ErrorCode, ErrorResponse, HardwareReport, MAX_BODY_BYTES, NextAction, ProgressRequest,
    ProgressResponse, RegisterRequest, RegisterResponse, ResultRequest, SCHEMA_HEADER,
    SCHEMA_VERSION, Token, paths,
};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, OtherError, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};
use zeroize::Zeroize;

use crate::cmdline::{ApiUrl, CaPin};

/// A failed exchange with the agent API.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The host name did not resolve.
    #[error("cannot resolve {host}")]
    Resolve {
        /// host:port.
        host: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// TCP connect failed.
    #[error("cannot connect to {addr}")]
    Connect {
        /// The address.
        addr: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The server's chain has no certificate matching `anneal.ca`.
    #[error(
        "CA fingerprint mismatch: refusing {url}: no certificate in the chain it sent has the SHA-256 {pin} given as anneal.ca"
    )]
    CaMismatch {
        /// The API URL.
        url: String,
        /// The expected digest.
        pin: String,
    },
    /// Any other TLS failure (name, expiry, signature).
    #[error("TLS with {url} failed")]
    Tls {
        /// The API URL.
        url: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Reading or writing the exchange failed (timeouts included).
    #[error("exchange with {url} failed")]
    Io {
        /// The API URL.
        url: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The server answered an error status.
    #[error("{method} {path} answered HTTP {status}{}", code.map(|c| format!(" ({c:?})")).unwrap_or_default())]
    Status {
        /// The method.
        method: &'static str,
        /// The path.
        path: String,
        /// HTTP status.
        status: u16,
        /// The error code of the body, when it had one.
        code: Option<ErrorCode>,
        /// The message of the body.
        message: String,
    },
    /// An answer that is not HTTP/1.1 as expected.
    #[error("malformed HTTP answer from {url}: {what}")]
    Malformed {
        /// The API URL.
        url: String,
        /// What was wrong.
        what: &'static str,
    },
    /// A body that does not match the contract.
    #[error("{path}: the answer does not match the agent contract")]
    Json {
        /// The path.
        path: String,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A request or call made out of order.
    #[error("not registered: no session token")]
    NotRegistered,
    /// Building the TLS configuration failed.
    #[error("TLS configuration")]
    Config(#[source] rustls::Error),
}

impl ClientError {
    /// True when retrying the same request cannot help.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::CaMismatch { .. } | Self::NotRegistered | Self::Config(_) => true,
            Self::Status { status, code, .. } => match code {
                Some(c) if c.is_permanent() => true,
                Some(ErrorCode::Internal) => false,
                _ => matches!(status, 400 | 401 | 403 | 404 | 426),
            },
            _ => false,
        }
    }
}

/// Marker error for a pin mismatch inside rustls.
#[derive(Debug)]
struct PinMismatch;

impl fmt::Display for PinMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no certificate in the chain matches anneal.ca")
    }
}

impl std::error::Error for PinMismatch {}

/// Trusts exactly one CA: the chain certificate whose SHA-256 is the pin.
#[derive(Debug)]
pub struct PinnedCaVerifier {
    pin: CaPin,
    provider: Arc<CryptoProvider>,
}

impl PinnedCaVerifier {
    /// A verifier for `pin`.
    pub fn new(pin: CaPin, provider: Arc<CryptoProvider>) -> Self {
        Self { pin, provider }
    }
}

fn pin_error() -> rustls::Error {
    rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(PinMismatch))))
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let digest = |c: &CertificateDer<'_>| -> [u8; 32] { Sha256::digest(c.as_ref()).into() };
        // The serving certificate itself must not be the CA (docs/api.md: distinct).
        let Some(ca_pos) = intermediates
            .iter()
            .position(|c| anneal_api::agent::ct_eq(&digest(c), &self.pin.0))
        else {
            return Err(pin_error());
        };
        let mut roots = RootCertStore::empty();
        roots.add(intermediates[ca_pos].clone().into_owned())?;
        let rest: Vec<CertificateDer<'_>> = intermediates
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != ca_pos)
            .map(|(_, c)| c.clone())
            .collect();
        let inner =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
        inner.verify_server_cert(end_entity, &rest, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The TLS client configuration pinned to `pin`.
pub fn tls_config(pin: CaPin) -> Result<Arc<rustls::ClientConfig>, ClientError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(ClientError::Config)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedCaVerifier::new(pin, provider)))
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// An HTTP answer.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Body (at most [`MAX_BODY_BYTES`]).
    pub body: Vec<u8>,
}

const MAX_HEAD: usize = 64 * 1024;

/// Parses a complete HTTP/1.1 response (head and body as read until the
/// connection closed or the framing ended). Pure, for tests and fuzzing.
pub fn parse_response(buf: &[u8]) -> Result<Option<HttpResponse>, &'static str> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            if buf.len() > MAX_HEAD {
                return Err("response head too large");
            }
            return Ok(None);
        }
        Err(_) => return Err("not an HTTP/1.1 response"),
    };
    let status = resp.code.ok_or("no status")?;
    let mut content_length: Option<usize> = None;
    let mut chunked = false;
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value)
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .ok_or("bad content-length")?;
            content_length = Some(v);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = String::from_utf8_lossy(h.value)
                .to_ascii_lowercase()
                .contains("chunked");
        }
    }
    let rest = &buf[head_len..];
    let body = if chunked {
        match decode_chunked(rest)? {
            Some(b) => b,
            None => return Ok(None),
        }
    } else if let Some(n) = content_length {
        if n > MAX_BODY_BYTES {
            return Err("body too large");
        }
        if rest.len() < n {
            return Ok(None);
        }
        rest[..n].to_vec()
    } else if status == 204 || status == 304 || (100..200).contains(&status) {
        Vec::new()
    } else {
        // Delimited by the end of the connection: the caller only asks again
        // after EOF, so this is the whole body.
        if rest.len() > MAX_BODY_BYTES {
            return Err("body too large");
        }
        rest.to_vec()
    };
    Ok(Some(HttpResponse { status, body }))
}

/// Framing is complete for a body delimited by Content-Length or chunks.
fn framed(buf: &[u8]) -> bool {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let Ok(httparse::Status::Complete(_)) = resp.parse(buf) else {
        return false;
    };
    let delimited = resp.headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("content-length")
            || h.name.eq_ignore_ascii_case("transfer-encoding")
    }) || matches!(resp.code, Some(204) | Some(304));
    delimited && matches!(parse_response(buf), Ok(Some(_)))
}

fn decode_chunked(mut b: &[u8]) -> Result<Option<Vec<u8>>, &'static str> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let line = std::str::from_utf8(&b[..eol]).map_err(|_| "bad chunk size")?;
        let size_str = line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_str, 16).map_err(|_| "bad chunk size")?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(Some(out));
        }
        if out.len().saturating_add(size) > MAX_BODY_BYTES {
            return Err("body too large");
        }
        if b.len() < size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&b[..size]);
        if &b[size..size + 2] != b"\r\n" {
            return Err("bad chunk terminator");
        }
        b = &b[size + 2..];
    }
}

/// A client of the agent API.
pub struct AgentClient {
    api: ApiUrl,
    pin: CaPin,
    config: Arc<rustls::ClientConfig>,
    session: Option<Token>,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Read timeout of ordinary requests.
    pub timeout: Duration,
}

impl fmt::Debug for AgentClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentClient")
            .field("api", &self.api.to_string())
            .field("pin", &self.pin)
            .field("session", &self.session)
            .finish()
    }
}

impl AgentClient {
    /// A client for `api` pinned to `pin`.
    pub fn new(api: ApiUrl, pin: CaPin) -> Result<Self, ClientError> {
        Ok(Self {
            config: tls_config(pin)?,
            api,
            pin,
            session: None,
            connect_timeout: Duration::from_secs(10),
            timeout: Duration::from_secs(30),
        })
    }

    /// The API URL.
    pub fn api(&self) -> &ApiUrl {
        &self.api
    }

    fn tls_error(&self, e: io::Error) -> ClientError {
        let is_pin = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .is_some_and(|re| {
                matches!(re, rustls::Error::InvalidCertificate(CertificateError::Other(o))
                    if o.0.downcast_ref::<PinMismatch>().is_some())
            });
        if is_pin {
            ClientError::CaMismatch {
                url: self.api.to_string(),
                pin: self.pin.to_hex(),
            }
        } else if e.get_ref().is_some_and(|i| i.is::<rustls::Error>()) {
            ClientError::Tls {
                url: self.api.to_string(),
                source: e,
            }
        } else {
            ClientError::Io {
                url: self.api.to_string(),
                source: e,
            }
        }
    }

    /// One request/response exchange.
    pub fn exchange(
        &self,
        method: &'static str,
        endpoint: &str,
        body: Option<&[u8]>,
        bearer: Option<&Token>,
        read_timeout: Duration,
    ) -> Result<HttpResponse, ClientError> {
        let authority = self.api.authority();
        let addrs: Vec<_> = (self.api.server_name().as_str(), self.api.port)
            .to_socket_addrs()
            .map_err(|source| ClientError::Resolve {
                host: authority.clone(),
                source,
            })?
            .collect();
        let mut last = None;
        let mut tcp = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, self.connect_timeout) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let Some(tcp) = tcp else {
            return Err(ClientError::Connect {
                addr: authority,
                source: last.unwrap_or_else(|| io::Error::from(io::ErrorKind::NotFound)),
            });
        };
        let io = |source| ClientError::Io {
            url: self.api.to_string(),
            source,
        };
        tcp.set_read_timeout(Some(read_timeout)).map_err(io)?;
        tcp.set_write_timeout(Some(self.timeout)).map_err(io)?;
        tcp.set_nodelay(true).map_err(io)?;
        let name =
            ServerName::try_from(self.api.server_name()).map_err(|_| ClientError::Malformed {
                url: self.api.to_string(),
                what: "host is not a valid TLS server name",
            })?;
        let conn = rustls::ClientConnection::new(self.config.clone(), name)
            .map_err(ClientError::Config)?;
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        let path = self.api.path(endpoint);
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {authority}\r\n{SCHEMA_HEADER}: {SCHEMA_VERSION}\r\n\
             User-Agent: anneal-agent/{}\r\nAccept: application/json\r\nConnection: close\r\n",
            env!("CARGO_PKG_VERSION")
        )
        .into_bytes();
        if let Some(t) = bearer {
            req.extend_from_slice(b"Authorization: Bearer ");
            req.extend_from_slice(t.expose().as_bytes());
            req.extend_from_slice(b"\r\n");
        }
        match body {
            Some(b) => {
                req.extend_from_slice(
                    format!(
                        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                        b.len()
                    )
                    .as_bytes(),
                );
                req.extend_from_slice(b);
            }
            None => req.extend_from_slice(b"Content-Length: 0\r\n\r\n"),
        }
        let written = tls.write_all(&req).and_then(|()| tls.flush());
        // The request may hold the bearer token: wipe our copy.
        req.zeroize();
        written.map_err(|e| self.tls_error(e))?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match tls.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.len() > MAX_BODY_BYTES + MAX_HEAD {
                        return Err(ClientError::Malformed {
                            url: self.api.to_string(),
                            what: "answer too large",
                        });
                    }
                    if framed(&buf) {
                        break;
                    }
                }
                // A peer that closes without close_notify: what we have is all.
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && !buf.is_empty() => break,
                Err(e) => return Err(self.tls_error(e)),
            }
        }
        match parse_response(&buf) {
            Ok(Some(r)) => Ok(r),
            Ok(None) => Err(ClientError::Malformed {
                url: self.api.to_string(),
                what: "connection closed before the answer was complete",
            }),
            Err(what) => Err(ClientError::Malformed {
                url: self.api.to_string(),
                what,
            }),
        }
    }

    fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: &'static str,
        endpoint: &str,
        body: Option<Vec<u8>>,
        bearer: Option<&Token>,
        read_timeout: Duration,
        expect_body: bool,
    ) -> Result<Option<T>, ClientError> {
        let mut body = body;
        let r = self.exchange(method, endpoint, body.as_deref(), bearer, read_timeout);
        // Bodies may hold a token (register): wipe them once sent.
        if let Some(b) = body.as_mut() {
            b.zeroize();
        }
        let r = r?;
        if !(200..300).contains(&r.status) {
            let parsed: Option<ErrorResponse> = serde_json::from_slice(&r.body).ok();
            return Err(ClientError::Status {
                method,
                path: endpoint.to_string(),
                status: r.status,
                code: parsed.as_ref().map(|p| p.code),
                message: parsed
                    .map(|p| anneal_api::agent::sanitize_reason(&p.message))
                    .unwrap_or_default(),
            });
        }
        if !expect_body {
            return Ok(None);
        }
        serde_json::from_slice(&r.body)
            .map(Some)
            .map_err(|source| ClientError::Json {
                path: endpoint.to_string(),
                source,
            })
    }

    fn json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, ClientError> {
        serde_json::to_vec(v).map_err(|source| ClientError::Json {
            path: String::new(),
            source,
        })
    }

    /// `POST /v1/agent/register`; keeps the session token.
    pub fn register(&mut self, req: &RegisterRequest) -> Result<RegisterResponse, ClientError> {
        let resp: Option<RegisterResponse> = self.call(
            "POST",
            paths::REGISTER,
            Some(Self::json(req)?),
            None,
            self.timeout,
            true,
        )?;
        let resp = resp.ok_or(ClientError::NotRegistered)?;
        self.session = Some(resp.session_token.clone());
        Ok(resp)
    }

    fn session(&self) -> Result<&Token, ClientError> {
        self.session.as_ref().ok_or(ClientError::NotRegistered)
    }

    /// `PUT /v1/agent/hardware`.
    pub fn put_hardware(&self, hw: &HardwareReport) -> Result<(), ClientError> {
        self.call::<serde_json::Value>(
            "PUT",
            paths::HARDWARE,
            Some(Self::json(hw)?),
            Some(self.session()?),
            self.timeout,
            false,
        )?;
        Ok(())
    }

    /// `GET /v1/agent/next`, long-polling for up to `hold`.
    pub fn next(&self, hold: Duration) -> Result<NextAction, ClientError> {
        let r: Option<NextAction> = self.call(
            "GET",
            paths::NEXT,
            None,
            Some(self.session()?),
            hold + self.timeout,
            true,
        )?;
        r.ok_or(ClientError::NotRegistered)
    }

    /// `POST /v1/agent/progress`.
    pub fn progress(&self, req: &ProgressRequest) -> Result<ProgressResponse, ClientError> {
        let r: Option<ProgressResponse> = self.call(
            "POST",
            paths::PROGRESS,
            Some(Self::json(req)?),
            Some(self.session()?),
            self.timeout,
            true,
        )?;
        r.ok_or(ClientError::NotRegistered)
    }

    /// `POST /v1/agent/result`.
    pub fn result(&self, req: &ResultRequest) -> Result<(), ClientError> {
        self.call::<serde_json::Value>(
            "POST",
            paths::RESULT,
            Some(Self::json(req)?),
            Some(self.session()?),
            self.timeout,
            false,
        )?;
        Ok(())
    }
}

/// Exponential backoff with jitter: 1, 2, 4 … `cap` seconds.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    cap: Duration,
}

impl Backoff {
    /// Starting at `first`, never above `cap`.
    pub fn new(first: Duration, cap: Duration) -> Self {
        Self { next: first, cap }
    }

    /// The next delay (±20 % jitter so a rack does not retry in lockstep).
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.cap);
        let jitter: f64 = rand::random::<f64>() * 0.4 + 0.8;
        base.mul_f64(jitter).min(self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_parse() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            .unwrap()
            .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}")
                .unwrap()
                .is_none()
        );
        let c = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{\"\r\n3;x=y\r\na\":\r\n0\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.body, b"{\"a\":");
        let e = parse_response(b"HTTP/1.1 204 No Content\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(e.status, 204);
        assert!(parse_response(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n").is_err());
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
    }

    #[test]
    fn permanence() {
        let s = |status, code| ClientError::Status {
            method: "POST",
            path: "/".into(),
            status,
            code,
            message: String::new(),
        };
        assert!(s(401, Some(ErrorCode::UsedToken)).is_permanent());
        assert!(s(401, None).is_permanent());
        assert!(s(426, Some(ErrorCode::SchemaMismatch)).is_permanent());
        assert!(!s(503, None).is_permanent());
        assert!(!s(500, Some(ErrorCode::Internal)).is_permanent());
    }

    #[test]
    fn backoff_grows_to_cap() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(8));
        let d: Vec<Duration> = (0..6).map(|_| b.next_delay()).collect();
        assert!(d[0] <= Duration::from_millis(1200) && d[0] >= Duration::from_millis(800));
        assert!(d[5] <= Duration::from_secs(8) && d[5] >= Duration::from_millis(6400));
    }
}
