//! The Machine controller: Enrolling → Inspecting → Available, Released,
//! Parked, PoweringOff behind a finalizer; boot tokens, one-time PXE
//! power-on, the inspection deadline, RetryHeld after three Restart failures,
//! and the `anneal.dev/…` annotations (docs/api.md, Machine). On a lease-mode
//! Subnet the power-on waits until the Machine's reservation is live in
//! bootd ([`dhcp_gate`], condition `DHCPReservationReady`).
//!
//! Status is written as a JSON merge patch computed from the difference
//! between the status read and the status wanted, carrying the
//! resourceVersion read as a precondition, under the fixed field manager
//! [`FIELD_MANAGER`]: a concurrent write (the agent API consuming a boot
//! token) makes the write fail with 409 and the reconcile run again, and
//! fields the controller does not change are never touched.

pub mod dhcp_gate;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anneal_api::agent::Token;
use anneal_api::{
    ErrorType, Machine, MachineHardware, MachineState, MachineStatus, NetBootStatus,
    OperationalStatus, Subnet,
};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder};
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::controller::{Identity, ReconcileError, Scope, drive};

use crate::redfish::{
    BmcAddress, BmcReason, BootTarget, Credentials, RedfishClient, ResetType, TlsPolicy,
};
use status::{condition, merge_diff, mint_token, parse_duration_ms, set_condition, time_in};

/// The field manager of every write of this controller.
pub const FIELD_MANAGER: &str = "anneal-lifecycle";
/// The finalizer that keeps a Machine until it is powered off.
pub const FINALIZER: &str = "anneal.dev/machine-cleanup";
/// Key of the boot token in Secret `<machine>-boot-token`.
pub const BOOT_TOKEN_KEY: &str = "token";
/// Label on boot-token Secrets naming their Machine.
pub const BOOT_TOKEN_LABEL: &str = "anneal.dev/boot-token-for";

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
    /// The BMC cleanup of a deleted machine has to be retried.
    #[error("bmc cleanup pending: {0}")]
    CleanupPending(String),
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

/// A BMC that cannot be used, classified.
#[derive(Debug, Clone)]
struct BmcFailure {
    reason: BmcReason,
    message: String,
}

impl From<crate::redfish::RedfishError> for BmcFailure {
    fn from(e: crate::redfish::RedfishError) -> Self {
        let mut message = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            message.push_str(": ");
            message.push_str(&s.to_string());
            src = s.source();
        }
        Self {
            reason: e.reason(),
            message,
        }
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
    let waiting = store.clone();
    let controller = controller
        .owns(scope.api::<MachineHardware>(), watcher::Config::default())
        .watches(
            scope.api::<Secret>(),
            watcher::Config::default(),
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
    if m.annotations().contains_key(annotations::PAUSED) {
        return Ok(Action::await_change());
    }
    let ns = m.namespace().ok_or(Error::NoNamespace)?;
    let api = Api::<Machine>::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, m, |event| async {
        match event {
            FinalizerEvent::Apply(m) => apply(&m, &ctx).await,
            FinalizerEvent::Cleanup(m) => cleanup(&m, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

struct Step<'a> {
    m: &'a Machine,
    ctx: &'a Context,
    api: Api<Machine>,
    ns: String,
    name: String,
    old: MachineStatus,
    st: MachineStatus,
    events: Vec<(EventType, &'static str, String)>,
    drop_annotations: Vec<&'static str>,
}

impl<'a> Step<'a> {
    fn new(m: &'a Machine, ctx: &'a Context) -> Result<Self, Error> {
        let ns = m.namespace().ok_or(Error::NoNamespace)?;
        let old = m.status.clone().unwrap_or_default();
        let mut st = old.clone();
        if st.state.is_none() {
            st.state = Some(MachineState::Enrolling);
        }
        if st.operational_status.is_none() {
            st.operational_status = Some(OperationalStatus::Ok);
        }
        Ok(Self {
            m,
            ctx,
            api: Api::namespaced(ctx.client.clone(), &ns),
            ns,
            name: m.name_any(),
            old,
            st,
            events: Vec::new(),
            drop_annotations: Vec::new(),
        })
    }

    fn generation(&self) -> Option<i64> {
        self.m.metadata.generation
    }

    fn state(&self) -> MachineState {
        self.st.state.unwrap_or(MachineState::Enrolling)
    }

    fn transition(&mut self, to: MachineState) {
        let from = self.state();
        if from != to {
            self.st.state = Some(to);
            self.st.error_count = None;
            self.st.restart_count = None;
            self.st.error_type = None;
            self.st.error_message = None;
            self.st.operational_status = Some(OperationalStatus::Ok);
            self.events.push((
                EventType::Normal,
                "StateChanged",
                format!("{from:?} → {to:?}"),
            ));
            tracing::info!(from = ?from, to = ?to, "machine state changed");
        }
    }

    fn cond(&mut self, type_: &str, status: bool, reason: &str, message: &str) {
        let generation = self.generation();
        set_condition(
            &mut self.st.conditions,
            type_,
            status,
            reason,
            message,
            generation,
        );
    }

    fn annotation(&self, key: &str) -> Option<&str> {
        self.m.annotations().get(key).map(String::as_str)
    }

    /// Writes the status difference (with the resourceVersion read as a
    /// precondition), drops consumed annotations, publishes Events.
    async fn commit(mut self) -> Result<(), Error> {
        self.st.observed_generation = self.generation();
        let old = serde_json::to_value(&self.old).unwrap_or_default();
        let new = serde_json::to_value(&self.st).unwrap_or_default();
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        if let Some(diff) = merge_diff(&old, &new) {
            let patch = json!({
                "metadata": {"resourceVersion": self.m.resource_version()},
                "status": diff,
            });
            self.api
                .patch_status(&self.name, &pp, &Patch::Merge(&patch))
                .await
                .map_err(Error::kube("writing machine status"))?;
        }
        if !self.drop_annotations.is_empty() {
            let mut anns = serde_json::Map::new();
            for a in &self.drop_annotations {
                anns.insert((*a).to_string(), serde_json::Value::Null);
            }
            let patch = json!({"metadata": {"annotations": anns}});
            self.api
                .patch(&self.name, &pp, &Patch::Merge(&patch))
                .await
                .map_err(Error::kube("removing consumed annotations"))?;
        }
        let reference = self.m.object_ref(&());
        for (type_, reason, note) in self.events {
            let ev = KubeEvent {
                type_,
                reason: reason.into(),
                note: Some(note),
                action: "Reconcile".into(),
                secondary: None,
            };
            if let Err(e) = self.ctx.recorder.publish(&ev, &reference).await {
                tracing::warn!(error = %e, "cannot publish event");
            }
        }
        Ok(())
    }

    fn attempts_key(&self) -> String {
        format!("{}/{}", self.ns, self.name)
    }

    /// Records a BMC failure; returns when to retry.
    fn bmc_failed(&mut self, f: &BmcFailure) -> Duration {
        let attempt = {
            let mut map = self
                .ctx
                .bmc_backoff
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let entry = map.entry(self.attempts_key()).or_insert(Backoff {
                attempts: 0,
                next_at: tokio::time::Instant::now(),
                fingerprint: String::new(),
            });
            entry.attempts = entry.attempts.saturating_add(1);
            entry.next_at = tokio::time::Instant::now() + f.reason.retry_after(entry.attempts);
            entry.fingerprint = fingerprint(self.m);
            entry.attempts
        };
        let reason = f.reason.as_str();
        let was = condition(&self.st.conditions, "BMCReachable")
            .map(|c| (c.status.clone(), c.reason.clone()));
        if was != Some(("False".into(), reason.into())) {
            self.events.push((
                EventType::Warning,
                "BMCUnavailable",
                format!("{reason}: {}", f.message),
            ));
            self.st.error_count = Some(self.st.error_count.unwrap_or(0).saturating_add(1));
        }
        self.cond("BMCReachable", false, reason, &f.message);
        self.st.operational_status = Some(OperationalStatus::Error);
        self.st.error_type = Some(ErrorType::Transient);
        self.st.error_message = Some(format!("bmc: {}", f.message));
        let retry = f.reason.retry_after(attempt);
        tracing::info!(reason, retry_s = retry.as_secs(), error = %f.message, "bmc unavailable");
        retry
    }

    fn bmc_ok(&mut self, powered_on: bool) {
        self.ctx
            .bmc_backoff
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.attempts_key());
        let was_down =
            condition(&self.st.conditions, "BMCReachable").is_some_and(|c| c.status == "False");
        if was_down {
            self.events.push((
                EventType::Normal,
                "BMCReachable",
                "the bmc answers again".into(),
            ));
        }
        self.cond("BMCReachable", true, "Connected", "the bmc answers");
        if self.st.error_type == Some(ErrorType::Transient) {
            self.st.error_type = None;
            self.st.error_message = None;
            self.st.error_count = None;
            self.st.operational_status = Some(OperationalStatus::Ok);
        }
        self.st.powered_on = Some(powered_on);
    }
}

/// Reads the BMC access of a machine into a client (None: no BMC).
async fn bmc_client(m: &Machine, ctx: &Context) -> Result<Option<RedfishClient>, BmcFailure> {
    let Some(bmc) = &m.spec.bmc else {
        return Ok(None);
    };
    let ns = m.namespace().unwrap_or_default();
    let address = BmcAddress::parse(&bmc.address)?;
    let insecure = bmc.insecure_skip_verify.unwrap_or(false);
    if insecure && bmc.ca_bundle_secret_ref.is_some() {
        return Err(BmcFailure {
            reason: BmcReason::TlsConfigConflict,
            message: "insecureSkipVerify and caBundleSecretRef are mutually exclusive".into(),
        });
    }
    let secret_key = |s: &Secret, key: &str| -> Option<Vec<u8>> {
        s.data
            .as_ref()
            .and_then(|d| d.get(key))
            .map(|b| b.0.clone())
            .or_else(|| {
                s.string_data
                    .as_ref()
                    .and_then(|d| d.get(key))
                    .map(|v| v.clone().into_bytes())
            })
    };
    let cref = &bmc.credentials_secret_ref;
    let secrets = Api::<Secret>::namespaced(ctx.client.clone(), cref.namespace_or(&ns));
    let missing = |what: String| BmcFailure {
        reason: BmcReason::CredentialsMissing,
        message: what,
    };
    let secret = match secrets.get_opt(&cref.name).await {
        Ok(Some(s)) => s,
        Ok(None) => return Err(missing(format!("secret {} not found", cref.name))),
        Err(e) => {
            return Err(BmcFailure {
                reason: BmcReason::QueryFailed,
                message: format!("cannot read secret {}: {e}", cref.name),
            });
        }
    };
    let username = secret_key(&secret, "username")
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| missing(format!("secret {} lacks username", cref.name)))?;
    let password = secret_key(&secret, "password")
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| missing(format!("secret {} lacks password", cref.name)))?;
    let tls = if insecure {
        TlsPolicy::InsecureSkipVerify
    } else if let Some(ca) = &bmc.ca_bundle_secret_ref {
        let api = Api::<Secret>::namespaced(ctx.client.clone(), ca.namespace_or(&ns));
        let pem = match api.get_opt(&ca.name).await {
            Ok(Some(s)) => secret_key(&s, "ca.crt"),
            _ => None,
        };
        TlsPolicy::CaBundle(pem.ok_or_else(|| BmcFailure {
            reason: BmcReason::TlsConfigConflict,
            message: format!("ca bundle secret {} lacks ca.crt", ca.name),
        })?)
    } else {
        TlsPolicy::SystemRoots
    };
    let creds = Credentials {
        username,
        password: Token::new(password),
    };
    Ok(Some(RedfishClient::new(
        &address,
        &creds,
        &tls,
        ctx.cfg.bmc_timeout,
    )?))
}

fn boot_token_secret_name(machine: &str) -> String {
    format!("{machine}-boot-token")
}

/// The lifetime of a boot token for this machine in milliseconds.
fn token_lifetime_ms(m: &Machine, cfg: &LifecycleConfig) -> i64 {
    let default = i64::try_from(cfg.boot_token_lifetime.as_millis()).unwrap_or(i64::MAX);
    m.spec
        .boot_timeout
        .as_deref()
        .and_then(parse_duration_ms)
        .map_or(default, |ms| ms.max(default))
}

async fn apply(m: &Machine, ctx: &Context) -> Result<Action, Error> {
    let mut s = Step::new(m, ctx)?;
    let now = Timestamp::now();

    // clear-error: counters reset, hold lifted, a fresh boot armed.
    if s.annotation(annotations::CLEAR_ERROR).is_some() {
        s.st.restart_count = None;
        s.st.error_count = None;
        s.st.error_type = None;
        s.st.error_message = None;
        s.st.operational_status = Some(OperationalStatus::Ok);
        s.st.net_boot = None;
        if condition(&s.st.conditions, "RetryHeld").is_some() {
            s.cond(
                "RetryHeld",
                false,
                "Cleared",
                "clear-error annotation applied",
            );
        }
        s.drop_annotations.push(annotations::CLEAR_ERROR);
        s.events.push((
            EventType::Normal,
            "ErrorCleared",
            "clear-error applied".into(),
        ));
    }

    // Held: no BMC call, no reservation change, until clear-error.
    if s.st.restart_count.unwrap_or(0) >= ctx.cfg.max_restarts {
        s.cond(
            "RetryHeld",
            true,
            "BootRetryExhausted",
            "three consecutive restart failures; set anneal.dev/clear-error to retry",
        );
        s.st.operational_status = Some(OperationalStatus::Error);
        s.commit().await?;
        return Ok(Action::await_change());
    }

    // Agent registration is observed whether or not the BMC answers.
    let registered =
        s.st.agent
            .as_ref()
            .and_then(|a| a.session_token_hash.as_deref())
            .is_some();
    if registered {
        s.cond(
            "AgentRegistered",
            true,
            "Registered",
            "the agent registered",
        );
    }

    // The agent's report needs no BMC: Inspecting → Available even while
    // the BMC fails.
    if s.state() == MachineState::Inspecting && inspection_reported(&s).await? {
        s.transition(MachineState::Available);
        s.st.net_boot = None;
        delete_boot_token(&s).await?;
        s.commit().await?;
        return Ok(Action::requeue(Duration::from_millis(100)));
    }

    let detached = s.annotation(annotations::DETACHED).is_some();
    if !detached {
        let wait = {
            let map = ctx.bmc_backoff.lock().unwrap_or_else(|p| p.into_inner());
            map.get(&s.attempts_key()).and_then(|b| {
                let now = tokio::time::Instant::now();
                (b.fingerprint == fingerprint(m) && b.next_at > now).then(|| b.next_at - now)
            })
        };
        if let Some(wait) = wait {
            // A failing BMC is tried at its cadence only.
            s.commit().await?;
            return Ok(Action::requeue(wait));
        }
    }
    let bmc = if detached {
        s.st.operational_status = Some(OperationalStatus::Detached);
        None
    } else {
        if s.st.operational_status == Some(OperationalStatus::Detached) {
            s.st.operational_status = Some(OperationalStatus::Ok);
        }
        match bmc_client(m, ctx).await {
            Ok(Some(c)) => match c.system().await {
                Ok(sys) => {
                    s.bmc_ok(sys.power_state.is_on());
                    Some((c, sys))
                }
                Err(e) => {
                    let retry = s.bmc_failed(&e.into());
                    s.commit().await?;
                    return Ok(Action::requeue(retry));
                }
            },
            Ok(None) => None,
            Err(f) => {
                let retry = s.bmc_failed(&f);
                s.commit().await?;
                return Ok(Action::requeue(retry));
            }
        }
    };
    let client = bmc.as_ref().map(|(c, _)| c);
    let http_boot =
        ctx.cfg.prefer_http_boot && bmc.as_ref().is_some_and(|(_, sys)| sys.offers_http_boot());
    let health = ctx.cfg.health_interval;

    // reboot annotation
    if let Some(v) = s.annotation(annotations::REBOOT).map(str::to_string) {
        s.drop_annotations.push(annotations::REBOOT);
        if let Some(c) = client {
            let soft = v.contains("soft");
            let kind = if soft {
                ResetType::GracefulRestart
            } else {
                ResetType::ForceRestart
            };
            if let Err(e) = c.reset(kind).await {
                let retry = s.bmc_failed(&e.into());
                s.drop_annotations.clear();
                s.commit().await?;
                return Ok(Action::requeue(retry));
            }
            s.events
                .push((EventType::Normal, "Rebooted", format!("{kind:?} sent")));
        }
    }

    // park / unpark
    let op = s.annotation(annotations::OPERATION).map(str::to_string);
    match (op.as_deref(), s.state()) {
        (Some("park"), MachineState::Available | MachineState::Provisioned) => {
            if let Some(c) = client
                && let Err(e) = c
                    .shutdown(ctx.cfg.graceful_shutdown_timeout, Duration::from_secs(1))
                    .await
            {
                let retry = s.bmc_failed(&e.into());
                s.commit().await?;
                return Ok(Action::requeue(retry));
            }
            s.st.powered_on = Some(false);
            s.transition(MachineState::Parked);
            s.drop_annotations.push(annotations::OPERATION);
            s.commit().await?;
            return Ok(Action::requeue(health));
        }
        (Some("unpark"), MachineState::Parked) => {
            let to = if m.spec.claim_ref.is_some() {
                MachineState::Provisioned
            } else {
                MachineState::Available
            };
            s.transition(to);
            s.drop_annotations.push(annotations::OPERATION);
            s.commit().await?;
            return Ok(Action::requeue(health));
        }
        (Some("unpark"), _) => s.drop_annotations.push(annotations::OPERATION),
        _ => {}
    }

    let action = match s.state() {
        MachineState::Enrolling => {
            if s.annotation(annotations::INSPECT_DISABLE).is_some()
                && m.spec.boot_mac_address.is_some()
            {
                s.transition(MachineState::Available);
                Action::requeue(Duration::from_millis(100))
            } else {
                s.transition(MachineState::Inspecting);
                arm(&mut s, client, http_boot, now).await?
            }
        }
        MachineState::Inspecting => inspecting(&mut s, client, http_boot, now).await?,
        MachineState::Available | MachineState::Released => {
            if s.annotation(annotations::RE_INSPECT).is_some() {
                s.drop_annotations.push(annotations::RE_INSPECT);
                s.transition(MachineState::Inspecting);
                arm(&mut s, client, http_boot, now).await?
            } else {
                if s.state() == MachineState::Available
                    && m.spec.claim_ref.is_none()
                    && s.st.powered_on == Some(true)
                    && let Some(c) = client
                {
                    match c
                        .shutdown(ctx.cfg.graceful_shutdown_timeout, Duration::from_secs(1))
                        .await
                    {
                        Ok(outcome) => {
                            s.st.powered_on = Some(false);
                            s.events.push((
                                EventType::Normal,
                                "PoweredOff",
                                format!("idle machine powered off ({outcome:?})"),
                            ));
                        }
                        Err(e) => {
                            let retry = s.bmc_failed(&e.into());
                            s.commit().await?;
                            return Ok(Action::requeue(retry));
                        }
                    }
                }
                Action::requeue(health)
            }
        }
        _ => Action::requeue(health),
    };
    s.commit().await?;
    Ok(action)
}

/// Inspecting: wait for registration + hardware until the boot token
/// expires; an expiry is a Restart failure.
async fn inspecting(
    s: &mut Step<'_>,
    client: Option<&RedfishClient>,
    http_boot: bool,
    now: Timestamp,
) -> Result<Action, Error> {
    let expires =
        s.st.net_boot
            .as_ref()
            .and_then(|n| n.expires_at.as_ref())
            .map(|t| t.0.as_millisecond());
    match expires {
        None => arm(s, client, http_boot, now).await,
        Some(exp) if exp > now.as_millisecond() => {
            let left =
                Duration::from_millis(u64::try_from(exp - now.as_millisecond()).unwrap_or(0));
            Ok(Action::requeue(
                (left + Duration::from_millis(200)).min(s.ctx.cfg.health_interval),
            ))
        }
        Some(_) => {
            let restarts = s.st.restart_count.unwrap_or(0).saturating_add(1);
            s.st.restart_count = Some(restarts);
            s.st.error_count = Some(s.st.error_count.unwrap_or(0).saturating_add(1));
            s.st.error_type = Some(ErrorType::Restart);
            s.st.operational_status = Some(OperationalStatus::Error);
            s.st.error_message =
                Some("the boot token expired before the agent registered and reported".into());
            s.st.net_boot = None;
            s.st.agent = None;
            tracing::warn!(restarts, "inspection deadline passed");
            if restarts >= s.ctx.cfg.max_restarts {
                s.cond(
                    "RetryHeld",
                    true,
                    "BootRetryExhausted",
                    "three consecutive restart failures; set anneal.dev/clear-error to retry",
                );
                s.events.push((
                    EventType::Warning,
                    "BootRetryExhausted",
                    format!("{restarts} consecutive boots without registration; holding"),
                ));
                delete_boot_token(s).await?;
                return Ok(Action::await_change());
            }
            s.events.push((
                EventType::Warning,
                "InspectionTimedOut",
                format!("restart {restarts}: the agent did not register in time"),
            ));
            arm(s, client, http_boot, now).await
        }
    }
}

/// Whether the agent of the current boot registered and reported its
/// hardware (the MachineHardware carries the session's hash).
async fn inspection_reported(s: &Step<'_>) -> Result<bool, Error> {
    let Some(session) =
        s.st.agent
            .as_ref()
            .and_then(|a| a.session_token_hash.clone())
    else {
        return Ok(false);
    };
    let hw = Api::<MachineHardware>::namespaced(s.ctx.client.clone(), &s.ns)
        .get_opt(&s.name)
        .await
        .map_err(Error::kube("reading machinehardware"))?;
    Ok(hw.is_some_and(|h| {
        h.annotations().get(crate::agentapi::SESSION_ANNOTATION) == Some(&session)
    }))
}

/// Mints a boot token (Secret + hash in status) and powers the machine on
/// with a one-time network-boot override.
async fn arm(
    s: &mut Step<'_>,
    client: Option<&RedfishClient>,
    http_boot: bool,
    now: Timestamp,
) -> Result<Action, Error> {
    // No power-on before the lease-mode reservation is live in bootd.
    if client.is_some()
        && let Some(recheck) = dhcp_hold(s, now).await?
    {
        return Ok(Action::requeue(recheck));
    }
    let token = mint_token();
    let hash = status::token_hash(token.expose());
    let lifetime = token_lifetime_ms(s.m, &s.ctx.cfg);
    let expires = time_in(now, lifetime);
    let secret_name = boot_token_secret_name(&s.name);
    let mut data = std::collections::BTreeMap::new();
    data.insert(
        BOOT_TOKEN_KEY.to_string(),
        ByteString(token.expose().as_bytes().to_vec()),
    );
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(secret_name.clone()),
            namespace: Some(s.ns.clone()),
            owner_references: s.m.controller_owner_ref(&()).map(|o| vec![o]),
            labels: Some(
                [(BOOT_TOKEN_LABEL.to_string(), s.name.clone())]
                    .into_iter()
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Secret::default()
    };
    Api::<Secret>::namespaced(s.ctx.client.clone(), &s.ns)
        .patch(
            &secret_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&secret),
        )
        .await
        .map_err(Error::kube("writing the boot token secret"))?;
    drop(secret);
    drop(token);
    if let Some(c) = client {
        let target = if http_boot {
            BootTarget::UefiHttp
        } else {
            BootTarget::Pxe
        };
        let powered = s.st.powered_on.unwrap_or(false);
        let res = async {
            c.set_boot_once(target).await?;
            c.reset(if powered {
                ResetType::ForceRestart
            } else {
                ResetType::On
            })
            .await
        }
        .await;
        if let Err(e) = res {
            // No token in status: the next pass mints a new one.
            let retry = s.bmc_failed(&e.into());
            return Ok(Action::requeue(retry));
        }
        s.st.powered_on = Some(true);
        s.events.push((
            EventType::Normal,
            "NetBootArmed",
            format!("powered on with a one-time {} override", target.as_str()),
        ));
    }
    s.st.net_boot = Some(NetBootStatus {
        token_hash: Some(hash),
        expires_at: Some(expires),
    });
    s.st.agent = None;
    s.cond(
        "AgentRegistered",
        false,
        "WaitingForAgent",
        "waiting for the agent to register",
    );
    let wait = Duration::from_millis(u64::try_from(lifetime).unwrap_or(0) + 200);
    Ok(Action::requeue(wait.min(s.ctx.cfg.health_interval)))
}

/// How often a Machine held for its DHCP reservation looks again (Subnet
/// changes wake it at once).
const DHCP_RECHECK: Duration = Duration::from_secs(5);

/// The DHCP power gate of lease-mode Subnets ([`dhcp_gate`]): Some(recheck)
/// while the Machine's reservation is not live in bootd. Writes the
/// condition, and a Warning Event every `dhcp_reservation_timeout` of
/// waiting.
async fn dhcp_hold(s: &mut Step<'_>, now: Timestamp) -> Result<Option<Duration>, Error> {
    let (sns, sname) = dhcp_gate::subnet_of(s.m);
    let subnet = Api::<Subnet>::namespaced(s.ctx.client.clone(), &sns)
        .get_opt(&sname)
        .await
        .map_err(Error::kube("reading the machine's subnet"))?;
    let key = s.attempts_key();
    // lastTransitionTime keeps whole seconds: the wait began at the latest
    // at the end of that second, so the bound is never cut short.
    let waiting_since = condition(&s.st.conditions, dhcp_gate::CONDITION)
        .filter(|c| c.status == "False")
        .map(|c| {
            let t = c.last_transition_time.0.as_millisecond();
            if t % 1000 == 0 { t + 999 } else { t }
        });
    match dhcp_gate::evaluate(s.m, subnet.as_ref()) {
        dhcp_gate::Gate::NotApplicable => {
            s.st.conditions.retain(|c| c.type_ != dhcp_gate::CONDITION);
            Ok(None)
        }
        dhcp_gate::Gate::Ready {
            subnet,
            address,
            revision,
        } => {
            s.ctx
                .dhcp_warned
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&key);
            let message = format!("{address} is live on Subnet {subnet} (revision {revision})");
            if waiting_since.is_some() {
                let held_since = condition(&s.st.conditions, dhcp_gate::CONDITION)
                    .map(|c| c.last_transition_time.0.to_string())
                    .unwrap_or_default();
                tracing::info!(%subnet, %address, %held_since, "dhcp reservation live; powering on");
                s.events
                    .push((EventType::Normal, dhcp_gate::LIVE, message.clone()));
            }
            s.cond(dhcp_gate::CONDITION, true, dhcp_gate::LIVE, &message);
            Ok(None)
        }
        dhcp_gate::Gate::Waiting { subnet, missing } => {
            let since = waiting_since.unwrap_or(now.as_millisecond());
            let elapsed = now.as_millisecond().saturating_sub(since).max(0);
            let timeout =
                i64::try_from(s.ctx.cfg.dhcp_reservation_timeout.as_millis()).unwrap_or(i64::MAX);
            let overdue = timeout > 0 && elapsed >= timeout;
            let message = dhcp_gate::waiting_message(&subnet, &missing, overdue);
            if waiting_since.is_none() {
                tracing::info!(%subnet, %message, "power-on held for the dhcp reservation");
            }
            s.cond(dhcp_gate::CONDITION, false, dhcp_gate::WAITING, &message);
            let mut recheck = DHCP_RECHECK;
            if overdue {
                let periods = elapsed / timeout;
                let mut warned = s.ctx.dhcp_warned.lock().unwrap_or_else(|p| p.into_inner());
                let before = warned
                    .get(&key)
                    .filter(|(start, _)| *start == since)
                    .map_or(0, |(_, p)| *p);
                if periods > before {
                    warned.insert(key, (since, periods));
                    let note = format!(
                        "no power-on after {}s: the DHCP reservation on Subnet {subnet} is not \
                         live ({}); {}; still waiting",
                        elapsed / 1000,
                        match &missing {
                            dhcp_gate::Missing::NoBootMac => "no boot MAC",
                            dhcp_gate::Missing::Reservation { .. } => "no reservation",
                            dhcp_gate::Missing::Applied { .. } => "not applied by bootd",
                        },
                        dhcp_gate::hint(&subnet, &missing),
                    );
                    tracing::warn!(%subnet, elapsed_ms = elapsed, "dhcp reservation overdue");
                    s.events
                        .push((EventType::Warning, dhcp_gate::OVERDUE_EVENT, note));
                }
            } else {
                // wake up for the bound, not later
                let left = u64::try_from(timeout - elapsed).unwrap_or(0);
                recheck = recheck.min(Duration::from_millis(left + 50));
            }
            Ok(Some(recheck))
        }
    }
}

async fn delete_boot_token(s: &Step<'_>) -> Result<(), Error> {
    match Api::<Secret>::namespaced(s.ctx.client.clone(), &s.ns)
        .delete(&boot_token_secret_name(&s.name), &Default::default())
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(source) => Err(Error::Kube {
            what: "deleting the boot token secret",
            source,
        }),
    }
}

/// Deletion: power off and clear the override (unless force-release), then
/// let the finalizer go.
async fn cleanup(m: &Machine, ctx: &Context) -> Result<Action, Error> {
    let mut s = Step::new(m, ctx)?;
    ctx.dhcp_warned
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&s.attempts_key());
    if s.annotation(annotations::FORCE_RELEASE).is_some()
        || s.annotation(annotations::DETACHED).is_some()
        || m.spec.bmc.is_none()
    {
        delete_boot_token(&s).await?;
        return Ok(Action::await_change());
    }
    let to = if m.spec.claim_ref.is_some() {
        MachineState::Deprovisioning
    } else {
        MachineState::PoweringOff
    };
    s.transition(to);
    let client = match bmc_client(m, ctx).await {
        Ok(Some(c)) => c,
        Ok(None) => return Ok(Action::await_change()),
        Err(f) => {
            let retry = s.bmc_failed(&f);
            s.commit().await?;
            return Err(Error::CleanupPending(format!(
                "bmc unavailable, retrying in {}s",
                retry.as_secs()
            )));
        }
    };
    let res = async {
        let _ = client.clear_boot_override().await;
        client
            .shutdown(ctx.cfg.graceful_shutdown_timeout, Duration::from_secs(1))
            .await
    }
    .await;
    if let Err(e) = res {
        let f: BmcFailure = e.into();
        s.bmc_failed(&f);
        s.commit().await?;
        return Err(Error::CleanupPending(f.message));
    }
    delete_boot_token(&s).await?;
    Ok(Action::await_change())
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
            ..LifecycleConfig::default()
        };
        let api = crate::agentapi::AgentApiConfig {
            listen: self.agent_api_listen,
            namespace: self.manager_namespace.clone(),
            server_names: self.agent_api_names.clone(),
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
