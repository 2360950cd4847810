//! The QEMU demo: a VM in a fresh network namespace boots the Debian kernel
//! under TCG with a tiny initramfs and its serial console is shown live.
//! Later stages grow this into enrol → network boot → inspect → provision.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::time::Duration;

use anneal_testinfra::{
    DiskBus, DiskConfig, Firmware, Netns, NicConfig, Vm, VmConfig, debian_kernel, smoke_initramfs,
};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let firmware = if std::env::args().any(|a| a == "--bios") {
        Firmware::SeaBios
    } else {
        Firmware::Ovmf
    };
    let mut ns = Netns::create("anldemo")?;
    ns.start_router_advertisements()?;
    let kernel = debian_kernel()?;
    println!(
        "anneal demo: namespace {} · kernel {} · firmware {firmware:?}",
        ns.name(),
        kernel.version
    );
    let initrd = ns.dir().join("demo.cpio");
    std::fs::write(
        &initrd,
        smoke_initramfs(
            "echo \"anneal demo: /init running on $(uname -r)\"\n\
             for b in /sys/block/*; do echo \"disk $(basename $b)\"; done\n\
             echo ANNEAL-DEMO-DONE\npoweroff -f",
        )?,
    )?;
    let disk = ns.dir().join("disk0.img");
    std::fs::File::create(&disk)?.set_len(256 << 20)?;
    let tap = ns.add_tap()?;
    let cfg = VmConfig {
        firmware,
        nics: vec![NicConfig::virtio(&tap, "52:54:00:de:00:01")],
        disks: vec![DiskConfig {
            path: disk,
            format: "raw".into(),
            bus: DiskBus::VirtioBlk,
            serial: "DEMO0001".into(),
        }],
        kernel: Some(kernel.vmlinuz),
        initrd: Some(initrd),
        append: Some("console=ttyS0 panic=-1".into()),
        ..VmConfig::default()
    };
    let mut vm = Vm::launch(&cfg, Some(&ns))?;
    println!(
        "anneal demo: QEMU pid {} · serial console follows\n",
        vm.pid()
    );
    // Show the serial console as it grows until the marker or the timeout.
    let mut shown = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    loop {
        let text = vm.serial_text();
        if text.len() > shown {
            print!("{}", &text[shown..]);
            std::io::stdout().flush()?;
            shown = text.len();
        }
        if text.contains("ANNEAL-DEMO-DONE") {
            break;
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("the VM did not finish within 240 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    vm.wait_for_line("ANNEAL-DEMO-DONE", Duration::from_secs(1))
        .await?;
    println!(
        "\nanneal demo: done after {:.1} s; cleaning up",
        vm.uptime().as_secs_f64()
    );
    Ok(())
}
