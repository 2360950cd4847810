//! Leases across a restart (docs/bootd.md, "Leases"), with a real VM: "a VM
//! that leased an address before a bootd restart renews the same address after
//! it".
//!
//! OVMF's PXE client → the bootd binary (lease mode, 2 min leases, a lease
//! file, inside the test namespace) → `snponly.efi` over TFTP → the iPXE
//! script over HTTP → the Debian kernel and the agent initramfs. The agent
//! (PID 1) takes its lease from bootd and keeps it (renewal at half the lease
//! time, a REQUEST with `ciaddr`). After the lease, bootd is stopped by its
//! PID and started again on the same lease file. The VM's renewal must be
//! ACKed by the new bootd with the same address, and nothing else handed out.
//!
//! Two cases run at once, each in its own namespace:
//! - `reserved` (the manager's model): the VM's address is a reservation; a
//!   second machine with a persisted lease is unlisted across the restart,
//!   and the startup filter must drop its lease (it then gets nothing).
//! - `dynamic`: `answerAll`, a lease range of one address, no reservation.
//!   The lease file is bootd's only memory of who holds the address: after
//!   the restart another client must be refused (the same table without the
//!   lease file would offer it that address, checked in-process) and the
//!   VM's renewal ACKed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_tests::artifacts;
use anneal_tests::dhcp_probe;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anneal_dhcp::{Decision, DropReason, Lease, Leases, Mac};
use anneal_testinfra::{
    ChildGroup, DebianKernel, Firmware, Netns, NicConfig, Vm, VmConfig, debian_kernel,
};

const TOKEN: &str = "dGhpcy1pcy1hLXRlc3QtYm9vdC10b2tlbi0wMDAx";
const FILES: &str = "{snponly.efi: /usr/lib/ipxe/snponly.efi, ipxe.efi: /usr/lib/ipxe/ipxe.efi}";

/// The reserved case's VM, and the machine unlisted across the restart.
const RES_MAC: &str = "52:54:00:b3:00:01";
const RES_ADDR: &str = "10.77.0.50";
const GONE_MAC: &str = "52:54:00:b3:00:99";
const GONE_ADDR: &str = "10.77.0.51";
/// The dynamic case's VM, its only possible address, and another client.
const DYN_MAC: &str = "52:54:00:b3:00:02";
const DYN_ADDR: &str = "10.77.0.100";
const OTHER_MAC: &str = "52:54:00:b3:00:77";

/// Kernel, bootd binary, agent initramfs: built once for both cases.
struct Artifacts {
    kernel: DebianKernel,
    bootd: PathBuf,
    initrd: PathBuf,
}

fn artifacts() -> &'static Artifacts {
    static A: OnceLock<Artifacts> = OnceLock::new();
    A.get_or_init(|| {
        let kernel = debian_kernel().unwrap();
        let agent = artifacts::agent_musl();
        let tool = artifacts::initramfs_tool();
        let bootd = artifacts::bootd();
        let dir = artifacts::target_dir().join("bootd-renew");
        std::fs::create_dir_all(&dir).unwrap();
        let initrd = dir.join("agent.cpio.zst");
        artifacts::build_initramfs(&tool, &agent, &kernel.modules, &initrd);
        Artifacts {
            kernel,
            bootd,
            initrd,
        }
    })
}

fn common(a: &Artifacts) -> String {
    format!(
        "serverIP: 10.77.0.1\ncidr: 10.77.0.0/24\nfiles: {FILES}\n\
         artifacts: {{kernel: {}, initrd: {}}}\n\
         api: {{url: \"https://10.77.0.1:8443\", caSha256: \"{}\"}}\n",
        a.kernel.vmlinuz.display(),
        a.initrd.display(),
        "ab".repeat(32),
    )
}

/// The reserved case's table; `with_gone` lists the second machine too.
fn reserved_config(a: &Artifacts, with_gone: bool) -> String {
    let mut s = common(a)
        + "dhcp: {mode: lease, gateway: \"\", leaseTime: 2m}\n"
        + &format!(
            "machines:\n  - name: lab/renew\n    mac: \"{RES_MAC}\"\n    address: {RES_ADDR}\n    \
             console: [ttyS0]\n    token: {TOKEN}\n"
        );
    if with_gone {
        s.push_str(&format!(
            "  - name: lab/gone\n    mac: \"{GONE_MAC}\"\n    address: {GONE_ADDR}\n"
        ));
    }
    s
}

/// The dynamic case's table: no reservation, `answerAll`, one address.
fn dynamic_config(a: &Artifacts) -> String {
    common(a)
        + "answerAll: true\n"
        + &format!(
            "dhcp: {{mode: lease, gateway: \"\", leaseTime: 2m, leaseRange: {{start: {DYN_ADDR}, end: {DYN_ADDR}}}}}\n\
             machines:\n  - name: lab/dynamic\n    mac: \"{DYN_MAC}\"\n    console: [ttyS0]\n    token: {TOKEN}\n"
        )
}

/// A DHCPDISCOVER from `mac` (PXE vendor class).
/// What a bootd serving `cfg` with `leases` decides for a DISCOVER from `mac`.
fn would_answer(cfg: &str, leases: &[Lease], mac: Mac) -> Decision {
    let snap = anneal_bootd::StaticConfig::from_yaml(cfg)
        .unwrap()
        .snapshot(8080, "r".into())
        .unwrap();
    dhcp_probe::decide_discover(
        &snap.table,
        &Leases::from_leases(leases.iter().copied()),
        mac,
    )
}

/// busybox udhcpc with `mac` on a veth into `ns`'s bridge, asking for
/// `request`; (got a lease, its output, the client's namespace).
fn udhcpc(ns: &Netns, mac: &str, request: &str) -> (bool, String, Netns) {
    let other = Netns::bare("brg").unwrap();
    ns.add_veth_to_bridge(&other, "vg0", "g0", "10.77.0.3/24")
        .unwrap();
    other.ip(&["link", "set", "g0", "address", mac]).unwrap();
    let out = other
        .exec("busybox")
        .args([
            "udhcpc",
            "-i",
            "g0",
            "-n",
            "-q",
            "-f",
            "-t",
            "2",
            "-T",
            "1",
            "-A",
            "1",
            "-s",
            "/bin/true",
            "-r",
            request,
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text, other)
}

struct Bootd {
    child: ChildGroup,
    log: PathBuf,
}

impl Bootd {
    async fn start(ns: &Netns, bin: &Path, config: &Path, leases: &Path, log: PathBuf) -> Bootd {
        let child = ChildGroup::spawn(
            "bootd",
            ns.exec(bin.to_str().unwrap())
                .arg("--config")
                .arg(config)
                .args(["--interface", "br0", "--lease-file"])
                .arg(leases)
                .env("RUST_LOG", "info")
                .env("NO_COLOR", "1")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap()),
        )
        .unwrap();
        let mut b = Bootd { child, log };
        // its "bootd serving" line; a generous deadline for a loaded host
        let deadline = Instant::now() + Duration::from_secs(60);
        while !b.log_text().contains("bootd serving") {
            assert!(
                b.child.try_exit().is_none(),
                "bootd exited:\n{}",
                b.log_text()
            );
            assert!(
                Instant::now() < deadline,
                "bootd did not start within 60 s:\n{}",
                b.log_text()
            );
            tokio::time::sleep(anneal_tests::wait::POLL).await;
        }
        b
    }

    /// The log without ANSI colour sequences.
    fn log_text(&self) -> String {
        let raw = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut out = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }

    /// SIGTERM to its PID, then waits for the exit.
    async fn stop(&mut self) {
        let pid = self.child.pid().to_string();
        let st = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(st.success(), "kill -TERM {pid}");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.child.try_exit().is_none() {
            assert!(
                Instant::now() < deadline,
                "bootd (pid {pid}) still running 60 s after SIGTERM:\n{}",
                self.log_text()
            );
            tokio::time::sleep(anneal_tests::wait::POLL).await;
        }
    }
}

/// `(mac, yiaddr, to)` of every ACK and OFFER bootd logged.
fn answers(log: &str) -> Vec<(String, String, String, String)> {
    let field = |l: &str, k: &str| -> String {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or("")
            .trim_matches('"')
            .to_string()
    };
    log.lines()
        .filter(|l| l.contains("answered"))
        .map(|l| {
            (
                field(l, "mac"),
                field(l, "reply"),
                field(l, "yiaddr"),
                field(l, "to"),
            )
        })
        .filter(|(_, r, _, _)| r == "ack" || r == "offer")
        .collect()
}

fn metrics(ns: &Netns) -> String {
    let out = ns
        .exec("busybox")
        .args(["wget", "-q", "-O-", "http://10.77.0.1:8080/metrics"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn metric(m: &str, needle: &str) -> u64 {
    m.lines()
        .filter(|l| !l.starts_with('#') && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reserved,
    Dynamic,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_renews_the_same_address_after_a_bootd_restart() {
    tokio::task::spawn_blocking(artifacts).await.unwrap();
    let (a, b) = tokio::join!(
        tokio::spawn(run_case(Kind::Reserved)),
        tokio::spawn(run_case(Kind::Dynamic))
    );
    let mut failures = Vec::new();
    for (kind, r) in [(Kind::Reserved, a), (Kind::Dynamic, b)] {
        if let Err(e) = r {
            failures.push(format!("case {kind:?}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

async fn run_case(kind: Kind) {
    let art = artifacts();
    let (mac_s, addr_s) = match kind {
        Kind::Reserved => (RES_MAC, RES_ADDR),
        Kind::Dynamic => (DYN_MAC, DYN_ADDR),
    };
    let vm_mac: Mac = mac_s.parse().unwrap();
    let vm_addr: Ipv4Addr = addr_s.parse().unwrap();
    let gone_mac: Mac = GONE_MAC.parse().unwrap();
    let other_mac: Mac = OTHER_MAC.parse().unwrap();
    let tag = format!("{kind:?}").to_lowercase();

    let mut ns = Netns::create("brn").unwrap();
    ns.start_router_advertisements().unwrap();
    let dir = ns.dir();
    let (text1, text2) = match kind {
        Kind::Reserved => (reserved_config(art, true), reserved_config(art, false)),
        Kind::Dynamic => (dynamic_config(art), dynamic_config(art)),
    };
    let cfg1 = dir.join("bootd-1.yaml");
    let cfg2 = dir.join("bootd-2.yaml");
    std::fs::write(&cfg1, &text1).unwrap();
    std::fs::write(&cfg2, &text2).unwrap();
    let leases = dir.join("leases.json");
    if kind == Kind::Reserved {
        // The second machine holds a lease from before (an earlier boot).
        anneal_bootd::leasefile::store(
            &leases,
            &[Lease {
                mac: gone_mac,
                address: GONE_ADDR.parse().unwrap(),
                expires: anneal_bootd::unix_now() + 3600,
            }],
        )
        .unwrap();
    }

    let mut first = Bootd::start(&ns, &art.bootd, &cfg1, &leases, dir.join("bootd-1.log")).await;
    let tap = ns.add_tap().unwrap();
    let mut nic = NicConfig::virtio(&tap, mac_s);
    nic.option_rom = false;
    let vm_cfg = VmConfig {
        firmware: Firmware::Ovmf,
        memory_mib: 1024,
        cpus: 2,
        nics: vec![nic],
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&vm_cfg, Some(&ns)).unwrap();
    let leased = vm
        .wait_for_line(
            &format!(
                r"anneal: DHCP lease {addr_s}/24 on \S+ from 10\.77\.0\.1, router none, lease 120 s"
            ),
            // OVMF, iPXE, the kernel and the agent under TCG: 60-120 s on
            // a quiet machine, 298.6 s in one CI run with both cases' VMs,
            // another lane's VMs and the host's steal on two cores (the
            // other case missed 300 s there). A bound on a wait, not a
            // figure: the lease line is the event.
            Duration::from_secs(600),
        )
        .await
        .unwrap_or_else(|e| panic!("{tag}: {e:#}\nbootd:\n{}", first.log_text()));
    let t_lease = vm.uptime();
    println!(
        "{tag}: lease after {:.1} s: {leased}",
        t_lease.as_secs_f64()
    );

    // Restart bootd on the same lease file.
    let m1 = metrics(&ns);
    first.stop().await;
    let log1 = first.log_text();
    let held = anneal_bootd::leasefile::load(&leases).unwrap();
    let before = held
        .iter()
        .find(|l| l.mac == vm_mac)
        .copied()
        .unwrap_or_else(|| panic!("{tag}: the VM's lease was not persisted: {held:?}"));
    assert_eq!(before.address, vm_addr);
    let restart = Instant::now();
    let second = Bootd::start(&ns, &art.bootd, &cfg2, &leases, dir.join("bootd-2.log")).await;
    let t_restart = vm.uptime();
    println!(
        "{tag}: bootd restarted at {:.1} s (down {:.2} s)",
        t_restart.as_secs_f64(),
        restart.elapsed().as_secs_f64()
    );
    let reloaded = anneal_bootd::leasefile::load(&leases).unwrap();
    assert_eq!(
        reloaded
            .iter()
            .map(|l| (l.mac, l.address))
            .collect::<Vec<_>>(),
        vec![(vm_mac, vm_addr)],
        "{tag}: the lease file after the restart holds the VM's lease only"
    );

    // Another client asks after the restart and gets nothing.
    let (asker, asked) = match kind {
        Kind::Reserved => {
            assert!(held.iter().any(|l| l.mac == gone_mac), "{held:?}");
            let log2 = second.log_text();
            assert!(
                log2.lines()
                    .any(|l| l.contains("dropped persisted lease") && l.contains(GONE_MAC)),
                "the startup filter did not drop the unlisted MAC's lease:\n{log2}"
            );
            (GONE_MAC, GONE_ADDR)
        }
        Kind::Dynamic => {
            // Control: the same table without the lease file would offer
            // the VM's address to the other client; with it, the pool is
            // exhausted.
            match would_answer(&text2, &[], other_mac) {
                Decision::Reply(r) => assert_eq!(r.message.yiaddr(), vm_addr),
                d => panic!("control: {d:?}"),
            }
            assert!(matches!(
                would_answer(&text2, &reloaded, other_mac),
                Decision::Drop {
                    reason: DropReason::PoolExhausted
                }
            ));
            (OTHER_MAC, DYN_ADDR)
        }
    };
    let (got, text, other) = udhcpc(&ns, asker, asked);
    assert!(!got, "{tag}: {asker} got a lease after the restart: {text}");

    // The VM's renewal, ACKed by the new bootd.
    let renewed = vm
        .wait_for_line(
            &format!(r"anneal: DHCP lease {addr_s}/24 on \S+ renewed from 10\.77\.0\.1"),
            Duration::from_secs(150),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{tag}: {e:#}\nbootd after the restart:\n{}",
                second.log_text()
            )
        });
    let t_renew = vm.uptime();
    println!(
        "{tag}: renewed at {:.1} s: {renewed}",
        t_renew.as_secs_f64()
    );
    // The lease file shows the extension.
    let after = anneal_tests::eventually(
        "the renewed lease persisted with a later expiry",
        Duration::from_secs(30),
        || async {
            let after = anneal_bootd::leasefile::load(&leases)
                .unwrap()
                .into_iter()
                .find(|l| l.mac == vm_mac);
            match after {
                Some(a) if a.expires > before.expires => Ok(a),
                other => Err(other),
            }
        },
    )
    .await;
    let m2 = metrics(&ns);
    let log2 = second.log_text();
    let console = vm.serial_text();
    vm.kill();
    drop(second);
    drop(other);

    assert_eq!(after.address, vm_addr);
    assert!(
        after.expires > before.expires,
        "{tag}: renewal extended the persisted lease: {before:?} → {after:?}"
    );
    // The first bootd handed out only the VM's address, to the VM.
    let a1 = answers(&log1);
    assert!(
        a1.iter()
            .any(|(m, r, y, _)| m == mac_s && r == "ack" && y == addr_s),
        "{log1}"
    );
    assert!(
        a1.iter().all(|(m, _, y, _)| m == mac_s && y == addr_s),
        "{tag}: the first bootd answered another client or address: {a1:?}"
    );
    // The second bootd: the renewal only, unicast to the VM's own address
    // (a REQUEST with ciaddr); the other client refused.
    let a2 = answers(&log2);
    assert!(
        a2.iter().all(|(m, _, y, _)| m == mac_s && y == addr_s),
        "{tag}: another address or client was answered after the restart: {a2:?}"
    );
    assert!(
        a2.iter()
            .any(|(_, r, _, to)| r == "ack" && to == &format!("{addr_s}:68")),
        "{tag}: no renewal ACK to {addr_s}:68 after the restart: {a2:?}\n{log2}"
    );
    assert!(
        log2.lines()
            .any(|l| l.contains("no answer") && l.contains(asker)),
        "{tag}: {asker}'s request was not refused: {log2}"
    );
    // Metrics of the new bootd: the ACK, no NAK, no offer (the VM never went
    // back to DISCOVER, the other client got none).
    assert!(
        metric(&m2, "msg_type=\"request\",outcome=\"ack\"") >= 1,
        "{m2}"
    );
    assert_eq!(metric(&m2, "outcome=\"nak\""), 0, "{m2}");
    assert_eq!(metric(&m2, "outcome=\"offer\""), 0, "{m2}");
    assert!(
        metric(&m1, "msg_type=\"request\",outcome=\"ack\"") >= 1,
        "{m1}"
    );
    if kind == Kind::Dynamic {
        assert!(
            metric(&m2, "drop_pool_exhausted") >= 1,
            "the other client was not refused for an exhausted pool: {m2}"
        );
    }
    // The console: one lease, renewed, never moved or failed.
    for bad in ["DHCP moved", "renewal on", "expired; asking again"] {
        assert!(
            !console.contains(bad),
            "{tag}: console has {bad:?}:\n{console}"
        );
    }
    println!(
        "{tag}: QEMU → lease {:.1} s; restart at {:.1} s; renewal ACKed at {:.1} s",
        t_lease.as_secs_f64(),
        t_restart.as_secs_f64(),
        t_renew.as_secs_f64()
    );
}
