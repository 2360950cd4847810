//! bootd against the real control plane: creating a Machine opens the MAC
//! gate within 2 s, deleting it closes it, and `status.dhcp.appliedRevision`
//! catches up only once the table built from that revision is live.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod dhcp_probe;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anneal_api::{Machine, Subnet};
use anneal_bootd::watch::{WatchConfig, build, run};
use anneal_bootd::{Shared, StaticConfig};
use anneal_dhcp::{Decision, DropReason, Leases, Mac};
use anneal_testinfra::ControlPlane;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

const MAC: &str = "52:54:00:c0:00:01";

fn answer(shared: &Shared) -> Decision {
    dhcp_probe::decide_discover(
        &shared.snapshot().table,
        &Leases::default(),
        Mac([0x52, 0x54, 0, 0xc0, 0, 1]),
    )
}

async fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what} not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machines_open_and_close_the_gate_and_applied_revision_follows() {
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
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(matches!(
        answer(&shared),
        Decision::Drop {
            reason: DropReason::NotEnrolled
        }
    ));

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
    let opened = wait_until("gate open", Duration::from_secs(2), || {
        matches!(
            answer(&shared),
            Decision::Drop {
                reason: DropReason::NoReservation
            }
        )
    })
    .await;
    println!(
        "gate opened {:.0} ms after create returned ({:.0} ms incl. create)",
        opened.as_secs_f64() * 1e3,
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
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = subnets.get("lab").await.unwrap();
        let applied = s
            .status
            .and_then(|s| s.dhcp)
            .and_then(|d| d.applied_revision);
        if applied.as_deref() == Some("rev-1") {
            // it was written after the table went live: the live table is rev-1
            assert_eq!(shared.snapshot().table.revision, "rev-1");
            break;
        }
        // never ahead of the live table
        assert!(applied.is_none(), "{applied:?}");
        assert!(Instant::now() < deadline, "appliedRevision never caught up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match answer(&shared) {
        Decision::Reply(r) => assert_eq!(r.message.yiaddr(), Ipv4Addr::new(10, 77, 0, 50)),
        other => panic!("{other:?}"),
    }

    // deleting the Machine closes the gate
    machines
        .delete("m1", &DeleteParams::default())
        .await
        .unwrap();
    let closed = wait_until("gate closed", Duration::from_secs(2), || {
        matches!(
            answer(&shared),
            Decision::Drop {
                reason: DropReason::NotEnrolled
            }
        )
    })
    .await;
    println!(
        "gate closed {:.0} ms after delete",
        closed.as_secs_f64() * 1e3
    );
    cancel.cancel();
    let _ = task.await;
}
