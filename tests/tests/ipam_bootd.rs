//! The manager's reservations controller and bootd's watcher against one
//! real control plane: a net-booting Machine gets an address written by the
//! manager, bootd makes that table live and reports
//! `appliedRevision == revision`, and its DHCP answer offers exactly that
//! address; when the Machine leaves the net-booting states the reservation
//! goes, the revision changes and bootd follows again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod dhcp_probe;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anneal_api::{Machine, Subnet, reservations_revision};
use anneal_bootd::watch::{WatchConfig, build, run};
use anneal_bootd::{Shared, StaticConfig};
use anneal_dhcp::{Decision, DropReason, Leases, Mac};
use anneal_testinfra::ControlPlane;
use kube::api::{Api, Patch, PatchParams, PostParams};

const MAC: &str = "52:54:00:c1:00:01";

fn answer(shared: &Shared) -> Decision {
    dhcp_probe::decide_discover(
        &shared.snapshot().table,
        &Leases::default(),
        Mac([0x52, 0x54, 0, 0xc1, 0, 1]),
    )
}

/// (reservations as (address, mac), revision, appliedRevision).
type Dhcp = (Vec<(String, String)>, Option<String>, Option<String>);

fn dhcp_of(s: &Subnet) -> Dhcp {
    let d = s
        .status
        .as_ref()
        .and_then(|s| s.dhcp.clone())
        .unwrap_or_default();
    (
        d.reservations
            .iter()
            .map(|r| (r.address.clone(), r.mac.clone()))
            .collect(),
        d.revision.clone(),
        d.applied_revision.clone(),
    )
}

/// Waits until bootd has applied the manager's current revision and the
/// table matches `want`; returns the revision and the time it took.
async fn applied(
    subnets: &Api<Subnet>,
    shared: &Shared,
    want: &[(String, String)],
) -> (String, Duration) {
    let t = Instant::now();
    loop {
        let s = subnets.get("lab").await.unwrap();
        let (table, rev, applied) = dhcp_of(&s);
        if table == want
            && let Some(rev) = rev
            && applied.as_deref() == Some(rev.as_str())
        {
            // the manager's revision is the digest of the table it wrote
            let d = s.status.as_ref().unwrap().dhcp.as_ref().unwrap();
            assert_eq!(rev, reservations_revision(&d.reservations));
            // and bootd answers from exactly that revision
            assert_eq!(shared.snapshot().table.revision, rev);
            return (rev, t.elapsed());
        }
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "bootd did not apply {want:?} within 15 s: {:?}",
            dhcp_of(&s)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootd_applies_the_manager_written_reservation_table() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), "default");
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let subnet: Subnet = serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": "lab"},
        "spec": {
            "siteRef": {"name": "site"}, "cidr": "10.77.0.0/24",
            "bootd": {"serverIP": "10.77.0.1", "mode": "External"},
            "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.150"}}
        }
    }))
    .unwrap();
    subnets
        .create(&PostParams::default(), &subnet)
        .await
        .unwrap();

    // The manager, as `manager run` runs it.
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let manager = tokio::spawn(anneal_manager::run(
        client.clone(),
        anneal_manager::RunConfig::default(),
        async {
            let _ = stop_rx.await;
        },
    ));

    // bootd's watcher, in-process.
    let base = StaticConfig::from_yaml(
        "serverIP: 10.77.0.1\ncidr: 10.77.0.0/24\ndhcp: {mode: proxy}\nartifacts: {kernel: /k, initrd: /i}\n",
    )
    .unwrap();
    let cfg = WatchConfig {
        namespace: "default".into(),
        subnet: "lab".into(),
        base,
        http_port: 8080,
    };
    let (snap, _, _) = build(&client, &cfg).await.unwrap();
    let shared = Arc::new(Shared::new(snap, Leases::default(), String::new()));
    let cancel = anneal_bootd::CancellationToken::new();
    let task = tokio::spawn(run(client.clone(), cfg, shared.clone(), cancel.clone()));

    // An empty table first: the manager writes its revision, bootd applies it.
    let (rev_empty, _) = applied(&subnets, &shared, &[]).await;

    // A Machine that net-boots gets the lowest address of the range.
    let m: Machine = serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": "m1"},
        "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": MAC, "console": ["ttyS0"]}
    }))
    .unwrap();
    machines.create(&PostParams::default(), &m).await.unwrap();
    let set_state = |state: &'static str| {
        let machines = machines.clone();
        async move {
            machines
                .patch_status(
                    "m1",
                    &PatchParams::default(),
                    &Patch::Merge(&serde_json::json!({"status": {"state": state}})),
                )
                .await
                .unwrap();
        }
    };
    set_state("Inspecting").await;
    let want = [("10.77.0.100".to_string(), MAC.to_string())];
    let (rev_one, took) = applied(&subnets, &shared, &want).await;
    println!(
        "Machine Inspecting → reservation written and applied by bootd in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    assert_ne!(rev_one, rev_empty);
    match answer(&shared) {
        Decision::Reply(r) => assert_eq!(r.message.yiaddr(), Ipv4Addr::new(10, 77, 0, 100)),
        other => panic!("{other:?}"),
    }

    // Inspection done: the reservation goes, bootd follows.
    set_state("Available").await;
    let (rev_after, took) = applied(&subnets, &shared, &[]).await;
    println!(
        "Machine Available → release applied by bootd in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    assert_eq!(
        rev_after, rev_empty,
        "the revision is a digest, not a counter"
    );
    assert!(matches!(
        answer(&shared),
        Decision::Drop {
            reason: DropReason::NoReservation
        }
    ));

    cancel.cancel();
    let _ = task.await;
    let _ = stop_tx.send(());
    manager.await.unwrap().unwrap();
}
