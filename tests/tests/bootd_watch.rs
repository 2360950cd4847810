//! bootd against the real control plane: creating a Machine opens the MAC
//! gate, deleting it closes it, and `status.dhcp.appliedRevision` catches up
//! only once the table built from that revision is live.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anneal_api::{Machine, Subnet};
use anneal_dhcp::{Decision, DropReason, Mac};
use anneal_testinfra::ControlPlane;
use anneal_tests::eventually;
use anneal_tests::lab::{Watcher, create_lease_subnet};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

const MAC: &str = "52:54:00:c0:00:01";
const MAC_BYTES: Mac = Mac([0x52, 0x54, 0, 0xc0, 0, 1]);
/// Generous: a loaded 2-core machine may take seconds for a watch event.
const WATCH: Duration = Duration::from_secs(30);

fn dropped(d: &Decision, why: DropReason) -> bool {
    matches!(d, Decision::Drop { reason } if *reason == why)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_open_and_close_the_gate_and_applied_revision_follows() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let subnets = create_lease_subnet(&client, "default").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");

    let watcher = Watcher::start(&client).await;
    // the table built at start: no Machine, the gate is closed
    let d = watcher.answer(MAC_BYTES);
    assert!(dropped(&d, DropReason::NotEnrolled), "{d:?}");

    // a Machine opens the gate (no reservation yet: the gate is open, the
    // address not)
    let m: Machine = serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": "m1"},
        "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": MAC, "console": ["ttyS0"]}
    }))
    .unwrap();
    let t = Instant::now();
    machines.create(&PostParams::default(), &m).await.unwrap();
    eventually("the gate open for m1 (NoReservation)", WATCH, || async {
        let d = watcher.answer(MAC_BYTES);
        if dropped(&d, DropReason::NoReservation) {
            Ok(())
        } else {
            Err(d)
        }
    })
    .await;
    println!(
        "gate opened {:.0} ms after the create call",
        t.elapsed().as_secs_f64() * 1e3
    );

    // the manager reserves an address and bumps the revision; bootd makes it
    // live, then reports it
    let status = serde_json::json!({"status": {"dhcp": {
        "reservations": [{"address": "10.77.0.50", "machine": "m1", "mac": MAC}],
        "revision": "rev-1"
    }}});
    subnets
        .patch_status("lab", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    eventually("appliedRevision rev-1", WATCH, || async {
        let s: Subnet = subnets.get("lab").await.unwrap();
        let applied = s
            .status
            .and_then(|s| s.dhcp)
            .and_then(|d| d.applied_revision);
        // never ahead of the live table
        assert!(
            applied.is_none() || applied.as_deref() == Some("rev-1"),
            "{applied:?}"
        );
        if applied.as_deref() == Some("rev-1") {
            // it was written after the table went live: the live table is rev-1
            assert_eq!(watcher.revision(), "rev-1");
            Ok(())
        } else {
            Err(applied)
        }
    })
    .await;
    match watcher.answer(MAC_BYTES) {
        Decision::Reply(r) => assert_eq!(r.message.yiaddr(), Ipv4Addr::new(10, 77, 0, 50)),
        other => panic!("{other:?}"),
    }

    // deleting the Machine closes the gate
    let t = Instant::now();
    machines
        .delete("m1", &DeleteParams::default())
        .await
        .unwrap();
    eventually("the gate closed for m1 (NotEnrolled)", WATCH, || async {
        let d = watcher.answer(MAC_BYTES);
        if dropped(&d, DropReason::NotEnrolled) {
            Ok(())
        } else {
            Err(d)
        }
    })
    .await;
    println!(
        "gate closed {:.0} ms after the delete call",
        t.elapsed().as_secs_f64() * 1e3
    );
    watcher.stop().await;
}
