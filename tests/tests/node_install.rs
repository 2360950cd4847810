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
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_testinfra::{ControlPlane, NODE_DIR, Node};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
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

    let left = node.stop();
    assert!(left.is_empty(), "the node left on the host: {left:?}");
}
