//! The Day-1 cloud OS (issue 45) on its own, without anneal's deploy: the
//! Debian 12 image `tests/setup.d/cloudos.sh` builds has the layout the
//! deploy expects (GPT, ESP with one vendor loader and no removable path,
//! ext4 root with the fixed UUID); a copy of it, with the removable fallback
//! installed as the deploy's post-install step would, boots on OVMF under
//! TCG with a NoCloud seed (a second virtio disk, vfat labelled CIDATA), and
//! cloud-init applies the seed: over SSH (inside the test's namespace) the
//! user `ops` logs in with the test's key, the hostname is the meta-data's,
//! the runcmd marker is there and the NIC has the static address of the
//! network-config.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anneal_testinfra::{
    DiskBus, DiskConfig, Firmware, Netns, NicConfig, Vm, VmConfig, process_alive, run,
};
use anneal_tests::cloudos::{
    CloudOs, NoCloudSeed, cloud_os, meta_data, nocloud_vfat, ssh_keygen, ssh_run,
    static_network_config, user_data,
};

const MAC: &str = "52:54:00:45:c1:01";
const ADDR: &str = "10.77.0.45";
const HOSTNAME: &str = "cloudos-test";
/// Boot to SSH under TCG, generously.
const DEADLINE: Duration = Duration::from_secs(15 * 60);

fn mtools(tool: &str, image: &str, args: &[&str]) -> String {
    run(Command::new(tool)
        .env("MTOOLS_SKIP_CHECK", "1")
        .arg("-i")
        .arg(image)
        .args(args))
    .unwrap()
}

/// The image as built: two partitions where info.json says, the ESP with
/// exactly one loader under a vendor directory and no `\EFI\BOOT`, the root
/// ext4 with the fixed UUID, and nothing anneal-specific in its name.
fn check_layout(os: &CloudOs) {
    let table: serde_json::Value =
        serde_json::from_str(&run(Command::new("sfdisk").arg("--json").arg(&os.disk)).unwrap())
            .unwrap();
    let table = &table["partitiontable"];
    assert_eq!(table["label"], "gpt", "{table}");
    let parts = table["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 2, "{table}");
    let esp = &parts[os.esp_partition as usize - 1];
    let root = &parts[os.root_partition as usize - 1];
    assert_eq!(
        esp["type"].as_str().map(str::to_uppercase).as_deref(),
        Some("C12A7328-F81F-11D2-BA4B-00A0C93EC93B"),
        "{esp}"
    );
    assert_eq!(esp["start"].as_u64().unwrap() * 512, os.esp_offset);
    assert_eq!(root["start"].as_u64().unwrap() * 512, os.root_offset);
    let root_end = (root["start"].as_u64().unwrap() + root["size"].as_u64().unwrap()) * 512;
    assert_eq!(root_end, os.partitions_end);
    assert!(
        os.partitions_end + (64 << 20) <= os.disk_bytes,
        "no free space after the root for a CIDATA partition: {table}"
    );
    let esp_img = format!("{}@@{}", os.disk.display(), os.esp_offset);
    let listing = mtools("mdir", &esp_img, &["-/", "-b", "::/"]);
    let files: Vec<&str> = listing
        .lines()
        .map(str::trim)
        .filter(|l| l.to_ascii_lowercase().ends_with(".efi"))
        .collect();
    assert_eq!(
        files,
        vec![format!("::/{}", os.loader).as_str()],
        "ESP listing:\n{listing}"
    );
    assert!(os.loader.starts_with("EFI/debian/"), "{}", os.loader);
    assert!(
        !listing.to_ascii_uppercase().contains("::/EFI/BOOT"),
        "the image must not carry the removable path itself:\n{listing}"
    );
    let probe = run(Command::new("blkid")
        .args(["-p", "-o", "export", "-O"])
        .arg(os.root_offset.to_string())
        .arg(&os.disk))
    .unwrap();
    assert!(probe.contains("TYPE=ext4"), "{probe}");
    assert!(probe.contains(&format!("UUID={}", os.root_uuid)), "{probe}");
    for (pkg, v) in &os.packages {
        assert!(!v.is_empty(), "no version of {pkg} in info.json");
    }
}

/// What the deploy's `install-removable-fallback` step does to the ESP: the
/// vendor loader copied to `\EFI\BOOT\BOOTX64.EFI` (a fresh OVMF VARS has no
/// boot entry for the vendor path).
fn install_removable_fallback(os: &CloudOs, disk: &Path, scratch: &Path) {
    let esp_img = format!("{}@@{}", disk.display(), os.esp_offset);
    let loader = scratch.join("loader.efi");
    mtools(
        "mcopy",
        &esp_img,
        &[&format!("::/{}", os.loader), loader.to_str().unwrap()],
    );
    mtools("mmd", &esp_img, &["::/EFI/BOOT"]);
    mtools(
        "mcopy",
        &esp_img,
        &[loader.to_str().unwrap(), "::/EFI/BOOT/BOOTX64.EFI"],
    );
}

/// A console line that means the boot failed for good.
fn boot_failure(serial: &str) -> Option<&str> {
    const FATAL: [&str; 6] = [
        "Kernel panic",
        "You are in emergency mode",
        "Give root password for maintenance",
        "ALERT!",
        "Gave up waiting for root file system",
        "Cannot open access to console",
    ];
    serial.lines().find(|l| FATAL.iter().any(|f| l.contains(f)))
}

fn console_tail(vm: &Vm) -> String {
    let text = vm.serial_text();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debian_cloud_image_boots_on_ovmf_and_cloud_init_applies_a_nocloud_seed() {
    let os = cloud_os().unwrap();
    println!(
        "cloud OS: {} (kernel {}, packages {:?})",
        os.disk.display(),
        os.kernel,
        os.packages
    );
    check_layout(&os);

    let work = tempfile::Builder::new()
        .prefix("anneal-cloudos-")
        .tempdir()
        .unwrap();
    let disk = work.path().join("disk.raw");
    run(Command::new("cp")
        .arg("--sparse=always")
        .arg(&os.disk)
        .arg(&disk))
    .unwrap();
    install_removable_fallback(&os, &disk, work.path());

    let key = ssh_keygen("cloudos-boot-test").unwrap();
    let marker = format!("cloudos-marker-{}", std::process::id());
    let seed = NoCloudSeed {
        user_data: user_data(
            "ops",
            &key.public,
            &[&format!("echo {marker} > /var/tmp/marker")],
        ),
        meta_data: meta_data("cloudos-boot-1", HOSTNAME),
        network_config: Some(static_network_config(
            "eth0",
            MAC,
            &format!("{ADDR}/24"),
            Some(anneal_testinfra::BRIDGE_IP),
        )),
    };
    let seed_img = work.path().join("seed.img");
    nocloud_vfat(&seed_img, &seed, 16).unwrap();

    let ns = Netns::create("cloudos").unwrap();
    let tap = ns.add_tap().unwrap();
    let mut nic = NicConfig::virtio(&tap, MAC);
    nic.option_rom = false;
    nic.bootindex = None;
    let cfg = VmConfig {
        firmware: Firmware::Ovmf,
        memory_mib: 1024,
        cpus: 2,
        nics: vec![nic],
        disks: vec![
            DiskConfig {
                path: disk.clone(),
                format: "raw".into(),
                bus: DiskBus::VirtioBlk,
                serial: "cloudos-root".into(),
            },
            DiskConfig {
                path: seed_img.clone(),
                format: "raw".into(),
                bus: DiskBus::VirtioBlk,
                serial: "cloudos-seed".into(),
            },
        ],
        no_reboot: true,
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&cfg, Some(&ns)).unwrap();
    let started = Instant::now();
    println!(
        "QEMU pid {} in namespace {}, console {}",
        vm.pid(),
        ns.name(),
        vm.serial_path().display()
    );

    // Until SSH answers as `ops` with the test's key: the user exists and
    // sshd runs (cloud-init's network stage runs before sshd).
    let mut last = String::new();
    let mut kernel_seen = None;
    loop {
        let serial = vm.serial_text();
        if kernel_seen.is_none() && serial.contains("Linux version") {
            kernel_seen = Some(started.elapsed());
        }
        if let Some(line) = boot_failure(&serial) {
            panic!(
                "the cloud OS failed to boot: {line:?}\nconsole:\n{}",
                console_tail(&vm)
            );
        }
        if !process_alive(vm.pid()) {
            panic!(
                "QEMU exited before SSH answered (last ssh error: {last})\nconsole:\n{}",
                console_tail(&vm)
            );
        }
        assert!(
            started.elapsed() < DEADLINE,
            "no SSH after {DEADLINE:?} (last ssh error: {last})\nconsole:\n{}",
            console_tail(&vm)
        );
        match ssh_run(Some(ns.name()), ADDR, "ops", &key.private, "true") {
            Ok(_) => break,
            Err(e) => last = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let to_ssh = started.elapsed();
    println!(
        "boot to SSH: {:.1} s (kernel's first line at {:.1} s)",
        to_ssh.as_secs_f64(),
        kernel_seen.unwrap_or_default().as_secs_f64()
    );

    let ssh = |cmd: &str| ssh_run(Some(ns.name()), ADDR, "ops", &key.private, cmd);
    // runcmd runs in cloud-init's final stage, after sshd starts.
    let status = ssh("cloud-init status --wait --long; true").unwrap();
    println!(
        "cloud-init done at {:.1} s:\n{}",
        started.elapsed().as_secs_f64(),
        status.trim()
    );
    assert!(
        status.lines().any(|l| l.trim() == "status: done"),
        "cloud-init did not finish cleanly:\n{status}\n{}\nconsole:\n{}",
        ssh("sudo grep -E 'WARNING|ERROR|Traceback' /var/log/cloud-init.log | tail -n 40")
            .unwrap_or_default(),
        console_tail(&vm)
    );

    let hostname = ssh("hostname").unwrap();
    assert_eq!(hostname.trim(), HOSTNAME);
    let got_marker = ssh("cat /var/tmp/marker").unwrap();
    assert_eq!(got_marker.trim(), marker);
    let addrs = ssh("ip -4 addr").unwrap();
    assert!(
        addrs.contains(&format!("inet {ADDR}/24")),
        "no static {ADDR}/24:\n{addrs}"
    );
    // The datasource is the seed, the renderer netplan (Debian 12's cloud
    // images), and nothing of anneal is inside.
    let ds = ssh("cat /run/cloud-init/cloud-id; echo; ls /etc/netplan/").unwrap();
    assert!(ds.contains("nocloud"), "{ds}");
    assert!(ds.contains("50-cloud-init.yaml"), "{ds}");
    let whoami = ssh("id -un; sudo -n true && echo sudo-ok").unwrap();
    assert_eq!(
        whoami.split_whitespace().collect::<Vec<_>>(),
        ["ops", "sudo-ok"]
    );
    let root_pw = ssh("sudo -n getent shadow root | cut -d: -f2").unwrap();
    assert!(
        root_pw.trim().starts_with('*') || root_pw.trim().starts_with('!'),
        "root password not locked: {root_pw:?}"
    );

    // The whole system came up: no failed unit (the ESP mount by its
    // volume id, networkd, resolved, ssh, cloud-init's four stages).
    let state = ssh("systemctl is-system-running --wait; true").unwrap();
    assert_eq!(
        state.trim(),
        "running",
        "{}",
        ssh("systemctl --failed --no-legend; true").unwrap_or_default()
    );
    // growpart (cloud-guest-utils) took the free space after the root: on
    // this disk nothing follows it.
    let root_bytes: u64 = ssh("lsblk -bdno SIZE /dev/disk/by-partuuid/$(findmnt -no PARTUUID /)")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        root_bytes > os.partitions_end - os.root_offset,
        "the root partition was not grown: {root_bytes} bytes"
    );
    println!(
        "{}",
        ssh("systemd-analyze; systemd-analyze blame | head -n 12; df -h /; true").unwrap()
    );

    vm.kill();
    assert!(!process_alive(vm.pid()), "QEMU {} still running", vm.pid());
    let ns_name = ns.name().to_string();
    drop(ns);
    assert!(!Netns::exists(&ns_name), "namespace {ns_name} left behind");
}
