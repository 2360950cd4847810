//! Figures (a program, not a test): N Machines spread over B Subnets, one
//! bootd watcher per Subnet (bootd's own `watch::run`, in-process, each on
//! its own client) against a real control plane; W Machine writes after
//! they synced. Prints, per Machine write, the API server's reads (GET and
//! LIST of machines, subnets, secrets) and the watch events it sent for
//! Machines, and how long until every bootd's table showed every write.
//!
//! Reproduce:
//! `cargo build --release -p anneal-bench --bin bootd-watch-scale && target/release/bootd-watch-scale`
//! (`SCALE_N` machines, default 10,000; `SCALE_BOOTDS` Subnets and bootds,
//! default 10; `SCALE_WRITES` Machine writes measured, default 200).
//! Writes `target/bench/bootd-watch-scale.json`.
//!
//! Before bootd watched through caches, every bootd re-listed every Machine
//! (and re-read its Subnet and token Secret) on every Machine change: about
//! N Machines read per bootd per write.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anneal_api::{Machine, Subnet};
use anneal_bootd::watch::{WatchConfig, build, run};
use anneal_bootd::{CancellationToken, Shared, StaticConfig};
use anneal_dhcp::Leases;
use anneal_testinfra::ControlPlane;
use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const NS: &str = "default";
const PARALLEL: usize = 32;
/// How long every bootd may take to show what it must.
const LIMIT: Duration = Duration::from_secs(300);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Sums `metric` lines of the API server's /metrics whose labels contain
/// every one of `labels` and any one of `any`.
async fn metric_sum(client: &kube::Client, metric: &str, labels: &[&str], any: &[&str]) -> f64 {
    let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = client.request_text(req).await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter(|l| any.is_empty() || any.iter().any(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// GET and LIST requests of what bootd reads.
async fn reads(client: &kube::Client) -> f64 {
    let mut sum = 0.0;
    for verb in ["verb=\"GET\"", "verb=\"LIST\""] {
        sum += metric_sum(
            client,
            "apiserver_request_total",
            &[verb],
            &[
                "resource=\"machines\"",
                "resource=\"subnets\"",
                "resource=\"secrets\"",
            ],
        )
        .await;
    }
    sum
}

/// Watch events the API server sent for Machines.
async fn machine_watch_events(client: &kube::Client) -> f64 {
    metric_sum(
        client,
        "apiserver_watch_events_total",
        &["anneal.dev"],
        &["kind=\"Machine\"", "resource=\"machines\""],
    )
    .await
}

fn subnet(i: usize) -> Subnet {
    serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
        "metadata": {"name": format!("rack{i}")},
        "spec": {
            "siteRef": {"name": "site"}, "cidr": format!("10.{i}.0.0/16"),
            "bootd": {"serverIP": format!("10.{i}.0.2"), "mode": "External"},
            "dhcp": {"mode": "proxy"},
        }
    }))
    .unwrap()
}

fn mac(i: usize) -> String {
    format!(
        "52:54:{:02x}:{:02x}:{:02x}:01",
        i >> 16 & 0xff,
        i >> 8 & 0xff,
        i & 0xff
    )
}

/// Waits until `ok` holds for every bootd's snapshot.
async fn until(what: &str, bootds: &[Arc<Shared>], ok: impl Fn(usize, &Shared) -> bool) {
    let t = Instant::now();
    while !bootds.iter().enumerate().all(|(i, s)| ok(i, s)) {
        assert!(t.elapsed() < LIMIT, "{what}: not within {LIMIT:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let n = env_usize("SCALE_N", 10_000);
    let b = env_usize("SCALE_BOOTDS", 10).max(1);
    let w = env_usize("SCALE_WRITES", 200).max(1);
    let cp = ControlPlane::start().await?;
    cp.install_crds(&anneal_api::crds()).await?;
    let client = cp.client();
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), NS);
    for i in 0..b {
        subnets.create(&PostParams::default(), &subnet(i)).await?;
    }
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
    let t = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let machines = machines.clone();
            async move {
                let m: Machine = serde_json::from_value(json!({
                    "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
                    "metadata": {"name": format!("m{i}")},
                    "spec": {"subnetRef": {"name": format!("rack{}", i % b)}, "bootMACAddress": mac(i)}
                }))
                .unwrap();
                machines.create(&PostParams::default(), &m).await.unwrap();
            }
        })
        .buffer_unordered(PARALLEL)
        .collect::<Vec<_>>()
        .await;
    println!(
        "created {n} machines on {b} subnets in {:.1} s",
        t.elapsed().as_secs_f64()
    );

    let cancel = CancellationToken::new();
    let mut bootds = Vec::new();
    for i in 0..b {
        let base = StaticConfig::from_yaml(&format!(
            "serverIP: 10.{i}.0.2\ncidr: 10.{i}.0.0/16\ndhcp: {{mode: proxy}}\nartifacts: {{kernel: /k, initrd: /i}}\n",
        ))?;
        let cfg = WatchConfig {
            namespace: NS.into(),
            subnet: format!("rack{i}"),
            base,
            http_port: 8080,
        };
        let own = cp.client();
        let (snap, _, _) = build(&own, &cfg).await?;
        let shared = Arc::new(Shared::new(snap, Leases::default(), String::new()));
        tokio::spawn(run(own, cfg, shared.clone(), cancel.clone()));
        bootds.push(shared);
    }
    let per = |i: usize| (0..n).filter(|m| m % b == i).count();
    until("every bootd's table complete", &bootds, |i, s| {
        s.snapshot().machines.len() == per(i)
    })
    .await;

    let reads_before = reads(&client).await;
    let events_before = machine_watch_events(&client).await;
    let t = Instant::now();
    // W annotation writes (the debug shell bit each bootd's table carries)
    let written: Vec<usize> = (0..w).map(|k| k * n / w).collect();
    futures::stream::iter(written.clone())
        .map(|i| {
            let machines = machines.clone();
            async move {
                let patch = json!({"metadata": {"annotations": {anneal_bootd::watch::DEBUG_SHELL_ANNOTATION: "true"}}});
                machines
                    .patch(&format!("m{i}"), &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .unwrap();
            }
        })
        .buffer_unordered(PARALLEL)
        .collect::<Vec<_>>()
        .await;
    let macs: Vec<(usize, anneal_dhcp::Mac)> = written
        .iter()
        .map(|&i| (i % b, mac(i).parse().unwrap()))
        .collect();
    until("every write in its bootd's table", &bootds, |i, s| {
        let snap = s.snapshot();
        macs.iter()
            .filter(|(k, _)| *k == i)
            .all(|(_, m)| snap.machines.get(m).is_some_and(|e| e.debug_shell))
    })
    .await;
    let seen_secs = t.elapsed().as_secs_f64();
    let reads = reads(&client).await - reads_before;
    let events = machine_watch_events(&client).await - events_before;
    cancel.cancel();
    let reads_per_write = reads / w as f64;
    let events_per_write = events / w as f64;
    println!("{w} Machine writes, {b} bootds, {n} Machines:");
    println!(
        "  API server reads (GET/LIST machines, subnets, secrets) per write: {reads_per_write:.2}"
    );
    println!(
        "  Machine watch events sent per write (all watchers): {events_per_write:.2} (one bootd watches each Machine)"
    );
    println!("  every write in its bootd's table after {seen_secs:.2} s");
    println!(
        "  before (a re-list per change): about {} Machines read per bootd per write",
        n
    );
    let json = json!({
        "benchmark": "bootd-watch-scale",
        "machines": n, "bootds": b, "writes": w,
        "reads_per_write": reads_per_write,
        "machine_watch_events_per_write": events_per_write,
        "all_seen_secs": seen_secs,
        "load_average_at_end": anneal_bench::load_average(),
        "labels": BTreeMap::from([("reads", "GET+LIST of machines, subnets, secrets")]),
    });
    anneal_bench::write_json("bootd-watch-scale", &json)?;
    Ok(())
}
