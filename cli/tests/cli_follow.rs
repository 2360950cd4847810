//! `logs -f` and `watch` run as processes against a real kube-apiserver,
//! the test driving the DeployRun and its log ConfigMap as the manager
//! would: `logs -f` prints lines as they are appended and ends with the run;
//! `watch` redraws its bars in a real terminal (tmux) as the run's percent
//! moves, prints plain lines when stdout is a pipe, and ends with a table.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anneal_api::{DeployRun, Machine};
use anneal_testinfra::{ControlPlane, Tmux};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_kubectl-anneal");
const NS: &str = "fleet";
const WAIT: Duration = Duration::from_secs(60);

async fn setup() -> ControlPlane {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let nss: Api<Namespace> = Api::all(cp.client());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
    )
    .await
    .unwrap();
    cp
}

async fn machine(cp: &ControlPlane, name: &str, mac: &str, run: &str) {
    let api: Api<Machine> = Api::namespaced(cp.client(), NS);
    let m: Machine = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": name, "labels": {"rack": "r1"}},
        "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": mac}
    }))
    .unwrap();
    api.create(&PostParams::default(), &m).await.unwrap();
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(
            &json!({"status": {"state": "Provisioning", "currentRunRef": {"name": run}}}),
        ),
    )
    .await
    .unwrap();
}

async fn deploy_run(cp: &ControlPlane, name: &str, machine: &str, status: Value) {
    let api: Api<DeployRun> = Api::namespaced(cp.client(), NS);
    let r: DeployRun = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
        "metadata": {"name": name, "labels": {"anneal.dev/machine": machine}},
        "spec": {"machineRef": {"name": machine}, "claimRef": {"name": "c1"},
                 "imageRef": {"name": "ubuntu"}}
    }))
    .unwrap();
    api.create(&PostParams::default(), &r).await.unwrap();
    run_status(cp, name, status).await;
}

async fn run_status(cp: &ControlPlane, name: &str, status: Value) {
    let api: Api<DeployRun> = Api::namespaced(cp.client(), NS);
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await
    .unwrap();
}

async fn set_log(cp: &ControlPlane, run: &str, log: &str) {
    let api: Api<ConfigMap> = Api::namespaced(cp.client(), NS);
    let name = format!("{run}-log");
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": name}, "data": {"log": log}
    }))
    .unwrap();
    if api.get_opt(&name).await.unwrap().is_none() {
        api.create(&PostParams::default(), &cm).await.unwrap();
    } else {
        api.patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"data": {"log": log}})),
        )
        .await
        .unwrap();
    }
}

/// A plugin process whose stdout is read line by line.
struct Follow {
    child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    seen: Vec<String>,
}

impl Follow {
    fn start(kc: &Path, args: &[&str]) -> Self {
        let mut child = tokio::process::Command::new(BIN)
            .arg("--kubeconfig")
            .arg(kc)
            .args(args)
            .env_remove("KUBECONFIG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Reads lines until one contains `want`.
    async fn until(&mut self, want: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let line = tokio::time::timeout_at(deadline.into(), self.lines.next_line())
                .await
                .unwrap_or_else(|_| {
                    panic!("no line {want:?} within {WAIT:?}; seen {:?}", self.seen)
                })
                .unwrap()
                .unwrap_or_else(|| panic!("stdout ended before {want:?}; seen {:?}", self.seen));
            println!("| {line}");
            let hit = line.contains(want);
            self.seen.push(line);
            if hit {
                return;
            }
        }
    }

    /// Waits for the exit; returns (code, the rest of stdout, stderr).
    async fn finish(mut self) -> (i32, Vec<String>, String) {
        let mut rest = Vec::new();
        let deadline = Instant::now() + WAIT;
        while let Some(line) = tokio::time::timeout_at(deadline.into(), self.lines.next_line())
            .await
            .expect("the command ends")
            .unwrap()
        {
            println!("| {line}");
            rest.push(line);
        }
        let out = tokio::time::timeout(WAIT, self.child.wait_with_output())
            .await
            .expect("the command exits")
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        println!("stderr: {stderr}");
        (out.status.code().unwrap_or(-1), rest, stderr)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_prints_appended_lines_until_the_run_ends() {
    let cp = setup().await;
    let kc = cp.kubeconfig_path().to_path_buf();
    machine(&cp, "m1", "52:54:00:00:00:01", "m1-run-1").await;
    deploy_run(
        &cp,
        "m1-run-1",
        "m1",
        json!({"phase": "WritingContent", "percent": 5}),
    )
    .await;
    set_log(&cp, "m1-run-1", "agent: partitioned\n").await;

    let mut f = Follow::start(&kc, &["-n", NS, "logs", "m1", "-f"]);
    f.until("agent: partitioned").await;
    set_log(&cp, "m1-run-1", "agent: partitioned\nagent: p2 42%\n").await;
    f.until("agent: p2 42%").await;
    // The manager keeps the last 512 KiB: whole lines are cut at the front.
    set_log(&cp, "m1-run-1", "agent: p2 42%\nagent: p2 100%\n").await;
    f.until("agent: p2 100%").await;
    // A last line, then the run's end: the line is printed, the command ends.
    set_log(
        &cp,
        "m1-run-1",
        "agent: p2 42%\nagent: p2 100%\nagent: rebooting\n",
    )
    .await;
    run_status(
        &cp,
        "m1-run-1",
        json!({"phase": "Succeeded", "percent": 100}),
    )
    .await;
    let (code, rest, stderr) = f.finish().await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        rest,
        ["agent: rebooting"],
        "the last line is printed once, before the end"
    );
    assert!(
        stderr.contains("deployrun fleet/m1-run-1 ended: Succeeded"),
        "{stderr}"
    );

    // Each line once, in order.
    let (code, rest, _) = Follow::start(&kc, &["-n", NS, "logs", "m1", "-f"])
        .finish()
        .await;
    assert_eq!(code, 0);
    assert_eq!(
        rest,
        ["agent: p2 42%", "agent: p2 100%", "agent: rebooting"],
        "a finished run's log is printed once and the command ends"
    );
}

/// RFC 3339 time `secs` seconds ago.
fn ago(secs: i64) -> String {
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    k8s_openapi::jiff::Timestamp::from_second(now - secs)
        .unwrap()
        .to_string()
}

/// The percent of the bar line of `run` on screen.
fn bar_of(screen: &str, run: &str) -> (usize, String) {
    let line = screen
        .lines()
        .find(|l| l.contains(run) && l.contains('['))
        .unwrap_or_else(|| panic!("no bar of {run}:\n{screen}"));
    (line.matches('#').count(), line.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_draws_moving_bars_in_a_terminal_and_ends_with_a_table() {
    let cp = setup().await;
    let kc = cp.kubeconfig_path().to_path_buf();
    let work = tempfile::tempdir().unwrap();
    machine(&cp, "m1", "52:54:00:00:00:01", "m1-run-1").await;
    machine(&cp, "m2", "52:54:00:00:00:02", "m2-run-1").await;
    deploy_run(
        &cp,
        "m1-run-1",
        "m1",
        json!({"phase": "Partitioning", "percent": 0}),
    )
    .await;
    // An older, finished run is not watched.
    deploy_run(
        &cp,
        "m1-run-0",
        "m1",
        json!({"phase": "Failed", "percent": 3}),
    )
    .await;

    // The same watch on a pipe: plain lines.
    let mut plain = Follow::start(&kc, &["-n", NS, "watch", "-l", "rack=r1"]);
    plain
        .until("m1 m1-run-1 Partitioning 0% - MiB/s peers 0")
        .await;

    let exit = work.path().join("exit");
    let tmux = Tmux::start(
        work.path(),
        &format!(
            "{BIN} --kubeconfig {} -n {NS} watch -l rack=r1; echo \"watch exited $?\" > {}; echo WATCH-DONE; exec sleep 3600",
            kc.display(),
            exit.display()
        ),
    )
    .unwrap();
    let first = tmux.until("Partitioning", WAIT).await.unwrap();
    println!("--- terminal, start:\n{first}");
    assert!(first.contains("1 running, 0 finished"), "{first}");
    // An update to the finished run does not bring it into the watch.
    Api::<DeployRun>::namespaced(cp.client(), NS)
        .patch(
            "m1-run-0",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .unwrap();

    run_status(
        &cp,
        "m1-run-1",
        json!({"phase": "WritingContent", "percent": 37, "throughputMiBps": 120,
               "transfer": {"peers": 2, "downloadedBytes": 0, "uploadedBytes": 0, "httpBytes": 0}}),
    )
    .await;
    // A second machine starts while watching: it is watched too.
    deploy_run(
        &cp,
        "m2-run-1",
        "m2",
        json!({"phase": "Pending", "percent": 0}),
    )
    .await;
    let mid = tmux.until(" 37%", WAIT).await.unwrap();
    let mid = if mid.contains("m2-run-1") {
        mid
    } else {
        tmux.until("m2-run-1", WAIT).await.unwrap()
    };
    println!("--- terminal, mid-deploy:\n{mid}");
    run_status(
        &cp,
        "m1-run-1",
        json!({"phase": "WritingContent", "percent": 81, "throughputMiBps": 131,
               "transfer": {"peers": 3, "downloadedBytes": 0, "uploadedBytes": 0, "httpBytes": 0},
               // Started 2 minutes ago (before the watch): the bar counts from then.
               "phaseTimings": [
                   {"phase": "Partitioning", "start": ago(125), "end": ago(120)},
                   {"phase": "WritingContent", "start": ago(120)}]}),
    )
    .await;
    let later = tmux.until(" 81%", WAIT).await.unwrap();
    println!("--- terminal, later:\n{later}");
    let (a, line_a) = bar_of(&mid, "m1-run-1");
    let (b, line_b) = bar_of(&later, "m1-run-1");
    assert!(b > a, "the bar moved: {line_a:?} then {line_b:?}");
    assert!(
        line_b.contains("131 MiB/s") && line_b.contains(" 3 peers"),
        "{line_b}"
    );
    let running: Option<u64> = line_b
        .split_whitespace()
        .last()
        .and_then(|t| t.strip_prefix("2m")?.strip_suffix('s')?.parse().ok());
    assert!(
        running.is_some_and(|s| (5..=20).contains(&s)),
        "running since the first phase's start (2m05s ago): {line_b}"
    );
    // Redrawn in place: one bar line per run, never a scrolled history.
    assert_eq!(later.matches("m1-run-1").count(), 1, "{later}");

    run_status(
        &cp,
        "m1-run-1",
        json!({"phase": "Succeeded", "percent": 100, "throughputMiBps": 125,
               "phaseTimings": [
                   {"phase": "Partitioning", "start": "2026-12-01T00:00:00Z", "end": "2026-12-01T00:00:05Z"},
                   {"phase": "WritingContent", "start": "2026-12-01T00:00:05Z", "end": "2026-12-01T00:01:05Z"}]}),
    )
    .await;
    run_status(
        &cp,
        "m2-run-1",
        json!({"phase": "Failed", "percent": 12,
               "conditions": [{"type": "Succeeded", "status": "False", "reason": "DiskGone",
                               "message": "disk gone", "lastTransitionTime": "2026-12-01T00:00:00Z"}]}),
    )
    .await;
    let last = tmux.until("WATCH-DONE", WAIT).await.unwrap();
    println!("--- terminal, final:\n{last}");
    let row = last
        .lines()
        .find(|l| l.starts_with("m1 ") && !l.contains('[') && l.contains("Succeeded"))
        .unwrap_or_else(|| panic!("no table row of m1:\n{last}"));
    assert!(
        row.contains("m1-run-1") && row.contains("100%") && row.contains("1m05s"),
        "{row}"
    );
    assert!(
        last.contains("MACHINE") && last.contains("RESULT"),
        "{last}"
    );
    let failed = last
        .lines()
        .find(|l| l.starts_with("m2 ") && !l.contains('[') && l.contains("Failed"))
        .unwrap_or_else(|| panic!("no table row of m2:\n{last}"));
    assert!(failed.contains("disk gone"), "{failed}");
    assert!(
        !last.contains("m1-run-0"),
        "a run finished before the watch is not watched"
    );
    // A failed run makes the exit status 1.
    assert_eq!(
        std::fs::read_to_string(&exit).unwrap().trim(),
        "watch exited 1"
    );

    let (code, rest, stderr) = plain.finish().await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("deploy runs failed in fleet: m2-run-1"),
        "{stderr}"
    );
    let all = rest;
    for want in [
        "m1 m1-run-1 WritingContent 37% 120 MiB/s peers 2",
        "m1 m1-run-1 WritingContent 81% 131 MiB/s peers 3",
        "m1 m1-run-1 Succeeded 100% 125 MiB/s peers 3",
        "m2 m2-run-1 Failed 12% - MiB/s peers 0",
    ] {
        assert!(all.iter().any(|l| l == want), "no line {want:?} in {all:?}");
    }
    assert!(
        !all.iter().any(|l| l.contains('\x1b')),
        "no escapes on a pipe"
    );
    assert!(
        !all.iter().any(|l| l.contains("m1-run-0")),
        "a run finished before the watch is not watched: {all:?}"
    );
}
