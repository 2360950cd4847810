//! `/metrics`: reconcile counts and errors by kind, binds and bind
//! conflicts. No per-object labels, so cardinality stays fixed.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Label set: the kind a controller reconciles.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// Kind, for example `MachineClaim`.
    pub kind: String,
}

/// Label set: the kind a controller reconciles and the fixed kind of the
/// error a reconcile returned.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    /// Kind, for example `MachineClaim`.
    pub kind: String,
    /// Error kind, for example `api` or `conflict`.
    pub error: String,
}

/// Label set: a Machine state (`status.state`; `None` before the first).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// State, for example `Available`.
    pub state: String,
}

/// Every value of [`StateLabel::state`].
pub const MACHINE_STATES: &[&str] = &[
    "None",
    "Enrolling",
    "Inspecting",
    "Available",
    "Provisioning",
    "Provisioned",
    "Deprovisioning",
    "PoweringOff",
    "Released",
    "Parked",
];

/// The manager's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Reconciles run, by kind.
    pub reconciles: Family<KindLabel, Counter>,
    /// Reconciles that returned an error, by kind and error kind.
    pub reconcile_errors: Family<ErrorLabel, Counter>,
    /// Successful binds.
    pub binds: Counter,
    /// Bind patches refused with 409 Conflict.
    pub bind_conflicts: Counter,
    /// Machines released by claim deletion.
    pub releases: Counter,
    /// 1 while this replica holds the leader Lease.
    pub leader: Gauge,
    /// Machines by state (the leader's Machine lifecycle sets it; every
    /// state has a sample, 0 included).
    pub machines: Family<StateLabel, Gauge>,
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("anneal_manager");
        let reconciles = Family::<KindLabel, Counter>::default();
        let reconcile_errors = Family::<ErrorLabel, Counter>::default();
        let binds = Counter::default();
        let bind_conflicts = Counter::default();
        let releases = Counter::default();
        let leader = Gauge::default();
        let machines = Family::<StateLabel, Gauge>::default();
        registry.register("reconciles", "Reconciles run, by kind", reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Reconciles that failed, by kind and error kind",
            reconcile_errors.clone(),
        );
        registry.register("binds", "Claims bound to machines", binds.clone());
        registry.register(
            "bind_conflicts",
            "Bind patches refused with 409 Conflict",
            bind_conflicts.clone(),
        );
        registry.register(
            "releases",
            "Machines released by claim deletion",
            releases.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica is the leader",
            leader.clone(),
        );
        registry.register(
            "machines",
            "Machines by state (the leader's count)",
            machines.clone(),
        );
        Arc::new(Self {
            registry,
            reconciles,
            reconcile_errors,
            binds,
            bind_conflicts,
            releases,
            leader,
            machines,
        })
    }

    /// Sets the machines-by-state gauge from `(state, count)` pairs; a state
    /// not given is 0.
    pub fn set_machine_states<'a>(&self, counts: impl IntoIterator<Item = (&'a str, i64)>) {
        let counts: std::collections::BTreeMap<&str, i64> = counts.into_iter().collect();
        for s in MACHINE_STATES {
            self.machines
                .get_or_create(&StateLabel {
                    state: (*s).to_string(),
                })
                .set(counts.get(s).copied().unwrap_or(0));
        }
    }

    /// Counts one reconcile of `kind`.
    pub fn reconciled(&self, kind: &str) {
        self.reconciles
            .get_or_create(&KindLabel {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Counts one failed reconcile of `kind` with an error of `error` kind.
    pub fn failed(&self, kind: &str, error: &str) {
        self.reconcile_errors
            .get_or_create(&ErrorLabel {
                kind: kind.to_string(),
                error: error.to_string(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Connections `/metrics` serves at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 32;
/// How long a connection may take to send its request and read the answer.
pub const CONNECTION_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `GET /metrics` (and `/healthz`) on `listener` until the task is
/// dropped. Deliberately minimal: one request per connection, at most
/// [`MAX_CONNECTIONS`] at once, each closed after [`CONNECTION_DEADLINE`];
/// a request head is read into 4 KiB at most.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    serve_bounded(listener, metrics, MAX_CONNECTIONS, CONNECTION_DEADLINE).await;
}

async fn serve_bounded(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    max: usize,
    deadline: std::time::Duration,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((stream, _)) = listener.accept().await else {
            // out of descriptors or similar: do not spin
            tokio::time::sleep(crate::agentapi::ACCEPT_BACKOFF).await;
            continue;
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tokio::time::timeout(deadline, answer(stream, &metrics)).await;
        });
    }
}

async fn answer(mut stream: tokio::net::TcpStream, metrics: &Metrics) {
    let mut buf = vec![0u8; 4096];
    let n = match stream.read(&mut buf).await {
        Ok(n) => n,
        Err(_) => return,
    };
    let head = String::from_utf8_lossy(buf.get(..n).unwrap_or_default());
    let path = head.split_whitespace().nth(1).unwrap_or("/");
    let (status, body, ctype) = match path {
        "/metrics" => (
            "200 OK",
            metrics.render(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        "/healthz" => ("200 OK", "ok\n".to_string(), "text/plain"),
        _ => ("404 Not Found", "not found\n".to_string(), "text/plain"),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    /// Idle connections hold the slots only until their deadline: with
    /// every slot taken by a silent client, the next request is answered
    /// once those are closed.
    #[tokio::test]
    async fn silent_connections_are_bounded_in_number_and_time() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve_bounded(
            listener,
            Metrics::new(),
            2,
            std::time::Duration::from_millis(300),
        ));
        let mut idle = Vec::new();
        for _ in 0..2 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        c.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        // the silent ones were closed (end of stream, nothing sent) before
        // the third was even accepted
        for s in idle {
            let mut rest = [0u8; 16];
            assert_eq!(s.try_read(&mut rest).unwrap(), 0);
        }
        server.abort();
    }

    /// Every metric the registry renders (`# TYPE NAME TYPE`) has a row in
    /// docs/metrics.md with that type (a counter as `NAME_total`).
    #[test]
    fn every_metric_is_in_docs_metrics_md_with_its_type() {
        let page = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"),
        )
        .unwrap();
        // a family renders only once it has a sample
        let m = Metrics::new();
        m.reconciles
            .get_or_create(&KindLabel {
                kind: "Machine".into(),
            })
            .inc();
        m.reconcile_errors
            .get_or_create(&ErrorLabel {
                kind: "Machine".into(),
                error: "api".into(),
            })
            .inc();
        let text = m.render();
        let mut seen = 0;
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let (name, kind) = rest.split_once(' ').unwrap();
            let queried = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            let row = format!("| `{queried}` | {kind} |");
            assert!(
                page.lines().any(|l| l.starts_with(&row)),
                "docs/metrics.md has no row starting {row:?}"
            );
            seen += 1;
        }
        assert_eq!(seen, 6, "{text}");
    }
}
