//! The arm64 boot matrix (docs/testing.md, "arm64") end to end, under TCG: an
//! arm64 machine (AAVMF on QEMU's `virt` board, a Cortex-A72) of
//! `architecture: aarch64` PXE-boots Debian's arm64 shim and network GRUB from
//! bootd (client architecture 11; no arm64 iPXE is available here), then the
//! arm64 kernel and our initramfs with the aarch64 agent (bootd's
//! `artifacts.aarch64`). The agent registers and inventories (MachineHardware:
//! aarch64, UEFI), the Machine is Available; the arm64 test OS
//! (tests/src/testos.rs `test_os_for(Aarch64)`: its UKI built from Debian's
//! arm64 kernel and `linuxaa64.efi.stub`) is imported, the machine claimed and
//! deployed: the agent writes the contents, runs the default hook (mkswap,
//! install-removable-fallback, efibootmgr), and AAVMF boots the load option it
//! wrote, `\EFI\BOOT\BOOTAA64.EFI`: the test OS prints its marker and the
//! Machine's name.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_tests::e2e::{self, Lab, LabOptions, MACHINE};
use anneal_tests::testos::{Arch, test_os_for};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_arm64_machine_is_inspected_deployed_and_boots_its_os() {
    let os = tokio::task::spawn_blocking(|| test_os_for(Arch::Aarch64));
    let mut lab = Lab::start_with(
        &|s| println!("e2e-arm64: {s}"),
        LabOptions {
            deploy: true,
            aarch64: true,
            ..LabOptions::default()
        },
    )
    .await
    .unwrap();
    let os = os.await.unwrap().unwrap();
    let t = Instant::now();
    let _server = lab
        .serve_and_import(&[("testos", &os.image, true)], Duration::from_secs(900))
        .await
        .unwrap();
    println!("e2e-arm64: imported in {:.1} s", t.elapsed().as_secs_f64());

    lab.boot_until_available("e2e-arm64", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    println!(
        "e2e-arm64: QEMU launch → Machine Available in {:.1} s",
        lab.since_launch().as_secs_f64()
    );
    let console = lab.console();
    // the arm64 chain: GRUB ran bootd's configs and booted the arm64 pair
    assert!(
        console.contains("anneal: GRUB on ")
            && console.contains(&format!("anneal: booting default/{MACHINE}")),
        "{}",
        e2e::tail(&console, 80)
    );
    let hw = lab.hardware().await.unwrap().expect("MachineHardware");
    println!("e2e-arm64: {}", e2e::summary(&hw));
    let cpu = hw.spec.cpu.as_ref().expect("cpu in the inventory");
    assert_eq!(
        cpu.architecture,
        Some(anneal_api::Architecture::Aarch64),
        "{}",
        e2e::summary(&hw)
    );
    assert_eq!(cpu.model.as_deref(), Some("ARM Cortex-A72"));
    let fw = hw
        .spec
        .firmware
        .as_ref()
        .expect("firmware in the inventory");
    assert_eq!(fw.mode, anneal_api::FirmwareMode::Uefi);
    assert!(!fw.secure_boot);

    // deployed, and the deployed OS boots from its disk
    lab.deploy_and_boot("testos", "e2e-arm64", &os.marker_sha256)
        .await;
    // AAVMF booted the entry the agent wrote: the arm64 removable path
    assert_eq!(lab.anneal_boot_entry().unwrap(), r"\EFI\BOOT\BOOTAA64.EFI");
}
