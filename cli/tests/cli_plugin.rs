//! `kubectl-anneal` run as a process against a real kube-apiserver (etcd +
//! apiserver of `anneal_testinfra::ControlPlane`) with a kubeconfig file:
//! each command's output, and the objects afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::too_many_lines)]

use std::path::Path;

use anneal_api::{DeployRun, Machine, MachineClaim};
use anneal_testinfra::ControlPlane;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_kubectl-anneal");

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs the plugin with `--kubeconfig` and `args`.
async fn plugin(kubeconfig: &Path, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(BIN)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .await
        .unwrap();
    let r = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    println!(
        "$ kubectl anneal {}\n{}{}(exit {})",
        args.join(" "),
        r.stdout,
        r.stderr,
        r.code
    );
    r
}

/// Runs the plugin and expects success; returns stdout.
async fn ok(kubeconfig: &Path, args: &[&str]) -> String {
    let r = plugin(kubeconfig, args).await;
    assert_eq!(r.code, 0, "{args:?} failed: {}", r.stderr);
    r.stdout
}

fn cond(type_: &str, status: &str, reason: &str, message: &str) -> Value {
    json!({"type": type_, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": "2026-12-01T00:00:00Z"})
}

async fn machine(cp: &ControlPlane, ns: &str, name: &str, mac: &str, status: Value) {
    let api: Api<Machine> = Api::namespaced(cp.client(), ns);
    let m: Machine = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": name},
        "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": mac}
    }))
    .unwrap();
    api.create(&PostParams::default(), &m).await.unwrap();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await
    .unwrap();
}

async fn run_object(cp: &ControlPlane, ns: &str, name: &str, machine: &str, status: Value) {
    let api: Api<DeployRun> = Api::namespaced(cp.client(), ns);
    let r: DeployRun = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
        "metadata": {"name": name, "labels": {"anneal.dev/machine": machine}},
        "spec": {"machineRef": {"name": machine}, "claimRef": {"name": "c1"},
                 "imageRef": {"name": "ubuntu"}}
    }))
    .unwrap();
    api.create(&PostParams::default(), &r).await.unwrap();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await
    .unwrap();
}

async fn log_configmap(cp: &ControlPlane, ns: &str, run: &str, log: &str) {
    let api: Api<ConfigMap> = Api::namespaced(cp.client(), ns);
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": format!("{run}-log")}, "data": {"log": log}
    }))
    .unwrap();
    api.create(&PostParams::default(), &cm).await.unwrap();
}

fn annotation(m: &Machine, key: &str) -> Option<String> {
    m.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_commands_change_and_show_what_they_say() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let kc = cp.kubeconfig_path().to_path_buf();
    let ns = "fleet";
    let nss: Api<Namespace> = Api::all(cp.client());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap(),
    )
    .await
    .unwrap();

    // m1: Provisioning, held after three failures, a run at 42 %; m2 and m3
    // Available; m4 Provisioned with a finished run only.
    machine(
        &cp,
        ns,
        "m1",
        "52:54:00:00:00:01",
        json!({"state": "Provisioning", "operationalStatus": "error", "errorType": "Restart",
               "errorMessage": "deploy failed in WritingContent: disk gone", "errorCount": 3,
               "restartCount": 3, "currentRunRef": {"name": "m1-aaaa0000-2"},
               "conditions": [cond("RetryHeld", "True", "BootRetryExhausted", "3 consecutive failed attempts"),
                              cond("Progressing", "False", "DeployFailed", "disk gone")]}),
    )
    .await;
    for (name, mac) in [("m2", "52:54:00:00:00:02"), ("m3", "52:54:00:00:00:03")] {
        machine(
            &cp,
            ns,
            name,
            mac,
            json!({"state": "Available", "operationalStatus": "OK"}),
        )
        .await;
    }
    machine(
        &cp,
        ns,
        "m4",
        "52:54:00:00:00:04",
        json!({"state": "Provisioned", "operationalStatus": "OK",
               "lastSuccessfulRunRef": {"name": "m4-bbbb0000-1"}}),
    )
    .await;
    run_object(
        &cp,
        ns,
        "m1-aaaa0000-2",
        "m1",
        json!({"phase": "WritingContent", "percent": 42, "throughputMiBps": 117,
               "transfer": {"peers": 3, "downloadedBytes": 1, "uploadedBytes": 0, "httpBytes": 0}}),
    )
    .await;
    run_object(
        &cp,
        ns,
        "m1-aaaa0000-1",
        "m1",
        json!({"phase": "Failed", "percent": 10}),
    )
    .await;
    run_object(
        &cp,
        ns,
        "m4-bbbb0000-1",
        "m4",
        json!({"phase": "Succeeded", "percent": 100}),
    )
    .await;
    log_configmap(&cp, ns, "m1-aaaa0000-2", "agent: writing p2\nagent: 42%\n").await;
    log_configmap(&cp, ns, "m1-aaaa0000-1", "agent: disk gone\n").await;
    log_configmap(&cp, ns, "m4-bbbb0000-1", "agent: deployed\n").await;

    // status: counts, the held machine with its reason, the run with its percent.
    let out = ok(&kc, &["status", "-n", ns]).await;
    assert!(
        out.contains("Machines in fleet: 4 (Available 2, Provisioned 1, Provisioning 1)"),
        "{out}"
    );
    assert!(out.contains("Machines in error: 1"), "{out}");
    let held = out
        .lines()
        .find(|l| l.starts_with("fleet/m1 "))
        .expect(&out);
    assert!(
        held.contains("Provisioning") && held.contains("BootRetryExhausted"),
        "{held}"
    );
    let run_line = out
        .lines()
        .find(|l| l.starts_with("fleet/m1-aaaa0000-2 "))
        .expect(&out);
    assert!(
        run_line.contains("WritingContent") && run_line.contains("42%") && run_line.contains("117"),
        "{run_line}"
    );
    assert!(
        !out.contains("m4-bbbb0000-1"),
        "a finished run is not in progress: {out}"
    );
    let wide = ok(&kc, &["status", "-n", ns, "-o", "wide"]).await;
    assert!(wide.contains("PEERS") && wide.contains("ubuntu"), "{wide}");
    let doc: Value =
        serde_json::from_str(&ok(&kc, &["status", "-n", ns, "-o", "json"]).await).unwrap();
    assert_eq!(doc["machines"], 4, "{doc}");
    assert_eq!(doc["byState"]["Available"], 2, "{doc}");
    assert_eq!(doc["errors"][0]["reason"], "BootRetryExhausted", "{doc}");
    assert_eq!(doc["errors"][0]["errorCount"], 3, "{doc}");
    assert_eq!(doc["runs"].as_array().unwrap().len(), 1, "{doc}");
    assert_eq!(doc["runs"][0]["percent"], 42, "{doc}");
    assert_eq!(doc["runs"][0]["peers"], 3, "{doc}");
    let yaml = ok(&kc, &["status", "-n", ns, "-o", "yaml"]).await;
    assert!(yaml.contains("reason: BootRetryExhausted"), "{yaml}");
    // Another namespace sees none of it; -A sees it.
    let empty = ok(&kc, &["status", "-n", "default"]).await;
    assert!(empty.contains("Machines in default: 0 (none)"), "{empty}");
    let all = ok(&kc, &["status", "-A"]).await;
    assert!(all.contains("Machines in *: 4"), "{all}");

    let machines: Api<Machine> = Api::namespaced(cp.client(), ns);

    // cordon / uncordon: spec.unclaimable.
    let out = ok(&kc, &["-n", ns, "cordon", "m2"]).await;
    assert_eq!(
        out,
        "machine fleet/m2 cordoned (spec.unclaimable: false -> true)\n"
    );
    assert!(machines.get("m2").await.unwrap().spec.unclaimable);
    let out = ok(&kc, &["-n", ns, "cordon", "m2"]).await;
    assert_eq!(
        out,
        "machine fleet/m2 already cordoned (spec.unclaimable: true)\n"
    );
    let out = ok(&kc, &["-n", ns, "uncordon", "m2"]).await;
    assert_eq!(
        out,
        "machine fleet/m2 uncordoned (spec.unclaimable: true -> false)\n"
    );
    assert!(!machines.get("m2").await.unwrap().spec.unclaimable);

    // park / unpark: anneal.dev/operation.
    let out = ok(&kc, &["-n", ns, "park", "m3"]).await;
    assert_eq!(
        out,
        "machine fleet/m3 park requested (annotation anneal.dev/operation: <unset> -> \"park\")\n"
    );
    let m3 = machines.get("m3").await.unwrap();
    assert_eq!(
        annotation(&m3, "anneal.dev/operation").as_deref(),
        Some("park")
    );
    let out = ok(&kc, &["-n", ns, "unpark", "m3"]).await;
    assert!(
        out.starts_with("machine fleet/m3 unpark requested (annotation anneal.dev/operation: \"park\" -> \"unpark\"); the machine is Available, not Parked"),
        "{out}"
    );
    let m3 = machines.get("m3").await.unwrap();
    assert_eq!(
        annotation(&m3, "anneal.dev/operation").as_deref(),
        Some("unpark")
    );
    let out = ok(&kc, &["-n", ns, "park", "m1"]).await;
    assert!(
        out.contains("the machine is Provisioning, so the request waits"),
        "{out}"
    );

    // reinspect, clear-error, reboot: their annotations, exactly.
    let out = ok(&kc, &["-n", ns, "reinspect", "m2"]).await;
    assert_eq!(
        out,
        "machine fleet/m2 re-inspection requested (annotation anneal.dev/re-inspect: <unset> -> \"\")\n"
    );
    assert_eq!(
        annotation(&machines.get("m2").await.unwrap(), "anneal.dev/re-inspect").as_deref(),
        Some("")
    );
    let out = ok(&kc, &["-n", ns, "clear-error", "m1"]).await;
    assert_eq!(
        out,
        "machine fleet/m1 clear-error requested (annotation anneal.dev/clear-error: <unset> -> \"\"); errorCount 3, restartCount 3, RetryHeld True\n"
    );
    assert_eq!(
        annotation(&machines.get("m1").await.unwrap(), "anneal.dev/clear-error").as_deref(),
        Some("")
    );
    ok(&kc, &["-n", ns, "reboot", "m2"]).await;
    assert_eq!(
        annotation(&machines.get("m2").await.unwrap(), "anneal.dev/reboot").as_deref(),
        Some(r#"{"mode":"soft"}"#)
    );
    let out = ok(&kc, &["-n", ns, "reboot", "--hard", "m2"]).await;
    assert!(out.contains(r#"hard reboot requested (annotation anneal.dev/reboot: "{\"mode\":\"soft\"}" -> "{\"mode\":\"hard\"}")"#), "{out}");
    assert_eq!(
        annotation(&machines.get("m2").await.unwrap(), "anneal.dev/reboot").as_deref(),
        Some(r#"{"mode":"hard"}"#)
    );

    // logs: the current run, a named run, the last successful run.
    assert_eq!(
        ok(&kc, &["-n", ns, "logs", "m1"]).await,
        "agent: writing p2\nagent: 42%\n"
    );
    assert_eq!(
        ok(&kc, &["-n", ns, "logs", "m1", "--run", "m1-aaaa0000-1"]).await,
        "agent: disk gone\n"
    );
    assert_eq!(
        ok(&kc, &["-n", ns, "logs", "m4"]).await,
        "agent: deployed\n"
    );
    let r = plugin(&kc, &["-n", ns, "logs", "m1", "--run", "m4-bbbb0000-1"]).await;
    assert_ne!(r.code, 0);
    assert!(
        r.stderr
            .contains("deployrun fleet/m4-bbbb0000-1 belongs to machine m4, not m1"),
        "{}",
        r.stderr
    );
    let r = plugin(&kc, &["-n", ns, "logs", "m2"]).await;
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("machine fleet/m2 has no deploy run"),
        "{}",
        r.stderr
    );

    // Errors name the object and the fix.
    let r = plugin(&kc, &["-n", ns, "cordon", "m9"]).await;
    assert_ne!(r.code, 0);
    assert_eq!(
        r.stderr,
        "error: machine fleet/m9 not found (kubectl get machines -n fleet)\n"
    );
    let r = plugin(&kc, &["-n", ns, "release", "m2"]).await;
    assert_ne!(r.code, 0);
    assert!(
        r.stderr
            .contains("machine fleet/m2 is not claimed (spec.claimRef is empty)"),
        "{}",
        r.stderr
    );

    // release: deletes the claim bound to the machine.
    let claims: Api<MachineClaim> = Api::namespaced(cp.client(), ns);
    let claim: MachineClaim = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
        "metadata": {"name": "c1"}, "spec": {"machineName": "m4", "imageRef": {"name": "ubuntu"}}
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    machines
        .patch(
            "m4",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"claimRef": {"name": "c1"}}})),
        )
        .await
        .unwrap();
    let out = ok(&kc, &["-n", ns, "release", "m4"]).await;
    assert!(
        out.starts_with("machine fleet/m4 released: machineclaim fleet/c1 deleted"),
        "{out}"
    );
    assert!(out.contains("reclaimPolicy Retain"), "{out}");
    assert!(
        claims.get_opt("c1").await.unwrap().is_none(),
        "the claim is gone"
    );

    // The kubeconfig's namespace and KUBECONFIG are honoured: a context
    // namespace set with kubectl, no -n, no --kubeconfig.
    let mut set = cp.kubectl().unwrap();
    set.args(["config", "set-context", "--current", "--namespace", ns]);
    let st = set.status().unwrap();
    assert!(st.success());
    let out = tokio::process::Command::new(BIN)
        .args(["cordon", "m3"])
        .env("KUBECONFIG", &kc)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        stdout,
        "machine fleet/m3 cordoned (spec.unclaimable: false -> true)\n"
    );
}
