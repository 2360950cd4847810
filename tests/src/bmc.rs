//! A QEMU VM powered off (`-S`) behind `anneal-qemu-bmc`, sushy-emulator,
//! a Redfish client of either, and a test PKI: the lifecycle and Redfish
//! tests' BMC side.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anneal_manager::redfish::{BmcAddress, Credentials, PowerState, RedfishClient, TlsPolicy};
use anneal_qemu_bmc::{BmcConfig, LogEntry, RunningBmc};
use anneal_testinfra::{ChildGroup, DiskBus, DiskConfig, Netns, NicConfig, Vm, VmConfig};

pub const BMC_USER: &str = "admin";
pub const BMC_PASSWORD: &str = "s3cret-bmc-pw";

/// A VM that starts powered off, and the files of its BMC.
#[derive(Debug)]
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
        crate::eventually(
            "the QMP socket of the BMC's VM",
            Duration::from_secs(30),
            || async { vm.qmp_path().exists() },
        )
        .await;
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
#[derive(Debug)]
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
        crate::eventually(
            &format!("sushy-emulator listening on 127.0.0.1:{port}"),
            Duration::from_secs(60),
            || async { std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() },
        )
        .await;
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

/// Waits until the BMC reports the power state `want`.
pub async fn wait_power(c: &RedfishClient, want: PowerState, timeout: Duration) {
    crate::eventually(&format!("power state {want:?}"), timeout, || async {
        let got = c.power_state().await.unwrap();
        if got == want { Ok(()) } else { Err(got) }
    })
    .await;
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

/// The wall clock in milliseconds since the epoch, as the BMC stamps its
/// request log ([`LogEntry::ts_ms`]).
pub fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// A VM that starts powered off behind Debian's ipmi_sim: its
/// chassis control drives the VM over QMP (qemu/ipmi-sim/qmp-hook.py).
#[derive(Debug)]
pub struct IpmiVm {
    pub vm: Vm,
    pub dir: tempfile::TempDir,
    pub sim: anneal_qemu_bmc::ipmi_sim::RunningIpmiSim,
    pub addr: SocketAddr,
}

impl IpmiVm {
    /// Launches an OVMF VM (NIC on a tap of `ns`, one blank disk), paused,
    /// and ipmi_sim on a free loopback UDP port, answering once this
    /// returns.
    pub async fn launch(ns: &Netns, mac: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("anneal-ipmivm-")
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
                serial: "IPMIDISK01".into(),
            }],
            extra_args: vec!["-S".into(), "-no-shutdown".into()],
            no_reboot: false,
            ..VmConfig::default()
        };
        let vm = Vm::launch(&cfg, Some(ns)).unwrap();
        crate::eventually(
            "the QMP socket of the IPMI VM",
            Duration::from_secs(30),
            || async { vm.qmp_path().exists() },
        )
        .await;
        let addr = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let sim = anneal_qemu_bmc::ipmi_sim::start(&anneal_qemu_bmc::ipmi_sim::IpmiSimConfig {
            listen: addr,
            username: BMC_USER.into(),
            password: BMC_PASSWORD.into(),
            dir: dir.path().join("sim"),
            qmp: Some(vm.qmp_path().to_path_buf()),
        })
        .unwrap();
        let me = Self { vm, dir, sim, addr };
        let c = me.client(BMC_PASSWORD);
        crate::eventually(
            &format!("ipmi_sim answering on {addr}"),
            Duration::from_secs(30),
            || async { c.power_state().await.ok() },
        )
        .await;
        me
    }

    /// `ipmi://127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("ipmi://{}", self.addr)
    }

    /// An IPMI client of the simulator.
    pub fn client(&self, password: &str) -> anneal_manager::ipmi::IpmiClient {
        anneal_manager::ipmi::IpmiClient::new(
            &self.addr.ip().to_string(),
            self.addr.port(),
            BMC_USER,
            anneal_api::agent::Token::new(password.to_string()),
            Duration::from_secs(3),
        )
    }

    /// Whether the VM's CPUs run (QMP).
    pub async fn running(&self) -> bool {
        let mut q = anneal_qemu_bmc::qmp::Qmp::connect(self.vm.qmp_path())
            .await
            .unwrap();
        q.running().await.unwrap()
    }
}

/// Datagrams a [`UdpTap`] received, with their arrival times.
type Received = std::sync::Arc<std::sync::Mutex<Vec<(std::time::Instant, Vec<u8>)>>>;

/// A UDP address standing in for an IPMI BMC that records every
/// datagram it receives with its arrival time: silent, or relaying each
/// datagram to `upstream` (an ipmi_sim) and the answers back to the last
/// sender. The task ends when the tap drops.
#[derive(Debug)]
pub struct UdpTap {
    pub addr: SocketAddr,
    seen: Received,
    task: tokio::task::JoinHandle<()>,
}

impl UdpTap {
    pub async fn start(upstream: Option<SocketAddr>) -> Self {
        let front = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = front.local_addr().unwrap();
        let back = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        if let Some(up) = upstream {
            back.connect(up).await.unwrap();
        }
        let seen = Received::default();
        let log = seen.clone();
        let task = tokio::spawn(async move {
            let (mut a, mut b) = (vec![0u8; 2048], vec![0u8; 2048]);
            let mut peer = None;
            loop {
                tokio::select! {
                    r = front.recv_from(&mut a) => {
                        let Ok((n, from)) = r else { continue };
                        log.lock().unwrap().push((std::time::Instant::now(), a[..n].to_vec()));
                        if upstream.is_some() {
                            peer = Some(from);
                            let _ = back.send(&a[..n]).await;
                        }
                    }
                    r = back.recv(&mut b), if upstream.is_some() => {
                        if let (Ok(n), Some(p)) = (r, peer) {
                            let _ = front.send_to(&b[..n], p).await;
                        }
                    }
                }
            }
        });
        Self { addr, seen, task }
    }

    /// `ipmi://127.0.0.1:PORT`.
    pub fn address(&self) -> String {
        format!("ipmi://{}", self.addr)
    }

    /// Arrival times of the RMCP+ Open Session Requests so far (each opens
    /// one session attempt of the driver).
    pub fn open_session_requests(&self) -> Vec<std::time::Instant> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, d)| d.len() > 5 && d[4] == 0x06 && d[5] & 0x3f == 0x10)
            .map(|(t, _)| *t)
            .collect()
    }
}

impl Drop for UdpTap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Groups arrival times into bursts: a gap longer than `quiet` starts a new
/// one.
pub fn bursts(times: &[std::time::Instant], quiet: Duration) -> Vec<Vec<std::time::Instant>> {
    let mut out: Vec<Vec<std::time::Instant>> = Vec::new();
    for t in times {
        match out.last_mut() {
            Some(b) if *t - *b.last().unwrap() <= quiet => b.push(*t),
            _ => out.push(vec![*t]),
        }
    }
    out
}

/// An ipmi_sim with no VM behind it (its chassis is the state directory
/// under `dir`) on a free loopback UDP port, answering once this returns.
pub async fn ipmi_sim_alone(
    dir: &std::path::Path,
) -> (anneal_qemu_bmc::ipmi_sim::RunningIpmiSim, SocketAddr) {
    let addr = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let sim = anneal_qemu_bmc::ipmi_sim::start(&anneal_qemu_bmc::ipmi_sim::IpmiSimConfig {
        listen: addr,
        username: BMC_USER.into(),
        password: BMC_PASSWORD.into(),
        dir: dir.to_path_buf(),
        qmp: None,
    })
    .unwrap();
    let c = anneal_manager::ipmi::IpmiClient::new(
        &addr.ip().to_string(),
        addr.port(),
        BMC_USER,
        anneal_api::agent::Token::new(BMC_PASSWORD.to_string()),
        Duration::from_secs(1),
    );
    crate::eventually(
        &format!("ipmi_sim answering on {addr}"),
        Duration::from_secs(30),
        || async { c.power_state().await.map_err(|e| e.to_string()) },
    )
    .await;
    (sim, addr)
}
