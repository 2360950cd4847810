//! Manifests (docs/kubernetes.md, "Manifests (`deploy/`)"): `kubectl apply -k`
//! of each overlay of `deploy/` against a real kube-apiserver
//! (schema-validated, strict): the appliance installs one manager replica on
//! the host's network with a hostPath content store and no disruption budget;
//! the cluster overlay two replicas, a PodDisruptionBudget and a claim from
//! the default StorageClass; every CRD is Established; applying again changes
//! nothing. Then, acting with the manager's ServiceAccount token (as its pod
//! would), `kubectl auth can-i` shows it may do what the manager needs and is
//! refused what it does not: its Lease only in its own namespace, no CRD,
//! RBAC, Namespace, Pod or Node writes, and Secrets only in its own namespace
//! and in the tenant namespaces an operator enrolled (a RoleBinding of
//! `anneal-manager-secrets`): a Secret of another namespace is refused, and so
//! is listing Secrets cluster-wide.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use anneal_testinfra::ControlPlane;
use anneal_tests::wait::eventually;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolumeClaim};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn apply(cp: &ControlPlane, overlay: &str) -> String {
    let out = cp
        .kubectl()
        .unwrap()
        .args(["apply", "-k"])
        .arg(root().join(overlay))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl apply -k {overlay}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

async fn established(cp: &ControlPlane) {
    let crds: Api<CustomResourceDefinition> = Api::all(cp.client());
    for want in anneal_api::crds() {
        let name = want.metadata.name.unwrap();
        eventually(
            &format!("CRD {name} Established"),
            Duration::from_secs(60),
            || async {
                let c = crds.get(&name).await.ok()?;
                c.status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
                    .then_some(())
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_appliance_overlay_installs_one_replica_on_the_host_network() {
    let cp = ControlPlane::start().await.unwrap();
    let first = apply(&cp, "deploy/overlays/appliance");
    established(&cp).await;
    let client = cp.client();
    let d = Api::<Deployment>::namespaced(client.clone(), "anneal-system")
        .get("anneal-manager")
        .await
        .unwrap();
    let spec = d.spec;
    assert_eq!(spec.replicas, Some(1));
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("anneal-manager"));
    let c = &pod.containers[0];
    assert_eq!(c.image.as_deref(), Some("docker.io/anneal/manager:dev"));
    assert!(
        c.args
            .as_ref()
            .unwrap()
            .contains(&"--lease-namespace=anneal-system".to_string())
    );
    assert!(c.liveness_probe.is_some() && c.readiness_probe.is_some());
    assert!(c.resources.as_ref().unwrap().requests.is_some());
    let pvc = Api::<PersistentVolumeClaim>::namespaced(client.clone(), "anneal-system")
        .get("anneal-content")
        .await
        .unwrap();
    assert_eq!(
        pvc.spec.unwrap().volume_name.as_deref(),
        Some("anneal-content")
    );
    let pdbs = Api::<PodDisruptionBudget>::namespaced(client.clone(), "anneal-system")
        .get_opt("anneal-manager")
        .await
        .unwrap();
    assert!(pdbs.is_none(), "the appliance has no disruption budget");
    let ns = Api::<Namespace>::all(client.clone())
        .get("anneal-system")
        .await
        .unwrap();
    assert_eq!(
        ns.metadata.labels.unwrap()["pod-security.kubernetes.io/enforce"],
        "privileged"
    );
    // the install is idempotent
    let again = apply(&cp, "deploy/overlays/appliance");
    assert!(
        again.lines().all(|l| l.ends_with(" unchanged")),
        "first:\n{first}\nagain:\n{again}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_overlay_installs_two_replicas_and_the_manager_is_least_privilege() {
    let cp = ControlPlane::start().await.unwrap();
    apply(&cp, "deploy/overlays/cluster");
    established(&cp).await;
    let client = cp.client();
    let d = Api::<Deployment>::namespaced(client.clone(), "anneal-system")
        .get("anneal-manager")
        .await
        .unwrap();
    let spec = d.spec;
    assert_eq!(spec.replicas, Some(2));
    assert_eq!(spec.template.spec.unwrap().host_network, None);
    let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), "anneal-system")
        .get("anneal-manager")
        .await
        .unwrap();
    assert!(pdb.spec.unwrap().min_available.is_some());
    let pvc = Api::<PersistentVolumeClaim>::namespaced(client.clone(), "anneal-system")
        .get("anneal-content")
        .await
        .unwrap();
    assert_eq!(
        pvc.spec.unwrap().access_modes.unwrap(),
        ["ReadWriteMany".to_string()]
    );

    // A tenant namespace enrolled as the install docs say (the manager may
    // use Secrets there), and one that is not.
    for args in [
        vec!["create", "namespace", "tenant-a"],
        vec!["create", "namespace", "tenant-b"],
        vec![
            "create",
            "rolebinding",
            "anneal-manager-secrets",
            "-n",
            "tenant-a",
            "--clusterrole=anneal-manager-secrets",
            "--serviceaccount=anneal-system:anneal-manager",
        ],
    ] {
        let out = cp.kubectl().unwrap().args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The manager's own token, as the kubelet would mount it.
    let (kubeconfig, _) =
        anneal_tests::rbac::service_account(&cp, "anneal-system", "anneal-manager").await;
    let can = |args: &[&str]| {
        let out = cp
            .kubectl()
            .unwrap()
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(["auth", "can-i"])
            .args(args)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let yes = match out.status.code() {
            Some(0) => true,
            Some(1) => false,
            _ => panic!(
                "kubectl auth can-i {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        (yes, said)
    };
    let needs: &[&[&str]] = &[
        &["list", "machines.anneal.dev", "--all-namespaces"],
        &[
            "patch",
            "machines.anneal.dev",
            "--subresource=status",
            "-n",
            "tenant-a",
        ],
        &["create", "deployruns.anneal.dev", "-n", "tenant-a"],
        &["get", "secrets", "-n", "tenant-a"],
        &["watch", "secrets", "-n", "tenant-a"],
        &["create", "secrets", "-n", "anneal-system"],
        &[
            "create",
            "leases.coordination.k8s.io",
            "-n",
            "anneal-system",
        ],
        &[
            "update",
            "leases.coordination.k8s.io",
            "-n",
            "anneal-system",
        ],
        &["create", "jobs.batch", "-n", "anneal-system"],
        // its workloads' protocol lines (an ingest's result, a seeder's
        // readiness)
        &["get", "pods", "--subresource=log", "-n", "anneal-system"],
        &["create", "deployments.apps", "-n", "anneal-system"],
        &["create", "events.events.k8s.io", "-n", "tenant-a"],
        &["create", "tokenreviews.authentication.k8s.io"],
    ];
    // The API server's RBAC authorizer learns new roles and bindings from
    // its watch: each needed permission is awaited (bounded), and the
    // refusals are checked once every binding has been seen.
    for a in needs {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let (yes, said) = loop {
            let (yes, said) = can(a);
            if yes || std::time::Instant::now() > deadline {
                break (yes, said);
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(
            yes,
            "the manager needs `{}` and may not ({said})",
            a.join(" ")
        );
    }
    let refused: &[&[&str]] = &[
        &["create", "leases.coordination.k8s.io", "-n", "kube-system"],
        &["update", "leases.coordination.k8s.io", "-n", "tenant-a"],
        &["create", "customresourcedefinitions.apiextensions.k8s.io"],
        &["create", "clusterroles.rbac.authorization.k8s.io"],
        &[
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            "-n",
            "anneal-system",
        ],
        &["delete", "namespaces"],
        // Secrets only where an operator bound anneal-manager-secrets
        &["get", "secrets", "-n", "tenant-b"],
        &["list", "secrets", "--all-namespaces"],
        &["create", "secrets", "-n", "kube-system"],
        &["create", "pods", "-n", "anneal-system"],
        &["create", "pods/exec", "-n", "anneal-system"],
        &["delete", "pods", "-n", "anneal-system"],
        &["patch", "nodes"],
        &["create", "serviceaccounts/token", "-n", "anneal-system"],
        &["delete", "persistentvolumeclaims", "-n", "anneal-system"],
        // its workloads run in its own namespace only (a Role there)
        &["create", "deployments.apps", "-n", "site-a"],
        &["create", "jobs.batch", "-n", "tenant-a"],
        &["get", "pods", "--subresource=log", "-n", "tenant-a"],
        &["list", "pods", "-n", "kube-system"],
    ];
    for a in refused {
        let (yes, said) = can(a);
        assert!(!yes, "the manager must not `{}` ({said})", a.join(" "));
    }
}
