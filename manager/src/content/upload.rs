//! Staged upload: `PUT /v1/staged/<namespace>/<name>` over HTTPS writes the
//! body into `<store>/<namespace>/.staged/<name>` and answers its sha256,
//! which becomes the ImageImport's checksum (`staged://<name>` names it).
//!
//! - **Authentication**: a Kubernetes bearer token, checked with a
//!   TokenReview; **authorisation**: a SubjectAccessReview for `create
//!   imageimports.anneal.dev` in that namespace. No token or a rejected one:
//!   401; not allowed: 403. The token is never logged.
//! - **Never overwrites**: the body streams into a temporary file beside the
//!   target, hashed as it arrives, and is linked into place only if the name
//!   is free (409 otherwise); a broken upload leaves nothing.
//! - **Bounded**: at most `max_bytes` per upload (413 past it), 16 uploads at
//!   once (503 past it), 30 s to send the request head, 60 s without a body
//!   frame ends it.
//! - **Counted** against the namespace's store quota (docs/images.md, "Store
//!   quota") from its first byte until an import consumes it or it is
//!   removed: refused (413, naming the namespace, the quota, what is used
//!   and the fix) before any byte is written when its Content-Length does
//!   not fit, and ended (413, the partial file removed) when the bytes
//!   received pass what was left.
//! - TLS from the agent API's CA (Secret `anneal-agent-api-ca`), so one CA
//!   covers the manager's HTTPS endpoints.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use serde_json::json;
use sha2::Digest as _;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// Settings of the upload endpoint.
#[derive(Clone, Debug)]
pub struct UploadConfig {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The content store.
    pub store: PathBuf,
    /// Largest upload.
    pub max_bytes: u64,
    /// Namespace of the CA Secret.
    pub pki_namespace: String,
    /// Names of the serving certificate.
    pub server_names: Vec<String>,
}

/// Errors starting the endpoint.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The CA could not be loaded.
    #[error("loading the CA for the upload endpoint")]
    Ca(#[source] crate::agentapi::ca::CaError),
    /// TLS could not be set up.
    #[error("setting up TLS for the upload endpoint")]
    Tls,
    /// The address could not be bound.
    #[error("binding the upload endpoint to {addr} (pick another with --upload-listen)")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

type Resp = Response<Full<Bytes>>;

fn reply(status: StatusCode, body: serde_json::Value) -> Resp {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn error(status: StatusCode, message: impl Into<String>) -> Resp {
    reply(status, json!({"error": message.into()}))
}

/// A DNS-1123 subdomain (what Kubernetes names are).
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
        && !s.contains("..")
}

struct Server {
    client: kube::Client,
    cfg: UploadConfig,
    quota: super::quota::StoreQuota,
    slots: Semaphore,
}

/// Binds and serves until `cancel`; returns the bound address.
pub async fn start(
    client: kube::Client,
    cfg: UploadConfig,
    quota: super::quota::StoreQuota,
    cancel: CancellationToken,
) -> Result<SocketAddr, UploadError> {
    let pki =
        crate::agentapi::ca::load_or_create(client.clone(), &cfg.pki_namespace, &cfg.server_names)
            .await
            .map_err(UploadError::Ca)?;
    let tls = pki.server_tls().ok_or(UploadError::Tls)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| UploadError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| UploadError::Bind {
        addr: cfg.listen,
        source,
    })?;
    tracing::info!(%addr, "staged upload endpoint listening (https)");
    let server = Arc::new(Server {
        client,
        cfg,
        quota,
        slots: Semaphore::new(16),
    });
    tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let (tcp, peer) = tokio::select! {
                _ = cancel.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(_) => continue,
                },
            };
            let (server, acceptor, cancel) = (server.clone(), acceptor.clone(), cancel.clone());
            conns.spawn(async move {
                let Ok(Ok(tls)) =
                    tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await
                else {
                    return;
                };
                let svc = hyper::service::service_fn(move |req| {
                    let server = server.clone();
                    async move { Ok::<_, Infallible>(server.handle(peer, req).await) }
                });
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                builder
                    .http1()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(30));
                let conn = builder.serve_connection(TokioIo::new(tls), svc);
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = conn => {}
                }
            });
            while conns.try_join_next().is_some() {}
        }
        conns.abort_all();
    });
    Ok(addr)
}

impl Server {
    async fn handle(&self, peer: SocketAddr, req: Request<Incoming>) -> Resp {
        let path = req.uri().path().to_string();
        let resp = self.route(req).await;
        tracing::info!(%peer, %path, status = resp.status().as_u16(), "staged upload request");
        resp
    }

    async fn route(&self, req: Request<Incoming>) -> Resp {
        let path = req.uri().path().to_string();
        let Some(rest) = path.strip_prefix("/v1/staged/") else {
            return error(
                StatusCode::NOT_FOUND,
                "no such path; PUT /v1/staged/<namespace>/<name>",
            );
        };
        let Some((ns, name)) = rest.split_once('/') else {
            return error(StatusCode::NOT_FOUND, "PUT /v1/staged/<namespace>/<name>");
        };
        if !valid_name(ns) || !valid_name(name) || ns.len() > 63 {
            return error(
                StatusCode::BAD_REQUEST,
                "namespace and name must be DNS-1123 names (lowercase letters, digits, '-', '.')",
            );
        }
        if req.method() != Method::PUT {
            return error(StatusCode::METHOD_NOT_ALLOWED, "only PUT");
        }
        let token = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|v| v.trim().to_string());
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            return error(
                StatusCode::UNAUTHORIZED,
                "a Kubernetes bearer token is required",
            );
        };
        match self.authorize(&token, ns).await {
            Ok(true) => {}
            Ok(false) => {
                return error(
                    StatusCode::FORBIDDEN,
                    format!("not allowed to create imageimports.anneal.dev in namespace {ns}"),
                );
            }
            Err(status) => return error(status, "the token was not accepted"),
        }
        let length = req
            .headers()
            .get(hyper::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(len) = length
            && len > self.cfg.max_bytes
        {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "{len} bytes is more than the limit of {} bytes",
                    self.cfg.max_bytes
                ),
            );
        }
        let Ok(_slot) = self.slots.try_acquire() else {
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many uploads at once; retry later",
            );
        };
        let left = match self.quota_left(ns, length).await {
            Ok(left) => left,
            Err(resp) => return resp,
        };
        self.store(ns, name, left, req.into_body()).await
    }

    /// What the namespace may still stage (`None`: unlimited), or the
    /// refusal when `length` (the Content-Length) does not fit.
    async fn quota_left(&self, ns: &str, length: Option<u64>) -> Result<Option<u64>, Resp> {
        use super::quota;
        let Some(limit) = self.quota.limit(ns) else {
            return Ok(None);
        };
        let used = quota::namespace_usage(&self.client, Some(&self.cfg.store), ns, None)
            .await
            .map_err(|_| {
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the namespace's store usage cannot be read from the API server; retry later",
                )
            })?;
        quota::admit(&self.quota, ns, used, length.unwrap_or(0))
            .map_err(|r| error(StatusCode::PAYLOAD_TOO_LARGE, r.to_string()))?;
        Ok(Some(limit.saturating_sub(used.total())))
    }

    /// `Ok(allowed)`, or the status to answer when the token is not valid.
    async fn authorize(&self, token: &str, ns: &str) -> Result<bool, StatusCode> {
        let reviews: Api<TokenReview> = Api::all(self.client.clone());
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                ..TokenReviewSpec::default()
            },
            ..TokenReview::default()
        };
        let done = reviews
            .create(&PostParams::default(), &review)
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        let status = done.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(StatusCode::UNAUTHORIZED);
        }
        let user = status.user.unwrap_or_default();
        let sars: Api<SubjectAccessReview> = Api::all(self.client.clone());
        let sar = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: user.username,
                groups: user.groups,
                uid: user.uid,
                extra: user.extra,
                resource_attributes: Some(ResourceAttributes {
                    group: Some("anneal.dev".into()),
                    resource: Some("imageimports".into()),
                    verb: Some("create".into()),
                    namespace: Some(ns.to_string()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let done = sars
            .create(&PostParams::default(), &sar)
            .await
            .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
        Ok(done.status.is_some_and(|s| s.allowed))
    }

    async fn store(&self, ns: &str, name: &str, left: Option<u64>, mut body: Incoming) -> Resp {
        let dir = self.cfg.store.join(ns).join(".staged");
        let target = dir.join(name);
        if tokio::fs::create_dir_all(&dir).await.is_err() {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the content store is not writable",
            );
        }
        if target.exists() {
            return error(
                StatusCode::CONFLICT,
                format!(
                    "staged://{name} already exists in namespace {ns}; upload under another name"
                ),
            );
        }
        let tmp = dir.join(format!(".{name}.part-{:016x}", rand::random::<u64>()));
        let result = self.receive(ns, &tmp, left, &mut body).await;
        let (sha, bytes) = match result {
            Ok(x) => x,
            Err(resp) => {
                let _ = tokio::fs::remove_file(&tmp).await;
                return resp;
            }
        };
        // Link into place only if the name is still free (never overwrite).
        let linked = tokio::fs::hard_link(&tmp, &target).await;
        let _ = tokio::fs::remove_file(&tmp).await;
        match linked {
            Ok(()) => reply(
                StatusCode::CREATED,
                json!({
                    "name": name, "namespace": ns, "bytes": bytes, "sha256": sha,
                    "url": format!("staged://{name}"), "checksum": format!("sha256:{sha}"),
                }),
            ),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => error(
                StatusCode::CONFLICT,
                format!(
                    "staged://{name} already exists in namespace {ns}; upload under another name"
                ),
            ),
            Err(_) => error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the content store is not writable",
            ),
        }
    }

    /// Streams the body into `tmp`, at most `max_bytes` and at most `left`
    /// (the namespace's quota); the caller removes `tmp` on an error.
    async fn receive(
        &self,
        ns: &str,
        tmp: &Path,
        left: Option<u64>,
        body: &mut Incoming,
    ) -> Result<(String, u64), Resp> {
        let mut file = tokio::fs::File::create(tmp).await.map_err(|_| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the content store is not writable",
            )
        })?;
        let mut hasher = sha2::Sha256::new();
        let mut bytes = 0u64;
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(60), body.frame())
                .await
                .map_err(|_| error(StatusCode::REQUEST_TIMEOUT, "no data for 60 s"))?;
            let Some(frame) = frame else { break };
            let frame =
                frame.map_err(|_| error(StatusCode::BAD_REQUEST, "the upload broke off"))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            bytes += data.len() as u64;
            if bytes > self.cfg.max_bytes {
                return Err(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("more than the limit of {} bytes", self.cfg.max_bytes),
                ));
            }
            if let Some(left) = left
                && bytes > left
            {
                return Err(self.over_quota(ns, tmp, bytes).await);
            }
            hasher.update(&data);
            file.write_all(&data).await.map_err(|_| {
                error(
                    StatusCode::INSUFFICIENT_STORAGE,
                    "the content store is full",
                )
            })?;
        }
        file.sync_all().await.map_err(|_| {
            error(
                StatusCode::INSUFFICIENT_STORAGE,
                "the content store is full",
            )
        })?;
        Ok((hex::encode(hasher.finalize()), bytes))
    }
}

impl Server {
    /// The 413 of an upload whose bytes passed the namespace's quota while
    /// streaming (the usage read again, this upload's partial file `tmp`
    /// counted as what was asked for).
    async fn over_quota(&self, ns: &str, tmp: &Path, received: u64) -> Resp {
        use super::quota;
        let partial = tmp.file_name().map(|n| n.to_string_lossy().into_owned());
        let store = Some(self.cfg.store.as_path());
        let refusal =
            match quota::namespace_usage(&self.client, store, ns, partial.as_deref()).await {
                Ok(used) => quota::admit(&self.quota, ns, used, received).err(),
                Err(_) => None,
            };
        let message = match refusal {
            Some(r) => format!("ended after {received} bytes: {r}"),
            None => format!(
                "ended after {received} bytes: namespace {ns} has no room left in its content store quota; {}",
                quota::fix(ns)
            ),
        };
        error(StatusCode::PAYLOAD_TOO_LARGE, message)
    }
}

#[cfg(test)]
mod tests {
    use super::valid_name;

    #[test]
    fn names_are_dns_1123() {
        assert!(valid_name("debian-12.raw"));
        assert!(!valid_name(".hidden"));
        assert!(!valid_name("a..b"));
        assert!(!valid_name("Upper"));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(""));
    }
}
