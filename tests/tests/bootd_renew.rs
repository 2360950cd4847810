//! Issue 3 acceptance, with a real VM: "a VM that leased an address before a
//! bootd restart renews the same address after it".
//!
//! OVMF's PXE client → the bootd binary (lease mode, 2 min leases, a lease
//! file, inside the test namespace) → `snponly.efi` over TFTP → the iPXE
//! script over HTTP → the Debian kernel and the agent initramfs. The agent
//! (PID 1) takes its lease from bootd and keeps it (renewal at half the lease
//! time, a REQUEST with `ciaddr`). After the lease, bootd is stopped by its
//! PID and started again on the same lease file with a table that no longer
//! lists a second machine (whose persisted lease must not survive the
//! restart). The VM's renewal must be ACKed by the new bootd with the same
//! address, and nothing else handed out.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod agent_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anneal_dhcp::{Lease, Mac};
use anneal_testinfra::{ChildGroup, Firmware, Netns, NicConfig, Vm, VmConfig, debian_kernel};

const VM_MAC: &str = "52:54:00:b3:00:01";
const VM_ADDR: &str = "10.77.0.50";
/// Enrolled before the restart (with a persisted lease), gone after it.
const GONE_MAC: &str = "52:54:00:b3:00:99";
const GONE_ADDR: &str = "10.77.0.51";
const TOKEN: &str = "dGhpcy1pcy1hLXRlc3QtYm9vdC10b2tlbi0wMDAx";
const FILES: &str = "{snponly.efi: /usr/lib/ipxe/snponly.efi, ipxe.efi: /usr/lib/ipxe/ipxe.efi}";

fn bootd_bin() -> PathBuf {
    let out = Command::new("cargo")
        .current_dir(agent_common::root())
        .args(["build", "--quiet", "-p", "anneal-bootd", "--bin", "bootd"])
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "building bootd failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    agent_common::target_dir().join("debug/bootd")
}

/// The static boot table; `with_gone` lists the second machine too.
fn config(kernel: &Path, initrd: &Path, with_gone: bool) -> String {
    let mut s = format!(
        "serverIP: 10.77.0.1\ncidr: 10.77.0.0/24\n\
         dhcp: {{mode: lease, gateway: \"\", leaseTime: 2m}}\n\
         files: {FILES}\n\
         artifacts: {{kernel: {}, initrd: {}}}\n\
         api: {{url: \"https://10.77.0.1:8443\", caSha256: \"{}\"}}\n\
         machines:\n  - name: lab/renew\n    mac: \"{VM_MAC}\"\n    address: {VM_ADDR}\n    \
         console: [ttyS0]\n    token: {TOKEN}\n",
        kernel.display(),
        initrd.display(),
        "ab".repeat(32),
    );
    if with_gone {
        s.push_str(&format!(
            "  - name: lab/gone\n    mac: \"{GONE_MAC}\"\n    address: {GONE_ADDR}\n"
        ));
    }
    s
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
        for _ in 0..100 {
            if b.log_text().contains("bootd serving") {
                return b;
            }
            assert!(
                b.child.try_exit().is_none(),
                "bootd exited:\n{}",
                b.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("bootd did not start:\n{}", b.log_text());
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
        for _ in 0..100 {
            if self.child.try_exit().is_some() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("bootd ignored SIGTERM");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_renews_the_same_address_after_a_bootd_restart() {
    let kernel = debian_kernel().unwrap();
    let agent = agent_common::agent_musl();
    let tool = agent_common::initramfs_tool();
    let bootd = bootd_bin();

    let mut ns = Netns::create("brn").unwrap();
    ns.start_router_advertisements().unwrap();
    let dir = ns.dir();
    let initrd = dir.join("agent.cpio.zst");
    agent_common::build_initramfs(&tool, &agent, &kernel.modules, &initrd);
    let cfg1 = dir.join("bootd-1.yaml");
    let cfg2 = dir.join("bootd-2.yaml");
    std::fs::write(&cfg1, config(&kernel.vmlinuz, &initrd, true)).unwrap();
    std::fs::write(&cfg2, config(&kernel.vmlinuz, &initrd, false)).unwrap();

    // The second machine holds a lease from before (an earlier boot).
    let leases = dir.join("leases.json");
    let vm_mac: Mac = VM_MAC.parse().unwrap();
    let gone_mac: Mac = GONE_MAC.parse().unwrap();
    let vm_addr: std::net::Ipv4Addr = VM_ADDR.parse().unwrap();
    anneal_bootd::leasefile::store(
        &leases,
        &[Lease {
            mac: gone_mac,
            address: GONE_ADDR.parse().unwrap(),
            expires: anneal_bootd::unix_now() + 3600,
        }],
    )
    .unwrap();

    let mut first = Bootd::start(&ns, &bootd, &cfg1, &leases, dir.join("bootd-1.log")).await;
    let tap = ns.add_tap().unwrap();
    let mut nic = NicConfig::virtio(&tap, VM_MAC);
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
            &format!(r"anneal: DHCP lease {VM_ADDR}/24 on \S+ from 10\.77\.0\.1, router none, lease 120 s"),
            Duration::from_secs(300),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nbootd:\n{}", first.log_text()));
    let t_lease = vm.uptime();
    println!("lease after {:.1} s: {leased}", t_lease.as_secs_f64());

    // Restart bootd on the same lease file (the gone machine unlisted).
    let m1 = metrics(&ns);
    first.stop().await;
    let log1 = first.log_text();
    let held = anneal_bootd::leasefile::load(&leases).unwrap();
    let before = held
        .iter()
        .find(|l| l.mac == vm_mac)
        .copied()
        .unwrap_or_else(|| panic!("the VM's lease was not persisted: {held:?}"));
    assert_eq!(before.address, vm_addr);
    assert!(held.iter().any(|l| l.mac == gone_mac), "{held:?}");
    let restart = Instant::now();
    let second = Bootd::start(&ns, &bootd, &cfg2, &leases, dir.join("bootd-2.log")).await;
    let t_restart = vm.uptime();
    println!(
        "bootd restarted at {:.1} s (down {:.2} s)",
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
        "the startup filter keeps the VM's lease and drops the unlisted MAC's"
    );
    let log2 = second.log_text();
    assert!(
        log2.lines()
            .any(|l| l.contains("dropped persisted lease") && l.contains(GONE_MAC)),
        "{log2}"
    );

    // The unlisted MAC asks for its old address and gets nothing.
    let other = Netns::bare("brg").unwrap();
    ns.add_veth_to_bridge(&other, "vg0", "g0", "10.77.0.3/24")
        .unwrap();
    other
        .ip(&["link", "set", "g0", "address", GONE_MAC])
        .unwrap();
    let udhcpc = other
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
            GONE_ADDR,
        ])
        .output()
        .unwrap();
    assert!(
        !udhcpc.status.success(),
        "the unlisted MAC got a lease: {}",
        String::from_utf8_lossy(&udhcpc.stderr)
    );

    // The VM's renewal, ACKed by the new bootd.
    let renewed = vm
        .wait_for_line(
            &format!(r"anneal: DHCP lease {VM_ADDR}/24 on \S+ renewed from 10\.77\.0\.1"),
            Duration::from_secs(150),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nbootd after the restart:\n{}", second.log_text()));
    let t_renew = vm.uptime();
    println!("renewed at {:.1} s: {renewed}", t_renew.as_secs_f64());
    // The lease file shows the extension.
    let mut after = None;
    for _ in 0..50 {
        after = anneal_bootd::leasefile::load(&leases)
            .unwrap()
            .into_iter()
            .find(|l| l.mac == vm_mac);
        if after.is_some_and(|a| a.expires > before.expires) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = after.unwrap();
    let m2 = metrics(&ns);
    let log2 = second.log_text();
    let console = vm.serial_text();
    vm.kill();
    drop(second);
    drop(other);

    assert_eq!(after.address, vm_addr);
    assert!(
        after.expires > before.expires,
        "renewal extended the persisted lease: {before:?} → {after:?}"
    );
    // What the first bootd handed out: only the VM's address, to the VM.
    let a1 = answers(&log1);
    assert!(
        a1.iter()
            .any(|(m, r, y, _)| m == VM_MAC && r == "ack" && y == VM_ADDR),
        "{log1}"
    );
    // What the second bootd handed out: the renewal only, unicast to the
    // VM's own address (a REQUEST with ciaddr).
    let a2 = answers(&log2);
    assert!(
        a2.iter().all(|(m, _, y, _)| m == VM_MAC && y == VM_ADDR),
        "another address or client was answered after the restart: {a2:?}"
    );
    assert!(
        a2.iter()
            .any(|(_, r, _, to)| r == "ack" && to == &format!("{VM_ADDR}:68")),
        "no renewal ACK to {VM_ADDR}:68 after the restart: {a2:?}\n{log2}"
    );
    assert!(
        a1.iter().all(|(_, _, y, _)| y == VM_ADDR),
        "the first bootd handed out another address: {a1:?}"
    );
    assert!(
        log2.lines()
            .any(|l| l.contains("no answer") && l.contains(GONE_MAC)),
        "the unlisted MAC's request was not refused: {log2}"
    );
    // Metrics of the new bootd: the ACK, no NAK, no offers (the VM never
    // went back to DISCOVER).
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
    // The console: one lease, renewed, never moved or failed.
    for bad in ["DHCP moved", "renewal on", "expired; asking again"] {
        assert!(!console.contains(bad), "console has {bad:?}:\n{console}");
    }
    println!(
        "QEMU → lease {:.1} s; restart at {:.1} s; renewal ACKed at {:.1} s",
        t_lease.as_secs_f64(),
        t_restart.as_secs_f64(),
        t_renew.as_secs_f64()
    );
}
