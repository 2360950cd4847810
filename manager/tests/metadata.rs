//! The metadata endpoint (docs/deploy.md "Day-1 over the network") against
//! a real kube-apiserver, with the manager's claims and reservations
//! controllers binding and reserving for real: a request is answered from
//! the claim of the one Machine holding its source address (a lease-mode
//! reservation or a static address of its claim's networkData), in the
//! OpenStack and NoCloud layouts; another namespace's Machine, an address
//! nobody holds, a Machine that is not deployed, and other methods get
//! nothing. The clients bind loopback source addresses (127.0.0.0/8 all
//! reach the endpoint on 127.0.0.1).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use anneal_api::{Machine, MachineClaim, Subnet};
use anneal_testinfra::ControlPlane;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MARKER: &str = "marker-7f3a9c";

async fn create<K>(client: &Client, ns: &str, obj: Value)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned,
{
    let api: Api<K> = Api::namespaced(client.clone(), ns);
    api.create(
        &PostParams::default(),
        &serde_json::from_value(obj).unwrap(),
    )
    .await
    .unwrap();
}

async fn namespace(client: &Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    api.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": name}})).unwrap(),
    )
    .await
    .unwrap();
}

async fn lab(client: &Client, ns: &str, range: (&str, &str)) {
    create::<Subnet>(
        client,
        ns,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "lab"},
            "spec": {"siteRef": {"name": "site"}, "cidr": "127.0.0.0/24",
                     "bootd": {"serverIP": "127.0.0.1", "mode": "External"},
                     "dhcp": {"mode": "lease", "gateway": "127.0.0.254",
                              "leaseRange": {"start": range.0, "end": range.1}}}}),
    )
    .await;
}

async fn machine(client: &Client, ns: &str, name: &str, mac: &str) {
    create::<Machine>(
        client,
        ns,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": name, "labels": {"rack": "r7"}},
            "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": mac}}),
    )
    .await;
    set_status(client, ns, name, json!({"state": "Available"})).await;
}

async fn set_status(client: &Client, ns: &str, name: &str, status: Value) {
    Api::<Machine>::namespaced(client.clone(), ns)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .unwrap();
}

/// Polls until `f` gives a value (the controllers' writes are what is
/// waited for), at most 60 s.
async fn until<T, F: std::future::Future<Output = Option<T>>>(what: &str, f: impl Fn() -> F) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{what}: not within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET path` (or another method) from source address `from`: (status, body).
async fn get(endpoint: SocketAddr, from: &str, method: &str, path: &str) -> (u16, String) {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(from.parse::<IpAddr>().unwrap(), 0))
        .unwrap();
    let mut s = sock.connect(endpoint).await.unwrap();
    s.write_all(
        format!("{method} {path} HTTP/1.1\r\nhost: metadata\r\nconnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Every layout from `from` answers with m1's data (the endpoint's stores
/// may lag the controllers' writes by a watch event: the first is awaited).
async fn serves_m1(ep: SocketAddr, from: &str) {
    let meta = until("meta_data.json for m1", || async {
        let (code, body) = get(ep, from, "GET", "/openstack/latest/meta_data.json").await;
        (code == 200).then(|| serde_json::from_str::<Value>(&body).unwrap())
    })
    .await;
    assert_eq!(meta["hostname"], "web-1", "{meta}");
    assert_eq!(meta["uuid"], "m1-abc-1", "{meta}");
    assert_eq!(
        meta["public_keys"]["key-0"],
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOperatorKey op@lab"
    );
    assert_eq!(meta["meta"]["rack"], "r7");
    assert_eq!(meta["meta"]["anneal.dev/claim"], "c1");
    let (code, user) = get(ep, from, "GET", "/openstack/2018-08-27/user_data").await;
    assert_eq!(code, 200);
    assert!(
        user.starts_with("#cloud-config") && user.contains(MARKER),
        "{user}"
    );
    let (code, net) = get(ep, from, "GET", "/openstack/latest/network_data.json").await;
    assert_eq!(code, 200, "{net}");
    let net: Value = serde_json::from_str(&net).unwrap();
    assert_eq!(net["links"][0]["ethernet_mac_address"], "52:54:00:5e:00:01");
    assert_eq!(net["networks"][0]["ip_address"], "127.0.0.50");
    assert_eq!(net["networks"][0]["routes"][0]["gateway"], "127.0.0.254");
    assert_eq!(net["services"][0]["address"], "127.0.0.53");
    let (code, nc) = get(ep, from, "GET", "/nocloud/meta-data").await;
    assert_eq!(code, 200);
    let nc: Value = serde_json::from_str(&nc).unwrap();
    assert_eq!(
        (nc["local-hostname"].clone(), nc["instance-id"].clone()),
        (json!("web-1"), json!("m1-abc-1"))
    );
    let (code, _) = get(ep, from, "GET", "/nocloud/network-config").await;
    assert_eq!(code, 200);
    // Ignition cannot carry cloud-init user data: refused, naming it.
    let (code, ign) = get(ep, from, "GET", "/ignition/config.ign").await;
    assert_eq!(code, 422, "{ign}");
    assert!(
        ign.contains("spec.userData") && !ign.contains(MARKER),
        "{ign}"
    );
}

/// Two tenants with a lease-mode Subnet each; in team-a a Secret with
/// user data and keys, Machine m1 and claim c1 (user data, hostname, keys,
/// a static address on the boot NIC); in team-b Machine m2.
async fn world(client: &Client) {
    for ns in ["team-a", "team-b"] {
        namespace(client, ns).await;
    }
    lab(client, "team-a", ("127.0.0.100", "127.0.0.101")).await;
    lab(client, "team-b", ("127.0.0.120", "127.0.0.121")).await;
    create::<Secret>(
        client,
        "team-a",
        json!({"metadata": {"name": "day1"}, "stringData": {
            "userData": format!("#cloud-config\nruncmd:\n  - echo {MARKER} > /root/marker\n"),
            "authorized_keys": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOperatorKey op@lab\n"}}),
    )
    .await;
    machine(client, "team-a", "m1", "52:54:00:5e:00:01").await;
    machine(client, "team-b", "m2", "52:54:00:5e:00:02").await;
    create::<MachineClaim>(
        client,
        "team-a",
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": "c1"},
            "spec": {"machineName": "m1",
                     "userData": {"name": "day1"},
                     "metaData": {"hostname": "web-1", "publicKeysSecretRef": {"name": "day1"}},
                     "networkData": {"ethernets": [{"name": "eno1", "nic": "boot",
                         "addresses": ["127.0.0.50/24"], "gateway4": "127.0.0.254",
                         "nameservers": ["127.0.0.53"]}]}}}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_only_the_machine_holding_the_address() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    world(&client).await;

    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let manager = tokio::spawn(anneal_manager::run(
        client.clone(),
        anneal_manager::RunConfig::default(),
        async {
            let _ = rx.await;
        },
    ));
    let cancel = tokio_util::sync::CancellationToken::new();
    let md = anneal_manager::metadata::start(
        client.clone(),
        anneal_manager::metadata::MetadataConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            namespace: None,
        },
        cancel.clone(),
    )
    .await
    .unwrap();
    let ep = md.addr();

    // The claims controller binds c1 to m1; the Machine is then deployed
    // (its state written here: no lifecycle runs) and holds a reservation.
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), "team-a");
    until("c1 Bound to m1", || async {
        let c = claims.get("c1").await.unwrap();
        let st = c.status?;
        (st.machine_name.as_deref() == Some("m1")).then_some(())
    })
    .await;
    set_status(
        &client,
        "team-a",
        "m1",
        json!({"state": "Provisioned", "currentRunRef": {"name": "m1-abc-1"}}),
    )
    .await;
    set_status(&client, "team-b", "m2", json!({"state": "Provisioned"})).await;
    let subnets_a: Api<Subnet> = Api::namespaced(client.clone(), "team-a");
    let lease = until("m1's reservation", || async {
        let s = subnets_a.get("lab").await.unwrap();
        let r = s.status?.dhcp?.reservations;
        r.iter()
            .find(|r| r.machine == "m1")
            .map(|r| r.address.clone())
    })
    .await;
    let subnets_b: Api<Subnet> = Api::namespaced(client.clone(), "team-b");
    let lease_b = until("m2's reservation", || async {
        let s = subnets_b.get("lab").await.unwrap();
        let r = s.status?.dhcp?.reservations;
        r.iter()
            .find(|r| r.machine == "m2")
            .map(|r| r.address.clone())
    })
    .await;

    // The listing needs no identity.
    let (code, body) = get(ep, "127.0.0.9", "GET", "/openstack/").await;
    assert_eq!(code, 200);
    assert!(
        body.lines().any(|l| l == "2015-10-15") && body.ends_with("latest"),
        "{body}"
    );

    // From m1's lease address and from its claim's static address: m1's data.
    for from in [lease.as_str(), "127.0.0.50"] {
        serves_m1(ep, from).await;
    }

    // An Ignition config as user data is merged into the rendered one (the
    // Secret is read per request).
    let ign_user = json!({"ignition": {"version": "3.4.0"},
        "storage": {"files": [{"path": format!("/etc/{MARKER}")}]}});
    Api::<Secret>::namespaced(client.clone(), "team-a")
        .patch(
            "day1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"stringData": {"userData": ign_user.to_string()}})),
        )
        .await
        .unwrap();
    let (code, ign) = get(ep, &lease, "GET", "/ignition/config.ign").await;
    assert_eq!(code, 200, "{ign}");
    let ign: Value = serde_json::from_str(&ign).unwrap();
    assert!(
        ign["ignition"]["version"]
            .as_str()
            .unwrap()
            .starts_with("3."),
        "{ign}"
    );
    assert!(
        ign["ignition"]["config"]["merge"][0]["source"]
            .as_str()
            .unwrap()
            .starts_with("data:;base64,"),
        "{ign}"
    );
    let files = ign["storage"]["files"].as_array().unwrap();
    assert!(files.iter().any(|f| f["path"] == "/etc/hostname"), "{ign}");
    assert_eq!(
        ign["passwd"]["users"][0]["sshAuthorizedKeys"][0],
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOperatorKey op@lab"
    );

    // Another namespace's Machine (deployed, holding an address, no claim),
    // an address nobody holds, another method, an unknown path: nothing of
    // m1's, and no Machine named.
    for (from, method, path, want) in [
        (lease_b.as_str(), "GET", "/openstack/latest/user_data", 404),
        (
            lease_b.as_str(),
            "GET",
            "/openstack/latest/meta_data.json",
            404,
        ),
        ("127.0.0.9", "GET", "/openstack/latest/meta_data.json", 404),
        (
            lease.as_str(),
            "POST",
            "/openstack/latest/meta_data.json",
            405,
        ),
        (lease.as_str(), "GET", "/latest/meta-data/", 404),
        (
            lease.as_str(),
            "GET",
            "/openstack/latest/../../../etc/passwd",
            404,
        ),
    ] {
        let (code, body) = get(ep, from, method, path).await;
        assert_eq!(code, want, "{from} {method} {path}: {body}");
        assert!(!body.contains(MARKER) && !body.contains("web-1"), "{body}");
        if from == "127.0.0.9" {
            assert!(!body.contains("m1") && !body.contains("team-a"), "{body}");
        }
    }

    // A Machine that is no longer deployed is served nothing.
    set_status(&client, "team-a", "m1", json!({"state": "Deprovisioning"})).await;
    let (code, body) = get(ep, &lease, "GET", "/openstack/latest/user_data").await;
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("not Provisioning or Provisioned"), "{body}");

    cancel.cancel();
    md.join().await;
    let _ = stop.send(());
    manager.await.unwrap().unwrap();
}
