//! The post-install builtins on real UEFI variables: a TCG VM on OVMF
//! (direct kernel boot of the Debian kernel, a busybox initramfs built with
//! anneal-initramfs carrying `examples/posthook_run` and its libraries) runs
//! mkswap, install-removable-fallback and efibootmgr on a virtio disk through
//! the kernel's efivarfs, then efibootmgr again. The firmware's own entries
//! stay, exactly one anneal entry is left and it is first in BootOrder; the
//! disk is checked on the host afterwards. A VM test: about a minute under TCG.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use anneal_testinfra::{DiskBus, DiskConfig, Vm, VmConfig};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

const TOOLS: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const ESP_GUID: &str = "AAAAAAAA-BBBB-CCCC-DDDD-EEEEEEEEEEEE";

fn sh(cmd: &str) -> String {
    let out = Command::new("bash")
        .arg("-c")
        .arg(cmd)
        .env("PATH", TOOLS)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds `examples/posthook_run` (dev profile, this target dir) and returns
/// its path. `--workspace`, not `-p anneal-agent`: features are then unified
/// across the workspace as `cargo test --workspace` did, so the example that
/// run already built is fresh (a `-p` build resolves features for this
/// package alone and compiled half the dependency tree again).
fn posthook_run() -> PathBuf {
    let st = anneal_testinfra::cargo_command()
        .args(["build", "--workspace", "--example", "posthook_run"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(st.success(), "building examples/posthook_run");
    // this test: <target>/debug/deps/posthook_vm-<hash>
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    profile_dir.join("examples/posthook_run")
}

fn section<'a>(text: &'a str, start: &str, end: &str) -> Vec<&'a str> {
    text.lines()
        .map(|l| l.trim_end_matches('\r'))
        .skip_while(|l| *l != start)
        .take_while(|l| *l != end)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtins_write_real_efi_variables_on_ovmf() {
    let dir = tempfile::tempdir().unwrap();
    let runner = posthook_run();
    let kernel = anneal_testinfra::debian_kernel().unwrap();

    // The disk: ESP (vfat, \EFI\debian\grubx64.efi), swap, root.
    let img = dir.path().join("disk.img");
    let i = img.display().to_string();
    sh(&format!(
        "truncate -s 64M {i} && sgdisk -o -n 1:2048:+32M -t 1:ef00 -u 1:{ESP_GUID} \
         -n 2:0:+8M -t 2:8200 -n 3:0:0 -t 3:8300 {i} >/dev/null && \
         mkfs.vfat --offset 2048 {i} 32768 >/dev/null && \
         printf grub > {d}/grub && mmd -i {i}@@1048576 ::/EFI ::/EFI/debian && \
         mcopy -i {i}@@1048576 {d}/grub ::/EFI/debian/grubx64.efi",
        d = dir.path().display()
    ));

    let r = runner.display();
    let vars = "/sys/firmware/efi/efivars";
    let init = format!(
        "#!/bin/sh\n\
         mount -t proc proc /proc\nmount -t sysfs sys /sys\nmount -t devtmpfs dev /dev\n\
         for m in virtio_pci virtio_blk efivarfs; do /bin/busybox modprobe $m; done\n\
         mount -t efivarfs efivarfs {vars}\n\
         n=0; while [ ! -b /dev/vda ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n+1)); done\n\
         echo POSTHOOK-VM-RUN1\n\
         {r} /dev/vda ns/m1 {vars} mkswap install-removable-fallback efibootmgr\n\
         echo POSTHOOK-VM-RUN2\n\
         {r} /dev/vda ns/m1 {vars} efibootmgr\n\
         sync\necho POSTHOOK-VM-END\n\
         /bin/busybox poweroff -f\n"
    );
    let init_path = dir.path().join("init.sh");
    std::fs::write(&init_path, init).unwrap();
    let inputs = anneal_initramfs::Inputs {
        agent: init_path,
        modules_dir: Some(kernel.modules.clone()),
        kernel_release: Some(kernel.version.clone()),
        selection: anneal_initramfs::Selection {
            classes: vec![anneal_initramfs::Class::Virtio],
            names: vec!["efivarfs".into()],
            exclude: vec![],
        },
        firmware_dir: None,
        firmware: vec![],
        busybox: Some(PathBuf::from("/bin/busybox")),
        binaries: vec![runner.clone()],
        sysroot: None,
        compression: anneal_initramfs::Compression::Gzip,
        level: 1,
    };
    let (initrd, _) = anneal_initramfs::build(&inputs).unwrap();
    let initrd_path = dir.path().join("initrd.img");
    std::fs::write(&initrd_path, initrd).unwrap();

    let cfg = VmConfig {
        kernel: Some(kernel.vmlinuz.clone()),
        initrd: Some(initrd_path),
        append: Some("console=ttyS0 panic=-1".into()),
        disks: vec![DiskConfig {
            path: img.clone(),
            format: "raw".into(),
            bus: DiskBus::VirtioBlk,
            serial: "posthook".into(),
        }],
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&cfg, None).unwrap();
    vm.wait_for_line("^POSTHOOK-VM-END", Duration::from_secs(400))
        .await
        .unwrap();
    let text = vm.serial_text();
    vm.kill();

    let run1 = section(&text, "POSTHOOK-VM-RUN1", "POSTHOOK-VM-RUN2");
    let run2 = section(&text, "POSTHOOK-VM-RUN2", "POSTHOOK-VM-END");
    for run in [&run1, &run2] {
        assert!(run.contains(&"POSTHOOK-RUN-DONE"), "{run:#?}");
    }
    let ours = format!(
        "anneal ns/m1\tHD(1,GPT,{},0x800,0x10000)/File(\\EFI\\BOOT\\BOOTX64.EFI)",
        ESP_GUID.to_lowercase()
    );
    let vars_of = |run: &[&str]| -> Vec<String> {
        run.iter()
            .filter_map(|l| l.strip_prefix("BOOTVAR "))
            .map(str::to_string)
            .collect()
    };
    let order_of = |run: &[&str]| -> Vec<String> {
        run.iter()
            .find_map(|l| l.strip_prefix("BOOTORDER "))
            .unwrap_or_else(|| panic!("no BOOTORDER in {run:#?}"))
            .split(',')
            .map(str::to_string)
            .collect()
    };
    let (v1, v2) = (vars_of(&run1), vars_of(&run2));
    let mine1: Vec<_> = v1.iter().filter(|v| v.ends_with(&ours)).collect();
    let mine2: Vec<_> = v2.iter().filter(|v| v.ends_with(&ours)).collect();
    assert_eq!(mine1.len(), 1, "{v1:#?}");
    assert_eq!(mine2.len(), 1, "{v2:#?}");
    assert_ne!(
        mine1[0][..4],
        mine2[0][..4],
        "the second run writes a new entry"
    );
    assert_eq!(order_of(&run1)[0], mine1[0][..4]);
    assert_eq!(order_of(&run2)[0], mine2[0][..4]);
    assert!(!order_of(&run2).contains(&mine1[0][..4].to_string()));
    // The firmware's own entries are all still there.
    let foreign1: Vec<_> = v1.iter().filter(|v| !v.ends_with(&ours)).collect();
    let foreign2: Vec<_> = v2.iter().filter(|v| !v.ends_with(&ours)).collect();
    assert!(
        !foreign1.is_empty(),
        "OVMF registers its own entries: {v1:#?}"
    );
    assert_eq!(foreign1, foreign2);

    // The disk, on the host.
    assert_eq!(
        sh(&format!("mtype -i {i}@@1048576 ::/EFI/BOOT/BOOTX64.EFI")),
        "grub"
    );
    let swap = sh(&format!(
        "blkid -p -O {} -S {} -o export {i}",
        (2048u64 + 65536) * 512,
        8u64 << 20
    ));
    assert!(swap.contains("TYPE=swap"), "{swap}");
}
