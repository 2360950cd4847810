//! What the node tests (`node_*`, issue 17) share: FROM-scratch image
//! archives of our static binaries (`anneal-oci`, as `deploy/images` builds
//! them), and a kustomize overlay in a test directory over one of
//! `deploy/overlays/`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `docker.io/anneal/<name>:dev` holding `bin` at `/<path>` (its
/// entrypoint) and the host's CA roots, written to `<out>/<name>.oci.tar`.
pub fn image(name: &str, bin: &Path, path: &str, out: &Path) -> PathBuf {
    let oci = crate::artifacts::oci_tool();
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
    assert!(st.success(), "anneal-oci build {name}");
    archive
}

/// Writes `<dir>/kustomization.yaml`: `deploy/overlays/<base>` (by relative
/// path: kustomize takes no absolute one) with `patches` (YAML list items,
/// indented by two spaces), and installs it: `kubectl apply -k <dir>`.
pub fn apply_overlay(cp: &anneal_testinfra::ControlPlane, dir: &Path, base: &str, patches: &str) {
    std::fs::create_dir_all(dir).unwrap();
    let target = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/overlays")
        .join(base)
        .canonicalize()
        .unwrap();
    let up = "../".repeat(dir.canonicalize().unwrap().components().count() - 1);
    let resource = format!(
        "{up}{}",
        target.display().to_string().trim_start_matches('/')
    );
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - {resource}\npatches:\n{patches}"
        ),
    )
    .unwrap();
    let out = cp
        .kubectl()
        .unwrap()
        .args(["apply", "-k"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl apply -k {base} (test overlay): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Each manager pod's status and log (its last run's when it restarted),
/// for a failure message.
pub async fn manager_logs(pods: &kube::Api<k8s_openapi::api::core::v1::Pod>) -> String {
    let mut out = String::new();
    let list = pods
        .list(&kube::api::ListParams::default().labels("app.kubernetes.io/name=anneal-manager"))
        .await
        .unwrap();
    for p in list.items {
        let name = p.metadata.name.unwrap_or_default();
        let previous = kube::api::LogParams {
            previous: true,
            ..Default::default()
        };
        let log = match pods.logs(&name, &previous).await {
            Ok(l) => l,
            Err(_) => pods
                .logs(&name, &Default::default())
                .await
                .unwrap_or_default(),
        };
        out.push_str(&format!("--- {name}: {:?}\n{log}\n", p.status));
    }
    out
}
