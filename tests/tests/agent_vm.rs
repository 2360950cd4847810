//! The agent as PID 1 in a VM: the Debian kernel boots our initramfs
//! (-kernel/-initrd on OVMF, TCG) with a virtio NIC, a virtio-blk and an NVMe
//! disk (serials on the QEMU command line); the agent loads the drivers by
//! modalias, takes a DHCP lease from dnsmasq in the test namespace, registers
//! over HTTPS with the pinned CA at a protocol test server in the same
//! namespace, sends the inventory and powers off when told.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_tests::{agent_vm, artifacts};

use std::process::Stdio;
use std::time::Duration;

use anneal_api::agent::{FirmwareMode, HardwareReport};
use anneal_testinfra::{
    ChildGroup, DiskBus, DiskConfig, Firmware, Netns, NicConfig, Vm, VmConfig, debian_kernel,
};

const MAC: &str = "52:54:00:a6:00:01";
const TOKEN: &str = "dGhpcy1pcy1hLXRlc3QtYm9vdC10b2tlbi0wMDAx";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_boots_registers_and_reports() {
    let kernel = debian_kernel().unwrap();
    let agent = artifacts::agent_musl();
    let tool = artifacts::initramfs_tool();
    let fake = artifacts::fake_manager();

    let ns = Netns::create("agvm").unwrap();
    let dir = ns.dir();
    let initrd = dir.join("agent.cpio.zst");
    artifacts::build_initramfs(&tool, &agent, &kernel.modules, &initrd);

    // DHCP from dnsmasq (addresses only), no ping delay.
    let _dnsmasq = agent_vm::dnsmasq(&ns);

    // The agent API stand-in, inside the namespace on the bridge address.
    let (_manager, out, pin) = agent_vm::fake_manager(
        &ns,
        &fake,
        ("10.77.0.1:8443", TOKEN, "default/vm-agent"),
        &dir,
    )
    .await
    .unwrap();

    let mut disks = Vec::new();
    for (bus, serial, mib) in [
        (DiskBus::VirtioBlk, "AGENTVBLK01", 256u64),
        (DiskBus::Nvme, "AGENTNVME01", 128),
    ] {
        let path = dir.join(format!("{serial}.raw"));
        std::fs::File::create(&path)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        disks.push(DiskConfig {
            path,
            format: "raw".into(),
            bus,
            serial: serial.into(),
        });
    }
    let tap = ns.add_tap().unwrap();
    let mut nic = NicConfig::virtio(&tap, MAC);
    nic.option_rom = false;
    nic.bootindex = None;
    let bootif = agent_vm::bootif(MAC);
    let cfg = VmConfig {
        firmware: Firmware::Ovmf,
        memory_mib: 1024,
        cpus: 2,
        nics: vec![nic],
        disks,
        kernel: Some(kernel.vmlinuz.clone()),
        initrd: Some(initrd),
        append: Some(format!(
            "console=ttyS0 panic=-1 quiet anneal.api=https://10.77.0.1:8443 anneal.ca={pin} \
             anneal.token={TOKEN} anneal.machine=default/vm-agent BOOTIF={bootif}"
        )),
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&cfg, Some(&ns)).unwrap();
    let registered = vm
        .wait_for_line(
            r"anneal: registered as default/vm-agent",
            Duration::from_secs(240),
        )
        .await
        .unwrap();
    let at_registration = vm.uptime();
    vm.wait_for_line(r"anneal: powering off", Duration::from_secs(60))
        .await
        .unwrap();
    let console = vm.serial_text();
    println!("{console}");
    println!(
        "registered {:.1} s after QEMU start: {registered}",
        at_registration.as_secs_f64()
    );

    // The console tells the story, step by step.
    for want in [
        "anneal: anneal-agent ",
        "anneal: mounted proc, sys, devtmpfs, devpts",
        "anneal: driver loaded: virtio_net",
        "anneal: driver loaded: virtio_blk",
        "anneal: driver loaded: nvme",
        "anneal: mounted efivarfs (UEFI boot)",
        "anneal: link up on ",
        "anneal: DHCP lease 10.77.0.",
        "anneal: network configured: 10.77.0.",
        "anneal: disk vda: 256 MiB virtio serial=AGENTVBLK01",
        "anneal: disk nvme0n1: 128 MiB nvme serial=AGENTNVME01",
        "anneal: hardware sent",
    ] {
        assert!(console.contains(want), "console lacks {want:?}");
    }
    assert!(
        !console.contains(TOKEN),
        "the boot token reached the console"
    );

    // What the manager received.
    let hw: HardwareReport =
        serde_json::from_slice(&std::fs::read(out.join("hardware.json")).unwrap()).unwrap();
    let serials: Vec<(&str, Option<&str>, &str)> = hw
        .disks
        .iter()
        .map(|d| {
            (
                d.device_name.as_str(),
                d.serial_number.as_deref(),
                d.bus.as_deref().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        serials,
        [
            ("nvme0n1", Some("AGENTNVME01"), "nvme"),
            ("vda", Some("AGENTVBLK01"), "virtio")
        ]
    );
    assert_eq!(hw.disks[0].size_bytes, 128 << 20);
    assert_eq!(hw.disks[1].size_bytes, 256 << 20);
    assert!(hw.disks.iter().all(|d| d.pcie_path.is_some()));
    assert_eq!(hw.nics.len(), 1);
    assert_eq!(hw.nics[0].mac, MAC);
    assert_eq!(hw.nics[0].driver.as_deref(), Some("virtio_net"));
    assert!(hw.nics[0].link);
    assert_eq!(hw.memory_bytes, 1024 << 20, "memory exactly as configured");
    assert_eq!(hw.cpu.count, 2);
    assert_eq!(hw.cpu.architecture.as_deref(), Some("x86_64"));
    assert_eq!(hw.firmware.mode, FirmwareMode::Uefi);
    assert!(!hw.firmware.secure_boot);
    let events = std::fs::read_to_string(out.join("events.log")).unwrap();
    assert!(events.starts_with("POST /v1/agent/register -> 200\nPUT /v1/agent/hardware -> 204\n"));
}

/// The agent registers over IPv6: with `anneal.api` at an IPv6
/// literal the agent brings its boot network up over DHCPv6 (here
/// dnsmasq's, a reference peer; router advertisements from radvd with the
/// managed flag and no SLAAC, so DHCPv6 is the only way to an address),
/// adds the address once duplicate address detection passed and registers
/// over HTTPS at `[fd77::1]:8443`, the certificate's IPv6 SAN checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_registers_over_ipv6() {
    const MAC6: &str = "52:54:00:a6:00:06";
    let kernel = debian_kernel().unwrap();
    let agent = artifacts::agent_musl();
    let tool = artifacts::initramfs_tool();
    let fake = artifacts::fake_manager();

    let mut ns = Netns::create("agv6").unwrap();
    ns.start_managed_router_advertisements().unwrap();
    let dir = ns.dir();
    let initrd = dir.join("agent.cpio.zst");
    artifacts::build_initramfs(&tool, &agent, &kernel.modules, &initrd);

    // DHCPv6 only: no DHCPv4 range, so an agent falling back to IPv4 gets
    // nothing
    let _dnsmasq = ChildGroup::spawn(
        "dnsmasq",
        ns.exec("dnsmasq")
            .args([
                "--no-daemon",
                "--conf-file=/dev/null",
                "--port=0",
                "--interface=br0",
                "--bind-interfaces",
                "--dhcp-range=fd77::100,fd77::1ff,64,10m",
                "--log-dhcp",
            ])
            .arg(format!(
                "--dhcp-leasefile={}",
                dir.join("dnsmasq.leases").display()
            ))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("dnsmasq.log")).unwrap()),
    )
    .unwrap();

    let (_manager, out, pin) = agent_vm::fake_manager(
        &ns,
        &fake,
        ("[fd77::1]:8443", TOKEN, "default/vm-agent6"),
        &dir,
    )
    .await
    .unwrap();

    let mut vm = agent_vm::launch_agent_vm(
        &ns,
        &kernel.vmlinuz,
        &initrd,
        MAC6,
        1,
        768,
        format!(
            "console=ttyS0 panic=-1 quiet anneal.api=https://[fd77::1]:8443 anneal.ca={pin} \
             anneal.token={TOKEN} anneal.machine=default/vm-agent6 BOOTIF={}",
            agent_vm::bootif(MAC6)
        ),
    );
    let res = vm
        .wait_for_line(
            r"anneal: hardware sent|anneal: FAILED: ",
            Duration::from_secs(240),
        )
        .await;
    let console = vm.serial_text();
    vm.kill();
    let line = res.unwrap_or_else(|e| panic!("{e:#}\nconsole:\n{console}"));
    assert!(
        line.contains("hardware sent"),
        "{line}\nconsole:\n{console}"
    );
    println!("{console}");
    for want in [
        "anneal: DHCPv6 on ",
        "anneal: DHCPv6 address fd77::1",
        "anneal: network configured: fd77::1",
        "anneal: registering with https://[fd77::1]:8443",
        "anneal: registered as default/vm-agent6",
    ] {
        assert!(console.contains(want), "console lacks {want:?}:\n{console}");
    }
    assert!(
        !console.contains("anneal: DHCP lease"),
        "the agent took an IPv4 lease"
    );
    // dnsmasq saw our DUID-LL (the boot MAC) and bound the address
    let log = std::fs::read_to_string(dir.join("dnsmasq.log")).unwrap();
    assert!(
        log.contains("DHCPREPLY(br0) fd77::1"),
        "dnsmasq bound no address:\n{log}"
    );
    assert!(
        log.contains("00:03:00:01:52:54:00:a6:00:06"),
        "not a DUID-LL of the boot MAC:\n{log}"
    );
    let hw: HardwareReport =
        serde_json::from_slice(&std::fs::read(out.join("hardware.json")).unwrap()).unwrap();
    assert_eq!(hw.nics.len(), 1);
    assert_eq!(hw.nics[0].mac, MAC6);
    let events = std::fs::read_to_string(out.join("events.log")).unwrap();
    assert!(events.starts_with("POST /v1/agent/register -> 200\nPUT /v1/agent/hardware -> 204\n"));
}
