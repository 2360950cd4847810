//! HTTP: per-machine iPXE scripts, kernel and initramfs (with Range), the
//! first-stage files for UEFI HTTP boot, and `/metrics`.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;

use anneal_api::error_chain;
use anneal_dhcp::Mac;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, RANGE};
use hyper::{Method, Request, Response, StatusCode};
use tokio_util::sync::CancellationToken;

use crate::metrics::HttpLabels;
use crate::script;
use crate::state::Shared;

type Resp = Response<Full<Bytes>>;

fn respond(code: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Resp {
    let mut r = Response::new(Full::new(body.into()));
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

async fn serve_file(path: &Path, req: &Request<Incoming>) -> Resp {
    let data = match tokio::fs::read(path).await {
        Ok(d) => Bytes::from(d),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %error_chain(&e), "artifact unreadable");
            return respond(StatusCode::NOT_FOUND, "text/plain", "not found\n");
        }
    };
    let len = data.len() as u64;
    let range = req.headers().get(RANGE).and_then(|v| v.to_str().ok());
    let mut r = match parse_range(range, len) {
        Ok(None) => respond(StatusCode::OK, "application/octet-stream", data),
        Ok(Some((s, e))) => {
            let mut r = respond(
                StatusCode::PARTIAL_CONTENT,
                "application/octet-stream",
                data.slice(s as usize..=e as usize),
            );
            if let Ok(v) = format!("bytes {s}-{e}/{len}").parse() {
                r.headers_mut().insert(CONTENT_RANGE, v);
            }
            r
        }
        Err(Unsatisfiable) => {
            let mut r = respond(StatusCode::RANGE_NOT_SATISFIABLE, "text/plain", "");
            if let Ok(v) = format!("bytes */{len}").parse() {
                r.headers_mut().insert(CONTENT_RANGE, v);
            }
            r
        }
    };
    if let Ok(v) = "bytes".parse() {
        r.headers_mut().insert("accept-ranges", v);
    }
    r
}

fn script_response(shared: &Shared, mac_str: &str) -> (Resp, &'static str) {
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
    match script::boot_script(&shared.template, &snap, mac, m) {
        Ok(s) => {
            tracing::info!(%mac, machine = %m.name, "served boot script");
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

async fn route(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Resp, Infallible> {
    let path = req.uri().path().to_owned();
    let (resp, kind) = if req.method() != Method::GET && req.method() != Method::HEAD {
        (
            respond(StatusCode::METHOD_NOT_ALLOWED, "text/plain", ""),
            "other",
        )
    } else if let Some(mac) = path.strip_prefix("/ipxe/") {
        script_response(&shared, mac)
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
    } else if path == "/boot/kernel" || path == "/boot/initrd" {
        let snap = shared.snapshot();
        match &snap.artifacts {
            Some(a) => {
                let (p, k) = if path.ends_with("kernel") {
                    (&a.kernel, "kernel")
                } else {
                    (&a.initrd, "initrd")
                };
                (serve_file(p, &req).await, k)
            }
            None => (
                respond(StatusCode::NOT_FOUND, "text/plain", "no artifacts\n"),
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
        let mut r = Response::from_parts(parts, Full::new(Bytes::new()));
        if let Ok(v) = len.to_string().parse() {
            r.headers_mut().insert(CONTENT_LENGTH, v);
        }
        r
    } else {
        resp
    };
    Ok(resp)
}

/// Accepts connections until cancelled.
pub async fn serve(
    shared: Arc<Shared>,
    listener: tokio::net::TcpListener,
    cancel: CancellationToken,
) {
    loop {
        let (stream, peer) = tokio::select! {
            () = cancel.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %error_chain(&e), "http accept failed");
                    continue;
                }
            },
        };
        let shared = shared.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(stream);
            let svc = hyper::service::service_fn(move |req| route(shared.clone(), req));
            let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, svc);
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!(%peer, error = %error_chain(&e), "http connection ended");
                },
                () = cancel.cancelled() => {}
            }
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
