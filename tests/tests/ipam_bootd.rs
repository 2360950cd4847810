//! The manager's reservations controller and bootd's watcher against one
//! real control plane: a net-booting Machine gets an address written by the
//! manager, bootd makes that table live and reports
//! `appliedRevision == revision`, and its DHCP answer offers exactly that
//! address; when the Machine leaves the net-booting states the reservation
//! goes, the revision changes and bootd follows again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anneal_api::{Machine, Subnet, reservations_revision};
use anneal_dhcp::{Decision, DropReason, Mac};
use anneal_testinfra::ControlPlane;
use anneal_tests::eventually;
use anneal_tests::lab::{Watcher, create_lease_subnet};
use kube::api::{Api, Patch, PatchParams, PostParams};

const MAC: &str = "52:54:00:c1:00:01";

const MAC_BYTES: Mac = Mac([0x52, 0x54, 0, 0xc1, 0, 1]);

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
    watcher: &Watcher,
    want: &[(String, String)],
) -> (String, Duration) {
    let t = Instant::now();
    let rev = eventually(
        &format!("bootd applying the manager's table {want:?}"),
        Duration::from_secs(60),
        || async {
            let s = subnets.get("lab").await.unwrap();
            let (table, rev, applied) = dhcp_of(&s);
            match rev {
                Some(rev) if table == want && applied.as_deref() == Some(rev.as_str()) => {
                    // the manager's revision is the digest of the table it wrote
                    let d = s.status.as_ref().unwrap().dhcp.as_ref().unwrap();
                    assert_eq!(rev, reservations_revision(&d.reservations));
                    Ok(rev)
                }
                _ => Err(dhcp_of(&s)),
            }
        },
    )
    .await;
    // and bootd answers from exactly that revision
    assert_eq!(watcher.revision(), rev);
    (rev, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bootd_applies_the_manager_written_reservation_table() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let subnets = create_lease_subnet(&client, "default").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");

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
    let watcher = Watcher::start(&client).await;

    // An empty table first: the manager writes its revision, bootd applies it.
    let (rev_empty, _) = applied(&subnets, &watcher, &[]).await;

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
    let (rev_one, took) = applied(&subnets, &watcher, &want).await;
    println!(
        "Machine Inspecting → reservation written and applied by bootd in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    assert_ne!(rev_one, rev_empty);
    match watcher.answer(MAC_BYTES) {
        Decision::Reply(r) => assert_eq!(r.message.yiaddr(), Ipv4Addr::new(10, 77, 0, 100)),
        other => panic!("{other:?}"),
    }

    // Inspection done: the reservation goes, bootd follows.
    set_state("Available").await;
    let (rev_after, took) = applied(&subnets, &watcher, &[]).await;
    println!(
        "Machine Available → release applied by bootd in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    assert_eq!(
        rev_after, rev_empty,
        "the revision is a digest, not a counter"
    );
    assert!(matches!(
        watcher.answer(MAC_BYTES),
        Decision::Drop {
            reason: DropReason::NoReservation
        }
    ));

    watcher.stop().await;
    let _ = stop_tx.send(());
    manager.await.unwrap().unwrap();
}
