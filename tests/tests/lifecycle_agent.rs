//! Interoperability: the agent's own client library (the code the live
//! environment runs: CA pinning by `anneal.ca`, its HTTP/1.1 client, its
//! inventory reading a captured QEMU sysfs tree) registers with the
//! manager's agent API, reports hardware and is told to power off; the
//! Machine reaches Available with the MachineHardware the agent collected.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anneal_agent::client::{AgentClient as RealAgent, ClientError};
use anneal_agent::cmdline::{ApiUrl, CaPin};
use anneal_api::agent::{NextAction, RegisterRequest, Token};
use anneal_api::{Machine, MachineHardware};
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_testinfra::ControlPlane;
use anneal_tests::eventually;
use anneal_tests::lifecycle::*;
use kube::api::{Api, PostParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_real_agent_client_registers_reports_and_powers_off() {
    let logs = capture_logs();
    let cp = ControlPlane::start().await.unwrap();
    let client = prepare(&cp, &[]).await;
    let manager = Manager::start(
        cp.kubeconfig_path(),
        LifecycleConfig {
            boot_token_lifetime: Duration::from_secs(120),
            health_interval: Duration::from_secs(5),
            // the BMCs of the tests speak plain HTTP (redfish+http://)
            allow_insecure_bmc: true,
            ..LifecycleConfig::default()
        },
        loopback_agent_api(),
    );
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    machines
        .create(
            &PostParams::default(),
            &machine("agent-m", "52:54:00:7f:30:01", None),
        )
        .await
        .unwrap();
    let token = eventually("boot token", Duration::from_secs(60), || async {
        armed_boot_token(&client, "agent-m").await
    })
    .await;

    let url = format!("https://127.0.0.1:{}", manager.api_addr.port());
    let pin = manager.ca_sha256.clone();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/agent/sys/qemu");
    let tok = token.clone();
    let (report, reg_name, pin_err) = tokio::task::spawn_blocking(move || {
        // A wrong pin is refused by the agent before anything is sent.
        let mut wrong = RealAgent::new(
            ApiUrl::parse(&url).unwrap(),
            CaPin::parse(&"ab".repeat(32)).unwrap(),
        )
        .unwrap();
        let pin_err = wrong
            .register(&RegisterRequest {
                boot_token: Token::new(tok.clone()),
                boot_mac: "52:54:00:7f:30:01".into(),
                agent_version: "interop".into(),
                machine: Some("default/agent-m".into()),
            })
            .unwrap_err();
        let mut agent =
            RealAgent::new(ApiUrl::parse(&url).unwrap(), CaPin::parse(&pin).unwrap()).unwrap();
        let reg = agent
            .register(&RegisterRequest {
                boot_token: Token::new(tok),
                boot_mac: "52:54:00:7f:30:01".into(),
                agent_version: "interop".into(),
                machine: Some("default/agent-m".into()),
            })
            .unwrap();
        let report = anneal_agent::inventory::Root::new(fixture)
            .collect(Default::default())
            .unwrap();
        agent.put_hardware(&report).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            match agent.next(Duration::from_secs(5)).unwrap() {
                NextAction::PowerOff => break,
                NextAction::Wait { .. } => {}
                other => panic!("unexpected action {other:?}"),
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never told to power off"
            );
        }
        (report, reg.machine.name, pin_err)
    })
    .await
    .unwrap();
    assert!(
        matches!(pin_err, ClientError::CaMismatch { .. }),
        "{pin_err:?}"
    );
    assert_eq!(reg_name, "agent-m");
    assert!(!report.disks.is_empty(), "fixture has disks");

    let m = machine_json(&machines, "agent-m").await;
    assert_eq!(m["status"]["state"], "Available", "{m}");
    assert_eq!(m["status"]["agent"]["version"], "interop");
    let hw: Api<MachineHardware> = Api::namespaced(client.clone(), "default");
    let h = hw.get("agent-m").await.unwrap();
    assert_eq!(h.spec.disks.len(), report.disks.len());
    assert_eq!(
        h.spec.cpu.as_ref().unwrap().count,
        i32::try_from(report.cpu.count).unwrap()
    );
    assert_eq!(
        h.spec.memory_bytes,
        Some(i64::try_from(report.memory_bytes).unwrap())
    );
    assert!(!logs.text().contains(&token), "boot token logged");
}
