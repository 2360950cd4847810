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

/// One Machine per boot MAC on a Subnet, across namespaces: of two Machines
/// enrolling the same MAC, bootd's table keeps the first enrolled (its
/// name and boot token), whichever the list returns last; a Machine of a
/// namespace the Subnet does not grant (`spec.allowedNamespaces`) opens no
/// gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_boot_mac_boots_only_its_first_machine_from_granted_namespaces() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    // `tenant-b` lists after `default`: a list's later duplicate used to
    // overwrite the first
    for ns in ["tenant-b", "tenant-c"] {
        anneal_tests::lifecycle::create_namespace(&client, ns).await;
    }
    let mut subnet = anneal_tests::lab::lease_subnet(None);
    subnet.spec.allowed_namespaces = vec!["tenant-b".into()];
    Api::<Subnet>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &subnet)
        .await
        .unwrap();
    const STRANGER: &str = "52:54:00:c0:00:03";
    let mut tokens = std::collections::BTreeMap::new();
    for (ns, name, mac) in [
        ("default", "first", MAC),
        ("tenant-b", "thief", MAC),
        ("tenant-c", "stranger", STRANGER),
    ] {
        let m: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"subnetRef": {"name": "lab", "namespace": "default"}, "bootMACAddress": mac}
        }))
        .unwrap();
        Api::<Machine>::namespaced(client.clone(), ns)
            .create(&PostParams::default(), &m)
            .await
            .unwrap();
        // the token where bootd reads it (as the manager writes it): a key
        // of Secret anneal-boot-tokens in the Subnet's namespace
        let key = anneal_api::tenancy::boot_token_secret(ns, name, "default");
        tokens.insert(key, format!("token-of-{name}"));
        // armed: bootd serves a token only while status.netBoot.tokenHash
        // is its hash
        let hash = anneal_bootd::watch::token_hash(&anneal_bootd::state::Token::new(format!(
            "token-of-{name}"
        )));
        Api::<Machine>::namespaced(client.clone(), ns)
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {"netBoot": {"tokenHash": hash}}})),
            )
            .await
            .unwrap();
    }

    let tokens: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": anneal_api::tenancy::BOOT_TOKENS_SECRET, "namespace": "default"},
        "stringData": tokens
    }))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &tokens)
        .await
        .unwrap();

    // the table bootd builds at start from these objects
    let watcher = Watcher::start(&client).await;
    let snap = watcher.shared.snapshot();
    let boot = snap.machines.get(&MAC_BYTES).expect("MAC enrolled");
    assert_eq!(
        boot.name, "default/first",
        "the first Machine keeps the MAC"
    );
    assert_eq!(
        boot.token.unused().map(|t| t.expose()),
        Some("token-of-first"),
        "the MAC boots with the first Machine's token"
    );
    let stranger: Mac = STRANGER.parse().unwrap();
    assert!(
        !snap.machines.contains_key(&stranger),
        "a Machine of an ungranted namespace is in the table: {:?}",
        snap.machines.get(&stranger).map(|b| &b.name)
    );
    let d = watcher.answer(stranger);
    assert!(dropped(&d, DropReason::NotEnrolled), "{d:?}");
    watcher.stop().await;
}

/// The API server's GET and LIST requests of Machines, Subnets and Secrets
/// (`apiserver_request_total`): what a bootd reads besides its watches.
async fn bootd_reads(client: &kube::Client) -> u64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && ["machines", "subnets", "secrets"]
                    .iter()
                    .any(|r| l.contains(&format!("resource=\"{r}\"")))
                && (l.contains("verb=\"LIST\"") || l.contains("verb=\"GET\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A Machine write costs a bootd no API read: its table is assembled from
/// watch caches, and it watches only Machines naming its Subnet (once every
/// bootd re-listed every Machine, and re-read its Subnet and token Secret,
/// on every change of any Machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_writes_cost_a_bootd_no_reads() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    create_lease_subnet(&client, "default").await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let machine = |name: &str, subnet: &str, mac: &str| -> Machine {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": name},
            "spec": {"subnetRef": {"name": subnet}, "bootMACAddress": mac}
        }))
        .unwrap()
    };
    let watcher = Watcher::start(&client).await;
    let gate_open = |mac: Mac| {
        let watcher = &watcher;
        move || async move {
            let d = watcher.answer(mac);
            if dropped(&d, DropReason::NoReservation) {
                Ok(())
            } else {
                Err(d)
            }
        }
    };
    // live: its first Machine reached the table through the watch
    machines
        .create(&PostParams::default(), &machine("m1", "lab", MAC))
        .await
        .unwrap();
    eventually("the gate open for m1", WATCH, gate_open(MAC_BYTES)).await;

    let before = bootd_reads(&client).await;
    // Machines of another Subnet, written and rewritten
    for i in 0..30 {
        let name = format!("other-{i}");
        let mac = format!("52:54:00:c1:00:{i:02x}");
        machines
            .create(&PostParams::default(), &machine(&name, "other", &mac))
            .await
            .unwrap();
        machines
            .patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {"state": "Available"}})),
            )
            .await
            .unwrap();
    }
    // and one of its own, seen through the watch
    const MAC2: &str = "52:54:00:c0:00:02";
    machines
        .create(&PostParams::default(), &machine("m2", "lab", MAC2))
        .await
        .unwrap();
    eventually(
        "the gate open for m2",
        WATCH,
        gate_open(MAC2.parse().unwrap()),
    )
    .await;
    let after = bootd_reads(&client).await;
    assert_eq!(
        after - before,
        0,
        "bootd read the API server {} times for 61 Machine writes (GET/LIST of machines, subnets, secrets)",
        after - before
    );
    // the other Subnet's Machines never entered this table
    let snap = watcher.shared.snapshot();
    assert_eq!(snap.machines.len(), 2, "{:?}", snap.machines.keys());
}
