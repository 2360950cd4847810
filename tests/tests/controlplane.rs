//! The control plane the tests use is real: a kube-apiserver backed by etcd
//! installs our CRDs generated from the Rust types, serves the status
//! subresource and enforces optimistic concurrency.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anneal_api::Machine;
use anneal_testinfra::{ControlPlane, process_alive};
use kube::api::{Api, Patch, PatchParams, PostParams};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_apiserver_serves_our_crds_status_and_conflicts() {
    let cp = ControlPlane::start().await.unwrap();
    let startup = cp.startup_time();
    println!("control plane start-up: {:.2} s", startup.as_secs_f64());
    // Generous: a loaded 2-core machine may take several times the quiet
    // start-up; the printed figure is the measurement.
    assert!(
        startup < Duration::from_secs(120),
        "control plane took {startup:?} to start"
    );
    let pids = cp.pids();

    cp.install_crds(&anneal_api::crds()).await.unwrap();

    let machines: Api<Machine> = Api::namespaced(cp.client(), "default");
    let m: Machine = serde_json::from_value(serde_json::json!({
        "apiVersion": "anneal.dev/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": "cp-test"},
        "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": "52:54:00:00:00:01"}
    }))
    .unwrap();
    let created = machines.create(&PostParams::default(), &m).await.unwrap();
    let stale_rv = created.metadata.resource_version.clone().unwrap();

    // Status goes through the status subresource ...
    let status = serde_json::json!({"status": {"state": "Enrolling", "poweredOn": false}});
    machines
        .patch_status("cp-test", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let after = machines.get("cp-test").await.unwrap();
    let after_json = serde_json::to_value(&after).unwrap();
    assert_eq!(after_json["status"]["state"], "Enrolling", "{after_json}");
    assert_ne!(
        after.metadata.resource_version.as_deref(),
        Some(stale_rv.as_str())
    );

    // ... and a write to the main resource cannot change it.
    let mut with_status = after_json.clone();
    with_status["status"]["state"] = "Available".into();
    let replaced: Machine = machines
        .replace(
            "cp-test",
            &PostParams::default(),
            &serde_json::from_value(with_status).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        serde_json::to_value(&replaced).unwrap()["status"]["state"],
        "Enrolling"
    );

    // An update carrying a stale resourceVersion is refused with 409.
    let mut stale = created.clone();
    stale.metadata.resource_version = Some(stale_rv);
    stale.spec.unclaimable = true;
    match machines
        .replace("cp-test", &PostParams::default(), &stale)
        .await
    {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 409, "{e:?}"),
        other => panic!("expected 409 Conflict, got {other:?}"),
    }

    // kubectl (built from the same release) talks to it too.
    let out = cp
        .kubectl()
        .unwrap()
        .args(["get", "machines", "-o", "name"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "machine.anneal.dev/cp-test"
    );

    drop(cp);
    for pid in pids {
        assert!(
            !process_alive(pid),
            "control-plane process {pid} still running"
        );
    }
}
