//! Two manager replicas (real processes) elect a leader on a Lease; the
//! leader is SIGKILLed while it is binding; the other takes over and no
//! machine is ever bound twice.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anneal_api::{ClaimPhase, Machine, MachineClaim};
use anneal_testinfra::{ChildGroup, ControlPlane, process_alive};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// `manager run` flags that keep the test to the claim half: the machine
/// lifecycle (agent API on a fixed port) is switched off when the binary has
/// it.
fn claim_only_flags() -> Vec<&'static str> {
    let help = Command::new(env!("CARGO_BIN_EXE_manager"))
        .args(["run", "--help"])
        .output()
        .unwrap();
    if String::from_utf8_lossy(&help.stdout).contains("--no-lifecycle") {
        vec!["--no-lifecycle"]
    } else {
        Vec::new()
    }
}

fn replica(cp: &ControlPlane, id: &str) -> ChildGroup {
    let port = anneal_testinfra::free_port().unwrap();
    let log = std::fs::File::create(cp.dir().join(format!("manager-{id}.log"))).unwrap();
    ChildGroup::spawn(
        id,
        Command::new(env!("CARGO_BIN_EXE_manager"))
            .args([
                "run",
                "--identity",
                id,
                "--lease-duration-secs",
                "3",
                "--renew-secs",
                "1",
                "--metrics-addr",
                &format!("127.0.0.1:{port}"),
            ])
            .args(claim_only_flags())
            .env("KUBECONFIG", cp.kubeconfig_path())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log),
    )
    .unwrap()
}

async fn holder(client: &Client) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), "default")
        .get_opt("anneal-manager")
        .await
        .unwrap()
        .and_then(|l| l.spec?.holder_identity)
}

async fn create_claims(client: &Client, ns: &str, range: std::ops::Range<usize>) {
    let api: Api<MachineClaim> = Api::namespaced(client.clone(), ns);
    let futs = range.map(|i| {
        let api = api.clone();
        async move {
            let c: MachineClaim = serde_json::from_value(json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
                "metadata": {"name": format!("c{i}")},
                "spec": {"selector": {"matchLabels": {"pool": "ha"}}}
            }))
            .unwrap();
            api.create(&PostParams::default(), &c).await.unwrap();
        }
    });
    futures::future::join_all(futs).await;
}

/// (bound claims, pending claims, machine -> holder); asserts the
/// invariants on the way.
async fn snapshot(client: &Client, ns: &str) -> (usize, usize, BTreeMap<String, String>) {
    let cs = Api::<MachineClaim>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let ms = Api::<Machine>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    let holders: BTreeMap<String, String> = ms
        .iter()
        .filter_map(|m| {
            m.spec
                .claim_ref
                .as_ref()
                .map(|r| (m.name_any(), r.name.clone()))
        })
        .collect();
    let distinct: BTreeSet<&String> = holders.values().collect();
    assert_eq!(
        distinct.len(),
        holders.len(),
        "a claim holds two machines: {holders:?}"
    );
    let mut bound = 0;
    let mut pending = 0;
    for c in &cs {
        match c.status.as_ref().and_then(|s| s.phase) {
            Some(ClaimPhase::Bound) => {
                bound += 1;
                let m = c
                    .status
                    .as_ref()
                    .and_then(|s| s.machine_name.clone())
                    .unwrap();
                assert_eq!(
                    holders.get(&m),
                    Some(&c.name_any()),
                    "claim {} says {m}",
                    c.name_any()
                );
            }
            Some(ClaimPhase::Pending) => pending += 1,
            _ => {}
        }
    }
    (bound, pending, holders)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_killed_mid_run_never_double_binds() {
    let t0 = Instant::now();
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let ns = "default";

    let mut a = replica(&cp, "replica-a");
    let mut b = replica(&cp, "replica-b");
    let deadline = Instant::now() + Duration::from_secs(30);
    let leader = loop {
        if let Some(h) = holder(&client).await {
            break h;
        }
        assert!(Instant::now() < deadline, "no replica took the lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("leader: {leader} after {:.1} s", t0.elapsed().as_secs_f64());

    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    for i in 0..10 {
        let m: Machine = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": format!("m{i}"), "labels": {"pool": "ha"}},
            "spec": {"subnetRef": {"name": "lab"}}
        }))
        .unwrap();
        machines.create(&PostParams::default(), &m).await.unwrap();
        machines
            .patch_status(
                &format!("m{i}"),
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": {"state": "Available"}})),
            )
            .await
            .unwrap();
    }

    create_claims(&client, ns, 0..25).await;
    // Kill the leader as soon as it has bound something, while it is binding.
    let deadline = Instant::now() + Duration::from_secs(30);
    let at_kill = loop {
        let (_, _, holders) = snapshot(&client, ns).await;
        if !holders.is_empty() {
            break holders.len();
        }
        assert!(Instant::now() < deadline, "the leader bound nothing");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (killed, survivor_id) = if leader == "replica-a" {
        (&mut a, "replica-b")
    } else {
        (&mut b, "replica-a")
    };
    let pid = killed.pid();
    killed.kill();
    assert!(!process_alive(pid));
    println!(
        "killed {leader} with {at_kill} machines bound at {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    create_claims(&client, ns, 25..50).await;

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (bound, pending, holders) = snapshot(&client, ns).await;
        if bound == 10 && pending == 40 && holders.len() == 10 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after failover: bound {bound} pending {pending} held {}",
            holders.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "all bound by the survivor at {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(
        holder(&client).await.as_deref(),
        Some(survivor_id),
        "the survivor holds the lease"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (bound, pending, holders) = snapshot(&client, ns).await;
    assert_eq!((bound, pending, holders.len()), (10, 40, 10));
    let survivor = if survivor_id == "replica-a" {
        &mut a
    } else {
        &mut b
    };
    assert!(survivor.try_exit().is_none(), "the survivor keeps running");
}
