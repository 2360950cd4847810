//! Issue 17: anneal installed with `kubectl apply -k` on the test tier's
//! real node. FROM-scratch images built by `anneal-oci` are imported into
//! the node's containerd: the workloads' (the static musl agent, as
//! `deploy/images` builds it) and the manager's (the test build's manager
//! with its shared libraries, `anneal_tests::node::manager_image`: no
//! second compile for musl in the suite); the appliance overlay is
//! applied through a test overlay that only adapts it to this machine (the
//! API server's loopback address as the in-cluster one, since the test
//! node runs no kube-proxy; the manager's ports on the node's address
//! instead of all interfaces; the content store under the node's
//! directory). The manager pod becomes Ready (its readiness probe answered
//! by the manager itself), holds the Lease `anneal-system/anneal-manager`
//! under its own name, and writes the agent API's CA Secret with its own
//! ServiceAccount. The node leaves nothing on the host.
//!
//! Then a managed bootd: a Site and a lease-mode Subnet with
//! `spec.bootd.mode: Managed` (the host's network) in `anneal-system`. The
//! manager runs `bootd-<subnet>` as a Deployment from bootd's image (the
//! test build's bootd with its shared libraries), as `anneal-bootd`, on the
//! interface the test gave `serverIP` (a bridge with no port: nothing leaves
//! the host). bootd makes the reservation table live
//! (`status.dhcp.appliedRevision`), the Subnet says `BootdAvailable=True`,
//! and bootd serves a first stage from the content store's `boot/files`.
//! Deleting the Subnet removes the Deployment through its owner reference
//! (the node's garbage collector).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_testinfra::{ControlPlane, NODE_DIR, Node};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, ListParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_appliance_install_runs_the_manager_as_a_pod_holding_the_lease() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().to_path_buf();
    let images = tokio::task::spawn_blocking(move || {
        let agent = anneal_tests::artifacts::agent_musl();
        vec![
            anneal_tests::node::manager_image(&dir),
            anneal_tests::node::image("agent", &agent, "anneal-agent", &dir),
            anneal_tests::node::bootd_image(&dir),
        ]
    })
    .await
    .unwrap();
    let cp = ControlPlane::start().await.unwrap();
    let node = Node::start(&cp, &images).await.unwrap();
    let api_port = cp.url().rsplit(':').next().unwrap().to_string();
    let metrics = anneal_testinfra::free_port().unwrap();
    let agent_api = anneal_testinfra::free_port().unwrap();
    let node_ip = anneal_testinfra::NODE_IP;

    // the test overlay: the appliance, adapted to this machine only
    anneal_tests::node::apply_overlay(
        &cp,
        &work.path().join("overlay"),
        "appliance",
        &format!(
            r#"  - target:
      kind: Deployment
      name: anneal-manager
    patch: |-
      - op: replace
        path: /spec/template/spec/containers/0/args
        value:
          - run
          - --lease-namespace=anneal-system
          - --metrics-addr={node_ip}:{metrics}
          - --agent-api-listen={node_ip}:{agent_api}
          - --agent-api-name={node_ip}
          - --workload-executor=kubernetes
          - --workload-image=docker.io/anneal/agent:dev
          - --workload-namespace=anneal-system
          - --content-claim=anneal-content
      - op: replace
        path: /spec/template/spec/containers/0/ports
        value:
          - name: agent-api
            containerPort: {agent_api}
          - name: metrics
            containerPort: {metrics}
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value: {{name: KUBERNETES_SERVICE_HOST, value: "127.0.0.1"}}
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value: {{name: KUBERNETES_SERVICE_PORT, value: "{api_port}"}}
      - op: replace
        path: /spec/template/spec/containers/0/imagePullPolicy
        value: Never
  - target:
      kind: PersistentVolume
      name: anneal-content
    patch: |-
      - op: replace
        path: /spec/hostPath/path
        value: {NODE_DIR}/content
"#
        ),
    );

    let client = cp.client();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "anneal-system");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(180);
    let pod = loop {
        let d = deployments.get("anneal-manager").await.unwrap();
        let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
        let list = pods
            .list(&ListParams::default().labels("app.kubernetes.io/name=anneal-manager"))
            .await
            .unwrap();
        if ready == 1 && list.items.len() == 1 {
            break list.items[0].clone();
        }
        if Instant::now() > deadline {
            panic!(
                "the manager pod is not Ready after 180 s:\n{}",
                anneal_tests::node::manager_logs(&pods).await
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let pod_name = pod.metadata.name.unwrap();
    println!("manager pod {pod_name} Ready");

    // it leads, under its own name
    let leases: Api<Lease> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let holder = leases
            .get_opt("anneal-manager")
            .await
            .unwrap()
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity);
        if holder.as_deref() == Some(pod_name.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the Lease is held by {holder:?}, not the pod {pod_name}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // and acts with its own ServiceAccount: the agent API's CA
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(60);
    while secrets
        .get_opt("anneal-agent-api-ca")
        .await
        .unwrap()
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "no agent API CA Secret after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    managed_bootd(&client, &pods).await;

    let left = node.stop();
    assert!(left.is_empty(), "the node left on the host: {left:?}");
}

/// The (port-less) bridge holding the managed bootd's `serverIP`, removed on
/// drop (by name: the test created it).
struct PortlessBridge(&'static str);

impl PortlessBridge {
    fn create(name: &'static str, cidr: &str) -> PortlessBridge {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", name])
            .output();
        for args in [
            vec!["link", "add", name, "type", "bridge"],
            vec!["addr", "add", cidr, "dev", name],
            vec!["link", "set", name, "up"],
        ] {
            let out = std::process::Command::new("ip")
                .args(&args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        PortlessBridge(name)
    }
}

impl Drop for PortlessBridge {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", self.0])
            .output();
    }
}

async fn managed_bootd(client: &kube::Client, pods: &Api<Pod>) {
    use anneal_api::Subnet;
    use anneal_api::conditions::types;
    const SERVER_IP: &str = "10.90.0.1";
    let _bridge = PortlessBridge::create("anlbd0", &format!("{SERVER_IP}/24"));
    // the boot files an operator puts into the content store
    let boot = std::path::Path::new(NODE_DIR).join("content/boot");
    std::fs::create_dir_all(boot.join("files")).unwrap();
    std::fs::write(boot.join("vmlinuz"), b"kernel").unwrap();
    std::fs::write(boot.join("initrd.img"), b"initrd").unwrap();
    let first_stage = b"a first stage from the content store".to_vec();
    std::fs::write(boot.join("files/snponly.efi"), &first_stage).unwrap();

    let apply = |v: serde_json::Value| {
        let client = client.clone();
        async move {
            let cp = kube::api::PatchParams::apply("node-install-test");
            let name = v["metadata"]["name"].as_str().unwrap().to_string();
            let obj: kube::api::DynamicObject = serde_json::from_value(v.clone()).unwrap();
            let ar = kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
                "anneal.dev",
                "v1alpha1",
                v["kind"].as_str().unwrap(),
            ));
            Api::<kube::api::DynamicObject>::namespaced_with(client, "anneal-system", &ar)
                .patch(&name, &cp, &kube::api::Patch::Apply(&obj))
                .await
                .unwrap();
        }
    };
    apply(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Site",
        "metadata": {"name": "rack1", "namespace": "anneal-system"}, "spec": {}}))
    .await;
    apply(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": "rack1", "namespace": "anneal-system"},
        "spec": {"siteRef": {"name": "rack1"}, "cidr": "10.90.0.0/24",
                 "bootd": {"serverIP": SERVER_IP, "mode": "Managed"},
                 "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.90.0.100", "end": "10.90.0.150"}}}}))
    .await;

    let applied = Instant::now();
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), "anneal-system");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "anneal-system");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = subnets.get("rack1").await.unwrap();
        let st = s.status.clone().unwrap_or_default();
        let available = st
            .conditions
            .iter()
            .find(|c| c.type_ == types::BOOTD_AVAILABLE)
            .map(|c| format!("{} {}: {}", c.status, c.reason, c.message));
        let dhcp = st.dhcp.clone().unwrap_or_default();
        let live = dhcp.revision.is_some() && dhcp.applied_revision == dhcp.revision;
        if live && available.as_deref().is_some_and(|a| a.starts_with("True")) {
            println!(
                "managed bootd live {:.1} s after the Subnet: {}",
                applied.elapsed().as_secs_f64(),
                available.unwrap_or_default()
            );
            break;
        }
        let last = format!("BootdAvailable {available:?}, dhcp {dhcp:?}");
        if Instant::now() > deadline {
            let mut logs = String::new();
            for p in pods
                .list(&ListParams::default().labels("app.kubernetes.io/component=bootd"))
                .await
                .unwrap()
                .items
            {
                let name = p.metadata.name.clone().unwrap_or_default();
                let log = pods
                    .logs(&name, &Default::default())
                    .await
                    .unwrap_or_default();
                logs.push_str(&format!("--- {name}: {:?}\n{log}\n", p.status));
            }
            panic!(
                "the managed bootd is not live after 120 s: {last}\n{logs}\n{}",
                anneal_tests::node::manager_logs(pods).await
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let d = deployments.get("bootd-rack1").await.unwrap();
    assert_eq!(
        d.owner_references().first().map(|o| o.kind.as_str()),
        Some("Subnet")
    );
    // it serves the content store's first stage on serverIP
    let answer = http_get(&format!("{SERVER_IP}:8080"), "/files/snponly.efi").await;
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"),
        "{text}"
    );
    assert!(answer.ends_with(&first_stage), "{text}");

    // the Subnet deleted: the garbage collector removes its bootd
    subnets.delete("rack1", &Default::default()).await.unwrap();
    let deleted = Instant::now();
    let deadline = deleted + Duration::from_secs(90);
    loop {
        let d = deployments.get_opt("bootd-rack1").await.unwrap();
        let left = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=bootd"))
            .await
            .unwrap()
            .items
            .len();
        if d.is_none() && left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bootd-rack1 still there 90 s after its Subnet was deleted ({left} pods)"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "Subnet deleted: its bootd Deployment and pod gone {:.1} s later",
        deleted.elapsed().as_secs_f64()
    );
}

/// A plain HTTP/1.0 GET: the whole answer, head and body.
async fn http_get(addr: &str, path: &str) -> Vec<u8> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), c.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}
