//! The project's RBAC manifests (`deploy/base/rbac-*.yaml`) applied to the
//! test control plane, and clients that act as their ServiceAccounts
//! (tokens from the TokenRequest API, as a kubelet would mount them).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use kube::config::{AuthInfo, KubeConfigOptions, Kubeconfig};

use anneal_testinfra::ControlPlane;

/// `kubectl apply` of the repository's manifest `rel` (from the workspace
/// root) with `namespace: anneal-system` replaced by `namespace`.
pub fn apply_manifest(cp: &ControlPlane, rel: &str, namespace: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join(rel)).unwrap();
    let text = text.replace(
        "namespace: anneal-system",
        &format!("namespace: {namespace}"),
    );
    let mut child = cp
        .kubectl()
        .unwrap()
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "kubectl apply {rel}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A kubeconfig file (in the control plane's directory) and a client that
/// authenticate as ServiceAccount `namespace/name` with a fresh token.
pub async fn service_account(
    cp: &ControlPlane,
    namespace: &str,
    name: &str,
) -> (PathBuf, kube::Client) {
    let sas: Api<ServiceAccount> = Api::namespaced(cp.client(), namespace);
    // built from JSON: the spec's shape differs between API versions
    let request: TokenRequest =
        serde_json::from_value(serde_json::json!({"spec": {"expirationSeconds": 3600}})).unwrap();
    let tr = sas
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap();
    let status = serde_json::to_value(&tr.status).unwrap();
    let token = status["token"].as_str().unwrap().to_owned();
    let mut kc = Kubeconfig::read_from(cp.kubeconfig_path()).unwrap();
    for a in &mut kc.auth_infos {
        a.auth_info = Some(AuthInfo {
            token: Some(token.clone().into()),
            ..AuthInfo::default()
        });
    }
    let path = cp.dir().join(format!("kubeconfig-{namespace}-{name}"));
    std::fs::write(&path, serde_json::to_vec(&kc).unwrap()).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .unwrap();
    (path, kube::Client::try_from(cfg).unwrap())
}

/// Enrols `namespace` as docs/kubernetes.md tells an operator: ClusterRole
/// `anneal-manager-secrets` bound to the manager's ServiceAccount there
/// (the manager uses Secrets only where it is bound).
pub fn enroll_namespace(cp: &ControlPlane, namespace: &str) {
    let out = cp
        .kubectl()
        .unwrap()
        .args([
            "create",
            "rolebinding",
            "anneal-manager-secrets",
            "-n",
            namespace,
            "--clusterrole=anneal-manager-secrets",
            "--serviceaccount=anneal-system:anneal-manager",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "enrolling {namespace}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
