//! The manager runtime: one owner for everything `manager run` starts.
//!
//! [`Runtime`] owns the kube `Client`, the namespace scope (`--namespace`,
//! honoured by every controller; all namespaces only when unset), one root
//! [`CancellationToken`], one [`JoinSet`] of named controller tasks, the
//! event [`Recorder`] (reporting `anneal-manager` with this replica's
//! identity), the [`Metrics`] and the leader election.
//!
//! What runs where:
//! - on every replica: `/metrics`, the agent API (agents may reach any
//!   replica; the agent API writes only under optimistic locks) and the
//!   metadata endpoint when configured (it only reads);
//! - only while this replica holds the leader Lease: EVERY controller —
//!   claims, readiness, ipam, validity, the Cluster API provider (idle
//!   unless Cluster API is installed) and the Machine lifecycle (the one
//!   that calls BMCs and mints boot tokens).
//!
//! Losing the Lease cancels the controllers (a child token of the root one
//! per leadership term), waits for them to stop and drops their state (their
//! caches and in-memory maps live in the tasks); the replica then campaigns
//! again and, once elected, starts them afresh from a new list. It does not
//! exit: a replica that lost the Lease to a network blip is a follower like
//! any other.
//!
//! SIGTERM and Ctrl-C (or the `shutdown` future of [`run`]) stop the
//! runtime in order: the controllers first (running reconciles finish), then
//! the agent API, then `/metrics`; then [`Runtime::run`] returns `Ok`. A
//! controller task that ends on its own while leading is a bug: the runtime
//! stops and returns [`RunError::ControllerExited`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::runtime::events::Recorder;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, warn};

use crate::agentapi::AgentApiConfig;
use crate::controller::{Scope, reporter};
use crate::leader::{Elector, LeaderError, LeaseConfig};
use crate::lifecycle::LifecycleConfig;
use crate::metrics::{self, Metrics};

/// How long stopping controllers may take before their tasks are aborted.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Configuration of [`run`] and [`Runtime`].
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
    #[error("binding metrics address {addr} (pick a free one with --metrics-addr)")]
    Metrics {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The agent API could not start.
    #[error("starting the agent API")]
    AgentApi(#[source] crate::agentapi::AgentApiError),
    /// The metadata endpoint could not bind.
    #[error("binding the metadata endpoint to {addr} (pick a free address with --metadata-listen)")]
    Metadata {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A controller stopped while it should be running.
    #[error("controller {0} stopped on its own (see its log lines above); restart the manager")]
    ControllerExited(&'static str),
}

/// The manager runtime; see the module documentation.
pub struct Runtime {
    client: Client,
    cfg: RunConfig,
    cancel: CancellationToken,
    controllers: JoinSet<&'static str>,
    recorder: Recorder,
    reporter: kube::runtime::events::Reporter,
    metrics: Arc<Metrics>,
    lifecycle: Option<(LifecycleConfig, AgentApiConfig)>,
    content: Option<crate::content::ContentConfig>,
    store_quota: crate::content::quota::StoreQuota,
    metadata: Option<crate::metadata::MetadataConfig>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("cfg", &self.cfg)
            .field("controllers", &self.controllers.len())
            .finish_non_exhaustive()
    }
}

/// Which term ended, and why.
enum TermEnd {
    Shutdown,
    Lost(LeaderError),
    Exited(&'static str),
}

impl Runtime {
    /// A runtime for `cfg`; nothing runs before [`Runtime::run`].
    pub fn new(client: Client, cfg: RunConfig) -> Self {
        let identity = cfg.lease.as_ref().map(|l| l.identity.clone());
        Self {
            recorder: Recorder::new(client.clone(), reporter(identity.clone())),
            reporter: reporter(identity),
            client,
            cfg,
            cancel: CancellationToken::new(),
            controllers: JoinSet::new(),
            metrics: Metrics::new(),
            lifecycle: None,
            content: None,
            store_quota: crate::content::quota::StoreQuota::default(),
            metadata: None,
        }
    }

    /// Also runs the Machine lifecycle: its controller (leader only) and the
    /// agent API (every replica).
    #[must_use]
    pub fn with_lifecycle(mut self, cfg: LifecycleConfig, api: AgentApiConfig) -> Self {
        self.lifecycle = Some((cfg, api));
        self
    }

    /// Also runs the ImageImport, PartitionContent and Image controllers
    /// (leader only) with their workload executor.
    #[must_use]
    pub fn with_content(mut self, cfg: crate::content::ContentConfig) -> Self {
        self.content = Some(cfg);
        self
    }

    /// The content store's per-namespace byte quota for the controllers of
    /// [`Runtime::with_content`] (docs/images.md, "Store quota"); without
    /// it: unlimited.
    #[must_use]
    pub fn with_store_quota(mut self, quota: crate::content::quota::StoreQuota) -> Self {
        self.store_quota = quota;
        self
    }

    /// Also serves the metadata endpoint (every replica).
    #[must_use]
    pub fn with_metadata(mut self, cfg: crate::metadata::MetadataConfig) -> Self {
        self.metadata = Some(cfg);
        self
    }

    /// The root token: cancelling it shuts the runtime down in order.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// The metrics.
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Starts every controller into the JoinSet under `term`.
    fn spawn_controllers(&mut self, term: &CancellationToken) {
        // One Machine watch and cache for the controllers of this term:
        // each takes its feed while its future is built below, then it runs.
        let machines = Arc::new(crate::controller::SharedWatch::new(
            crate::controller::scoped(&self.client, self.cfg.namespace.as_deref()),
        ));
        let scope = Scope {
            client: self.client.clone(),
            namespace: self.cfg.namespace.clone(),
            metrics: self.metrics.clone(),
            recorder: self.recorder.clone(),
            reporter: self.reporter.clone(),
            cancel: term.clone(),
            machines: Some(machines.clone()),
        };
        let concurrency = self.cfg.concurrency;
        self.spawn(
            crate::claims::ID.name,
            crate::claims::controller(scope.clone(), concurrency),
        );
        self.spawn("validity", crate::validity::controller(scope.clone()));
        self.spawn(
            crate::readiness::ID.name,
            crate::readiness::controller(scope.clone()),
        );
        self.spawn(crate::ipam::ID.name, crate::ipam::controller(scope.clone()));
        // off (one info line) while Cluster API's kinds are not served
        self.spawn(crate::capi::ID.name, crate::capi::controller(scope.clone()));
        // every controller above took its Machine feed
        self.spawn("machine-watch", machines.run(term.clone()));
        if let Some(cfg) = &self.content {
            self.spawn(
                "content",
                crate::content::controller(scope.clone(), cfg.clone(), self.store_quota.clone()),
            );
        }
        if let Some((cfg, _)) = &self.lifecycle {
            let cfg = cfg.clone();
            self.spawn(
                crate::lifecycle::ID.name,
                crate::lifecycle::controller(scope, cfg),
            );
        }
    }

    /// Spawns one named controller task.
    fn spawn(&mut self, name: &'static str, fut: impl Future<Output = ()> + Send + 'static) {
        info!(controller = name, "starting controller");
        self.controllers.spawn(
            async move {
                fut.await;
                name
            }
            .instrument(tracing::info_span!("task", controller = name)),
        );
    }

    /// Cancels `term` and waits (bounded) for every controller to stop.
    async fn stop_controllers(&mut self, term: &CancellationToken, grace: Duration) {
        term.cancel();
        let drained = tokio::time::timeout(grace, async {
            while let Some(res) = self.controllers.join_next().await {
                match res {
                    Ok(name) => info!(controller = name, "controller stopped"),
                    Err(e) => warn!(error = %e, "controller task failed"),
                }
            }
        })
        .await;
        if drained.is_err() {
            warn!(
                left = self.controllers.len(),
                "controllers did not stop in time; aborting them"
            );
            self.controllers.shutdown().await;
        }
    }

    /// Runs until the root token is cancelled (Ok) or something cannot go
    /// on (Err). Leader election, if configured, gates every controller.
    pub async fn run(mut self) -> Result<(), RunError> {
        let services = CancellationToken::new();
        let metrics_task = match self.cfg.metrics_addr {
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| RunError::Metrics { addr, source })?;
                info!(%addr, "serving /metrics");
                let m = self.metrics.clone();
                let stop = services.clone();
                Some(tokio::spawn(async move {
                    tokio::select! {
                        () = metrics::serve(listener, m) => {}
                        () = stop.cancelled() => {}
                    }
                }))
            }
            None => None,
        };
        let agent_cancel = services.child_token();
        let agent_api = match &self.lifecycle {
            Some((_, api)) => Some(
                crate::agentapi::start(self.client.clone(), api.clone(), agent_cancel.clone())
                    .await
                    .map_err(RunError::AgentApi)?,
            ),
            None => None,
        };
        let metadata = match &self.metadata {
            Some(cfg) => Some(
                crate::metadata::start(self.client.clone(), cfg.clone(), agent_cancel.clone())
                    .await
                    .map_err(|source| RunError::Metadata {
                        addr: cfg.listen,
                        source,
                    })?,
            ),
            None => None,
        };

        let elector = self
            .cfg
            .lease
            .clone()
            .map(|l| Elector::new(self.client.clone(), l));
        let result = loop {
            if let Some(e) = &elector {
                tokio::select! {
                    res = e.acquire() => if let Err(err) = res { break Err(err.into()) },
                    () = self.cancel.cancelled() => break Ok(()),
                }
            }
            self.metrics.leader.set(1);
            let term = self.cancel.child_token();
            self.spawn_controllers(&term);
            let end = tokio::select! {
                // Shutdown first: cancelling the root also cancels the term,
                // so controllers ending then are not a failure.
                biased;
                () = self.cancel.cancelled() => TermEnd::Shutdown,
                err = async {
                    match &elector {
                        Some(e) => e.hold().await,
                        None => std::future::pending().await,
                    }
                } => TermEnd::Lost(err),
                Some(res) = self.controllers.join_next() => match res {
                    Ok(_) if self.cancel.is_cancelled() => TermEnd::Shutdown,
                    Ok(name) => TermEnd::Exited(name),
                    Err(e) => {
                        error!(error = %e, "controller task panicked");
                        TermEnd::Exited("unknown")
                    }
                },
            };
            // Leadership lost: the controllers stop within the elector's
            // grace, before the lease can expire for another replica.
            let grace = match (&end, &elector) {
                (TermEnd::Lost(_), Some(e)) => e.stop_grace(),
                _ => STOP_GRACE,
            };
            self.stop_controllers(&term, grace).await;
            self.metrics.leader.set(0);
            match end {
                TermEnd::Shutdown => break Ok(()),
                TermEnd::Lost(err) => {
                    error!(error = %err, "leadership lost; controllers stopped, campaigning again");
                }
                TermEnd::Exited(name) => {
                    error!(controller = name, "controller stopped on its own");
                    break Err(RunError::ControllerExited(name));
                }
            }
        };

        agent_cancel.cancel();
        if let Some(api) = agent_api {
            api.join().await;
            info!("agent API stopped");
        }
        if let Some(md) = metadata {
            md.join().await;
            info!("metadata endpoint stopped");
        }
        services.cancel();
        if let Some(t) = metrics_task {
            let _ = t.await;
            info!("/metrics stopped");
        }
        result
    }
}

/// Runs the manager's controllers (no lifecycle) until `shutdown` resolves
/// (Ok) or something cannot go on (Err): [`Runtime`] with `shutdown`
/// cancelling its root token.
pub async fn run(
    client: Client,
    cfg: RunConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let runtime = Runtime::new(client, cfg);
    let token = runtime.shutdown_token();
    let trigger = tokio::spawn(async move {
        shutdown.await;
        token.cancel();
    });
    let result = runtime.run().await;
    trigger.abort();
    result
}
