//! The agent API (docs/api.md, agent protocol): HTTPS only (rustls, ring),
//! `Anneal-Agent-Schema: 1` on every request (a mismatch answers 426),
//! bounded JSON bodies that deny unknown fields.
//!
//! - `POST /v1/agent/register`: the boot token is hashed and compared in
//!   constant time with `status.netBoot.tokenHash`; it must not have
//!   expired; it is single use (the hash is removed from status in the same
//!   write that records the session, with the resourceVersion read as a
//!   precondition, and the Secret holding it is deleted). Answers a session
//!   token whose hash lives in `status.agent.sessionTokenHash`, so it is
//!   bound to the machine and to this boot (arming a new boot drops it).
//!   The same request (token, MAC, version, machine) from the same address
//!   within [`REGISTER_REPLAY_WINDOW`], before the session was used (the
//!   answer was lost), gets the same session while it is still the
//!   Machine's; registrations with one token run one at a time; a status
//!   that keeps changing under the write answers 503, never `usedToken`.
//! - `PUT /v1/agent/hardware`: writes the MachineHardware (same name, owned
//!   by the Machine) by server-side apply, only while Inspecting (in other
//!   states the report is acknowledged with 204 and not written).
//! - `GET /v1/agent/next`: long-poll: `poweroff` once the machine is idle
//!   (Available, Released, Parked), otherwise `wait`.
//!
//! Everything the API needs is in the API server (hashes in status, the CA
//! in its Secret), so a manager restart loses nothing. A watch of Machines
//! keeps an in-memory index (boot token hash and session hash → Machine):
//! a request looks its Machine up there and then reads that one Machine
//! live (the live object decides, compared in constant time), so no request
//! lists Machines.
//!
//! Bounded ([`AgentApiLimits`]): HTTP/1.1 only (ALPN `http/1.1`), a
//! connection cap (more wait in the backlog), the TLS handshake and each
//! request head within a header deadline, the body within a body deadline
//! (408), bodies capped at `MAX_BODY_BYTES` (413), a token bucket per source
//! address (429 with Retry-After), and a pause after accept errors such as
//! EMFILE.

pub mod ca;
pub mod runs;

use anneal_api::conditions::{reasons, types};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anneal_api::agent::{
    self, ErrorCode, ErrorResponse, HardwareReport, MachineIdentity, NextAction, RegisterRequest,
    RegisterResponse, Token,
};
use anneal_api::{
    FirmwareMode, HardwareCpu, HardwareDisk, HardwareFirmware, HardwareNic, HardwareSystem,
    Machine, MachineHardware, MachineHardwareSpec, MachineState, NicLldp,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::controller::{Index, Indexed};
use crate::lifecycle::status::{mint_token, time_in, token_hash};

pub use ca::AgentPki;

/// Annotation on MachineHardware: the session hash of the report.
pub const SESSION_ANNOTATION: &str = "anneal.dev/agent-session";
/// The field manager of the agent API's writes.
pub const FIELD_MANAGER: &str = "anneal-agent-api";

/// Errors starting the agent API.
#[derive(Debug, thiserror::Error)]
pub enum AgentApiError {
    /// The CA cannot be loaded or created.
    #[error("agent api ca")]
    Ca(#[from] ca::CaError),
    /// The serving configuration is invalid.
    #[error("invalid serving certificate")]
    Tls,
    /// The listener cannot bind.
    #[error("cannot listen on {addr}")]
    Bind {
        /// address
        addr: SocketAddr,
        /// cause
        #[source]
        source: std::io::Error,
    },
}

/// Tunables of the agent API.
#[derive(Debug, Clone)]
pub struct AgentApiConfig {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The manager's namespace (holds the CA Secret).
    pub namespace: String,
    /// DNS names and IP addresses of the serving certificate.
    pub server_names: Vec<String>,
    /// Session token lifetime without use: a request authenticated with a
    /// session at least [`session_renew_after`](Self::session_renew_after)
    /// after its last renewal moves its expiry to now + this (a deploy that
    /// reports progress never outlives its session; an unused one expires).
    pub session_ttl: Duration,
    /// How long after its last renewal a used session is renewed again (one
    /// status write per agent per this period at most).
    pub session_renew_after: Duration,
    /// Longest hold of `GET /v1/agent/next`.
    pub long_poll: Duration,
    /// Fast-track: an Available machine's agent is kept running (`next`
    /// answers `wait`) this long after its registration, so a claim bound
    /// meanwhile deploys without a new boot; None: off (`poweroff`).
    pub fast_track_window: Option<Duration>,
}

impl Default for AgentApiConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8443)),
            namespace: "anneal-system".into(),
            server_names: vec!["localhost".into(), "127.0.0.1".into()],
            session_ttl: Duration::from_secs(3600),
            session_renew_after: Duration::from_secs(300),
            long_poll: Duration::from_secs(25),
            fast_track_window: None,
        }
    }
}

/// Bounds of the agent API server (see [`start_with_limits`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgentApiLimits {
    /// Connections served at once; more wait in the listen backlog until
    /// one ends.
    pub max_connections: usize,
    /// The TLS handshake and each request head (also the wait for the next
    /// request on a kept-alive connection) must complete within this long.
    pub header_timeout: Duration,
    /// A request body must arrive within this long after its head (then
    /// 408 and the connection is closed).
    pub body_timeout: Duration,
    /// Requests per second one source address may make, on average...
    pub rate_per_sec: f64,
    /// ...and at once (the bucket size); over it: 429 with Retry-After.
    pub rate_burst: f64,
}

/// Default [`AgentApiLimits::max_connections`].
pub const MAX_CONNECTIONS: usize = 512;
/// Default [`AgentApiLimits::header_timeout`].
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`AgentApiLimits::body_timeout`].
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the accept loop pauses after an accept error that says a
/// resource ran out (EMFILE, ENFILE, ENOBUFS, ENOMEM), instead of spinning.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How long a registration's answer is kept: the same request (boot token,
/// boot MAC, agent version, machine) from the same address sent again within
/// this window, before the session was used (the answer was lost), gets the
/// same session.
pub const REGISTER_REPLAY_WINDOW: Duration = Duration::from_secs(60);
/// Source addresses the rate limiter remembers at most (the oldest are
/// forgotten first).
const RATE_TABLE_MAX: usize = 65_536;

impl Default for AgentApiLimits {
    fn default() -> Self {
        Self {
            max_connections: MAX_CONNECTIONS,
            header_timeout: HEADER_TIMEOUT,
            body_timeout: BODY_TIMEOUT,
            rate_per_sec: 20.0,
            rate_burst: 60.0,
        }
    }
}

/// A token bucket per source address.
#[derive(Debug, Default)]
struct RateLimiter {
    buckets: HashMap<std::net::IpAddr, (f64, tokio::time::Instant)>,
}

impl RateLimiter {
    /// Takes one request from `ip`'s bucket; `Err(seconds to wait)` when empty.
    fn take(
        &mut self,
        ip: std::net::IpAddr,
        limits: &AgentApiLimits,
        now: tokio::time::Instant,
    ) -> Result<(), u64> {
        if self.buckets.len() >= RATE_TABLE_MAX && !self.buckets.contains_key(&ip) {
            // forget the buckets that are full again (idle sources), else the oldest
            let full = limits.rate_burst;
            let rate = limits.rate_per_sec;
            self.buckets.retain(|_, (tokens, at)| {
                *tokens + now.saturating_duration_since(*at).as_secs_f64() * rate < full
            });
            if self.buckets.len() >= RATE_TABLE_MAX
                && let Some(oldest) = self
                    .buckets
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| *k)
            {
                self.buckets.remove(&oldest);
            }
        }
        let (tokens, at) = self.buckets.entry(ip).or_insert((limits.rate_burst, now));
        *tokens = (*tokens
            + now.saturating_duration_since(*at).as_secs_f64() * limits.rate_per_sec)
            .min(limits.rate_burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            let wait = (1.0 - *tokens) / limits.rate_per_sec.max(f64::MIN_POSITIVE);
            Err(wait.ceil().clamp(1.0, 3600.0) as u64)
        }
    }
}

/// A registration answered lately, kept for [`REGISTER_REPLAY_WINDOW`].
#[derive(Debug)]
struct Registered {
    at: tokio::time::Instant,
    /// What the request said and where it came from: a replay repeats it.
    peer: std::net::IpAddr,
    boot_mac: String,
    agent_version: String,
    hint: Option<String>,
    session: Token,
    session_hash: String,
    namespace: String,
    name: String,
}

/// A running agent API.
#[derive(Debug)]
pub struct RunningAgentApi {
    addr: SocketAddr,
    pki: AgentPki,
    task: tokio::task::JoinHandle<()>,
}

impl RunningAgentApi {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The CA and its fingerprint.
    pub fn pki(&self) -> &AgentPki {
        &self.pki
    }

    /// Waits for the server task (ends on cancel).
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

struct Server {
    client: kube::Client,
    cfg: AgentApiConfig,
    /// session hash → (namespace, name); a cache, the status is the truth.
    sessions: Mutex<HashMap<String, (String, String)>>,
    /// Boot token and session hashes of every Machine, from a watch.
    index: Arc<Indexed<HashIndex>>,
    /// (the index holds a complete list, watch events applied so far).
    index_ready: tokio::sync::watch::Receiver<(bool, u64)>,
    limits: AgentApiLimits,
    rate: Mutex<RateLimiter>,
    /// Boot token hash → the registration it made, for replays.
    registered: Mutex<HashMap<String, Registered>>,
    /// Boot token hash → the lock one registration at a time holds.
    inflight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// How long a request waits for the Machine index's first list.
const INDEX_WAIT: Duration = Duration::from_secs(30);
/// How long a lookup that misses waits for the watch to catch up (a token
/// minted a moment ago); an unknown token is refused after this long.
const INDEX_LAG: Duration = Duration::from_secs(2);

/// Boot token hash and session hash → (namespace, name).
#[derive(Debug, Default)]
pub struct HashIndex {
    boot: HashMap<String, (String, String)>,
    session: HashMap<String, (String, String)>,
    entries: HashMap<(String, String), (Option<String>, Option<String>)>,
}

impl HashIndex {
    fn forget(&mut self, key: &(String, String)) {
        if let Some((boot, session)) = self.entries.remove(key) {
            if let Some(b) = boot
                && self.boot.get(&b) == Some(key)
            {
                self.boot.remove(&b);
            }
            if let Some(h) = session
                && self.session.get(&h) == Some(key)
            {
                self.session.remove(&h);
            }
        }
    }
}

impl Index<Machine> for HashIndex {
    fn upsert(&mut self, m: &Machine) {
        let key = (m.namespace().unwrap_or_default(), m.name_any());
        self.forget(&key);
        let st = m.status.as_ref();
        let boot = st
            .and_then(|s| s.net_boot.as_ref())
            .and_then(|n| n.token_hash.clone());
        let session = st
            .and_then(|s| s.agent.as_ref())
            .and_then(|a| a.session_token_hash.clone());
        if let Some(b) = &boot {
            self.boot.insert(b.clone(), key.clone());
        }
        if let Some(h) = &session {
            self.session.insert(h.clone(), key.clone());
        }
        self.entries.insert(key, (boot, session));
    }

    fn remove(&mut self, m: &Machine) {
        self.forget(&(m.namespace().unwrap_or_default(), m.name_any()));
    }
}

/// Keeps `index` in step with every Machine until `cancel`; flips `ready`
/// after the first complete list.
async fn feed_index(
    client: kube::Client,
    index: Arc<Indexed<HashIndex>>,
    ready: tokio::sync::watch::Sender<(bool, u64)>,
    cancel: CancellationToken,
) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let stream = watcher(Api::<Machine>::all(client), watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    loop {
        let ev = tokio::select! {
            () = cancel.cancelled() => return,
            ev = stream.next() => ev,
        };
        match ev {
            Some(Ok(ev)) => {
                index.apply(&ev);
                let done = matches!(ev, watcher::Event::InitDone);
                ready.send_modify(|(listed, n)| {
                    *listed |= done;
                    *n += 1;
                });
            }
            Some(Err(e)) => tracing::warn!(error = %e, "agent api: machine watch failed; retrying"),
            None => return,
        }
    }
}

/// Loads (or creates) the CA, binds and serves until `cancel`, with the
/// default [`AgentApiLimits`].
pub async fn start(
    client: kube::Client,
    cfg: AgentApiConfig,
    cancel: CancellationToken,
) -> Result<RunningAgentApi, AgentApiError> {
    start_with_limits(client, cfg, AgentApiLimits::default(), cancel).await
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

/// [`start`] with explicit bounds: HTTP/1.1 only (ALPN `http/1.1`), at most
/// `limits.max_connections` connections at once, the TLS handshake and
/// every request head within `limits.header_timeout`, a body within
/// `limits.body_timeout`, a rate limit per source address, and a pause
/// after accept errors such as EMFILE.
pub async fn start_with_limits(
    client: kube::Client,
    cfg: AgentApiConfig,
    limits: AgentApiLimits,
    cancel: CancellationToken,
) -> Result<RunningAgentApi, AgentApiError> {
    let pki = ca::load_or_create(client.clone(), &cfg.namespace, &cfg.server_names).await?;
    let tls = pki.server_tls().ok_or(AgentApiError::Tls)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| AgentApiError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|source| AgentApiError::Bind {
            addr: cfg.listen,
            source,
        })?;
    tracing::info!(%addr, ca_sha256 = %pki.ca_sha256, "agent api listening (https)");
    let index: Arc<Indexed<HashIndex>> = Arc::default();
    let (ready_tx, index_ready) = tokio::sync::watch::channel((false, 0));
    tokio::spawn(feed_index(
        client.clone(),
        index.clone(),
        ready_tx,
        cancel.clone(),
    ));
    let server = Arc::new(Server {
        client,
        cfg,
        sessions: Mutex::new(HashMap::new()),
        index,
        index_ready,
        limits,
        rate: Mutex::default(),
        registered: Mutex::default(),
        inflight: Mutex::default(),
    });
    let task = tokio::spawn(async move {
        let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let slot = tokio::select! {
                _ = cancel.cancelled() => break,
                s = slots.clone().acquire_owned() => match s {
                    Ok(s) => s,
                    Err(_) => break,
                },
            };
            let (tcp, peer) = tokio::select! {
                _ = cancel.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) if resource_exhausted(&e) => {
                        tracing::warn!(error = %e, backoff_ms = ACCEPT_BACKOFF.as_millis() as u64, "agent api accept failed: out of a resource; pausing accepts");
                        tokio::select! {
                            _ = cancel.cancelled() => break,
                            () = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                        }
                        continue;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "agent api accept failed");
                        continue;
                    }
                },
            };
            let server = server.clone();
            let acceptor = acceptor.clone();
            let cancel = cancel.clone();
            conns.spawn(async move {
                let _slot = slot;
                let tls = match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp))
                    .await
                {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        tracing::info!(%peer, error = %e, "agent api: tls handshake refused");
                        return;
                    }
                    Err(_) => {
                        tracing::info!(%peer, "agent api: tls handshake not done within the header deadline; closed");
                        return;
                    }
                };
                let svc = hyper::service::service_fn(move |req| {
                    let server = server.clone();
                    async move { Ok::<_, Infallible>(server.handle(peer, req).await) }
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .max_headers(64)
                    .serve_connection(TokioIo::new(tls), svc);
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    r = conn => match r {
                        Ok(()) => {}
                        Err(e) if e.is_timeout() => {
                            tracing::info!(%peer, deadline_secs = limits.header_timeout.as_secs_f64(), "agent api: no complete request head within the header deadline; closed");
                        }
                        Err(e) => tracing::debug!(%peer, error = %e, "agent connection ended"),
                    },
                }
            });
            while conns.try_join_next().is_some() {}
        }
        conns.abort_all();
    });
    Ok(RunningAgentApi { addr, pki, task })
}

type Resp = Response<Full<Bytes>>;

fn json_reply<T: Serialize>(status: StatusCode, body: &T) -> Resp {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, "application/json")
        .header(agent::SCHEMA_HEADER, agent::SCHEMA_VERSION)
        .body(Full::new(Bytes::from(
            serde_json::to_vec(body).unwrap_or_default(),
        )))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn fail(status: StatusCode, code: ErrorCode, message: &str) -> Resp {
    json_reply(
        status,
        &ErrorResponse {
            code,
            message: message.into(),
        },
    )
}

fn unauthorized(code: ErrorCode) -> Resp {
    fail(
        StatusCode::UNAUTHORIZED,
        code,
        "invalid, expired or used token",
    )
}

fn internal() -> Resp {
    fail(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Internal,
        "try again later",
    )
}

/// A well-formed token is 64 lowercase hex characters (32 bytes).
fn well_formed(t: &Token) -> bool {
    t.len() == 64 && t.expose().bytes().all(|b| b.is_ascii_hexdigit())
}

fn now_ms() -> i64 {
    Timestamp::now().as_millisecond()
}

impl Server {
    async fn handle(&self, peer: SocketAddr, req: Request<Incoming>) -> Resp {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let schema = req
            .headers()
            .get(agent::SCHEMA_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.chars().take(16).collect::<String>());
        let bearer = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|v| Token::new(v.trim()));
        let limited = self.rate.lock().unwrap_or_else(|p| p.into_inner()).take(
            peer.ip(),
            &self.limits,
            tokio::time::Instant::now(),
        );
        if let Err(wait) = limited {
            tracing::debug!(%peer, %path, "agent api: rate limit of the source address exceeded");
            let mut r = fail(
                StatusCode::TOO_MANY_REQUESTS,
                ErrorCode::Internal,
                &format!(
                    "too many requests from {}: at most {} a second (bursts of {}); retry after {wait} s",
                    peer.ip(),
                    self.limits.rate_per_sec,
                    self.limits.rate_burst
                ),
            );
            if let Ok(v) = wait.to_string().parse() {
                r.headers_mut().insert(hyper::header::RETRY_AFTER, v);
            }
            return r;
        }
        let collect = Limited::new(req.into_body(), agent::MAX_BODY_BYTES).collect();
        let body = match tokio::time::timeout(self.limits.body_timeout, collect).await {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(_)) => {
                return fail(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    ErrorCode::BadRequest,
                    &format!("body too large (at most {} bytes)", agent::MAX_BODY_BYTES),
                );
            }
            Err(_) => {
                tracing::info!(%peer, %path, "agent api: request body not received within the body deadline; closing");
                let mut r = fail(
                    StatusCode::REQUEST_TIMEOUT,
                    ErrorCode::BadRequest,
                    &format!(
                        "request body not received within {} s",
                        self.limits.body_timeout.as_secs()
                    ),
                );
                r.headers_mut().insert(
                    hyper::header::CONNECTION,
                    hyper::header::HeaderValue::from_static("close"),
                );
                return r;
            }
        };
        if schema.as_deref() != Some(agent::SCHEMA_VERSION) {
            tracing::info!(%peer, %path, schema = ?schema, "agent api: schema header missing or different");
            self.mark_incompatible(bearer, &body, schema.as_deref())
                .await;
            return fail(
                StatusCode::UPGRADE_REQUIRED,
                ErrorCode::SchemaMismatch,
                "Anneal-Agent-Schema must be 1",
            );
        }
        let resp = match (method, path.as_str()) {
            (Method::POST, agent::paths::REGISTER) => self.register(peer, &body).await,
            (Method::PUT, agent::paths::HARDWARE) => match self.authenticate(bearer).await {
                Ok((m, session)) => self.hardware(&m, &session, &body).await,
                Err(r) => r,
            },
            (Method::GET, agent::paths::NEXT) => {
                let again = bearer.clone();
                match self.authenticate(bearer).await {
                    Ok((m, _)) => self.next(&m).await,
                    Err(r) => self.ended_inspection(again).await.unwrap_or(r),
                }
            }
            (Method::POST, agent::paths::PROGRESS) => match self.authenticate(bearer).await {
                Ok((m, _)) => match runs::progress(&self.client, &m, &body).await {
                    Ok(action) => json_reply(StatusCode::OK, &agent::ProgressResponse { action }),
                    Err(r) => refused(&m, r),
                },
                Err(r) => r,
            },
            (Method::POST, agent::paths::RESULT) => match self.authenticate(bearer).await {
                Ok((m, _)) => match runs::result(&self.client, &m, &body).await {
                    Ok(()) => no_content(),
                    Err(r) => refused(&m, r),
                },
                Err(r) => r,
            },
            _ => fail(StatusCode::NOT_FOUND, ErrorCode::BadRequest, "no such path"),
        };
        tracing::info!(%peer, %path, status = resp.status().as_u16(), "agent api request");
        resp
    }

    /// Finds the machine whose `status.netBoot.tokenHash` is `hash` (only
    /// the hinted one when the agent names its machine).
    async fn machine_by_boot_hash(
        &self,
        hint: Option<&str>,
        hash: &str,
    ) -> Result<Option<Machine>, kube::Error> {
        let matches = |m: &Machine| {
            m.status
                .as_ref()
                .and_then(|s| s.net_boot.as_ref())
                .and_then(|n| n.token_hash.as_deref())
                .is_some_and(|h| agent::ct_eq(h.as_bytes(), hash.as_bytes()))
        };
        // The watch cache first: a hash no Machine is armed with costs the
        // API server nothing, whatever machine the request names.
        let Some((ns, name)) = self.lookup(|i| i.boot.get(hash).cloned()).await else {
            return Ok(None);
        };
        // A named machine is the only candidate: a token minted for
        // another machine is refused even though it is valid there.
        if let Some(h) = hint
            && h.split_once('/') != Some((ns.as_str(), name.as_str()))
        {
            return Ok(None);
        }
        let m = Api::<Machine>::namespaced(self.client.clone(), &ns)
            .get_opt(&name)
            .await?;
        Ok(m.filter(matches))
    }

    /// Looks a Machine up in the hash index, once it holds a full list.
    async fn lookup(
        &self,
        f: impl Fn(&HashIndex) -> Option<(String, String)>,
    ) -> Option<(String, String)> {
        let mut ready = self.index_ready.clone();
        let _ = tokio::time::timeout(INDEX_WAIT, ready.wait_for(|r| r.0)).await;
        let deadline = tokio::time::Instant::now() + INDEX_LAG;
        loop {
            ready.borrow_and_update();
            if let Some(hit) = self.index.read(&f) {
                return Some(hit);
            }
            match tokio::time::timeout_at(deadline, ready.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    async fn register(&self, peer: SocketAddr, body: &[u8]) -> Resp {
        let req: RegisterRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(_) => {
                return fail(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::BadRequest,
                    "invalid register body",
                );
            }
        };
        if !well_formed(&req.boot_token) {
            tracing::info!(%peer, "register refused: malformed boot token");
            return unauthorized(ErrorCode::InvalidToken);
        }
        let hash = token_hash(req.boot_token.expose());
        // One registration per boot token at a time: a concurrent retry
        // waits for the first and then gets its answer (the replay below).
        let gate = self
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(hash.clone())
            .or_default()
            .clone();
        let resp = {
            let _turn = gate.lock().await;
            self.register_once(peer, &req, &hash).await
        };
        let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        // the map's reference and ours: nobody else waits on this token
        if Arc::strong_count(&gate) <= 2 {
            inflight.remove(&hash);
        }
        resp
    }

    /// The answer the same registration (boot token hash `hash`, the same
    /// MAC, version and machine, from the same address) got within
    /// [`REGISTER_REPLAY_WINDOW`], if its session is unused and still the
    /// Machine's.
    async fn replay(&self, hash: &str, peer: SocketAddr, req: &RegisterRequest) -> Option<Resp> {
        let now = tokio::time::Instant::now();
        let hit = {
            let mut reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
            reg.retain(|_, r| now.saturating_duration_since(r.at) < REGISTER_REPLAY_WINDOW);
            let r = reg.get(hash).filter(|r| {
                r.peer == peer.ip()
                    && r.boot_mac == req.boot_mac
                    && r.agent_version == req.agent_version
                    && r.hint == req.machine
            })?;
            (
                r.at,
                r.session.clone(),
                r.session_hash.clone(),
                r.namespace.clone(),
                r.name.clone(),
            )
        };
        let (at, session, session_hash, ns, name) = hit;
        let live = Api::<Machine>::namespaced(self.client.clone(), &ns)
            .get_opt(&name)
            .await
            .ok()
            .flatten();
        let current = live
            .as_ref()
            .and_then(|m| m.status.as_ref())
            .and_then(|s| s.agent.as_ref())
            .and_then(|a| a.session_token_hash.as_deref())
            .is_some_and(|h| agent::ct_eq(h.as_bytes(), session_hash.as_bytes()));
        if !current {
            self.registered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(hash);
            return None;
        }
        let left = self
            .cfg
            .session_ttl
            .saturating_sub(now.saturating_duration_since(at));
        tracing::info!(machine = %name, "register retried with the same boot token within the replay window: same session");
        Some(json_reply(
            StatusCode::OK,
            &RegisterResponse {
                session_token: session,
                expires_in_seconds: left.as_secs(),
                machine: MachineIdentity {
                    namespace: ns,
                    name,
                },
            },
        ))
    }

    async fn register_once(&self, peer: SocketAddr, req: &RegisterRequest, hash: &str) -> Resp {
        if let Some(r) = self.replay(hash, peer, req).await {
            return r;
        }
        let hash = hash.to_string();
        for _ in 0..4 {
            let m = match self
                .machine_by_boot_hash(req.machine.as_deref(), &hash)
                .await
            {
                Ok(Some(m)) => m,
                Ok(None) => {
                    tracing::info!(%peer, "register refused: unknown or used boot token");
                    return unauthorized(ErrorCode::InvalidToken);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "register: cannot read machines");
                    return internal();
                }
            };
            let (ns, name) = (m.namespace().unwrap_or_default(), m.name_any());
            let expires = m
                .status
                .as_ref()
                .and_then(|s| s.net_boot.as_ref())
                .and_then(|n| n.expires_at.as_ref())
                .map_or(0, |t| t.0.as_millisecond());
            if expires <= now_ms() {
                tracing::info!(%peer, machine = %name, "register refused: boot token expired");
                return unauthorized(ErrorCode::ExpiredToken);
            }
            // The token is bound to the machine's boot NIC too: an agent that
            // booted from another MAC is not this machine's (docs/api.md,
            // "Agent protocol").
            if let Some(want) = m.spec.boot_mac_address.as_deref()
                && !same_mac(want, &req.boot_mac)
            {
                let sent: String = req.boot_mac.chars().take(64).collect();
                tracing::info!(%peer, machine = %name, boot_mac = ?sent, spec_boot_mac = %want, "register refused: boot MAC differs from spec.bootMACAddress");
                return fail(
                    StatusCode::FORBIDDEN,
                    ErrorCode::InvalidToken,
                    &format!(
                        "machine {ns}/{name}: the agent booted from MAC {sent:?}, but spec.bootMACAddress is {want}; boot the machine from its enrolled NIC or correct spec.bootMACAddress"
                    ),
                );
            }
            let session = mint_token();
            let session_hash = token_hash(session.expose());
            let ttl = i64::try_from(self.cfg.session_ttl.as_millis()).unwrap_or(i64::MAX);
            let now = Timestamp::now();
            let mut conditions = m
                .status
                .as_ref()
                .map(|s| s.conditions.clone())
                .unwrap_or_default();
            crate::conditions::set(
                &mut conditions,
                types::AGENT_COMPATIBLE,
                true,
                reasons::SCHEMA_MATCHES,
                "the agent speaks Anneal-Agent-Schema 1",
                m.metadata.generation,
            );
            let patch = json!({
                "metadata": {"resourceVersion": m.resource_version()},
                "status": {
                    "conditions": conditions,
                    "netBoot": {"tokenHash": null},
                    "agent": {
                        "sessionTokenHash": session_hash,
                        "expiresAt": time_in(now, ttl),
                        "version": req.agent_version.chars().take(64).collect::<String>(),
                        "lastSeen": time_in(now, 0),
                        "address": peer.ip().to_string(),
                    },
                },
            });
            let api = Api::<Machine>::namespaced(self.client.clone(), &ns);
            let pp = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            match api.patch_status(&name, &pp, &Patch::Merge(&patch)).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => {
                    tracing::warn!(machine = %name, error = %e, "register: cannot write status");
                    return internal();
                }
            }
            if let Err(e) =
                crate::lifecycle::driver::delete_boot_token_secrets(&self.client, &m).await
            {
                tracing::debug!(machine = %name, error = %e, "boot token secret not deleted");
            }
            self.registered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(
                    hash.clone(),
                    Registered {
                        at: tokio::time::Instant::now(),
                        peer: peer.ip(),
                        boot_mac: req.boot_mac.clone(),
                        agent_version: req.agent_version.clone(),
                        hint: req.machine.clone(),
                        session: session.clone(),
                        session_hash: session_hash.clone(),
                        namespace: ns.clone(),
                        name: name.clone(),
                    },
                );
            self.sessions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(session_hash, (ns.clone(), name.clone()));
            tracing::info!(%peer, machine = %name, agent_version = %req.agent_version, "agent registered");
            return json_reply(
                StatusCode::OK,
                &RegisterResponse {
                    session_token: session,
                    expires_in_seconds: self.cfg.session_ttl.as_secs(),
                    machine: MachineIdentity {
                        namespace: ns,
                        name,
                    },
                },
            );
        }
        tracing::warn!(%peer, "register: the machine's status kept changing under four attempts; answered 503");
        internal()
    }

    /// Sets `AgentCompatible=False` on the machine a refused request speaks
    /// for, when it can be told: by its session token, or by the boot token
    /// of a registration body. Best effort: a failure is only logged.
    async fn mark_incompatible(&self, bearer: Option<Token>, body: &[u8], schema: Option<&str>) {
        let machine = if let Some(b) = bearer {
            self.authenticate(Some(b)).await.ok().map(|(m, _)| m)
        } else {
            let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            match v["bootToken"].as_str().map(Token::new) {
                Some(t) if well_formed(&t) => self
                    .machine_by_boot_hash(v["machine"].as_str(), &token_hash(t.expose()))
                    .await
                    .ok()
                    .flatten(),
                _ => None,
            }
        };
        let Some(m) = machine else {
            return;
        };
        let mut conditions = m
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default();
        crate::conditions::set(
            &mut conditions,
            types::AGENT_COMPATIBLE,
            false,
            reasons::SCHEMA_MISMATCH,
            format!(
                "the agent sent Anneal-Agent-Schema {:?}; this manager speaks 1",
                schema.unwrap_or("")
            ),
            m.metadata.generation,
        );
        let patch = json!({
            "metadata": {"resourceVersion": m.resource_version()},
            "status": {"conditions": conditions},
        });
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        if let Err(e) =
            Api::<Machine>::namespaced(self.client.clone(), &m.namespace().unwrap_or_default())
                .patch_status(&m.name_any(), &pp, &Patch::Merge(&patch))
                .await
        {
            tracing::info!(machine = %m.name_any(), error = %e, "cannot record AgentCompatible=False");
        }
    }

    /// The machine a bearer session token speaks for.
    async fn authenticate(&self, bearer: Option<Token>) -> Result<(Machine, String), Resp> {
        let Some(token) = bearer.filter(well_formed) else {
            return Err(unauthorized(ErrorCode::InvalidToken));
        };
        let hash = token_hash(token.expose());
        drop(token);
        let valid = |m: &Machine| {
            m.status
                .as_ref()
                .and_then(|s| s.agent.as_ref())
                .is_some_and(|a| {
                    a.session_token_hash
                        .as_deref()
                        .is_some_and(|h| agent::ct_eq(h.as_bytes(), hash.as_bytes()))
                        && a.expires_at
                            .as_ref()
                            .is_some_and(|t| t.0.as_millisecond() > now_ms())
                })
        };
        let cached = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&hash)
            .cloned();
        let found = match cached {
            Some((ns, name)) => Api::<Machine>::namespaced(self.client.clone(), &ns)
                .get_opt(&name)
                .await
                .map(|m| m.filter(valid)),
            None => match self.lookup(|i| i.session.get(&hash).cloned()).await {
                Some((ns, name)) => Api::<Machine>::namespaced(self.client.clone(), &ns)
                    .get_opt(&name)
                    .await
                    .map(|m| m.filter(valid)),
                None => Ok(None),
            },
        };
        match found {
            Ok(Some(m)) => {
                // a used session is no lost answer: no replay of it any more
                self.registered
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .retain(|_, r| r.session_hash != hash);
                self.renew(&m).await;
                Ok((m, hash))
            }
            Ok(None) => Err(unauthorized(ErrorCode::InvalidToken)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read machines");
                Err(internal())
            }
        }
    }

    /// Moves a used session's expiry to now + the TTL once
    /// `session_renew_after` has passed since it was last set. Only the
    /// expiry of the same session is written (a merge patch guarded by the
    /// Machine's resourceVersion: a concurrent change wins, and the next
    /// request renews). Best effort: a failed write leaves the old expiry.
    async fn renew(&self, m: &Machine) {
        let ttl = i64::try_from(self.cfg.session_ttl.as_millis()).unwrap_or(i64::MAX);
        let after = i64::try_from(self.cfg.session_renew_after.as_millis()).unwrap_or(i64::MAX);
        let Some(expires) = m
            .status
            .as_ref()
            .and_then(|s| s.agent.as_ref())
            .and_then(|a| a.expires_at.as_ref())
            .map(|t| t.0.as_millisecond())
        else {
            return;
        };
        let now = Timestamp::now();
        if expires.saturating_sub(now.as_millisecond()) > ttl.saturating_sub(after) {
            return;
        }
        let patch = json!({
            "metadata": {"resourceVersion": m.resource_version()},
            "status": {"agent": {"expiresAt": time_in(now, ttl), "lastSeen": time_in(now, 0)}},
        });
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let api =
            Api::<Machine>::namespaced(self.client.clone(), &m.namespace().unwrap_or_default());
        match api
            .patch_status(&m.name_any(), &pp, &Patch::Merge(&patch))
            .await
        {
            Ok(_) => tracing::debug!(machine = %m.name_any(), "agent session renewed"),
            Err(e) => {
                tracing::debug!(machine = %m.name_any(), error = %e, "agent session not renewed this time")
            }
        }
    }

    /// `poweroff` for the agent of an inspection that ended: the transition to
    /// Available cleared its session's hash (docs/api.md, "Agent protocol"),
    /// so it can no longer act; a `next` it sends after that (its long-poll
    /// was not waiting at the moment) still gets the `poweroff` the contract
    /// promises an idle Available machine. Only sessions this manager minted
    /// are known (an in-memory index): after a restart such a poll gets 401.
    /// None: not such a session.
    async fn ended_inspection(&self, bearer: Option<Token>) -> Option<Resp> {
        let token = bearer.filter(well_formed)?;
        let hash = token_hash(token.expose());
        drop(token);
        let (ns, name) = self
            .sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&hash)
            .cloned()?;
        let m = Api::<Machine>::namespaced(self.client.clone(), &ns)
            .get_opt(&name)
            .await
            .ok()
            .flatten()?;
        let st = m.status.as_ref()?;
        let ended = matches!(
            st.state,
            Some(MachineState::Available | MachineState::Released | MachineState::Parked)
        ) && st
            .agent
            .as_ref()
            .is_some_and(|a| a.session_token_hash.is_none());
        if !ended {
            return None;
        }
        tracing::info!(machine = %name, "next from the ended inspection session: poweroff");
        Some(json_reply(StatusCode::OK, &NextAction::PowerOff))
    }

    async fn hardware(&self, m: &Machine, session: &str, body: &[u8]) -> Resp {
        let report: HardwareReport = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(_) => {
                return fail(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::BadRequest,
                    "invalid hardware body",
                );
            }
        };
        let ns = m.namespace().unwrap_or_default();
        let name = m.name_any();
        // The inventory is the one taken while Inspecting: a report in any
        // other state (an agent booted to deploy or wipe reports too) is
        // acknowledged and not written, so a session cannot rewrite the
        // disks a plan is made from.
        let state = m.status.as_ref().and_then(|s| s.state);
        if state != Some(MachineState::Inspecting) {
            tracing::info!(machine = %name, state = ?state, "hardware report not written: the inventory is taken only while Inspecting");
            return no_content();
        }
        let mut hw = MachineHardware::new(&name, hardware_spec(&report));
        hw.metadata.namespace = Some(ns.clone());
        hw.metadata.owner_references = m.controller_owner_ref(&()).map(|o| vec![o]);
        hw.metadata.annotations = Some(
            [(SESSION_ANNOTATION.to_string(), session.to_string())]
                .into_iter()
                .collect(),
        );
        match Api::<MachineHardware>::namespaced(self.client.clone(), &ns)
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&hw),
            )
            .await
        {
            Ok(_) => {
                tracing::info!(machine = %name, disks = report.disks.len(), nics = report.nics.len(), "hardware reported");
                Response::builder()
                    .status(StatusCode::NO_CONTENT)
                    .header(agent::SCHEMA_HEADER, agent::SCHEMA_VERSION)
                    .body(Full::new(Bytes::new()))
                    .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
            }
            Err(e) => {
                tracing::warn!(machine = %name, error = %e, "cannot write machinehardware");
                internal()
            }
        }
    }

    async fn next(&self, m: &Machine) -> Resp {
        let ns = m.namespace().unwrap_or_default();
        let name = m.name_any();
        let api = Api::<Machine>::namespaced(self.client.clone(), &ns);
        let deadline = tokio::time::Instant::now() + self.cfg.long_poll;
        let mut current = Some(m.clone());
        loop {
            let state = current
                .as_ref()
                .and_then(|m| m.status.as_ref())
                .and_then(|s| s.state);
            let fast_track = state == Some(MachineState::Available)
                && current.as_ref().is_some_and(|m| {
                    crate::lifecycle::handlers::fast_track_live(
                        m,
                        self.cfg.fast_track_window,
                        Timestamp::now(),
                    )
                });
            if !fast_track
                && matches!(
                    state,
                    Some(MachineState::Available | MachineState::Released | MachineState::Parked)
                )
            {
                return json_reply(StatusCode::OK, &NextAction::PowerOff);
            }
            if state == Some(MachineState::Deprovisioning)
                && let Some(m) = current.as_ref()
            {
                return match runs::wipe_disks(&self.client, m).await {
                    Ok(disks) => {
                        tracing::info!(machine = %name, disks = disks.len(), "wipe handed to the agent");
                        json_reply(
                            StatusCode::OK,
                            &NextAction::Wipe {
                                id: runs::wipe_id(m),
                                disks,
                            },
                        )
                    }
                    Err(e) => {
                        tracing::warn!(machine = %name, error = %e, "cannot read the inventory to wipe");
                        internal()
                    }
                };
            }
            if state == Some(MachineState::Provisioning)
                && let Some(run) = current
                    .as_ref()
                    .and_then(|m| m.status.as_ref())
                    .and_then(|s| s.current_run_ref.as_ref())
            {
                match crate::deploy::runs::read_plan(&self.client, &ns, &run.name).await {
                    Ok(Some(plan)) => {
                        tracing::info!(machine = %name, run = %run.name, "deploy plan handed to the agent");
                        return json_reply(
                            StatusCode::OK,
                            &NextAction::Deploy {
                                plan: Box::new(plan),
                            },
                        );
                    }
                    Ok(None) => {
                        tracing::warn!(machine = %name, run = %run.name, "the run has no plan secret yet");
                    }
                    Err(e) => {
                        tracing::warn!(machine = %name, error = %e, "cannot read the deploy plan");
                        return internal();
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return json_reply(
                    StatusCode::OK,
                    &NextAction::Wait {
                        retry_after_seconds: 1,
                    },
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            current = api.get_opt(&name).await.ok().flatten();
        }
    }
}

/// Whether two MAC addresses are the same (any of the accepted spellings:
/// `:` or `-`, either case). An unparsable one matches nothing.
fn same_mac(a: &str, b: &str) -> bool {
    match (
        a.parse::<anneal_api::mac::Mac>(),
        b.parse::<anneal_api::mac::Mac>(),
    ) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

fn no_content() -> Resp {
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .header(agent::SCHEMA_HEADER, agent::SCHEMA_VERSION)
        .body(Full::new(Bytes::new()))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn refused(m: &Machine, r: runs::Refusal) -> Resp {
    match r {
        runs::Refusal::BadRequest(msg) => {
            fail(StatusCode::BAD_REQUEST, ErrorCode::BadRequest, &msg)
        }
        runs::Refusal::NotCurrent(msg) => fail(StatusCode::CONFLICT, ErrorCode::Conflict, &msg),
        runs::Refusal::Api(e) => {
            tracing::warn!(machine = %m.name_any(), error = %e, "cannot record the run report");
            internal()
        }
    }
}

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn clamp_i32(v: u32) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

/// The MachineHardware spec of an agent's report.
pub fn hardware_spec(r: &HardwareReport) -> MachineHardwareSpec {
    MachineHardwareSpec {
        disks: r
            .disks
            .iter()
            .map(|d| HardwareDisk {
                device_name: if d.device_name.starts_with("/dev/") {
                    d.device_name.clone()
                } else {
                    format!("/dev/{}", d.device_name)
                },
                size_bytes: clamp_i64(d.size_bytes),
                serial_number: d.serial_number.clone(),
                wwn: d.wwn.clone(),
                model: d.model.clone(),
                vendor: d.vendor.clone(),
                rotational: d.rotational,
                pcie_path: d.pcie_path.clone(),
                hctl: d.hctl.clone(),
                slot_number: d.slot_number.and_then(|s| i32::try_from(s).ok()),
                logical_sector_size: Some(clamp_i32(d.logical_sector_size)),
                physical_sector_size: Some(clamp_i32(d.physical_sector_size)),
            })
            .collect(),
        nics: r
            .nics
            .iter()
            .map(|n| HardwareNic {
                name: n.name.clone(),
                mac: n.mac.clone(),
                speed_mbps: n.speed_mbps.map(clamp_i32),
                driver: n.driver.clone(),
                pci_address: n.pci_address.clone(),
                link: n.link,
                lldp: n.lldp.as_ref().map(|l| NicLldp {
                    chassis_id: Some(l.chassis_id.clone()),
                    port_id: Some(l.port_id.clone()),
                    port_description: l.port_description.clone(),
                    system_name: l.system_name.clone(),
                }),
            })
            .collect(),
        memory_bytes: Some(clamp_i64(r.memory_bytes)),
        cpu: Some(HardwareCpu {
            count: clamp_i32(r.cpu.count),
            model: r.cpu.model.clone(),
            architecture: match r.cpu.architecture.as_deref() {
                Some("x86_64") => Some(anneal_api::Architecture::X86_64),
                Some("aarch64") => Some(anneal_api::Architecture::Aarch64),
                _ => None,
            },
        }),
        firmware: Some(HardwareFirmware {
            mode: match r.firmware.mode {
                agent::FirmwareMode::Uefi => FirmwareMode::Uefi,
                agent::FirmwareMode::Bios => FirmwareMode::Bios,
            },
            secure_boot: r.firmware.secure_boot,
        }),
        system: Some(HardwareSystem {
            vendor: r.system.vendor.clone(),
            product: r.system.product.clone(),
            serial: r.system.serial.clone(),
            uuid: r.system.uuid.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_hardware_spec_carries_each_nics_lldp_neighbour() {
        let report: HardwareReport = serde_json::from_value(serde_json::json!({
            "disks": [], "memoryBytes": 1024,
            "cpu": {"count": 1}, "firmware": {"mode": "uefi", "secureBoot": false},
            "system": {},
            "nics": [
                {"name": "eno1", "mac": "52:54:00:00:00:01", "link": true,
                 "lldp": {"chassisId": "0c:a1:b2:c3:d4:e5", "portId": "Ethernet1/17",
                          "systemName": "leaf-07"}},
                {"name": "eno2", "mac": "52:54:00:00:00:02", "link": false}
            ]
        }))
        .unwrap();
        let spec = hardware_spec(&report);
        assert_eq!(
            spec.nics[0].lldp,
            Some(NicLldp {
                chassis_id: Some("0c:a1:b2:c3:d4:e5".into()),
                port_id: Some("Ethernet1/17".into()),
                port_description: None,
                system_name: Some("leaf-07".into()),
            })
        );
        assert_eq!(spec.nics[1].lldp, None);
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["nics"][0]["lldp"]["portId"], "Ethernet1/17");
        assert!(json["nics"][1].get("lldp").is_none());
        // an unknown field inside lldp is refused like any other
        let bad = serde_json::json!({"name": "eno1", "mac": "m", "link": true,
                                     "lldp": {"chassisId": "c", "portId": "p", "vlan": 7}});
        assert!(serde_json::from_value::<anneal_api::agent::Nic>(bad).is_err());
    }
}
