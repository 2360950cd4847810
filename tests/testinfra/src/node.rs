//! A real Kubernetes node for the test tier (docs/kubernetes.md, "On a real
//! node (the test tier)"): containerd and runc from Debian, and kubelet,
//! kube-scheduler and kube-controller-manager built by the set-up from the
//! same pinned Go modules as kube-apiserver, joined to a [`ControlPlane`].
//! Pods run FROM-scratch images imported with `ctr` (no registry here); the
//! sandbox image is our own `pause` (tests/node/pause.c). Non-host-network
//! pods get addresses from the `bridge` + `host-local` CNI plugins (no
//! masquerading, no iptables rule).
//!
//! One node per machine at a time (kubelet's cgroups, iptables chains and
//! the CNI bridge are host-wide): [`Node::start`] takes an exclusive lock
//! on `/run/anneal-node.lock` and holds it until the node is stopped, so
//! tests of several binaries that need a node take turns.
//!
//! Everything the node changes on the host is undone by [`Node::stop`] (or
//! on drop): its pods are deleted and their containers stopped, the
//! processes (kubelet, the scheduler, the controller manager, containerd
//! and its shims, found by the socket path only ours use) killed by PID,
//! the mounts under its directories unmounted, the `kubepods` cgroups
//! removed, the iptables chains kubelet added (v4 and v6) deleted,
//! `net.ipv4.ip_forward` restored, the CNI bridge and the node's address
//! (on `lo`: kubelet refuses a loopback node IP) deleted, and its
//! directories removed. [`Node::stop`] returns what it still found
//! ([`Leftovers`]): a test asserts there is none. `ANNEAL_NODE_LOGS=DIR`
//! keeps the node's logs (containerd, kubelet, scheduler, controller
//! manager) in `DIR`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Node as KubeNode;
use kube::api::Api;
use nix::fcntl::{Flock, FlockArg};

use crate::controlplane::{NODE_IP, NODE_NAME};
use crate::procs::ChildGroup;
use crate::{ControlPlane, cached_bin, free_port, run};

/// The node's data (containerd's root, kubelet's root, logs, CNI state).
pub const NODE_DIR: &str = "/var/lib/anneal-node";
/// The node's runtime state (containerd's socket and state).
pub const NODE_RUN: &str = "/run/anneal-node";
/// The CNI bridge the node's pods are attached to.
pub const CNI_BRIDGE: &str = "annealcni0";
/// The pods' network (host-local IPAM).
pub const POD_CIDR: &str = "10.89.0.0/24";
/// The sandbox image (our pause), imported at start.
pub const PAUSE_IMAGE: &str = "docker.io/anneal/pause:test";

/// What a stop found still on the host (empty: all undone).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// `table chain` of iptables/ip6tables chains not there before.
    pub iptables_chains: Vec<String>,
    /// Mount points under the node's directories or of its containers.
    pub mounts: Vec<String>,
    /// `kubepods` cgroup directories.
    pub cgroups: Vec<String>,
    /// Processes of the node still alive (PID and command line).
    pub processes: Vec<String>,
    /// Files and directories of the node still present.
    pub files: Vec<String>,
    /// `net.ipv4.ip_forward` not restored (before, now).
    pub ip_forward: Option<(String, String)>,
    /// The CNI bridge still present.
    pub bridge: bool,
    /// The node's address still on `lo`.
    pub node_ip: bool,
}

impl Leftovers {
    /// True when nothing was left.
    pub fn is_empty(&self) -> bool {
        *self == Leftovers::default()
    }
}

/// Host directories the node's components write whatever they are told
/// (containerd's shim sockets and runc state, the CNI result cache,
/// kubelet's device-plugin socket): removed at stop when they were not
/// there before the start.
const HOST_PATHS: [&str; 3] = ["/run/containerd", "/var/lib/cni", "/var/lib/kubelet"];

/// The host's state before the node started, to restore and compare.
#[derive(Debug, Default)]
struct Before {
    ip_forward: String,
    chains: BTreeSet<String>,
    /// Which of [`HOST_PATHS`] existed (empty: unknown, keep them).
    host_paths: Vec<bool>,
    /// The pods' network namespaces (`/run/netns/cni-*`) already there.
    cni_netns: BTreeSet<String>,
}

/// The CNI plugins' pod network namespaces (`/run/netns/cni-*`).
fn cni_netns() -> BTreeSet<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .filter(|n| n.starts_with("cni-"))
                .collect()
        })
        .unwrap_or_default()
}

/// A running node. Stop it with [`Node::stop`] to learn what was left.
pub struct Node {
    lock: Option<Flock<std::fs::File>>,
    api_relay: Option<crate::TcpForward>,
    containerd: Option<ChildGroup>,
    kubelet: Option<ChildGroup>,
    scheduler: Option<ChildGroup>,
    controller_manager: Option<ChildGroup>,
    kube_proxy: Option<ChildGroup>,
    kubeconfig: PathBuf,
    before: Before,
    startup: Duration,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("name", &NODE_NAME).finish()
    }
}

fn socket() -> PathBuf {
    Path::new(NODE_RUN).join("containerd.sock")
}

/// `table chain` of every chain of iptables and ip6tables.
fn iptables_chains() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (bin, family) in [("iptables-save", "v4"), ("ip6tables-save", "v6")] {
        let Ok(text) = Command::new(bin).stderr(Stdio::null()).output() else {
            continue;
        };
        let mut table = String::new();
        for line in String::from_utf8_lossy(&text.stdout).lines() {
            if let Some(t) = line.strip_prefix('*') {
                table = t.to_string();
            } else if let Some(c) = line.strip_prefix(':') {
                let chain = c.split_whitespace().next().unwrap_or_default();
                out.insert(format!("{family} {table} {chain}"));
            }
        }
    }
    out
}

/// Deletes the iptables tables that had no chain before the node started
/// and hold no rule now: on the nf_tables backend, the node's first
/// `iptables -t <table>` created them (their built-in chains, policy
/// ACCEPT), and removing the node's own chains leaves them behind. Through
/// `nft` (the backend's own tool); a table with any rule is left alone.
fn remove_new_empty_tables(before: &BTreeSet<String>) {
    let now = iptables_chains();
    let mut tables = BTreeSet::new();
    for c in &now {
        let mut parts = c.split(' ');
        if let (Some(family), Some(table)) = (parts.next(), parts.next()) {
            tables.insert((family.to_string(), table.to_string()));
        }
    }
    for (family, table) in tables {
        let prefix = format!("{family} {table} ");
        if before.iter().any(|c| c.starts_with(&prefix)) {
            continue;
        }
        let (save, nft_family) = if family == "v4" {
            ("iptables-save", "ip")
        } else {
            ("ip6tables-save", "ip6")
        };
        let Ok(rules) = Command::new(save).args(["-t", &table]).output() else {
            continue;
        };
        let text = String::from_utf8_lossy(&rules.stdout);
        if text.lines().any(|l| l.starts_with("-A ")) {
            continue;
        }
        let _ = Command::new("nft")
            .args(["delete", "table", nft_family, &table])
            .stderr(Stdio::null())
            .status();
    }
}

fn ip_forward() -> String {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Mount points of the node: under its directories, or a container's
/// rootfs or sandbox mount of containerd's shims.
fn node_mounts() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|m| m.replace("\\040", " "))
        .filter(|m| {
            m.starts_with(NODE_DIR)
                || m.starts_with(NODE_RUN)
                || m.starts_with("/run/containerd/io.containerd.runtime.v2.task/k8s.io/")
                || m.starts_with("/run/netns/cni-")
        })
        .collect()
}

/// `kubepods` cgroup directories (v1 controllers and the unified tree).
fn kubepods_cgroups() -> Vec<String> {
    let mut out = Vec::new();
    let Ok(roots) = std::fs::read_dir("/sys/fs/cgroup") else {
        return out;
    };
    for r in roots.flatten() {
        let p = r.path();
        for name in ["kubepods", "kubepods.slice"] {
            let k = p.join(name);
            if k.is_dir() {
                out.push(k.display().to_string());
            }
        }
    }
    out
}

/// Processes of the node: their command line names our socket or
/// directories (kubelet, containerd, its shims, the pods' processes are
/// children of the shims and go with them).
fn node_processes() -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(p.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmd.contains(NODE_RUN) || cmd.contains(NODE_DIR) {
            out.push((pid, cmd.trim().to_string()));
        }
    }
    out
}

/// Whether the node's address is on `lo`.
fn node_ip_present() -> bool {
    Command::new("ip")
        .args(["-o", "addr", "show", "dev", "lo"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(&format!(" {NODE_IP}/")))
}

/// SIGKILLs every process of a cgroup tree.
fn kill_cgroup_tasks(dir: &Path) {
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                kill_cgroup_tasks(&e.path());
            }
        }
    }
}

/// Removes a cgroup tree bottom-up (only empty directories can go).
fn remove_cgroup(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Writes containerd's configuration and the CNI network into `dir`; the
/// configuration's path.
fn write_containerd_config(dir: &Path) -> anyhow::Result<PathBuf> {
    let config = format!(
        r#"version = 2
root = "{dir}/containerd"
state = "{run}/containerd"
[grpc]
  address = "{sock}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{dir}/cni/net.d"
"#,
        dir = NODE_DIR,
        run = NODE_RUN,
        sock = socket().display(),
    );
    let config_path = dir.join("containerd.toml");
    std::fs::write(&config_path, config)?;
    std::fs::write(
        dir.join("cni/net.d/10-anneal.conflist"),
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "anneal-node",
            "plugins": [{
                "type": "bridge",
                "bridge": CNI_BRIDGE,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    // through the bridge to the host (the API relay)
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": format!("{NODE_DIR}/cni/ipam"),
                },
            }],
        })
        .to_string(),
    )?;
    Ok(config_path)
}

/// Writes the kubelet's kubeconfig (its client certificate from the control
/// plane's directory) and configuration (on a free port) into `dir`.
fn write_kubelet_config(cp: &ControlPlane, dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let cp_dir = cp.dir();
    let kubelet_kubeconfig = dir.join("kubelet.kubeconfig");
    std::fs::write(
        &kubelet_kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {url}\n    certificate-authority: {ca}\nusers:\n- name: kubelet\n  user:\n    client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: kubelet\ncurrent-context: c\n",
            url = cp.url(),
            ca = cp_dir.join("ca.crt").display(),
            cert = cp_dir.join("kubelet-client.crt").display(),
            key = cp_dir.join("kubelet-client.key").display(),
        ),
    )?;
    let kubelet_port = free_port()?;
    let kubelet_config = dir.join("kubelet.yaml");
    std::fs::write(
        &kubelet_config,
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_IP}
port: {kubelet_port}
readOnlyPort: 0
healthzPort: 0
tlsCertFile: {crt}
tlsPrivateKeyFile: {key}
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: {ca}
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{sock}
podLogsDir: {dir}/pod-logs
registerNode: true
serializeImagePulls: false
imageGCHighThresholdPercent: 100
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
makeIPTablesUtilChains: false
localStorageCapacityIsolation: false
"#,
            crt = cp_dir.join("kubelet.crt").display(),
            key = cp_dir.join("kubelet.key").display(),
            ca = cp_dir.join("ca.crt").display(),
            sock = socket().display(),
            dir = NODE_DIR,
        ),
    )?;
    Ok((kubelet_kubeconfig, kubelet_config))
}

impl Node {
    /// Starts a node joined to `cp` and waits until it is Ready. `images`
    /// are OCI archives (`anneal-oci`) imported into containerd first.
    pub async fn start(cp: &ControlPlane, images: &[PathBuf]) -> anyhow::Result<Node> {
        let begin = Instant::now();
        let lock_file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open("/run/anneal-node.lock")
            .context("opening /run/anneal-node.lock")?;
        let lock = tokio::task::spawn_blocking(move || {
            Flock::lock(lock_file, FlockArg::LockExclusive).map_err(|(_, e)| e)
        })
        .await?
        .context("locking /run/anneal-node.lock (one node per machine)")?;
        // A node of a test that was killed: undo what it left first.
        let stale = node_processes();
        for (pid, _) in &stale {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        cleanup_host(&Before::default());
        let before = Before {
            ip_forward: ip_forward(),
            chains: iptables_chains(),
            host_paths: HOST_PATHS.iter().map(|p| Path::new(p).exists()).collect(),
            cni_netns: cni_netns(),
        };
        let mut node = Node {
            lock: Some(lock),
            api_relay: None,
            containerd: None,
            kubelet: None,
            scheduler: None,
            controller_manager: None,
            kube_proxy: None,
            kubeconfig: cp.kubeconfig_path().to_path_buf(),
            before,
            startup: Duration::ZERO,
        };
        node.start_components(cp, images).await?;
        node.startup = begin.elapsed();
        Ok(node)
    }

    async fn start_components(
        &mut self,
        cp: &ControlPlane,
        images: &[PathBuf],
    ) -> anyhow::Result<()> {
        let dir = Path::new(NODE_DIR);
        let logs = dir.join("logs");
        for d in [
            dir.to_path_buf(),
            logs.clone(),
            dir.join("cni/net.d"),
            Path::new(NODE_RUN).to_path_buf(),
        ] {
            std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        let cp_dir = cp.dir();

        // the node's address, on lo
        if !node_ip_present() {
            run(Command::new("ip").args(["addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"]))?;
        }

        // the API server for pods on the pod network (no kube-proxy here):
        // a relay on the node's address, same port
        let api: std::net::SocketAddr = cp
            .url()
            .trim_start_matches("https://")
            .parse()
            .context("the API server's address")?;
        self.api_relay = Some(crate::forward_host_tcp(
            std::net::SocketAddr::new(NODE_IP.parse()?, api.port()),
            api,
        )?);

        // containerd
        let config_path = write_containerd_config(dir)?;
        self.start_containerd(&config_path, &logs, images).await?;

        // kubelet
        let (kubelet_kubeconfig, kubelet_config) = write_kubelet_config(cp, dir)?;
        self.kubelet = Some(ChildGroup::spawn_logged(
            "kubelet",
            Command::new(cached_bin("kubelet")?)
                .arg(format!("--config={}", kubelet_config.display()))
                .arg(format!("--kubeconfig={}", kubelet_kubeconfig.display()))
                .arg(format!("--root-dir={NODE_DIR}/kubelet"))
                .arg(format!("--hostname-override={NODE_NAME}"))
                .arg(format!("--node-ip={NODE_IP}"))
                .arg("--v=1"),
            &logs.join("kubelet.log"),
        )?);

        // the scheduler and the controller manager, as the admin
        let admin = cp.kubeconfig_path().display().to_string();
        self.scheduler = Some(ChildGroup::spawn_logged(
            "kube-scheduler",
            Command::new(cached_bin("kube-scheduler")?)
                .arg(format!("--kubeconfig={admin}"))
                .arg(format!("--authentication-kubeconfig={admin}"))
                .arg(format!("--authorization-kubeconfig={admin}"))
                .arg("--leader-elect=false")
                .arg("--bind-address=127.0.0.1")
                .arg(format!("--secure-port={}", free_port()?))
                .arg("--v=1"),
            &logs.join("kube-scheduler.log"),
        )?);
        self.controller_manager = Some(ChildGroup::spawn_logged(
            "kube-controller-manager",
            Command::new(cached_bin("kube-controller-manager")?)
                .arg(format!("--kubeconfig={admin}"))
                .arg(format!("--authentication-kubeconfig={admin}"))
                .arg(format!("--authorization-kubeconfig={admin}"))
                .arg("--leader-elect=false")
                .arg("--use-service-account-credentials=true")
                .arg(format!(
                    "--service-account-private-key-file={}",
                    cp_dir.join("sa.key").display()
                ))
                .arg(format!(
                    "--root-ca-file={}",
                    cp_dir.join("ca.crt").display()
                ))
                .arg("--bind-address=127.0.0.1")
                .arg(format!("--secure-port={}", free_port()?))
                .arg("--v=1"),
            &logs.join("kube-controller-manager.log"),
        )?);

        // Ready
        self.wait_ready(cp, &logs).await
    }

    /// Waits until the node is Ready, failing when one of its components
    /// exits first.
    async fn wait_ready(&mut self, cp: &ControlPlane, logs: &Path) -> anyhow::Result<()> {
        let nodes: Api<KubeNode> = Api::all(cp.client());
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            for (name, c) in [
                ("kubelet", &mut self.kubelet),
                ("kube-scheduler", &mut self.scheduler),
                ("kube-controller-manager", &mut self.controller_manager),
                ("containerd", &mut self.containerd),
            ] {
                if let Some(st) = c.as_mut().and_then(ChildGroup::try_exit) {
                    anyhow::bail!(
                        "{name} exited ({st}): {}",
                        crate::tail_file(&logs.join(format!("{name}.log")))
                    );
                }
            }
            let ready = nodes
                .get_opt(NODE_NAME)
                .await
                .ok()
                .flatten()
                .is_some_and(|n| {
                    n.status
                        .and_then(|s| s.conditions)
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True")
                });
            if ready {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "node {NODE_NAME} not Ready after 120 s; kubelet: {}",
                crate::tail_file(&logs.join("kubelet.log"))
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Starts containerd with `config_path`, waits for its socket and imports
    /// the pause image and `images`.
    async fn start_containerd(
        &mut self,
        config_path: &Path,
        logs: &Path,
        images: &[PathBuf],
    ) -> anyhow::Result<()> {
        self.containerd = Some(ChildGroup::spawn_logged(
            "containerd",
            Command::new("containerd").arg("--config").arg(config_path),
            &logs.join("containerd.log"),
        )?);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !socket().exists() {
            if let Some(st) = self.containerd.as_mut().and_then(ChildGroup::try_exit) {
                anyhow::bail!(
                    "containerd exited ({st}): {}",
                    crate::tail_file(&logs.join("containerd.log"))
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "containerd's socket did not appear in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut all = vec![pause_image()?];
        all.extend(images.iter().cloned());
        for archive in &all {
            run(Command::new("ctr")
                .arg("--address")
                .arg(socket())
                .args(["-n", "k8s.io", "images", "import"])
                .arg(archive))
            .with_context(|| format!("importing {}", archive.display()))?;
        }
        Ok(())
    }

    /// Where pods reach the API server (set `KUBERNETES_SERVICE_HOST` and
    /// `_PORT` to it: the test node has no kube-proxy for the `kubernetes`
    /// Service): the node's address, relayed to the API server.
    pub fn api_address(&self) -> Option<std::net::SocketAddr> {
        self.api_relay.as_ref().map(|r| r.listen)
    }

    /// From `start()` to Ready.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The node's logs (containerd, kubelet, scheduler, controller manager).
    pub fn log_dir(&self) -> PathBuf {
        Path::new(NODE_DIR).join("logs")
    }

    /// Starts kube-proxy (iptables mode, as the admin) for the tests that
    /// reach a Service from outside the cluster (its `externalIPs`), and
    /// waits until it has programmed the Service `default/kubernetes`. It
    /// changes no sysctl (conntrack limits and timeouts left as they are,
    /// no localhost NodePorts); its KUBE-* chains go with the node's.
    pub async fn start_kube_proxy(&mut self, cp: &ControlPlane) -> anyhow::Result<()> {
        let logs = Path::new(NODE_DIR).join("logs");
        let admin = cp.kubeconfig_path().display().to_string();
        self.kube_proxy = Some(ChildGroup::spawn_logged(
            "kube-proxy",
            Command::new(cached_bin("kube-proxy")?)
                .arg(format!("--kubeconfig={admin}"))
                .arg(format!("--hostname-override={NODE_NAME}"))
                .arg("--proxy-mode=iptables")
                .arg("--iptables-localhost-nodeports=false")
                .arg("--conntrack-max-per-core=0")
                .arg("--conntrack-tcp-timeout-established=0")
                .arg("--conntrack-tcp-timeout-close-wait=0")
                .arg(format!("--healthz-bind-address=127.0.0.1:{}", free_port()?))
                .arg(format!("--metrics-bind-address=127.0.0.1:{}", free_port()?))
                .arg("--v=2"),
            &logs.join("kube-proxy.log"),
        )?);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(st) = self.kube_proxy.as_mut().and_then(ChildGroup::try_exit) {
                anyhow::bail!(
                    "kube-proxy exited ({st}): {}",
                    crate::tail_file(&logs.join("kube-proxy.log"))
                );
            }
            // a Service's rules carry its name in a comment (nat with
            // endpoints, filter without)
            let rules = Command::new("iptables-save")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            if rules.contains("default/kubernetes:https") {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "kube-proxy programmed no Service after 60 s: {}\niptables-save:\n{rules}",
                crate::tail_file(&logs.join("kube-proxy.log"))
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops the node, undoes its changes to the host, and reports what it
    /// still found.
    pub fn stop(mut self) -> Leftovers {
        self.teardown()
    }

    fn teardown(&mut self) -> Leftovers {
        if self.lock.is_none() {
            return Leftovers::default();
        }
        // The pods first, through the API: kubelet stops their containers.
        if self.kubelet.is_some() {
            if let Ok(kubectl) = cached_bin("kubectl") {
                let _ = Command::new(kubectl)
                    .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
                    .args([
                        "delete",
                        "pods",
                        "--all",
                        "--all-namespaces",
                        "--grace-period=0",
                        "--force",
                        "--wait=false",
                        "--request-timeout=10s",
                    ])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline && !self.running_sandboxes().is_empty() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        for c in [
            &mut self.kube_proxy,
            &mut self.controller_manager,
            &mut self.scheduler,
            &mut self.kubelet,
        ] {
            if let Some(mut c) = c.take() {
                c.kill();
            }
        }
        // What kubelet did not stop: every task of containerd's k8s.io
        // namespace, killed and deleted through containerd.
        for id in self.running_sandboxes() {
            let _ = self.ctr(&["-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", &id]);
        }
        if let Some(mut c) = self.containerd.take() {
            c.kill();
        }
        self.api_relay = None;
        // The shims outlive containerd (they are reparented): by PID.
        for (pid, _) in node_processes() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !node_processes().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        // ANNEAL_NODE_LOGS=DIR keeps the node's logs (they go with its
        // directory otherwise).
        if let Some(keep) = std::env::var_os("ANNEAL_NODE_LOGS") {
            let _ = Command::new("cp")
                .arg("-r")
                .arg(self.log_dir())
                .arg(&keep)
                .status();
        }
        cleanup_host(&self.before);
        let left = Leftovers {
            iptables_chains: iptables_chains()
                .difference(&self.before.chains)
                .cloned()
                .collect(),
            mounts: node_mounts(),
            cgroups: kubepods_cgroups(),
            processes: node_processes()
                .into_iter()
                .map(|(p, c)| format!("{p} {c}"))
                .collect(),
            files: [NODE_DIR, NODE_RUN]
                .iter()
                .chain(
                    HOST_PATHS
                        .iter()
                        .zip(&self.before.host_paths)
                        .filter(|(_, existed)| !**existed)
                        .map(|(p, _)| p),
                )
                .filter(|p| Path::new(p).exists())
                .map(|p| (*p).to_string())
                .chain(
                    cni_netns()
                        .difference(&self.before.cni_netns)
                        .map(|n| format!("/run/netns/{n}")),
                )
                .collect(),
            ip_forward: (ip_forward() != self.before.ip_forward)
                .then(|| (self.before.ip_forward.clone(), ip_forward())),
            bridge: Path::new("/sys/class/net").join(CNI_BRIDGE).exists(),
            node_ip: node_ip_present(),
        };
        self.lock = None;
        left
    }

    fn ctr(&self, args: &[&str]) -> anyhow::Result<String> {
        run(Command::new("ctr")
            .arg("--address")
            .arg(socket())
            .args(args))
    }

    /// Task ids of containerd's k8s.io namespace that are not stopped.
    fn running_sandboxes(&self) -> Vec<String> {
        if !socket().exists() {
            return Vec::new();
        }
        self.ctr(&["-n", "k8s.io", "tasks", "ls"])
            .unwrap_or_default()
            .lines()
            .skip(1)
            .filter(|l| !l.contains("STOPPED"))
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let left = self.teardown();
        if !left.is_empty() {
            eprintln!("the test node left on the host: {left:?}");
        }
    }
}

/// The words of an `iptables-save` rule line, as the shell would split
/// them: a double-quoted comment (kube-proxy's `--comment "kubernetes
/// service portals"`) is one word, `\"` inside it a quote.
fn rule_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let (mut quoted, mut started) = (false, false);
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if quoted => {
                if let Some(n) = chars.next() {
                    cur.push(n);
                }
            }
            '"' => {
                quoted = !quoted;
                started = true;
            }
            c if c.is_whitespace() && !quoted => {
                if started {
                    words.push(std::mem::take(&mut cur));
                    started = false;
                }
            }
            c => {
                cur.push(c);
                started = true;
            }
        }
    }
    if started {
        words.push(cur);
    }
    words
}

/// Undoes the node's host changes: mounts, cgroups, the iptables chains
/// that are not in `before` (kubelet's KUBE-* and the CNI plugins'
/// CNI-*; all of them when `before` is empty, at a start after a killed
/// test), ip_forward (when `before` knows it), the bridge, the directories.
fn cleanup_host(before: &Before) {
    let mut mounts = node_mounts();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for m in mounts {
        let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
    }
    // What still runs in the pods' cgroups (a container whose shim was
    // killed is reparented, not stopped) is the node's: killed by PID, then
    // the cgroups go once they are empty.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let cgroups = kubepods_cgroups();
        if cgroups.is_empty() || Instant::now() > deadline {
            break;
        }
        for c in &cgroups {
            kill_cgroup_tasks(Path::new(c));
            remove_cgroup(Path::new(c));
        }
        if !kubepods_cgroups().is_empty() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    for chain in iptables_chains().difference(&before.chains) {
        let mut parts = chain.split(' ');
        let (Some(family), Some(table), Some(name)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if !(name.starts_with("KUBE-") || name.starts_with("CNI-")) {
            continue;
        }
        let bin = if family == "v4" {
            "iptables"
        } else {
            "ip6tables"
        };
        // references to it first (rules jumping to it), then the chain
        if let Ok(rules) = Command::new(format!("{bin}-save"))
            .args(["-t", table])
            .output()
        {
            for line in String::from_utf8_lossy(&rules.stdout).lines() {
                if line.starts_with("-A ") && line.contains(&format!("-j {name}")) {
                    let mut args = rule_words(line);
                    args[0] = "-D".into();
                    let _ = Command::new(bin).args(["-t", table]).args(&args).status();
                }
            }
        }
        let _ = Command::new(bin).args(["-t", table, "-F", name]).status();
        let _ = Command::new(bin).args(["-t", table, "-X", name]).status();
    }
    remove_new_empty_tables(&before.chains);
    if !before.ip_forward.is_empty() && ip_forward() != before.ip_forward {
        let _ = std::fs::write("/proc/sys/net/ipv4/ip_forward", &before.ip_forward);
    }
    if Path::new("/sys/class/net").join(CNI_BRIDGE).exists() {
        let _ = Command::new("ip")
            .args(["link", "del", CNI_BRIDGE])
            .status();
    }
    if node_ip_present() {
        let _ = Command::new("ip")
            .args(["addr", "del", &format!("{NODE_IP}/32"), "dev", "lo"])
            .status();
    }
    for d in [NODE_DIR, NODE_RUN] {
        let _ = std::fs::remove_dir_all(d);
    }
    // the pods' network namespaces (unmounted above with the node's mounts)
    if !before.host_paths.is_empty() {
        for ns in cni_netns().difference(&before.cni_netns) {
            let _ = std::fs::remove_file(Path::new("/run/netns").join(ns));
        }
    }
    for (p, existed) in HOST_PATHS.iter().zip(&before.host_paths) {
        if !existed {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// Our pause image (tests/node/pause.c, static with musl-gcc, packed by
/// `anneal-oci`), built once into the cache.
fn pause_image() -> anyhow::Result<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../node/pause.c");
    let source = std::fs::read(&src).with_context(|| format!("reading {}", src.display()))?;
    let digest = {
        use std::hash::{Hash as _, Hasher as _};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        source.hash(&mut h);
        format!("{:016x}", h.finish())
    };
    let dir = crate::cache_dir().join("node");
    std::fs::create_dir_all(&dir)?;
    let archive = dir.join(format!("pause-{digest}.oci.tar"));
    if archive.exists() {
        return Ok(archive);
    }
    let bin = dir.join(format!("pause-{digest}"));
    run(Command::new("musl-gcc")
        .args(["-static", "-Os", "-o"])
        .arg(&bin)
        .arg(&src))?;
    let oci = crate::workspace_bin("anneal-oci")?;
    let tmp = dir.join(format!("pause-{digest}.tmp.tar"));
    run(Command::new(oci)
        .args(["build", "--name", "anneal/pause", "--tag", "test"])
        .args(["--entrypoint", "/pause", "--user", "65535:65535"])
        .arg(format!("--file=pause={}", bin.display()))
        .arg("--out")
        .arg(&tmp))?;
    std::fs::rename(&tmp, &archive)?;
    Ok(archive)
}

#[cfg(test)]
mod tests {
    use super::rule_words;

    #[test]
    fn a_quoted_comment_is_one_word() {
        assert_eq!(
            rule_words(
                r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#
            ),
            [
                "-A",
                "PREROUTING",
                "-m",
                "comment",
                "--comment",
                "kubernetes service portals",
                "-j",
                "KUBE-SERVICES"
            ]
        );
        assert_eq!(
            rule_words(r#"-A X --comment "a \"b\"" -j Y"#),
            ["-A", "X", "--comment", "a \"b\"", "-j", "Y"]
        );
        assert_eq!(rule_words("-A X  -j Y "), ["-A", "X", "-j", "Y"]);
    }
}
