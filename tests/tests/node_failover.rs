//! The cluster overlay on the test tier's real node (docs/kubernetes.md, "On a
//! real node (the test tier)"): two manager replicas on the pod network, one
//! leader, a deploy in progress when the leader pod is killed.
//!
//! The overlay is the cluster one adapted to this machine only: the
//! in-cluster API address (the node's relay), images never pulled, a
//! hostPath PersistentVolume for the content store's claim (the test node
//! has no StorageClass), and what a site with managed bootds and machines
//! outside the cluster sets: `anneal-system` at Pod Security `privileged`
//! (bootd on the host's network), the agent API's Service with the
//! provisioning address as an `externalIP` (kube-proxy, iptables mode,
//! sends a machine's connections to a Ready replica), the server workloads
//! on the host's network on that address. The VM (OVMF, TCG) on the
//! provisioning segment is inspected through the pods, the test OS is
//! imported by the ingest Job's pod, the machine is claimed and, while its
//! agent writes, the leader pod is force-deleted (no hand-over): another
//! surviving replica takes the Lease within the lease duration (15 s,
//! counted from the last renewal; the Deployment's replacement, started
//! meanwhile, gives it the first try) and the run in progress completes:
//! one DeployRun,
//! Succeeded, the Machine Provisioned, the deployed OS boots. The
//! Deployment brings a replacement replica up. The node leaves nothing on
//! the host.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_testinfra::{ControlPlane, NODE_DIR, NODE_IP, Node};
use anneal_tests::node_lab::{
    Artifacts, Import, NS, NodeVm, SERVER_IP, Segment, claim, prepare_store, site_and_subnet,
    the_run_succeeded, wait_store_bound, wait_writing,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};

/// The manager's lease duration (its default): the Lease expires at most
/// this long after the kill (counted from the last renewal before it), and
/// the standby tries again at that moment.
const LEASE: Duration = Duration::from_secs(15);

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
async fn killing_the_leader_mid_deploy_hands_over_and_the_deploy_completes() {
    let work = tempfile::tempdir().unwrap();
    let art = Artifacts::build_in(work.path()).await;
    let (images, os) = (&art.images, &art.os);
    let segment = Segment::create();
    let cp = ControlPlane::start().await.unwrap();
    let mut node = Node::start(&cp, images).await.unwrap();
    node.start_kube_proxy(&cp).await.unwrap();
    let api = node.api_address().unwrap();
    prepare_store(&art.vmlinuz, &art.initrd);

    // the content store's volume (no StorageClass on the test node)
    let pv = format!(
        r#"{{"apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {{"name": "anneal-content-node"}},
            "spec": {{"capacity": {{"storage": "500Gi"}}, "accessModes": ["ReadWriteMany"],
                      "persistentVolumeReclaimPolicy": "Retain",
                      "claimRef": {{"namespace": "{NS}", "name": "anneal-content"}},
                      "hostPath": {{"path": "{NODE_DIR}/content", "type": "Directory"}}}}}}"#
    );
    let mut child = cp
        .kubectl()
        .unwrap()
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), pv.as_bytes()).unwrap();
    assert!(child.wait().unwrap().success(), "the PersistentVolume");

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
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --agent-api-name={SERVER_IP}
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --bootd-api-url=https://{SERVER_IP}:8443
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --allow-insecure-bmc
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --workload-host-network
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --content-listen={SERVER_IP}:8088
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --content-url=http://{SERVER_IP}:8088
      - op: add
        path: /spec/template/spec/containers/0/args/-
        value: --fast-track-window=10m
  - target:
      kind: Service
      name: anneal-agent-api
    patch: |-
      - op: add
        path: /spec/externalIPs
        value: ["{SERVER_IP}"]
  - target:
      kind: Namespace
      name: anneal-system
    patch: |-
      - op: replace
        path: /metadata/labels/pod-security.kubernetes.io~1enforce
        value: privileged
"#,
            ip = api.ip(),
            port = api.port()
        ),
    );

    let client = cp.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
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
    let (ready, _) = both("two Ready replicas, one leading").await;
    println!("replicas {ready:?}");

    // a managed bootd, the test OS imported, the VM inspected
    wait_store_bound(&client).await;
    site_and_subnet(&client, false).await;
    let mut import = Import::start(&client, os, work.path()).await;
    let mut vm = NodeVm::enrol(&client, &segment, NODE_IP.parse().unwrap(), work.path()).await;
    vm.wait_state(&client, &pods, "Available", Duration::from_secs(300))
        .await;
    if let Err(why) = import.wait(&client).await {
        vm.fail(&pods, &why).await;
    }

    // claimed; the leader dies without handing over while the agent writes
    let claimed = Instant::now();
    claim(&client).await;
    wait_writing(&client, &vm, &pods, Duration::from_secs(300)).await;
    let leader = holder(&leases).await.unwrap();
    let other = ready_pods(&pods)
        .await
        .into_iter()
        .find(|p| *p != leader)
        .unwrap_or_else(|| panic!("no second Ready replica beside the leader {leader}"));
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
    // The surviving replica leads (the Deployment's replacement, started
    // meanwhile, gives the established standby the first try).
    let deadline = Instant::now() + Duration::from_secs(90);
    let new = loop {
        let h = holder(&leases).await;
        if let Some(h) = h.clone().filter(|h| *h != leader) {
            break h;
        }
        assert!(
            Instant::now() < deadline,
            "the Lease is still held by {h:?} 90 s after {leader} was killed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let took = killed.elapsed();
    println!(
        "{leader} killed {:.1} s after the claim, its run writing; {new} took the Lease {:.1} s later (lease duration {} s)",
        killed.duration_since(claimed).as_secs_f64(),
        took.as_secs_f64(),
        LEASE.as_secs()
    );
    assert_eq!(
        new, other,
        "the Deployment's replacement {new} took the Lease, not the surviving replica {other}"
    );
    assert!(
        took <= LEASE + Duration::from_secs(2),
        "{new} took the Lease {took:?} after the kill: more than the lease duration"
    );
    vm.wait_state(&client, &pods, "Provisioned", Duration::from_secs(600))
        .await;
    let run = the_run_succeeded(&client).await;
    println!(
        "claim → Provisioned in {:.1} s, one run ({}), Succeeded",
        claimed.elapsed().as_secs_f64(),
        run.metadata.name.unwrap_or_default()
    );
    vm.wait_deployed_os(&pods, os).await;
    println!(
        "claim → the deployed OS's marker on the console in {:.1} s",
        claimed.elapsed().as_secs_f64()
    );

    // and the Deployment replaces the dead replica
    let (ready, now) = both("the replacement replica Ready").await;
    assert_ne!(now, leader);
    assert!(!ready.contains(&leader), "{ready:?}");

    vm.delete(&client).await;
    drop(segment);
    let left = node.stop();
    assert!(left.is_empty(), "the node left on the host: {left:?}");
}
