//! The claim and readiness controllers against a real kube-apiserver: the
//! 50-claims/10-machines race (20 rounds, concurrency 8), selector binding
//! with hardware floors, taints and cordons, release on claim deletion,
//! readiness rules, and the kubectl view (printer columns, explain).
//! One control plane for the whole file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anneal_api::{ClaimPhase, Machine, MachineClaim, MachineHardware, MachineState, ReadinessRule};
use anneal_testinfra::ControlPlane;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

async fn namespace(client: &Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    api.create(&PostParams::default(), &ns).await.unwrap();
}

async fn machine(client: &Client, ns: &str, name: &str, labels: Value, spec: Value, state: &str) {
    let api: Api<Machine> = Api::namespaced(client.clone(), ns);
    let mut full = json!({"subnetRef": {"name": "lab"}});
    for (k, v) in spec.as_object().unwrap() {
        full[k] = v.clone();
    }
    let m: Machine = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": name, "labels": labels}, "spec": full
    }))
    .unwrap();
    api.create(&PostParams::default(), &m).await.unwrap();
    let status = json!({"status": {"state": state}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

async fn hardware(
    client: &Client,
    ns: &str,
    name: &str,
    cpus: i32,
    mem_gib: i64,
    disks_gb: &[i64],
) {
    let api: Api<MachineHardware> = Api::namespaced(client.clone(), ns);
    let disks: Vec<Value> = disks_gb
        .iter()
        .enumerate()
        .map(|(i, gb)| json!({"deviceName": format!("/dev/sd{}", (b'a' + i as u8) as char), "sizeBytes": gb * 1_000_000_000}))
        .collect();
    let hw: MachineHardware = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineHardware",
        "metadata": {"name": name},
        "spec": {"cpu": {"count": cpus}, "memoryBytes": mem_gib << 30, "disks": disks}
    }))
    .unwrap();
    api.create(&PostParams::default(), &hw).await.unwrap();
}

fn claim_obj(name: &str, spec: Value) -> MachineClaim {
    serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
        "metadata": {"name": name}, "spec": spec
    }))
    .unwrap()
}

async fn claim(client: &Client, ns: &str, name: &str, spec: Value) {
    let api: Api<MachineClaim> = Api::namespaced(client.clone(), ns);
    api.create(&PostParams::default(), &claim_obj(name, spec))
        .await
        .unwrap();
}

fn phase(c: &MachineClaim) -> Option<ClaimPhase> {
    c.status.as_ref().and_then(|s| s.phase)
}

/// Polls `f` until it returns Some, or panics with the last description.
async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => panic!("{what}: timed out; last: {last}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn get_claim(client: &Client, ns: &str, name: &str) -> MachineClaim {
    Api::<MachineClaim>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap()
}

async fn get_machine(client: &Client, ns: &str, name: &str) -> Machine {
    Api::<Machine>::namespaced(client.clone(), ns)
        .get(name)
        .await
        .unwrap()
}

async fn wait_claim(
    client: &Client,
    ns: &str,
    name: &str,
    want: ClaimPhase,
    machine: Option<&str>,
) -> MachineClaim {
    eventually(
        &format!("claim {ns}/{name} {want:?} on {machine:?}"),
        Duration::from_secs(30),
        || async {
            let c = get_claim(client, ns, name).await;
            let got = c.status.as_ref().and_then(|s| s.machine_name.clone());
            if phase(&c) == Some(want) && got.as_deref() == machine {
                Ok(c)
            } else {
                Err(format!("{:?}", c.status))
            }
        },
    )
    .await
}

/// One race round: returns the number of 409s seen so far is not needed;
/// asserts the invariants.
async fn race_round(client: &Client, port: u16, round: usize) {
    let ns = format!("race-{round}");
    namespace(client, &ns).await;
    let mut creates = Vec::new();
    for i in 0..10 {
        let ns = ns.clone();
        creates.push(async move {
            machine(
                client,
                &ns,
                &format!("m{i}"),
                json!({"pool": "race"}),
                json!({}),
                "Available",
            )
            .await
        });
    }
    futures::future::join_all(creates).await;
    let mut creates = Vec::new();
    for i in 0..50 {
        let ns = ns.clone();
        creates.push(async move {
            claim(
                client,
                &ns,
                &format!("c{i}"),
                json!({"selector": {"matchLabels": {"pool": "race"}}}),
            )
            .await
        });
    }
    futures::future::join_all(creates).await;

    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), &ns);
    let machines: Api<Machine> = Api::namespaced(client.clone(), &ns);
    let check = || async {
        let cs = claims.list(&ListParams::default()).await.unwrap().items;
        let ms = machines.list(&ListParams::default()).await.unwrap().items;
        let bound: Vec<&MachineClaim> = cs
            .iter()
            .filter(|c| phase(c) == Some(ClaimPhase::Bound))
            .collect();
        let pending = cs
            .iter()
            .filter(|c| phase(c) == Some(ClaimPhase::Pending))
            .count();
        // Machine side: who holds each machine.
        let holders: BTreeMap<String, String> = ms
            .iter()
            .filter_map(|m| {
                m.spec
                    .claim_ref
                    .as_ref()
                    .map(|r| (m.name_any(), r.name.clone()))
            })
            .collect();
        let distinct_holders: BTreeSet<&String> = holders.values().collect();
        // Invariants that must hold at every instant.
        assert_eq!(
            distinct_holders.len(),
            holders.len(),
            "round {round}: a claim holds two machines: {holders:?}"
        );
        for c in &bound {
            let m = c
                .status
                .as_ref()
                .and_then(|s| s.machine_name.clone())
                .unwrap();
            assert_eq!(
                holders.get(&m),
                Some(&c.name_any()),
                "round {round}: claim {} says {m} but machine says {:?}",
                c.name_any(),
                holders.get(&m)
            );
        }
        let machines_named: BTreeSet<String> = bound
            .iter()
            .map(|c| {
                c.status
                    .as_ref()
                    .and_then(|s| s.machine_name.clone())
                    .unwrap()
            })
            .collect();
        assert_eq!(
            machines_named.len(),
            bound.len(),
            "round {round}: a machine bound twice"
        );
        if bound.len() == 10 && pending == 40 && holders.len() == 10 {
            Ok(())
        } else {
            Err(format!(
                "bound {} pending {pending} held {}",
                bound.len(),
                holders.len()
            ))
        }
    };
    eventually(
        &format!("race round {round}"),
        Duration::from_secs(60),
        check,
    )
    .await;
    // No late second binding: the binds counter (bumped after each bind's
    // write returns, so awaited, not read once) reaches exactly 10 per
    // round; a late extra bind makes it overshoot here or in a later round.
    let want = 10.0 * (round as f64 + 1.0);
    let binds = eventually(
        &format!("race round {round}: the binds counter at {want}"),
        Duration::from_secs(60),
        || async {
            let b = metric(port, "anneal_manager_binds").await;
            if b >= want {
                Ok(b)
            } else {
                Err(format!("binds {b}"))
            }
        },
    )
    .await;
    assert_eq!(binds, want, "round {round}: binds beyond 10 a round");
    check().await.unwrap();
}

async fn metric(port: u16, name: &str) -> f64 {
    let out = std::process::Command::new("curl")
        .args(["-sf", &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_bind_atomically_by_selector_and_release() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();

    let port = anneal_testinfra::free_port().unwrap();
    let cfg = anneal_manager::RunConfig {
        namespace: None,
        concurrency: 8,
        lease: None,
        metrics_addr: Some(format!("127.0.0.1:{port}").parse().unwrap()),
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let manager = tokio::spawn(anneal_manager::run(client.clone(), cfg, async {
        let _ = stop_rx.await;
    }));

    // 1. The race, 20 rounds.
    let started = Instant::now();
    for round in 0..20 {
        race_round(&client, port, round).await;
    }
    println!(
        "race: 20 rounds of 50 claims / 10 machines in {:.1} s, {} bind conflicts (409) resolved",
        started.elapsed().as_secs_f64(),
        metric(port, "anneal_manager_bind_conflicts").await
    );
    // (each round awaited its binds; none came late)
    assert_eq!(
        metric(port, "anneal_manager_binds").await,
        200.0,
        "exactly 10 binds per round"
    );

    // 2. Selector: hardware floors, taints, cordons.
    let ns = "sel";
    namespace(&client, ns).await;
    let sel = json!({"pool": "sel"});
    machine(&client, ns, "small", sel.clone(), json!({}), "Available").await;
    hardware(&client, ns, "small", 2, 4, &[100]).await;
    machine(
        &client,
        ns,
        "big-tainted",
        sel.clone(),
        json!({"taints": [{"key": "gpu", "value": "true", "effect": "NoBind"}]}),
        "Available",
    )
    .await;
    hardware(&client, ns, "big-tainted", 16, 64, &[1000]).await;
    machine(
        &client,
        ns,
        "big-cordoned",
        sel.clone(),
        json!({"unclaimable": true}),
        "Available",
    )
    .await;
    hardware(&client, ns, "big-cordoned", 16, 64, &[1000]).await;
    machine(&client, ns, "big-nohw", sel.clone(), json!({}), "Available").await;
    machine(
        &client,
        ns,
        "big-other",
        json!({"pool": "other"}),
        json!({}),
        "Available",
    )
    .await;
    hardware(&client, ns, "big-other", 16, 64, &[1000]).await;
    machine(
        &client,
        ns,
        "big-inspecting",
        sel.clone(),
        json!({}),
        "Inspecting",
    )
    .await;
    hardware(&client, ns, "big-inspecting", 16, 64, &[1000]).await;
    machine(
        &client,
        ns,
        "big",
        sel.clone(),
        json!({"reclaimPolicy": "Retain"}),
        "Available",
    )
    .await;
    hardware(&client, ns, "big", 16, 64, &[1000, 200]).await;

    let floor =
        json!({"minCPUs": 8, "minMemoryBytes": 32i64 << 30, "disks": [{"minSizeGigabytes": 500}]});
    claim(
        &client,
        ns,
        "c-big",
        json!({"selector": {"matchLabels": {"pool": "sel"}, "hardware": floor}}),
    )
    .await;
    wait_claim(&client, ns, "c-big", ClaimPhase::Bound, Some("big")).await;

    claim(
        &client,
        ns,
        "c-gpu",
        json!({"selector": {"matchLabels": {"pool": "sel"}, "hardware": {"minCPUs": 8}},
        "tolerations": [{"key": "gpu", "value": "true", "effect": "NoBind"}]}),
    )
    .await;
    wait_claim(&client, ns, "c-gpu", ClaimPhase::Bound, Some("big-tainted")).await;

    claim(&client, ns, "c-waiting", json!({"selector": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["sel"]}],
        "hardware": {"minCPUs": 8}}})).await;
    let waiting = wait_claim(&client, ns, "c-waiting", ClaimPhase::Pending, None).await;
    let bound_cond = waiting
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Bound")
        .unwrap();
    assert_eq!(bound_cond.status, "False");
    assert_eq!(bound_cond.reason, "NoMatchingMachine", "{bound_cond:?}");
    claim(
        &client,
        ns,
        "c-huge",
        json!({"selector": {"matchLabels": {"pool": "sel"}, "hardware": {"minCPUs": 64}}}),
    )
    .await;
    wait_claim(&client, ns, "c-huge", ClaimPhase::Pending, None).await;
    claim(
        &client,
        ns,
        "c-ghost",
        json!({"machineName": "does-not-exist"}),
    )
    .await;
    wait_claim(&client, ns, "c-ghost", ClaimPhase::Failed, None).await;
    // Nothing else moved: small, nohw, other, inspecting and cordoned stay
    // free. No sleep: a claim's status is written after its bind decision
    // in the same reconcile, so Pending/Failed above means it bound
    // nothing; and the binds counter did not move (awaited: it is bumped
    // after the write returns, so a bind would show up below as an extra).
    let binds_sel = eventually(
        "the binds counter at 202 (the race, c-big, c-gpu)",
        Duration::from_secs(30),
        || async {
            let b = metric(port, "anneal_manager_binds").await;
            if b >= 202.0 {
                Ok(b)
            } else {
                Err(format!("binds {b}"))
            }
        },
    )
    .await;
    assert_eq!(binds_sel, 202.0, "binds beyond c-big and c-gpu");
    for free in [
        "small",
        "big-cordoned",
        "big-nohw",
        "big-other",
        "big-inspecting",
    ] {
        assert!(
            get_machine(&client, ns, free)
                .await
                .spec
                .claim_ref
                .is_none(),
            "{free} must stay unbound"
        );
    }
    assert_eq!(
        phase(&get_claim(&client, ns, "c-waiting").await),
        Some(ClaimPhase::Pending)
    );

    // Uncordon: the waiting claim binds, nothing else changes.
    Api::<Machine>::namespaced(client.clone(), ns)
        .patch(
            "big-cordoned",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"unclaimable": false}})),
        )
        .await
        .unwrap();
    wait_claim(
        &client,
        ns,
        "c-waiting",
        ClaimPhase::Bound,
        Some("big-cordoned"),
    )
    .await;
    assert_eq!(
        phase(&get_claim(&client, ns, "c-huge").await),
        Some(ClaimPhase::Pending)
    );
    assert_eq!(
        get_machine(&client, ns, "big")
            .await
            .spec
            .claim_ref
            .unwrap()
            .name,
        "c-big"
    );
    assert_eq!(
        get_machine(&client, ns, "big-tainted")
            .await
            .spec
            .claim_ref
            .unwrap()
            .name,
        "c-gpu"
    );

    // 3. kubectl: printer columns and explain.
    let out = anneal_testinfra::run(cp.kubectl().unwrap().args([
        "get",
        "machines,machineclaims",
        "-n",
        ns,
    ]))
    .unwrap();
    println!("{out}");
    for col in [
        "STATE", "CLAIM", "CORDONED", "PHASE", "MACHINE", "IMAGE", "AGE",
    ] {
        assert!(out.contains(col), "kubectl get shows column {col}:\n{out}");
    }
    let line = out
        .lines()
        .find(|l| l.starts_with("machine.anneal.dev/big "))
        .unwrap();
    assert!(
        line.contains("Available") && line.contains("c-big"),
        "{line}"
    );
    let line = out
        .lines()
        .find(|l| l.starts_with("machineclaim.anneal.dev/c-big "))
        .unwrap();
    assert!(line.contains("Bound") && line.contains("big"), "{line}");
    let explain =
        anneal_testinfra::run(cp.kubectl().unwrap().args(["explain", "machine.spec.bmc"])).unwrap();
    println!("{explain}");
    for doc in [
        "baseboard management controller",
        "credentialsSecretRef",
        "redfish://",
        "insecureSkipVerify",
        "caBundleSecretRef",
    ] {
        assert!(
            explain.contains(doc),
            "kubectl explain shows {doc:?}:\n{explain}"
        );
    }

    // 4. Release: deleting the claim marks the machine Released (Retain)
    // and clears its claimRef; the claim goes away. While the machine is
    // Parked the release waits (every controller stands down).
    let before = get_machine(&client, ns, "big").await.status.unwrap().state;
    let set_state = |state: Option<MachineState>| {
        let client = client.clone();
        async move {
            Api::<Machine>::namespaced(client, ns)
                .patch_status(
                    "big",
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"status": {"state": state}})),
                )
                .await
                .unwrap();
        }
    };
    set_state(Some(MachineState::Parked)).await;
    Api::<MachineClaim>::namespaced(client.clone(), ns)
        .delete("c-big", &DeleteParams::default())
        .await
        .unwrap();
    eventually(
        "ReleaseWaitsForUnpark on c-big",
        Duration::from_secs(30),
        || async {
            let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), ns)
                .list(&Default::default())
                .await
                .unwrap();
            let found = events.items.iter().any(|e| {
                e.reason.as_deref() == Some("ReleaseWaitsForUnpark")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("c-big")
            });
            if found {
                Ok(())
            } else {
                Err("no event yet".to_string())
            }
        },
    )
    .await;
    let held = get_machine(&client, ns, "big").await;
    assert!(
        held.spec.claim_ref.is_some(),
        "a Parked machine was released"
    );
    assert_eq!(held.status.unwrap().state, Some(MachineState::Parked));
    assert!(
        Api::<MachineClaim>::namespaced(client.clone(), ns)
            .get_opt("c-big")
            .await
            .unwrap()
            .is_some(),
        "the claim of a Parked machine went before its release"
    );
    set_state(before).await;
    let released = eventually("release of big", Duration::from_secs(60), || async {
        let m = get_machine(&client, ns, "big").await;
        let gone = Api::<MachineClaim>::namespaced(client.clone(), ns)
            .get_opt("c-big")
            .await
            .unwrap()
            .is_none();
        if m.spec.claim_ref.is_none() && gone {
            Ok(m)
        } else {
            Err(format!("{:?} gone={gone}", m.spec.claim_ref))
        }
    })
    .await;
    let st = released.status.unwrap();
    assert_eq!(st.state, Some(MachineState::Released));
    let ready = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(ready.reason, "Released");
    // A Released machine is not taken by the waiting huge claim nor anyone:
    // checked once it is Released (no sleep; a claim freed by the release
    // may bind another machine, so the binds counter is not the measure).
    assert!(
        get_machine(&client, ns, "big")
            .await
            .spec
            .claim_ref
            .is_none()
    );

    // 5. Readiness rules.
    let ns = "ready";
    namespace(&client, ns).await;
    let gate = json!({"gate": "a"});
    machine(
        &client,
        ns,
        "r1",
        gate.clone(),
        json!({"taints": [{"key": "anneal.dev/undiscovered", "effect": "NoBind"}]}),
        "Available",
    )
    .await;
    machine(&client, ns, "r2", gate.clone(), json!({}), "Available").await;
    let rules: Api<ReadinessRule> = Api::namespaced(client.clone(), ns);
    for (name, mode, key) in [
        ("boot", "BootstrapOnly", "anneal.dev/undiscovered"),
        ("cont", "Continuous", "anneal.dev/unhealthy"),
    ] {
        let r: ReadinessRule = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "ReadinessRule", "metadata": {"name": name},
            "spec": {"machineSelector": {"matchLabels": {"gate": "a"}},
                     "conditions": [{"type": if mode == "Continuous" { "Healthy" } else { "Discovered" }, "requiredStatus": "True"}],
                     "enforcementMode": mode, "taint": {"key": key, "effect": "NoBind"}}
        }))
        .unwrap();
        rules.create(&PostParams::default(), &r).await.unwrap();
    }
    let taint_keys = |m: Machine| {
        m.spec
            .taints
            .iter()
            .map(|t| t.key.clone())
            .collect::<BTreeSet<_>>()
    };
    // Continuous applies its taint to both (Healthy is not True); bootstrap keeps r1's.
    eventually(
        "continuous taint applied",
        Duration::from_secs(30),
        || async {
            let k1 = taint_keys(get_machine(&client, ns, "r1").await);
            let k2 = taint_keys(get_machine(&client, ns, "r2").await);
            if k1.len() == 2 && k2.len() == 1 && k2.contains("anneal.dev/unhealthy") {
                Ok(())
            } else {
                Err(format!("{k1:?} {k2:?}"))
            }
        },
    )
    .await;
    let set_conditions = |name: &'static str, conds: Value| {
        let client = client.clone();
        async move {
            let conds: Vec<Value> = conds.as_array().unwrap().iter().map(|c| {
                json!({"type": c[0], "status": c[1], "reason": "Test", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"})
            }).collect();
            Api::<Machine>::namespaced(client, ns)
                .patch_status(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(&json!({"status": {"conditions": conds}})),
                )
                .await
                .unwrap();
        }
    };
    set_conditions("r1", json!([["Discovered", "True"], ["Healthy", "True"]])).await;
    eventually("r1 untainted", Duration::from_secs(30), || async {
        let k1 = taint_keys(get_machine(&client, ns, "r1").await);
        if k1.is_empty() {
            Ok(())
        } else {
            Err(format!("{k1:?}"))
        }
    })
    .await;
    // Discovered goes away: BootstrapOnly does not re-apply; Healthy goes
    // False: Continuous does.
    set_conditions("r1", json!([["Discovered", "False"], ["Healthy", "False"]])).await;
    eventually(
        "r1 re-tainted by the continuous rule only",
        Duration::from_secs(30),
        || async {
            let k1 = taint_keys(get_machine(&client, ns, "r1").await);
            if k1 == BTreeSet::from(["anneal.dev/unhealthy".to_string()]) {
                Ok(())
            } else {
                Err(format!("{k1:?}"))
            }
        },
    )
    .await;
    let st = rules.get("cont").await.unwrap().status.unwrap();
    assert_eq!(st.selected_machines, Some(2));

    // 6. What CEL cannot express: Valid=False with a reason.
    let ns = "valid";
    namespace(&client, ns).await;
    let subnets: Api<anneal_api::Subnet> = Api::namespaced(client.clone(), ns);
    let images: Api<anneal_api::Image> = Api::namespaced(client.clone(), ns);
    let sites: Api<anneal_api::Site> = Api::namespaced(client.clone(), ns);
    let mk = |kind: &str, name: &str, spec: Value| json!({"apiVersion": "anneal.dev/v1alpha1", "kind": kind, "metadata": {"name": name}, "spec": spec});
    let lease = |start: &str, end: &str| {
        json!({
        "siteRef": {"name": "site"}, "cidr": "10.77.0.0/24",
        "bootd": {"serverIP": "10.77.0.2", "mode": "External"},
        "dhcp": {"mode": "lease", "gateway": "10.77.0.1", "leaseRange": {"start": start, "end": end}}})
    };
    subnets
        .create(
            &PostParams::default(),
            &serde_json::from_value(mk("Subnet", "good", lease("10.77.0.100", "10.77.0.200")))
                .unwrap(),
        )
        .await
        .unwrap();
    subnets
        .create(
            &PostParams::default(),
            &serde_json::from_value(mk("Subnet", "outside", lease("10.77.0.100", "10.77.1.20")))
                .unwrap(),
        )
        .await
        .unwrap();
    subnets
        .create(
            &PostParams::default(),
            &serde_json::from_value(mk(
                "Subnet",
                "server-in-range",
                lease("10.77.0.1", "10.77.0.50"),
            ))
            .unwrap(),
        )
        .await
        .unwrap();
    images.create(&PostParams::default(), &serde_json::from_value(mk("Image", "dangling", json!({"bootable": false,
        "layout": {"partitionTable": "gpt", "slots": [{"number": 1, "role": "data", "contentRef": {"name": "nope"}}]}}))).unwrap()).await.unwrap();
    images.create(&PostParams::default(), &serde_json::from_value(mk("Image", "elsewhere", json!({"bootable": false,
        "layout": {"partitionTable": "gpt", "slots": [{"number": 1, "role": "data", "contentRef": {"name": "c", "namespace": "other"}}]}}))).unwrap()).await.unwrap();
    sites
        .create(
            &PostParams::default(),
            &serde_json::from_value(mk(
                "Site",
                "site",
                json!({"seederSubnetRef": {"name": "good"}}),
            ))
            .unwrap(),
        )
        .await
        .unwrap();
    let hooks: Api<anneal_api::PostHook> = Api::namespaced(client.clone(), ns);
    hooks.create(&PostParams::default(), &serde_json::from_value(mk("PostHook", "ok", json!({
        "params": {"label": {"default": "root"}},
        "steps": [{"builtin": "mkswap"}, {"script": {"inline": "tune2fs -L {{ label }} {{ targetDisk }}"}}]}))).unwrap()).await.unwrap();
    hooks
        .create(
            &PostParams::default(),
            &serde_json::from_value(mk(
                "PostHook",
                "undeclared",
                json!({
        "steps": [{"script": {"inline": "echo {{ nope }}"}}]}),
            ))
            .unwrap(),
        )
        .await
        .unwrap();
    hooks
        .create(
            &PostParams::default(),
            &serde_json::from_value(mk(
                "PostHook",
                "missing-cm",
                json!({
        "steps": [{"script": {"configMapRef": {"name": "absent", "key": "run.sh"}}}]}),
            ))
            .unwrap(),
        )
        .await
        .unwrap();
    let valid_reason = |v: Value| -> Option<(String, String)> {
        let c = v["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Valid")?
            .clone();
        Some((
            c["status"].as_str()?.to_string(),
            c["reason"].as_str()?.to_string(),
        ))
    };
    for (what, want_status, want_reason) in [
        ("subnet/good", "True", "Valid"),
        ("subnet/outside", "False", "LeaseRangeOutsideCIDR"),
        ("subnet/server-in-range", "False", "ServerIPInLeaseRange"),
        ("image/dangling", "False", "ContentNotFound"),
        ("image/elsewhere", "False", "ContentNamespaceMismatch"),
        ("site/site", "False", "SeederSubnetHasNoDataHalf"),
        ("posthook/ok", "True", "Valid"),
        ("posthook/undeclared", "False", "UndeclaredParam"),
        ("posthook/missing-cm", "False", "ScriptSourceNotFound"),
    ] {
        eventually(
            &format!("{what} Valid={want_status} {want_reason}"),
            Duration::from_secs(30),
            || async {
                let (kind, name) = what.split_once('/').unwrap();
                let v = match kind {
                    "subnet" => serde_json::to_value(subnets.get(name).await.unwrap()).unwrap(),
                    "image" => serde_json::to_value(images.get(name).await.unwrap()).unwrap(),
                    "posthook" => serde_json::to_value(hooks.get(name).await.unwrap()).unwrap(),
                    _ => serde_json::to_value(sites.get(name).await.unwrap()).unwrap(),
                };
                match valid_reason(v) {
                    Some((s, r)) if s == want_status && r == want_reason => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
    }

    assert_eq!(
        hooks.get("ok").await.unwrap().status.unwrap().step_count,
        Some(2)
    );
    // A claim whose OS image is not bootable is invalid before anything else
    // (even before its named machine is looked up).
    claim(
        &client,
        ns,
        "c-data-as-os",
        json!({"machineName": "absent", "imageRef": {"name": "dangling"}}),
    )
    .await;
    let c = wait_claim(&client, ns, "c-data-as-os", ClaimPhase::Pending, None).await;
    let conds = c.status.unwrap().conditions;
    let valid = conds.iter().find(|c| c.type_ == "Valid").unwrap();
    assert_eq!(
        (valid.status.as_str(), valid.reason.as_str()),
        ("False", "ImageNotBootable"),
        "{valid:?}"
    );

    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(15), manager)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
