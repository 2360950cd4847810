//! The metadata endpoint (docs/deploy.md "Day-1 over the network"): a
//! claim's Day-1 data over plain HTTP on the provisioning network, for
//! images that fetch it instead of reading the config drive.
//!
//! Layouts, all rendered from the same intent as the config drive
//! ([`crate::deploy::cloudinit::render`]):
//! - OpenStack (`/openstack/`, `/openstack/<version>/meta_data.json`,
//!   `user_data`, `network_data.json`, `vendor_data.json`): the layout
//!   chosen for images that expect a metadata service. Its
//!   `network_data.json` carries links, bonds, VLANs, static addresses and
//!   DNS (EC2's layout has no network configuration), cloud-init's
//!   OpenStack datasource and Ignition/Afterburn on OpenStack read it, and
//!   it is the layout of a `config-2` drive too;
//! - NoCloud seed files (`/nocloud/meta-data`, `user-data`, `vendor-data`,
//!   `network-config`): cloud-init's `ds=nocloud;s=http://HOST:PORT/nocloud/`;
//! - Ignition (`/ignition/config.ign`): `ignition.config.url=` of CoreOS-
//!   family images ([`crate::deploy::ignition`]).
//!
//! Who asks is told by the TCP source address alone: an address answers
//! only when exactly one Machine holds it, through a lease-mode
//! reservation the manager wrote into a Subnet's status, or as a static
//! address of its Bound claim's generated `networkData`; that Machine must
//! be `Provisioning` or `Provisioned` with a claim Bound to it by namespace
//! and name. Anything else is 404 without a body that names another
//! Machine. Secret-sourced data is read per request from the claim's own
//! namespace and never logged.
//!
//! Bounds: at most [`MAX_CONNECTIONS`] connections, a request head within
//! [`HEADER_TIMEOUT`], GET and HEAD only, no request body read, one answer
//! at most the size of the data it serves.

pub mod openstack;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anneal_api::{ClaimPhase, Image, Machine, MachineClaim, MachineHardware, MachineState, Subnet};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::deploy::cloudinit;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 256;
/// A request head must arrive within this.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Configuration of [`start`].
#[derive(Clone, Debug)]
pub struct MetadataConfig {
    /// Listen address (the provisioning network's side of this host).
    pub listen: SocketAddr,
    /// Serve only Machines of this namespace (`--namespace`); `None`: all.
    pub namespace: Option<String>,
}

/// A started endpoint.
#[derive(Debug)]
pub struct RunningMetadata {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl RunningMetadata {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the endpoint to stop (after its cancel token fired).
    pub async fn join(self) {
        let _ = self.task.await;
    }
}

/// The server's shared state.
struct Server {
    client: Client,
    subnets: Store<Subnet>,
    claims: Store<MachineClaim>,
}

/// Binds `cfg.listen` and serves until `cancel` fires.
pub async fn start(
    client: Client,
    cfg: MetadataConfig,
    cancel: CancellationToken,
) -> std::io::Result<RunningMetadata> {
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let (subnets, subnet_task) = reflect::<Subnet>(&client, cfg.namespace.as_deref(), &cancel);
    let (claims, claim_task) = reflect::<MachineClaim>(&client, cfg.namespace.as_deref(), &cancel);
    let server = Arc::new(Server {
        client,
        subnets,
        claims,
    });
    tracing::info!(%addr, "metadata endpoint listening (http)");
    let task = tokio::spawn(async move {
        accept_loop(listener, server, cancel).await;
        subnet_task.abort();
        claim_task.abort();
    });
    Ok(RunningMetadata { addr, task })
}

/// A store of `K` (the namespace or all) kept by a watch until `cancel`.
fn reflect<K>(
    client: &Client,
    namespace: Option<&str>,
    cancel: &CancellationToken,
) -> (Store<K>, tokio::task::JoinHandle<()>)
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let (store, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .applied_objects();
    let cancel = cancel.clone();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                next = stream.next() => match next {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::debug!(error = %e, "metadata endpoint: watch error"),
                    None => break,
                },
            }
        }
    });
    (store, task)
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    server: Arc<Server>,
    cancel: CancellationToken,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let slot = tokio::select! {
            () = cancel.cancelled() => break,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let (tcp, peer) = tokio::select! {
            () = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(error = %e, "metadata endpoint: accept failed");
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(crate::agentapi::ACCEPT_BACKOFF) => {}
                    }
                    continue;
                }
            },
        };
        let server = server.clone();
        let cancel = cancel.clone();
        conns.spawn(async move {
            let _slot = slot;
            let svc = hyper::service::service_fn(move |req| {
                let server = server.clone();
                async move { Ok::<_, Infallible>(server.handle(peer, &req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_headers(32)
                .serve_connection(TokioIo::new(tcp), svc);
            tokio::select! {
                () = cancel.cancelled() => {}
                r = conn => if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "metadata connection ended");
                },
            }
        });
        while conns.try_join_next().is_some() {}
    }
    conns.abort_all();
}

type Resp = Response<Full<Bytes>>;

fn reply(status: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Resp {
    Response::builder()
        .status(status)
        .header(CONTENT_TYPE, ctype)
        .body(Full::new(body.into()))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn text(status: StatusCode, msg: impl Into<String>) -> Resp {
    let mut m = msg.into();
    m.push('\n');
    reply(status, "text/plain; charset=utf-8", m)
}

/// What a path asks for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// `/openstack` or `/openstack/`: the version listing.
    Versions,
    /// `/openstack/<version>/<file>`.
    OpenStack(String),
    /// `/nocloud/<file>`.
    NoCloud(String),
    /// `/ignition/config.ign`.
    Ignition,
}

fn route(path: &str) -> Option<Route> {
    let p = path.trim_end_matches('/');
    if p == "/openstack" {
        return Some(Route::Versions);
    }
    if let Some(rest) = p.strip_prefix("/openstack/") {
        let (version, file) = rest.split_once('/')?;
        return (openstack::known_version(version)
            && [
                "meta_data.json",
                "user_data",
                "network_data.json",
                "vendor_data.json",
                "vendor_data2.json",
            ]
            .contains(&file))
        .then(|| Route::OpenStack(file.to_string()));
    }
    if let Some(file) = p.strip_prefix("/nocloud/") {
        return ["meta-data", "user-data", "vendor-data", "network-config"]
            .contains(&file)
            .then(|| Route::NoCloud(file.to_string()));
    }
    (p == "/ignition/config.ign").then_some(Route::Ignition)
}

/// The machine's Day-1 files (the config drive's names) and who it is.
struct Served {
    files: BTreeMap<String, Vec<u8>>,
    machine: String,
}

impl Server {
    async fn handle(&self, peer: SocketAddr, req: &Request<Incoming>) -> Resp {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "GET only");
        }
        let path = req.uri().path();
        let Some(r) = route(path) else {
            return text(StatusCode::NOT_FOUND, format!("no such path {path}"));
        };
        if r == Route::Versions {
            return reply(StatusCode::OK, "text/plain", openstack::listing());
        }
        let ip = match peer.ip() {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        };
        let served = match self.served(ip).await {
            Ok(s) => s,
            Err((status, msg)) => {
                tracing::info!(%peer, path, status = status.as_u16(), reason = %msg, "metadata refused");
                return text(status, msg);
            }
        };
        let resp = answer(&r, &served.files);
        tracing::info!(%peer, path, machine = %served.machine, status = resp.status().as_u16(), "metadata served");
        resp
    }

    /// The Day-1 files of the Machine holding `ip`.
    async fn served(&self, ip: IpAddr) -> Result<Served, (StatusCode, String)> {
        let not_found = |why: String| (StatusCode::NOT_FOUND, why);
        let (ns, name) = self
            .holder(ip)
            .ok_or_else(|| not_found(format!("no Machine holds address {ip} (a lease-mode reservation or a static address of its claim's networkData)")))?;
        let kube_err = |e: kube::Error| {
            tracing::warn!(error = %e, "metadata endpoint: reading the cluster failed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "the cluster cannot be read right now; retry".to_string(),
            )
        };
        let m = Api::<Machine>::namespaced(self.client.clone(), &ns)
            .get_opt(&name)
            .await
            .map_err(kube_err)?
            .ok_or_else(|| not_found(format!("Machine {ns}/{name} does not exist")))?;
        let state = m.status.as_ref().and_then(|s| s.state);
        if !matches!(
            state,
            Some(MachineState::Provisioning | MachineState::Provisioned)
        ) {
            return Err(not_found(format!(
                "Machine {ns}/{name} is not Provisioning or Provisioned: no Day-1 data is served"
            )));
        }
        let bound = self
            .bound_claim(&m, &ns, &name)
            .ok_or_else(|| not_found(format!("Machine {ns}/{name} has no claim bound to it")))?;
        let image = match &bound.spec.image_ref {
            Some(r) => Api::<Image>::namespaced(self.client.clone(), &ns)
                .get_opt(&r.name)
                .await
                .map_err(kube_err)?,
            None => None,
        };
        let claim = cloudinit::with_image_defaults(&bound, image.as_ref()).into_owned();
        if !cloudinit::wanted(&claim) {
            return Err(not_found(format!(
                "claim {ns}/{} sets no userData, networkData or metaData",
                claim.name_any()
            )));
        }
        let hw = Api::<MachineHardware>::namespaced(self.client.clone(), &ns)
            .get_opt(&name)
            .await
            .map_err(kube_err)?;
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
        let day1 =
            crate::deploy::runs::gather_day1(&self.client, &m, &claim, hw.as_ref(), &secrets)
                .await
                .map_err(kube_err)?;
        let mut rendered = cloudinit::render(&claim, &day1, 0, "").map_err(|e| {
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("claim {ns}/{}: {e}", claim.name_any()),
            )
        })?;
        let status = m.status.as_ref();
        let instance = status
            .and_then(|s| {
                s.current_run_ref
                    .as_ref()
                    .or(s.last_successful_run_ref.as_ref())
            })
            .map(|r| r.name.clone())
            .or_else(|| claim.uid())
            .unwrap_or_default();
        cloudinit::stamp_instance_id(&mut rendered.drive, &instance);
        let files = rendered
            .drive
            .files
            .iter()
            .map(|(k, v)| (k.clone(), v.expose().to_vec()))
            .collect();
        Ok(Served {
            files,
            machine: format!("{ns}/{name}"),
        })
    }

    /// The one Machine (namespace, name) holding `ip`: a Subnet reservation
    /// or a static address of a Bound claim's generated network data.
    fn holder(&self, ip: IpAddr) -> Option<(String, String)> {
        let mut found = std::collections::BTreeSet::new();
        let want = ip.to_string();
        for s in self.subnets.state() {
            let sns = s.namespace().unwrap_or_default();
            for r in s
                .status
                .as_ref()
                .and_then(|st| st.dhcp.as_ref())
                .map(|d| d.reservations.as_slice())
                .unwrap_or_default()
            {
                if r.address == want {
                    found.insert(match r.machine.split_once('/') {
                        Some((ns, m)) => (ns.to_string(), m.to_string()),
                        None => (sns.clone(), r.machine.clone()),
                    });
                }
            }
        }
        for c in self.claims.state() {
            let Some(st) = c.status.as_ref() else {
                continue;
            };
            let (Some(ClaimPhase::Bound), Some(machine)) = (st.phase, st.machine_name.as_ref())
            else {
                continue;
            };
            if static_addresses(&c).any(|a| a == ip) {
                found.insert((c.namespace().unwrap_or_default(), machine.clone()));
            }
        }
        if found.len() > 1 {
            tracing::warn!(address = %ip, holders = ?found, "metadata endpoint: an address held by more than one Machine answers none");
            return None;
        }
        found.pop_first()
    }

    /// The claim bound to Machine `ns/name`: named by its `spec.claimRef`
    /// (same namespace) and Bound to it by name.
    fn bound_claim(&self, m: &Machine, ns: &str, name: &str) -> Option<MachineClaim> {
        let r = m.spec.claim_ref.as_ref()?;
        if r.namespace.as_deref().is_some_and(|n| n != ns) {
            return None;
        }
        let c = self
            .claims
            .get(&reflector::ObjectRef::new(&r.name).within(ns))?;
        let st = c.status.as_ref()?;
        (st.phase == Some(ClaimPhase::Bound) && st.machine_name.as_deref() == Some(name))
            .then(|| c.as_ref().clone())
    }
}

/// Every static address of a claim's generated network data.
fn static_addresses(c: &MachineClaim) -> impl Iterator<Item = IpAddr> + '_ {
    let n = c.spec.network_data.as_ref();
    let eth = n
        .into_iter()
        .flat_map(|n| n.ethernets.iter().map(|e| &e.addressing));
    let bonds = n
        .into_iter()
        .flat_map(|n| n.bonds.iter().map(|b| &b.addressing));
    let vlans = n
        .into_iter()
        .flat_map(|n| n.vlans.iter().map(|v| &v.addressing));
    eth.chain(bonds)
        .chain(vlans)
        .flat_map(|a| a.addresses.iter())
        .filter_map(|a| a.split('/').next()?.parse().ok())
}

/// The answer for route `r` from the machine's files.
fn answer(r: &Route, files: &BTreeMap<String, Vec<u8>>) -> Resp {
    let meta: Value = files
        .get("meta-data")
        .and_then(|b| serde_json::from_slice(b).ok())
        .unwrap_or_else(|| json!({}));
    let file = |name: &str, ctype: &str| match files.get(name) {
        Some(b) => reply(StatusCode::OK, ctype, b.clone()),
        None => text(StatusCode::NOT_FOUND, format!("the claim sets no {name}")),
    };
    let json_reply = |v: &Value| reply(StatusCode::OK, "application/json", v.to_string());
    match r {
        Route::Versions => reply(StatusCode::OK, "text/plain", openstack::listing()),
        Route::OpenStack(f) => match f.as_str() {
            "meta_data.json" => json_reply(&openstack::meta_data(&meta)),
            "user_data" => file("user-data", "application/octet-stream"),
            "network_data.json" => network_data(files),
            _ => json_reply(&json!({})),
        },
        Route::NoCloud(f) => match f.as_str() {
            "vendor-data" => reply(StatusCode::OK, "text/plain", ""),
            other => file(other, "application/octet-stream"),
        },
        Route::Ignition => match crate::deploy::ignition::render(files) {
            Ok(b) => reply(StatusCode::OK, "application/json", b),
            Err(e) => text(StatusCode::UNPROCESSABLE_ENTITY, e),
        },
    }
}

fn network_data(files: &BTreeMap<String, Vec<u8>>) -> Resp {
    let Some(body) = files.get("network-config") else {
        return text(StatusCode::NOT_FOUND, "the claim sets no networkData");
    };
    let v2: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(_) => {
            return text(
                StatusCode::NOT_FOUND,
                "the claim's network-config is not JSON version 2; it is on the config drive and at /nocloud/network-config only",
            );
        }
    };
    match openstack::network_data(&v2) {
        Ok(n) => reply(StatusCode::OK, "application/json", n.to_string()),
        Err(e) => text(
            StatusCode::NOT_FOUND,
            format!("{e}; it is on the config drive and at /nocloud/network-config only"),
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn paths_route_to_their_layout() {
        assert_eq!(route("/openstack/"), Some(Route::Versions));
        assert_eq!(
            route("/openstack/latest/meta_data.json"),
            Some(Route::OpenStack("meta_data.json".into()))
        );
        assert_eq!(
            route("/openstack/2015-10-15/network_data.json"),
            Some(Route::OpenStack("network_data.json".into()))
        );
        assert_eq!(route("/openstack/1999-01-01/meta_data.json"), None);
        assert_eq!(route("/openstack/latest/../../etc/passwd"), None);
        assert_eq!(
            route("/nocloud/user-data"),
            Some(Route::NoCloud("user-data".into()))
        );
        assert_eq!(route("/nocloud/secret"), None);
        assert_eq!(route("/ignition/config.ign"), Some(Route::Ignition));
        assert_eq!(route("/latest/meta-data/"), None);
    }

    #[test]
    fn answers_come_from_the_files() {
        let files = BTreeMap::from([
            ("user-data".to_string(), b"#cloud-config\n".to_vec()),
            (
                "meta-data".to_string(),
                br#"{"instance-id":"r-1","local-hostname":"h1","public-keys":[]}"#.to_vec(),
            ),
        ]);
        let r = answer(&Route::OpenStack("user_data".into()), &files);
        assert_eq!(r.status(), StatusCode::OK);
        let r = answer(&Route::OpenStack("network_data.json".into()), &files);
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let r = answer(&Route::NoCloud("network-config".into()), &files);
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let r = answer(&Route::NoCloud("vendor-data".into()), &files);
        assert_eq!(r.status(), StatusCode::OK);
    }
}
