//! A real local control plane: etcd and kube-apiserver (built from Go modules
//! by the set-up) on free loopback ports, with generated certificates and an
//! admin kubeconfig.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use base64::prelude::{BASE64_STANDARD, Engine as _};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::procs::ChildGroup;
use crate::{cached_bin, free_port};

/// A running etcd + kube-apiserver pair. Dropping it stops both and removes
/// their data.
pub struct ControlPlane {
    apiserver: ChildGroup,
    etcd: ChildGroup,
    dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    client: kube::Client,
    url: String,
    startup: Duration,
}

struct Pki {
    ca_pem: String,
    serving_cert: String,
    serving_key: String,
    admin_cert: String,
    admin_key: String,
    sa_key: String,
    sa_pub: String,
    /// The test node's kubelet: its client certificate (`system:node:<NODE_NAME>`),
    /// its serving certificate, and the API server's client certificate for
    /// the kubelet's API (logs, exec).
    kubelet_client: (String, String),
    kubelet_serving: (String, String),
    apiserver_kubelet_client: (String, String),
}

/// The test node's name (`crate::node`).
pub const NODE_NAME: &str = "anneal-node";
/// The test node's address (kubelet refuses a loopback one): put on `lo`
/// while the node runs, so nothing leaves the machine.
pub const NODE_IP: &str = "10.88.255.1";

fn generate_pki() -> anyhow::Result<Pki> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "anneal-test-ca");
    ca_params.distinguished_name = dn;
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, &ca_key);

    let serving_key = KeyPair::generate()?;
    let mut serving =
        CertificateParams::new(vec!["localhost".to_string(), "kubernetes".to_string()])?;
    serving
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse()?));
    serving
        .subject_alt_names
        .push(SanType::IpAddress("10.0.0.1".parse()?));
    // the test node's pods reach it there (crate::node's relay)
    serving
        .subject_alt_names
        .push(SanType::IpAddress(NODE_IP.parse()?));
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "kube-apiserver");
    serving.distinguished_name = dn;
    let serving_cert = serving.signed_by(&serving_key, &issuer)?;

    let admin_key = KeyPair::generate()?;
    let mut admin = CertificateParams::new(Vec::<String>::new())?;
    admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "anneal-test-admin");
    dn.push(DnType::OrganizationName, "system:masters");
    admin.distinguished_name = dn;
    let admin_cert = admin.signed_by(&admin_key, &issuer)?;

    let client = |cn: &str, org: &str| -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, cn);
        dn.push(DnType::OrganizationName, org);
        p.distinguished_name = dn;
        Ok((p.signed_by(&key, &issuer)?.pem(), key.serialize_pem()))
    };
    let kubelet_client = client(&format!("system:node:{NODE_NAME}"), "system:nodes")?;
    let apiserver_kubelet_client = client("kube-apiserver-kubelet-client", "system:masters")?;
    let kubelet_serving = {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(vec![NODE_NAME.to_string()])?;
        p.subject_alt_names
            .push(SanType::IpAddress(NODE_IP.parse()?));
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, NODE_NAME);
        p.distinguished_name = dn;
        (p.signed_by(&key, &issuer)?.pem(), key.serialize_pem())
    };
    let sa = KeyPair::generate()?;
    Ok(Pki {
        kubelet_client,
        kubelet_serving,
        apiserver_kubelet_client,
        ca_pem: ca_cert.pem(),
        serving_cert: serving_cert.pem(),
        serving_key: serving_key.serialize_pem(),
        admin_cert: admin_cert.pem(),
        admin_key: admin_key.serialize_pem(),
        sa_key: sa.serialize_pem(),
        sa_pub: sa.public_key_pem(),
    })
}

fn b64(data: &str) -> String {
    BASE64_STANDARD.encode(data)
}

/// Waits until `port` accepts connections. Fails at once when `child` has
/// exited (for example because another process took the port between
/// `free_port` and its bind).
async fn wait_tcp(
    port: u16,
    child: &mut ChildGroup,
    deadline: Instant,
    what: &str,
    log: &Path,
) -> anyhow::Result<()> {
    while Instant::now() < deadline {
        if let Some(status) = child.try_exit() {
            anyhow::bail!(
                "{what} exited ({status}) before listening on port {port}; log {}:\n{}",
                log.display(),
                crate::tail_file(log)
            );
        }
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!(
        "{what} did not listen on port {port} in time; log {}:\n{}",
        log.display(),
        crate::tail_file(log)
    )
}

/// Writes the control plane's certificates and keys into `d`.
fn write_pki(d: &Path, pki: &Pki) -> anyhow::Result<()> {
    for (name, body) in [
        ("ca.crt", &pki.ca_pem),
        ("apiserver.crt", &pki.serving_cert),
        ("apiserver.key", &pki.serving_key),
        ("sa.key", &pki.sa_key),
        ("sa.pub", &pki.sa_pub),
        ("kubelet-client.crt", &pki.kubelet_client.0),
        ("kubelet-client.key", &pki.kubelet_client.1),
        ("kubelet.crt", &pki.kubelet_serving.0),
        ("kubelet.key", &pki.kubelet_serving.1),
        (
            "apiserver-kubelet-client.crt",
            &pki.apiserver_kubelet_client.0,
        ),
        (
            "apiserver-kubelet-client.key",
            &pki.apiserver_kubelet_client.1,
        ),
    ] {
        std::fs::write(d.join(name), body)?;
    }
    Ok(())
}

/// The kube-apiserver command: serving on `port` with the certificates in
/// `d`, backed by the etcd at `etcd_client`, logging to `api_log`.
fn apiserver_command(
    bin: &Path,
    d: &Path,
    etcd_client: u16,
    port: u16,
    api_log: &Path,
) -> anyhow::Result<Command> {
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--etcd-servers=http://127.0.0.1:{etcd_client}"))
        .arg("--bind-address=127.0.0.1")
        .arg("--advertise-address=127.0.0.1")
        .arg(format!("--secure-port={port}"))
        .arg(format!("--cert-dir={}", d.join("certs").display()))
        .arg(format!(
            "--tls-cert-file={}",
            d.join("apiserver.crt").display()
        ))
        .arg(format!(
            "--tls-private-key-file={}",
            d.join("apiserver.key").display()
        ))
        .arg(format!("--client-ca-file={}", d.join("ca.crt").display()))
        .arg(format!(
            "--service-account-key-file={}",
            d.join("sa.pub").display()
        ))
        .arg(format!(
            "--service-account-signing-key-file={}",
            d.join("sa.key").display()
        ))
        .arg("--service-account-issuer=https://kubernetes.default.svc")
        .arg("--service-cluster-ip-range=10.0.0.0/24")
        // Node: the test node's kubelet (crate::node) acts as
        // system:node:anneal-node; the kubelet flags let the API
        // server reach it (logs, exec) at its InternalIP, never
        // resolving the node's name through the host's resolver.
        .arg("--authorization-mode=Node,RBAC")
        .arg(format!(
            "--kubelet-client-certificate={}",
            d.join("apiserver-kubelet-client.crt").display()
        ))
        .arg(format!(
            "--kubelet-client-key={}",
            d.join("apiserver-kubelet-client.key").display()
        ))
        .arg(format!(
            "--kubelet-certificate-authority={}",
            d.join("ca.crt").display()
        ))
        .arg("--kubelet-preferred-address-types=InternalIP")
        .arg("--enable-priority-and-fairness=false")
        // ANNEAL_CP_PROFILING=1 serves /debug/pprof (a benchmark's profile).
        .arg(format!(
            "--profiling={}",
            std::env::var("ANNEAL_CP_PROFILING").is_ok_and(|v| v == "1")
        ))
        .arg("--v=1")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(d.join("kube-apiserver.out"))?)
        .stderr(std::fs::File::create(api_log)?);
    Ok(cmd)
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("url", &self.url)
            .field("dir", &self.dir)
            .finish()
    }
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver and waits until the API server is ready
    /// (the `default` namespace exists). Ports are picked free, then bound by
    /// the children: when a child dies because another process took its port
    /// in between, the whole start is retried on new ports (three attempts).
    pub async fn start() -> anyhow::Result<Self> {
        let mut last = None;
        for attempt in 1..=3 {
            match Self::start_once().await {
                Ok(cp) => return Ok(cp),
                Err(e) => {
                    eprintln!("control plane start attempt {attempt} failed: {e:#}");
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("control plane did not start")))
    }

    async fn start_once() -> anyhow::Result<Self> {
        let begin = Instant::now();
        let etcd_bin = cached_bin("etcd")?;
        let apiserver_bin = cached_bin("kube-apiserver")?;
        let dir = tempfile::Builder::new().prefix("anneal-cp-").tempdir()?;
        let d = dir.path();
        let pki = generate_pki()?;
        write_pki(d, &pki)?;

        let etcd_client = free_port()?;
        let etcd_peer = free_port()?;
        let etcd_log = d.join("etcd.log");
        let mut etcd = ChildGroup::spawn(
            "etcd",
            Command::new(&etcd_bin)
                .arg("--name=anneal-test")
                .arg(format!("--data-dir={}", d.join("etcd").display()))
                .arg(format!(
                    "--listen-client-urls=http://127.0.0.1:{etcd_client}"
                ))
                .arg(format!(
                    "--advertise-client-urls=http://127.0.0.1:{etcd_client}"
                ))
                .arg(format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"))
                .arg(format!(
                    "--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"
                ))
                .arg(format!(
                    "--initial-cluster=anneal-test=http://127.0.0.1:{etcd_peer}"
                ))
                .arg("--unsafe-no-fsync")
                .arg("--log-level=warn")
                .stdin(Stdio::null())
                .stdout(std::fs::File::create(&etcd_log)?)
                .stderr(std::fs::File::create(d.join("etcd.err"))?),
        )?;
        let deadline = Instant::now() + Duration::from_secs(60);
        wait_tcp(
            etcd_client,
            &mut etcd,
            deadline,
            "etcd",
            &d.join("etcd.err"),
        )
        .await?;

        let port = free_port()?;
        let api_log = d.join("kube-apiserver.log");
        let mut apiserver = ChildGroup::spawn(
            "kube-apiserver",
            &mut apiserver_command(&apiserver_bin, d, etcd_client, port, &api_log)?,
        )?;

        let url = format!("https://127.0.0.1:{port}");
        let kubeconfig_yaml = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: anneal-test\n  cluster:\n    server: {url}\n    certificate-authority-data: {}\nusers:\n- name: admin\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- name: anneal-test\n  context:\n    cluster: anneal-test\n    user: admin\n    namespace: default\ncurrent-context: anneal-test\n",
            b64(&pki.ca_pem),
            b64(&pki.admin_cert),
            b64(&pki.admin_key)
        );
        let kubeconfig = d.join("kubeconfig");
        std::fs::write(&kubeconfig, &kubeconfig_yaml)?;
        let kc = Kubeconfig::from_yaml(&kubeconfig_yaml).context("parsing generated kubeconfig")?;
        let config =
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
        let client = kube::Client::try_from(config)?;

        let deadline = Instant::now() + Duration::from_secs(90);
        wait_tcp(port, &mut apiserver, deadline, "kube-apiserver", &api_log).await?;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        loop {
            if let Some(status) = apiserver.try_exit() {
                anyhow::bail!(
                    "kube-apiserver exited ({status}); log {}:\n{}",
                    api_log.display(),
                    crate::tail_file(&api_log)
                );
            }
            match namespaces.get_opt("default").await {
                Ok(Some(_)) => break,
                _ if Instant::now() > deadline => {
                    anyhow::bail!(
                        "kube-apiserver not ready after 90 s; log {}:\n{}",
                        api_log.display(),
                        crate::tail_file(&api_log)
                    )
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let startup = begin.elapsed();
        Ok(Self {
            apiserver,
            etcd,
            dir,
            kubeconfig,
            client,
            url,
            startup,
        })
    }

    /// A client authenticated as a cluster admin.
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// The admin kubeconfig file.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The API server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Time from `start()` to a ready API server.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// PIDs of etcd and kube-apiserver (to assert teardown).
    pub fn pids(&self) -> [u32; 2] {
        [self.etcd.pid(), self.apiserver.pid()]
    }

    /// The data directory (logs, certificates).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `kubectl` (built by the set-up) pointed at this control plane.
    pub fn kubectl(&self) -> anyhow::Result<Command> {
        let mut cmd = Command::new(cached_bin("kubectl")?);
        cmd.arg(format!("--kubeconfig={}", self.kubeconfig.display()));
        Ok(cmd)
    }

    /// Creates the CRDs and waits until each is Established and served.
    pub async fn install_crds(&self, crds: &[CustomResourceDefinition]) -> anyhow::Result<()> {
        let api: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        for crd in crds {
            api.create(&PostParams::default(), crd)
                .await
                .with_context(|| format!("creating CRD {:?}", crd.metadata.name))?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for crd in crds {
            let name = crd.metadata.name.clone().unwrap_or_default();
            loop {
                let current = api.get(&name).await?;
                let established = current
                    .status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| {
                        c.iter()
                            .any(|c| c.type_ == "Established" && c.status == "True")
                    });
                if established {
                    break;
                }
                if Instant::now() > deadline {
                    anyhow::bail!("CRD {name} not Established after 60 s");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // Established can precede the resource being served; list until it is.
            let version = crd
                .spec
                .versions
                .iter()
                .find(|v| v.storage)
                .map(|v| v.name.clone());
            let gvk = GroupVersionKind::gvk(
                &crd.spec.group,
                &version.unwrap_or_default(),
                &crd.spec.names.kind,
            );
            let ar = ApiResource::from_gvk_with_plural(&gvk, &crd.spec.names.plural);
            let dynamic: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
            while dynamic.list(&ListParams::default().limit(1)).await.is_err() {
                if Instant::now() > deadline {
                    anyhow::bail!("CRD {name} established but not served after 60 s");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.apiserver.kill();
        self.etcd.kill();
    }
}
