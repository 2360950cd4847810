//! Agent API load figure (docs/lifecycle.md, "Agent API"): N concurrent
//! connections (default 1,000) with bogus tokens against the real manager
//! process's agent API (half register with a bogus boot token, half call
//! `next` with a bogus session; each from its own loopback source address, so
//! no per-address rate limit hides them), while M legitimate agents (default
//! 5) register with the boot tokens the manager minted. Prints:
//! - the API server's LIST count of Machines (`apiserver_request_total`)
//!   before and after the flood: the bogus requests must cause none;
//! - how many legitimate registrations succeeded, and their latency;
//! - the manager's peak RSS (VmHWM) against the 150 MiB budget.
//!
//! Writes target/bench/agentapi-load.json. Needs the control-plane
//! binaries of `bash tests/setup.sh`; build the manager first:
//! `cargo build --release -p anneal-manager --bin manager &&
//!  cargo run --release -p anneal-bench --bin agentapi-load [-- --connections 1000 --legit 5 --manager PATH]`

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anneal_api::Machine;
use anneal_bench::{ChildGroup, free_port, load_average, option, write_json};
use anneal_testinfra::ControlPlane;
use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

/// The budget for the manager's RSS under this load.
const BUDGET_MIB: f64 = 150.0;

/// The API server's LIST count of Machines.
async fn machine_lists(client: &kube::Client) -> anyhow::Result<u64> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await?;
    Ok(text
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("resource=\"machines\"")
                && l.contains("verb=\"LIST\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64)
}

struct Client {
    tls: TlsConnector,
    addr: SocketAddr,
}

impl Client {
    /// One request from `from` (`Connection: close`): the status code.
    async fn call(
        &self,
        from: IpAddr,
        method: &str,
        path: &str,
        bearer: Option<&str>,
        body: &str,
    ) -> anyhow::Result<u16> {
        let s = tokio::net::TcpSocket::new_v4()?;
        s.bind(SocketAddr::new(from, 0))?;
        let tcp = s.connect(self.addr).await?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
        let mut s = self.tls.connect(name, tcp).await?;
        let auth = bearer
            .map(|b| format!("Authorization: Bearer {b}\r\n"))
            .unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Anneal-Agent-Schema: 1\r\nContent-Type: application/json\r\n{auth}\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        let text = String::from_utf8_lossy(&out);
        text.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| {
                format!(
                    "not an HTTP response: {:?}",
                    text.chars().take(80).collect::<String>()
                )
            })
    }
}

/// A call's status code (or its error) and how long it took.
type Answer = (Result<u16, String>, Duration);

/// `legit` legitimate Machines (no BMC) and the boot tokens the manager arms
/// them with: (namespace/name, token) each.
async fn boot_tokens(
    client: &kube::Client,
    legit: usize,
    log: &std::path::Path,
) -> anyhow::Result<Vec<(String, String)>> {
    let machines = Api::<Machine>::namespaced(client.clone(), "default");
    for i in 0..legit {
        let m: Machine = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1",
            "kind": "Machine",
            "metadata": {"name": format!("load-{i}"), "namespace": "default"},
            "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": format!("52:54:00:7e:00:{i:02x}")},
        }))?;
        machines.create(&PostParams::default(), &m).await?;
    }
    let secrets = Api::<Secret>::namespaced(client.clone(), "default");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut tokens = Vec::new();
    for i in 0..legit {
        let name = format!("load-{i}-boot-token");
        loop {
            if let Some(t) = secrets
                .get_opt(&name)
                .await?
                .and_then(|s| s.data?.get("token").map(|b| b.0.clone()))
            {
                tokens.push((format!("default/load-{i}"), String::from_utf8(t)?));
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "Secret default/{name} did not appear within 60 s: the manager did not arm \
                     machine load-{i} (its log: {})",
                    log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(tokens)
}

/// A client of the agent API on `api_port`, trusting the CA certificate
/// where the manager publishes it.
async fn agent_client(client: &kube::Client, api_port: u16) -> anyhow::Result<Client> {
    let ca =
        Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), "anneal-system")
            .get("anneal-agent-api-ca")
            .await?;
    let ca_pem = ca
        .data
        .as_ref()
        .and_then(|d| d.get("ca.crt"))
        .map(|s| s.clone().into_bytes())
        .context("ca.crt in ConfigMap anneal-system/anneal-agent-api-ca")?;
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject as _;
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&ca_pem) {
        roots.add(c?)?;
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Client {
        tls: TlsConnector::from(Arc::new(tls)),
        addr: SocketAddr::from(([127, 0, 0, 1], api_port)),
    })
}

/// Returns once the agent API on `api_port` answers (the index has its
/// first list), within 60 s.
async fn wait_answering(
    agent: &Client,
    api_port: u16,
    log: &std::path::Path,
) -> anyhow::Result<()> {
    let ready = Instant::now() + Duration::from_secs(60);
    while agent
        .call(
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            "GET",
            "/v1/agent/next",
            None,
            "",
        )
        .await
        .is_err()
    {
        if Instant::now() > ready {
            bail!(
                "the agent api on 127.0.0.1:{api_port} did not answer within 60 s (log: {})",
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// `connections` concurrent bogus-token calls, each from its own loopback
/// address: half register with a bogus boot token, half call `next` with a
/// bogus session.
fn spawn_flood(agent: &Arc<Client>, connections: usize) -> Vec<tokio::task::JoinHandle<Answer>> {
    (0..connections)
        .map(|i| {
            let agent = agent.clone();
            let from = IpAddr::V4(Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8));
            tokio::spawn(async move {
                let bogus = format!("{:064x}", i + 1);
                let t = Instant::now();
                let r = if i % 2 == 0 {
                    let body = json!({"bootToken": bogus, "bootMac": "52:54:00:00:00:01", "agentVersion": "load"});
                    agent
                        .call(from, "POST", "/v1/agent/register", None, &body.to_string())
                        .await
                } else {
                    agent
                        .call(from, "GET", "/v1/agent/next", Some(&bogus), "")
                        .await
                };
                (r.map_err(|e| format!("{e:#}")), t.elapsed())
            })
        })
        .collect()
}

/// The legitimate agents' registrations with their boot `tokens`.
fn spawn_registrations(
    agent: &Arc<Client>,
    tokens: &[(String, String)],
) -> Vec<tokio::task::JoinHandle<Answer>> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, (machine, token))| {
            let agent = agent.clone();
            let body = json!({"bootToken": token, "bootMac": format!("52:54:00:7e:00:{i:02x}"), "agentVersion": "load", "machine": machine}).to_string();
            tokio::spawn(async move {
                let t = Instant::now();
                let r = agent
                    .call(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1)), "POST", "/v1/agent/register", None, &body)
                    .await;
                (r.map_err(|e| format!("{e:#}")), t.elapsed())
            })
        })
        .collect()
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    if anneal_bench::flag("--help") {
        println!(
            "agentapi-load [--connections N (1000)] [--legit M (5)] [--manager PATH]\n\
             N concurrent bogus-token connections against the manager's agent API while M \
             agents register; prints the API server's Machine LISTs, the registrations and \
             the manager's peak RSS against {BUDGET_MIB} MiB; writes target/bench/agentapi-load.json"
        );
        return Ok(());
    }
    let connections: usize = option("--connections").map_or(Ok(1000), |v| v.parse())?;
    let legit: usize = option("--legit").map_or(Ok(5), |v| v.parse())?;
    let manager_bin = anneal_bench::sibling_bin("manager", "--manager", "anneal-manager")?;
    let cp = ControlPlane::start().await?;
    cp.install_crds(&anneal_api::crds()).await?;
    let client = cp.client();
    let _ = Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "anneal-system"}}))?,
        )
        .await;
    let api_port = free_port()?;
    let log = cp.dir().join("manager.log");
    let mut cmd = Command::new(&manager_bin);
    cmd.args(["run", "--no-leader-election"])
        .arg(format!("--metrics-addr=127.0.0.1:{}", free_port()?))
        .arg(format!("--agent-api-listen=127.0.0.1:{api_port}"))
        .args(["--agent-api-name", "127.0.0.1"])
        .env("KUBECONFIG", cp.kubeconfig_path())
        .env("RUST_LOG", "warn");
    let manager = ChildGroup::spawn_logged("manager", &mut cmd, &log)?;
    let tokens = boot_tokens(&client, legit, &log).await?;
    let agent = Arc::new(agent_client(&client, api_port).await?);
    wait_answering(&agent, api_port, &log).await?;

    let lists_before = machine_lists(&client).await?;
    let start = Instant::now();
    let flood = spawn_flood(&agent, connections);
    // legitimate agents register while the flood is in flight
    tokio::time::sleep(Duration::from_millis(300)).await;
    let legit_calls = spawn_registrations(&agent, &tokens);
    let mut legit_ok = 0;
    let mut legit_secs = Vec::new();
    for c in legit_calls {
        let (r, took) = c.await?;
        if matches!(r, Ok(200)) {
            legit_ok += 1;
        } else {
            println!("  legitimate registration: {r:?}");
        }
        legit_secs.push(took.as_secs_f64());
    }
    let mut by_code = std::collections::BTreeMap::<String, usize>::new();
    let mut slowest = 0f64;
    for f in flood {
        let (r, took) = f.await?;
        let key = match r {
            Ok(c) => c.to_string(),
            Err(e) => format!("error: {}", e.chars().take(60).collect::<String>()),
        };
        *by_code.entry(key).or_default() += 1;
        slowest = slowest.max(took.as_secs_f64());
    }
    let flood_secs = start.elapsed().as_secs_f64();
    let lists_after = machine_lists(&client).await?;
    let rss = anneal_bench::peak_rss_mib(manager.pid())?;
    drop(manager);
    println!(
        "agent api: {connections} concurrent bogus-token connections in {flood_secs:.1} s \
         (slowest {slowest:.1} s): {by_code:?}"
    );
    println!(
        "API server Machine LISTs: {lists_before} before, {lists_after} after = {} from the flood",
        lists_after.saturating_sub(lists_before)
    );
    legit_secs.sort_by(f64::total_cmp);
    println!(
        "legitimate registrations during the flood: {legit_ok} of {legit} succeeded (slowest {:.2} s)",
        legit_secs.last().copied().unwrap_or(0.0)
    );
    println!(
        "manager peak RSS (VmHWM): {rss:.1} MiB / budget {BUDGET_MIB} MiB = {:.2} ({})",
        rss / BUDGET_MIB,
        if rss < BUDGET_MIB { "met" } else { "NOT met" }
    );
    write_json(
        "agentapi-load",
        &json!({
            "connections": connections,
            "flood_seconds": flood_secs,
            "slowest_seconds": slowest,
            "answers": by_code,
            "machine_lists_before": lists_before,
            "machine_lists_after": lists_after,
            "legit": legit,
            "legit_ok": legit_ok,
            "legit_seconds": legit_secs,
            "manager_peak_rss_mib": rss,
            "budget_mib": BUDGET_MIB,
            "load_average": load_average(),
        }),
    )?;
    Ok(())
}
