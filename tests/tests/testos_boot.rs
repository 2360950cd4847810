//! The bootable test OS (`anneal_tests::testos`) the deploy tests import: its
//! image has the layout of docs/testos.md "Layout" (GPT: ESP with the loader
//! under `\EFI\anneal\` only, swap, ext4 root), and a copy of it on which the
//! test installs the removable fallback `\EFI\BOOT\BOOTX64.EFI` boots on OVMF
//! under TCG to the marker lines: the marker's SHA-256, the DMI serial QEMU
//! sets, the root UUID and the size of the data on the root.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anneal_testinfra::{DiskBus, DiskConfig, Firmware, Vm, VmConfig, run};
use anneal_tests::testos::{LOADER_MTOOLS, TestOs, test_os};

fn mtools(tool: &str, image: &str, args: &[&str]) -> anyhow::Result<String> {
    run(Command::new(tool)
        .env("MTOOLS_SKIP_CHECK", "1")
        .arg("-i")
        .arg(image)
        .args(args))
}

/// `line` from `tag` on.
fn tagged(line: String, tag: &str) -> String {
    let at = line.find(tag).unwrap();
    line[at..].trim().to_string()
}

/// Every file and directory of the ESP, as `mdir -/ -b` lists them.
fn esp_listing(os: &TestOs, image: &Path) -> Vec<String> {
    mtools("mdir", &os.esp.mtools_image(image), &["-/", "-b", "::/"])
        .unwrap()
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The probed signature (TYPE, UUID) of the partition at `offset`.
fn probe(image: &Path, offset: u64) -> (String, String) {
    let out = run(Command::new("blkid")
        .args(["-p", "-o", "export", "-O"])
        .arg(offset.to_string())
        .arg(image))
    .unwrap();
    let field = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_default()
            .to_string()
    };
    (field("TYPE"), field("UUID"))
}

fn check_layout(os: &TestOs) {
    let len = std::fs::metadata(&os.image).unwrap().len();
    assert_eq!(len, os.image_bytes);
    assert!((600 << 20..=1 << 30).contains(&len), "image is {len} bytes");
    // The GPT as sfdisk reads it.
    let table: serde_json::Value =
        serde_json::from_str(&run(Command::new("sfdisk").arg("--json").arg(&os.image)).unwrap())
            .unwrap();
    let table = &table["partitiontable"];
    assert_eq!(table["label"], "gpt", "{table}");
    let parts = table["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 3, "{table}");
    for (got, want) in parts.iter().zip([&os.esp, &os.swap, &os.root]) {
        assert_eq!(got["start"].as_u64(), Some(want.start_lba), "{got}");
        assert_eq!(got["size"].as_u64(), Some(want.size_lba), "{got}");
        assert_eq!(
            got["uuid"].as_str().map(str::to_lowercase).as_deref(),
            Some(want.part_uuid.as_str()),
            "{got}"
        );
        assert_eq!(
            got["type"].as_str().map(str::to_lowercase).as_deref(),
            Some(want.type_guid.as_str()),
            "{got}"
        );
    }
    assert_eq!((os.esp.number, os.swap.number, os.root.number), (1, 2, 3));
    // Filesystems where the layout says.
    assert_eq!(probe(&os.image, os.esp.offset()).0, "vfat");
    assert_eq!(
        probe(&os.image, os.swap.offset()),
        ("swap".to_string(), os.swap_uuid.clone())
    );
    assert_eq!(
        probe(&os.image, os.root.offset()),
        ("ext4".to_string(), os.root_fs_uuid.clone())
    );
    // The ESP holds the loader under the vendor directory only: no
    // `\EFI\BOOT\` (installing the removable fallback is the deploy's job).
    assert_eq!(
        esp_listing(os, &os.image),
        ["::/EFI/", "::/EFI/anneal/", LOADER_MTOOLS],
        "the test OS ESP must hold only {}",
        os.loader
    );
    assert_eq!(os.loader, r"\EFI\anneal\linux.efi");
    assert!(os.data_bytes >= 200 << 20);
    assert!(
        os.cmdline
            .contains(&format!("root=UUID={}", os.root_fs_uuid)),
        "{}",
        os.cmdline
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_os_boots_from_the_removable_path_and_prints_its_marker() {
    let t0 = Instant::now();
    let os = test_os().unwrap();
    let first = t0.elapsed();
    let t1 = Instant::now();
    let again = test_os().unwrap();
    let cached = t1.elapsed();
    println!(
        "test OS {} ({} MiB): first test_os() {:.1} s (a cold build when nothing was cached), cached {:.2} s",
        os.image.display(),
        os.image_bytes >> 20,
        first.as_secs_f64(),
        cached.as_secs_f64()
    );
    assert_eq!(again.image, os.image);
    check_layout(&os);

    // A copy with the removable fallback, which OVMF boots on a disk
    // without boot entries; the cached image stays as it is.
    let work = tempfile::tempdir().unwrap();
    let disk = work.path().join("disk.img");
    run(Command::new("cp")
        .arg("--sparse=always")
        .arg(&os.image)
        .arg(&disk))
    .unwrap();
    let loader = work.path().join("linux.efi");
    let esp = os.esp.mtools_image(&disk);
    mtools(
        "mcopy",
        &esp,
        &[LOADER_MTOOLS, &loader.display().to_string()],
    )
    .unwrap();
    mtools("mmd", &esp, &["::/EFI/BOOT"]).unwrap();
    mtools(
        "mcopy",
        &esp,
        &[&loader.display().to_string(), "::/EFI/BOOT/BOOTX64.EFI"],
    )
    .unwrap();
    assert!(esp_listing(&os, &disk).contains(&"::/EFI/BOOT/BOOTX64.EFI".to_string()));
    assert!(
        !esp_listing(&os, &os.image)
            .iter()
            .any(|l| l.starts_with("::/EFI/BOOT")),
        "the cached image gained \\EFI\\BOOT"
    );

    let serial = "ANNEAL-TESTOS-01";
    let cfg = VmConfig {
        firmware: Firmware::Ovmf,
        memory_mib: 1024,
        cpus: 2,
        disks: vec![DiskConfig {
            path: disk.clone(),
            format: "raw".into(),
            bus: DiskBus::VirtioBlk,
            serial: "TESTOSDISK01".into(),
        }],
        // No NIC at all (nothing to PXE from), and the DMI serial the test
        // OS prints as the machine name.
        extra_args: vec![
            "-nic".into(),
            "none".into(),
            "-smbios".into(),
            format!("type=1,serial={serial}"),
        ],
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&cfg, None).unwrap();
    let timeout = Duration::from_secs(240);
    // The marker lines, from their tag on (a kernel message may share the
    // console line).
    let marker = tagged(
        vm.wait_for_line(r"ANNEAL-MARKER [0-9a-f]{64}", timeout)
            .await
            .unwrap(),
        "ANNEAL-MARKER",
    );
    let to_marker = vm.uptime();
    assert_eq!(
        marker,
        format!("ANNEAL-MARKER {}", os.marker_sha256),
        "wrong marker hash; console:\n{}",
        vm.serial_text()
    );
    let deployed = tagged(
        vm.wait_for_line(r"ANNEAL-DEPLOYED ", timeout)
            .await
            .unwrap(),
        "ANNEAL-DEPLOYED",
    );
    assert_eq!(deployed, format!("ANNEAL-DEPLOYED {serial}"));
    let root = tagged(
        vm.wait_for_line(r"ANNEAL-ROOT ", timeout).await.unwrap(),
        "ANNEAL-ROOT",
    );
    assert_eq!(root, format!("ANNEAL-ROOT {} /dev/vda3", os.root_fs_uuid));
    let data = tagged(
        vm.wait_for_line(r"ANNEAL-DATA [0-9]+KiB", timeout)
            .await
            .unwrap(),
        "ANNEAL-DATA",
    );
    let kib: u64 = data
        .trim_start_matches("ANNEAL-DATA ")
        .trim_end_matches("KiB")
        .parse()
        .unwrap();
    assert!(kib >= 200 * 1024, "{data}");
    println!(
        "power-on -> ANNEAL-MARKER under TCG: {:.1} s ({marker}; {deployed}; {root}; {data})",
        to_marker.as_secs_f64()
    );
    let text = vm.serial_text();
    assert!(
        !text.contains("ANNEAL-TESTOS-ERROR"),
        "the test OS init failed:\n{text}"
    );
}
