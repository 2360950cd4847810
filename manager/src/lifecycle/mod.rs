//! The Machine controller: Enrolling → Inspecting → Available, Released,
//! Parked, PoweringOff behind a finalizer; boot tokens, one-time PXE
//! power-on, the inspection deadline, RetryHeld after `max_restarts` Restart failures,
//! and the `anneal.dev/…` annotations (docs/api.md, Machine). On a lease-mode
//! Subnet the power-on waits until the Machine's reservation is live in
//! bootd ([`dhcp_gate`], condition `DHCPReservationReady`).
//!
//! The decisions are pure state handlers ([`handlers`]: a snapshot in, an
//! outcome with BMC actions and status changes out); [`driver`] gathers the
//! snapshot, carries out the decision and writes the status once, as a
//! JSON merge patch computed from the difference between the status read
//! and the status wanted, carrying the resourceVersion read as a
//! precondition, under the fixed field manager [`FIELD_MANAGER`]: a
//! concurrent write (the agent API consuming a boot token) makes the write
//! fail with 409 and the reconcile run again, and fields the controller
//! does not change are never touched.

pub mod dhcp_gate;
pub mod driver;
pub mod handlers;
pub mod status;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anneal_api::{Machine, MachineHardware, MachineState, Subnet};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::Recorder;
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::controller::{Identity, ReconcileError, Scope, drive};
use status::{condition, parse_duration_ms};

/// The field manager of every write of this controller.
pub const FIELD_MANAGER: &str = "anneal-lifecycle";
/// The finalizer that keeps a Machine until it is powered off.
pub const FINALIZER: &str = "anneal.dev/machine-cleanup";
pub use anneal_api::tenancy::{BOOT_TOKEN_KEY, BOOT_TOKEN_LABEL, BOOT_TOKEN_NAMESPACE_LABEL};

/// Annotations (all `anneal.dev/…`).
pub mod annotations {
    /// No writes, no calls.
    pub const PAUSED: &str = "anneal.dev/paused";
    /// No BMC calls; status kept current.
    pub const DETACHED: &str = "anneal.dev/detached";
    /// `{"mode":"hard"|"soft"}`.
    pub const REBOOT: &str = "anneal.dev/reboot";
    /// Skip inspection (needs `bootMACAddress`).
    pub const INSPECT_DISABLE: &str = "anneal.dev/inspect-disable";
    /// Inspect again.
    pub const RE_INSPECT: &str = "anneal.dev/re-inspect";
    /// Reset the error counters and lift RetryHeld.
    pub const CLEAR_ERROR: &str = "anneal.dev/clear-error";
    /// Skip BMC cleanup on delete.
    pub const FORCE_RELEASE: &str = "anneal.dev/force-release";
    /// `park` or `unpark`.
    pub const OPERATION: &str = "anneal.dev/operation";
}

/// Tunables of the controller.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// Operator default boot token lifetime (the inspection deadline);
    /// `spec.bootTimeout` can only raise it.
    pub boot_token_lifetime: Duration,
    /// How long GracefulShutdown may take before ForceOff.
    pub graceful_shutdown_timeout: Duration,
    /// Timeout of each BMC request.
    pub bmc_timeout: Duration,
    /// How often a healthy machine's BMC is checked.
    pub health_interval: Duration,
    /// Consecutive Restart failures that hold a machine.
    pub max_restarts: i32,
    /// Prefer UEFI HTTP boot over PXE where the BMC offers it.
    pub prefer_http_boot: bool,
    /// How long a Machine on a lease-mode Subnet may wait for its DHCP
    /// reservation to go live before a Warning Event (repeated every such
    /// period); it keeps waiting either way.
    pub dhcp_reservation_timeout: Duration,
    /// Where agents fetch contents, progress cadence.
    pub deploy: crate::deploy::runs::DeployConfig,
    /// Fast-track window (the agent API's too): an Available machine's
    /// agent keeps running this long after registering; None: off.
    pub fast_track_window: Option<Duration>,
    /// Accept `redfish+http://` BMC addresses (credentials in clear; labs
    /// only). Off: such a Machine gets `BMCReachable=False` with reason
    /// `InsecureBMCRefused` and no request is sent.
    pub allow_insecure_bmc: bool,
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            boot_token_lifetime: Duration::from_secs(20 * 60),
            graceful_shutdown_timeout: Duration::from_secs(120),
            bmc_timeout: Duration::from_secs(10),
            health_interval: Duration::from_secs(60),
            max_restarts: 3,
            prefer_http_boot: false,
            dhcp_reservation_timeout: Duration::from_secs(120),
            deploy: crate::deploy::runs::DeployConfig {
                content_url: None,
                progress_interval_seconds: 2,
                stall_timeout: Some(Duration::from_secs(600)),
                deadline: Some(Duration::from_secs(1200)),
                swarm: crate::swarm::SwarmConfig::default(),
            },
            fast_track_window: None,
            allow_insecure_bmc: false,
        }
    }
}

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API server call failed.
    #[error("kubernetes api call failed: {what}")]
    Kube {
        /// what was attempted
        what: &'static str,
        /// cause
        #[source]
        source: kube::Error,
    },
    /// The Machine has no namespace.
    #[error("machine has no namespace")]
    NoNamespace,
    /// The pass decided from a cached copy older than the Machine on the
    /// API server; it is run again on the fresh one (nothing was done).
    #[error(
        "the cached machine is older than the server's (resourceVersion {cached} vs {live}); deciding again"
    )]
    Stale {
        /// The cached resourceVersion.
        cached: String,
        /// The server's.
        live: String,
    },
    /// The BMC cleanup of a deleted machine has to be retried.
    #[error("bmc cleanup pending: {0}")]
    CleanupPending(String),
    /// bootd's copy of a boot token would go into a Subnet's namespace that
    /// does not grant the Machine's (nothing was written).
    #[error("{0}")]
    NotGranted(String),
    /// The finalizer helper failed.
    #[error("finalizer")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
}

impl Error {
    fn kube(what: &'static str) -> impl FnOnce(kube::Error) -> Self {
        move |source| Self::Kube { what, source }
    }

    fn is_conflict(&self) -> bool {
        match self {
            Self::Kube {
                source: kube::Error::Api(e),
                ..
            } => e.code == 409,
            Self::Stale { .. } => true,
            Self::Finalizer(f) => match f.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.is_conflict(),
                _ => false,
            },
            _ => false,
        }
    }
}

/// Shared state of the controller.
pub struct Context {
    client: kube::Client,
    cfg: LifecycleConfig,
    recorder: Recorder,
    /// BMC failures per machine: the cadence of the next attempt, kept in
    /// memory so a failing BMC is neither hammered by reconciles that status
    /// writes trigger nor rewrites status at every try.
    bmc_backoff: Arc<Mutex<HashMap<String, Backoff>>>,
    /// Machines warned about an overdue DHCP reservation: the start of the
    /// wait (ms) and how many timeout periods were warned about.
    dhcp_warned: Mutex<HashMap<String, (i64, i64)>>,
}

/// When a failing BMC may be tried again.
#[derive(Debug, Clone)]
struct Backoff {
    attempts: u32,
    next_at: tokio::time::Instant,
    /// Generation and annotations when it failed: an edit retries at once.
    fingerprint: String,
}

fn fingerprint(m: &Machine) -> String {
    format!(
        "{:?}/{}",
        m.metadata.generation,
        serde_json::to_string(m.annotations()).unwrap_or_default()
    )
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// Starts the agent API (which loads or creates its CA first) and runs the
/// Machine controller until `cancel` fires, without leader election: for
/// tests and single-replica tools. `manager run` goes through
/// [`crate::Runtime`], which runs the agent API on every replica and this
/// controller only on the leader.
pub async fn start(
    client: kube::Client,
    cfg: LifecycleConfig,
    api: crate::agentapi::AgentApiConfig,
    cancel: CancellationToken,
) -> Result<
    (
        crate::agentapi::RunningAgentApi,
        tokio::task::JoinHandle<()>,
    ),
    crate::agentapi::AgentApiError,
> {
    let server = crate::agentapi::start(client.clone(), api, cancel.clone()).await?;
    let controller = tokio::spawn(run(client, cfg, cancel));
    Ok((server, controller))
}

/// Runs the Machine controller (all namespaces, no leader election) until
/// `cancel` fires.
pub async fn run(client: kube::Client, cfg: LifecycleConfig, cancel: CancellationToken) {
    controller(Scope::standalone(client, cancel), cfg).await;
}

/// The Machine controller's identity.
pub const ID: Identity = Identity {
    name: "lifecycle",
    kind: "Machine",
    field_manager: FIELD_MANAGER,
};

impl Context {
    fn new(scope: &Scope, cfg: LifecycleConfig) -> Self {
        Self {
            client: scope.client.clone(),
            cfg,
            recorder: scope.recorder.clone(),
            bmc_backoff: Arc::default(),
            dhcp_warned: Mutex::default(),
        }
    }
}

/// Runs the Machine controller in `scope` (its namespace, its token) until
/// the scope is cancelled. Its in-memory state (BMC back-off, DHCP warnings)
/// lives and dies with this call.
pub async fn controller(scope: Scope, cfg: LifecycleConfig) {
    let ctx = Arc::new(Context::new(&scope, cfg));
    let mapper_backoff = ctx.bmc_backoff.clone();
    let controller = Controller::new(scope.api::<Machine>(), watcher::Config::default());
    let store = controller.store();
    tokio::spawn(count_states(
        store.clone(),
        scope.metrics.clone(),
        scope.cancel.clone(),
    ));
    let waiting = store.clone();
    let bound = store.clone();
    let secrets_of = store.clone();
    let controller = controller
        .owns(scope.api::<MachineHardware>(), watcher::Config::default())
        // A run's status (progress, result) wakes its Machine.
        .owns(
            scope.api::<anneal_api::DeployRun>(),
            watcher::Config::default(),
        )
        // A claim's edit (image, hooks, params) may start a new run.
        .watches(
            scope.api::<anneal_api::MachineClaim>(),
            watcher::Config::default(),
            |claim: anneal_api::MachineClaim| {
                let ns = claim.namespace().unwrap_or_default();
                claim
                    .status
                    .and_then(|s| s.machine_name)
                    .map(|m| ObjectRef::<Machine>::new(&m).within(&ns))
            },
        )
        // A PostHook's edit changes hooksHash for the claims that use it
        // (by name, or through their Image): their bound Machines plan
        // again; one whose intent did not change starts nothing.
        .watches(
            scope.api::<anneal_api::PostHook>(),
            watcher::Config::default(),
            move |hook: anneal_api::PostHook| {
                let ns = hook.namespace().unwrap_or_default();
                bound
                    .state()
                    .iter()
                    .filter(|m| {
                        m.spec.claim_ref.is_some() && m.namespace().unwrap_or_default() == ns
                    })
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect::<Vec<_>>()
            },
        )
        .watches_stream(
            bmc_secrets(&scope, secrets_of.clone()),
            move |secret: Secret| {
                let ns = secret.namespace().unwrap_or_default();
                let name = secret.name_any();
                store
                    .state()
                    .iter()
                    .filter(|m| {
                        let mns = m.namespace().unwrap_or_default();
                        m.spec.bmc.as_ref().is_some_and(|b| {
                            let c = &b.credentials_secret_ref;
                            let hit = c.name == name && c.namespace_or(&mns) == ns;
                            let ca = b
                                .ca_bundle_secret_ref
                                .as_ref()
                                .is_some_and(|r| r.name == name && r.namespace_or(&mns) == ns);
                            hit || ca
                        })
                    })
                    .map(|m| {
                        // A Secret edit retries at once.
                        let key = format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any());
                        mapper_backoff
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&key);
                        ObjectRef::from_obj(m.as_ref())
                    })
                    .collect::<Vec<_>>()
            },
        )
        // A Machine held for its DHCP reservation goes on as soon as its
        // lease-mode Subnet changes (reservation written, revision applied).
        .watches(
            scope.api::<Subnet>(),
            watcher::Config::default(),
            move |subnet: Subnet| {
                let key = (subnet.namespace().unwrap_or_default(), subnet.name_any());
                waiting
                    .state()
                    .iter()
                    .filter(|m| dhcp_gate::subnet_of(m) == key)
                    .filter(|m| {
                        m.status.as_ref().is_some_and(|st| {
                            condition(&st.conditions, dhcp_gate::CONDITION)
                                .is_some_and(|c| c.status == "False")
                        })
                    })
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect::<Vec<_>>()
            },
        );
    drive(ID, &scope, controller, reconcile, ctx).await;
}

/// How often the machines-by-state gauge is recounted from the store.
const STATE_GAUGE_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Sets the machines-by-state gauge from the controller's store while this
/// term lasts (the leader's); its samples are removed when the term ends,
/// so a follower reports none.
async fn count_states(
    store: Store<Machine>,
    metrics: Arc<crate::metrics::Metrics>,
    cancel: CancellationToken,
) {
    let ready = tokio::select! {
        r = store.wait_until_ready() => r.is_ok(),
        () = cancel.cancelled() => false,
    };
    if ready {
        loop {
            metrics.set_machine_states(state_counts(&store.state()));
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(STATE_GAUGE_EVERY) => {}
            }
        }
    }
    metrics.machines.clear();
}

/// Machines per state name (`None` before the first state).
fn state_counts(machines: &[Arc<Machine>]) -> Vec<(&'static str, i64)> {
    let mut counts: BTreeMap<&'static str, i64> = BTreeMap::new();
    for m in machines {
        let name = match m.status.as_ref().and_then(|s| s.state) {
            None => "None",
            Some(MachineState::Enrolling) => "Enrolling",
            Some(MachineState::Inspecting) => "Inspecting",
            Some(MachineState::Available) => "Available",
            Some(MachineState::Provisioning) => "Provisioning",
            Some(MachineState::Provisioned) => "Provisioned",
            Some(MachineState::Deprovisioning) => "Deprovisioning",
            Some(MachineState::PoweringOff) => "PoweringOff",
            Some(MachineState::Released) => "Released",
            Some(MachineState::Parked) => "Parked",
        };
        *counts.entry(name).or_default() += 1;
    }
    counts.into_iter().collect()
}

/// The namespaces of the Secrets `machines` reference for their BMCs
/// (credentials, CA bundles).
fn bmc_secret_namespaces(machines: &[Arc<Machine>]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for m in machines {
        let mns = m.namespace().unwrap_or_default();
        if let Some(b) = &m.spec.bmc {
            out.insert(b.credentials_secret_ref.namespace_or(&mns).to_string());
            if let Some(r) = &b.ca_bundle_secret_ref {
                out.insert(r.namespace_or(&mns).to_string());
            }
        }
    }
    out
}

/// The Secrets of the namespaces Machines take BMC Secrets from, as one
/// stream: a watch per namespace (the scope's one when it has one), started
/// and stopped as Machines come and go. The manager may read Secrets only
/// where an operator bound ClusterRole `anneal-manager-secrets`
/// (docs/kubernetes.md): never a cluster-wide Secret watch. A namespace
/// whose Secrets it may not watch is named in a warning (the watch retries
/// with back-off; the Machine's own reconcile names the refused Secret).
fn bmc_secrets(
    scope: &Scope,
    machines: Store<Machine>,
) -> impl futures::Stream<Item = Result<Secret, watcher::Error>> + Send + 'static {
    use futures::StreamExt as _;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Secret>(256);
    let client = scope.client.clone();
    let fixed = scope.namespace.clone();
    let cancel = scope.cancel.clone();
    tokio::spawn(async move {
        let mut watches: BTreeMap<String, tokio::task::JoinHandle<()>> = BTreeMap::new();
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                _ = tick.tick() => {}
            }
            let want = match &fixed {
                Some(ns) => BTreeSet::from([ns.clone()]),
                None => bmc_secret_namespaces(&machines.state()),
            };
            watches.retain(|ns, task| {
                let keep = want.contains(ns);
                if !keep {
                    task.abort();
                }
                keep
            });
            for ns in want {
                if watches.contains_key(&ns) {
                    continue;
                }
                let api = Api::<Secret>::namespaced(client.clone(), &ns);
                let tx = tx.clone();
                let name = ns.clone();
                watches.insert(
                    ns,
                    tokio::spawn(async move {
                        let mut refused = false;
                        let mut events = std::pin::pin!(
                            kube::runtime::WatchStreamExt::default_backoff(
                                kube::runtime::watcher(api, watcher::Config::default())
                            )
                        );
                        while let Some(ev) = events.next().await {
                            match ev {
                                // An edit (or a deletion) after the watch
                                // began; the initial list is no edit (it
                                // would cut short the back-off of every
                                // Machine with a failing BMC as the watch
                                // of its namespace starts).
                                Ok(watcher::Event::Apply(secret) | watcher::Event::Delete(secret)) => {
                                    refused = false;
                                    if tx.send(secret).await.is_err() {
                                        return;
                                    }
                                }
                                Ok(_) => refused = false,
                                Err(e) if !refused => {
                                    refused = true;
                                    tracing::warn!(namespace = %name, error = %e,
                                        "cannot watch the Secrets of this namespace (its Machines' BMC credentials): bind ClusterRole anneal-manager-secrets to the manager's ServiceAccount there");
                                }
                                Err(_) => {}
                            }
                        }
                    }),
                );
            }
        }
        for (_, t) in watches {
            t.abort();
        }
    });
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|o| o.map(Ok))).boxed()
}

impl ReconcileError for Error {
    fn is_conflict(&self) -> bool {
        Error::is_conflict(self)
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Kube { .. } => "api",
            Self::Finalizer(_) => "finalizer",
            _ => "reconcile",
        }
    }
}

#[tracing::instrument(skip_all, fields(machine = %m.name_any()))]
async fn reconcile(m: Arc<Machine>, ctx: Arc<Context>) -> Result<Action, Error> {
    if handlers::paused(&m) {
        // Reconciles of one Machine never overlap: once this is logged, no
        // reconcile of it runs until the annotation changes.
        tracing::info!("paused: not reconciled until the anneal.dev/paused annotation is removed");
        return Ok(Action::await_change());
    }
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let api = Api::<Machine>::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, m, |event| async {
        match event {
            FinalizerEvent::Apply(m) => driver::apply(&m, &ctx).await,
            FinalizerEvent::Cleanup(m) => driver::cleanup(&m, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// Command-line flags of the lifecycle half of `manager run`.
#[derive(Debug, Clone, clap::Args)]
pub struct LifecycleArgs {
    /// Do not run the Machine controller and the agent API.
    #[arg(long)]
    pub no_lifecycle: bool,
    /// Where the agent API listens (HTTPS only).
    #[arg(long, default_value = "0.0.0.0:8443")]
    pub agent_api_listen: std::net::SocketAddr,
    /// DNS names and IP addresses of the agent API's serving certificate
    /// (repeat the flag; the URL bootd writes as `anneal.api` must match).
    #[arg(long = "agent-api-name", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
    pub agent_api_names: Vec<String>,
    /// The manager's namespace: holds Secret `anneal-agent-api-ca`.
    #[arg(long, env = "POD_NAMESPACE", default_value = "anneal-system")]
    pub manager_namespace: String,
    /// Operator default boot token lifetime (the inspection deadline), a
    /// duration like `20m`; `spec.bootTimeout` can only raise it.
    #[arg(long, default_value = "20m")]
    pub boot_token_lifetime: String,
    /// How long GracefulShutdown may take before ForceOff (`2m`).
    #[arg(long, default_value = "2m")]
    pub graceful_shutdown_timeout: String,
    /// Boot by UEFI HTTP instead of PXE where the BMC offers it.
    #[arg(long)]
    pub prefer_http_boot: bool,
    /// How long a Machine on a lease-mode Subnet waits for its DHCP
    /// reservation to be live in bootd before a Warning Event (`2m`); the
    /// power-on stays held until it is.
    #[arg(long, default_value = "2m")]
    pub dhcp_reservation_timeout: String,
    /// Base URL agents fetch contents from (the content server, e.g.
    /// `http://10.0.0.1:8088`); without it no deploy can be planned.
    #[arg(long)]
    pub content_url: Option<String>,
    /// Distribution: trackers, seeders, the agents' swarm (docs/distribution.md).
    #[command(flatten)]
    pub swarm: crate::swarm::SwarmConfig,
    /// How often a deploying agent reports progress (`2s`).
    #[arg(long, default_value = "2s")]
    pub deploy_progress_interval: String,
    /// A deploy whose agent reports nothing for this long fails and is
    /// retried (`10m`).
    #[arg(long, default_value = "10m")]
    pub deploy_stall_timeout: String,
    /// A deploy that has not ended this long after its agent started it
    /// fails and is retried (`20m`; a claim's `spec.deployDeadline`
    /// overrides it).
    #[arg(long, default_value = "20m")]
    pub deploy_deadline: String,
    /// Fast-track: keep an Available machine's agent running, powered on,
    /// this long after it registered (`30m`), so a claim bound meanwhile
    /// deploys without a power cycle; unset: off.
    #[arg(long)]
    pub fast_track_window: Option<String>,
    /// Accept `redfish+http://` BMC addresses, which send the BMC
    /// credentials in clear (labs only); without it such a Machine gets
    /// `BMCReachable=False` (reason `InsecureBMCRefused`).
    #[arg(long)]
    pub allow_insecure_bmc: bool,
}

/// Errors of [`start_from_args`].
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A duration flag does not parse.
    #[error("invalid duration {0:?} (use 90s, 20m, 1h)")]
    Duration(String),
    /// The agent API cannot start.
    #[error(transparent)]
    AgentApi(#[from] crate::agentapi::AgentApiError),
}

impl LifecycleArgs {
    /// The controller's and the agent API's configurations (None when
    /// `--no-lifecycle`).
    pub fn configs(
        &self,
    ) -> Result<Option<(LifecycleConfig, crate::agentapi::AgentApiConfig)>, StartError> {
        if self.no_lifecycle {
            return Ok(None);
        }
        let dur = |s: &str| {
            parse_duration_ms(s)
                .and_then(|ms| u64::try_from(ms).ok())
                .map(Duration::from_millis)
                .ok_or_else(|| StartError::Duration(s.to_string()))
        };
        let cfg = LifecycleConfig {
            boot_token_lifetime: dur(&self.boot_token_lifetime)?,
            graceful_shutdown_timeout: dur(&self.graceful_shutdown_timeout)?,
            prefer_http_boot: self.prefer_http_boot,
            dhcp_reservation_timeout: dur(&self.dhcp_reservation_timeout)?,
            deploy: crate::deploy::runs::DeployConfig {
                content_url: self.content_url.clone(),
                progress_interval_seconds: u32::try_from(
                    dur(&self.deploy_progress_interval)?.as_secs().max(1),
                )
                .unwrap_or(2),
                stall_timeout: Some(dur(&self.deploy_stall_timeout)?),
                deadline: Some(dur(&self.deploy_deadline)?),
                swarm: self.swarm.clone(),
            },
            fast_track_window: self.fast_track_window.as_deref().map(dur).transpose()?,
            allow_insecure_bmc: self.allow_insecure_bmc,
            ..LifecycleConfig::default()
        };
        let api = crate::agentapi::AgentApiConfig {
            listen: self.agent_api_listen,
            namespace: self.manager_namespace.clone(),
            server_names: self.agent_api_names.clone(),
            fast_track_window: cfg.fast_track_window,
            ..crate::agentapi::AgentApiConfig::default()
        };
        Ok(Some((cfg, api)))
    }
}

/// Starts the lifecycle half of the manager from its flags (None when
/// disabled) without leader election; `manager run` passes
/// [`LifecycleArgs::configs`] to [`crate::Runtime`] instead.
pub async fn start_from_args(
    client: kube::Client,
    args: &LifecycleArgs,
    cancel: CancellationToken,
) -> Result<Option<crate::agentapi::RunningAgentApi>, StartError> {
    let Some((cfg, api)) = args.configs()? else {
        return Ok(None);
    };
    let (server, _controller) = start(client, cfg, api, cancel).await?;
    Ok(Some(server))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_state_gauge_counts_every_state_and_zeroes_the_rest() {
        let m = |state: Option<&str>| -> Arc<Machine> {
            let mut v = serde_json::json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
                "metadata": {"name": "m", "namespace": "ns"}, "spec": {"subnetRef": {"name": "s"}}});
            if let Some(s) = state {
                v["status"] = serde_json::json!({ "state": s });
            }
            Arc::new(serde_json::from_value(v).unwrap())
        };
        let ms = [
            m(Some("Available")),
            m(Some("Available")),
            m(Some("Provisioned")),
            m(None),
        ];
        let counts = state_counts(&ms);
        assert_eq!(counts, [("Available", 2), ("None", 1), ("Provisioned", 1)]);
        let metrics = crate::metrics::Metrics::new();
        metrics.set_machine_states(counts);
        let text = metrics.render();
        for line in [
            r#"anneal_manager_machines{state="Available"} 2"#,
            r#"anneal_manager_machines{state="Provisioned"} 1"#,
            r#"anneal_manager_machines{state="None"} 1"#,
            r#"anneal_manager_machines{state="Parked"} 0"#,
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        metrics.machines.clear();
        assert!(!metrics.render().contains("anneal_manager_machines{"));
    }
}
