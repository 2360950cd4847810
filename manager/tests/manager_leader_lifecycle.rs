//! Two manager replicas (real processes) with the Machine lifecycle on, one
//! BMC (anneal-qemu-bmc in front of a paused QEMU VM) logging every request
//! with its User-Agent (which names the calling replica):
//!
//! - only the Lease holder calls the BMC and arms the Machine (one boot
//!   token, one one-time PXE override, one power-on);
//! - the leader is SIGKILLed; the follower takes the Lease within the lease
//!   duration (plus one retry period) and carries on without arming the
//!   armed Machine again (same token hash, same boot-token Secret), and
//!   arms a new Machine itself;
//! - SIGTERM stops the survivor cleanly (exit status 0).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anneal_api::Machine;
use anneal_qemu_bmc::{BmcConfig, LogEntry};
use anneal_testinfra::{ChildGroup, ControlPlane, Vm, VmConfig, process_alive};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};
use serde_json::json;

const LEASE_SECS: u64 = 3;
const RENEW_SECS: u64 = 1;
const BMC_USER: &str = "admin";
const BMC_PASSWORD: &str = "leader-test-pw";

fn replica(cp: &ControlPlane, id: &str) -> ChildGroup {
    let metrics = anneal_testinfra::free_port().unwrap();
    let agent = anneal_testinfra::free_port().unwrap();
    let log = std::fs::File::create(cp.dir().join(format!("manager-{id}.log"))).unwrap();
    ChildGroup::spawn(
        id,
        Command::new(env!("CARGO_BIN_EXE_manager"))
            .args([
                "run",
                "--identity",
                id,
                "--lease-duration-secs",
                &LEASE_SECS.to_string(),
                "--renew-secs",
                &RENEW_SECS.to_string(),
                "--metrics-addr",
                &format!("127.0.0.1:{metrics}"),
                "--agent-api-listen",
                &format!("127.0.0.1:{agent}"),
                "--manager-namespace",
                "anneal-system",
                // the test's BMC speaks plain HTTP (redfish+http://)
                "--allow-insecure-bmc",
            ])
            .env("KUBECONFIG", cp.kubeconfig_path())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log),
    )
    .unwrap()
}

/// Waits (on a watch) until the Lease is held by someone `accept`s.
async fn lease_held_by(
    client: &Client,
    timeout: Duration,
    accept: impl Fn(&str) -> bool,
) -> String {
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let cond = move |l: Option<&Lease>| {
        l.and_then(|l| l.spec.as_ref()?.holder_identity.as_deref())
            .is_some_and(&accept)
    };
    let lease = tokio::time::timeout(timeout, await_condition(leases, "anneal-manager", cond))
        .await
        .expect("lease condition not reached in time")
        .unwrap()
        .unwrap();
    lease.spec.unwrap().holder_identity.unwrap()
}

/// Waits (on a watch) until the Machine is Inspecting with a boot token
/// hash; returns the hash.
async fn armed(client: &Client, name: &str, timeout: Duration) -> String {
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let cond = |m: Option<&Machine>| {
        m.map(|m| serde_json::to_value(m).unwrap())
            .is_some_and(|v| {
                v["status"]["state"] == "Inspecting"
                    && v["status"]["netBoot"]["tokenHash"].is_string()
            })
    };
    let m = tokio::time::timeout(timeout, await_condition(machines, name, cond))
        .await
        .unwrap_or_else(|_| panic!("machine {name} not armed in time"))
        .unwrap()
        .unwrap();
    serde_json::to_value(&m).unwrap()["status"]["netBoot"]["tokenHash"]
        .as_str()
        .unwrap()
        .to_string()
}

fn machine(name: &str, bmc: &str) -> Machine {
    serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "subnetRef": {"name": "lab"},
            "bootMACAddress": "52:54:00:7f:30:01",
            "bmc": {"address": bmc, "credentialsSecretRef": {"name": "bmc-creds"}},
        }
    }))
    .unwrap()
}

fn replica_of(e: &LogEntry) -> String {
    e.user_agent
        .as_deref()
        .and_then(|ua| ua.split_once('(')?.1.strip_suffix(')'))
        .unwrap_or("<no identity>")
        .to_string()
}

fn one_time_pxe(log: &[LogEntry]) -> usize {
    log.iter()
        .filter(|e| e.method == "PATCH" && e.action.as_deref() == Some("Boot=Once/Pxe"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_calls_the_bmc_and_arms_once() {
    let t0 = Instant::now();
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let nss: Api<Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "anneal-system"}})).unwrap(),
    )
    .await
    .unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "default");
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "bmc-creds"},
                "stringData": {"username": BMC_USER, "password": BMC_PASSWORD},
            }))
            .unwrap(),
        )
        .await
        .unwrap();

    // A VM that stays paused until the BMC powers it on; no NIC, no disk.
    let vm = Vm::launch(
        &VmConfig {
            memory_mib: 256,
            cpus: 1,
            extra_args: vec!["-S".into(), "-no-shutdown".into()],
            no_reboot: false,
            ..VmConfig::default()
        },
        None,
    )
    .unwrap();
    let dir = tempfile::Builder::new()
        .prefix("anneal-leader-bmc-")
        .tempdir()
        .unwrap();
    let request_log = dir.path().join("requests.jsonl");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !vm.qmp_path().exists() {
        assert!(Instant::now() < deadline, "QEMU made no QMP socket");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bmc = anneal_qemu_bmc::start(BmcConfig {
        listen: ([127, 0, 0, 1], 0).into(),
        qmp: vm.qmp_path().to_path_buf(),
        state_file: dir.path().join("bmc-state.json"),
        request_log: Some(request_log.clone()),
        username: BMC_USER.into(),
        password: BMC_PASSWORD.into(),
        system_id: "vm0".into(),
        tls: None,
    })
    .await
    .unwrap();
    let bmc_address = format!("redfish+http://127.0.0.1:{}", bmc.addr().port());

    let mut a = replica(&cp, "replica-a");
    let mut b = replica(&cp, "replica-b");
    let leader = lease_held_by(&client, Duration::from_secs(60), |_| true).await;
    let follower = if leader == "replica-a" {
        "replica-b"
    } else {
        "replica-a"
    };
    println!("leader {leader} at {:.1} s", t0.elapsed().as_secs_f64());

    // The leader arms m1: one token, one one-time PXE override, power on.
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    machines
        .create(&PostParams::default(), &machine("m1", &bmc_address))
        .await
        .unwrap();
    let hash1 = armed(&client, "m1", Duration::from_secs(90)).await;
    let secret1 = secrets.get("m1-boot-token").await.unwrap();
    println!("m1 armed at {:.1} s", t0.elapsed().as_secs_f64());
    // the power-on may follow the status write that shows the arm: wait for
    // it to reach the BMC's request log (the event itself, bounded)
    let deadline = Instant::now() + Duration::from_secs(60);
    let before = loop {
        let log = anneal_qemu_bmc::read_request_log(&request_log);
        if log
            .iter()
            .any(|e| e.is_reset() && e.action.as_deref() == Some("On"))
            || Instant::now() > deadline
        {
            break log;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!before.is_empty(), "the leader never called the BMC");
    for e in &before {
        assert_eq!(
            replica_of(e),
            leader,
            "a BMC request not from the leader {leader}: {e:?}"
        );
    }
    assert_eq!(one_time_pxe(&before), 1, "one PXE override: {before:?}");
    assert!(
        before
            .iter()
            .any(|e| e.is_reset() && e.action.as_deref() == Some("On")),
        "no power-on: {before:?}"
    );

    // SIGKILL the leader; the follower takes over within the lease.
    let (killed, survivor) = if leader == "replica-a" {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    let pid = killed.pid();
    let kill_ms = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    killed.kill();
    assert!(!process_alive(pid));
    let killed_at = Instant::now();
    let leases: Api<Lease> = Api::namespaced(client.clone(), "default");
    let takeover_cond = move |l: Option<&Lease>| {
        l.and_then(|l| l.spec.as_ref()?.holder_identity.as_deref()) == Some(follower)
    };
    if tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(leases.clone(), "anneal-manager", takeover_cond),
    )
    .await
    .is_err()
    {
        // what the survivor was doing: is it alive, what did it log
        let alive = survivor.try_exit().map(|s| s.to_string());
        let log = std::fs::read_to_string(cp.dir().join(format!("manager-{follower}.log")))
            .unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(60).collect();
        let lease = leases.get_opt("anneal-manager").await.ok().flatten();
        panic!(
            "{follower} did not take the lease within 30 s of the kill (exit: {alive:?}); \
             lease: {:?}; its log ends:\n{}",
            lease.and_then(|l| l.spec),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let new = follower.to_string();
    let takeover = killed_at.elapsed();
    println!(
        "{new} took the lease {:.1} s after the kill",
        takeover.as_secs_f64()
    );
    assert!(
        takeover <= Duration::from_secs(LEASE_SECS + 2 * RENEW_SECS + 5),
        "takeover took {takeover:?} for a {LEASE_SECS} s lease"
    );

    // The survivor arms a new machine, and leaves m1's arm alone. m2 shares
    // m1's BMC, whose VM m1's arm powered on: enrolment restarts a running
    // server only when the spec allows it (docs/lifecycle.md, Enrolling).
    let mut m2 = machine("m2", &bmc_address);
    m2.spec.restart_running_for_inspection = true;
    machines.create(&PostParams::default(), &m2).await.unwrap();
    let hash2 = armed(&client, "m2", Duration::from_secs(90)).await;
    println!("m2 armed at {:.1} s", t0.elapsed().as_secs_f64());
    assert_ne!(hash1, hash2);
    let m1 = serde_json::to_value(machines.get("m1").await.unwrap()).unwrap();
    assert_eq!(
        m1["status"]["netBoot"]["tokenHash"], hash1,
        "m1's boot token was minted again"
    );
    let secret1_now = secrets.get("m1-boot-token").await.unwrap();
    assert_eq!(
        secret1_now.resource_version(),
        secret1.resource_version(),
        "m1's boot-token Secret was written again"
    );
    // Every request came from one of the two, and the follower's only once
    // the leader was dead.
    let log = anneal_qemu_bmc::read_request_log(&request_log);
    for e in &log {
        let who = replica_of(e);
        assert!(who == leader || who == follower, "unknown caller: {e:?}");
        if who == follower {
            assert!(
                e.ts_ms >= kill_ms,
                "{follower} called the BMC while {leader} led: {e:?}"
            );
        }
    }
    assert!(
        log.iter().any(|e| replica_of(e) == follower),
        "{follower} never called the BMC: {log:?}"
    );
    assert_eq!(
        one_time_pxe(&log),
        2,
        "one PXE override per armed machine (m1 by {leader}, m2 by {follower}): {log:?}"
    );

    // SIGTERM: the survivor stops in order and exits 0.
    survivor.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = survivor.try_exit() {
            break s;
        }
        assert!(Instant::now() < deadline, "{follower} ignored SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let log = std::fs::read_to_string(cp.dir().join(format!("manager-{follower}.log"))).unwrap();
    let tail: Vec<&str> = log.lines().rev().take(40).collect();
    assert!(
        status.success(),
        "{follower} exited with {status}; its log ends:\n{}",
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
    assert!(
        log.contains("agent API stopped") && log.contains("/metrics stopped"),
        "{follower} did not stop in order"
    );
    bmc.stop().await;
    drop(vm);
}
