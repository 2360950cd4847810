//! Issue 17: the cluster overlay on the test tier's real node: two manager
//! replicas on the pod network, one leader. The leader pod is killed (force
//! deleted: no graceful hand-over, its Lease must expire); the other
//! replica takes the Lease, and the Deployment brings a new second
//! replica up. The overlay is the cluster one with only the in-cluster API
//! address changed (the node's relay: the test node runs no kube-proxy)
//! and images never pulled. The node leaves nothing on the host.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_testinfra::{ControlPlane, Node};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases
        .get_opt("anneal-manager")
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

async fn ready_pods(pods: &Api<Pod>) -> Vec<String> {
    pods.list(&ListParams::default().labels("app.kubernetes.io/name=anneal-manager"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|p| p.metadata.name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_pod_hands_the_lease_to_the_other_replica() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().to_path_buf();
    let images = tokio::task::spawn_blocking(move || vec![anneal_tests::node::manager_image(&dir)])
        .await
        .unwrap();
    let cp = ControlPlane::start().await.unwrap();
    let node = Node::start(&cp, &images).await.unwrap();
    let api = node.api_address().unwrap();

    anneal_tests::node::apply_overlay(
        &cp,
        &work.path().join("overlay"),
        "cluster",
        &format!(
            r#"  - target:
      kind: Deployment
      name: anneal-manager
    patch: |-
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value: {{name: KUBERNETES_SERVICE_HOST, value: "{ip}"}}
      - op: add
        path: /spec/template/spec/containers/0/env/-
        value: {{name: KUBERNETES_SERVICE_PORT, value: "{port}"}}
      - op: replace
        path: /spec/template/spec/containers/0/imagePullPolicy
        value: Never
"#,
            ip = api.ip(),
            port = api.port()
        ),
    );

    let client = cp.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "anneal-system");
    let leases: Api<Lease> = Api::namespaced(client.clone(), "anneal-system");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "anneal-system");
    let both = |why: &'static str| {
        let (pods, leases, deployments) = (pods.clone(), leases.clone(), deployments.clone());
        async move {
            let deadline = Instant::now() + Duration::from_secs(180);
            loop {
                let ready = ready_pods(&pods).await;
                let leader = holder(&leases).await;
                if ready.len() == 2 && leader.as_ref().is_some_and(|l| ready.contains(l)) {
                    return (ready, leader.unwrap());
                }
                if Instant::now() > deadline {
                    let d = deployments
                        .get("anneal-manager")
                        .await
                        .ok()
                        .and_then(|d| d.status);
                    panic!(
                        "{why}: ready {ready:?}, leader {leader:?}, deployment {d:?}\n{}",
                        anneal_tests::node::manager_logs(&pods).await
                    );
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    let (ready, leader) = both("two Ready replicas, one leading").await;
    println!("replicas {ready:?}, leader {leader}");

    // the leader dies without handing over
    let killed = Instant::now();
    pods.delete(
        &leader,
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        },
    )
    .await
    .unwrap();
    let other = ready.iter().find(|p| **p != leader).unwrap().clone();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let h = holder(&leases).await;
        if h.as_deref() == Some(other.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the Lease is still held by {h:?}, not {other}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "{other} took the Lease {:.1} s after {leader} was killed (lease duration 15 s)",
        killed.elapsed().as_secs_f64()
    );
    // and the Deployment replaces the dead replica
    let (ready, now) = both("the replacement replica Ready").await;
    assert_eq!(now, other);
    assert!(!ready.contains(&leader), "{ready:?}");

    let left = node.stop();
    assert!(left.is_empty(), "the node left on the host: {left:?}");
}
