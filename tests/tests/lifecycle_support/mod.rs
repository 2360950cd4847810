//! Shared by the lifecycle and Redfish tests: a QEMU VM powered off (`-S`)
//! with its BMC, sushy-emulator, and small polling helpers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anneal_manager::redfish::{BmcAddress, Credentials, PowerState, RedfishClient, TlsPolicy};
use anneal_qemu_bmc::{BmcConfig, LogEntry, RunningBmc};
use anneal_testinfra::{ChildGroup, DiskBus, DiskConfig, Netns, NicConfig, Vm, VmConfig};

pub const BMC_USER: &str = "admin";
pub const BMC_PASSWORD: &str = "s3cret-bmc-pw";

/// A VM that starts powered off, and the files of its BMC.
pub struct BmcVm {
    pub vm: Vm,
    pub dir: tempfile::TempDir,
    pub bmc: Option<RunningBmc>,
    pub addr: SocketAddr,
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
}

impl BmcVm {
    /// Launches an OVMF VM (NIC with iPXE ROM on a tap of `ns`, one blank
    /// disk), paused, and starts its BMC on a free loopback port.
    pub async fn launch(ns: &Netns, mac: &str, tls: Option<(Vec<u8>, Vec<u8>)>) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("anneal-bmcvm-")
            .tempdir()
            .unwrap();
        let disk = dir.path().join("disk.img");
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(32 << 20)
            .unwrap();
        let tap = ns.add_tap().unwrap();
        let cfg = VmConfig {
            memory_mib: 512,
            cpus: 1,
            nics: vec![NicConfig::virtio(&tap, mac)],
            disks: vec![DiskConfig {
                path: disk,
                format: "raw".into(),
                bus: DiskBus::VirtioBlk,
                serial: "BMCDISK01".into(),
            }],
            extra_args: vec!["-S".into(), "-no-shutdown".into()],
            no_reboot: false,
            ..VmConfig::default()
        };
        let vm = Vm::launch(&cfg, Some(ns)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !vm.qmp_path().exists() {
            assert!(Instant::now() < deadline, "no qmp socket");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut me = Self {
            vm,
            dir,
            bmc: None,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            tls,
        };
        me.start_bmc().await;
        me
    }

    pub fn request_log_path(&self) -> PathBuf {
        self.dir.path().join("requests.jsonl")
    }

    pub fn state_path(&self) -> PathBuf {
        self.dir.path().join("bmc-state.json")
    }

    pub fn requests(&self) -> Vec<LogEntry> {
        anneal_qemu_bmc::read_request_log(&self.request_log_path())
    }

    /// (Re)starts the BMC on its port (a free one the first time).
    pub async fn start_bmc(&mut self) {
        let bmc = anneal_qemu_bmc::start(BmcConfig {
            listen: self.addr,
            qmp: self.vm.qmp_path().to_path_buf(),
            state_file: self.state_path(),
            request_log: Some(self.request_log_path()),
            username: BMC_USER.into(),
            password: BMC_PASSWORD.into(),
            system_id: "vm0".into(),
            tls: self.tls.clone(),
        })
        .await
        .unwrap();
        self.addr = bmc.addr();
        self.bmc = Some(bmc);
    }

    pub async fn stop_bmc(&mut self) {
        if let Some(b) = self.bmc.take() {
            b.stop().await;
        }
    }

    pub fn address(&self) -> String {
        let scheme = if self.tls.is_some() {
            "redfish"
        } else {
            "redfish+http"
        };
        format!("{scheme}://127.0.0.1:{}", self.addr.port())
    }
}

/// A running `sushy-emulator --fake` on a free loopback port.
pub struct Sushy {
    pub child: ChildGroup,
    pub port: u16,
}

impl Sushy {
    pub async fn start() -> Self {
        let bin = anneal_testinfra::cached_bin("sushy-emulator")
            .expect("sushy-emulator: run tests/setup.d/sushy.sh");
        let port = anneal_testinfra::free_port().unwrap();
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut cmd = Command::new(bin);
        cmd.args(["--fake", "-i", "127.0.0.1", "-p", &port.to_string()])
            .stdout(log.reopen().unwrap())
            .stderr(log.reopen().unwrap());
        let child = ChildGroup::spawn("sushy-emulator", &mut cmd).unwrap();
        let me = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            assert!(Instant::now() < deadline, "sushy-emulator did not start");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        me
    }
}

pub fn client(address: &str, password: &str, tls: TlsPolicy) -> RedfishClient {
    RedfishClient::new(
        &BmcAddress::parse(address).unwrap(),
        &Credentials {
            username: BMC_USER.into(),
            password: anneal_api::agent::Token::new(password),
        },
        &tls,
        Duration::from_secs(5),
    )
    .unwrap()
}

pub async fn wait_power(c: &RedfishClient, want: PowerState, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let got = c.power_state().await.unwrap();
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "power state stayed {got:?}, wanted {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Polls `f` until it returns Some, or panics with `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A CA and a serving certificate for 127.0.0.1 (PEM): (ca, cert, key).
pub fn test_pki() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, &ca_key);
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    leaf.subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    (ca_cert.pem(), cert.pem(), key.serialize_pem())
}

// ---------------------------------------------------------------------------
// The manager's lifecycle half, run in its own runtime so a test can kill it
// (drop every task at once, like a process kill) and start it again.

use std::sync::{Arc, Mutex};

use anneal_api::Machine;
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::lifecycle::LifecycleConfig;
use kube::api::Api;

/// Everything the process logs (all tracing output, debug level).
#[derive(Clone, Default)]
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

    pub async fn register(&self, token: &str, machine: Option<&str>) -> (u16, serde_json::Value) {
        let mut body = serde_json::json!({
            "bootToken": token,
            "bootMac": "52:54:00:00:00:00",
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
        },
        firmware: anneal_api::agent::Firmware {
            mode: anneal_api::agent::FirmwareMode::Uefi,
            secure_boot: false,
        },
        system: Default::default(),
    })
    .unwrap()
}

pub async fn boot_token(client: &kube::Client, machine: &str) -> Option<String> {
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), "default");
    let s = secrets
        .get_opt(&format!("{machine}-boot-token"))
        .await
        .unwrap()?;
    let b = s.data?.get("token")?.0.clone();
    String::from_utf8(b).ok()
}

pub async fn create_namespace(client: &kube::Client, name: &str) {
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
    let _ = api.create(&Default::default(), &ns).await;
}
