//! Scale benchmark (a program, not a test): N Machines with MachineHardware
//! and N selector claims against a real control plane; measures the time
//! until every claim is Bound, the manager process's peak RSS (VmHWM), the
//! API server's write requests while binding (by verb and resource) and the
//! CPU time each process spent in that window.
//!
//! Reproduce:
//! `cargo build --release -p anneal-manager --bin manager -p anneal-bench --bin manager-scale && SCALE_N=10000 SCALE_CONCURRENCY=32 target/release/manager-scale`
//! (`SCALE_N`: machines and claims, default 1,000; `SCALE_CONCURRENCY`: the
//! manager's `--concurrency`, default 8). Writes `target/bench/manager-scale.json`.
//!
//! Reference measured in the same run: the time the API server needs just to
//! accept the N claim creations. The ratio bind-time / create-time says how
//! much the controller adds on top of raw API throughput.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anneal_api::{ClaimPhase, Machine, MachineClaim, MachineHardware};
use anneal_testinfra::{ChildGroup, ControlPlane};
use futures::StreamExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use serde_json::json;

/// The goals for 10,000 machines + 10,000 claims (docs/benchmarks.md).
const GOAL_SECS: f64 = 60.0;
const GOAL_MIB: f64 = 150.0;
/// How long the manager may take to judge every Machine at start-up.
const STARTUP_LIMIT: Duration = Duration::from_secs(300);
/// How long every claim may take to be Bound.
const BIND_LIMIT: Duration = Duration::from_secs(300);
const PARALLEL: usize = 32;
const NS: &str = "default";

const USAGE: &str =
    "manager-scale: N Machines and N selector claims to Bound against a real control plane

environment:
  SCALE_N=N              machines and claims (default 1000)
  SCALE_CONCURRENCY=C    the manager's --concurrency (default 8)
  SCALE_LIFECYCLE=1      also run the Machine lifecycle controller (default:
                         `--no-lifecycle`, the claim half alone); the
                         Machines have no BMC, so a bind is all it sees

needs target/release/manager beside this binary:
  cargo build --release -p anneal-manager --bin manager -p anneal-bench --bin manager-scale
writes target/bench/manager-scale.json";

/// Switches the machine lifecycle off when the binary has it: the benchmark
/// measures the claim half. With `SCALE_LIFECYCLE=1` the lifecycle runs
/// (its agent API on a free local port, its CA in `anneal-system`).
fn lifecycle_flags(bin: &std::path::Path) -> anyhow::Result<Vec<String>> {
    if std::env::var("SCALE_LIFECYCLE").is_ok_and(|v| v == "1") {
        let port = anneal_testinfra::free_port()?;
        return Ok(vec![
            "--agent-api-listen".into(),
            format!("127.0.0.1:{port}"),
            "--manager-namespace".into(),
            "anneal-system".into(),
        ]);
    }
    let help = Command::new(bin).args(["run", "--help"]).output();
    Ok(match help {
        Ok(o) if String::from_utf8_lossy(&o.stdout).contains("--no-lifecycle") => {
            vec!["--no-lifecycle".into()]
        }
        _ => Vec::new(),
    })
}

/// The API server's requests so far, by "VERB resource[/subresource]", from
/// its own `apiserver_request_total` counter.
async fn apiserver_requests(client: &kube::Client) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(req) = http::Request::get("/metrics").body(Vec::new()) else {
        return out;
    };
    let Ok(text) = client.request_text(req).await else {
        return out;
    };
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let label = |k: &str| {
            let pat = format!("{k}=\"");
            let i = line.find(&pat)? + pat.len();
            Some(line[i..].split('"').next()?.to_string())
        };
        // non-resource requests (this benchmark's reads of /metrics) left out
        let (Some(verb), Some(resource)) =
            (label("verb"), label("resource").filter(|r| !r.is_empty()))
        else {
            continue;
        };
        let sub = label("subresource").filter(|s| !s.is_empty());
        let key = match sub {
            Some(s) => format!("{verb} {resource}/{s}"),
            None => format!("{verb} {resource}"),
        };
        let v: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(key).or_insert(0.0) += v;
    }
    out
}

fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// CPU seconds (user + system) process `pid` has used so far.
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // fields after the command name (which may hold spaces): state is 3rd
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    let hz = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(100.0);
    Some(ticks as f64 / hz)
}

/// CPU seconds of the processes the run measures, by name.
fn cpu_all(procs: &[(&'static str, u32)]) -> BTreeMap<&'static str, f64> {
    procs
        .iter()
        .filter_map(|(name, pid)| Some((*name, cpu_secs(*pid)?)))
        .collect()
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Creates `n` Available Machines, each with a MachineHardware.
async fn create_machines(client: &kube::Client, n: usize) {
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
    let hardware: Api<MachineHardware> = Api::namespaced(client.clone(), NS);
    futures::stream::iter(0..n)
        .map(|i| {
            let (machines, hardware) = (machines.clone(), hardware.clone());
            async move {
                let name = format!("m{i:04}");
                let m: Machine = serde_json::from_value(json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
                    "metadata": {"name": name, "labels": {"pool": "scale", "rack": format!("r{}", i % 20)}},
                    "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": format!("52:54:00:00:{:02x}:{:02x}", i / 256, i % 256)}
                }))
                .unwrap();
                machines.create(&PostParams::default(), &m).await.unwrap();
                machines
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&json!({"status": {"state": "Available"}})))
                    .await
                    .unwrap();
                let hw: MachineHardware = serde_json::from_value(json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineHardware",
                    "metadata": {"name": name},
                    "spec": {"cpu": {"count": 8 + (i % 4) * 8}, "memoryBytes": (32i64 + (i as i64 % 4) * 32) << 30,
                             "disks": [{"deviceName": "/dev/nvme0n1", "sizeBytes": 960_000_000_000i64}]}
                }))
                .unwrap();
                hardware.create(&PostParams::default(), &hw).await.unwrap();
            }
        })
        .buffer_unordered(PARALLEL)
        .collect::<Vec<_>>()
        .await;
}

/// Starts `manager run` against the control plane.
fn start_manager(
    cp: &ControlPlane,
    concurrency: usize,
    metrics_port: u16,
) -> anyhow::Result<ChildGroup> {
    let manager_bin = std::env::current_exe()?
        .parent()
        .map(|p| p.join("manager"))
        .ok_or_else(|| anyhow::anyhow!("cannot locate the manager binary"))?;
    anyhow::ensure!(
        manager_bin.exists(),
        "{} missing: build it with `cargo build --release -p anneal-manager --bin manager`",
        manager_bin.display()
    );
    let log = std::fs::File::create(cp.dir().join("manager.log"))?;
    ChildGroup::spawn(
        "manager",
        Command::new(&manager_bin)
            .args([
                "run",
                "--concurrency",
                &concurrency.to_string(),
                "--metrics-addr",
                &format!("127.0.0.1:{metrics_port}"),
            ])
            .args(lifecycle_flags(&manager_bin)?)
            .env("KUBECONFIG", cp.kubeconfig_path())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log),
    )
}

/// Waits (from a watch) until `done` holds for `n` distinct objects;
/// returns false when the stream ended first.
async fn watch_until<K>(api: Api<K>, n: usize, done: impl Fn(&K) -> bool) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut seen = HashSet::new();
    let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    while let Some(ev) = stream.next().await {
        let (Ok(Event::Apply(obj)) | Ok(Event::InitApply(obj))) = ev else {
            continue;
        };
        if done(&obj) {
            seen.insert(obj.meta().name.clone().unwrap_or_default());
            if seen.len() == n {
                return true;
            }
        }
    }
    false
}

/// The API server's request counts once they stop moving (at most 5 s):
/// the manager publishes Events off its reconcile path, so the last few
/// binds' Events may still be in flight when the last claim is Bound.
async fn settled_requests(client: &kube::Client) -> BTreeMap<String, f64> {
    let mut last = apiserver_requests(client).await;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = apiserver_requests(client).await;
        if now == last {
            break;
        }
        last = now;
    }
    last
}

/// Creates `n` selector claims, `PARALLEL` at a time.
async fn create_claims(claims: &Api<MachineClaim>, n: usize) {
    futures::stream::iter(0..n)
        .map(|i| {
            let claims = claims.clone();
            async move {
                let c: MachineClaim = serde_json::from_value(json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
                    "metadata": {"name": format!("c{i:04}")},
                    "spec": {"selector": {"matchLabels": {"pool": "scale"},
                             "hardware": {"minCPUs": 8, "minMemoryBytes": 16i64 << 30, "disks": [{"minSizeGigabytes": 500}]}}}
                }))
                .unwrap();
                claims.create(&PostParams::default(), &c).await.unwrap();
            }
        })
        .buffer_unordered(PARALLEL)
        .collect::<Vec<_>>()
        .await;
}

/// The manager's `anneal_manager_bind_conflicts` counter.
fn bind_conflicts(metrics_port: u16) -> f64 {
    let metrics = Command::new("curl")
        .args(["-sf", &format!("http://127.0.0.1:{metrics_port}/metrics")])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    metrics
        .lines()
        .filter(|l| l.starts_with("anneal_manager_bind_conflicts"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The Events in the namespace by reason (the story the manager told).
async fn events_by_reason(client: &kube::Client) -> anyhow::Result<BTreeMap<String, u64>> {
    let mut reasons = BTreeMap::<String, u64>::new();
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client.clone(), NS);
    for e in events.list(&ListParams::default()).await?.items {
        *reasons.entry(e.reason.unwrap_or_default()).or_default() +=
            e.count.unwrap_or(1).max(1) as u64;
    }
    Ok(reasons)
}

/// What one binding window measured.
struct Window {
    create_secs: f64,
    bind_secs: f64,
    writes: BTreeMap<String, f64>,
    /// GET, LIST and WATCH requests (the benchmark's own watch and metrics
    /// reads included).
    reads: BTreeMap<String, f64>,
    cpu: BTreeMap<&'static str, f64>,
}

/// Creates the claims and waits for every one to be Bound: times, the API
/// server's writes and each process's CPU seconds in that window.
async fn bind_window(
    client: &kube::Client,
    n: usize,
    procs: &[(&'static str, u32)],
) -> anyhow::Result<Window> {
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), NS);
    let requests_before = apiserver_requests(client).await;
    let cpu_before = cpu_all(procs);
    let start = Instant::now();
    // Bound claims counted from a watch: a LIST of every claim every few
    // hundred milliseconds would load the API server being measured.
    let bound = tokio::spawn(watch_until(claims.clone(), n, |c: &MachineClaim| {
        c.status.as_ref().and_then(|s| s.phase) == Some(ClaimPhase::Bound)
    }));
    create_claims(&claims, n).await;
    let create_secs = start.elapsed().as_secs_f64();
    let all = tokio::time::timeout(BIND_LIMIT.saturating_sub(start.elapsed()), bound).await;
    anyhow::ensure!(
        matches!(all, Ok(Ok(true))),
        "not every claim Bound after {BIND_LIMIT:?}"
    );
    let bind_secs = start.elapsed().as_secs_f64();
    let cpu_after = cpu_all(procs);
    let requests_after = settled_requests(client).await;
    let (writes, reads): (BTreeMap<String, f64>, BTreeMap<String, f64>) = requests_after
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v - requests_before.get(k).copied().unwrap_or(0.0),
            )
        })
        .filter(|(_, v)| *v > 0.0)
        .partition(|(k, _)| {
            ["POST ", "PATCH ", "PUT ", "DELETE ", "APPLY "]
                .iter()
                .any(|w| k.starts_with(w))
        });
    let cpu = cpu_after
        .iter()
        .map(|(k, v)| (*k, v - cpu_before.get(k).copied().unwrap_or(0.0)))
        .collect();
    Ok(Window {
        create_secs,
        bind_secs,
        writes,
        reads,
        cpu,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    if anneal_bench::flag("--help") || anneal_bench::flag("-h") {
        println!("{USAGE}");
        return Ok(());
    }
    let n = env_usize("SCALE_N", 1000);
    // Claims the manager reconciles at once (`manager run --concurrency`).
    let concurrency = env_usize("SCALE_CONCURRENCY", 8);

    let cp = ControlPlane::start().await?;
    cp.install_crds(&anneal_api::crds()).await?;
    let client = cp.client();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns =
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "anneal-system"}});
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(ns)?)
        .await?;
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);

    let t = Instant::now();
    create_machines(&client, n).await;
    println!(
        "created {n} machines + hardware in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let port = anneal_testinfra::free_port()?;
    let manager = start_manager(&cp, concurrency, port)?;
    // Let it become leader, sync its caches and write what it writes once
    // per Machine at start-up (the validity controller's `Valid` verdict)
    // before the clock starts: those writes are not binding's.
    let t = Instant::now();
    let judged = tokio::time::timeout(
        STARTUP_LIMIT,
        watch_until(machines.clone(), n, |m: &Machine| {
            m.status
                .as_ref()
                .is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Valid"))
        }),
    )
    .await;
    let startup_secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(
        matches!(judged, Ok(true)),
        "the manager did not judge every Machine (condition Valid) within {STARTUP_LIMIT:?}"
    );
    let rss_startup_mib = proc_status_kib(manager.pid(), "VmRSS:").unwrap_or(0) as f64 / 1024.0;
    println!(
        "manager started, every Machine judged, in {startup_secs:.1} s ({rss_startup_mib:.1} MiB)"
    );

    let [etcd, apiserver] = cp.pids();
    let procs = [
        ("manager", manager.pid()),
        ("kube-apiserver", apiserver),
        ("etcd", etcd),
        ("manager-scale", std::process::id()),
    ];
    let w = bind_window(&client, n, &procs).await?;
    let rss_mib = proc_status_kib(manager.pid(), "VmHWM:").unwrap_or(0) as f64 / 1024.0;
    // Machine side: every machine held by a distinct claim.
    let held: BTreeSet<String> = machines
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter_map(|m| m.spec.claim_ref.as_ref().map(|r| r.name.clone()))
        .collect();
    anyhow::ensure!(
        held.len() == n,
        "{} distinct holders for {n} machines",
        held.len()
    );
    let conflicts = bind_conflicts(port);
    drop(manager);
    let reasons = events_by_reason(&client).await?;
    println!("Events by reason: {reasons:?}");
    report(&Run {
        n,
        concurrency,
        startup_secs,
        rss_startup_mib,
        rss_mib,
        conflicts,
        reasons,
        w,
    })
}

/// Everything one run measured.
struct Run {
    n: usize,
    concurrency: usize,
    startup_secs: f64,
    rss_startup_mib: f64,
    rss_mib: f64,
    conflicts: f64,
    reasons: BTreeMap<String, u64>,
    w: Window,
}

/// Prints the run and writes `target/bench/manager-scale.json`.
fn report(r: &Run) -> anyhow::Result<()> {
    let (n, w, rss_mib, rss_startup_mib, conflicts) =
        (r.n, &r.w, r.rss_mib, r.rss_startup_mib, r.conflicts);
    let ratio = w.bind_secs / w.create_secs;
    // Binding writes no Machine status: a status write here raced the binds.
    let machine_status_writes: f64 = w
        .writes
        .iter()
        .filter(|(k, _)| k.ends_with(" machines/status"))
        .fold(0.0, |sum, (_, v)| sum + v);
    println!(
        "claims created (reference, API server only): {:.2} s",
        w.create_secs
    );
    println!(
        "all {n} claims Bound after: {:.2} s  (ratio to reference {ratio:.2}x; goal < {GOAL_SECS} s)",
        w.bind_secs
    );
    println!(
        "manager peak RSS (VmHWM): {rss_mib:.1} MiB (goal < {GOAL_MIB} MiB; {rss_startup_mib:.1} MiB before the first claim)"
    );
    println!("bind conflicts (409) resolved: {conflicts}");
    println!("API server writes while binding (the {n} creates included), per claim:");
    for (k, v) in &w.writes {
        println!("  {k:<40} {:>9} ({:.2} per claim)", *v as u64, v / n as f64);
    }
    println!("API server reads while binding: {:?}", w.reads);
    println!("CPU seconds while binding: {:?}", w.cpu);
    let json = json!({
        "benchmark": "manager-scale",
        "machines": n, "claims": n, "concurrency": r.concurrency,
        "lifecycle": std::env::var("SCALE_LIFECYCLE").is_ok_and(|v| v == "1"),
        "load_average_at_end": anneal_bench::load_average(),
        "create_claims_secs": w.create_secs,
        "all_bound_secs": w.bind_secs,
        "ratio_bound_to_create": ratio,
        "manager_peak_rss_mib": rss_mib,
        "manager_rss_after_startup_mib": rss_startup_mib,
        "bind_conflicts": conflicts,
        "apiserver_writes": w.writes,
        "apiserver_reads": w.reads,
        "cpu_secs_while_binding": w.cpu,
        "events_by_reason": r.reasons,
        "goal_secs": GOAL_SECS, "goal_rss_mib": GOAL_MIB,
        "manager_startup_secs": r.startup_secs,
        "machine_status_writes": machine_status_writes,
        "pass": w.bind_secs < GOAL_SECS && rss_mib < GOAL_MIB && machine_status_writes == 0.0,
    });
    anneal_bench::write_json("manager-scale", &json)?;
    Ok(())
}
