//! What the node tests (`node_install`, `node_failover`) share to boot and
//! deploy a QEMU VM through anneal's pods on the test tier's node: the
//! provisioning segment, the content store prepared as an operator would,
//! the Site and Subnet, the test OS imported through an ImageImport (its
//! ingest Job a pod), the VM behind a BMC enrolled as a Machine, a claim,
//! and the failure report (console tail, bootd's, the workloads' and the
//! managers' logs).

use std::path::Path;
use std::time::{Duration, Instant};

use anneal_api::{DeployRun, Image, ImageImport, Machine, RunPhase};
use anneal_testinfra::{DiskBus, DiskConfig, Firmware, NODE_DIR, NicConfig, Vm, VmConfig};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams};

/// bootd's address on the provisioning segment (the agent API's and the
/// content server's too).
pub const SERVER_IP: &str = "10.90.0.1";
/// The host's end of the segment.
pub const HOST_IF: &str = "anlbd0";
/// The VM's NIC.
pub const MAC: &str = "52:54:00:e2:e0:71";
/// The VM's disk serial (the claim's target).
pub const SERIAL: &str = "NODEVBLK0001";
/// The Machine's name (and the VM's DMI serial, which the test OS prints).
pub const MACHINE: &str = "node-vm";
/// Where everything lives.
pub const NS: &str = "anneal-system";
const BMC_USER: &str = "admin";
const BMC_PASSWORD: &str = "node-bmc-password";

/// What the node tests build before the node starts.
#[derive(Debug)]
pub struct Artifacts {
    /// The image archives the node imports: the manager's, the workloads'
    /// (the static musl agent) and bootd's.
    pub images: Vec<std::path::PathBuf>,
    /// The Debian kernel bootd serves.
    pub vmlinuz: std::path::PathBuf,
    /// The agent's initramfs bootd serves.
    pub initrd: std::path::PathBuf,
    /// The test OS the VM deploys.
    pub os: crate::testos::TestOs,
}

impl Artifacts {
    /// [`Artifacts::build`] off the runtime's threads.
    pub async fn build_in(dir: &Path) -> Artifacts {
        let dir = dir.to_path_buf();
        tokio::task::spawn_blocking(move || Artifacts::build(&dir))
            .await
            .unwrap()
    }

    /// Builds them into `dir` (blocking).
    pub fn build(dir: &Path) -> Artifacts {
        let agent = crate::artifacts::agent_musl();
        let kernel = anneal_testinfra::debian_kernel().unwrap();
        let initrd = dir.join("agent.cpio.zst");
        crate::artifacts::build_initramfs(
            &crate::artifacts::initramfs_tool(),
            &agent,
            &kernel.modules,
            &initrd,
        );
        Artifacts {
            images: vec![
                crate::node::manager_image(dir),
                crate::node::image("agent", &agent, "anneal-agent", dir),
                crate::node::bootd_image(dir),
            ],
            vmlinuz: kernel.vmlinuz,
            initrd,
            os: crate::testos::test_os().unwrap(),
        }
    }
}

/// The provisioning segment: a bridge in a namespace of the test (the VM's
/// tap joins it) and a veth pair from it to the host, whose host end
/// ([`HOST_IF`]) holds [`SERVER_IP`]: the host-network pods reach the VM
/// and nothing else does. Removed on drop (the host end by name, the
/// namespace with the rest).
#[derive(Debug)]
pub struct Segment {
    /// The namespace holding the bridge `br0`.
    pub ns: anneal_testinfra::Netns,
}

impl Segment {
    /// Creates it (router advertisements on: iPXE waits ~15 s for IPv6
    /// without them).
    pub fn create() -> Segment {
        let mut ns = anneal_testinfra::Netns::create("anlnd").unwrap();
        ns.start_router_advertisements().unwrap();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", HOST_IF])
            .output();
        for args in [
            vec![
                "link",
                "add",
                HOST_IF,
                "type",
                "veth",
                "peer",
                "name",
                "anlbdp",
                "netns",
                ns.name(),
            ],
            vec!["addr", "add", "10.90.0.1/24", "dev", HOST_IF],
            vec!["link", "set", HOST_IF, "up"],
        ] {
            let out = std::process::Command::new("ip")
                .args(&args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        ns.ip(&["link", "set", "anlbdp", "master", "br0"]).unwrap();
        ns.ip(&["link", "set", "anlbdp", "up"]).unwrap();
        Segment { ns }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", HOST_IF])
            .output();
    }
}

/// The content store under the node's directory as an operator prepares
/// it: the boot files bootd serves in `boot/` (the kernel, the agent's
/// initramfs, iPXE's first stages: copies, the pods see the store, not the
/// host's paths), the directory owned by the workloads' user 65532 and
/// group-writable (bootd runs as root in the group 65532 without
/// `CAP_DAC_OVERRIDE`; a hostPath volume ignores fsGroup), as
/// docs/kubernetes.md says.
pub fn prepare_store(vmlinuz: &Path, initrd: &Path) {
    let boot = Path::new(NODE_DIR).join("content/boot");
    std::fs::create_dir_all(boot.join("files")).unwrap();
    std::fs::copy(vmlinuz, boot.join("vmlinuz")).unwrap();
    std::fs::copy(initrd, boot.join("initrd.img")).unwrap();
    for f in ["snponly.efi", "ipxe.efi", "undionly.kpxe"] {
        std::fs::copy(
            Path::new("/usr/lib/ipxe").join(f),
            boot.join("files").join(f),
        )
        .unwrap();
    }
    for args in [
        vec!["chown", "-R", "65532:65532", "content"],
        vec!["chmod", "0770", "content"],
    ] {
        let out = std::process::Command::new(args[0])
            .args(&args[1..])
            .current_dir(NODE_DIR)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Server-side apply of an anneal object (JSON with apiVersion, kind,
/// metadata.name) in [`NS`].
pub async fn apply(client: &kube::Client, v: serde_json::Value) {
    let pp = kube::api::PatchParams::apply("node-test");
    let name = v["metadata"]["name"].as_str().unwrap().to_string();
    let obj: kube::api::DynamicObject = serde_json::from_value(v.clone()).unwrap();
    let ar = kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
        "anneal.dev",
        "v1alpha1",
        v["kind"].as_str().unwrap(),
    ));
    Api::<kube::api::DynamicObject>::namespaced_with(client.clone(), NS, &ar)
        .patch(&name, &pp, &kube::api::Patch::Apply(&obj))
        .await
        .unwrap();
}

/// Waits until the content store's claim `anneal-content` is Bound (until
/// then a pod mounting the store is not scheduled).
pub async fn wait_store_bound(client: &kube::Client) {
    let claims: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(client.clone(), NS);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let phase = claims
            .get("anneal-content")
            .await
            .unwrap()
            .status
            .and_then(|s| s.phase);
        if phase.as_deref() == Some("Bound") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "PersistentVolumeClaim anneal-content not Bound after 120 s: {phase:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Site `rack1` (with a tracker on [`SERVER_IP`] seeding from `rack1` when
/// `tracker`) and the lease-mode Subnet `rack1` on the segment, its bootd
/// managed.
pub async fn site_and_subnet(client: &kube::Client, tracker: bool) {
    let spec = if tracker {
        serde_json::json!({"tracker": {"ip": SERVER_IP}, "seederSubnetRef": {"name": "rack1"}})
    } else {
        serde_json::json!({})
    };
    apply(
        client,
        serde_json::json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Site",
            "metadata": {"name": "rack1", "namespace": NS}, "spec": spec}),
    )
    .await;
    apply(client, serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": "rack1", "namespace": NS},
        "spec": {"siteRef": {"name": "rack1"}, "cidr": "10.90.0.0/24",
                 "bootd": {"serverIP": SERVER_IP, "mode": "Managed"},
                 "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.90.0.100", "end": "10.90.0.150"}}}}))
    .await;
}

/// The test OS served on the node's address (the ingest Job's pod is on
/// the pod network) and imported as Image `testos` through an ImageImport;
/// [`Import::wait`] waits for the Image.
#[derive(Debug)]
pub struct Import {
    files: Option<crate::images::FileServer>,
    started: Instant,
}

impl Import {
    /// Serves `os`'s image from `work/src` and creates the ImageImport.
    pub async fn start(client: &kube::Client, os: &crate::testos::TestOs, work: &Path) -> Import {
        let src = work.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::copy(&os.image, src.join("testos.raw")).unwrap();
        let files = crate::images::FileServer::start_on(
            &src,
            None,
            anneal_testinfra::NODE_IP.parse().unwrap(),
        );
        let sum = crate::images::sha256_file(&src.join("testos.raw"));
        Api::<ImageImport>::namespaced(client.clone(), NS)
            .create(
                &Default::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
                    "metadata": {"name": "testos"},
                    "spec": {"source": {"url": files.url("testos.raw"), "checksum": format!("sha256:{sum}")},
                             "imageName": "testos", "contentPrefix": "testos", "osFamily": "Linux",
                             "bootable": true},
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        Import {
            files: Some(files),
            started: Instant::now(),
        }
    }

    /// Waits until Image `testos` is Ready (`Err` with why: the import
    /// failed, or 300 s passed); the file server stops then.
    pub async fn wait(&mut self, client: &kube::Client) -> Result<Duration, String> {
        let imports: Api<ImageImport> = Api::namespaced(client.clone(), NS);
        let images: Api<Image> = Api::namespaced(client.clone(), NS);
        loop {
            let st = imports
                .get("testos")
                .await
                .unwrap()
                .status
                .unwrap_or_default();
            if st.state == Some(anneal_api::ImportState::Failed) {
                return Err(format!("ImageImport testos failed: {:?}", st.conditions));
            }
            if images
                .get_opt("testos")
                .await
                .unwrap()
                .and_then(|i| i.status)
                .and_then(|s| s.state)
                == Some(anneal_api::ImageState::Ready)
            {
                self.files = None;
                return Ok(self.started.elapsed());
            }
            if self.started.elapsed() > Duration::from_secs(300) {
                return Err(format!(
                    "Image testos not Ready 300 s after its import: {st:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// The VM (OVMF, TCG, a 3 GiB disk [`SERIAL`], its NIC on the segment,
/// paused until its BMC powers it on) behind a Redfish BMC on `bmc_ip`
/// (where the manager pods reach it), enrolled as Machine [`MACHINE`] of
/// Subnet `rack1`.
pub struct NodeVm {
    /// The VM.
    pub vm: Vm,
    _bmc: anneal_qemu_bmc::RunningBmc,
    enrolled: Instant,
    last: String,
}

impl std::fmt::Debug for NodeVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeVm")
            .field("state", &self.last)
            .finish_non_exhaustive()
    }
}

impl NodeVm {
    /// Launches, serves its BMC and enrols it.
    pub async fn enrol(
        client: &kube::Client,
        segment: &Segment,
        bmc_ip: std::net::IpAddr,
        work: &Path,
    ) -> NodeVm {
        let dir = work.join("vm");
        std::fs::create_dir_all(&dir).unwrap();
        let disk = dir.join("vda.raw");
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(3 << 30)
            .unwrap();
        let tap = segment.ns.add_tap().unwrap();
        let mut nic = NicConfig::virtio(&tap, MAC);
        // OVMF's own PXE client fetches the first stage, as on real hardware
        nic.option_rom = false;
        let cfg = VmConfig {
            firmware: Firmware::Ovmf,
            memory_mib: 1024,
            cpus: 2,
            nics: vec![nic],
            disks: vec![DiskConfig {
                path: disk,
                format: "raw".into(),
                bus: DiskBus::VirtioBlk,
                serial: SERIAL.into(),
            }],
            // paused until the BMC powers it on; the deployed test OS
            // prints the DMI serial
            extra_args: vec![
                "-S".into(),
                "-no-shutdown".into(),
                "-smbios".into(),
                format!("type=1,serial={MACHINE}"),
            ],
            no_reboot: false,
            ..VmConfig::default()
        };
        let launched = Instant::now();
        let vm = Vm::launch(&cfg, Some(&segment.ns)).unwrap();
        while !vm.qmp_path().exists() {
            assert!(
                launched.elapsed() < Duration::from_secs(60),
                "no QMP socket"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let bmc = anneal_qemu_bmc::start(anneal_qemu_bmc::BmcConfig {
            listen: std::net::SocketAddr::new(bmc_ip, 0),
            qmp: vm.qmp_path().to_path_buf(),
            state_file: dir.join("bmc-state.json"),
            request_log: None,
            username: BMC_USER.into(),
            password: BMC_PASSWORD.into(),
            system_id: "vm0".into(),
            tls: None,
        })
        .await
        .unwrap();
        Api::<Secret>::namespaced(client.clone(), NS)
            .create(
                &Default::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": format!("{MACHINE}-bmc")},
                    "stringData": {"username": BMC_USER, "password": BMC_PASSWORD},
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        Api::<Machine>::namespaced(client.clone(), NS)
            .create(
                &Default::default(),
                &serde_json::from_value(serde_json::json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
                    "metadata": {"name": MACHINE},
                    "spec": {
                        "subnetRef": {"name": "rack1"},
                        "bootMACAddress": MAC,
                        "console": ["ttyS0"],
                        "bootLoader": "ipxe",
                        "bmc": {
                            "address": format!("redfish+http://{}", bmc.addr()),
                            "credentialsSecretRef": {"name": format!("{MACHINE}-bmc")},
                        },
                    },
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        NodeVm {
            vm,
            _bmc: bmc,
            enrolled: Instant::now(),
            last: "?".into(),
        }
    }

    /// Waits until the Machine's `status.state` is `until`, printing each
    /// change; after `limit`, fails with [`fail`].
    pub async fn wait_state(
        &mut self,
        client: &kube::Client,
        pods: &Api<Pod>,
        until: &str,
        limit: Duration,
    ) {
        let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
        let since = Instant::now();
        loop {
            let m = serde_json::to_value(machines.get(MACHINE).await.unwrap()).unwrap();
            let state = m["status"]["state"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if state != self.last {
                println!(
                    "machine {MACHINE}: {state} ({:.1} s after enrolment)",
                    self.enrolled.elapsed().as_secs_f64()
                );
                self.last = state.clone();
            }
            if state == until {
                return;
            }
            if since.elapsed() > limit {
                self.fail(
                    pods,
                    &format!(
                        "machine {MACHINE} not {until} {} s after enrolment (state {state:?})",
                        self.enrolled.elapsed().as_secs()
                    ),
                )
                .await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until the deployed test OS has printed its marker and the
    /// machine's name on the console.
    pub async fn wait_deployed_os(&self, pods: &Api<Pod>, os: &crate::testos::TestOs) {
        let marker = format!("ANNEAL-MARKER {}", os.marker_sha256);
        let name = format!("ANNEAL-DEPLOYED {MACHINE}");
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let console = self.vm.serial_text();
            if console.contains(&marker) && console.contains(&name) {
                return;
            }
            if Instant::now() > deadline {
                self.fail(pods, "the deployed OS printed no marker within 300 s")
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Panics with `what`, the console's tail and the pods' logs.
    pub async fn fail(&self, pods: &Api<Pod>, what: &str) -> ! {
        let console = self.vm.serial_text();
        let lines: Vec<&str> = console.lines().collect();
        panic!(
            "{what}\nconsole tail:\n{}\n{}\n{}\n{}",
            lines[lines.len().saturating_sub(40)..].join("\n"),
            bootd_logs(pods).await,
            workload_logs(pods).await,
            crate::node::manager_logs(pods).await
        );
    }

    /// Deletes the Machine's claims and the Machine and waits until it is
    /// gone (a claimed Machine waits for its claim's release; the manager
    /// then clears the boot override and lets it go, the VM's power left as
    /// it is: docs/lifecycle.md, "Delete").
    pub async fn delete(self, client: &kube::Client) {
        let claims: Api<anneal_api::MachineClaim> = Api::namespaced(client.clone(), NS);
        for c in claims.list(&Default::default()).await.unwrap().items {
            let name = c.metadata.name.unwrap_or_default();
            claims.delete(&name, &Default::default()).await.unwrap();
        }
        let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
        machines.delete(MACHINE, &Default::default()).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(90);
        while machines.get_opt(MACHINE).await.unwrap().is_some() {
            assert!(
                Instant::now() < deadline,
                "Machine {MACHINE} still there 90 s after its deletion"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// Claims the machine (`deploy`: Image `testos` to disk [`SERIAL`]).
pub async fn claim(client: &kube::Client) {
    Api::<anneal_api::MachineClaim>::namespaced(client.clone(), NS)
        .create(
            &Default::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
                "metadata": {"name": "deploy"},
                "spec": {"machineName": MACHINE, "imageRef": {"name": "testos"},
                         "targetDisk": {"serialNumber": SERIAL}},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
}

/// Waits until the (only) DeployRun writes its contents; fails if it ended
/// first or after `limit`.
pub async fn wait_writing(client: &kube::Client, vm: &NodeVm, pods: &Api<Pod>, limit: Duration) {
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), NS);
    let since = Instant::now();
    loop {
        let list = runs.list(&Default::default()).await.unwrap().items;
        let phase = list
            .first()
            .and_then(|r| r.status.as_ref())
            .and_then(|s| s.phase);
        match phase {
            Some(RunPhase::WritingContent) => return,
            Some(RunPhase::Succeeded | RunPhase::Failed) => {
                vm.fail(
                    pods,
                    &format!("the run ended before the test saw it writing: {phase:?}"),
                )
                .await;
            }
            _ => {}
        }
        if since.elapsed() > limit {
            vm.fail(pods, &format!("no run writing after {limit:?}: {phase:?}"))
                .await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The one DeployRun, checked Succeeded (the run in progress completed,
/// none was started again); returns it.
pub async fn the_run_succeeded(client: &kube::Client) -> DeployRun {
    use kube::ResourceExt as _;
    let list = Api::<DeployRun>::namespaced(client.clone(), NS)
        .list(&Default::default())
        .await
        .unwrap()
        .items;
    assert_eq!(
        list.len(),
        1,
        "the run in progress completed, none was started again: {:?}",
        list.iter()
            .map(|r| (r.name_any(), r.status.clone()))
            .collect::<Vec<_>>()
    );
    let st = list[0].status.clone().unwrap_or_default();
    assert_eq!(st.phase, Some(RunPhase::Succeeded), "{st:?}");
    list[0].clone()
}

/// Each bootd pod's status and log, for a failure message.
pub async fn bootd_logs(pods: &Api<Pod>) -> String {
    pod_logs(pods, "app.kubernetes.io/component=bootd", true).await
}

/// Each workload pod's (ingest, content server, seeder, tracker, bootd)
/// phase and last log lines, for a failure message.
pub async fn workload_logs(pods: &Api<Pod>) -> String {
    pod_logs(pods, "app.kubernetes.io/managed-by=anneal-manager", false).await
}

/// The pods matching `selector`: their whole status and log (`whole`), or
/// their phase and last 20 log lines.
async fn pod_logs(pods: &Api<Pod>, selector: &str, whole: bool) -> String {
    let mut logs = String::new();
    for p in pods
        .list(&ListParams::default().labels(selector))
        .await
        .unwrap()
        .items
    {
        let name = p.metadata.name.clone().unwrap_or_default();
        let log = pods
            .logs(&name, &Default::default())
            .await
            .unwrap_or_default();
        if whole {
            logs.push_str(&format!("--- {name}: {:?}\n{log}\n", p.status));
        } else {
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            logs.push_str(&format!(
                "--- {name}: {:?}\n{}\n",
                p.status.and_then(|s| s.phase),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            ));
        }
    }
    logs
}
