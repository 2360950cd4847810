//! The test tier's real node (docs/kubernetes.md, "On a real node (the test
//! tier)"): containerd and runc from Debian, kubelet, kube-scheduler and
//! kube-controller-manager built from the pinned Go modules, joined to a real
//! kube-apiserver. The node becomes Ready; a FROM-scratch pod of the agent's
//! image (built by `anneal-oci`, imported with `ctr`, sandboxed by our own
//! pause) runs to completion and its log comes back through the API server
//! from the kubelet; a second pod on the pod network (the bridge CNI plugin)
//! serves the agent's tracker, reached from the host at its pod IP. Stopping
//! the node leaves nothing on the host: no iptables chain, mount, cgroup,
//! process, file, bridge, and ip_forward as it was.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use anneal_testinfra::{ControlPlane, Node};
use anneal_tests::wait::eventually;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use serde_json::json;

fn pod(name: &str, args: &[&str], restart: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart,
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65532,
                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "agent",
                "image": "docker.io/anneal/agent:dev",
                "imagePullPolicy": "Never",
                "command": ["/anneal-agent"],
                "args": args,
                "securityContext": {"allowPrivilegeEscalation": false,
                    "readOnlyRootFilesystem": true, "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_runs_from_scratch_pods_and_leaves_nothing_behind() {
    let work = tempfile::tempdir().unwrap();
    let image = tokio::task::spawn_blocking({
        let d = work.path().to_path_buf();
        move || {
            anneal_tests::node::image(
                "agent",
                &anneal_tests::artifacts::agent_musl(),
                "anneal-agent",
                &d,
            )
        }
    })
    .await
    .unwrap();
    let cp = ControlPlane::start().await.unwrap();
    let node = Node::start(&cp, &[image]).await.unwrap();
    println!(
        "node Ready {:.1} s after its start",
        node.startup_time().as_secs_f64()
    );
    let client = cp.client();
    // the controller manager creates the namespace's ServiceAccount
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    eventually(
        "ServiceAccount default/default",
        Duration::from_secs(60),
        || async { sas.get_opt("default").await.ok().flatten() },
    )
    .await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod("hello", &["--help"], "Never"))
        .await
        .unwrap();
    let phase = |name: &'static str, want: &'static str| {
        let pods = pods.clone();
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                let st = pods.get(name).await.unwrap().status.unwrap_or_default();
                if st.phase.as_deref() == Some(want) {
                    return st;
                }
                assert!(
                    st.phase.as_deref() != Some("Failed") && std::time::Instant::now() < deadline,
                    "pod {name} not {want}: {st:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    phase("hello", "Succeeded").await;
    // its log, from the kubelet through the API server
    let log = pods.logs("hello", &Default::default()).await.unwrap();
    assert!(log.contains("Usage: anneal-agent"), "{log}");

    // a pod on the pod network, reached from the host
    pods.create(
        &PostParams::default(),
        &pod(
            "tracker",
            &["tracker", "--listen", "0.0.0.0:6969"],
            "Always",
        ),
    )
    .await
    .unwrap();
    let st = phase("tracker", "Running").await;
    let ip = st.pod_ip.unwrap();
    assert!(ip.starts_with("10.89.0."), "{ip}");
    let stats = eventually(
        "the tracker's /stats at the pod IP",
        Duration::from_secs(60),
        || async {
            let out = Command::new("curl")
                .args(["-sf", "--max-time", "5"])
                .arg(format!("http://{ip}:6969/stats"))
                .output()
                .ok()?;
            serde_json::from_slice::<serde_json::Value>(&out.stdout).ok()
        },
    )
    .await;
    assert!(stats.get("torrents").is_some(), "{stats}");

    let left = node.stop();
    assert!(left.is_empty(), "the node left on the host: {left:?}");
}
