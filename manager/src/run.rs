//! `manager run`: metrics, leader election, then the controllers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::runtime::events::{Recorder, Reporter};
use tokio::sync::watch;
use tracing::{error, info};

use crate::leader::{Elector, LeaderError, LeaseConfig};
use crate::metrics::{self, Metrics};

/// Configuration of [`run`].
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Watch only this namespace; `None` watches all.
    pub namespace: Option<String>,
    /// Claims reconciled in parallel.
    pub concurrency: u16,
    /// Leader election; `None` runs without it (single replica, tests).
    pub lease: Option<LeaseConfig>,
    /// Where `/metrics` listens; `None` serves no metrics.
    pub metrics_addr: Option<SocketAddr>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            namespace: None,
            concurrency: 8,
            lease: None,
            metrics_addr: None,
        }
    }
}

/// Errors that end [`run`].
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Leadership could not be kept.
    #[error(transparent)]
    Leader(#[from] LeaderError),
    /// The metrics listener could not bind.
    #[error("binding metrics address {addr}")]
    Metrics {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Runs the manager's controllers until `shutdown` resolves (Ok) or
/// leadership is lost (Err; the process should exit and restart).
pub async fn run(
    client: Client,
    cfg: RunConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let metrics = Metrics::new();
    if let Some(addr) = cfg.metrics_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| RunError::Metrics { addr, source })?;
        info!(%addr, "serving /metrics");
        tokio::spawn(metrics::serve(listener, metrics.clone()));
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    let elector = cfg
        .lease
        .clone()
        .map(|l| Arc::new(Elector::new(client.clone(), l)));
    let mut shutdown = std::pin::pin!(shutdown);
    if let Some(e) = &elector {
        tokio::select! {
            res = e.acquire() => res?,
            () = &mut shutdown => return Ok(()),
        }
        metrics.leader.set(1);
    }

    let reporter = Reporter {
        controller: "anneal-manager".into(),
        instance: cfg.lease.as_ref().map(|l| l.identity.clone()),
    };
    let recorder = Recorder::new(client.clone(), reporter);
    let claims = tokio::spawn(crate::claims::run(
        client.clone(),
        cfg.namespace.clone(),
        cfg.concurrency,
        metrics.clone(),
        recorder.clone(),
        stop(),
    ));
    let validity = tokio::spawn(crate::validity::run(
        client.clone(),
        cfg.namespace.clone(),
        metrics.clone(),
        stop.clone(),
    ));
    let rules = tokio::spawn(crate::readiness::run(
        client.clone(),
        cfg.namespace.clone(),
        metrics.clone(),
        recorder.clone(),
        stop(),
    ));
    let ipam = tokio::spawn(crate::ipam::run(
        client.clone(),
        cfg.namespace.clone(),
        metrics.clone(),
        recorder,
        stop(),
    ));

    let lost = async {
        match &elector {
            Some(e) => e.hold().await,
            None => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        err = lost => {
            error!(error = %err, "leadership lost; stopping");
            Err(RunError::Leader(err))
        }
        () = &mut shutdown => Ok(()),
    };
    metrics.leader.set(0);
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        let _ = claims.await;
        let _ = rules.await;
        let _ = validity.await;
        let _ = ipam.await;
    })
    .await;
    result
}
