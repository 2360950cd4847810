#![allow(clippy::too_many_lines)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The Helm chart (`deploy/helm/anneal`, docs/kubernetes.md "Install with
//! Helm"): `helm lint` and `helm template` pass with the default values and
//! with the appliance values; the values derive the manager's provisioning
//! flags (`--agent-api-name`, `--bootd-api-url`, `--content-listen`,
//! `--content-url`); an empty required value or a contradiction fails the
//! render naming the value; the chart's `crds/` are `deploy/base/crds` byte
//! for byte. Against the real kube-apiserver: the CRDs are created, then every
//! object of each rendering is accepted by a server-side dry run, and the
//! rendered RBAC and admission policy are deploy/base's, rule for rule
//! (nothing wider). Finally the documented install command (`helm install
//! --create-namespace --take-ownership`) runs against the API server (no node:
//! nothing is scheduled), and the manager binary's start-up check accepts the
//! rendered flags (and refuses the defaults, which name no provisioning
//! address).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anneal_testinfra::{ControlPlane, cached_bin};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .canonicalize()
        .unwrap()
}

fn chart() -> PathBuf {
    root().join("deploy/helm/anneal")
}

fn helm() -> Command {
    let bin = cached_bin("helm").unwrap_or_else(|e| {
        panic!("helm is missing ({e:#}): tests/setup.sh builds it from tests/controlplane/helm")
    });
    Command::new(bin)
}

/// `helm template anneal deploy/helm/anneal -n anneal-system --include-crds ARGS`:
/// (success, stdout, stderr).
fn template(args: &[&str]) -> (bool, String, String) {
    let out = helm()
        .args(["template", "anneal"])
        .arg(chart())
        .args(["--namespace", "anneal-system", "--include-crds"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn rendered(args: &[&str]) -> String {
    let (ok, out, err) = template(args);
    assert!(ok, "helm template {args:?}: {err}");
    out
}

const APPLIANCE: &[&str] = &["-f", "deploy/helm/anneal/values-appliance.yaml"];

fn with_root(args: &[&str]) -> Vec<String> {
    args.iter()
        .map(|a| {
            if a.starts_with("deploy/") {
                root().join(a).display().to_string()
            } else {
                (*a).to_string()
            }
        })
        .collect()
}

fn rendered_with(args: &[&str]) -> String {
    let args = with_root(args);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    rendered(&refs)
}

/// The documents of a rendering that hold an object (`kind:` at the top level).
fn objects(yaml: &str) -> usize {
    yaml.split("\n---")
        .filter(|doc| doc.lines().any(|l| l.starts_with("kind: ")))
        .count()
}

/// The manager Deployment's args in a rendering (the `- --flag` lines of
/// the container's args).
fn manager_args(yaml: &str) -> Vec<String> {
    let doc = yaml
        .split("\n---")
        .find(|d| d.contains("\nkind: Deployment") && d.contains("name: anneal-manager"))
        .expect("the manager Deployment");
    doc.lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("- --"))
        .map(|f| format!("--{}", f.trim_matches('"')))
        .collect()
}

#[test]
fn the_charts_crds_are_deploy_bases() {
    let base = root().join("deploy/base/crds");
    let list = |dir: &Path| -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap() != "kustomization.yaml")
            .map(|p| {
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect()
    };
    let want = list(&base);
    let have = list(&chart().join("crds"));
    assert!(!want.is_empty());
    let names = |m: &BTreeMap<String, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&have),
        names(&want),
        "deploy/helm/anneal/crds has other files than deploy/base/crds: run deploy/helm/sync-crds.sh"
    );
    for (name, bytes) in &want {
        assert!(
            have[name] == *bytes,
            "deploy/helm/anneal/crds/{name} differs from deploy/base/crds/{name}: run deploy/helm/sync-crds.sh"
        );
    }
}

#[test]
fn lint_and_template_pass_and_values_derive_the_managers_flags() {
    for values in [&[][..], APPLIANCE] {
        let mut cmd = helm();
        cmd.arg("lint").arg(chart()).arg("--strict");
        cmd.args(with_root(values));
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "helm lint {values:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // defaults: a cluster install, images from the local registry
    let default = rendered(&[]);
    let args = manager_args(&default);
    assert!(args.contains(&"--workload-executor=kubernetes".to_string()));
    assert!(args.contains(&"--workload-image=localhost:5000/anneal/agent:0.1.0".to_string()));
    assert!(args.contains(&"--bootd-image=localhost:5000/anneal/bootd:0.1.0".to_string()));
    // the store quota and the source size limit (docs/images.md, "Store quota")
    assert!(args.contains(&"--store-quota-bytes-per-namespace=214748364800".to_string()));
    assert!(args.contains(&"--max-source-bytes=68719476736".to_string()));
    let quotas = manager_args(&rendered(&[
        "--set-json",
        r#"contentStore.namespaceQuotas={"fleet":1099511627776}"#,
    ]));
    assert!(quotas.contains(&"--store-quota-namespace=fleet=1099511627776".to_string()));
    // where the pods the manager creates run and what they pull with
    assert!(args.contains(&"--workload-image-pull-policy=IfNotPresent".to_string()));
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--workload-node-selector"))
    );
    let placed = manager_args(&rendered(&[
        "--set-json",
        r#"workloads={"nodeSelector":{"rack":"r7"},"tolerations":["dedicated=provisioning:NoSchedule","maintenance"]}"#,
        "--set-json",
        r#"image.pullSecrets=["regcred",{"name":"mirror"}]"#,
        "--set",
        "image.pullPolicy=Always",
    ]));
    for want in [
        "--workload-node-selector=rack=r7",
        "--workload-toleration=dedicated=provisioning:NoSchedule",
        "--workload-toleration=maintenance",
        "--workload-image-pull-secret=regcred",
        "--workload-image-pull-secret=mirror",
        "--workload-image-pull-policy=Always",
    ] {
        assert!(placed.contains(&want.to_string()), "{want} in {placed:?}");
    }
    assert!(default.contains("image: localhost:5000/anneal/manager:0.1.0"));
    assert!(!default.contains("docker.io"), "no image from docker.io");
    assert!(default.contains("kind: PodDisruptionBudget"));
    assert!(default.contains("type: LoadBalancer"));
    assert!(default.contains("pod-security.kubernetes.io/enforce: privileged"));
    assert!(!args.iter().any(|a| a.starts_with("--agent-api-name")));
    assert!(!args.iter().any(|a| a.starts_with("--content-url")));

    // the appliance: one replica on the host's network, a hostPath store
    let appliance = rendered_with(APPLIANCE);
    assert!(appliance.contains("hostNetwork: true"));
    assert!(appliance.contains("path: /var/lib/anneal/content"));
    assert!(!appliance.contains("kind: PodDisruptionBudget"));
    assert!(appliance.contains("replicas: 1"));

    // the provisioning address derives every flag a deploy needs
    let mut with_addr = APPLIANCE.to_vec();
    with_addr.extend(["--set", "provisioning.address=10.0.0.1"]);
    let args = manager_args(&rendered_with(&with_addr));
    for want in [
        "--agent-api-name=10.0.0.1",
        "--bootd-api-url=https://10.0.0.1:8443",
        "--content-listen=10.0.0.1:8088",
        "--content-url=http://10.0.0.1:8088",
        "--workload-host-network",
    ] {
        assert!(args.contains(&want.to_string()), "{want} in {args:?}");
    }
    // NodePort: the URL carries the node port; more names for the certificate
    let args = manager_args(&rendered(&[
        "--set",
        "agentApi.expose=NodePort",
        "--set",
        "provisioning.address=10.0.0.2",
        "--set",
        "agentApi.names={anneal.example.net}",
    ]));
    for want in [
        "--agent-api-name=10.0.0.2",
        "--agent-api-name=anneal.example.net",
        "--bootd-api-url=https://10.0.0.2:30443",
    ] {
        assert!(args.contains(&want.to_string()), "{want} in {args:?}");
    }

    // off the host's network the content server listens on its pod's addresses
    let args = manager_args(&rendered(&[
        "--set",
        "provisioning.hostNetwork=false",
        "--set",
        "provisioning.address=10.0.0.3",
    ]));
    assert!(args.contains(&"--content-listen=0.0.0.0:8088".to_string()));
    assert!(args.contains(&"--content-url=http://10.0.0.3:8088".to_string()));
    assert!(!args.contains(&"--workload-host-network".to_string()));

    // a required value left empty, and contradictions, name the value
    for (set, names) in [
        ("image.registry=", "image.registry is required"),
        ("agentApi.expose=Ingress", "agentApi.expose must be"),
        ("namespace.podSecurity=restricted", "namespace.podSecurity"),
    ] {
        let (ok, _, err) = template(&["--set", set]);
        assert!(!ok, "helm template --set {set} should fail");
        assert!(err.contains(names), "--set {set}: {err}");
    }
    let mut two = APPLIANCE.to_vec();
    two.extend(["--set", "manager.replicas=2"]);
    let args = with_root(&two);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, _, err) = template(&refs);
    assert!(!ok && err.contains("manager.replicas=1"), "{err}");
}

/// `manager run ARGS` with no cluster: its start-up check's refusal lines
/// (`--flag: why`) and stderr. Past the check it stops connecting.
fn manager_check(args: &[String]) -> (Vec<String>, String) {
    assert_eq!(
        args.first().map(String::as_str),
        Some("--lease-namespace=anneal-system")
    );
    let out =
        anneal_testinfra::manager_without_cluster(&anneal_tests::artifacts::manager_host(), args)
            .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let refusals = stderr
        .lines()
        .filter(|l| l.starts_with("--"))
        .map(str::to_string)
        .collect();
    (refusals, stderr)
}

#[test]
fn the_manager_accepts_the_rendered_flags_and_refuses_without_an_address() {
    let mut appliance = APPLIANCE.to_vec();
    appliance.extend(["--set", "provisioning.address=10.0.0.1"]);
    // the workload pods' placement flags parse in the real binary too
    let cluster = [
        "--set",
        "provisioning.address=10.0.0.2",
        "--set",
        "agentApi.expose=NodePort",
        "--set-json",
        r#"workloads={"nodeSelector":{"anneal.dev/provisioning":"true"},"tolerations":["dedicated=provisioning:NoSchedule"]}"#,
        "--set-json",
        r#"image.pullSecrets=["regcred"]"#,
    ];
    for args in [&appliance[..], &cluster[..]] {
        let flags = manager_args(&rendered_with(args));
        let (refusals, stderr) = manager_check(&flags);
        assert!(refusals.is_empty(), "{args:?}: {stderr}");
        assert!(
            stderr.contains("connecting to the cluster"),
            "{args:?}: {stderr}"
        );
    }
    // the default values name no address: the manager says what to set
    let (refusals, stderr) = manager_check(&manager_args(&rendered(&[])));
    assert!(
        refusals.iter().any(|l| l.starts_with("--agent-api-name")),
        "{stderr}"
    );
}

/// `kubectl apply --server-side [--dry-run=server] -f -` of `yaml`: the
/// objects the server returned.
fn apply(cp: &ControlPlane, yaml: &str, dry_run: bool) -> Vec<Value> {
    let mut cmd = cp.kubectl().unwrap();
    cmd.args(["apply", "--server-side", "--field-manager=anneal-helm-test"]);
    if dry_run {
        cmd.arg("--dry-run=server");
    }
    let mut child = cmd
        .args(["-o", "json", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "kubectl apply --server-side (dry run {dry_run}) refused objects: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut objs = Vec::new();
    for v in serde_json::Deserializer::from_slice(&out.stdout).into_iter::<Value>() {
        let v = v.unwrap();
        match v["items"].as_array() {
            Some(items) if v["kind"] == "List" => objs.extend(items.iter().cloned()),
            _ => objs.push(v),
        }
    }
    objs
}

fn kubectl(cp: &ControlPlane, args: &[&str]) {
    let out = cp.kubectl().unwrap().args(args).output().unwrap();
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// RBAC and admission objects by (kind, name): what they grant and to
/// whom, what they admit.
fn rbac(objs: &[Value]) -> BTreeMap<(String, String), Value> {
    objs.iter()
        .filter(|o| {
            matches!(
                o["kind"].as_str(),
                Some(
                    "ClusterRole"
                        | "Role"
                        | "ClusterRoleBinding"
                        | "RoleBinding"
                        | "ValidatingAdmissionPolicy"
                        | "ValidatingAdmissionPolicyBinding"
                )
            )
        })
        .map(|o| {
            (
                (
                    o["kind"].as_str().unwrap().to_string(),
                    format!(
                        "{}/{}",
                        o["metadata"]["namespace"].as_str().unwrap_or(""),
                        o["metadata"]["name"].as_str().unwrap()
                    ),
                ),
                serde_json::json!({
                    "rules": o["rules"],
                    "aggregationRule": o["aggregationRule"],
                    "roleRef": o["roleRef"],
                    "subjects": o["subjects"],
                    "spec": o["spec"],
                }),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rendered_object_passes_the_api_servers_dry_run() {
    let started = std::time::Instant::now();
    let cp = ControlPlane::start().await.unwrap();
    // The CRDs for real (the custom resources' kinds must exist for a dry
    // run of anything that names them), and the namespace the namespaced
    // objects go to: a dry run creates neither.
    let crds = chart().join("crds");
    kubectl(
        &cp,
        &["apply", "--server-side", "-f", crds.to_str().unwrap()],
    );
    kubectl(
        &cp,
        &[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=60s",
        ],
    );
    kubectl(&cp, &["create", "namespace", "anneal-system"]);

    let mut with_addr = APPLIANCE.to_vec();
    with_addr.extend(["--set", "provisioning.address=10.0.0.1"]);
    let renderings: Vec<(&str, Vec<&str>)> = vec![
        ("default", vec![]),
        ("appliance", APPLIANCE.to_vec()),
        ("appliance with an address", with_addr),
        (
            "NodePort",
            vec![
                "--set",
                "agentApi.expose=NodePort",
                "--set",
                "provisioning.address=10.0.0.2",
                "--set",
                "contentStore.storageClass=fast",
                "--set",
                "image.pullSecrets={regcred}",
                "--set-string",
                "manager.nodeSelector.anneal\\.dev/manager=true",
            ],
        ),
    ];
    let mut default_objs = Vec::new();
    for (what, args) in &renderings {
        let yaml = rendered_with(args);
        let want = objects(&yaml);
        let objs = apply(&cp, &yaml, true);
        assert_eq!(
            objs.len(),
            want,
            "{what}: the dry run returned {} objects of {want} rendered",
            objs.len()
        );
        println!("{what}: {want} objects accepted by the server-side dry run");
        if *what == "default" {
            default_objs = objs;
        }
    }

    // The rendered RBAC and admission policy are deploy/base's: the same
    // objects, rule for rule (the release namespace is anneal-system here).
    let base = ["rbac-manager.yaml", "rbac-bootd.yaml", "admission.yaml"]
        .iter()
        .map(|f| std::fs::read_to_string(root().join("deploy/base").join(f)).unwrap())
        .collect::<Vec<_>>()
        .join("\n---\n");
    let base = rbac(&apply(&cp, &base, true));
    let chart_rbac = rbac(&default_objs);
    assert!(!base.is_empty());
    assert_eq!(
        chart_rbac.keys().collect::<Vec<_>>(),
        base.keys().collect::<Vec<_>>()
    );
    for (k, v) in &base {
        assert_eq!(&chart_rbac[k], v, "{k:?} differs from deploy/base");
    }

    // The documented install command, for real (no node: nothing runs).
    let out = helm()
        .arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
        .args(["install", "anneal"])
        .arg(chart())
        .args([
            "-n",
            "anneal-system",
            "--create-namespace",
            "--take-ownership",
            "-f",
        ])
        .arg(chart().join("values-appliance.yaml"))
        .args(["--set", "provisioning.address=10.0.0.1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "helm install: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cp
        .kubectl()
        .unwrap()
        .args([
            "get",
            "namespace",
            "anneal-system",
            "-o",
            "jsonpath={.metadata.labels.pod-security\\.kubernetes\\.io/enforce}",
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "privileged");
    println!("helm chart test: {:.1} s", started.elapsed().as_secs_f64());
}
