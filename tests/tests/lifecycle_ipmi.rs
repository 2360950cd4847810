//! The Machine lifecycle walk of lifecycle_walk.rs through the IPMI driver
//! (docs/lifecycle.md, "BMC access and failures"): a real control plane, a
//! QEMU VM (paused, `-S`) behind Debian's ipmi_sim whose chassis control
//! drives it over QMP, and a test client standing in for the agent. Enrolment,
//! the one-time PXE boot flags then the power-on, registration, Available with
//! MachineHardware, the power-off over IPMI. Beside it, the retry cadences
//! Redfish has in lifecycle_faults.rs, measured on the wire: a BMC that does
//! not answer (BMCUnreachable) gets a burst of 3 sends within the BMC timeout
//! every 15 s; a wrong password (CredentialsRejected, a second ipmi_sim behind
//! a counting relay) is not retried (its cadence is 300 s) until the Secret is
//! fixed, which retries at once and powers that machine on with PXE once.
//! Every message names its BMC.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use anneal_api::{Machine, MachineHardware};
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::ipmi::ATTEMPTS;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_manager::redfish::PowerState;
use anneal_testinfra::{ControlPlane, Netns};
use anneal_tests::bmc::*;
use anneal_tests::eventually;

/// The boot MAC of ipmi-a's VM and Machine.
const MAC_A: &str = "52:54:00:7f:16:01";
use anneal_tests::lifecycle::*;
use hyper::Method;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_walk_over_ipmi() {
    let t0 = Instant::now();
    let ns = Netns::create("anlip").unwrap();
    let dir_w = tempfile::Builder::new()
        .prefix("anneal-ipmi-w-")
        .tempdir()
        .unwrap();
    let (cp, ipmivm, (sim_w, sim_w_addr)) = tokio::join!(
        ControlPlane::start(),
        IpmiVm::launch(&ns, MAC_A),
        ipmi_sim_alone(dir_w.path())
    );
    let cp = cp.unwrap();
    // ipmi-w's BMC: the second ipmi_sim behind a relay counting sessions;
    // ipmi-u's: a socket that never answers.
    let tap_w = UdpTap::start(Some(sim_w_addr)).await;
    let silent = UdpTap::start(None).await;
    let client = prepare(
        &cp,
        &[("bmc-i", BMC_PASSWORD), ("bmc-wrong", "not-the-password")],
    )
    .await;
    let lc = LifecycleConfig {
        boot_token_lifetime: Duration::from_secs(45),
        graceful_shutdown_timeout: Duration::from_secs(2),
        bmc_timeout: Duration::from_secs(3),
        health_interval: Duration::from_secs(5),
        // ipmi:// is not plain HTTP: no --allow-insecure-bmc needed
        allow_insecure_bmc: false,
        ..LifecycleConfig::default()
    };
    let api_cfg = AgentApiConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        namespace: "anneal-system".into(),
        server_names: vec!["127.0.0.1".into(), "localhost".into()],
        session_ttl: Duration::from_secs(600),
        session_renew_after: Duration::from_secs(300),
        long_poll: Duration::from_secs(3),
        fast_track_window: None,
    };
    let mut manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), "default");
    for (name, mac, address, secret) in [
        ("ipmi-a", MAC_A, ipmivm.address(), "bmc-i"),
        ("ipmi-w", "52:54:00:7f:16:02", tap_w.address(), "bmc-wrong"),
        ("ipmi-u", "52:54:00:7f:16:03", silent.address(), "bmc-i"),
    ] {
        machines
            .create(
                &PostParams::default(),
                &machine(name, mac, Some((&address, secret))),
            )
            .await
            .unwrap();
    }

    // Enrolling → Inspecting: token minted, one-time PXE, power on.
    let token = eventually("ipmi-a armed", Duration::from_secs(60), || async {
        let m = machine_json(&machines, "ipmi-a").await;
        if m["status"]["state"] == "Inspecting" && m["status"]["netBoot"]["tokenHash"].is_string() {
            armed_boot_token(&client, "ipmi-a").await
        } else {
            None
        }
    })
    .await;
    println!("ipmi-a armed after {:.1} s", t0.elapsed().as_secs_f64());
    // the chassis control ran the QMP hook: the VM was reset
    let calls = eventually("ipmi-a's VM booted", Duration::from_secs(30), || async {
        let c = ipmivm.sim.calls();
        if c.iter().any(|l| l.starts_with("vm boot")) {
            Ok(c)
        } else {
            Err(c)
        }
    })
    .await;
    let boot = calls.iter().position(|c| c == "set boot pxe");
    let on = calls.iter().position(|c| c == "set power 1");
    assert!(
        boot.is_some() && on.is_some() && boot < on,
        "pxe once before power-on: {calls:?}"
    );
    // the VM was reset with its NIC first in the firmware's boot order
    assert_eq!(
        calls.get(on.unwrap() + 1).map(String::as_str),
        Some("vm boot network"),
        "{calls:?}"
    );
    assert!(ipmivm.running().await, "the VM runs after the power-on");
    let ipmi = ipmivm.client(BMC_PASSWORD);
    assert_eq!(ipmi.power_state().await.unwrap(), PowerState::On);

    // The other two: classified, naming their BMC, nothing switched.
    let m = eventually(
        "ipmi-w CredentialsRejected",
        Duration::from_secs(60),
        || async {
            let m = machine_json(&machines, "ipmi-w").await;
            (cond(&m, "BMCReachable") == Some(("False".into(), "CredentialsRejected".into())))
                .then_some(m)
        },
    )
    .await;
    let rejected_at = Instant::now();
    let opens_rejected = tap_w.open_session_requests().len();
    let msg = bmc_message(&m);
    assert!(
        msg.contains(&tap_w.addr.to_string()) && msg.contains("password"),
        "{msg}"
    );
    assert!(opens_rejected >= 1, "the wrong password was never tried");
    let m = eventually("ipmi-u BMCUnreachable", Duration::from_secs(60), || async {
        let m = machine_json(&machines, "ipmi-u").await;
        (cond(&m, "BMCReachable") == Some(("False".into(), "BMCUnreachable".into()))).then_some(m)
    })
    .await;
    let msg = bmc_message(&m);
    assert!(msg.contains(&silent.addr.to_string()), "{msg}");

    // Registration, hardware, Available.
    let agent = AgentClient::new(manager.api_addr, &manager.ca_pem);
    // from the Machine's boot MAC: register checks it (docs/api.md, "Agent
    // protocol")
    let (code, reg) = agent
        .register_as(&token, Some("default/ipmi-a"), MAC_A)
        .await;
    assert_eq!(code, 200, "{reg}");
    let session = reg["sessionToken"].as_str().unwrap().to_string();
    let (code, _) = agent
        .call(
            Method::PUT,
            anneal_api::agent::paths::HARDWARE,
            Some(&session),
            Some("1"),
            Some(sample_hardware()),
        )
        .await;
    assert_eq!(code, 204);
    let hw: Api<MachineHardware> = Api::namespaced(client.clone(), "default");
    assert_eq!(
        hw.get("ipmi-a").await.unwrap().owner_references()[0].name,
        "ipmi-a"
    );
    eventually("ipmi-a Available", Duration::from_secs(60), || async {
        (machine_json(&machines, "ipmi-a").await["status"]["state"] == "Available").then_some(())
    })
    .await;

    // Powered off over IPMI: the soft shutdown (the chassis honours it).
    eventually("VM off over IPMI", Duration::from_secs(60), || async {
        (ipmi.power_state().await.ok() == Some(PowerState::Off)).then_some(())
    })
    .await;
    assert!(!ipmivm.running().await, "the VM is stopped");
    let calls = ipmivm.sim.calls();
    assert!(
        calls.iter().any(|c| c == "set shutdown 1"),
        "soft shutdown: {calls:?}"
    );
    let m = eventually(
        "ipmi-a status.poweredOn false",
        Duration::from_secs(60),
        || async {
            let m = machine_json(&machines, "ipmi-a").await;
            if m["status"]["poweredOn"] == false {
                Ok(m)
            } else {
                Err(m["status"].clone())
            }
        },
    )
    .await;
    assert_eq!(cond(&m, "BMCReachable").unwrap().0, "True", "{m}");
    assert_eq!(cond(&m, "AgentRegistered").unwrap().0, "True", "{m}");
    // The refused and the silent BMC switched nothing: one power-on only.
    let ons = calls.iter().filter(|c| *c == "set power 1").count();
    assert_eq!(ons, 1, "{calls:?}");
    println!(
        "ipmi-a Available and off after {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    // --- unreachable cadence: 3 sends within the timeout, every 15 s -------
    let opens = eventually(
        "three session attempts on the silent BMC",
        Duration::from_secs(90),
        || async {
            let t = silent.open_session_requests();
            if t.len() >= 3 * ATTEMPTS as usize {
                Ok(t)
            } else {
                Err(t.len())
            }
        },
    )
    .await;
    let tries = bursts(&opens, Duration::from_secs(5));
    let spans: Vec<f64> = tries
        .iter()
        .map(|b| (*b.last().unwrap() - b[0]).as_secs_f64())
        .collect();
    let gaps: Vec<f64> = tries
        .windows(2)
        .map(|w| (w[1][0] - *w[0].last().unwrap()).as_secs_f64())
        .collect();
    println!(
        "ipmi unreachable: sends per attempt {:?}, spans {spans:?} s, quiet gaps {gaps:?} s",
        tries.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert_eq!(tries.len(), 3, "session attempts: {tries:?}");
    assert!(
        tries.iter().all(|b| b.len() == ATTEMPTS as usize),
        "each attempt sends {ATTEMPTS} times: {tries:?}"
    );
    // the sends of one attempt fit in the BMC timeout (3 s)
    assert!(spans.iter().all(|s| *s < 3.0), "{spans:?}");
    // Never sooner than the 15 s cadence; later only by scheduling delay
    // (generous for a loaded machine, below a skipped retry's 30 s).
    assert!(
        gaps.iter().all(|g| (14.5..30.0).contains(g)),
        "unreachable retries not every 15 s: {gaps:?}"
    );

    // --- wrong password: not retried until the Secret is fixed --------------
    // Since the rejection, longer than the unreachable cadence (two of its
    // retries) passed with no session attempt: CredentialsRejected waits
    // 300 s (and a BMC may lock the user out after failed logins).
    let quiet_for = rejected_at.elapsed();
    assert!(quiet_for > Duration::from_secs(20), "{quiet_for:?}");
    assert_eq!(
        tap_w.open_session_requests().len(),
        opens_rejected,
        "the wrong password was retried within {quiet_for:?}"
    );
    let m = machine_json(&machines, "ipmi-w").await;
    assert_eq!(
        cond(&m, "BMCReachable"),
        Some(("False".into(), "CredentialsRejected".into())),
        "{m}"
    );
    assert!(sim_w.calls().is_empty(), "{:?}", sim_w.calls());
    let fixed = Instant::now();
    secrets
        .patch(
            "bmc-wrong",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"stringData": {"password": BMC_PASSWORD}})),
        )
        .await
        .unwrap();
    eventually(
        "ipmi-w recovers on the secret edit",
        Duration::from_secs(60),
        || async {
            let m = machine_json(&machines, "ipmi-w").await;
            (cond(&m, "BMCReachable").map(|c| c.0) == Some("True".into())).then_some(())
        },
    )
    .await;
    let took = fixed.elapsed();
    println!(
        "ipmi-w: no retry for {:.1} s after CredentialsRejected, recovered {:.2} s after the secret edit",
        quiet_for.as_secs_f64(),
        took.as_secs_f64()
    );
    assert!(tap_w.open_session_requests().len() > opens_rejected);
    // and then ipmi-w is armed like ipmi-a: PXE once, then power on
    let calls = eventually("ipmi-w powered on", Duration::from_secs(60), || async {
        let c = sim_w.calls();
        if c.iter().any(|c| c == "set power 1") {
            Ok(c)
        } else {
            Err(c)
        }
    })
    .await;
    let boot = calls.iter().position(|c| c == "set boot pxe");
    let on = calls.iter().position(|c| c == "set power 1");
    assert!(
        boot.is_some() && boot < on,
        "pxe once before power-on: {calls:?}"
    );
    println!(
        "lifecycle over ipmi done after {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    manager.kill();
    sim_w.stop();
}

fn bmc_message(m: &serde_json::Value) -> String {
    m["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == "BMCReachable"))
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}
