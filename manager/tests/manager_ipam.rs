//! The reservations (IPAM) controller against a real kube-apiserver, run as
//! `manager run` runs it: allocation (lowest free address of the lease range,
//! bootd's server IP and the gateway skipped, only net-booting or deployed
//! Machines), the revision, `DHCPPoolExhausted` with the waiting count, the
//! Events, stability across a manager restart (no write at all), release on
//! delete and on leaving the Subnet, proxy mode; `reservationCount` and
//! `bootdReady` (docs/operators.md, "Columns, short names, `kubectl get
//! anneal`").
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anneal_api::{Machine, Reservation, Subnet, reservations_revision};
use anneal_testinfra::ControlPlane;
use futures::StreamExt;
use k8s_openapi::api::events::v1::Event;
use kube::api::{
    Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::task::JoinHandle;

struct Manager {
    stop: tokio::sync::oneshot::Sender<()>,
    task: JoinHandle<Result<(), anneal_manager::RunError>>,
}

fn start_manager(client: &Client) -> Manager {
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(anneal_manager::run(
        client.clone(),
        anneal_manager::RunConfig::default(),
        async {
            let _ = rx.await;
        },
    ));
    Manager { stop, task }
}

impl Manager {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

async fn subnet(client: &Client, name: &str, dhcp: serde_json::Value) {
    let api: Api<Subnet> = Api::namespaced(client.clone(), "default");
    let s: Subnet = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": name},
        "spec": {
            "siteRef": {"name": "site"}, "cidr": "10.77.0.0/24",
            "bootd": {"serverIP": "10.77.0.1", "mode": "External"},
            "dhcp": dhcp
        }
    }))
    .unwrap();
    api.create(&PostParams::default(), &s).await.unwrap();
}

async fn machine(client: &Client, name: &str, subnet: &str, mac: &str, state: &str) {
    let api: Api<Machine> = Api::namespaced(client.clone(), "default");
    let m: Machine = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": name},
        "spec": {"subnetRef": {"name": subnet}, "bootMACAddress": mac}
    }))
    .unwrap();
    api.create(&PostParams::default(), &m).await.unwrap();
    set_state(client, name, state).await;
}

async fn set_state(client: &Client, name: &str, state: &str) {
    let api: Api<Machine> = Api::namespaced(client.clone(), "default");
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"state": state}})),
    )
    .await
    .unwrap();
}

/// address → machine of the Subnet's table.
fn table(s: &Subnet) -> BTreeMap<String, String> {
    reservations(s)
        .into_iter()
        .map(|r| (r.address, r.machine))
        .collect()
}

fn reservations(s: &Subnet) -> Vec<Reservation> {
    s.status
        .as_ref()
        .and_then(|s| s.dhcp.as_ref())
        .map(|d| d.reservations.clone())
        .unwrap_or_default()
}

fn exhausted(s: &Subnet) -> Option<(String, String, String)> {
    s.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "DHCPPoolExhausted")
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Polls the Subnet until `f` holds; returns it and how long it took.
async fn until(
    client: &Client,
    name: &str,
    what: &str,
    f: impl Fn(&Subnet) -> bool,
) -> (Subnet, Duration) {
    let api: Api<Subnet> = Api::namespaced(client.clone(), "default");
    let t = Instant::now();
    loop {
        let s = api.get(name).await.unwrap();
        if f(&s) {
            return (s, t.elapsed());
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{what} not within 60 s; status: {}",
            serde_json::to_string_pretty(&s.status).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

fn revision_matches(s: &Subnet) -> bool {
    let d = s.status.as_ref().and_then(|s| s.dhcp.as_ref());
    d.and_then(|d| d.revision.clone()) == Some(reservations_revision(&reservations(s)))
}

async fn events(client: &Client, reason: &str) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(client.clone(), "default");
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

async fn eventually_events(client: &Client, reason: &str, about: &str) -> Event {
    let t = Instant::now();
    loop {
        if let Some(e) = events(client, reason)
            .await
            .into_iter()
            .find(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(about))
        {
            return e;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no {reason} event about {about} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn m(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reservations_allocate_stay_release_and_exhaust() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("anneal_manager::ipam=debug")
            }),
        )
        .with_test_writer()
        .try_init();
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), "default");
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");

    // A pool of two (bootd's server IP and the gateway lie outside it, as
    // validity demands; skipping them is unit-tested in ipam.rs).
    subnet(
        &client,
        "lab",
        json!({"mode": "lease", "gateway": "10.77.0.254",
               "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.101"}}),
    )
    .await;
    subnet(&client, "prox", json!({"mode": "proxy"})).await;
    let manager = start_manager(&client);

    // 1. Allocation: net-booting and deployed Machines only, oldest first.
    let t = Instant::now();
    machine(&client, "m1", "lab", "52:54:00:1a:00:01", "Inspecting").await;
    machine(&client, "idle", "lab", "52:54:00:1a:00:02", "Available").await;
    machine(&client, "m3", "lab", "52:54:00:1A:00:03", "Provisioned").await;
    machine(&client, "px", "prox", "52:54:00:1a:00:04", "Inspecting").await;
    let (s, took) = until(&client, "lab", "two reservations", |s| {
        table(s).len() == 2 && revision_matches(s)
    })
    .await;
    println!(
        "allocation: 2 reservations {:.0} ms after the last create ({:.0} ms from the first)",
        took.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(
        table(&s),
        m(&[("10.77.0.100", "m1"), ("10.77.0.101", "m3")])
    );
    let r3 = reservations(&s)
        .into_iter()
        .find(|r| r.machine == "m3")
        .unwrap();
    assert_eq!(r3.mac, "52:54:00:1a:00:03", "MACs are stored lowercase");
    assert!(r3.since.is_some());
    let (st, reason, msg) = exhausted(&s).unwrap();
    assert_eq!(
        (st.as_str(), reason.as_str()),
        ("False", "AddressesAvailable")
    );
    assert!(msg.contains("default/lab"), "{msg}");
    let ev = eventually_events(&client, "AddressReserved", "m1").await;
    assert!(
        ev.note.as_deref().unwrap_or("").contains("10.77.0.100"),
        "{ev:?}"
    );
    // Proxy mode: no table, the condition False.
    let (p, _) = until(&client, "prox", "proxy condition", |s| {
        exhausted(s).is_some()
    })
    .await;
    assert!(reservations(&p).is_empty());
    assert_eq!(exhausted(&p).unwrap().0, "False");
    assert_eq!(exhausted(&p).unwrap().1, "ProxyMode");
    let ps = p.status.clone().unwrap();
    assert_eq!(
        (ps.reservation_count, ps.bootd_ready),
        (None, None),
        "proxy mode: no count, and bootd reports nothing"
    );
    // The printer columns' fields: the count, and bootd not ready until it has
    // applied the current revision (bootd's write is played here: it patches
    // appliedRevision once the table is live).
    let st = s.status.clone().unwrap();
    assert_eq!(st.reservation_count, Some(2));
    assert_eq!(st.bootd_ready, Some(false), "no bootd has applied anything");
    let rev = st.dhcp.unwrap().revision.unwrap();
    subnets
        .patch_status(
            "lab",
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": {"dhcp": {"appliedRevision": rev}}})),
        )
        .await
        .unwrap();
    until(&client, "lab", "bootdReady=true", |s| {
        s.status.as_ref().and_then(|s| s.bootd_ready) == Some(true)
    })
    .await;

    // 2. Exhaustion: a third net-booting Machine waits.
    set_state(&client, "idle", "Inspecting").await;
    let (s, took) = until(&client, "lab", "DHCPPoolExhausted=True", |s| {
        exhausted(s).is_some_and(|c| c.0 == "True")
    })
    .await;
    println!(
        "exhaustion: condition True {:.0} ms after the state change",
        took.as_secs_f64() * 1e3
    );
    let (_, reason, msg) = exhausted(&s).unwrap();
    assert_eq!(reason, "PoolExhausted");
    assert!(
        msg.contains("default/lab") && msg.contains("1 Machine(s) waiting: idle"),
        "{msg}"
    );
    assert_eq!(
        table(&s),
        m(&[("10.77.0.100", "m1"), ("10.77.0.101", "m3")]),
        "nobody is moved to make room"
    );
    let ev = eventually_events(&client, "DHCPPoolExhausted", "idle").await;
    assert_eq!(ev.type_.as_deref(), Some("Warning"));
    eventually_events(&client, "DHCPPoolExhausted", "lab").await;

    // 3. A manager restart changes nothing: same table (same `since`), no
    // write at all. Proven without a sleep: a watch from the Subnet's
    // version before the restart sees, as its first change, the release of
    // step 4 (m1 gone); a rewrite by the restarted manager would come
    // first, with m1 still in it.
    let before = subnets.get("lab").await.unwrap();
    let mut changes = subnets
        .watch(
            &WatchParams::default().fields("metadata.name=lab"),
            &before.resource_version().unwrap(),
        )
        .await
        .unwrap()
        .boxed();
    manager.stop().await;
    let manager = start_manager(&client);

    // 4. Release on delete: m1's address goes to the waiting Machine.
    let t = Instant::now();
    machines
        .delete("m1", &DeleteParams::default())
        .await
        .unwrap();
    let (s, took) = until(&client, "lab", "m1 released, idle served", |s| {
        table(s) == m(&[("10.77.0.100", "idle"), ("10.77.0.101", "m3")]) && revision_matches(s)
    })
    .await;
    println!(
        "release on delete: address reused {:.0} ms after the delete ({:.0} ms incl. the call)",
        took.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(exhausted(&s).unwrap().0, "False");
    let first = loop {
        match changes.next().await {
            Some(Ok(WatchEvent::Modified(s))) => break s,
            Some(Ok(WatchEvent::Bookmark(_))) => {}
            other => panic!("watch of Subnet lab: {other:?}"),
        }
    };
    assert!(
        !table(&first).values().any(|m| m == "m1"),
        "the restarted manager rewrote the Subnet before m1's release: {:?}",
        first.status
    );
    // m3's entry kept its `since` across the restart and the release
    let keep = |s: &Subnet| {
        reservations(s)
            .into_iter()
            .filter(|r| r.machine == "m3")
            .collect::<Vec<_>>()
    };
    assert_eq!(keep(&s), keep(&before));
    let ev = eventually_events(&client, "AddressReleased", "lab").await;
    assert!(ev.note.as_deref().unwrap_or("").contains("m1"), "{ev:?}");
    let rev_two = s
        .status
        .as_ref()
        .unwrap()
        .dhcp
        .as_ref()
        .unwrap()
        .revision
        .clone();

    // 5. Leaving the Subnet (or the states) releases too; m3's address
    // never moved.
    machines
        .patch(
            "m3",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"subnetRef": {"name": "prox"}}})),
        )
        .await
        .unwrap();
    set_state(&client, "idle", "Available").await;
    let (s, _) = until(&client, "lab", "empty table", |s| {
        table(s).is_empty() && revision_matches(s)
    })
    .await;
    let st = s.status.clone().unwrap();
    assert_eq!(st.reservation_count, Some(0));
    assert_eq!(
        st.bootd_ready,
        Some(false),
        "the new revision is not applied: bootd is not ready for it"
    );
    let rev_empty = s
        .status
        .as_ref()
        .unwrap()
        .dhcp
        .as_ref()
        .unwrap()
        .revision
        .clone();
    assert_ne!(rev_two, rev_empty, "the revision follows the table");
    let (p, _) = until(&client, "prox", "still no table", |_| true).await;
    assert!(reservations(&p).is_empty(), "proxy mode never reserves");

    manager.stop().await;
}

/// `spec.ipv6` (docs/api.md, "Subnet"): the API server admits a valid one and
/// rejects the rules CEL holds, naming the field; in lease mode every
/// reservation carries an `ipv6Address` from `spec.ipv6.leaseRange`, stable
/// and unique, covered by the revision.
#[tokio::test]
async fn ipv6_reservations_and_admission() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), "default");
    let create = |name: &str, mode: &str, ipv6: serde_json::Value| {
        let mut dhcp = json!({"mode": mode});
        if mode == "lease" {
            dhcp = json!({"mode": "lease", "gateway": "",
                          "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.110"}});
        }
        serde_json::from_value::<Subnet>(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": name},
            "spec": {
                "siteRef": {"name": "site"}, "cidr": "10.77.0.0/24",
                "bootd": {"serverIP": "10.77.0.1", "mode": "External"},
                "dhcp": dhcp, "ipv6": ipv6
            }
        }))
        .unwrap()
    };
    let ok = json!({"prefix": "2001:db8:77::/64", "serverAddress": "2001:db8:77::1",
                    "leaseRange": {"start": "2001:db8:77::100", "end": "2001:db8:77::1ff"},
                    "dnsServers": ["2001:db8:77::53"], "routerAdvertisements": true});
    let rejected = [
        (
            "lease",
            json!({"prefix": "2001:db8::/48", "serverAddress": "2001:db8::1",
                         "leaseRange": {"start": "2001:db8::100", "end": "2001:db8::1ff"}}),
            "spec.ipv6.prefix must be an IPv6 network of /64 or longer",
        ),
        (
            "lease",
            json!({"prefix": "2001:db8:77::/64", "serverAddress": "2001:db8:99::1",
                         "leaseRange": {"start": "2001:db8:77::100", "end": "2001:db8:77::1ff"}}),
            "spec.ipv6.serverAddress must lie inside spec.ipv6.prefix",
        ),
        (
            "lease",
            json!({"prefix": "2001:db8:77::/64", "serverAddress": "2001:db8:77::1",
                         "leaseRange": {"start": "2001:db8:77::100", "end": "2001:db8:78::1"}}),
            "spec.ipv6.leaseRange must lie inside spec.ipv6.prefix",
        ),
        (
            "lease",
            json!({"prefix": "2001:db8:77::/64", "serverAddress": "2001:db8:77::1"}),
            "spec.ipv6.leaseRange is required in lease mode",
        ),
        (
            "proxy",
            ok.clone(),
            "spec.ipv6.leaseRange must be absent in proxy mode",
        ),
        (
            "lease",
            json!({"prefix": "2001:db8:77::/64", "serverAddress": "10.77.0.1",
                         "leaseRange": {"start": "2001:db8:77::100", "end": "2001:db8:77::1ff"}}),
            "spec.ipv6.serverAddress must be an IPv6 address",
        ),
    ];
    for (i, (mode, v6, want)) in rejected.into_iter().enumerate() {
        let err = subnets
            .create(
                &PostParams::default(),
                &create(&format!("bad{i}"), mode, v6),
            )
            .await
            .expect_err(want);
        assert!(err.to_string().contains(want), "{want}: {err}");
    }
    subnets
        .create(&PostParams::default(), &create("v6", "lease", ok))
        .await
        .unwrap();

    let mgr = start_manager(&client);
    machine(&client, "a", "v6", "52:54:00:00:06:01", "Inspecting").await;
    machine(&client, "b", "v6", "52:54:00:00:06:02", "Provisioning").await;
    let v6 = |s: &Subnet| -> BTreeMap<String, Option<String>> {
        reservations(s)
            .into_iter()
            .map(|r| (r.machine, r.ipv6_address))
            .collect()
    };
    let (s, took) = until(&client, "v6", "both IPv6 reservations", |s| {
        v6(s).len() == 2 && revision_matches(s)
    })
    .await;
    println!("ipv6 reservations written in {took:?}");
    assert_eq!(
        v6(&s),
        BTreeMap::from([
            ("a".to_string(), Some("2001:db8:77::100".to_string())),
            ("b".to_string(), Some("2001:db8:77::101".to_string())),
        ])
    );
    // a leaves the net-booting states: its entry goes, b keeps its address,
    // a newcomer takes the freed lowest
    set_state(&client, "a", "Available").await;
    machine(&client, "c", "v6", "52:54:00:00:06:03", "Inspecting").await;
    let (s, _) = until(&client, "v6", "c reserved, a released", |s| {
        let t = v6(s);
        t.len() == 2 && t.contains_key("c") && revision_matches(s)
    })
    .await;
    assert_eq!(
        v6(&s),
        BTreeMap::from([
            ("b".to_string(), Some("2001:db8:77::101".to_string())),
            ("c".to_string(), Some("2001:db8:77::100".to_string())),
        ])
    );
    mgr.stop().await;
}
