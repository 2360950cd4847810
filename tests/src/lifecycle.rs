//! The manager's lifecycle half run in its own runtime (killable like a
//! process), a log capture, the agent side of the protocol over HTTPS, and
//! the Machine/Secret/Namespace fixtures of the lifecycle tests.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anneal_api::Machine;
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_manager::redfish::TlsPolicy;
use kube::api::Api;

use crate::bmc::BMC_USER;

/// Everything the process logs (all tracing output, debug level).
#[derive(Clone, Debug, Default)]
pub struct LogBuffer(pub Arc<Mutex<Vec<u8>>>);

impl LogBuffer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs a global subscriber capturing every log line at debug level.
pub fn capture_logs() -> LogBuffer {
    let buf = LogBuffer::default();
    let w = buf.clone();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("debug"))
        .with_ansi(false)
        .with_writer(move || w.clone())
        .try_init();
    buf
}

#[derive(Debug)]
pub struct Manager {
    rt: Option<tokio::runtime::Runtime>,
    pub api_addr: SocketAddr,
    pub ca_pem: String,
    pub ca_sha256: String,
}

impl Manager {
    pub fn start(kubeconfig: &std::path::Path, lc: LifecycleConfig, api: AgentApiConfig) -> Self {
        let kubeconfig = kubeconfig.to_path_buf();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let (addr, ca, sha) = rt.block_on(async move {
                let kc = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
                let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                    .await
                    .unwrap();
                let client = kube::Client::try_from(cfg).unwrap();
                let cancel = tokio_util::sync::CancellationToken::new();
                let (srv, _ctl) = anneal_manager::lifecycle::start(client, lc, api, cancel)
                    .await
                    .unwrap();
                (
                    srv.addr(),
                    srv.pki().ca_pem.clone(),
                    srv.pki().ca_sha256.clone(),
                )
            });
            Manager {
                rt: Some(rt),
                api_addr: addr,
                ca_pem: ca,
                ca_sha256: sha,
            }
        })
        .join()
        .unwrap()
    }

    /// Drops every task of the manager at once.
    pub fn kill(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.kill();
    }
}

pub async fn machine_json(api: &Api<Machine>, name: &str) -> serde_json::Value {
    serde_json::to_value(api.get(name).await.unwrap()).unwrap()
}

/// A condition of a Machine as (status, reason).
pub fn cond(m: &serde_json::Value, type_: &str) -> Option<(String, String)> {
    m["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_string(),
                c["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
}

/// A Machine pointing at a BMC (or none) with credentials in `secret`.
pub fn machine(name: &str, mac: &str, bmc: Option<(&str, &str)>) -> Machine {
    let mut spec = serde_json::json!({
        "subnetRef": {"name": "lab"},
        "bootMACAddress": mac,
    });
    if let Some((address, secret)) = bmc {
        spec["bmc"] = serde_json::json!({
            "address": address,
            "credentialsSecretRef": {"name": secret},
        });
    }
    serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }))
    .unwrap()
}

pub fn credentials_secret(name: &str, password: &str) -> k8s_openapi::api::core::v1::Secret {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "default"},
        "stringData": {"username": BMC_USER, "password": password},
    }))
    .unwrap()
}

/// The agent side of the protocol, over real HTTPS trusting the manager's CA.
#[derive(Debug)]
pub struct AgentClient {
    pub ep: anneal_manager::redfish::Endpoint,
}

impl AgentClient {
    pub fn new(addr: SocketAddr, ca_pem: &str) -> Self {
        let tls =
            anneal_manager::redfish::tls_config(&TlsPolicy::CaBundle(ca_pem.as_bytes().to_vec()))
                .unwrap();
        Self {
            ep: anneal_manager::redfish::Endpoint {
                host: "127.0.0.1".into(),
                port: addr.port(),
                tls: Some(tls),
                timeout: Duration::from_secs(40),
            },
        }
    }

    /// Sends a request with the schema header (unless `schema` is None).
    pub async fn call(
        &self,
        method: hyper::Method,
        path: &str,
        bearer: Option<&str>,
        schema: Option<&str>,
        body: Option<serde_json::Value>,
    ) -> (u16, serde_json::Value) {
        let auth = bearer.map(|b| format!("Bearer {b}"));
        let headers: Vec<(&str, &str)> = schema
            .map(|s| vec![(anneal_api::agent::SCHEMA_HEADER, s)])
            .unwrap_or_default();
        let r = anneal_manager::redfish::http::exchange_with(
            &self.ep,
            method,
            path,
            auth.as_deref(),
            &headers,
            body.map(|b| b.to_string().into_bytes()),
        )
        .await
        .unwrap();
        let v = serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null);
        (r.status.as_u16(), v)
    }

    /// `GET next` with the session and schema 1.
    pub async fn next(&self, session: &str) -> (u16, serde_json::Value) {
        self.call(
            hyper::Method::GET,
            anneal_api::agent::paths::NEXT,
            Some(session),
            Some("1"),
            None,
        )
        .await
    }

    /// `POST result` of run or action `id` with `outcome`, schema 1.
    pub async fn result(
        &self,
        session: &str,
        id: &str,
        outcome: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        self.call(
            hyper::Method::POST,
            anneal_api::agent::paths::RESULT,
            Some(session),
            Some("1"),
            Some(serde_json::json!({"runId": id, "outcome": outcome})),
        )
        .await
    }

    pub async fn register(&self, token: &str, machine: Option<&str>) -> (u16, serde_json::Value) {
        self.register_as(token, machine, "52:54:00:00:00:00").await
    }

    /// [`AgentClient::register`] from boot MAC `mac`: a registration that must
    /// succeed names the Machine's `spec.bootMACAddress` (docs/api.md, "Agent
    /// protocol").
    pub async fn register_as(
        &self,
        token: &str,
        machine: Option<&str>,
        mac: &str,
    ) -> (u16, serde_json::Value) {
        let mut body = serde_json::json!({
            "bootToken": token,
            "bootMac": mac,
            "agentVersion": "test-0.1",
        });
        if let Some(m) = machine {
            body["machine"] = m.into();
        }
        self.call(
            hyper::Method::POST,
            anneal_api::agent::paths::REGISTER,
            None,
            Some("1"),
            Some(body),
        )
        .await
    }
}

pub fn sample_hardware() -> serde_json::Value {
    serde_json::to_value(anneal_api::agent::HardwareReport {
        disks: vec![anneal_api::agent::Disk {
            device_name: "vda".into(),
            size_bytes: 32 << 20,
            logical_sector_size: 512,
            physical_sector_size: 512,
            serial_number: Some("BMCDISK01".into()),
            bus: Some("virtio".into()),
            ..Default::default()
        }],
        nics: vec![anneal_api::agent::Nic {
            name: "eth0".into(),
            mac: "52:54:00:7f:10:01".into(),
            link: true,
            driver: Some("virtio_net".into()),
            ..Default::default()
        }],
        memory_bytes: 512 << 20,
        cpu: anneal_api::agent::Cpu {
            count: 1,
            model: Some("QEMU TCG".into()),
            architecture: Some("x86_64".into()),
        },
        firmware: anneal_api::agent::Firmware {
            mode: anneal_api::agent::FirmwareMode::Uefi,
            secure_boot: false,
        },
        system: Default::default(),
    })
    .unwrap()
}

/// The agent API of a test manager: HTTPS on 127.0.0.1 (a free port), its
/// CA in `anneal-system`, a 2 s long poll.
pub fn loopback_agent_api() -> anneal_manager::agentapi::AgentApiConfig {
    anneal_manager::agentapi::AgentApiConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        namespace: "anneal-system".into(),
        server_names: vec!["127.0.0.1".into()],
        long_poll: std::time::Duration::from_secs(2),
        ..anneal_manager::agentapi::AgentApiConfig::default()
    }
}

pub async fn boot_token(client: &kube::Client, machine: &str) -> Option<String> {
    secret_token(client, "default", &format!("{machine}-boot-token")).await
}

/// The boot token of Machine `machine` (namespace default) once it is
/// armed: its Secret holds a token whose hash the Machine's
/// `status.netBoot.tokenHash` carries. The Secret is written before the
/// status, so a token read from the Secret alone may not register yet.
pub async fn armed_boot_token(client: &kube::Client, machine: &str) -> Option<String> {
    let token = boot_token(client, machine).await?;
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let m = machines.get_opt(machine).await.unwrap()?;
    let armed = m
        .status
        .as_ref()?
        .net_boot
        .as_ref()?
        .token_hash
        .as_deref()?;
    (armed == anneal_manager::lifecycle::status::token_hash(&token)).then_some(token)
}

/// The token held by boot-token Secret `namespace/name`, if it exists.
pub async fn secret_token(client: &kube::Client, namespace: &str, name: &str) -> Option<String> {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), namespace);
    let s = secrets.get_opt(name).await.unwrap()?;
    let b = s.data?.get("token")?.0.clone();
    String::from_utf8(b).ok()
}

pub async fn create_namespace(client: &kube::Client, name: &str) {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    let _ = api.create(&Default::default(), &ns).await;
}

/// A started control plane made ready for the manager's lifecycle half:
/// the CRDs, the `anneal-system` namespace, and a BMC credentials Secret
/// (`BMC_USER` and a password) per `(name, password)`. Returns its client.
pub async fn prepare(
    cp: &anneal_testinfra::ControlPlane,
    secrets: &[(&str, &str)],
) -> kube::Client {
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    create_namespace(&client, "anneal-system").await;
    let api: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), "default");
    for (name, password) in secrets {
        api.create(
            &kube::api::PostParams::default(),
            &credentials_secret(name, password),
        )
        .await
        .unwrap();
    }
    client
}

/// Waits for an Event in `default` matching `f` (what: for the message).
pub async fn event(
    client: &kube::Client,
    what: &str,
    deadline: std::time::Duration,
    f: impl Fn(&k8s_openapi::api::events::v1::Event) -> bool,
) -> k8s_openapi::api::events::v1::Event {
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(client.clone(), "default");
    crate::eventually(what, deadline, || async {
        events
            .list(&kube::api::ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .find(|e| f(e))
    })
    .await
}
