//! Issue 17: anneal installed with `kubectl apply -k` on the test tier's
//! real node. The manager's and the workloads' FROM-scratch images
//! (`anneal-oci` over the static musl binaries, as `deploy/images` builds
//! them) are imported into the node's containerd; the appliance overlay is
//! applied through a test overlay that only adapts it to this machine (the
//! API server's loopback address as the in-cluster one, since the test
//! node runs no kube-proxy; the manager's ports on the node's address
//! instead of all interfaces; the content store under the node's
//! directory). The manager pod becomes Ready (its readiness probe answered
//! by the manager itself), holds the Lease `anneal-system/anneal-manager`
//! under its own name, and writes the agent API's CA Secret with its own
//! ServiceAccount. The node leaves nothing on the host.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anneal_testinfra::{ControlPlane, NODE_DIR, Node};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams};

fn image(oci: &Path, name: &str, bin: &Path, path: &str, out: &Path) -> PathBuf {
    let archive = out.join(format!("{name}.oci.tar"));
    let st = Command::new(oci)
        .args(["build", "--name", &format!("anneal/{name}"), "--tag", "dev"])
        .args(["--entrypoint", &format!("/{path}")])
        .arg(format!("--file={path}={}", bin.display()))
        .args(["--ca-roots", "/etc/ssl/certs/ca-certificates.crt"])
        .arg("--out")
        .arg(&archive)
        .status()
        .unwrap();
    assert!(st.success());
    archive
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_appliance_install_runs_the_manager_as_a_pod_holding_the_lease() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().to_path_buf();
    let images = tokio::task::spawn_blocking(move || {
        let oci = anneal_tests::artifacts::oci_tool();
        let manager = anneal_tests::artifacts::manager_musl();
        let agent = anneal_tests::artifacts::agent_musl();
        vec![
            image(&oci, "manager", &manager, "manager", &dir),
            image(&oci, "agent", &agent, "anneal-agent", &dir),
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
    let overlay = work.path().join("overlay");
    std::fs::create_dir_all(&overlay).unwrap();
    // kustomize takes a base by relative path only
    let appliance = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/overlays/appliance")
        .canonicalize()
        .unwrap();
    let up = "../".repeat(overlay.canonicalize().unwrap().components().count() - 1);
    let appliance = format!(
        "{up}{}",
        appliance.display().to_string().trim_start_matches('/')
    );
    std::fs::write(
        overlay.join("kustomization.yaml"),
        format!(
            r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - {appliance}
patches:
  - target:
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
    )
    .unwrap();
    let out = cp
        .kubectl()
        .unwrap()
        .args(["apply", "-k"])
        .arg(&overlay)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl apply -k: {}",
        String::from_utf8_lossy(&out.stderr)
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
            let mut logs = String::new();
            for p in &list.items {
                let name = p.metadata.name.clone().unwrap_or_default();
                logs.push_str(&format!(
                    "pod {name}: {:?}\nlog: {}\n",
                    p.status,
                    pods.logs(&name, &Default::default())
                        .await
                        .unwrap_or_default()
                ));
            }
            panic!("the manager pod is not Ready after 180 s:\n{logs}");
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

    let left = node.stop();
    assert!(left.is_empty(), "the node left on the host: {left:?}");
}
