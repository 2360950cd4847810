//! Firmware conformance matrix: real firmware under TCG network-boots through
//! bootd (DHCP, TFTP, HTTP) to a marker printed by a tiny busybox initramfs
//! started by the Debian kernel, or, in the cases of the boot matrix that no
//! end-to-end test boots (IPv6 PXE, IPv6 HTTP boot, a site's Secure Boot
//! key), to the agent: it registers with the agent-protocol test server
//! (`fake_manager`, in the namespace) over the address family it booted
//! on and reports the hardware, whose architecture, firmware mode and
//! Secure Boot state are checked. Cases run concurrently.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anneal_api::agent::{FirmwareMode, HardwareReport};
use anneal_tests::artifacts;

use anneal_bootd::{NetnsServer, ServerOptions, StaticConfig};
use anneal_testinfra::{
    Firmware, Netns, NicConfig, Vm, VmConfig, debian_kernel, debian_kernel_arm64, smoke_initramfs,
    smoke_initramfs_with,
};

/// The lease renewal across a bootd restart (docs/bootd.md, "Leases"), with
/// real VMs (`bootd_vm/renew.rs`). In this binary so that its minute of
/// waiting for the agent's renewal overlaps the matrix instead of holding a
/// test lane of `tests/run.sh` on its own.
#[path = "bootd_vm/renew.rs"]
mod renew;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Topology {
    /// bootd alone on the segment, lease mode.
    Lease,
    /// bootd in proxy mode beside a plain dnsmasq (addresses only) in a
    /// second namespace.
    ProxyBesideDnsmasq,
    /// bootd two hops away behind Debian's dhcrelay.
    Relayed,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    firmware: Firmware,
    option_rom: bool,
    http_boot: bool,
    chain_undionly: bool,
    topology: Topology,
    mac: &'static str,
    /// The firmware boots over IPv6 (IPv4 PXE off): bootd's DHCPv6 hands
    /// it `tftp://[fd77::1]/…`; iPXE then runs on the dual-stack segment.
    ipv6: bool,
    secure: Secure,
    /// The agent's initramfs instead of the smoke one: the case ends at the
    /// agent's hardware report (IPv6 cases register at `[fd77::1]`).
    agent: bool,
}

/// The boot token of the agent cases (in bootd's static table; bootd's
/// script hands it over in the token cpio).
const TOKEN: &str = "Ym9vdGQtdm0tYWdlbnQtY2FzZS10b2tlbi0wMDAx";

/// The agent's initramfs and the test server, built once for the matrix.
#[derive(Debug, Clone)]
struct AgentBits {
    initrd: PathBuf,
    fake_manager: PathBuf,
}

/// The Secure Boot chain of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Secure {
    /// No Secure Boot chain (the firmware may still be a Secure Boot one).
    Off,
    /// The machine's `bootLoader: shim`: Debian's signed shim, signed
    /// network GRUB and signed kernel under the Microsoft keys.
    MicrosoftShim,
    /// A site key: iPXE and the kernel signed with Debian's snakeoil key,
    /// the only db key of the firmware's variable store.
    SiteKey,
}

/// Debian's signed shim and network GRUB (tests/setup.d/secureboot.sh).
fn secureboot_dir() -> std::path::PathBuf {
    anneal_testinfra::cache_dir().join("secureboot")
}

/// `src` signed with the snakeoil key into `dest` (sbsign, package
/// sbsigntool). The key ships encrypted (pass phrase `snakeoil`, see the ovmf
/// package's README.Debian): it is decrypted next to `dest` first.
fn sign_snakeoil(src: &Path, dest: &Path) -> anyhow::Result<()> {
    let key = dest.with_extension("key");
    let out = std::process::Command::new("openssl")
        .args(["pkey", "-passin", "pass:snakeoil", "-in"])
        .arg(anneal_testinfra::SNAKEOIL_KEY)
        .arg("-out")
        .arg(&key)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "openssl pkey {}: {}",
        anneal_testinfra::SNAKEOIL_KEY,
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new("sbsign")
        .arg("--key")
        .arg(&key)
        .arg("--cert")
        .arg(anneal_testinfra::SNAKEOIL_CERT)
        .arg("--output")
        .arg(dest)
        .arg(src)
        .output()
        .map_err(|e| {
            anyhow::anyhow!("sbsign (package sbsigntool, tests/setup.d/secureboot.sh): {e}")
        })?;
    anyhow::ensure!(
        out.status.success(),
        "sbsign {}: {}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

const FILES: &str = "files: {snponly.efi: /usr/lib/ipxe/snponly.efi, ipxe.efi: /usr/lib/ipxe/ipxe.efi, undionly.kpxe: /usr/lib/ipxe/undionly.kpxe}";

fn config(
    case: &Case,
    dir: &Path,
    kernel: &Path,
    initrd: &Path,
    api: Option<(&str, &str)>,
    arm64: Option<(&Path, &anneal_testinfra::Arm64Pieces)>,
) -> String {
    let files = match (case.secure, arm64) {
        // no arm64 iPXE here (Debian ships none and serves no source
        // package to build one): arm64 boots Debian's arm64 shim and
        // network GRUB, like `bootLoader: shim` on x86_64
        (Secure::Off, Some((_, a))) => format!(
            "files: {{shimaa64.efi: {}, grubaa64.efi: {}}}",
            a.shim.display(),
            a.grub.display()
        ),
        (Secure::Off, None) => FILES.to_string(),
        (Secure::MicrosoftShim, _) => {
            let sb = secureboot_dir();
            format!(
                "files: {{snponly.efi: /usr/lib/ipxe/snponly.efi, shimx64.efi: {}, grubx64.efi: {}}}",
                sb.join("shimx64.efi").display(),
                sb.join("grubx64.efi").display()
            )
        }
        (Secure::SiteKey, _) => format!(
            "files: {{snponly.efi: {}/snponly.signed.efi}}",
            dir.display()
        ),
    };
    let loader = if case.secure == Secure::MicrosoftShim || arm64.is_some() {
        "shim"
    } else {
        "ipxe"
    };
    let (arch, console, arm_artifacts) = match arm64 {
        Some((k, _)) => (
            "aarch64",
            "ttyAMA0",
            format!(
                ", aarch64: {{kernel: {}, initrd: {}/initrd-arm64.cpio}}",
                k.display(),
                dir.display()
            ),
        ),
        None => ("x86_64", "ttyS0", String::new()),
    };
    let (server, cidr, dhcp) = match case.topology {
        Topology::Lease => (
            "10.77.0.1",
            "10.77.0.0/24",
            "dhcp: {mode: lease, gateway: \"\", leaseTime: 10m}".to_string(),
        ),
        Topology::ProxyBesideDnsmasq => ("10.77.0.1", "10.77.0.0/24", "dhcp: {mode: proxy}".into()),
        Topology::Relayed => (
            "10.99.0.1",
            "10.77.0.0/24",
            "dhcp: {mode: lease, gateway: 10.77.0.254, leaseTime: 10m}".into(),
        ),
    };
    let address = if case.topology == Topology::ProxyBesideDnsmasq {
        String::new()
    } else {
        "\n    address: 10.77.0.50".into()
    };
    let (api, token) = match api {
        Some((url, pin)) => (
            format!("api: {{url: \"{url}\", caSha256: \"{pin}\"}}\n"),
            format!("\n    token: {TOKEN}"),
        ),
        None => (String::new(), String::new()),
    };
    format!(
        "serverIP: {server}\ncidr: {cidr}\n{dhcp}\n{files}\n{api}\
         artifacts: {{kernel: {kernel}, initrd: {initrd}{arm_artifacts}}}\n\
         machines:\n  - name: lab/{name}\n    mac: \"{mac}\"{address}{token}\n    console: [{console}]\n    chainUndionly: {chain}\n    bootLoader: {loader}\n    architecture: {arch}\n",
        kernel = kernel.display(),
        initrd = initrd.display(),
        name = case.name,
        mac = case.mac,
        chain = case.chain_undionly,
    )
}

async fn run_case(case: Case, agent: Option<AgentBits>) -> anyhow::Result<f64> {
    let kernel = debian_kernel()?;
    let mut ns = Netns::create("bv")?;
    // IPv6 HTTP boot: an IPv6-only segment (no DHCPv4 answers for the
    // machine), where iPXE too takes its address and script from DHCPv6
    let v6_only = case.ipv6 && case.http_boot;
    if v6_only {
        ns.start_managed_router_advertisements()?;
    } else {
        ns.start_router_advertisements()?;
    }
    let dir = ns.dir();
    let marker = format!("ANNEAL-BOOTD-MARKER-{}", case.name);
    // the kernel logs whether the firmware enforced Secure Boot
    let smoke = format!(
        "if dmesg | grep -q 'Secure boot enabled'; then sb=1; else sb=0; fi\n\
         echo {marker} ok secureboot=$sb arch=$(uname -m)\npoweroff -f"
    );
    std::fs::write(dir.join("initrd.cpio"), smoke_initramfs(&smoke)?)?;
    let arm64 = if case.firmware.is_arm64() {
        let k = debian_kernel_arm64()?;
        let pieces = anneal_testinfra::arm64_pieces()?;
        std::fs::write(
            dir.join("initrd-arm64.cpio"),
            smoke_initramfs_with(&pieces.busybox, &smoke)?,
        )?;
        Some((k.vmlinuz, pieces))
    } else {
        None
    };
    let kernel_path = if case.secure == Secure::SiteKey {
        let signed = dir.join("vmlinuz.signed");
        sign_snakeoil(&kernel.vmlinuz, &signed)?;
        sign_snakeoil(
            Path::new("/usr/lib/ipxe/snponly.efi"),
            &dir.join("snponly.signed.efi"),
        )?;
        signed
    } else {
        kernel.vmlinuz.clone()
    };
    // The agent cases: the test server on bootd's address of the family
    // the firmware booted on; bootd's script names it as `anneal.api`.
    let mut children: Vec<std::process::Child> = Vec::new();
    let mut agent_run = None;
    if let Some(bits) = agent.as_ref().filter(|_| case.agent) {
        let (listen, url) = if case.ipv6 {
            ("[fd77::1]:8443", "https://[fd77::1]:8443")
        } else {
            ("10.77.0.1:8443", "https://10.77.0.1:8443")
        };
        let machine = format!("lab/{}", case.name);
        let (server, out, pin) = anneal_tests::agent_vm::fake_manager(
            &ns,
            &bits.fake_manager,
            (listen, TOKEN, &machine),
            &dir,
        )
        .await?;
        agent_run = Some((server, out, url, pin));
    }
    let initrd = match (&agent_run, &agent) {
        (Some(_), Some(bits)) => bits.initrd.clone(),
        _ => dir.join("initrd.cpio"),
    };
    let cfg = config(
        &case,
        &dir,
        &kernel_path,
        &initrd,
        agent_run
            .as_ref()
            .map(|(_, _, url, pin)| (*url, pin.as_str())),
        arm64.as_ref().map(|(k, p)| (k.as_path(), p)),
    );
    let snap = StaticConfig::from_yaml(&cfg)?.snapshot(8080, "r1".into())?;

    // Namespaces that must outlive the VM.
    let mut keep: Vec<Netns> = Vec::new();
    let server = match case.topology {
        Topology::Lease => NetnsServer::start(
            ns.name(),
            ServerOptions {
                interface: Some("br0".into()),
                lease_file: Some(dir.join("leases.json")),
                // no DHCPv4 on the segment: OVMF's HTTPv4 boot option
                // times out and its HTTPv6 one runs (with IPv4 switched
                // off in the firmware, `opt/org.tianocore/IPv4Support=n`,
                // this OVMF's HTTPv6 boot fails without sending a packet)
                dhcp_port: if v6_only { 0 } else { 67 },
                dhcp6: case.ipv6.then(|| anneal_bootd::dhcp6::Dhcp6Options {
                    server_ip: "fd77::1".parse().unwrap(),
                    prefix: "fd77::/64".parse().unwrap(),
                    range: Some(("fd77::100".parse().unwrap(), "fd77::1ff".parse().unwrap())),
                    dns: vec![],
                    preferred_lifetime: 600,
                    valid_lifetime: 900,
                }),
                ..ServerOptions::default()
            },
            snap,
        )?,
        Topology::ProxyBesideDnsmasq => {
            // the segment's own DHCP server, addresses only, in its own namespace
            let other = Netns::bare("bvd")?;
            ns.add_veth_to_bridge(&other, "vd0", "d0", "10.77.0.3/24")?;
            children.push(
                other
                    .exec("dnsmasq")
                    .args([
                        "--keep-in-foreground",
                        "--port=0",
                        "--interface=d0",
                        "--bind-interfaces",
                        "--dhcp-range=10.77.0.100,10.77.0.150,10m",
                        "--no-ping",
                        "--dhcp-leasefile=/dev/null",
                        "--log-facility=-",
                    ])
                    .arg(format!("--pid-file={}/dnsmasq.pid", dir.display()))
                    .stdout(std::fs::File::create(dir.join("dnsmasq.log"))?)
                    .stderr(std::fs::File::create(dir.join("dnsmasq.err"))?)
                    .spawn()?,
            );
            keep.push(other);
            NetnsServer::start(
                ns.name(),
                ServerOptions {
                    interface: Some("br0".into()),
                    ..ServerOptions::default()
                },
                snap,
            )?
        }
        Topology::Relayed => {
            // client segment (br0 here) -- relay ns -- bootd ns
            let relay = Netns::bare("bvy")?;
            let bootd_ns = Netns::bare("bvb")?;
            ns.add_veth_to_bridge(&relay, "vr0", "rd0", "10.77.0.254/24")?;
            relay.link(&bootd_ns, "ru0", "10.99.0.254/24", "b0", "10.99.0.1/24")?;
            bootd_ns.ip(&["route", "add", "10.77.0.0/24", "via", "10.99.0.254"])?;
            relay
                .exec("sysctl")
                .args(["-qw", "net.ipv4.ip_forward=1"])
                .status()?;
            children.push(
                relay
                    .exec("dhcrelay")
                    .args(["-d", "-4", "-iu", "ru0", "-id", "rd0", "10.99.0.1"])
                    .stdout(std::fs::File::create(dir.join("dhcrelay.log"))?)
                    .stderr(std::fs::File::create(dir.join("dhcrelay.err"))?)
                    .spawn()?,
            );
            anneal_tests::wait::file_contains(
                &dir.join("dhcrelay.err"),
                anneal_tests::wait::DHCRELAY_READY,
                Duration::from_secs(30),
            );
            let s = NetnsServer::start(
                bootd_ns.name(),
                ServerOptions {
                    interface: Some("b0".into()),
                    lease_file: Some(dir.join("leases.json")),
                    ..ServerOptions::default()
                },
                snap,
            )?;
            keep.push(relay);
            keep.push(bootd_ns);
            s
        }
    };

    let tap = ns.add_tap()?;
    let mut nic = NicConfig::virtio(&tap, case.mac);
    nic.option_rom = case.option_rom;
    let mut extra = Vec::new();
    if case.http_boot {
        for v in ["IPv4PXESupport", "IPv6PXESupport"] {
            extra.push("-fw_cfg".to_string());
            extra.push(format!("name=opt/org.tianocore/{v},string=n"));
        }
    }
    if case.ipv6 && !case.http_boot {
        extra.push("-fw_cfg".to_string());
        extra.push("name=opt/org.tianocore/IPv4PXESupport,string=n".to_string());
    }
    let vm_cfg = VmConfig {
        firmware: case.firmware,
        memory_mib: 1024,
        cpus: 1,
        nics: vec![nic],
        extra_args: extra,
        ..VmConfig::default()
    };
    let started = Instant::now();
    let mut vm = Vm::launch(&vm_cfg, Some(&ns))?;
    // our boot scripts say so when they give up, and OVMF falls through to
    // its shell when every network boot option failed: fail at once
    // the agent's console lines carry its uptime before `anneal:`
    let (done, done_re) = if agent_run.is_some() {
        let d = "anneal: hardware sent".to_string();
        (d.clone(), d)
    } else {
        let d = format!("{marker} ok");
        (d.clone(), format!("^{d}"))
    };
    let res = vm
        .wait_for_line(
            &format!(
                "{done_re}|anneal: FAILED: |anneal: .*exiting to the next boot device|UEFI Interactive Shell"
            ),
            Duration::from_secs(330),
        )
        .await
        .and_then(|line| {
            anyhow::ensure!(line.contains(&done), "the boot gave up: {line}");
            Ok(line)
        });
    let serial = vm.serial_text();
    let uname = if case.firmware.is_arm64() {
        "aarch64"
    } else {
        "x86_64"
    };
    // what the kernel saw (the smoke initramfs), or what the agent
    // reported to the test server
    let hw: Option<HardwareReport> = agent_run.as_ref().and_then(|(_, out, _, _)| {
        serde_json::from_slice(&std::fs::read(out.join("hardware.json")).ok()?).ok()
    });
    let (enforced, right_arch) = match &hw {
        Some(hw) => (
            hw.firmware.secure_boot,
            hw.cpu.architecture.as_deref() == Some(uname) && hw.firmware.mode == FirmwareMode::Uefi,
        ),
        None => (
            serial.contains(&format!("{marker} ok secureboot=1")),
            serial.contains(&format!("arch={uname}")),
        ),
    };
    let secs = started.elapsed().as_secs_f64();
    vm.kill();
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    let metrics = server.shared().metrics.render();
    server.stop();
    drop(keep);
    res.map_err(|e| {
        let lines: Vec<&str> = serial.lines().collect();
        let tail = lines[lines.len().saturating_sub(60)..].join("\n");
        anyhow::anyhow!(
            "case {}: {e:#}\nserial (last 60 lines):\n{tail}\nbootd metrics:\n{metrics}",
            case.name
        )
    })?;
    println!(
        "{}: {} after {secs:.1} s",
        case.name,
        if agent_run.is_some() {
            "the agent's hardware report"
        } else {
            "marker"
        }
    );
    let secure_firmware = matches!(
        case.firmware,
        Firmware::OvmfSecureBootMs | Firmware::OvmfSecureBootSnakeoil
    );
    anyhow::ensure!(
        right_arch,
        "case {}: not an {uname} kernel (or the agent's report lacks {uname} and UEFI: {hw:?})",
        case.name
    );
    if let Some((_, out, url, _)) = &agent_run {
        // registered over the family it booted on, at bootd's `anneal.api`
        let want: &[&str] = if case.ipv6 {
            &[
                "anneal: DHCPv6 address fd77::",
                "anneal: network configured: fd77::",
            ]
        } else {
            &[
                "anneal: DHCP lease 10.77.0.50/24",
                "anneal: network configured: 10.77.0.50/24",
            ]
        };
        for w in want
            .iter()
            .copied()
            .chain([format!("anneal: registering with {url}").as_str()])
            .chain([format!("anneal: registered as lab/{}", case.name).as_str()])
        {
            anyhow::ensure!(
                serial.contains(w),
                "case {}: console lacks {w:?}",
                case.name
            );
        }
        let events = std::fs::read_to_string(out.join("events.log"))?;
        anyhow::ensure!(
            events.starts_with("POST /v1/agent/register -> 200\nPUT /v1/agent/hardware -> 204\n"),
            "case {}: the test server saw {events}",
            case.name
        );
    }
    anyhow::ensure!(
        enforced == secure_firmware,
        "case {}: the kernel saw Secure Boot {} (expected {})",
        case.name,
        if enforced { "enforced" } else { "off" },
        if secure_firmware { "enforced" } else { "off" }
    );

    // The path each case claims is the path it took.
    let tftp = metric(&metrics, "bootd_tftp_requests_total{reason=\"served\"}");
    let scripts = metric(&metrics, "kind=\"script\",code=\"200\"");
    let files = metric(&metrics, "kind=\"file\",code=\"200\"");
    let ctx = format!("case {}:\n{metrics}", case.name);
    anyhow::ensure!(
        scripts >= 1 || case.secure == Secure::MicrosoftShim || case.firmware.is_arm64(),
        "no script served, {ctx}"
    );
    if case.secure == Secure::MicrosoftShim || case.firmware.is_arm64() {
        // over TFTP: shim, GRUB, grub/grub.cfg, grub/<mac>, the kernel and
        // the initramfs; GRUB ran both configs
        anyhow::ensure!(
            tftp >= 6
                && serial.contains("anneal: GRUB on ")
                && serial.contains("anneal: booting lab/"),
            "not the shim → GRUB chain, {ctx}\nserial:\n{serial}"
        );
    }
    if case.http_boot {
        anyhow::ensure!(files >= 1 && tftp == 0, "not an HTTP boot, {ctx}");
    } else if !case.option_rom || case.chain_undionly {
        anyhow::ensure!(tftp >= 1, "no first stage over TFTP, {ctx}");
    } else {
        anyhow::ensure!(tftp == 0, "iPXE ROM fetched a first stage, {ctx}");
    }
    if case.ipv6 {
        // the firmware's exchange was DHCPv6 (IPv4 PXE is off), and the
        // first stage it fetched came from the URL it was handed there
        anyhow::ensure!(
            metric(&metrics, "msg_type=\"v6_solicit\",outcome=\"advertise\"") >= 1
                && metric(&metrics, "msg_type=\"v6_request\",outcome=\"reply\"") >= 1,
            "no DHCPv6 exchange with the firmware, {ctx}"
        );
    }
    if case.chain_undionly {
        anyhow::ensure!(
            scripts >= 2,
            "undionly.kpxe did not fetch the script again, {ctx}"
        );
    }
    match case.topology {
        Topology::ProxyBesideDnsmasq => {
            let log = std::fs::read_to_string(dir.join("dnsmasq.log")).unwrap_or_default()
                + &std::fs::read_to_string(dir.join("dnsmasq.err")).unwrap_or_default();
            anyhow::ensure!(
                log.contains("DHCPACK"),
                "dnsmasq handed out no address: {log}"
            );
            // OVMF takes the boot file from the proxy offer itself (option 43
            // discovery control 8); iPXE takes its script URL from it too.
            anyhow::ensure!(
                metric(&metrics, "msg_type=\"discover\",outcome=\"offer\"") >= 2,
                "no proxy offers to firmware and iPXE, {ctx}"
            );
        }
        Topology::Lease | Topology::Relayed if v6_only => {
            // iPXE too took its address and its script over DHCPv6
            anyhow::ensure!(
                metric(&metrics, "msg_type=\"v6_request\",outcome=\"reply\"") >= 2,
                "iPXE did not take its address from DHCPv6, {ctx}"
            );
        }
        Topology::Lease | Topology::Relayed => {
            anyhow::ensure!(
                metric(&metrics, "msg_type=\"request\",outcome=\"ack\"") >= 1,
                "no lease acked, {ctx}"
            );
        }
    }
    Ok(secs)
}

fn metric(m: &str, needle: &str) -> u64 {
    m.lines()
        .filter(|l| !l.starts_with('#') && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

const UEFI_PXE_LEASE: Case = Case {
    name: "uefi-pxe-lease",
    firmware: Firmware::Ovmf,
    option_rom: false,
    http_boot: false,
    chain_undionly: false,
    topology: Topology::Lease,
    mac: "52:54:00:b0:00:01",
    ipv6: false,
    secure: Secure::Off,
    agent: false,
};

const fn case(name: &'static str, firmware: Firmware, mac: &'static str) -> Case {
    Case {
        name,
        firmware,
        option_rom: true,
        http_boot: false,
        chain_undionly: false,
        topology: Topology::Lease,
        mac,
        ipv6: false,
        secure: Secure::Off,
        agent: false,
    }
}

const UEFI_IPXE_ROM: Case = case("uefi-ipxe-rom", Firmware::Ovmf, "52:54:00:b0:00:02");
const UEFI_HTTP: Case = Case {
    option_rom: false,
    http_boot: true,
    ..case("uefi-http", Firmware::Ovmf, "52:54:00:b0:00:03")
};
const SEABIOS_IPXE_ROM: Case = case("seabios-ipxe-rom", Firmware::SeaBios, "52:54:00:b0:00:04");
const SEABIOS_UNDIONLY: Case = Case {
    chain_undionly: true,
    ..case("seabios-undionly", Firmware::SeaBios, "52:54:00:b0:00:05")
};
const UEFI_PXE_PROXY: Case = Case {
    option_rom: false,
    topology: Topology::ProxyBesideDnsmasq,
    ..case("uefi-pxe-proxy", Firmware::Ovmf, "52:54:00:b0:00:06")
};
const UEFI_PXE6: Case = Case {
    option_rom: false,
    ipv6: true,
    agent: true,
    ..case("uefi-pxe6", Firmware::Ovmf, "52:54:00:b0:00:08")
};
/// UEFI HTTP boot over IPv6 on an IPv6-only segment: DHCPv6 with vendor
/// class `HTTPClient` (architecture 16) gets option 59
/// `http://[fd77::1]:8080/files/snponly.efi`; iPXE then takes its address
/// and script URL from DHCPv6 and fetches the script, kernel and initramfs
/// over IPv6.
const UEFI_HTTP6: Case = Case {
    option_rom: false,
    http_boot: true,
    ipv6: true,
    agent: true,
    ..case("uefi-http6", Firmware::Ovmf, "52:54:00:b0:00:0c")
};
const SECURE_MS_SHIM: Case = Case {
    option_rom: false,
    secure: Secure::MicrosoftShim,
    ..case(
        "secureboot-ms-shim",
        Firmware::OvmfSecureBootMs,
        "52:54:00:b0:00:09",
    )
};
const SECURE_SITE_KEY: Case = Case {
    option_rom: false,
    secure: Secure::SiteKey,
    agent: true,
    ..case(
        "secureboot-site-key",
        Firmware::OvmfSecureBootSnakeoil,
        "52:54:00:b0:00:0a",
    )
};
/// arm64 UEFI (AAVMF on QEMU's `virt` board): PXE with client architecture
/// 11, Debian's arm64 shim and network GRUB, the arm64 kernel of the
/// Machine's `architecture: aarch64`.
const AARCH64_UEFI: Case = Case {
    option_rom: false,
    ..case("aarch64-uefi", Firmware::Aavmf, "52:54:00:b0:00:0b")
};
const SEABIOS_RELAYED: Case = Case {
    topology: Topology::Relayed,
    ..case("seabios-relayed", Firmware::SeaBios, "52:54:00:b0:00:07")
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn firmware_matrix() {
    let cases = [
        UEFI_PXE_LEASE,
        UEFI_IPXE_ROM,
        UEFI_HTTP,
        SEABIOS_IPXE_ROM,
        SEABIOS_UNDIONLY,
        UEFI_PXE_PROXY,
        SEABIOS_RELAYED,
        UEFI_PXE6,
        UEFI_HTTP6,
        SECURE_MS_SHIM,
        SECURE_SITE_KEY,
        AARCH64_UEFI,
    ];
    // ANNEAL_BOOTD_CASES=name,name runs only those (debugging one case)
    let only = std::env::var("ANNEAL_BOOTD_CASES").ok();
    let cases: Vec<Case> = cases
        .into_iter()
        .filter(|c| {
            only.as_deref()
                .is_none_or(|o| o.split(',').any(|n| n == c.name))
        })
        .collect();
    assert!(!cases.is_empty(), "ANNEAL_BOOTD_CASES names no case");
    let t0 = Instant::now();
    // the agent's initramfs, once, for the cases that boot it
    let agent = if cases.iter().any(|c| c.agent) {
        let bits = tokio::task::spawn_blocking(|| {
            let kernel = debian_kernel().unwrap();
            let dir = tempfile::Builder::new()
                .prefix("anneal-bootd-vm-agent-")
                .tempdir()
                .unwrap();
            let initrd = dir.path().join("agent.cpio.zst");
            artifacts::build_initramfs(
                &artifacts::initramfs_tool(),
                &artifacts::agent_musl(),
                &kernel.modules,
                &initrd,
            );
            (
                dir,
                AgentBits {
                    initrd,
                    fake_manager: artifacts::fake_manager(),
                },
            )
        })
        .await
        .unwrap();
        Some(bits)
    } else {
        None
    };
    let handles: Vec<_> = cases
        .iter()
        .map(|c| tokio::spawn(run_case(*c, agent.as_ref().map(|(_, b)| b.clone()))))
        .collect();
    let mut failures = Vec::new();
    for (c, h) in cases.iter().zip(handles) {
        match h.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => failures.push(format!("{e:#}")),
            Err(e) => failures.push(format!("{}: {e}", c.name)),
        }
    }
    println!(
        "matrix: {} cases in {:.1} s",
        cases.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
