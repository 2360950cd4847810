//! One-shot HTTP/1.1 requests over TCP or TLS (rustls with ring), one
//! connection per request: BMCs keep few connections and drop idle ones, so
//! a pool buys nothing and hides which step failed.

use std::sync::Arc;
use std::time::Duration;

use base64::prelude::{BASE64_STANDARD, Engine as _};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST, USER_AGENT};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;

/// The `User-Agent` of every BMC request: `anneal-manager/<version>`, plus
/// ` (<identity>)` once [`set_identity`] ran, so a BMC's access log shows
/// which manager replica called it.
static USER_AGENT_VALUE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn user_agent() -> &'static str {
    USER_AGENT_VALUE.get_or_init(|| format!("anneal-manager/{}", env!("CARGO_PKG_VERSION")))
}

/// Names this process (the manager replica's identity) in the `User-Agent`
/// of its BMC requests. Only the first call counts; call it before the
/// first request.
pub fn set_identity(identity: &str) {
    let _ = USER_AGENT_VALUE.set(format!(
        "anneal-manager/{} ({identity})",
        env!("CARGO_PKG_VERSION")
    ));
}

/// The largest response body read from a BMC.
pub const MAX_RESPONSE_BYTES: usize = 4 << 20;

/// Where and how to connect.
#[derive(Clone)]
pub struct Endpoint {
    /// Host name or address (no brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// TLS configuration; `None` is plain HTTP.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Limit for connect, handshake and the whole exchange, each.
    pub timeout: Duration,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls.is_some())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Why an exchange failed, by the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// TCP connect failed (refused, unreachable, DNS).
    #[error("cannot connect to {addr}")]
    Connect {
        /// host:port
        addr: String,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// A step took longer than the timeout.
    #[error("timed out during {step}")]
    Timeout {
        /// connect, tls handshake, exchange
        step: &'static str,
    },
    /// The TLS handshake failed (certificate, protocol).
    #[error("tls handshake with {addr} failed")]
    Tls {
        /// host:port
        addr: String,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// The host name is not valid for TLS.
    #[error("invalid tls server name {0:?}")]
    ServerName(String),
    /// The HTTP exchange failed.
    #[error("http exchange failed")]
    Http(#[source] hyper::Error),
    /// The request could not be built.
    #[error("cannot build request")]
    Request(#[source] hyper::http::Error),
    /// The response body was too large or broken.
    #[error("cannot read response body")]
    Body,
}

/// A response: status and body.
#[derive(Debug)]
pub struct Response {
    /// HTTP status.
    pub status: StatusCode,
    /// Body (at most [`MAX_RESPONSE_BYTES`]).
    pub body: Bytes,
}

/// Sends one request and reads the whole response.
pub async fn exchange(
    ep: &Endpoint,
    method: Method,
    path: &str,
    authorization: Option<&str>,
    json: Option<Vec<u8>>,
) -> Result<Response, TransportError> {
    exchange_with(ep, method, path, authorization, &[], json).await
}

/// [`exchange`] with extra request headers.
pub async fn exchange_with(
    ep: &Endpoint,
    method: Method,
    path: &str,
    authorization: Option<&str>,
    headers: &[(&str, &str)],
    json: Option<Vec<u8>>,
) -> Result<Response, TransportError> {
    let addr = if ep.host.contains(':') {
        format!("[{}]:{}", ep.host, ep.port)
    } else {
        format!("{}:{}", ep.host, ep.port)
    };
    let tcp = tokio::time::timeout(ep.timeout, TcpStream::connect(&addr))
        .await
        .map_err(|_| TransportError::Timeout { step: "connect" })?
        .map_err(|source| TransportError::Connect {
            addr: addr.clone(),
            source,
        })?;
    let _ = tcp.set_nodelay(true);
    let mut builder = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, addr.as_str())
        .header(USER_AGENT, user_agent())
        .header(ACCEPT, "application/json");
    if let Some(auth) = authorization {
        builder = builder.header(AUTHORIZATION, auth);
    }
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let body = match json {
        Some(b) => {
            builder = builder.header(CONTENT_TYPE, "application/json");
            Full::new(Bytes::from(b))
        }
        None => Full::new(Bytes::new()),
    };
    let req = builder.body(body).map_err(TransportError::Request)?;
    match &ep.tls {
        None => send(TokioIo::new(tcp), req, ep.timeout).await,
        Some(cfg) => {
            let name = ServerName::try_from(ep.host.clone())
                .map_err(|_| TransportError::ServerName(ep.host.clone()))?;
            let connector = tokio_rustls::TlsConnector::from(cfg.clone());
            let tls = tokio::time::timeout(ep.timeout, connector.connect(name, tcp))
                .await
                .map_err(|_| TransportError::Timeout {
                    step: "tls handshake",
                })?
                .map_err(|source| TransportError::Tls { addr, source })?;
            send(TokioIo::new(tls), req, ep.timeout).await
        }
    }
}

async fn send<IO>(
    io: TokioIo<IO>,
    req: Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<Response, TransportError>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let work = async move {
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(TransportError::Http)?;
        let driver = tokio::spawn(async move {
            let _ = conn.await;
        });
        let resp = sender
            .send_request(req)
            .await
            .map_err(TransportError::Http)?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|_| TransportError::Body)?
            .to_bytes();
        driver.abort();
        Ok(Response { status, body })
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| TransportError::Timeout { step: "exchange" })?
}

/// The value of an HTTP Basic `Authorization` header (RFC 7617): `Basic `
/// and the standard base64 (RFC 4648, padded) of `username:password`.
pub fn basic_authorization(username: &str, password: &str) -> String {
    format!(
        "Basic {}",
        BASE64_STANDARD.encode(format!("{username}:{password}"))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_authorization_is_rfc4648_base64() {
        // Standard alphabet, padded (RFC 4648): two, one and no `=`.
        for (user, password, encoded) in [
            ("", "", "Og=="),
            ("f", "", "Zjo="),
            ("fo", "o", "Zm86bw=="),
            ("foo", "bar", "Zm9vOmJhcg=="),
            ("admin", "password", "YWRtaW46cGFzc3dvcmQ="),
        ] {
            assert_eq!(
                basic_authorization(user, password),
                format!("Basic {encoded}"),
                "{user}:{password}"
            );
        }
    }
}
