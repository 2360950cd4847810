//! Tenancy against a real kube-apiserver:
//!
//! 1. A Machine admitted before admission refused it (the CRD of an older
//!    release, without the namespace rules) whose BMC Secret reference names
//!    another namespace gets `BMCReachable=False` (`CrossNamespaceSecret`):
//!    the other namespace's Secret is never read and nothing reaches the
//!    BMC; a `redfish+http://` BMC is refused (`InsecureBMCRefused`) while
//!    the manager runs without `--allow-insecure-bmc`.
//! 2. One boot MAC per Subnet across namespaces: a second Machine (another
//!    namespace) enrolling a MAC already enrolled on the Subnet gets
//!    `Valid=False` (`DuplicateBootMAC`, naming the first as
//!    namespace/name) and never the reservation; a Machine of a namespace
//!    the Subnet does not grant (`spec.allowedNamespaces`) gets
//!    `SubnetNotGranted` and no reservation; when the first Machine goes,
//!    the second holds the MAC.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anneal_api::{Machine, Subnet};
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_testinfra::ControlPlane;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

/// Generous: a loaded 2-core machine may take seconds for a watch event.
const WAIT: Duration = Duration::from_secs(60);

async fn namespace(client: &Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    api.create(&PostParams::default(), &ns).await.unwrap();
}

async fn secret(client: &Client, ns: &str, name: &str, data: Value) {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let s: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": ns},
        "stringData": data,
    }))
    .unwrap();
    api.create(&PostParams::default(), &s).await.unwrap();
}

async fn machine(client: &Client, ns: &str, name: &str, spec: Value) {
    let api: Api<Machine> = Api::namespaced(client.clone(), ns);
    let m: Machine = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }))
    .unwrap();
    api.create(&PostParams::default(), &m)
        .await
        .unwrap_or_else(|e| panic!("creating Machine {ns}/{name}: {e}"));
}

/// The condition `type_` of a Machine as JSON.
fn condition(m: &Machine, type_: &str) -> Option<Value> {
    let v = serde_json::to_value(m).unwrap();
    v["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

/// Waits (on a watch) for condition `type_` of Machine `ns/name` to have
/// `status` and `reason`; returns its message. On timeout, panics with the
/// Machine's conditions as last seen.
async fn wait_condition(
    client: &Client,
    ns: &str,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
) -> String {
    let api: Api<Machine> = Api::namespaced(client.clone(), ns);
    let cond = |m: Option<&Machine>| {
        m.and_then(|m| condition(m, type_))
            .is_some_and(|c| c["status"] == status && c["reason"] == reason)
    };
    match tokio::time::timeout(WAIT, await_condition(api.clone(), name, cond)).await {
        Ok(m) => {
            let m = m.unwrap().unwrap();
            condition(&m, type_).unwrap()["message"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        }
        Err(_) => {
            let seen = api.get(name).await.unwrap();
            let v = serde_json::to_value(&seen).unwrap();
            panic!(
                "Machine {ns}/{name}: {type_}={status} ({reason}) not reached in {WAIT:?}; conditions: {}",
                v["status"]["conditions"]
            );
        }
    }
}

/// The Machine CRD as an older release generated it: without the rules
/// that refuse a Secret reference's namespace, so such a Machine can still
/// be stored (as it was before this release).
fn crds_without_namespace_rules()
-> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>
{
    fn strip(v: &mut Value) {
        match v {
            Value::Object(o) => {
                if let Some(Value::Array(rules)) = o.get_mut("x-kubernetes-validations") {
                    rules.retain(|r| {
                        !r["rule"]
                            .as_str()
                            .is_some_and(|s| s.contains("SecretRef.namespace"))
                    });
                }
                o.values_mut().for_each(strip);
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    anneal_api::crds()
        .into_iter()
        .map(|c| {
            let mut v = serde_json::to_value(&c).unwrap();
            strip(&mut v);
            serde_json::from_value(v).unwrap()
        })
        .collect()
}

/// A TCP listener standing in for the BMC: counts every connection (a
/// request would carry the credentials) and reads what is sent.
async fn fake_bmc() -> (u16, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = tokio::io::AsyncReadExt::read(&mut sock, &mut buf).await;
            });
        }
    });
    (port, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_secrets_and_plain_http_bmcs_are_refused_before_any_request() {
    let t0 = Instant::now();
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&crds_without_namespace_rules())
        .await
        .unwrap();
    let client = cp.client();
    for ns in ["anneal-system", "tenant-a", "tenant-b"] {
        namespace(&client, ns).await;
    }
    // tenant-b's BMC credentials: what tenant-a must never obtain
    let victim = json!({"username": "tenant-b-admin", "password": "tenant-b-secret"});
    secret(&client, "tenant-b", "bmc", victim).await;
    secret(
        &client,
        "tenant-b",
        "ca",
        json!({"ca.crt": "not a certificate"}),
    )
    .await;
    let own = json!({"username": "tenant-a-admin", "password": "tenant-a-secret"});
    secret(&client, "tenant-a", "bmc", own).await;

    let (port, connections) = fake_bmc().await;
    let https = format!("redfish://127.0.0.1:{port}");
    machine(
        &client,
        "tenant-a",
        "foreign-creds",
        json!({"subnetRef": {"name": "lab"}, "bmc": {"address": https, "insecureSkipVerify": true,
               "credentialsSecretRef": {"name": "bmc", "namespace": "tenant-b"}}}),
    )
    .await;
    machine(
        &client,
        "tenant-a",
        "foreign-ca",
        json!({"subnetRef": {"name": "lab"}, "bmc": {"address": https,
               "credentialsSecretRef": {"name": "bmc"},
               "caBundleSecretRef": {"name": "ca", "namespace": "tenant-b"}}}),
    )
    .await;
    machine(
        &client,
        "tenant-a",
        "plain-http",
        json!({"subnetRef": {"name": "lab"}, "bmc": {"address": format!("redfish+http://127.0.0.1:{port}"),
               "credentialsSecretRef": {"name": "bmc"}}}),
    )
    .await;

    // the manager's lifecycle half as `manager run` starts it without
    // --allow-insecure-bmc
    let cancel = tokio_util::sync::CancellationToken::new();
    let (_api, _ctl) = anneal_manager::lifecycle::start(
        client.clone(),
        LifecycleConfig::default(),
        AgentApiConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            namespace: "anneal-system".into(),
            ..AgentApiConfig::default()
        },
        cancel.clone(),
    )
    .await
    .unwrap();

    let msg = wait_condition(
        &client,
        "tenant-a",
        "foreign-creds",
        "BMCReachable",
        "False",
        "CrossNamespaceSecret",
    )
    .await;
    println!("foreign-creds: {msg}");
    assert!(
        msg.contains("spec.bmc.credentialsSecretRef.namespace")
            && msg.contains("own namespace (tenant-a)"),
        "{msg}"
    );
    let msg = wait_condition(
        &client,
        "tenant-a",
        "foreign-ca",
        "BMCReachable",
        "False",
        "CrossNamespaceSecret",
    )
    .await;
    println!("foreign-ca: {msg}");
    assert!(
        msg.contains("spec.bmc.caBundleSecretRef.namespace"),
        "{msg}"
    );
    let msg = wait_condition(
        &client,
        "tenant-a",
        "plain-http",
        "BMCReachable",
        "False",
        "InsecureBMCRefused",
    )
    .await;
    println!("plain-http: {msg}");
    assert!(msg.contains("--allow-insecure-bmc"), "{msg}");

    // Each refusal is decided before the BMC would be called in the same
    // pass, and the conditions are written after it: no connection ever.
    assert_eq!(
        connections.load(Ordering::SeqCst),
        0,
        "the BMC was contacted (credentials sent)"
    );
    // ...and the operator sees it as an Event on the Machine
    // (Events are published off the reconcile path: awaited, bounded.)
    let events: Api<Event> = Api::namespaced(client.clone(), "tenant-a");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let evs = events.list(&ListParams::default()).await.unwrap().items;
        let notes: Vec<String> = evs
            .iter()
            .filter(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("foreign-creds")
            })
            .filter_map(|e| e.note.clone())
            .collect();
        if notes.iter().any(|n| n.starts_with("CrossNamespaceSecret")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no Event naming CrossNamespaceSecret on foreign-creds: {notes:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    cancel.cancel();
    println!("done in {:.1} s", t0.elapsed().as_secs_f64());
}

fn reservations(s: &Subnet) -> Vec<(String, String)> {
    s.status
        .as_ref()
        .and_then(|st| st.dhcp.as_ref())
        .map(|d| {
            d.reservations
                .iter()
                .map(|r| (r.machine.clone(), r.mac.clone()))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_boot_mac_per_subnet_across_namespaces() {
    let t0 = Instant::now();
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    for ns in ["infra", "tenant-a", "tenant-b", "tenant-c"] {
        namespace(&client, ns).await;
    }
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), "infra");
    let s: Subnet = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": "lab", "namespace": "infra"},
        "spec": {
            "siteRef": {"name": "site"}, "cidr": "10.77.0.0/24",
            "bootd": {"serverIP": "10.77.0.1", "mode": "External"},
            "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.77.0.100", "end": "10.77.0.110"}},
            "allowedNamespaces": ["tenant-a", "tenant-b"]
        }
    }))
    .unwrap();
    subnets.create(&PostParams::default(), &s).await.unwrap();

    const MAC: &str = "52:54:00:15:00:01";
    let lab = json!({"name": "lab", "namespace": "infra"});
    // all three net-boot (Inspecting) from the start, so the first table
    // the manager writes considers every one of them
    for (ns, name, mac) in [
        ("tenant-a", "first", MAC),
        // the same MAC, later, from another granted namespace
        ("tenant-b", "thief", MAC),
        ("tenant-c", "stranger", "52:54:00:15:00:03"),
    ] {
        machine(
            &client,
            ns,
            name,
            json!({"subnetRef": lab, "bootMACAddress": mac}),
        )
        .await;
        Api::<Machine>::namespaced(client.clone(), ns)
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": {"state": "Inspecting"}})),
            )
            .await
            .unwrap();
    }

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let manager = tokio::spawn(anneal_manager::run(
        client.clone(),
        anneal_manager::RunConfig::default(),
        async {
            let _ = stopped.await;
        },
    ));

    // the first table: only the first Machine holds the MAC
    let cond = |s: Option<&Subnet>| s.is_some_and(|s| !reservations(s).is_empty());
    let s = tokio::time::timeout(WAIT, await_condition(subnets.clone(), "lab", cond))
        .await
        .expect("no reservation table written")
        .unwrap()
        .unwrap();
    assert_eq!(
        reservations(&s),
        [("tenant-a/first".to_string(), MAC.to_string())],
        "only tenant-a/first may hold {MAC} (no duplicate, no ungranted namespace)"
    );

    let msg = wait_condition(
        &client,
        "tenant-b",
        "thief",
        "Valid",
        "False",
        "DuplicateBootMAC",
    )
    .await;
    println!("thief: {msg}");
    assert!(
        msg.contains("Machine tenant-a/first") && msg.contains("infra/lab"),
        "{msg}"
    );
    let msg = wait_condition(
        &client,
        "tenant-c",
        "stranger",
        "Valid",
        "False",
        "SubnetNotGranted",
    )
    .await;
    println!("stranger: {msg}");
    assert!(
        msg.contains("spec.allowedNamespaces") && msg.contains("tenant-c"),
        "{msg}"
    );
    wait_condition(&client, "tenant-a", "first", "Valid", "True", "Valid").await;
    let events: Api<Event> = Api::namespaced(client.clone(), "tenant-b");
    let evs = events.list(&ListParams::default()).await.unwrap().items;
    assert!(
        evs.iter()
            .any(|e| e.reason.as_deref() == Some("DuplicateBootMAC")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("thief")),
        "no DuplicateBootMAC Event on tenant-b/thief"
    );

    // the first Machine goes: the next one holds the MAC
    Api::<Machine>::namespaced(client.clone(), "tenant-a")
        .delete("first", &DeleteParams::default())
        .await
        .unwrap();
    wait_condition(&client, "tenant-b", "thief", "Valid", "True", "Valid").await;
    let cond = |s: Option<&Subnet>| {
        s.is_some_and(|s| reservations(s).iter().any(|(m, _)| m == "tenant-b/thief"))
    };
    let s = tokio::time::timeout(WAIT, await_condition(subnets.clone(), "lab", cond))
        .await
        .expect("tenant-b/thief never got the reservation after tenant-a/first was deleted")
        .unwrap()
        .unwrap();
    assert_eq!(
        reservations(&s)
            .into_iter()
            .map(|(m, _)| m)
            .collect::<Vec<_>>(),
        ["tenant-b/thief"]
    );

    let _ = stop.send(());
    manager.await.unwrap().unwrap();
    println!(
        "done in {:.1} s; subnet {}",
        t0.elapsed().as_secs_f64(),
        s.name_any()
    );
}
