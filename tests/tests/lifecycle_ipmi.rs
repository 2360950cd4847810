//! The Machine lifecycle walk of lifecycle_walk.rs through the IPMI driver
//! (issue 16): a real control plane, a QEMU VM (paused, `-S`) behind
//! Debian's ipmi_sim whose chassis control drives it over QMP, and a test
//! client standing in for the agent. Enrolment, the one-time PXE boot
//! flags then the power-on, registration, Available with MachineHardware,
//! the power-off over IPMI; plus a wrong password (CredentialsRejected)
//! and a BMC that does not answer (BMCUnreachable), each naming the BMC.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use anneal_api::{Machine, MachineHardware};
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_manager::redfish::PowerState;
use anneal_testinfra::{ControlPlane, Netns};
use anneal_tests::bmc::*;
use anneal_tests::eventually;
use anneal_tests::lifecycle::*;
use hyper::Method;
use kube::ResourceExt;
use kube::api::{Api, PostParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_walk_over_ipmi() {
    let t0 = Instant::now();
    let ns = Netns::create("anlip").unwrap();
    let (cp, ipmivm) = tokio::join!(
        ControlPlane::start(),
        IpmiVm::launch(&ns, "52:54:00:7f:16:01")
    );
    let cp = cp.unwrap();
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
        long_poll: Duration::from_secs(3),
        fast_track_window: None,
    };
    let mut manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let silent_addr = format!("ipmi://{}", silent.local_addr().unwrap());
    for (name, mac, address, secret) in [
        ("ipmi-a", "52:54:00:7f:16:01", ipmivm.address(), "bmc-i"),
        ("ipmi-w", "52:54:00:7f:16:02", ipmivm.address(), "bmc-wrong"),
        ("ipmi-u", "52:54:00:7f:16:03", silent_addr.clone(), "bmc-i"),
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
            boot_token(&client, "ipmi-a").await
        } else {
            None
        }
    })
    .await;
    println!("ipmi-a armed after {:.1} s", t0.elapsed().as_secs_f64());
    let calls = ipmivm.sim.calls();
    let boot = calls.iter().position(|c| c == "set boot pxe");
    let on = calls.iter().position(|c| c == "set power 1");
    assert!(
        boot.is_some() && on.is_some() && boot < on,
        "pxe once before power-on: {calls:?}"
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
    let msg = bmc_message(&m);
    assert!(
        msg.contains(&ipmivm.addr.to_string()) && msg.contains("password"),
        "{msg}"
    );
    let m = eventually("ipmi-u BMCUnreachable", Duration::from_secs(60), || async {
        let m = machine_json(&machines, "ipmi-u").await;
        (cond(&m, "BMCReachable") == Some(("False".into(), "BMCUnreachable".into()))).then_some(m)
    })
    .await;
    let msg = bmc_message(&m);
    assert!(
        msg.contains(silent_addr.trim_start_matches("ipmi://")),
        "{msg}"
    );

    // Registration, hardware, Available.
    let agent = AgentClient::new(manager.api_addr, &manager.ca_pem);
    let (code, reg) = agent.register(&token, Some("default/ipmi-a")).await;
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
    manager.kill();
}

fn bmc_message(m: &serde_json::Value) -> String {
    m["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == "BMCReachable"))
        .and_then(|c| c["message"].as_str())
        .unwrap_or_default()
        .to_string()
}
