//! Boot tokens (docs/api.md, "Agent protocol"), in VMs: "a boot with a wrong,
//! expired or reused token stops with one clear console line and no
//! registration; a CA fingerprint mismatch refuses the connection".
//!
//! The real static agent in our initramfs is booted directly (-kernel/-initrd
//! on OVMF under TCG, the kernel command line of docs/api.md) against the real
//! manager: the Machine controller mints the boot tokens (Secret
//! `<machine>-boot-token`, hash and expiry in `status.netBoot`) and the HTTPS
//! agent API checks them, on a real kube-apiserver; the API listens on host
//! loopback and is relayed into the test namespace at 10.77.0.1:8443. Four
//! boots run side by side, one per case:
//!
//! - wrong: `anneal.token` is the valid, unused token of *another* Machine
//!   (so also a token bound to the wrong machine);
//! - expired: the Machine's token with `status.netBoot.expiresAt` in the past
//!   (the Machine paused so the controller does not re-arm it first);
//! - reused: the Machine's token after a successful registration with it
//!   (the agent's own client library, from the host);
//! - CA mismatch: the Machine's valid token with `anneal.ca` the SHA-256 of
//!   the CA's PEM text instead of its DER (a plausible operator mistake).
//!
//! Each VM must print exactly one `FAILED:` line naming the cause and what
//! to check, never the token, register nothing (every Machine's status as
//! before, no MachineHardware), make no further attempt, and reboot after
//! the agent's delay (the guest's reboot ends QEMU, `-no-reboot`). The
//! manager must see exactly one refused registration per token case and,
//! for the CA case, only a refused TLS handshake: the token never reached
//! it, so it still registers afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anneal_tests::{agent_vm, artifacts};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anneal_agent::client::AgentClient as RealAgent;
use anneal_agent::cmdline::{ApiUrl, CaPin};
use anneal_api::agent::{RegisterRequest, Token};
use anneal_api::{Machine, MachineHardware};
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_manager::lifecycle::status::{time_in, token_hash};
use anneal_testinfra::{ControlPlane, Netns, Vm, debian_kernel, process_alive};
use anneal_tests::eventually;
use anneal_tests::lifecycle::*;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};

/// One boot: the Machine it speaks for and what its console must say.
struct Case {
    machine: &'static str,
    mac: &'static str,
    /// Substrings of the one `FAILED:` line.
    want: &'static [&'static str],
}

const WRONG: Case = Case {
    machine: "tok-wrong",
    mac: "52:54:00:a7:00:01",
    want: &[
        "FAILED: registration: boot token rejected",
        "HTTP 401 (InvalidToken)",
        "check: ",
        "anneal.token must be",
    ],
};
const EXPIRED: Case = Case {
    machine: "tok-expired",
    mac: "52:54:00:a7:00:02",
    want: &[
        "FAILED: registration: boot token rejected",
        "HTTP 401 (ExpiredToken)",
        "check: the boot token expired",
        "re-arm",
    ],
};
const REUSED: Case = Case {
    machine: "tok-reused",
    mac: "52:54:00:a7:00:03",
    want: &[
        "FAILED: registration: boot token rejected",
        "HTTP 401 (InvalidToken)",
        "check: ",
        "single use",
    ],
};
const CA: Case = Case {
    machine: "tok-ca",
    mac: "52:54:00:a7:00:04",
    want: &[
        "FAILED: registration: CA fingerprint mismatch",
        "given as anneal.ca",
        "check: anneal.ca against the manager's CA",
        "DER form",
    ],
};
/// The Machine whose token the "wrong" boot presents.
const OTHER: &str = "tok-other";
const OTHER_MAC: &str = "52:54:00:a7:00:ff";
/// Agent reboot delay (init::REBOOT_DELAY) plus slack for a loaded host.
const REBOOT_WITHIN: Duration = Duration::from_secs(30 + 60);

fn lines_with<'a>(text: &'a str, needle: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.contains(needle)).collect()
}

async fn status_of(machines: &Api<Machine>, name: &str) -> serde_json::Value {
    machine_json(machines, name).await["status"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_tokens_and_a_wrong_ca_stop_the_agent_in_a_vm() {
    let t0 = Instant::now();
    let logs = capture_logs();
    let kernel = debian_kernel().unwrap();
    let ns = Netns::create("agtok").unwrap();
    let dir = ns.dir();
    let build = tokio::task::spawn_blocking({
        let dir = dir.clone();
        let modules = kernel.modules.clone();
        move || {
            let agent = artifacts::agent_musl();
            let tool = artifacts::initramfs_tool();
            let initrd = dir.join("agent.cpio.zst");
            artifacts::build_initramfs(&tool, &agent, &modules, &initrd);
            initrd
        }
    });

    // The real manager: Machine controller + agent API, on a real API server.
    let cp = ControlPlane::start().await.unwrap();
    let client = prepare(&cp, &[]).await;
    let manager = Manager::start(
        cp.kubeconfig_path(),
        LifecycleConfig {
            boot_token_lifetime: Duration::from_secs(900),
            // the BMCs of the tests speak plain HTTP (redfish+http://)
            allow_insecure_bmc: true,
            ..LifecycleConfig::default()
        },
        AgentApiConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            namespace: "anneal-system".into(),
            server_names: vec![anneal_testinfra::BRIDGE_IP.into(), "127.0.0.1".into()],
            long_poll: Duration::from_secs(2),
            ..AgentApiConfig::default()
        },
    );
    let _forward = ns
        .forward_tcp(SocketAddr::from(([10, 77, 0, 1], 8443)), manager.api_addr)
        .unwrap();
    let _dhcp = agent_vm::dnsmasq(&ns);
    let pin = manager.ca_sha256.clone();
    // `sha256sum ca.crt` of the PEM file: the digest of the wrong bytes.
    let wrong_pin = token_hash(&manager.ca_pem);
    assert_ne!(wrong_pin, pin);

    // Five Machines without a BMC: the controller arms each (token Secret,
    // hash and expiry in status) and powers nothing.
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let all = [
        (WRONG.machine, WRONG.mac),
        (OTHER, OTHER_MAC),
        (EXPIRED.machine, EXPIRED.mac),
        (REUSED.machine, REUSED.mac),
        (CA.machine, CA.mac),
    ];
    for (name, mac) in all {
        machines
            .create(&PostParams::default(), &machine(name, mac, None))
            .await
            .unwrap();
    }
    let mut tokens = BTreeMap::new();
    for (name, _) in all {
        let t = eventually("boot token", Duration::from_secs(60), || async {
            armed_boot_token(&client, name).await
        })
        .await;
        tokens.insert(name, t);
    }

    // Expired: hold the controller off, then move the expiry into the past.
    machines
        .patch(
            EXPIRED.machine,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"annotations": {"anneal.dev/paused": "true"}}
            })),
        )
        .await
        .unwrap();
    let past = time_in(Timestamp::now(), -60_000);
    machines
        .patch_status(
            EXPIRED.machine,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"netBoot": {"expiresAt": past}}})),
        )
        .await
        .unwrap();

    // Reused: a successful registration consumes the token first.
    let url = format!("https://127.0.0.1:{}", manager.api_addr.port());
    let register_from_host = |machine: &'static str, mac: &'static str, token: String| {
        let url = url.clone();
        let pin = pin.clone();
        tokio::task::spawn_blocking(move || {
            let mut agent =
                RealAgent::new(ApiUrl::parse(&url).unwrap(), CaPin::parse(&pin).unwrap()).unwrap();
            agent.register(&RegisterRequest {
                boot_token: Token::new(token),
                boot_mac: mac.into(),
                agent_version: "host".into(),
                machine: Some(format!("default/{machine}")),
            })
        })
    };
    let reg = register_from_host(REUSED.machine, REUSED.mac, tokens[REUSED.machine].clone())
        .await
        .unwrap()
        .expect("the first registration with the token succeeds");
    assert_eq!(reg.machine.name, REUSED.machine);
    eventually(
        "AgentRegistered on tok-reused",
        Duration::from_secs(30),
        || {
            let machines = machines.clone();
            async move {
                let m = machine_json(&machines, REUSED.machine).await;
                (cond(&m, "AgentRegistered").map(|c| c.0) == Some("True".into())).then_some(())
            }
        },
    )
    .await;
    // The state the controller converges to before the boots: tok-reused
    // registered (its token consumed: no hash left in status), every other
    // Machine armed (token hash in status) and waiting for its agent.
    eventually(
        "four Machines armed and waiting, tok-reused registered with its token consumed",
        Duration::from_secs(30),
        || async {
            for (name, _) in all {
                let m = machine_json(&machines, name).await;
                let reused = name == REUSED.machine;
                let want = if reused { "True" } else { "False" };
                let registered = cond(&m, "AgentRegistered").map(|c| c.0);
                if m["status"]["netBoot"]["tokenHash"].is_string() == reused
                    || registered.as_deref() != Some(want)
                {
                    return Err(format!("{name}: {}", m["status"]));
                }
            }
            Ok(())
        },
    )
    .await;

    let mut before = BTreeMap::new();
    for (name, _) in all {
        before.insert(name, status_of(&machines, name).await);
    }
    assert!(before[EXPIRED.machine]["netBoot"]["tokenHash"].is_string());
    assert!(before[REUSED.machine]["netBoot"]["tokenHash"].is_null());
    assert!(before[CA.machine]["netBoot"]["tokenHash"].is_string());

    let initrd = build.await.unwrap();
    let log_mark = logs.text().len();
    let setup = t0.elapsed();

    // The four boots, side by side.
    let boots = [
        (&WRONG, tokens[OTHER].clone(), pin.clone()),
        (&EXPIRED, tokens[EXPIRED.machine].clone(), pin.clone()),
        (&REUSED, tokens[REUSED.machine].clone(), pin.clone()),
        (&CA, tokens[CA.machine].clone(), wrong_pin.clone()),
    ];
    let mut running = Vec::new();
    for (case, token, ca) in &boots {
        let append = format!(
            "console=ttyS0 panic=-1 quiet anneal.api=https://10.77.0.1:8443 anneal.ca={ca} \
             anneal.token={token} anneal.machine=default/{} BOOTIF={}",
            case.machine,
            agent_vm::bootif(case.mac)
        );
        let mut vm =
            agent_vm::launch_agent_vm(&ns, &kernel.vmlinuz, &initrd, case.mac, 1, 512, append);
        running.push(tokio::spawn(async move {
            let stopped = vm
                .wait_for_line(r"anneal: rebooting in \d+ s", Duration::from_secs(300))
                .await;
            let at = vm.uptime();
            (vm, stopped, at)
        }));
    }
    let mut vms: Vec<Vm> = Vec::new();
    for (handle, (case, _, _)) in running.into_iter().zip(&boots) {
        let (vm, stopped, at) = handle.await.unwrap();
        if let Err(e) = stopped {
            panic!("{}: {e:#}", case.machine);
        }
        println!(
            "{}: agent stopped {:.1} s after QEMU start",
            case.machine,
            at.as_secs_f64()
        );
        vms.push(vm);
    }
    // No further attempt: each agent sleeps, then reboots (QEMU exits).
    let deadline = Instant::now() + REBOOT_WITHIN;
    for (vm, (case, _, _)) in vms.iter().zip(&boots) {
        while process_alive(vm.pid()) {
            assert!(
                Instant::now() < deadline,
                "{}: no reboot after the failure:\n{}",
                case.machine,
                vm.serial_text()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    let boots_took = t0.elapsed() - setup;

    // The consoles.
    for (vm, (case, _, _)) in vms.iter().zip(&boots) {
        let console = vm.serial_text();
        println!("----- {} -----\n{console}", case.machine);
        let failed = lines_with(&console, "FAILED");
        assert_eq!(
            failed.len(),
            1,
            "{}: exactly one FAILED line wanted:\n{console}",
            case.machine
        );
        for want in case.want {
            assert!(
                failed[0].contains(want),
                "{}: {want:?} not in {:?}",
                case.machine,
                failed[0]
            );
        }
        assert!(
            console.contains("anneal: DHCP lease 10.77.0."),
            "{}: the network came up first",
            case.machine
        );
        for (name, token) in &tokens {
            assert!(
                !console.contains(token.as_str()),
                "{}: the token of {name} reached the console",
                case.machine
            );
        }
        // After the failure: the worker's exit and the reboot notice only.
        let after: Vec<&str> = console
            .lines()
            .skip_while(|l| !l.contains("FAILED"))
            .skip(1)
            .filter(|l| l.contains("anneal: "))
            .collect();
        assert_eq!(after.len(), 2, "{}: {after:#?}", case.machine);
        assert!(after[0].contains("agent worker exited with status 1"));
        assert!(after[1].contains("rebooting in 30 s"));
        for bad in ["registered as", "retrying", "attempt"] {
            assert!(
                !console.contains(bad),
                "{}: {bad:?} on the console",
                case.machine
            );
        }
    }

    // The manager: one refused registration per token case, only a refused
    // handshake for the CA case, no registration at all.
    let log = logs.text()[log_mark..].to_string();
    let requests = lines_with(&log, "agent api request");
    assert_eq!(requests.len(), 3, "{requests:#?}");
    for r in &requests {
        assert!(
            r.contains("path=/v1/agent/register") && r.contains("status=401"),
            "{r}"
        );
    }
    assert_eq!(
        lines_with(&log, "register refused: unknown or used boot token").len(),
        2,
        "wrong + reused"
    );
    let expired = lines_with(&log, "register refused: boot token expired");
    assert_eq!(expired.len(), 1, "{expired:#?}");
    assert!(expired[0].contains(EXPIRED.machine), "{}", expired[0]);
    let refused_tls = lines_with(&log, "tls handshake refused");
    assert_eq!(refused_tls.len(), 1, "the CA case: {refused_tls:#?}");
    assert!(lines_with(&log, "agent registered").is_empty(), "{log}");
    for (name, token) in &tokens {
        assert!(
            !log.contains(token.as_str()),
            "the token of {name} was logged"
        );
    }

    // Nothing registered: every Machine's status as before, no hardware.
    let hw: Api<MachineHardware> = Api::namespaced(client.clone(), "default");
    for (name, _) in all {
        assert_eq!(
            status_of(&machines, name).await,
            before[name],
            "{name}: status changed"
        );
        assert!(
            hw.get_opt(name).await.unwrap().is_none(),
            "{name}: hardware"
        );
    }
    // The CA case's token never left the VM: it still registers (once).
    let reg = register_from_host(CA.machine, CA.mac, tokens[CA.machine].clone())
        .await
        .unwrap()
        .expect("the CA case's token is still unused");
    assert_eq!(reg.machine.name, CA.machine);
    // And the "wrong" token was still good for the machine it belongs to.
    let reg = register_from_host(OTHER, OTHER_MAC, tokens[OTHER].clone())
        .await
        .unwrap()
        .expect("the other machine's token is still unused");
    assert_eq!(reg.machine.name, OTHER);

    println!(
        "agent_tokens: set-up {:.1} s, four boots to their reboot {:.1} s, total {:.1} s",
        setup.as_secs_f64(),
        boots_took.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}
