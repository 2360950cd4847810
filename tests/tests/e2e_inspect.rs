//! End to end, under TCG: a Machine with the VM's MAC and a BMC
//! (`anneal-qemu-bmc` in front of a paused QEMU) → the real manager mints the
//! boot token and powers the VM on with a one-time Pxe override → OVMF's PXE
//! client gets `snponly.efi` from the real bootd (lease mode, inside the test
//! namespace), iPXE the per-machine script over HTTP, then the Debian kernel
//! and our initramfs → the static musl agent (PID 1) loads its drivers,
//! takes its lease, registers over HTTPS (relayed from 10.77.0.1:8443 to the
//! manager on host loopback) and posts the hardware → the Machine is
//! Available and MachineHardware lists both disks with the serials of the
//! QEMU command line, the NIC's MAC, memory and CPU count exactly as
//! configured. Under 60 s from QEMU's launch. The set-up lives in `e2e/`
//! (shared with the demo).
//!
//! LLDP (docs/api.md, MachineHardware `nics[].lldp`): lldpd plays the switch
//! on the VM's tap (its port of the bridge) from before power-on; the agent's
//! inspection hears it and MachineHardware carries the port ID, system name
//! and chassis ID; a claim selecting another port of that switch stays
//! Pending, one selecting the VM's port binds the Machine.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_tests::e2e;

use std::time::{Duration, Instant};

use anneal_api::{ClaimPhase, Machine, MachineClaim, MachineHardware, NicLldp};
use e2e::{CPUS, DISKS, Lab, MAC, MACHINE, MEMORY_MIB, Progress};
use kube::api::{Api, PostParams};

/// The system name lldpd announces on the VM's tap.
const SWITCH: &str = "leaf-e2e.test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_network_boots_through_bootd_and_is_inspected() {
    let mut lab = Lab::start(&|s| println!("e2e: {s}")).await.unwrap();
    lab.launch_vm().await.unwrap();
    // the switch on the VM's port, sending before the VM is powered on
    let switch = lab.start_lldp(SWITCH).unwrap();
    lab.enrol().await.unwrap();
    let mut states = Vec::new();
    let res = lab
        .wait_available(Duration::from_secs(300), &mut |p| {
            if let Progress::State(s, t) = p {
                println!("e2e: state {s:?} at {:.1} s", t.as_secs_f64());
                states.push(s.to_string());
            }
        })
        .await;
    let elapsed = match res {
        Ok(t) => t,
        Err(e) => panic!("{e:#}\nconsole:\n{}", e2e::tail(&lab.console(), 60)),
    };
    println!(
        "e2e: QEMU launch → Machine Available in {:.1} s",
        elapsed.as_secs_f64()
    );
    // The Machine is Available once the manager has the hardware; the agent
    // prints "hardware sent" after the answer reaches it, which can be after
    // the test sees Available: wait for the line, then read the console.
    lab.wait_console("anneal: hardware sent", 1, Duration::from_secs(60))
        .await
        .unwrap();
    let console = lab.console();
    let (after_init, after_net, line) =
        e2e::registration_times(&console).expect("registration line on the console");
    println!(
        "e2e: /init → registration {after_init:.1} s ({after_net:.1} s after the lease): {line}"
    );
    // The console gives /init → registration; the goal on a quiet
    // machine is at most 3 s from the lease to registration (printed). The
    // assertion is generous (a TCG guest on a loaded host runs slowly): it
    // catches a fixed wait or a retry timeout, not load.
    assert!(after_init > 0.0 && after_init >= after_net, "{line}");
    if after_net > 3.0 {
        println!("note: registration {after_net:.1} s after the lease (goal: at most 3 s)");
    }
    assert!(
        after_net <= 30.0,
        "registration {after_net:.1} s after the lease (goal: at most 3 s): {line}"
    );

    // The lifecycle as the controller walked it.
    assert!(states.iter().any(|s| s == "Inspecting"), "{states:?}");
    assert_eq!(states.last().map(String::as_str), Some("Available"));

    // The VM was powered on by the manager through its BMC, PXE first.
    let log = lab.bmc_requests();
    let patch = log
        .iter()
        .position(|e| e.method == "PATCH" && e.action.as_deref() == Some("Boot=Once/Pxe"));
    let on = log
        .iter()
        .position(|e| e.is_reset() && e.action.as_deref() == Some("On"));
    assert!(
        matches!((patch, on), (Some(p), Some(o)) if p < o),
        "no Pxe override before power-on: {log:?}"
    );

    // The boot went through bootd's script: the kernel line carries every
    // boot parameter of docs/api.md.
    let cmdline = console
        .lines()
        .find(|l| l.contains("Kernel command line:"))
        .unwrap_or_else(|| panic!("no kernel command line on the console:\n{console}"));
    let bootif = format!("BOOTIF=01-{}", MAC.replace(':', "-"));
    let ca = format!("anneal.ca={}", lab.api.pki().ca_sha256);
    let machine = format!("anneal.machine=default/{MACHINE}");
    for want in [
        "anneal.api=https://10.77.0.1:8443",
        ca.as_str(),
        machine.as_str(),
        bootif.as_str(),
        "console=ttyS0",
        "initrd=initrd.img",
        "initrd=anneal-token.cpio",
    ] {
        assert!(cmdline.contains(want), "{want:?} not in {cmdline}");
    }
    // the token came in the second initrd, never on the command line
    // (docs/api.md, "Boot parameters")
    assert!(!cmdline.contains("anneal.token"), "{cmdline}");
    replayed_fetches_get_nothing(&lab).await;
    // The address the manager's reservations controller wrote.
    let lease = format!("anneal: DHCP lease {}/24", e2e::ADDRESS);
    for want in [lease.as_str(), "anneal: hardware sent"] {
        assert!(console.contains(want), "console lacks {want:?}");
    }
    let m = lab.bootd.shared().metrics.render();
    for want in [
        "bootd_tftp_requests_total{reason=\"served\"}",
        "kind=\"script\",code=\"200\"",
    ] {
        assert!(
            m.lines()
                .any(|l| l.starts_with("bootd_") && l.contains(want) && !l.ends_with(" 0")),
            "bootd metrics lack {want}:\n{m}"
        );
    }

    // MachineHardware: exactly the VM of the QEMU command line.
    let hw = lab.hardware().await.unwrap().expect("MachineHardware");
    print!("{}", e2e::summary(&hw));
    let mut disks: Vec<(String, Option<String>, i64)> = hw
        .spec
        .disks
        .iter()
        .map(|d| (d.device_name.clone(), d.serial_number.clone(), d.size_bytes))
        .collect();
    disks.sort();
    let mut want: Vec<(String, Option<String>, i64)> = DISKS
        .iter()
        .map(|(_, serial, mib, name)| {
            (
                format!("/dev/{name}"),
                Some(serial.to_string()),
                i64::try_from(mib << 20).unwrap(),
            )
        })
        .collect();
    want.sort();
    assert_eq!(disks, want);
    let macs: Vec<&str> = hw.spec.nics.iter().map(|n| n.mac.as_str()).collect();
    assert_eq!(macs, [MAC]);
    assert_eq!(
        hw.spec.memory_bytes,
        Some(i64::from(MEMORY_MIB) << 20),
        "memory exactly as configured"
    );
    assert_eq!(
        hw.spec.cpu.as_ref().map(|c| c.count),
        Some(i32::try_from(CPUS).unwrap())
    );
    assert_eq!(
        hw.spec.cpu.as_ref().and_then(|c| c.architecture),
        Some(anneal_api::Architecture::X86_64),
        "the inventory reports the architecture"
    );

    // The goal on a quiet machine is under 60 s (printed); the bound that can
    // fail is `wait_available`'s deadline above, generous for a loaded host.
    if elapsed > Duration::from_secs(60) {
        println!(
            "note: QEMU launch → Available took {:.1} s (goal on a quiet machine: under 60 s)",
            elapsed.as_secs_f64()
        );
    }

    the_switch_port_is_reported_and_selects_the_machine(&lab, &hw, &switch).await;
}

/// The LLDP frame lldpd sent on the VM's tap is in MachineHardware
/// (port ID the tap's name, the system name and chassis ID lldpd announced)
/// and on the console; with the claim controller running, a claim selecting
/// another port of the same switch waits (NoMatchingMachine, closest:
/// hardware below the selector's floors: it saw the Machine and refused it) while one selecting the VM's port binds it, and
/// the first still waits.
async fn the_switch_port_is_reported_and_selects_the_machine(
    lab: &Lab,
    hw: &MachineHardware,
    switch: &NicLldp,
) {
    let nic = hw.spec.nics.first().expect("the VM's NIC");
    assert_eq!(
        nic.lldp.as_ref(),
        Some(switch),
        "NIC {} in MachineHardware; lldpd said:\n{}",
        nic.name,
        lab.lldpd_log()
    );
    let port = switch.port_id.clone().unwrap();
    let line = format!("lldp={SWITCH} port {port}");
    assert!(
        lab.console().contains(&line),
        "console lacks {line:?}:\n{}",
        e2e::tail(&lab.console(), 40)
    );
    println!(
        "e2e: NIC {} heard LLDP: {SWITCH} port {port} (chassis {})",
        nic.name,
        switch.chassis_id.as_deref().unwrap_or("-")
    );

    let started = Instant::now();
    lab.start_claims();
    let claims: Api<MachineClaim> = Api::namespaced(lab.cp.client(), e2e::NAMESPACE);
    let by_port = |name: &str, port: &str| -> MachineClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": name},
            "spec": {
                "selector": {"hardware": {"nics": [{"lldp": {"systemName": SWITCH, "portId": port}}]}},
                "imageRef": {"name": "lldp-selected"},
            },
        }))
        .unwrap()
    };
    let status = |name: &'static str| {
        let claims = claims.clone();
        async move { claims.get(name).await.unwrap().status.unwrap_or_default() }
    };
    // a port of the same switch that no machine of the lab is cabled to
    let other = format!("{port}-other");
    claims
        .create(&PostParams::default(), &by_port("other-port", &other))
        .await
        .unwrap();
    anneal_tests::eventually(
        "claim other-port Pending: the Machine's NIC is on another port",
        Duration::from_secs(60),
        || async {
            let s = status("other-port").await;
            // it looked at the Machine and found its hardware short
            let refused = s.conditions.iter().any(|c| {
                c.type_ == "Bound"
                    && c.reason == "NoMatchingMachine"
                    && c.message.contains("hardware below")
            });
            if s.phase == Some(ClaimPhase::Pending) && refused {
                Ok(())
            } else {
                Err(s)
            }
        },
    )
    .await;
    claims
        .create(&PostParams::default(), &by_port("vm-port", &port))
        .await
        .unwrap();
    anneal_tests::eventually(
        "claim vm-port Bound to the lab's Machine",
        Duration::from_secs(60),
        || async {
            let s = status("vm-port").await;
            if s.phase == Some(ClaimPhase::Bound) && s.machine_name.as_deref() == Some(MACHINE) {
                Ok(())
            } else {
                Err(s)
            }
        },
    )
    .await;
    let machines: Api<Machine> = Api::namespaced(lab.cp.client(), e2e::NAMESPACE);
    let m = machines.get(MACHINE).await.unwrap();
    assert_eq!(
        m.spec.claim_ref.as_ref().map(|r| r.name.as_str()),
        Some("vm-port"),
        "{:?}",
        m.spec.claim_ref
    );
    let s = status("other-port").await;
    assert!(
        s.phase == Some(ClaimPhase::Pending) && s.machine_name.is_none(),
        "the claim of another port bound: {s:?}"
    );
    println!(
        "e2e: claim of port {other} Pending, claim of port {port} Bound to {MACHINE} ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
}

/// Against the real watcher after the real registration: the
/// machine's script and token cpio, asked for again once the agent
/// registered, give nothing usable: another host gets 403; even the
/// address leased to the MAC (added on br0 now that the VM is done) gets
/// 410 and no cpio. The old bootd served the script (200) to any address,
/// with `anneal.token=` on its kernel line while the token was unused.
async fn replayed_fetches_get_nothing(lab: &Lab) {
    let mac = MAC.replace(':', "-");
    let fetch = |from: &str, what: &str| {
        let out = lab
            .ns
            .exec("curl")
            .args([
                "-sS",
                "--max-time",
                "5",
                "-w",
                "\n%{http_code}",
                "--interface",
                from,
            ])
            .arg(format!("http://{}:8080/{what}/{mac}", e2e::SERVER_IP))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    for what in ["ipxe", "token"] {
        let s = fetch(e2e::SERVER_IP, what);
        assert!(s.ends_with("\n403"), "{what} from {}: {s}", e2e::SERVER_IP);
        assert!(
            s.contains(e2e::ADDRESS),
            "the refusal names the leased address: {s}"
        );
    }
    lab.ns
        .ip(&["addr", "add", &format!("{}/32", e2e::ADDRESS), "dev", "br0"])
        .unwrap();
    for what in ["ipxe", "token"] {
        // the watcher rebuilds on the Machine's status write that removed
        // the token's hash; by now it has, but poll rather than assume
        let s = anneal_tests::eventually(
            &format!("{what} from the leased address refused as spent"),
            Duration::from_secs(20),
            || async {
                let s = fetch(e2e::ADDRESS, what);
                if s.ends_with("\n410") { Ok(s) } else { Err(s) }
            },
        )
        .await;
        assert!(
            s.contains("re-arm") && !s.contains("#!ipxe") && !s.contains("run/anneal/token"),
            "{what} replayed from {}: {s}",
            e2e::ADDRESS
        );
    }
    println!(
        "e2e: replayed script and token fetches: 403 from another host, 410 from the leased address"
    );
}

/// Secure Boot (docs/bootd.md, "Secure Boot"): a machine whose firmware
/// enforces Secure Boot with the Microsoft keys boots the agent through
/// Debian's signed shim, signed network GRUB and signed kernel (`bootLoader:
/// shim`), with our initramfs, and the agent reports Secure Boot on. Then the
/// Secure Boot test OS (`testos::test_os_secure_boot`: Debian's signed shim,
/// GRUB and kernel on its ESP) is deployed: install-removable-fallback puts
/// shim first, as `\EFI\BOOT\BOOTX64.EFI` with GRUB beside it, the efibootmgr
/// entry points there, and the firmware, still enforcing, boots the deployed
/// OS through its own shim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_boot_machine_boots_through_shim_is_inspected_and_deployed() {
    let os = tokio::task::spawn_blocking(anneal_tests::testos::test_os_secure_boot);
    let mut lab = Lab::start_with(
        &|s| println!("e2e-sb: {s}"),
        e2e::LabOptions {
            secure_boot: true,
            deploy: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let os = os.await.unwrap().unwrap();
    let _server = lab
        .serve_and_import(&[("testos-sb", &os.image, true)], Duration::from_secs(900))
        .await
        .unwrap();
    lab.launch_vm().await.unwrap();
    lab.enrol().await.unwrap();
    let res = lab
        .wait_available(Duration::from_secs(300), &mut |p| {
            if let Progress::State(s, t) = p {
                println!("e2e-sb: state {s:?} at {:.1} s", t.as_secs_f64());
            }
        })
        .await;
    let console = lab.console();
    match res {
        Ok(t) => println!(
            "e2e-sb: QEMU launch → Machine Available in {:.1} s",
            t.as_secs_f64()
        ),
        Err(e) => panic!("{e:#}\nconsole:\n{}", e2e::tail(&console, 60)),
    }
    // the chain it took: GRUB ran bootd's configs, the kernel found Secure
    // Boot enforced
    assert!(
        console.contains("anneal: GRUB on "),
        "{}",
        e2e::tail(&console, 80)
    );
    assert!(
        console.contains(&format!("anneal: booting default/{MACHINE}")),
        "{}",
        e2e::tail(&console, 80)
    );
    assert!(
        console.contains("Secure boot enabled"),
        "{}",
        e2e::tail(&console, 80)
    );
    let hw = lab.hardware().await.unwrap().expect("MachineHardware");
    let fw = hw
        .spec
        .firmware
        .as_ref()
        .expect("firmware in the inventory");
    assert!(fw.secure_boot, "{}", e2e::summary(&hw));
    println!("e2e-sb: {}", e2e::summary(&hw));

    // deployed; the firmware, still enforcing, boots it through its shim
    lab.deploy_and_boot("testos-sb", "e2e-sb", &os.marker_sha256)
        .await;
    let console = lab.console();
    let deployed = console
        .rsplit_once("install-removable-fallback")
        .map_or("", |(_, after)| after);
    for want in [
        // the deployed ESP's own chain, not bootd's network GRUB
        "anneal test OS: GRUB under shim",
        // the firmware still enforcing: the kernel's EFI stub and lockdown
        "EFI stub: UEFI Secure Boot is enabled.",
        "Kernel is locked down from EFI Secure Boot",
    ] {
        assert!(
            deployed.contains(want),
            "after the deploy the console lacks {want:?}:\n{}",
            e2e::tail(&console, 80)
        );
    }
    assert!(
        console.contains(
            r"install-removable-fallback: \EFI\debian\shimx64.efi -> \EFI\BOOT\BOOTX64.EFI"
        ),
        "shim is not the removable loader:\n{}",
        e2e::tail(&console, 120)
    );
    assert_eq!(lab.anneal_boot_entry().unwrap(), r"\EFI\BOOT\BOOTX64.EFI");
}
