//! Smoke test of the VM and namespace infrastructure: the Debian kernel boots
//! a tiny busybox initramfs under TCG, on OVMF and on SeaBIOS, with a NIC on a
//! tap in a test namespace and virtio-blk + NVMe disks; afterwards nothing the
//! test created is left (namespace, tap, bridge, QEMU, radvd).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anneal_testinfra::{
    DiskBus, DiskConfig, Firmware, Netns, NicConfig, Vm, VmConfig, debian_kernel, process_alive,
    smoke_initramfs,
};

async fn boot(firmware: Firmware, ns: &Netns, mac: &str) -> anyhow::Result<(u32, String)> {
    let kernel = debian_kernel()?;
    let dir = ns.dir();
    // The init script lists the PCI devices the kernel found: one virtio-net,
    // one virtio-blk and one NVMe controller must be there.
    let initrd = dir.join(format!("smoke-{mac}.cpio").replace(':', ""));
    std::fs::write(
        &initrd,
        smoke_initramfs(
            "for d in /sys/bus/pci/devices/*; do echo \"pci $(cat $d/vendor):$(cat $d/device)\"; done\n\
             echo \"ANNEAL-SMOKE-OK firmware=$([ -d /sys/firmware/efi ] && echo uefi || echo bios)\"\n\
             poweroff -f",
        )?,
    )?;
    let mut disks = Vec::new();
    for (bus, serial) in [
        (DiskBus::VirtioBlk, "SMOKEVBLK01"),
        (DiskBus::Nvme, "SMOKENVME01"),
    ] {
        let path = dir.join(format!("{serial}-{}.img", mac.replace(':', "")));
        std::fs::File::create(&path)?.set_len(64 << 20)?;
        disks.push(DiskConfig {
            path,
            format: "raw".into(),
            bus,
            serial: serial.into(),
        });
    }
    let tap = ns.add_tap()?;
    let cfg = VmConfig {
        firmware,
        memory_mib: 512,
        cpus: 1,
        nics: vec![NicConfig::virtio(&tap, mac)],
        disks,
        kernel: Some(kernel.vmlinuz),
        initrd: Some(initrd),
        append: Some("console=ttyS0 panic=-1 quiet".into()),
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&cfg, Some(ns))?;
    let pid = vm.pid();
    let line = vm
        .wait_for_line(r"ANNEAL-SMOKE-OK", Duration::from_secs(180))
        .await?;
    println!(
        "{firmware:?}: marker after {:.1} s: {line}",
        vm.uptime().as_secs_f64()
    );
    let text = vm.serial_text();
    // virtio-net 1af4:1000/1041, virtio-blk 1af4:1001/1042, NVMe 1b36:0010
    assert!(
        text.contains("pci 0x1af4:0x1000") || text.contains("pci 0x1af4:0x1041"),
        "no virtio-net:\n{text}"
    );
    assert!(
        text.contains("pci 0x1af4:0x1001") || text.contains("pci 0x1af4:0x1042"),
        "no virtio-blk:\n{text}"
    );
    assert!(
        text.contains("pci 0x1b36:0x0010"),
        "no NVMe controller:\n{text}"
    );
    Ok((pid, line))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_kernel_boots_on_ovmf_and_seabios_and_everything_is_cleaned_up() {
    let mut ns = Netns::create("anlsmk").unwrap();
    ns.start_router_advertisements().unwrap();
    let ns_name = ns.name().to_string();
    let radvd = ns.radvd_pid().unwrap();

    let (uefi, bios) = tokio::join!(
        boot(Firmware::Ovmf, &ns, "52:54:00:5a:00:01"),
        boot(Firmware::SeaBios, &ns, "52:54:00:5a:00:02")
    );
    let (uefi_pid, uefi_line) = uefi.unwrap();
    let (bios_pid, bios_line) = bios.unwrap();
    assert!(uefi_line.contains("firmware=uefi"), "{uefi_line}");
    assert!(bios_line.contains("firmware=bios"), "{bios_line}");

    let interfaces = ns.interfaces().unwrap();
    assert!(
        interfaces.contains(&"br0".to_string()) && interfaces.contains(&"tap1".to_string()),
        "{interfaces:?}"
    );
    drop(ns);

    // Nothing the test created is left.
    assert!(!Netns::exists(&ns_name), "namespace {ns_name} left behind");
    let host_links = std::process::Command::new("ip")
        .args(["-o", "link"])
        .output()
        .unwrap();
    let host_links = String::from_utf8_lossy(&host_links.stdout);
    assert!(
        !host_links.contains(&ns_name),
        "host interface named after {ns_name} left"
    );
    let netns_list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&netns_list.stdout).contains(&ns_name));
    for (what, pid) in [
        ("qemu (uefi)", uefi_pid),
        ("qemu (bios)", bios_pid),
        ("radvd", radvd),
    ] {
        assert!(!process_alive(pid), "{what} pid {pid} still running");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_reaches_a_host_loopback_service_only_through_the_relay() {
    use std::io::{Read, Write};
    let ns = Netns::create("anlfwd").unwrap();
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let target = host.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = host.accept().unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).unwrap();
        s.write_all(&buf.map(|b| b.to_ascii_uppercase())).unwrap();
    });
    let curl = |url: &str| {
        ns.exec("busybox")
            .args(["nc", "-w", "2"])
            .args(url.split(':'))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Without the relay the host's loopback is not reachable from the namespace.
    let mut direct = curl(&format!("127.0.0.1:{}", target.port()));
    direct.stdin.take().unwrap().write_all(b"hello").unwrap();
    let out = direct.wait_with_output().unwrap();
    assert!(
        out.stdout.is_empty(),
        "namespace reached host loopback directly"
    );

    let fwd = ns
        .forward_tcp("10.77.0.1:18443".parse().unwrap(), target)
        .unwrap();
    let mut via = curl("10.77.0.1:18443");
    via.stdin.take().unwrap().write_all(b"hello").unwrap();
    let out = via.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO");
    server.join().unwrap();
    drop(fwd);
}
