//! anneal-qemu-bmc: a small Redfish service for one QEMU VM, driving it over
//! QMP. It is a test fixture of the harness and what the demo uses.
//!
//! - Power: `PowerState` is `On` while the guest CPUs run; `On` resets and
//!   continues a stopped VM, `ForceOff` stops it, `GracefulShutdown` sends an
//!   ACPI power-button press, `ForceRestart`/`GracefulRestart` reset it.
//!   Start QEMU with `-S` (powered off) and `-no-shutdown` so a guest
//!   power-off leaves QEMU alive, like a chassis with its BMC still up.
//! - Boot override: `Boot.BootSourceOverrideTarget` `Pxe`/`UefiHttp` puts the
//!   NICs first in the boot order (QOM `bootindex`, which QEMU writes to the
//!   firmware's `bootorder` at every reset), `Hdd`/`None` the disks; `Once` is
//!   consumed by the next power-on or reset, after which the disks come first
//!   again.
//! - The override is persisted in a JSON state file, so it survives a BMC
//!   restart; every request is appended to a JSON-lines request log.
//! - HTTP Basic authentication on everything but the service root; optional
//!   TLS.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod ipmi_sim;
pub mod qmp;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::prelude::{BASE64_STANDARD, Engine as _};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::qmp::{Qmp, QmpError};

/// Errors of the BMC.
#[derive(Debug, thiserror::Error)]
pub enum BmcError {
    /// The listener cannot bind.
    #[error("cannot listen on {addr}")]
    Bind {
        /// address
        addr: SocketAddr,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// The state file cannot be read or written.
    #[error("state file {path}")]
    State {
        /// path
        path: PathBuf,
        /// cause
        #[source]
        source: std::io::Error,
    },
    /// The TLS certificate or key cannot be used.
    #[error("invalid tls certificate or key")]
    Tls,
    /// QMP failed.
    #[error(transparent)]
    Qmp(#[from] QmpError),
}

/// How to run one BMC.
#[derive(Debug, Clone)]
pub struct BmcConfig {
    /// Where to listen.
    pub listen: SocketAddr,
    /// QEMU's QMP socket.
    pub qmp: PathBuf,
    /// Persisted BMC state (boot override).
    pub state_file: PathBuf,
    /// JSON-lines request log.
    pub request_log: Option<PathBuf>,
    /// Basic-auth user.
    pub username: String,
    /// Basic-auth password.
    pub password: String,
    /// The ComputerSystem Id.
    pub system_id: String,
    /// PEM certificate chain and key: serve HTTPS instead of HTTP.
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
}

/// The persisted part of the BMC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct BootSettings {
    /// `BootSourceOverrideEnabled`: Disabled, Once or Continuous.
    pub boot_source_override_enabled: String,
    /// `BootSourceOverrideTarget`: None, Pxe, UefiHttp or Hdd.
    pub boot_source_override_target: String,
    /// `BootSourceOverrideMode`: UEFI or Legacy.
    pub boot_source_override_mode: String,
}

impl Default for BootSettings {
    fn default() -> Self {
        Self {
            boot_source_override_enabled: "Disabled".into(),
            boot_source_override_target: "None".into(),
            boot_source_override_mode: "UEFI".into(),
        }
    }
}

/// One line of the request log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogEntry {
    /// Milliseconds since the Unix epoch.
    pub ts_ms: u64,
    /// HTTP method.
    pub method: String,
    /// Request path.
    pub path: String,
    /// Answer status.
    pub status: u16,
    /// `ResetType` of a reset, `Boot=<Enabled>/<Target>` of a boot PATCH.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// The request's `User-Agent` (the anneal manager puts its replica
    /// identity there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
}

impl LogEntry {
    /// True for a `ComputerSystem.Reset` (any type, any outcome).
    pub fn is_reset(&self) -> bool {
        self.method == "POST" && self.path.ends_with("/Actions/ComputerSystem.Reset")
    }
}

/// Reads a request log (missing file: empty).
pub fn read_request_log(path: &Path) -> Vec<LogEntry> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

const TARGETS: [&str; 4] = ["Pxe", "UefiHttp", "Hdd", "None"];
const RESET_TYPES: [&str; 7] = [
    "On",
    "ForceOff",
    "GracefulShutdown",
    "GracefulRestart",
    "ForceRestart",
    "ForceOn",
    "PushPowerButton",
];

struct Shared {
    cfg: BmcConfig,
    boot: Mutex<BootSettings>,
    auth: String,
    log: std::sync::Mutex<()>,
}

/// A running BMC; stops when [`RunningBmc::stop`] is called or it is dropped.
#[derive(Debug)]
pub struct RunningBmc {
    addr: SocketAddr,
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RunningBmc {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops listening and drops every open connection.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for RunningBmc {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

fn load_state(path: &Path) -> Result<BootSettings, BmcError> {
    match std::fs::read(path) {
        Ok(b) => Ok(serde_json::from_slice(&b).unwrap_or_default()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BootSettings::default()),
        Err(source) => Err(BmcError::State {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn save_state(path: &Path, boot: &BootSettings) -> Result<(), BmcError> {
    let tmp = path.with_extension("tmp");
    let io = |source| BmcError::State {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(&tmp, serde_json::to_vec_pretty(boot).unwrap_or_default()).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

fn tls_acceptor(cert: &[u8], key: &[u8]) -> Result<tokio_rustls::TlsAcceptor, BmcError> {
    use rustls::pki_types::pem::PemObject as _;
    let certs: Vec<_> = rustls::pki_types::CertificateDer::pem_slice_iter(cert)
        .collect::<Result<_, _>>()
        .map_err(|_| BmcError::Tls)?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key).map_err(|_| BmcError::Tls)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|_| BmcError::Tls)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|_| BmcError::Tls)?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(cfg)))
}

/// Binds and starts serving.
pub async fn start(cfg: BmcConfig) -> Result<RunningBmc, BmcError> {
    let boot = load_state(&cfg.state_file)?;
    let listener = TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| BmcError::Bind {
            addr: cfg.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(|source| BmcError::Bind {
        addr: cfg.listen,
        source,
    })?;
    let acceptor = match &cfg.tls {
        Some((c, k)) => Some(tls_acceptor(c, k)?),
        None => None,
    };
    let auth = format!(
        "Basic {}",
        BASE64_STANDARD.encode(format!("{}:{}", cfg.username, cfg.password))
    );
    let shared = Arc::new(Shared {
        cfg,
        boot: Mutex::new(boot),
        auth,
        log: std::sync::Mutex::new(()),
    });
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        loop {
            let (tcp, peer) = tokio::select! {
                _ = stop.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                },
            };
            let shared = shared.clone();
            let acceptor = acceptor.clone();
            conns.spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let shared = shared.clone();
                    async move { Ok::<_, Infallible>(handle(&shared, req).await) }
                });
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let res = match acceptor {
                    Some(a) => match a.accept(tcp).await {
                        Ok(tls) => builder.serve_connection(TokioIo::new(tls), svc).await,
                        Err(e) => {
                            tracing::debug!(%peer, error = %e, "tls handshake failed");
                            return;
                        }
                    },
                    None => builder.serve_connection(TokioIo::new(tcp), svc).await,
                };
                if let Err(e) = res {
                    tracing::debug!(%peer, error = %e, "connection ended");
                }
            });
            while conns.try_join_next().is_some() {}
        }
        conns.abort_all();
    });
    tracing::info!(%addr, "bmc listening");
    Ok(RunningBmc {
        addr,
        cancel,
        task: Some(task),
    })
}

fn reply(status: StatusCode, body: Option<Value>) -> Response<Full<Bytes>> {
    let mut b = Response::builder().status(status);
    let bytes = match body {
        Some(v) => {
            b = b.header(CONTENT_TYPE, "application/json");
            Bytes::from(v.to_string())
        }
        None => Bytes::new(),
    };
    b.body(Full::new(bytes))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn error(status: StatusCode, msg: &str) -> Response<Full<Bytes>> {
    reply(
        status,
        Some(json!({"error": {"code": "Base.1.0.GeneralError", "message": msg}})),
    )
}

impl Shared {
    fn system_path(&self) -> String {
        format!("/redfish/v1/Systems/{}", self.cfg.system_id)
    }

    fn record(
        &self,
        method: &Method,
        path: &str,
        status: StatusCode,
        action: Option<String>,
        user_agent: Option<String>,
    ) {
        let Some(p) = &self.cfg.request_log else {
            return;
        };
        let entry = LogEntry {
            ts_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            method: method.to_string(),
            path: path.to_string(),
            status: status.as_u16(),
            action,
            user_agent,
        };
        let _guard = self.log.lock();
        let line = format!("{}\n", serde_json::to_string(&entry).unwrap_or_default());
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }

    async fn system_json(&self) -> Result<Value, BmcError> {
        let mut qmp = Qmp::connect(&self.cfg.qmp).await?;
        let on = qmp.running().await?;
        let boot = self.boot.lock().await.clone();
        let path = self.system_path();
        Ok(json!({
            "@odata.type": "#ComputerSystem.v1_13_0.ComputerSystem",
            "@odata.id": path,
            "Id": self.cfg.system_id,
            "Name": self.cfg.system_id,
            "Manufacturer": "QEMU",
            "Model": "anneal-qemu-bmc",
            "PowerState": if on { "On" } else { "Off" },
            "Status": {"State": "Enabled", "Health": "OK"},
            "Boot": {
                "BootSourceOverrideEnabled": boot.boot_source_override_enabled,
                "BootSourceOverrideTarget": boot.boot_source_override_target,
                "BootSourceOverrideMode": boot.boot_source_override_mode,
                "BootSourceOverrideTarget@Redfish.AllowableValues": ["Pxe", "UefiHttp", "Hdd"],
            },
            "Actions": {"#ComputerSystem.Reset": {
                "target": format!("{path}/Actions/ComputerSystem.Reset"),
                "ResetType@Redfish.AllowableValues": RESET_TYPES,
            }},
        }))
    }

    /// Puts the NICs (`network_first`) or the disks first in the boot order.
    async fn set_boot_order(&self, qmp: &mut Qmp, network_first: bool) -> Result<(), BmcError> {
        let devs = qmp.boot_devices().await?;
        for (p, _) in &devs {
            let _ = qmp.set_bootindex(p, -1).await;
        }
        let (nets, disks): (Vec<_>, Vec<_>) = devs.into_iter().partition(|(_, n)| *n);
        let ordered: Vec<_> = if network_first {
            nets.into_iter().chain(disks).collect()
        } else {
            disks.into_iter().chain(nets).collect()
        };
        for (i, (p, _)) in ordered.iter().enumerate() {
            if let Err(e) = qmp.set_bootindex(p, i as i64 + 1).await {
                tracing::warn!(device = %p, error = %e, "cannot set bootindex");
            }
        }
        Ok(())
    }

    /// Resets the VM (applying and consuming the override) and, with
    /// `start`, makes sure its CPUs run.
    async fn boot(&self, start: bool) -> Result<(), BmcError> {
        let mut qmp = Qmp::connect(&self.cfg.qmp).await?;
        let mut boot = self.boot.lock().await;
        let active = boot.boot_source_override_enabled != "Disabled";
        let network = active
            && matches!(
                boot.boot_source_override_target.as_str(),
                "Pxe" | "UefiHttp"
            );
        self.set_boot_order(&mut qmp, network).await?;
        qmp.execute("system_reset", None).await?;
        if start && !qmp.running().await? {
            qmp.execute("cont", None).await?;
        }
        if boot.boot_source_override_enabled == "Once" {
            boot.boot_source_override_enabled = "Disabled".into();
            boot.boot_source_override_target = "None".into();
            save_state(&self.cfg.state_file, &boot)?;
            // The firmware's boot order was fixed at the reset; later resets
            // boot the disks again.
            self.set_boot_order(&mut qmp, false).await?;
        }
        tracing::info!(network, "vm reset");
        Ok(())
    }

    async fn reset(&self, kind: &str) -> Result<(), BmcError> {
        match kind {
            "On" | "ForceOn" => {
                let running = Qmp::connect(&self.cfg.qmp).await?.running().await?;
                if !running {
                    self.boot(true).await?;
                }
            }
            "ForceOff" => {
                Qmp::connect(&self.cfg.qmp)
                    .await?
                    .execute("stop", None)
                    .await?;
            }
            "GracefulShutdown" | "PushPowerButton" => {
                let mut qmp = Qmp::connect(&self.cfg.qmp).await?;
                if qmp.running().await? {
                    qmp.execute("system_powerdown", None).await?;
                } else if kind == "PushPowerButton" {
                    drop(qmp);
                    self.boot(true).await?;
                }
            }
            _ => self.boot(true).await?,
        }
        Ok(())
    }

    async fn patch_boot(&self, body: &Value) -> Result<(), String> {
        let Some(b) = body.get("Boot").and_then(Value::as_object) else {
            return Err("body needs a Boot object".into());
        };
        let mut boot = self.boot.lock().await;
        let mut next = boot.clone();
        for (k, v) in b {
            let v = v.as_str().ok_or_else(|| format!("{k} must be a string"))?;
            match k.as_str() {
                "BootSourceOverrideEnabled" => {
                    if !["Disabled", "Once", "Continuous"].contains(&v) {
                        return Err(format!("bad BootSourceOverrideEnabled {v:?}"));
                    }
                    next.boot_source_override_enabled = v.into();
                }
                "BootSourceOverrideTarget" => {
                    if !TARGETS.contains(&v) {
                        return Err(format!("unsupported BootSourceOverrideTarget {v:?}"));
                    }
                    next.boot_source_override_target = v.into();
                }
                "BootSourceOverrideMode" => {
                    if !["UEFI", "Legacy"].contains(&v) {
                        return Err(format!("bad BootSourceOverrideMode {v:?}"));
                    }
                    next.boot_source_override_mode = v.into();
                }
                other => return Err(format!("unsupported property {other}")),
            }
        }
        save_state(&self.cfg.state_file, &next).map_err(|e| e.to_string())?;
        *boot = next;
        Ok(())
    }
}

async fn handle(shared: &Shared, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_string();
    let authorized = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == shared.auth);
    let user_agent = req
        .headers()
        .get(hyper::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = match Limited::new(req.into_body(), 64 << 10).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            let r = error(StatusCode::PAYLOAD_TOO_LARGE, "body too large");
            shared.record(&method, &path, r.status(), None, user_agent);
            return r;
        }
    };
    let (resp, action) = route(shared, &method, &path, authorized, &body).await;
    shared.record(&method, &path, resp.status(), action, user_agent);
    resp
}

async fn route(
    shared: &Shared,
    method: &Method,
    path: &str,
    authorized: bool,
    body: &[u8],
) -> (Response<Full<Bytes>>, Option<String>) {
    let sys = shared.system_path();
    if path == "/redfish/v1" && method == Method::GET {
        return (
            reply(
                StatusCode::OK,
                Some(json!({
                    "@odata.type": "#ServiceRoot.v1_5_0.ServiceRoot",
                    "@odata.id": "/redfish/v1",
                    "Id": "RootService",
                    "Name": "anneal-qemu-bmc",
                    "RedfishVersion": "1.6.0",
                    "Systems": {"@odata.id": "/redfish/v1/Systems"},
                })),
            ),
            None,
        );
    }
    if !authorized {
        return (
            error(StatusCode::UNAUTHORIZED, "authentication required"),
            None,
        );
    }
    let qmp_failed = |e: BmcError| {
        tracing::warn!(error = %e, "qmp failed");
        error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the virtual machine does not answer",
        )
    };
    match (method.clone(), path) {
        (Method::GET, "/redfish/v1/Systems") => (
            reply(
                StatusCode::OK,
                Some(json!({
                    "@odata.id": "/redfish/v1/Systems",
                    "Name": "Computer System Collection",
                    "Members@odata.count": 1,
                    "Members": [{"@odata.id": sys}],
                })),
            ),
            None,
        ),
        (Method::GET, p) if p == sys => match shared.system_json().await {
            Ok(v) => (reply(StatusCode::OK, Some(v)), None),
            Err(e) => (qmp_failed(e), None),
        },
        (Method::PATCH, p) if p == sys => {
            let Ok(v) = serde_json::from_slice::<Value>(body) else {
                return (error(StatusCode::BAD_REQUEST, "invalid json"), None);
            };
            let action = format!(
                "Boot={}/{}",
                v["Boot"]["BootSourceOverrideEnabled"]
                    .as_str()
                    .unwrap_or("-"),
                v["Boot"]["BootSourceOverrideTarget"]
                    .as_str()
                    .unwrap_or("-")
            );
            match shared.patch_boot(&v).await {
                Ok(()) => (reply(StatusCode::NO_CONTENT, None), Some(action)),
                Err(msg) => (error(StatusCode::BAD_REQUEST, &msg), Some(action)),
            }
        }
        (Method::POST, p) if p == format!("{sys}/Actions/ComputerSystem.Reset") => {
            let kind = serde_json::from_slice::<Value>(body)
                .ok()
                .and_then(|v| v["ResetType"].as_str().map(str::to_string));
            let Some(kind) = kind.filter(|k| RESET_TYPES.contains(&k.as_str())) else {
                return (
                    error(StatusCode::BAD_REQUEST, "ResetType missing or unsupported"),
                    None,
                );
            };
            match shared.reset(&kind).await {
                Ok(()) => (reply(StatusCode::NO_CONTENT, None), Some(kind)),
                Err(e) => (qmp_failed(e), Some(kind)),
            }
        }
        _ => (error(StatusCode::NOT_FOUND, "no such resource"), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_defaults() {
        let dir = std::env::temp_dir().join(format!("anneal-bmc-unit-{}", std::process::id()));
        // a leftover of an earlier run with the same PID must not count
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("state.json");
        assert_eq!(load_state(&p).unwrap(), BootSettings::default());
        let s = BootSettings {
            boot_source_override_enabled: "Once".into(),
            boot_source_override_target: "Pxe".into(),
            boot_source_override_mode: "UEFI".into(),
        };
        save_state(&p, &s).unwrap();
        assert_eq!(load_state(&p).unwrap(), s);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
