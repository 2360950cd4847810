//! The end-to-end inspection lab, shared by `tests/tests/e2e_inspect.rs` and
//! the demo (`tests/examples/demo.rs`): a real control plane, the manager's
//! lifecycle half (Machine controller + HTTPS agent API) in-process, bootd
//! (DHCP/TFTP/HTTP inside a test namespace, its Machine/Subnet watcher on the
//! host side), the static musl agent in an initramfs built by our builder
//! from the Debian kernel's modules, and a QEMU VM on OVMF behind
//! `anneal-qemu-bmc`.
//!
//! The manager powers the VM on itself: the VM is launched paused (`-S
//! -no-shutdown`, i.e. powered off), its BMC listens on host loopback, and the
//! Machine points at it; arming the net boot sets a one-time Pxe override and
//! powers on. OVMF's own PXE client (no NIC option ROM, as on real hardware)
//! gets `snponly.efi` from bootd over TFTP, iPXE fetches the per-machine
//! script over HTTP, then the kernel and the initramfs.
//!
//! Network: the VM sits on `br0` (10.77.0.1/24) of a fresh namespace with
//! router advertisements; the agent API listens on 127.0.0.1 (host) and is
//! reached from the namespace through `Netns::forward_tcp` at
//! 10.77.0.1:8443, which its serving certificate names.
//!
//! The manager's reservations controller (`anneal_manager::ipam`, as
//! `manager run` starts it) writes the machine's reservation when it starts
//! inspecting: the lowest address of the lease range.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anneal_api::{Machine, MachineHardware, NicLldp, Subnet};
use anneal_bootd::watch::WatchConfig;
use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig};
use anneal_manager::agentapi::{AgentApiConfig, RunningAgentApi};
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_qemu_bmc::{BmcConfig, RunningBmc};
use anneal_testinfra::{
    ChildGroup, ControlPlane, DebianKernel, DiskBus, DiskConfig, Firmware, Netns, NicConfig,
    TcpForward, Vm, VmConfig, debian_kernel, debian_kernel_arm64,
};
use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;

/// Namespace and name of the Machine.
pub const NAMESPACE: &str = "default";
pub const MACHINE: &str = "inspect-vm";
pub const SUBNET: &str = "lab";
/// The VM's NIC.
pub const MAC: &str = "52:54:00:e2:e0:01";
/// Its reserved address (lease mode): the first of the lease range, written
/// by the manager's reservations controller.
pub const ADDRESS: &str = "10.77.0.100";
/// bootd's address on the segment, and where the agent API is relayed.
pub const SERVER_IP: &str = "10.77.0.1";
pub const API_URL: &str = "https://10.77.0.1:8443";
/// The VM's shape, as on the QEMU command line.
pub const MEMORY_MIB: u32 = 1024;
pub const CPUS: u32 = 2;
/// (bus, serial, size in MiB, kernel name).
pub const DISKS: [(DiskBus, &str, u64, &str); 2] = [
    (DiskBus::VirtioBlk, "E2EVBLK0001", 256, "vda"),
    (DiskBus::Nvme, "E2ENVME0001", 128, "nvme0n1"),
];
/// The deploy lab's disks: the OS disk must hold the test OS image.
pub const DEPLOY_DISKS: [(DiskBus, &str, u64, &str); 2] = [
    (DiskBus::VirtioBlk, "E2EVBLK0001", 3 << 10, "vda"),
    (DiskBus::Nvme, "E2ENVME0001", 256, "nvme0n1"),
];
/// Where the VM reaches the content server (relayed to host loopback).
pub const CONTENT_URL: &str = "http://10.77.0.1:8088";
const BMC_USER: &str = "admin";
const BMC_PASSWORD: &str = "e2e-bmc-password";
const FILES: &str = "{snponly.efi: /usr/lib/ipxe/snponly.efi, ipxe.efi: /usr/lib/ipxe/ipxe.efi, undionly.kpxe: /usr/lib/ipxe/undionly.kpxe}";

/// Everything the flow runs on. Fields drop in order: the VM and its BMC
/// first, the namespace and the control plane last.
#[derive(Debug)]
pub struct Lab {
    /// Stops the manager's workload processes (dropped first of the fields).
    _workloads: Option<WorkloadsGuard>,
    pub vm: Option<Vm>,
    bmc: Option<RunningBmc>,
    /// The VM's tap on `br0` (its switch port), once launched.
    pub vm_tap: Option<String>,
    /// lldpd playing the switch on the VM's tap ([`Lab::start_lldp`]).
    lldpd: Option<ChildGroup>,
    /// When QEMU was launched (paused, i.e. powered off).
    pub vm_launched: Option<Instant>,
    pub bootd: NetnsServer,
    _forward: TcpForward,
    pub api: RunningAgentApi,
    cancel: CancellationToken,
    pub ns: Netns,
    pub cp: ControlPlane,
    /// Artifacts, logs (`lab.log`: manager and bootd), the BMC's files.
    pub dir: PathBuf,
    pub initrd: PathBuf,
    pub initrd_bytes: u64,
    /// The VM's disks (bus, serial, MiB, kernel name).
    pub disks: Vec<(DiskBus, &'static str, u64, &'static str)>,
    /// The content store (deploy lab only).
    pub store: Option<PathBuf>,
    /// [`LabOptions::secure_boot`].
    secure_boot: bool,
    /// [`LabOptions::aarch64`].
    aarch64: bool,
    _content_forward: Option<TcpForward>,
    /// The second VM, once launched.
    pub peer: Option<PeerVm>,
}

/// What a lab runs besides the inspection spine.
#[derive(Debug, Clone, Copy, Default)]
pub struct LabOptions {
    /// The rest of the manager (claims, images and content with the
    /// `process` executor, the content server relayed at [`CONTENT_URL`]),
    /// bigger disks ([`DEPLOY_DISKS`]).
    pub deploy: bool,
    /// The manager's fast-track window (`--fast-track-window`): an Available
    /// machine's agent stays up that long after registering.
    pub fast_track_window: Option<Duration>,
    /// The manager's deploy stall timeout (`--deploy-stall-timeout`; the
    /// default when None).
    pub stall_timeout: Option<Duration>,
    /// The agent API's session TTL and renewal period (600 s and 300 s when
    /// None): a short TTL shows that a run outliving it keeps its session.
    pub session: Option<(Duration, Duration)>,
    /// UEFI Secure Boot with the Microsoft keys (OVMF's Secure Boot code and
    /// `OVMF_VARS_4M.ms.fd`), the Machine with `bootLoader: shim`: Debian's
    /// signed shim, network GRUB and kernel (tests/setup.d/secureboot.sh).
    pub secure_boot: bool,
    /// An arm64 machine (docs/testing.md, "arm64"): AAVMF on QEMU's `virt`
    /// board, the Machine of `architecture: aarch64` with `bootLoader: shim`
    /// (Debian's arm64 shim and network GRUB: no arm64 iPXE is available
    /// here), the aarch64 agent in an initramfs of the arm64 kernel's modules,
    /// served as bootd's `artifacts.aarch64`.
    pub aarch64: bool,
    /// Distribution (docs/distribution.md; deploy lab only): the Site gets a
    /// tracker on [`SERVER_IP`] (`spec.tracker.ip`, the lab Subnet as its
    /// seeder Subnet), the manager runs it and the seeders inside the lab's
    /// namespace (on the VMs' bridge: no NAT in front of a peer), and plans
    /// carry each content's swarm.
    pub swarm: bool,
}

/// The lab's second machine ([`Lab::launch_peer`]).
pub const PEER: &str = "peer-vm";
/// Its boot MAC.
pub const PEER_MAC: &str = "52:54:00:e2:e0:02";

/// A second VM of the lab with its own BMC and disks (under `<lab>/peer`).
#[derive(Debug)]
pub struct PeerVm {
    /// The VM.
    pub vm: Vm,
    _bmc: RunningBmc,
}

impl PeerVm {
    /// Its serial console so far.
    pub fn console(&self) -> String {
        self.vm.serial_text()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        self.cancel.cancel();
        if let Some(mut vm) = self.vm.take() {
            vm.kill();
        }
        if let Some(mut p) = self.peer.take() {
            p.vm.kill();
        }
        if let Some(mut lldpd) = self.lldpd.take() {
            lldpd.kill();
        }
    }
}

/// Kills, on drop, the process group of every workload the manager's
/// process executor started under a content store (`.workloads/<ns>/<name>/
/// pid` without an `exit` beside it: still running). The manager stops them
/// itself when its scope is cancelled and it gets to run again; a lab that
/// fails to start, or whose runtime is dropped first, does not give it that
/// chance (the content server of a failed e2e_arm64 outlived its test).
#[derive(Debug)]
struct WorkloadsGuard(PathBuf);

impl Drop for WorkloadsGuard {
    fn drop(&mut self) {
        let Ok(namespaces) = std::fs::read_dir(self.0.join(".workloads")) else {
            return;
        };
        for ns in namespaces.flatten() {
            let Ok(names) = std::fs::read_dir(ns.path()) else {
                continue;
            };
            for w in names.flatten() {
                let dir = w.path();
                if dir.join("exit").exists() {
                    continue;
                }
                // the executor starts each as the leader of its own group
                if let Some(pid) = std::fs::read_to_string(dir.join("pid"))
                    .ok()
                    .and_then(|p| p.trim().parse::<u32>().ok())
                {
                    anneal_testinfra::kill_process_group(pid);
                }
            }
        }
    }
}

/// Builds (or reuses) the static agent and the initramfs; returns its path.
/// `ANNEAL_AGENT_BIN` names an already built static agent instead (x86_64).
fn build_artifacts(dir: PathBuf, modules: PathBuf, aarch64: bool) -> PathBuf {
    let tool = crate::artifacts::initramfs_tool();
    if aarch64 {
        let agent = crate::artifacts::agent_musl_aarch64();
        let initrd = dir.join("agent-arm64.cpio.zst");
        crate::artifacts::build_initramfs_arm64(&tool, &agent, &modules, &initrd);
        return initrd;
    }
    let agent = std::env::var_os("ANNEAL_AGENT_BIN")
        .map_or_else(crate::artifacts::agent_musl, PathBuf::from);
    let initrd = dir.join("agent.cpio.zst");
    crate::artifacts::build_initramfs(&tool, &agent, &modules, &initrd);
    initrd
}

/// A directory whose `anneal-agent` runs the real one (in `bin`), but the
/// Site's tracker and seeders inside the lab's namespace `ns`: they listen
/// on the VMs' bridge, as they would on a provisioning network, where the
/// manager's host in the lab (the root namespace) has no address.
fn swarm_bin_dir(dir: &Path, bin: &Path, ns: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let out = dir.join("swarm-bin");
    std::fs::create_dir_all(&out)?;
    let real = bin.join("anneal-agent");
    let script = out.join("anneal-agent");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ncase \"$1\" in\n  seed|tracker) exec ip netns exec {ns} {real} \"$@\" ;;\nesac\nexec {real} \"$@\"\n",
            real = real.display()
        ),
    )?;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    Ok(out)
}

/// Sends the manager's and bootd's logs to `path` (first caller wins).
fn log_to(path: &std::path::Path) {
    if let Ok(f) = std::fs::File::create(path) {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "info,anneal_bootd=debug,kube=warn,hyper=warn",
            ))
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(f))
            .try_init();
    }
}

/// The lifecycle half's configuration for the lab, and the swarm's when
/// the lab has one.
fn lifecycle_config(
    opts: &LabOptions,
) -> (LifecycleConfig, Option<anneal_manager::swarm::SwarmConfig>) {
    let mut lc = LifecycleConfig {
        boot_token_lifetime: Duration::from_secs(600),
        graceful_shutdown_timeout: Duration::from_secs(3),
        bmc_timeout: Duration::from_secs(5),
        // the BMCs of the tests speak plain HTTP (redfish+http://)
        allow_insecure_bmc: true,
        ..LifecycleConfig::default()
    };
    if opts.deploy {
        lc.deploy.content_url = Some(CONTENT_URL.into());
        lc.health_interval = Duration::from_secs(10);
    }
    let swarm = opts.swarm.then(|| anneal_manager::swarm::SwarmConfig {
        tracker_interval_secs: 5,
        // the lab's two machines finish within seconds of each other
        seed_idle_secs: 5,
        // Under TCG on a loaded two-core machine (this lab's two VMs
        // and another lane's), an agent whose stripe is complete can go
        // 30 s (the default) without a piece while the other VM, which
        // holds the pieces it needs, is starved of CPU: one CI run fell
        // back to HTTP after 15 of 59 pieces that way. A swarm that
        // stops still falls back (and e2e_swarm fails on the reason).
        swarm_stall_timeout_secs: 120,
        ..anneal_manager::swarm::SwarmConfig::default()
    });
    if let Some(sw) = &swarm {
        lc.deploy.swarm = sw.clone();
    }
    lc.fast_track_window = opts.fast_track_window;
    if opts.stall_timeout.is_some() {
        lc.deploy.stall_timeout = opts.stall_timeout;
    }
    (lc, swarm)
}

/// Creates the lab's Subnet (lease mode) and, for a swarm lab, its Site: its
/// tracker on the bridge, the lab Subnet its seeder Subnet.
async fn create_subnet(client: &kube::Client, swarm: bool) -> anyhow::Result<()> {
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), NAMESPACE);
    subnets
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
                "metadata": {"name": SUBNET},
                "spec": {
                    "siteRef": {"name": "site"}, "cidr": "10.77.0.0/24",
                    "bootd": {"serverIP": SERVER_IP, "mode": "External"},
                    "dhcp": {"mode": "lease", "gateway": "", "leaseTime": "10m", "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.150"}}
                }
            }))?,
        )
        .await?;
    if swarm {
        // The Site: its tracker on the bridge, the lab Subnet its seeder
        // Subnet.
        let sites: Api<anneal_api::Site> = Api::namespaced(client.clone(), NAMESPACE);
        sites
            .create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "Site",
                    "metadata": {"name": "site"},
                    "spec": {"seederSubnetRef": {"name": SUBNET}, "tracker": {"ip": SERVER_IP}},
                }))?,
            )
            .await?;
    }
    Ok(())
}

/// Runs the manager's reservations controller alone (the lab without the
/// deploy's controller set).
fn start_ipam(client: &kube::Client, cancel: &CancellationToken) {
    let recorder = kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: "anneal-manager".into(),
            instance: None,
        },
    );
    let c = cancel.clone();
    tokio::spawn(anneal_manager::ipam::run(
        client.clone(),
        None,
        anneal_manager::metrics::Metrics::new(),
        recorder,
        async move { c.cancelled().await },
    ));
}

/// bootd's configuration: the agent API, the kernel and initramfs to boot,
/// the boot files by architecture and Secure Boot.
fn bootd_config(
    opts: &LabOptions,
    api: &RunningAgentApi,
    kernel: &DebianKernel,
    machine_kernel: &DebianKernel,
    dir: &Path,
    initrd: &Path,
) -> anyhow::Result<StaticConfig> {
    let (x86_initrd, arm_pair) = if opts.aarch64 {
        (
            dir.join("no-x86_64-initramfs-in-an-arm64-lab"),
            format!(
                ", aarch64: {{kernel: {}, initrd: {}}}",
                machine_kernel.vmlinuz.display(),
                initrd.display()
            ),
        )
    } else {
        (initrd.to_path_buf(), String::new())
    };
    Ok(StaticConfig::from_yaml(&format!(
        "serverIP: {SERVER_IP}\ncidr: 10.77.0.0/24\ndhcp: {{mode: lease}}\n\
         api: {{url: \"{API_URL}\", caSha256: \"{}\"}}\n\
         artifacts: {{kernel: {}, initrd: {}{arm_pair}}}\nfiles: {}\n",
        api.pki().ca_sha256,
        kernel.vmlinuz.display(),
        x86_initrd.display(),
        if opts.aarch64 {
            let a = anneal_testinfra::arm64_pieces()?;
            format!(
                "{{shimaa64.efi: {}, grubaa64.efi: {}}}",
                a.shim.display(),
                a.grub.display()
            )
        } else if opts.secure_boot {
            let sb = anneal_testinfra::cache_dir().join("secureboot");
            format!(
                "{{snponly.efi: /usr/lib/ipxe/snponly.efi, shimx64.efi: {}, grubx64.efi: {}}}",
                sb.join("shimx64.efi").display(),
                sb.join("grubx64.efi").display()
            )
        } else {
            FILES.to_string()
        },
    ))?)
}

/// Where the lab's workloads (ingest, content server, seeders) find the
/// agent binary: beside the host build, or a swarm lab's own directory.
fn workload_bin_dir(dir: &Path, swarm: bool, ns_name: &str) -> anyhow::Result<PathBuf> {
    let mut bin_dir = crate::artifacts::agent_host()
        .parent()
        .map(std::path::Path::to_path_buf)
        .context("agent binary directory")?;
    if swarm {
        bin_dir = swarm_bin_dir(dir, &bin_dir, ns_name)?;
    }
    Ok(bin_dir)
}

/// Runs the manager's `Runtime` with its content half (claims, images,
/// reservations, the content server on `port`), workloads as processes
/// from `bin_dir` under `dir_store`, until `cancel`.
fn start_runtime(
    client: &kube::Client,
    bin_dir: PathBuf,
    dir_store: &Path,
    port: u16,
    swarm: Option<anneal_manager::swarm::SwarmConfig>,
    cancel: &CancellationToken,
) {
    let runtime =
        anneal_manager::Runtime::new(client.clone(), anneal_manager::RunConfig::default())
            .with_content(anneal_manager::content::ContentConfig {
                executor: anneal_manager::workload::Executor::Process(
                    anneal_manager::workload::process::ProcessExecutor::new(bin_dir, dir_store),
                ),
                store_name: "lab-store".into(),
                max_source_bytes: None,
                ingest_deadline_secs: 1800,
                server_listen: Some(format!("127.0.0.1:{port}")),
                upload: None,
                swarm,
                bootd: None,
            });
    let shutdown = runtime.shutdown_token();
    let c = cancel.clone();
    tokio::spawn(async move {
        c.cancelled().await;
        shutdown.cancel();
    });
    tokio::spawn(runtime.run());
}

impl Lab {
    /// Brings up the control plane, the manager, bootd and the artifacts.
    /// `say` reports progress.
    pub async fn start(say: &dyn Fn(&str)) -> anyhow::Result<Lab> {
        Self::start_with(say, LabOptions::default()).await
    }

    /// [`Lab::start`] with options.
    pub async fn start_with(say: &dyn Fn(&str), opts: LabOptions) -> anyhow::Result<Lab> {
        let mut ns = Netns::create("anle2e")?;
        ns.start_router_advertisements()?;
        let dir = ns.dir();
        log_to(&dir.join("lab.log"));
        let kernel = debian_kernel()?;
        // the machine's own kernel: the arm64 one for an arm64 lab
        let machine_kernel = if opts.aarch64 {
            debian_kernel_arm64()?
        } else {
            kernel.clone()
        };
        say(&format!(
            "namespace {} (br0 {SERVER_IP}/24) · Debian kernel {}",
            ns.name(),
            machine_kernel.version
        ));
        let build = tokio::task::spawn_blocking({
            let dir = dir.clone();
            let modules = machine_kernel.modules.clone();
            let aarch64 = opts.aarch64;
            move || build_artifacts(dir, modules, aarch64)
        });
        let cp = ControlPlane::start().await?;
        cp.install_crds(&anneal_api::crds()).await?;
        let client = cp.client();
        say(&format!(
            "control plane up ({:.1} s), CRDs installed",
            cp.startup_time().as_secs_f64()
        ));
        let nss: Api<Namespace> = Api::all(client.clone());
        nss.create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({"metadata": {"name": "anneal-system"}}))?,
        )
        .await?;

        // The manager's lifecycle half, as `manager run` starts it.
        let cancel = CancellationToken::new();
        let (lc, swarm) = lifecycle_config(&opts);
        let (api, _controller) = anneal_manager::lifecycle::start(
            client.clone(),
            lc,
            AgentApiConfig {
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                namespace: "anneal-system".into(),
                server_names: vec![SERVER_IP.into(), "127.0.0.1".into(), "localhost".into()],
                session_ttl: opts.session.map_or(Duration::from_secs(600), |s| s.0),
                session_renew_after: opts.session.map_or(Duration::from_secs(300), |s| s.1),
                long_poll: Duration::from_secs(5),
                fast_track_window: opts.fast_track_window,
            },
            cancel.clone(),
        )
        .await?;
        let forward = ns.forward_tcp(SocketAddr::from(([10, 77, 0, 1], 8443)), api.addr())?;
        say(&format!(
            "manager: agent API on {} (relayed at {API_URL}), CA sha256 {}",
            api.addr(),
            api.pki().ca_sha256
        ));

        // The Subnet (lease mode); its reservations are the manager's.
        create_subnet(&client, opts.swarm).await?;
        // The manager's reservations controller fills status.dhcp; the
        // deploy lab runs the whole controller set (claims, images,
        // reservations) as `manager run` does, the lifecycle half aside.
        let mut store = None;
        let mut content_forward = None;
        let mut workloads = None;
        if opts.deploy {
            let dir_store = dir.join("store");
            std::fs::create_dir_all(&dir_store)?;
            workloads = Some(WorkloadsGuard(dir_store.clone()));
            let bin_dir = workload_bin_dir(&dir, swarm.is_some(), ns.name())?;
            let port = anneal_testinfra::free_port()?;
            start_runtime(&client, bin_dir, &dir_store, port, swarm.clone(), &cancel);
            content_forward = Some(ns.forward_tcp(
                SocketAddr::from(([10, 77, 0, 1], 8088)),
                SocketAddr::from(([127, 0, 0, 1], port)),
            )?);
            say(&format!(
                "manager: claims, images, content server on 127.0.0.1:{port} (relayed at {CONTENT_URL})"
            ));
            store = Some(dir_store);
        } else {
            start_ipam(&client, &cancel);
        }

        let initrd = build.await.context("artifact build panicked")?;
        let initrd_bytes = std::fs::metadata(&initrd)?.len();
        say(&format!(
            "agent initramfs built: {} ({:.1} MiB)",
            initrd.display(),
            initrd_bytes as f64 / (1 << 20) as f64
        ));

        // bootd: sockets inside the namespace, watcher on the host side.
        // An arm64 lab serves the arm64 pair only: no x86_64 machine boots
        // there, so no x86_64 initramfs is built (its path names that).
        let base = bootd_config(&opts, &api, &kernel, &machine_kernel, &dir, &initrd)?;
        let wcfg = WatchConfig {
            namespace: NAMESPACE.into(),
            subnet: SUBNET.into(),
            base,
            http_port: 8080,
        };
        let (snap, _, _) = anneal_bootd::watch::build(&client, &wcfg).await?;
        let bootd = NetnsServer::start(
            ns.name(),
            ServerOptions {
                interface: Some("br0".into()),
                lease_file: Some(dir.join("leases.json")),
                ..ServerOptions::default()
            },
            snap,
        )?;
        tokio::spawn(anneal_bootd::watch::run(
            client.clone(),
            wcfg,
            bootd.shared().clone(),
            cancel.clone(),
        ));
        say(&format!(
            "bootd serving in the namespace (DHCP lease mode, TFTP, HTTP on {})",
            bootd.http_addr
        ));
        Ok(Lab {
            _workloads: workloads,
            vm: None,
            bmc: None,
            vm_tap: None,
            lldpd: None,
            vm_launched: None,
            bootd,
            _forward: forward,
            api,
            cancel,
            ns,
            cp,
            dir,
            initrd,
            initrd_bytes,
            disks: if opts.deploy {
                DEPLOY_DISKS.to_vec()
            } else {
                DISKS.to_vec()
            },
            store,
            _content_forward: content_forward,
            secure_boot: opts.secure_boot,
            aarch64: opts.aarch64,
            peer: None,
        })
    }

    /// Launches the VM powered off (QEMU paused) and starts its BMC.
    pub async fn launch_vm(&mut self) -> anyhow::Result<()> {
        let launched = Instant::now();
        let (vm, bmc, tap) = self.launch_one(MACHINE, MAC, &self.dir.clone()).await?;
        self.vm = Some(vm);
        self.bmc = Some(bmc);
        self.vm_tap = Some(tap);
        self.vm_launched = Some(launched);
        Ok(())
    }

    /// Launches the second VM ([`PEER`], [`PEER_MAC`], its disks and BMC
    /// files under `<lab>/peer`) powered off, and enrols its Machine.
    pub async fn launch_peer(&mut self) -> anyhow::Result<()> {
        let dir = self.dir.join("peer");
        std::fs::create_dir_all(&dir)?;
        let (vm, bmc, _) = self.launch_one(PEER, PEER_MAC, &dir).await?;
        let address = format!("redfish+http://127.0.0.1:{}", bmc.addr().port());
        self.peer = Some(PeerVm { vm, _bmc: bmc });
        self.enrol_machine(PEER, PEER_MAC, &address).await
    }

    /// One VM (disks and BMC files in `dir`), paused, its BMC and its tap.
    async fn launch_one(
        &mut self,
        name: &str,
        mac: &str,
        dir: &Path,
    ) -> anyhow::Result<(Vm, RunningBmc, String)> {
        let mut disks = Vec::new();
        for &(bus, serial, mib, _) in &self.disks {
            let path = dir.join(format!("{serial}.raw"));
            std::fs::File::create(&path)?.set_len(mib << 20)?;
            disks.push(DiskConfig {
                path,
                format: "raw".into(),
                bus,
                serial: serial.into(),
            });
        }
        let tap = self.ns.add_tap()?;
        let mut nic = NicConfig::virtio(&tap, mac);
        // OVMF's own PXE client fetches the first stage, as on real hardware.
        nic.option_rom = false;
        let cfg = VmConfig {
            firmware: if self.aarch64 {
                Firmware::Aavmf
            } else if self.secure_boot {
                Firmware::OvmfSecureBootMs
            } else {
                Firmware::Ovmf
            },
            memory_mib: MEMORY_MIB,
            cpus: CPUS,
            nics: vec![nic],
            disks,
            extra_args: {
                let mut a = vec!["-S".to_string(), "-no-shutdown".to_string()];
                if self.store.is_some() {
                    // The deployed test OS prints the DMI serial as its name.
                    a.extend(["-smbios".to_string(), format!("type=1,serial={name}")]);
                }
                a
            },
            no_reboot: false,
            // the console takes input too (Lab::type_on_console)
            serial_input: true,
            ..VmConfig::default()
        };
        let launched = Instant::now();
        let vm = Vm::launch(&cfg, Some(&self.ns))?;
        while !vm.qmp_path().exists() {
            anyhow::ensure!(
                launched.elapsed() < Duration::from_secs(60),
                "no QMP socket"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let bmc = anneal_qemu_bmc::start(BmcConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            qmp: vm.qmp_path().to_path_buf(),
            state_file: dir.join("bmc-state.json"),
            request_log: Some(dir.join("bmc-requests.jsonl")),
            username: BMC_USER.into(),
            password: BMC_PASSWORD.into(),
            system_id: "vm0".into(),
            tls: None,
        })
        .await?;
        Ok((vm, bmc, tap))
    }

    /// LLDP (docs/api.md, MachineHardware `nics[].lldp`): lldpd (Debian's
    /// package) plays the switch on the VM's tap, inside the lab's namespace
    /// (so every VM of the lab has a port of its own, which the bridge would
    /// not give): system name `system_name`, port ID the tap's name
    /// (`portidsubtype ifname`), chassis ID the tap's MAC, a frame every
    /// second. Call it after [`Lab::launch_vm`] (the tap exists, the VM is
    /// still powered off) so the agent's listening window hears a frame. lldpd
    /// runs until the lab drops (its process group killed and reaped), with
    /// its own control socket and log (`lldpd.log`) in the lab's directory.
    pub fn start_lldp(&mut self, system_name: &str) -> anyhow::Result<NicLldp> {
        let tap = self.vm_tap.clone().context("launch the VM first")?;
        // `ip -br link show dev tap0`: "tap0  UP  aa:bb:cc:dd:ee:ff <...>"
        let line = self.ns.ip(&["-br", "link", "show", "dev", &tap])?;
        let chassis = line
            .split_whitespace()
            .nth(2)
            .with_context(|| format!("no MAC in {line:?}"))?
            .to_string();
        let conf = self.dir.join("lldpd.conf");
        std::fs::write(
            &conf,
            format!(
                "configure system hostname {system_name}\n\
                 configure lldp portidsubtype ifname\n\
                 configure lldp tx-interval 1\n"
            ),
        )?;
        let lldpd = ChildGroup::spawn_logged(
            "lldpd",
            self.ns
                .exec("lldpd")
                .args(["-d", "-I", &tap, "-C", &tap, "-u"])
                .arg(self.dir.join("lldpd.sock"))
                .arg("-O")
                .arg(&conf),
            &self.dir.join("lldpd.log"),
        )?;
        self.lldpd = Some(lldpd);
        Ok(NicLldp {
            chassis_id: Some(chassis),
            port_id: Some(tap.clone()),
            // lldpd describes a port without an alias by its name
            port_description: Some(tap),
            system_name: Some(system_name.to_string()),
        })
    }

    /// lldpd's log so far ([`Lab::start_lldp`]).
    pub fn lldpd_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("lldpd.log")).unwrap_or_default()
    }

    /// The manager's claim controller (as `manager run` starts it), for a
    /// lab without the deploy half; stopped with the lab.
    pub fn start_claims(&self) {
        let scope = anneal_manager::controller::Scope::standalone(
            self.cp.client(),
            self.cancel.child_token(),
        );
        tokio::spawn(anneal_manager::claims::controller(scope, 1));
    }

    /// The BMC's address as a Machine names it.
    pub fn bmc_address(&self) -> String {
        let port = self.bmc.as_ref().map_or(0, |b| b.addr().port());
        format!("redfish+http://127.0.0.1:{port}")
    }

    /// The BMC's request log.
    pub fn bmc_requests(&self) -> Vec<anneal_qemu_bmc::LogEntry> {
        anneal_qemu_bmc::read_request_log(&self.dir.join("bmc-requests.jsonl"))
    }

    /// Enrols the Machine: its BMC credentials and the Machine itself.
    pub async fn enrol(&self) -> anyhow::Result<()> {
        self.enrol_machine(MACHINE, MAC, &self.bmc_address()).await
    }

    /// Enrols Machine `name` (boot MAC `mac`, its BMC at `bmc`).
    async fn enrol_machine(&self, name: &str, mac: &str, bmc: &str) -> anyhow::Result<()> {
        let client = self.cp.client();
        let secrets: Api<Secret> = Api::namespaced(client.clone(), NAMESPACE);
        secrets
            .create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": format!("{name}-bmc")},
                    "stringData": {"username": BMC_USER, "password": BMC_PASSWORD},
                }))?,
            )
            .await?;
        let machines: Api<Machine> = Api::namespaced(client, NAMESPACE);
        machines
            .create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
                    "metadata": {"name": name},
                    "spec": {
                        "subnetRef": {"name": SUBNET},
                        "bootMACAddress": mac,
                        "console": [if self.aarch64 { "ttyAMA0" } else { "ttyS0" }],
                        "bootLoader": if self.secure_boot || self.aarch64 { "shim" } else { "ipxe" },
                        "architecture": if self.aarch64 { "aarch64" } else { "x86_64" },
                        "bmc": {
                            "address": bmc,
                            "credentialsSecretRef": {"name": format!("{name}-bmc")},
                        },
                    },
                }))?,
            )
            .await?;
        Ok(())
    }

    /// Machine `name`'s `status.state` (empty before the first write).
    pub async fn state_of(&self, name: &str) -> anyhow::Result<String> {
        let machines: Api<Machine> = Api::namespaced(self.cp.client(), NAMESPACE);
        let m = serde_json::to_value(machines.get(name).await?)?;
        Ok(m["status"]["state"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    /// The Machine's `status.state` (empty before the first write).
    pub async fn state(&self) -> anyhow::Result<String> {
        self.state_of(MACHINE).await
    }

    /// The Machine's `status.poweredOn`.
    pub async fn powered_on(&self) -> anyhow::Result<Option<bool>> {
        let machines: Api<Machine> = Api::namespaced(self.cp.client(), NAMESPACE);
        let m = serde_json::to_value(machines.get(MACHINE).await?)?;
        Ok(m["status"]["poweredOn"].as_bool())
    }

    /// The MachineHardware, once written.
    pub async fn hardware(&self) -> anyhow::Result<Option<MachineHardware>> {
        let hw: Api<MachineHardware> = Api::namespaced(self.cp.client(), NAMESPACE);
        Ok(hw.get_opt(MACHINE).await?)
    }

    /// The serial console so far.
    pub fn console(&self) -> String {
        self.vm.as_ref().map(Vm::serial_text).unwrap_or_default()
    }

    /// Time since QEMU was launched.
    pub fn since_launch(&self) -> Duration {
        self.vm_launched.map(|t| t.elapsed()).unwrap_or_default()
    }

    /// `kubectl get machines` against the lab's control plane.
    pub fn kubectl_get_machines(&self) -> anyhow::Result<String> {
        let out = self
            .cp
            .kubectl()?
            .args(["get", "machines", "-n", NAMESPACE, "-o", "wide"])
            .output()?;
        Ok(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }

    /// Polls until the Machine is Available (or `timeout` after QEMU's
    /// launch), reporting each console growth and state change. Returns the
    /// time from QEMU's launch to Available.
    pub async fn wait_available(
        &self,
        timeout: Duration,
        on: &mut dyn FnMut(Progress<'_>),
    ) -> anyhow::Result<Duration> {
        self.wait_state("Available", timeout, on).await
    }

    /// Polls until the Machine's state is `want` (or `timeout` after QEMU's
    /// launch), reporting console growth and state changes. Returns the time
    /// from QEMU's launch.
    pub async fn wait_state(
        &self,
        want: &str,
        timeout: Duration,
        on: &mut dyn FnMut(Progress<'_>),
    ) -> anyhow::Result<Duration> {
        let mut shown = 0;
        let mut last_state = String::from("?");
        loop {
            let console = self.console();
            if console.len() > shown {
                on(Progress::Console(&console[shown..]));
                shown = console.len();
            }
            let state = self.state().await.unwrap_or_default();
            if state != last_state {
                on(Progress::State(&state, self.since_launch()));
                last_state = state.clone();
            }
            if state == want {
                return Ok(self.since_launch());
            }
            if self.since_launch() > timeout {
                anyhow::bail!(
                    "machine {MACHINE} not {want} {:.0} s after QEMU's launch (state {state:?}); console tail:\n{}\nlab log tail:\n{}",
                    timeout.as_secs_f64(),
                    tail(&console, 40),
                    tail(
                        &std::fs::read_to_string(self.dir.join("lab.log")).unwrap_or_default(),
                        40
                    )
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A progress callback that prints the Machine's state changes, prefixed
/// with `tag`.
pub fn print_states(tag: &str) -> impl FnMut(Progress<'_>) + '_ {
    move |p| {
        if let Progress::State(s, t) = p {
            println!("{tag}: state {s:?} at {:.1} s", t.as_secs_f64());
        }
    }
}

impl Lab {
    /// Copies each `(name, file, bootable)` to `<lab>/src/<name>.raw`, serves
    /// that directory over HTTP and imports each as Image `name`, waiting
    /// until all are Ready. The server is returned: keep it alive while the
    /// lab may import again.
    pub async fn serve_and_import(
        &self,
        images: &[(&str, &Path, bool)],
        timeout: Duration,
    ) -> anyhow::Result<crate::images::FileServer> {
        let src = self.dir.join("src");
        std::fs::create_dir_all(&src)?;
        for (name, file, _) in images {
            std::fs::copy(file, src.join(format!("{name}.raw")))
                .with_context(|| format!("copying {} into the lab", file.display()))?;
        }
        let server = crate::images::FileServer::start(&src, None);
        for (name, _, bootable) in images {
            let file = src.join(format!("{name}.raw"));
            let url = server.url(&format!("{name}.raw"));
            let sum = crate::images::sha256_file(&file);
            self.import_as(name, &url, &sum, *bootable, timeout).await?;
        }
        Ok(server)
    }

    /// Launches the VM, enrols its Machine and waits until it is Available,
    /// printing its state changes prefixed with `tag`.
    pub async fn boot_until_available(
        &mut self,
        tag: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        self.launch_vm().await?;
        self.enrol().await?;
        self.wait_available(timeout, &mut print_states(tag)).await?;
        Ok(())
    }

    /// Imports `url` (sha256 `checksum`) as Image `name` (contents
    /// `<name>-pN`) through an ImageImport and waits until the Image is
    /// Ready.
    pub async fn import(
        &self,
        name: &str,
        url: &str,
        checksum: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        self.import_as(name, url, checksum, true, timeout).await
    }

    /// [`Lab::import`] of a bootable OS image or (`bootable` false) a data
    /// image.
    pub async fn import_as(
        &self,
        name: &str,
        url: &str,
        checksum: &str,
        bootable: bool,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let client = self.cp.client();
        let imports: Api<anneal_api::ImageImport> = Api::namespaced(client.clone(), NAMESPACE);
        imports
            .create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
                    "metadata": {"name": name},
                    "spec": {"source": {"url": url, "checksum": format!("sha256:{checksum}")},
                             "imageName": name, "contentPrefix": name, "osFamily": "Linux",
                             "bootable": bootable},
                }))?,
            )
            .await?;
        let images: Api<anneal_api::Image> = Api::namespaced(client, NAMESPACE);
        let start = Instant::now();
        loop {
            let imp = imports.get(name).await?;
            let st = imp.status.clone().unwrap_or_default();
            if st.state == Some(anneal_api::ImportState::Failed) {
                anyhow::bail!("ImageImport {name} failed: {:?}", st.conditions);
            }
            if let Some(i) = images.get_opt(name).await?
                && i.status.as_ref().and_then(|s| s.state) == Some(anneal_api::ImageState::Ready)
            {
                return Ok(());
            }
            anyhow::ensure!(
                start.elapsed() < timeout,
                "Image {name} not Ready after {timeout:?}: import {:?}",
                st
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// A MachineClaim `name` for the lab's Machine deploying `image` to the
    /// disk with serial `serial`, with `extra` merged into its spec.
    pub async fn claim(
        &self,
        name: &str,
        image: &str,
        serial: &str,
        extra: serde_json::Value,
    ) -> anyhow::Result<()> {
        self.claim_for(MACHINE, name, image, serial, extra).await
    }

    /// Claims the lab's Machine for `image` on the first deploy disk
    /// (claim `deploy`), waits for Provisioned (its states printed under
    /// `tag`; a failure panics with the console's tail) and for the deployed
    /// OS's marker (`marker_sha256`). Prints and returns the seconds from
    /// the claim to each.
    pub async fn deploy_and_boot(&self, image: &str, tag: &str, marker_sha256: &str) -> (f64, f64) {
        let claimed = std::time::Instant::now();
        self.claim("deploy", image, DEPLOY_DISKS[0].1, serde_json::json!({}))
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        self.wait_state(
            "Provisioned",
            Duration::from_secs(900),
            &mut print_states(tag),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nconsole:\n{}", tail(&self.console(), 80)));
        let provisioned = claimed.elapsed().as_secs_f64();
        println!("{tag}: claim → Provisioned in {provisioned:.1} s");
        self.wait_deployed_os(marker_sha256)
            .await
            .unwrap_or_else(|e| panic!("{e:#}"));
        let booted = claimed.elapsed().as_secs_f64();
        println!("{tag}: claim → the deployed OS's marker in {booted:.1} s");
        (provisioned, booted)
    }

    /// [`Lab::claim`] for Machine `machine`.
    pub async fn claim_for(
        &self,
        machine: &str,
        name: &str,
        image: &str,
        serial: &str,
        extra: serde_json::Value,
    ) -> anyhow::Result<()> {
        let mut spec = serde_json::json!({
            "machineName": machine,
            "imageRef": {"name": image},
            "targetDisk": {"serialNumber": serial},
        });
        if let (Some(base), Some(more)) = (spec.as_object_mut(), extra.as_object()) {
            for (k, v) in more {
                base.insert(k.clone(), v.clone());
            }
        }
        let claims: Api<anneal_api::MachineClaim> = Api::namespaced(self.cp.client(), NAMESPACE);
        claims
            .create(
                &PostParams::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
                    "metadata": {"name": name}, "spec": spec,
                }))?,
            )
            .await?;
        Ok(())
    }

    /// Merge-patches the lab's Machine with `patch`.
    pub async fn patch_machine(&self, patch: serde_json::Value) -> anyhow::Result<()> {
        let machines: Api<Machine> = Api::namespaced(self.cp.client(), NAMESPACE);
        machines
            .patch(
                MACHINE,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(patch),
            )
            .await?;
        Ok(())
    }

    /// Sends `ComputerSystem.Reset` (`ForceOff`, `On`, ...) to the VM's BMC
    /// behind the manager's back, as a power loss or a hand on the switch.
    pub fn bmc_reset(&self, reset_type: &str) -> anyhow::Result<()> {
        let port = self.bmc.as_ref().map_or(0, |b| b.addr().port());
        let out = std::process::Command::new("curl")
            .args(["-sS", "-f", "-u"])
            .arg(format!("{BMC_USER}:{BMC_PASSWORD}"))
            .args(["-H", "Content-Type: application/json", "-d"])
            .arg(format!("{{\"ResetType\":\"{reset_type}\"}}"))
            .arg(format!(
                "http://127.0.0.1:{port}/redfish/v1/Systems/vm0/Actions/ComputerSystem.Reset"
            ))
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "BMC reset {reset_type}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// The VM's Redfish ComputerSystem as its BMC answers it (`PowerState`,
    /// `Boot`), behind the manager's back.
    pub fn bmc_system(&self) -> anyhow::Result<serde_json::Value> {
        let port = self.bmc.as_ref().map_or(0, |b| b.addr().port());
        let out = std::process::Command::new("curl")
            .args(["-sS", "-f", "-u"])
            .arg(format!("{BMC_USER}:{BMC_PASSWORD}"))
            .arg(format!("http://127.0.0.1:{port}/redfish/v1/Systems/vm0"))
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "BMC GET system: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Types `text` on the VM's serial console.
    pub fn type_on_console(&self, text: &str) -> anyhow::Result<()> {
        self.vm.as_ref().context("no VM")?.send_serial(text)
    }

    /// Deletes the MachineClaim `name`.
    pub async fn delete_claim(&self, name: &str) -> anyhow::Result<()> {
        let claims: Api<anneal_api::MachineClaim> = Api::namespaced(self.cp.client(), NAMESPACE);
        claims.delete(name, &Default::default()).await?;
        Ok(())
    }

    /// DHCP DISCOVERs bootd has seen (every outcome, dropped ones too): a
    /// PXE or iPXE boot starts with one; a running agent only renews.
    pub fn dhcp_discovers(&self) -> u64 {
        self.bootd
            .shared()
            .metrics
            .render()
            .lines()
            .filter(|l| l.starts_with("bootd_dhcp_packets") && l.contains("msg_type=\"discover\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// The raw file behind the VM's disk with serial `serial`.
    pub fn disk_path(&self, serial: &str) -> PathBuf {
        self.dir.join(format!("{serial}.raw"))
    }

    /// Waits until the deployed test OS (`marker_sha256`: its
    /// `/anneal-marker`) has printed its marker and the Machine's name on
    /// the console.
    pub async fn wait_deployed_os(&self, marker_sha256: &str) -> anyhow::Result<()> {
        self.wait_console(
            &format!("ANNEAL-MARKER {marker_sha256}"),
            1,
            Duration::from_secs(600),
        )
        .await?;
        self.wait_console(
            &format!("ANNEAL-DEPLOYED {MACHINE}"),
            1,
            Duration::from_secs(60),
        )
        .await
    }

    /// The UEFI load option the agent wrote, read from the VM's variable
    /// store: it must be the only anneal entry and first in BootOrder; its
    /// file path, upper-cased (`\EFI\BOOT\BOOTX64.EFI`).
    pub fn anneal_boot_entry(&self) -> anyhow::Result<String> {
        let vm = self.vm.as_ref().context("no VM")?;
        let vars = std::fs::read(vm.vars_path())?;
        let (entries, order) = crate::ovmf::boot_entries(&vars)?;
        let ours: Vec<_> = entries
            .iter()
            .filter(|e| e.description.starts_with("anneal"))
            .collect();
        anyhow::ensure!(ours.len() == 1, "exactly one anneal entry: {entries:?}");
        anyhow::ensure!(
            order.first() == Some(&ours[0].number),
            "the anneal entry {:04X} is not first in BootOrder: {order:?}",
            ours[0].number
        );
        ours[0]
            .file
            .as_deref()
            .map(str::to_ascii_uppercase)
            .with_context(|| format!("the anneal entry has no file path: {:?}", ours[0]))
    }

    /// Waits until `text` occurs at least `count` times on the console (or
    /// `timeout`); the error carries the console's tail.
    pub async fn wait_console(
        &self,
        text: &str,
        count: usize,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let console = self.console();
            if console.matches(text).count() >= count {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{text:?} not printed {count} times in {timeout:?}; console tail:\n{}",
                tail(&console, 60)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// What [`Lab::wait_available`] reports.
#[derive(Debug)]
pub enum Progress<'a> {
    /// New console text.
    Console(&'a str),
    /// A new `status.state`, and the time since QEMU's launch.
    State(&'a str, Duration),
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The agent's registration line: `(seconds after /init, seconds after the
/// network was up, the line)`.
pub fn registration_times(console: &str) -> Option<(f64, f64, String)> {
    let line = console
        .lines()
        .find(|l| l.contains("anneal: registered as "))?
        .trim_end_matches('\r');
    let rest = line.split_once('(')?.1;
    let (a, rest) = rest.split_once(" s after /init, ")?;
    let b = rest.split_once(" s after the network")?.0;
    Some((
        a.trim().parse().ok()?,
        b.trim().parse().ok()?,
        line.to_string(),
    ))
}

/// A human summary of a MachineHardware.
pub fn summary(hw: &MachineHardware) -> String {
    let s = &hw.spec;
    let mut out = String::new();
    if let Some(c) = &s.cpu {
        out.push_str(&format!(
            "  cpu     {} × {}\n",
            c.count,
            c.model.as_deref().unwrap_or("?")
        ));
    }
    if let Some(m) = s.memory_bytes {
        out.push_str(&format!("  memory  {} MiB\n", m >> 20));
    }
    if let Some(f) = &s.firmware {
        out.push_str(&format!(
            "  firmware {:?} (secure boot {})\n",
            f.mode, f.secure_boot
        ));
    }
    for d in &s.disks {
        out.push_str(&format!(
            "  disk    {:<14} {:>5} MiB serial={} pcie={}\n",
            d.device_name,
            d.size_bytes >> 20,
            d.serial_number.as_deref().unwrap_or("-"),
            d.pcie_path.as_deref().unwrap_or("-"),
        ));
    }
    for n in &s.nics {
        out.push_str(&format!(
            "  nic     {:<14} {} driver={} link={}\n",
            n.name,
            n.mac,
            n.driver.as_deref().unwrap_or("-"),
            n.link
        ));
    }
    out
}

// demo helpers: used by the demo (`tests/examples/demo.rs`); new functions
// only, the ones above keep their behaviour.
impl Lab {
    /// The ImageImport `name`'s status (`None` before its first write or
    /// when it does not exist).
    pub async fn import_status(
        &self,
        name: &str,
    ) -> anyhow::Result<Option<anneal_api::ImageImportStatus>> {
        let imports: Api<anneal_api::ImageImport> = Api::namespaced(self.cp.client(), NAMESPACE);
        Ok(imports.get_opt(name).await?.and_then(|i| i.status))
    }

    /// The Machine's newest DeployRun (by creation time, then name) with its
    /// status, if it has one.
    pub async fn deploy_run_status(
        &self,
    ) -> anyhow::Result<Option<(String, anneal_api::DeployRunStatus)>> {
        let runs: Api<anneal_api::DeployRun> = Api::namespaced(self.cp.client(), NAMESPACE);
        let newest = runs
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .filter(|r| r.spec.machine_ref.name == MACHINE)
            .max_by_key(|r| {
                (
                    r.metadata.creation_timestamp.clone().map(|t| t.0),
                    kube::ResourceExt::name_any(r),
                )
            });
        Ok(newest.map(|r| {
            (
                kube::ResourceExt::name_any(&r),
                r.status.unwrap_or_default(),
            )
        }))
    }

    /// `kubectl get <kinds> -o wide` in the lab's namespace (`kinds` as
    /// kubectl takes them: `deployruns`, `imageimports,images`).
    pub fn kubectl_get(&self, kinds: &str) -> anyhow::Result<String> {
        let out = self
            .cp
            .kubectl()?
            .args(["get", kinds, "-n", NAMESPACE, "-o", "wide"])
            .output()?;
        Ok(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }

    /// When (ms since the Unix epoch) the BMC first powered the VM on at or
    /// after `since_ms`: a successful `ComputerSystem.Reset` of a type that
    /// leaves it running.
    pub fn power_on_after(&self, since_ms: u64) -> Option<u64> {
        self.bmc_requests()
            .iter()
            .filter(|e| e.ts_ms >= since_ms && e.is_reset() && (200..300).contains(&e.status))
            .find(|e| {
                matches!(
                    e.action.as_deref(),
                    Some("On" | "ForceOn" | "ForceRestart" | "GracefulRestart")
                )
            })
            .map(|e| e.ts_ms)
    }

    /// The VM's UEFI boot entries and BootOrder, read from its VARS store.
    pub fn boot_entries(&self) -> anyhow::Result<(Vec<crate::ovmf::BootEntry>, Vec<u16>)> {
        let vm = self.vm.as_ref().context("the lab's VM is not launched")?;
        let vars = std::fs::read(vm.vars_path())
            .with_context(|| format!("read the VM's VARS store {}", vm.vars_path().display()))?;
        crate::ovmf::boot_entries(&vars)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::os::unix::process::CommandExt as _;

    use super::WorkloadsGuard;

    /// A running workload (no `exit` file) is killed with its group when
    /// the guard drops; a finished one's PID is left alone.
    #[test]
    fn the_guard_kills_running_workloads_by_their_group() {
        let store = tempfile::tempdir().unwrap();
        let running = store.path().join(".workloads/default/content-server");
        let finished = store.path().join(".workloads/default/ingest");
        std::fs::create_dir_all(&running).unwrap();
        std::fs::create_dir_all(&finished).unwrap();
        let mut server = std::process::Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap();
        let mut other = std::process::Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap();
        std::fs::write(running.join("pid"), format!("{}\n", server.id())).unwrap();
        std::fs::write(finished.join("pid"), format!("{}\n", other.id())).unwrap();
        std::fs::write(finished.join("exit"), "0\n").unwrap();
        drop(WorkloadsGuard(store.path().to_path_buf()));
        // wait() returns once the process is gone: no sleep, no poll
        let status = server.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9),
            "the running workload is killed"
        );
        assert!(
            other.try_wait().unwrap().is_none(),
            "a workload with an exit file is not signalled"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }
}
