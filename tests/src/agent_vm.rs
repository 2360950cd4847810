//! The agent booted directly in a VM: dnsmasq on the test bridge for its
//! address, `BOOTIF=`, and a QEMU launch with `-kernel`/`-initrd`.

use std::path::Path;

/// dnsmasq on `br0` of `ns`: addresses only (10.77.0.100-150, router
/// 10.77.0.1), no ping delay; its log and leases go to the namespace's
/// directory. Killed (by process group) on drop.
pub fn dnsmasq(ns: &anneal_testinfra::Netns) -> anneal_testinfra::ChildGroup {
    let dir = ns.dir();
    anneal_testinfra::ChildGroup::spawn(
        "dnsmasq",
        ns.exec("dnsmasq")
            .args([
                "--no-daemon",
                "--conf-file=/dev/null",
                "--port=0",
                "--interface=br0",
                "--bind-interfaces",
                "--no-ping",
                "--dhcp-range=10.77.0.100,10.77.0.150,255.255.255.0,10m",
                "--dhcp-option=option:router,10.77.0.1",
            ])
            .arg(format!(
                "--dhcp-leasefile={}",
                dir.join("dnsmasq.leases").display()
            ))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("dnsmasq.log")).unwrap()),
    )
    .unwrap()
}

/// `BOOTIF=` of a MAC (`01-aa-bb-…`).
pub fn bootif(mac: &str) -> String {
    format!("01-{}", mac.replace(':', "-"))
}

/// Boots the agent directly (-kernel/-initrd on OVMF, TCG, no NIC option
/// ROM, no disks) with `append` as the kernel command line, one virtio NIC
/// on a new tap of `ns`. The guest's reboot ends QEMU (`-no-reboot`).
pub fn launch_agent_vm(
    ns: &anneal_testinfra::Netns,
    kernel: &Path,
    initrd: &Path,
    mac: &str,
    cpus: u32,
    memory_mib: u32,
    append: String,
) -> anneal_testinfra::Vm {
    let tap = ns.add_tap().unwrap();
    let mut nic = anneal_testinfra::NicConfig::virtio(&tap, mac);
    nic.option_rom = false;
    nic.bootindex = None;
    let cfg = anneal_testinfra::VmConfig {
        firmware: anneal_testinfra::Firmware::Ovmf,
        memory_mib,
        cpus,
        nics: vec![nic],
        kernel: Some(kernel.to_path_buf()),
        initrd: Some(initrd.to_path_buf()),
        append: Some(append),
        no_reboot: true,
        ..anneal_testinfra::VmConfig::default()
    };
    anneal_testinfra::Vm::launch(&cfg, Some(ns)).unwrap()
}

/// The agent-protocol test server (`fake_manager` at `bin`) in `ns`: it
/// listens on `listen`, takes `token` for `machine` ("namespace/name"),
/// records what the agent sends under `out` (`dir/manager`) and answers
/// its `next` with poweroff; its log is `dir/manager.log`. Returned once it
/// has written its CA's SHA-256 pin, with the pin (for `anneal.ca=`).
pub async fn fake_manager(
    ns: &anneal_testinfra::Netns,
    bin: &Path,
    (listen, token, machine): (&str, &str, &str),
    dir: &Path,
) -> anyhow::Result<(anneal_testinfra::ChildGroup, std::path::PathBuf, String)> {
    let out = dir.join("manager");
    let server = anneal_testinfra::ChildGroup::spawn(
        "fake_manager",
        ns.exec(&bin.to_string_lossy())
            .args([listen, token, machine])
            .arg(&out)
            .arg("poweroff")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("manager.log"))?),
    )?;
    let pin_path = out.join("ca.sha256");
    crate::eventually(
        "the fake manager writing its CA pin",
        std::time::Duration::from_secs(60),
        || async { pin_path.exists() },
    )
    .await;
    let pin = std::fs::read_to_string(&pin_path)?;
    Ok((server, out, pin.trim().to_owned()))
}
