//! What the node tests (`node_*`, docs/kubernetes.md "On a real node (the test
//! tier)") share: FROM-scratch image archives of our static binaries
//! (`anneal-oci`, as `deploy/images` builds them), and a kustomize overlay in
//! a test directory over one of `deploy/overlays/`.

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

/// `docker.io/anneal/manager:dev` for the node tests: the test build's
/// manager (debug, dynamically linked: no second compile of the manager
/// and its dependencies for musl, which cost the suite ~5 minutes) with the
/// shared libraries `ldd` names, at the paths its loader looks in. The
/// production image (`deploy/images`: the static musl binary alone) is
/// checked by `deploy_images`; the pods run the same manager code.
pub fn manager_image(out: &Path) -> PathBuf {
    dynamic_image("manager", &crate::artifacts::manager_host(), "manager", out)
}

/// `docker.io/anneal/bootd:dev` for the node tests: the test build's bootd
/// with its shared libraries, as [`manager_image`].
pub fn bootd_image(out: &Path) -> PathBuf {
    dynamic_image("bootd", &crate::artifacts::bootd(), "bootd", out)
}

/// `docker.io/anneal/<name>:dev`: the dynamically linked `bin` at
/// `/<path>` (its entrypoint), the shared libraries `ldd` names, the CA
/// roots.
fn dynamic_image(name: &str, bin: &Path, path: &str, out: &Path) -> PathBuf {
    let ldd = Command::new("ldd").arg(bin).output().unwrap();
    assert!(ldd.status.success(), "ldd {}", bin.display());
    let mut files = vec![format!("--file={path}={}", bin.display())];
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` or the
        // loader, `/lib64/ld-linux-x86-64.so.2 (0x…)`
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        let Some(path) = path.filter(|p| p.starts_with('/')) else {
            continue;
        };
        let real = std::fs::canonicalize(path).unwrap();
        files.push(format!(
            "--file={}={}:0755",
            path.trim_start_matches('/'),
            real.display()
        ));
    }
    let archive = out.join(format!("{name}.oci.tar"));
    let st = Command::new(crate::artifacts::oci_tool())
        .args(["build", "--name", &format!("anneal/{name}"), "--tag", "dev"])
        .args(["--entrypoint", &format!("/{path}"), "--max-size-mib", "200"])
        .args(&files)
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
