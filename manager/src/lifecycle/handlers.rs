//! The Machine lifecycle as pure state handlers (docs/lifecycle.md, "Code
//! structure"): a [`Snapshot`] of everything a decision needs goes in, a
//! [`Decision`] comes out: the [`Outcome`], the status to commit, the
//! Events, the annotations to drop, the boot-token operation and the BMC
//! actions to take, each with the status to commit should it fail. No API
//! client, no BMC client, no clock: `now` comes from the snapshot, so every
//! transition and hold is unit-tested below; no logging either (a dry run
//! decides whether the Subnet is read): the driver gathers the snapshot,
//! carries out the decision and logs it.

use anneal_api::conditions::{reasons, types};
use std::time::Duration;

use anneal_api::{
    ErrorType, Machine, MachineState, MachineStatus, NetBootStatus, OperationalStatus, Subnet,
};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::events::EventType;

use super::status::{condition, parse_duration_ms, time_in};
use super::{LifecycleConfig, annotations, dhcp_gate};
use crate::redfish::{BmcReason, BootTarget, ResetType};

/// How often a Machine held for its DHCP reservation looks again (Subnet
/// changes wake it at once).
pub const DHCP_RECHECK: Duration = Duration::from_secs(5);
/// The requeue after a transition that the next pass continues at once.
pub const SOON: Duration = Duration::from_millis(100);
/// The poll of a graceful shutdown.
pub const SHUTDOWN_POLL: Duration = Duration::from_secs(1);

/// A BMC that cannot be used, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BmcFailure {
    /// The `BMCReachable=False` reason (and the retry cadence).
    pub reason: BmcReason,
    /// What failed, with its causes.
    pub message: String,
}

impl From<crate::redfish::RedfishError> for BmcFailure {
    fn from(e: crate::redfish::RedfishError) -> Self {
        Self {
            reason: e.reason(),
            message: anneal_api::error_chain(&e),
        }
    }
}

impl From<crate::bmc::BmcError> for BmcFailure {
    fn from(e: crate::bmc::BmcError) -> Self {
        Self {
            reason: e.reason(),
            message: anneal_api::error_chain(&e),
        }
    }
}

/// What the driver learnt from the BMC before deciding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bmc {
    /// Not asked: no `spec.bmc`, detached, held, in backoff, or the decision
    /// needs no BMC ([`wants_bmc`]).
    None,
    /// Credentials resolved into a client (delete path: no system query).
    Resolved,
    /// The ComputerSystem answered.
    Answer {
        /// PowerState counts as on.
        powered_on: bool,
        /// The BMC offers UEFI HTTP boot.
        offers_http_boot: bool,
    },
    /// The access or the query failed.
    Failed(BmcFailure),
}

impl Bmc {
    fn usable(&self) -> bool {
        matches!(self, Self::Answer { .. } | Self::Resolved)
    }
}

/// Everything one decision reads.
#[derive(Debug, Clone)]
pub struct Snapshot<'a> {
    /// The Machine as read.
    pub machine: &'a Machine,
    /// The clock.
    pub now: Timestamp,
    /// The controller's tunables.
    pub cfg: &'a LifecycleConfig,
    /// The BMC answer or failure.
    pub bmc: Bmc,
    /// Consecutive failed BMC attempts so far (the in-memory backoff map).
    pub bmc_attempts: u32,
    /// Time left before a failing BMC may be tried again (None: try now,
    /// also after an edit of the Machine or its Secrets).
    pub bmc_backoff: Option<Duration>,
    /// The session annotation of the Machine's MachineHardware (the report
    /// of the agent of some boot), when read.
    pub hardware_session: Option<String>,
    /// The Machine's Subnet for the DHCP gate (read when [`wants_subnet`]).
    pub subnet: Option<Subnet>,
    /// The overdue-warning memory of the DHCP gate: start of the wait (ms)
    /// and the periods warned about.
    pub dhcp_warned: Option<(i64, i64)>,
    /// What the deploy planner found for a claimed Machine (read when
    /// [`wants_deploy`]).
    pub deploy: DeployView,
}

/// The deploy side of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeployView {
    /// Not read (no claim, or a state with nothing to deploy).
    #[default]
    NotRead,
    /// The claim's intent equals the last successful run's snapshot (or
    /// the adoption's, `status.adopted`).
    UpToDate,
    /// An externally provisioned Machine in Enrolling whose claim binding
    /// holds both ways: adopt it for that claim.
    Adoptable {
        /// The claim's name.
        claim: String,
        /// Its `metadata.generation`.
        generation: i64,
    },
    /// No run can be planned; the message names the cause and the fix.
    PlanFailed(String),
    /// A Pending DeployRun for the claim's new intent exists (the driver
    /// wrote it and its plan): start it.
    Ready {
        /// Its name.
        run: String,
        /// Its image (OS image, else the first data image).
        image: Option<String>,
    },
    /// The run in `status.currentRunRef`, as read.
    Current {
        /// Its name.
        run: String,
        /// Its phase (None: not found or no status yet).
        phase: Option<anneal_api::RunPhase>,
        /// The Succeeded condition's message.
        message: String,
        /// The run's image (OS image, else the first data image).
        image: Option<String>,
        /// Whole percent written.
        percent: Option<i32>,
    },
}

/// Fast-track: whether `m`'s agent, registered at `status.agent.lastSeen`
/// with a live session, is still inside the fast-track `window`.
pub fn fast_track_live(m: &Machine, window: Option<Duration>, now: Timestamp) -> bool {
    let Some(window) = window else {
        return false;
    };
    let Some(agent) = m.status.as_ref().and_then(|s| s.agent.as_ref()) else {
        return false;
    };
    let now = now.as_millisecond();
    let session = agent
        .expires_at
        .as_ref()
        .is_some_and(|t| t.0.as_millisecond() > now);
    let window_ms = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
    let inside = agent
        .last_seen
        .as_ref()
        .is_some_and(|t| t.0.as_millisecond().saturating_add(window_ms) > now);
    session && inside
}

/// When the fast-track window of `m` ends (ms), if it is live.
fn fast_track_end(m: &Machine, window: Option<Duration>, now: Timestamp) -> Option<i64> {
    if !fast_track_live(m, window, now) {
        return None;
    }
    let w = i64::try_from(window?.as_millis()).unwrap_or(i64::MAX);
    Some(
        m.status
            .as_ref()?
            .agent
            .as_ref()?
            .last_seen
            .as_ref()?
            .0
            .as_millisecond()
            .saturating_add(w),
    )
}

/// Whether the driver should plan or read runs: a claimed Machine that is
/// Available or Provisioned, or any Machine that is Provisioning.
pub fn wants_deploy(m: &Machine) -> bool {
    match state_of(m) {
        MachineState::Available | MachineState::Provisioned => m.spec.claim_ref.is_some(),
        // an externally provisioned one, to be adopted for its claim
        MachineState::Enrolling => m.spec.externally_provisioned && m.spec.claim_ref.is_some(),
        MachineState::Provisioning => true,
        _ => false,
    }
}

/// One Event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Normal or Warning.
    pub type_: EventType,
    /// The reason.
    pub reason: &'static str,
    /// The note.
    pub note: String,
}

/// A status in the making, with its Events and the annotations it consumes.
#[derive(Debug, Clone, PartialEq)]
pub struct Draft {
    /// The status to write.
    pub status: MachineStatus,
    /// Events to publish after the write.
    pub events: Vec<Event>,
    /// Annotations to remove after the write.
    pub drop_annotations: Vec<&'static str>,
    /// Delete the Machine's MachineHardware after the write (a re-inspect:
    /// nothing plans on the old inventory meanwhile).
    pub delete_hardware: bool,
}

/// A BMC call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BmcAction {
    /// `ComputerSystem.Reset`.
    Reset(ResetType),
    /// One-time boot override (UEFI mode), then the reset.
    BootOnce {
        /// Pxe or UefiHttp.
        target: BootTarget,
        /// On, or ForceRestart when already on.
        reset: ResetType,
    },
    /// GracefulShutdown, ForceOff after the graceful-shutdown timeout;
    /// `announce`: an Event `PoweredOff` names how it ended.
    Shutdown {
        /// Publish `PoweredOff`.
        announce: bool,
    },
    /// Clear the boot override; a failure is ignored.
    ClearOverride,
}

/// A BMC call and the status to commit instead of the decision's when it
/// fails (the status as it was before the call, plus the failure).
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// The call.
    pub action: BmcAction,
    /// The draft before the call.
    pub fallback: Draft,
}

/// What happens to Secret `<machine>-boot-token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenOp {
    /// Nothing.
    Keep,
    /// Mint a token right before the power-on (`BootOnce`; without a BMC
    /// before the write), write the Secret, and put its hash
    /// into `status.netBoot.tokenHash` (left None in the draft).
    Mint,
    /// Delete the Secret once the BMC calls succeeded.
    Delete,
}

/// What happens to the in-memory BMC backoff of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackoffOp {
    /// Unchanged.
    Keep,
    /// The BMC answered: forget the failures.
    Clear,
    /// One more failure: the `attempt`th in a row (1-based), tried again
    /// after `reason.retry_after(attempt)`.
    Failed {
        /// The reason (the cadence).
        reason: BmcReason,
        /// Consecutive failures including this one.
        attempt: u32,
    },
}

/// What happens to the DHCP overdue-warning memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarnOp {
    /// Unchanged.
    Keep,
    /// Forget it.
    Clear,
    /// Warned about `periods` periods of a wait that began at `since` (ms).
    Set {
        /// Start of the wait (ms).
        since: i64,
        /// Periods warned about.
        periods: i64,
    },
}

/// How the pass ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Stay; look again after `requeue` (None: on the next change).
    Wait {
        /// Why, for logs and tests.
        reason: &'static str,
        /// When to look again.
        requeue: Option<Duration>,
    },
    /// The state changed (the `StateChanged` Event is in the draft).
    Transition {
        /// The new state.
        next: MachineState,
        /// Why.
        event: &'static str,
        /// When to look again.
        requeue: Option<Duration>,
    },
    /// No BMC call until an operator acts (`RetryHeld=True`).
    Held {
        /// Why.
        reason: &'static str,
    },
    /// Delete: the finalizer may go.
    Release,
    /// Delete: the BMC cleanup has to be retried; the finalizer stays.
    CleanupPending {
        /// Why.
        message: String,
    },
}

impl Outcome {
    /// When the controller looks again (None: on the next change).
    pub fn requeue(&self) -> Option<Duration> {
        match self {
            Self::Wait { requeue, .. } | Self::Transition { requeue, .. } => *requeue,
            Self::Held { .. } | Self::Release | Self::CleanupPending { .. } => None,
        }
    }
}

/// The result of a handler.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// How the pass ends if every BMC call succeeds.
    pub outcome: Outcome,
    /// Whether the status is written at all.
    pub commit: bool,
    /// The status, Events and consumed annotations.
    pub draft: Draft,
    /// BMC calls, in order; the first that fails ends the pass.
    pub actions: Vec<Planned>,
    /// The boot-token Secret.
    pub token: TokenOp,
    /// The in-memory BMC backoff.
    pub backoff: BackoffOp,
    /// The DHCP overdue-warning memory.
    pub dhcp_warned: WarnOp,
}

/// The paused annotation: the controller neither writes nor calls anything.
pub fn paused(m: &Machine) -> bool {
    m.annotations().contains_key(annotations::PAUSED)
}

fn annotation<'m>(m: &'m Machine, key: &str) -> Option<&'m str> {
    m.annotations().get(key).map(String::as_str)
}

/// The state the status says (Enrolling before the first write).
pub fn state_of(m: &Machine) -> MachineState {
    m.status
        .as_ref()
        .and_then(|s| s.state)
        .unwrap_or(MachineState::Enrolling)
}

/// The session hash of the current boot's agent.
pub fn session_of(m: &Machine) -> Option<&str> {
    m.status
        .as_ref()
        .and_then(|s| s.agent.as_ref())
        .and_then(|a| a.session_token_hash.as_deref())
}

/// Whether the driver should read the MachineHardware for
/// [`Snapshot::hardware_session`]: only while Inspecting with a session.
pub fn wants_hardware(m: &Machine) -> bool {
    state_of(m) == MachineState::Inspecting && session_of(m).is_some()
}

fn held(m: &Machine, cfg: &LifecycleConfig) -> bool {
    annotation(m, annotations::CLEAR_ERROR).is_none()
        && m.status.as_ref().and_then(|s| s.restart_count).unwrap_or(0) >= cfg.max_restarts
}

fn reported(snap: &Snapshot<'_>) -> bool {
    state_of(snap.machine) == MachineState::Inspecting
        && session_of(snap.machine).is_some_and(|s| snap.hardware_session.as_deref() == Some(s))
}

/// Whether the driver should query the BMC before [`apply`]: not while
/// held, not once the inspection is reported, not detached, not during a
/// backoff, not without `spec.bmc`.
pub fn wants_bmc(snap: &Snapshot<'_>) -> bool {
    let m = snap.machine;
    m.spec.bmc.is_some()
        && !paused(m)
        && !held(m, snap.cfg)
        && !reported(snap)
        && annotation(m, annotations::DETACHED).is_none()
        && snap.bmc_backoff.is_none()
}

/// Whether the driver should read the Machine's Subnet for the DHCP gate:
/// only when the BMC answered and the pass would arm a boot (the gate can
/// only hold a power-on, so a pass that arms nothing without the Subnet
/// arms nothing with it).
pub fn wants_subnet(snap: &Snapshot<'_>) -> bool {
    matches!(snap.bmc, Bmc::Answer { .. }) && apply(snap).token == TokenOp::Mint
}

/// The RetryHeld message, built from the configured bound.
pub fn retry_held_message(max_restarts: i32) -> String {
    format!("{max_restarts} consecutive restart failures; set anneal.dev/clear-error to retry")
}

/// The lifetime of a boot token for this machine in milliseconds: the
/// operator default, raised by `spec.bootTimeout`.
pub fn token_lifetime_ms(m: &Machine, cfg: &LifecycleConfig) -> i64 {
    let default = i64::try_from(cfg.boot_token_lifetime.as_millis()).unwrap_or(i64::MAX);
    m.spec
        .boot_timeout
        .as_deref()
        .and_then(parse_duration_ms)
        .map_or(default, |ms| ms.max(default))
}

/// One pass in the making.
struct Pass<'s, 'a> {
    snap: &'s Snapshot<'a>,
    d: Draft,
    actions: Vec<Planned>,
    token: TokenOp,
    backoff: BackoffOp,
    warn: WarnOp,
}

impl<'s, 'a> Pass<'s, 'a> {
    fn new(snap: &'s Snapshot<'a>) -> Self {
        let mut st = snap.machine.status.clone().unwrap_or_default();
        if st.state.is_none() {
            st.state = Some(MachineState::Enrolling);
        }
        if st.operational_status.is_none() {
            st.operational_status = Some(OperationalStatus::Ok);
        }
        Self {
            snap,
            d: Draft {
                status: st,
                events: Vec::new(),
                drop_annotations: Vec::new(),
                delete_hardware: false,
            },
            actions: Vec::new(),
            token: TokenOp::Keep,
            backoff: BackoffOp::Keep,
            warn: WarnOp::Keep,
        }
    }

    fn m(&self) -> &'a Machine {
        self.snap.machine
    }

    fn cfg(&self) -> &'a LifecycleConfig {
        self.snap.cfg
    }

    fn state(&self) -> MachineState {
        self.d.status.state.unwrap_or(MachineState::Enrolling)
    }

    fn annotation(&self, key: &str) -> Option<&'a str> {
        annotation(self.snap.machine, key)
    }

    fn event(&mut self, type_: EventType, reason: &'static str, note: String) {
        self.d.events.push(Event {
            type_,
            reason,
            note,
        });
    }

    fn cond(&mut self, type_: &str, status: bool, reason: &str, message: &str) {
        crate::conditions::set_at(
            &mut self.d.status.conditions,
            type_,
            status,
            reason,
            message,
            self.snap.machine.metadata.generation,
            self.snap.now,
        );
    }

    fn transition(&mut self, to: MachineState) {
        let from = self.state();
        if from != to {
            let st = &mut self.d.status;
            st.state = Some(to);
            st.error_count = None;
            st.restart_count = None;
            st.error_type = None;
            st.error_message = None;
            // A detached machine stays detached on the operational axis.
            st.operational_status = Some(
                if annotation(self.snap.machine, annotations::DETACHED).is_some() {
                    OperationalStatus::Detached
                } else {
                    OperationalStatus::Ok
                },
            );
            self.event(
                EventType::Normal,
                "StateChanged",
                format!("{from:?} → {to:?}"),
            );
        }
    }

    /// Plans a BMC call; `fallback` is the draft as it is now.
    fn call(&mut self, action: BmcAction) {
        self.actions.push(Planned {
            action,
            fallback: self.d.clone(),
        });
    }

    fn bmc_ok(&mut self, powered_on: bool) {
        self.backoff = BackoffOp::Clear;
        let was_down = condition(&self.d.status.conditions, types::BMC_REACHABLE)
            .is_some_and(|c| c.status == "False");
        if was_down {
            self.event(
                EventType::Normal,
                types::BMC_REACHABLE,
                "the bmc answers again".into(),
            );
        }
        self.cond(
            types::BMC_REACHABLE,
            true,
            reasons::CONNECTED,
            "the bmc answers",
        );
        let st = &mut self.d.status;
        if st.error_type == Some(ErrorType::Transient) {
            st.error_type = None;
            st.error_message = None;
            st.error_count = None;
            st.operational_status = Some(OperationalStatus::Ok);
        }
        st.powered_on = Some(powered_on);
    }

    fn finish(self, outcome: Outcome, commit: bool) -> Decision {
        Decision {
            outcome,
            commit,
            draft: self.d,
            actions: self.actions,
            token: self.token,
            backoff: self.backoff,
            dhcp_warned: self.warn,
        }
    }
}

/// Records a BMC failure in `d`: `BMCReachable=False` with its reason, the
/// error fields, an Event and the error count when the reason is new.
/// Returns when to try again (`attempts`: failures before this one).
pub fn bmc_failed(d: &mut Draft, f: &BmcFailure, attempts: u32, snap: &Snapshot<'_>) -> Duration {
    let attempt = attempts.saturating_add(1);
    let reason = f.reason.as_str();
    let was = condition(&d.status.conditions, types::BMC_REACHABLE)
        .map(|c| (c.status.clone(), c.reason.clone()));
    if was != Some(("False".into(), reason.into())) {
        d.events.push(Event {
            type_: EventType::Warning,
            reason: "BMCUnavailable",
            note: format!("{reason}: {}", f.message),
        });
        d.status.error_count = Some(d.status.error_count.unwrap_or(0).saturating_add(1));
    }
    crate::conditions::set_at(
        &mut d.status.conditions,
        types::BMC_REACHABLE,
        false,
        reason,
        &f.message,
        snap.machine.metadata.generation,
        snap.now,
    );
    d.status.operational_status = Some(OperationalStatus::Error);
    d.status.error_type = Some(ErrorType::Transient);
    d.status.error_message = Some(format!("bmc: {}", f.message));
    f.reason.retry_after(attempt)
}

/// The decision after BMC call `failed` of `decision` failed: its fallback
/// draft plus the failure, retried at the reason's cadence (delete: the
/// cleanup stays pending).
pub fn action_failed(
    decision: &Decision,
    failed: usize,
    f: &BmcFailure,
    snap: &Snapshot<'_>,
) -> Decision {
    let mut d = decision
        .actions
        .get(failed)
        .map_or_else(|| decision.draft.clone(), |p| p.fallback.clone());
    // The answer that came before cleared the earlier failures.
    let before = if decision.backoff == BackoffOp::Clear {
        0
    } else {
        snap.bmc_attempts
    };
    let retry = bmc_failed(&mut d, f, before, snap);
    let outcome = match decision.outcome {
        Outcome::Release | Outcome::CleanupPending { .. } => Outcome::CleanupPending {
            message: f.message.clone(),
        },
        _ => Outcome::Wait {
            reason: "BMC call failed",
            requeue: Some(retry),
        },
    };
    Decision {
        outcome,
        commit: true,
        draft: d,
        actions: Vec::new(),
        token: TokenOp::Keep,
        backoff: BackoffOp::Failed {
            reason: f.reason,
            attempt: before.saturating_add(1),
        },
        dhcp_warned: decision.dhcp_warned,
    }
}

/// The handler of a live (not deleted) Machine: the cross-cutting ones
/// (paused, clear-error, RetryHeld, the agent's report, the BMC cadence,
/// detached, reboot, park/unpark), then the one of its state.
pub fn apply(snap: &Snapshot<'_>) -> Decision {
    let mut p = Pass::new(snap);
    if paused(snap.machine) {
        return p.finish(
            Outcome::Wait {
                reason: "paused",
                requeue: None,
            },
            false,
        );
    }
    clear_error(&mut p);
    if retry_held(&mut p) {
        return p.finish(
            Outcome::Held {
                reason: reasons::BOOT_RETRY_EXHAUSTED,
            },
            true,
        );
    }
    if session_of(snap.machine).is_some() {
        p.cond(
            types::AGENT_REGISTERED,
            true,
            reasons::REGISTERED,
            "the agent registered",
        );
    }
    // The agent's report needs no BMC: Inspecting → Available even while
    // the BMC fails.
    if reported(snap) {
        p.transition(MachineState::Available);
        p.d.status.net_boot = None;
        p.token = TokenOp::Delete;
        // The inspection's session ends with the inspection (docs/api.md,
        // "Agent protocol"): its hash is cleared so it cannot act any more.
        // Only fast-track keeps it (docs/api.md: the idle agent gets its
        // deploy plan from `next` inside the window, then `poweroff`).
        if snap.cfg.fast_track_window.is_none()
            && let Some(agent) = p.d.status.agent.as_mut()
        {
            agent.session_token_hash = None;
            agent.expires_at = None;
        }
        return p.finish(
            Outcome::Transition {
                next: MachineState::Available,
                event: "InspectionReported",
                requeue: Some(SOON),
            },
            true,
        );
    }
    // A deploy's success needs no BMC either: Provisioning → Provisioned
    // even while the BMC fails or backs off (the agent reboots the machine
    // itself).
    if p.state() == MachineState::Provisioning
        && matches!(
            snap.deploy,
            DeployView::Current {
                phase: Some(anneal_api::RunPhase::Succeeded),
                ..
            }
        )
    {
        let outcome = provisioning(&mut p, false, false);
        return p.finish(outcome, true);
    }
    let detached = p.annotation(annotations::DETACHED).is_some();
    if !detached && let Some(wait) = snap.bmc_backoff {
        // A failing BMC is tried at its cadence only.
        return p.finish(
            Outcome::Wait {
                reason: "BMC backoff",
                requeue: Some(wait),
            },
            true,
        );
    }
    let mut http_boot = false;
    let client = if detached {
        p.d.status.operational_status = Some(OperationalStatus::Detached);
        false
    } else {
        if p.d.status.operational_status == Some(OperationalStatus::Detached) {
            p.d.status.operational_status = Some(OperationalStatus::Ok);
        }
        match &snap.bmc {
            Bmc::Answer {
                powered_on,
                offers_http_boot,
            } => {
                p.bmc_ok(*powered_on);
                http_boot = snap.cfg.prefer_http_boot && *offers_http_boot;
                true
            }
            Bmc::Resolved => true,
            Bmc::Failed(f) => {
                let retry = bmc_failed(&mut p.d, f, snap.bmc_attempts, snap);
                p.backoff = BackoffOp::Failed {
                    reason: f.reason,
                    attempt: snap.bmc_attempts.saturating_add(1),
                };
                return p.finish(
                    Outcome::Wait {
                        reason: "BMC unavailable",
                        requeue: Some(retry),
                    },
                    true,
                );
            }
            Bmc::None => false,
        }
    };
    reboot(&mut p, client);
    if let Some(outcome) = park(&mut p, client, http_boot) {
        return p.finish(outcome, true);
    }
    let outcome = match p.state() {
        MachineState::Enrolling => enrolling(&mut p, client, http_boot),
        MachineState::Inspecting => inspecting(&mut p, client, http_boot),
        MachineState::Available | MachineState::Released => available(&mut p, client, http_boot),
        MachineState::Provisioning => provisioning(&mut p, client, http_boot),
        MachineState::Provisioned => provisioned(&mut p, client, http_boot),
        MachineState::Deprovisioning => deprovisioning(&mut p, client, http_boot),
        // Parked: only `unpark` (above) moves it.
        MachineState::Parked => Outcome::Wait {
            reason: "parked",
            requeue: Some(snap.cfg.health_interval),
        },
        _ => Outcome::Wait {
            reason: "nothing to do in this state",
            requeue: Some(snap.cfg.health_interval),
        },
    };
    p.finish(outcome, true)
}

/// `anneal.dev/clear-error`: counters reset, hold lifted, a fresh boot
/// armed (the state handler arms it: `netBoot` is dropped).
fn clear_error(p: &mut Pass<'_, '_>) {
    if p.annotation(annotations::CLEAR_ERROR).is_none() {
        return;
    }
    let st = &mut p.d.status;
    st.restart_count = None;
    st.error_count = None;
    st.error_type = None;
    st.error_message = None;
    st.operational_status = Some(OperationalStatus::Ok);
    st.net_boot = None;
    if condition(&p.d.status.conditions, types::RETRY_HELD).is_some() {
        p.cond(
            types::RETRY_HELD,
            false,
            reasons::CLEARED,
            "clear-error annotation applied",
        );
    }
    p.d.drop_annotations.push(annotations::CLEAR_ERROR);
    p.event(
        EventType::Normal,
        "ErrorCleared",
        "clear-error applied".into(),
    );
}

/// Held after `max_restarts` Restart failures: no BMC call, until
/// clear-error.
fn retry_held(p: &mut Pass<'_, '_>) -> bool {
    if p.d.status.restart_count.unwrap_or(0) < p.cfg().max_restarts {
        return false;
    }
    let message = retry_held_message(p.cfg().max_restarts);
    p.cond(
        types::RETRY_HELD,
        true,
        reasons::BOOT_RETRY_EXHAUSTED,
        &message,
    );
    p.d.status.operational_status = Some(OperationalStatus::Error);
    true
}

/// `anneal.dev/reboot` (`{"mode":"soft"}` GracefulRestart, else
/// ForceRestart); consumed. If the reset fails no annotation is dropped.
fn reboot(p: &mut Pass<'_, '_>, client: bool) {
    let Some(v) = p.annotation(annotations::REBOOT) else {
        return;
    };
    if client {
        let kind = if v.contains("soft") {
            ResetType::GracefulRestart
        } else {
            ResetType::ForceRestart
        };
        let mut fallback = p.d.clone();
        fallback.drop_annotations.clear();
        p.actions.push(Planned {
            action: BmcAction::Reset(kind),
            fallback,
        });
        p.d.drop_annotations.push(annotations::REBOOT);
        p.event(EventType::Normal, "Rebooted", format!("{kind:?} sent"));
    } else {
        p.d.drop_annotations.push(annotations::REBOOT);
    }
}

/// `anneal.dev/operation`: `park` from Available or Provisioned, `unpark`
/// from Parked; a park elsewhere waits (the annotation stays), an unpark
/// elsewhere is dropped.
fn park(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Option<Outcome> {
    let health = p.cfg().health_interval;
    match (p.annotation(annotations::OPERATION), p.state()) {
        (Some("park"), MachineState::Available | MachineState::Provisioned) => {
            if client {
                p.call(BmcAction::Shutdown { announce: false });
            }
            p.d.status.powered_on = Some(false);
            p.transition(MachineState::Parked);
            p.d.drop_annotations.push(annotations::OPERATION);
            Some(Outcome::Transition {
                next: MachineState::Parked,
                event: "Parked",
                requeue: Some(health),
            })
        }
        (Some("unpark"), MachineState::Parked) => {
            p.d.drop_annotations.push(annotations::OPERATION);
            if p.m().spec.claim_ref.is_none() {
                // unpark refreshes the inventory: a new inspection, the old
                // MachineHardware gone (docs/lifecycle.md, "States")
                p.d.delete_hardware = true;
                p.transition(MachineState::Inspecting);
                return Some(match arm(p, client, http_boot) {
                    Outcome::Wait {
                        reason: "boot armed",
                        requeue,
                    } => Outcome::Transition {
                        next: MachineState::Inspecting,
                        event: "Unparked",
                        requeue,
                    },
                    other => other,
                });
            }
            let to = MachineState::Provisioned;
            p.transition(to);
            Some(Outcome::Transition {
                next: to,
                event: "Unparked",
                requeue: Some(health),
            })
        }
        (Some("unpark"), _) => {
            p.d.drop_annotations.push(annotations::OPERATION);
            None
        }
        _ => None,
    }
}

/// Enrolling: straight to Available with inspect-disable (and a boot MAC),
/// else Inspecting with a boot armed.
fn enrolling(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Outcome {
    if p.m().spec.externally_provisioned {
        return adopt(p);
    }
    if p.annotation(annotations::INSPECT_DISABLE).is_some() && p.m().spec.boot_mac_address.is_some()
    {
        p.transition(MachineState::Available);
        return Outcome::Transition {
            next: MachineState::Available,
            event: "InspectionDisabled",
            requeue: Some(SOON),
        };
    }
    if client && p.d.status.powered_on == Some(true) && !p.m().spec.restart_running_for_inspection {
        // never a surprise power change: a running server stays up
        let message = "the server is on: enrolment does not restart a running server. Power it \
            off to have it inspected, or set spec.restartRunningForInspection: true to let \
            anneal power-cycle it into a network boot";
        p.cond(types::READY, false, reasons::RUNNING_AT_ENROLMENT, message);
        p.event(
            EventType::Warning,
            reasons::RUNNING_AT_ENROLMENT,
            message.to_string(),
        );
        return Outcome::Wait {
            reason: "running at enrolment",
            requeue: Some(p.cfg().health_interval),
        };
    }
    p.transition(MachineState::Inspecting);
    match arm(p, client, http_boot) {
        Outcome::Wait {
            reason: "boot armed",
            requeue,
        } => Outcome::Transition {
            next: MachineState::Inspecting,
            event: "NetBootArmed",
            requeue,
        },
        held => held,
    }
}

/// Enrolling an externally provisioned server: never a BMC action; once the
/// claim naming it binds both ways, Provisioned for that claim, recorded in
/// `status.adopted`.
fn adopt(p: &mut Pass<'_, '_>) -> Outcome {
    let DeployView::Adoptable { claim, generation } = p.snap.deploy.clone() else {
        p.cond(
            types::READY,
            false,
            reasons::WAITING_FOR_CLAIM,
            "externally provisioned: waiting for a MachineClaim naming this Machine \
             (spec.machineName, with the Image it runs) to bind it; its power is not touched",
        );
        return Outcome::Wait {
            reason: "waiting for the claim to adopt",
            requeue: Some(p.cfg().health_interval),
        };
    };
    p.transition(MachineState::Provisioned);
    p.d.status.adopted = Some(anneal_api::Adoption {
        claim: claim.clone(),
        claim_generation: generation,
        at: Some(anneal_api::Time(p.snap.now)),
    });
    p.cond(
        types::READY,
        true,
        reasons::PROVISIONED,
        &format!("adopted for MachineClaim {claim}: it already runs that claim's OS"),
    );
    p.event(
        EventType::Normal,
        reasons::ADOPTED_PROVISIONED_CLAIM,
        format!(
            "adopted for MachineClaim {claim} without a deploy: no power change, no network boot"
        ),
    );
    Outcome::Transition {
        next: MachineState::Provisioned,
        event: reasons::ADOPTED_PROVISIONED_CLAIM,
        requeue: Some(p.cfg().health_interval),
    }
}

/// Inspecting: wait for registration + hardware until the boot token
/// expires; an expiry is a Restart failure, the `max_restarts`th holds.
fn inspecting(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Outcome {
    let now = p.snap.now.as_millisecond();
    let expires =
        p.d.status
            .net_boot
            .as_ref()
            .and_then(|n| n.expires_at.as_ref())
            .map(|t| t.0.as_millisecond());
    match expires {
        None => arm(p, client, http_boot),
        Some(exp) if exp > now => {
            let left = Duration::from_millis(u64::try_from(exp - now).unwrap_or(0));
            Outcome::Wait {
                reason: "waiting for the agent",
                requeue: Some((left + Duration::from_millis(200)).min(p.cfg().health_interval)),
            }
        }
        Some(_) => {
            let st = &mut p.d.status;
            let restarts = st.restart_count.unwrap_or(0).saturating_add(1);
            st.restart_count = Some(restarts);
            st.error_count = Some(st.error_count.unwrap_or(0).saturating_add(1));
            st.error_type = Some(ErrorType::Restart);
            st.operational_status = Some(OperationalStatus::Error);
            st.error_message =
                Some("the boot token expired before the agent registered and reported".into());
            st.net_boot = None;
            st.agent = None;
            let max = p.cfg().max_restarts;
            if restarts >= max {
                p.cond(
                    types::RETRY_HELD,
                    true,
                    reasons::BOOT_RETRY_EXHAUSTED,
                    &retry_held_message(max),
                );
                p.event(
                    EventType::Warning,
                    reasons::BOOT_RETRY_EXHAUSTED,
                    format!("{restarts} consecutive boots without registration; holding"),
                );
                p.token = TokenOp::Delete;
                return Outcome::Held {
                    reason: reasons::BOOT_RETRY_EXHAUSTED,
                };
            }
            p.event(
                EventType::Warning,
                "InspectionTimedOut",
                format!("restart {restarts}: the agent did not register in time"),
            );
            arm(p, client, http_boot)
        }
    }
}

/// Available / Released: re-inspect on request; an idle unclaimed
/// Available machine that is on is shut down.
fn available(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Outcome {
    if p.annotation(annotations::RE_INSPECT).is_some() {
        p.d.drop_annotations.push(annotations::RE_INSPECT);
        p.d.delete_hardware = true;
        p.transition(MachineState::Inspecting);
        return match arm(p, client, http_boot) {
            Outcome::Wait {
                reason: "boot armed",
                requeue,
            } => Outcome::Transition {
                next: MachineState::Inspecting,
                event: "ReInspect",
                requeue,
            },
            other => other,
        };
    }
    // Released by a claim under reclaimPolicy Retain (the claim controller
    // wrote Released): shut down and the override cleared, once
    // (docs/troubleshooting.md, "Released")
    if p.state() == MachineState::Released
        && p.m().spec.claim_ref.is_none()
        && p.m().spec.reclaim_policy == anneal_api::ReclaimPolicy::Retain
        && client
        && condition(&p.d.status.conditions, types::READY)
            .is_none_or(|c| c.reason != reasons::RECYCLE_PENDING)
        && condition(&p.d.status.conditions, types::PROGRESSING)
            .is_none_or(|c| c.reason != reasons::RELEASED)
    {
        retain_power_off(p);
        return Outcome::Wait {
            reason: "released: powered off",
            requeue: Some(p.cfg().health_interval),
        };
    }
    // Released by a claim under reclaimPolicy Recycle: wipe.
    if p.state() == MachineState::Released
        && p.m().spec.claim_ref.is_none()
        && condition(&p.d.status.conditions, types::READY)
            .is_some_and(|c| c.reason == reasons::RECYCLE_PENDING)
    {
        p.transition(MachineState::Deprovisioning);
        p.cond(
            types::PROGRESSING,
            true,
            reasons::WIPING,
            "reclaimPolicy Recycle: the agent wipes the disks",
        );
        p.d.status.current_run_ref = None;
        return match arm(p, client, http_boot) {
            Outcome::Wait {
                reason: "boot armed",
                requeue,
            } => Outcome::Transition {
                next: MachineState::Deprovisioning,
                event: "Recycle",
                requeue,
            },
            other => other,
        };
    }
    if p.state() == MachineState::Available
        && p.m().spec.claim_ref.is_some()
        && let Some(outcome) = deploy_or_report(p, client, http_boot)
    {
        return outcome;
    }
    // Fast-track: the idle agent keeps running until its window ends.
    if p.state() == MachineState::Available
        && p.m().spec.claim_ref.is_none()
        && let Some(end) = fast_track_end(p.m(), p.cfg().fast_track_window, p.snap.now)
    {
        let left = u64::try_from(end - p.snap.now.as_millisecond()).unwrap_or(0);
        return Outcome::Wait {
            reason: "fast-track window",
            requeue: Some(Duration::from_millis(left + 200).min(p.cfg().health_interval)),
        };
    }
    if p.state() == MachineState::Available
        && p.m().spec.claim_ref.is_none()
        && p.d.status.powered_on == Some(true)
        && client
    {
        p.call(BmcAction::Shutdown { announce: true });
        p.d.status.powered_on = Some(false);
    }
    Outcome::Wait {
        reason: "idle",
        requeue: Some(p.cfg().health_interval),
    }
}

/// A claimed Available or Provisioned Machine: start the Ready run, or
/// report why none can be planned (nothing is powered on). None: nothing to
/// deploy.
fn deploy_or_report(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Option<Outcome> {
    match p.snap.deploy.clone() {
        DeployView::Ready { run, image } => {
            Some(start_run(p, &run, image.as_deref(), client, http_boot))
        }
        DeployView::PlanFailed(message) => {
            plan_failed(p, &message);
            Some(Outcome::Wait {
                reason: "deploy plan failed",
                requeue: Some(p.cfg().health_interval),
            })
        }
        _ => None,
    }
}

fn plan_failed(p: &mut Pass<'_, '_>, message: &str) {
    let known = condition(&p.d.status.conditions, types::PROGRESSING)
        .is_some_and(|c| c.reason == reasons::DEPLOY_PLAN_FAILED && c.message == message);
    if !known {
        p.event(
            EventType::Warning,
            reasons::DEPLOY_PLAN_FAILED,
            message.to_string(),
        );
    }
    p.cond(
        types::PROGRESSING,
        false,
        reasons::DEPLOY_PLAN_FAILED,
        message,
    );
}

/// Starts a run: Provisioning, `currentRunRef`, a net boot armed.
fn start_run(
    p: &mut Pass<'_, '_>,
    run: &str,
    image: Option<&str>,
    client: bool,
    http_boot: bool,
) -> Outcome {
    p.transition(MachineState::Provisioning);
    let r = anneal_api::NameRef::new(run);
    p.d.status.current_run_ref = Some(r.clone());
    p.d.status.last_attempted_run_ref = Some(r);
    p.d.status.deploy = Some(anneal_api::MachineDeploy {
        image: image.map(str::to_string),
        phase: Some("Pending".into()),
        percent: Some(0),
    });
    p.cond(
        types::PROGRESSING,
        true,
        reasons::DEPLOYING,
        &format!("DeployRun {run} started"),
    );
    if p.state() == MachineState::Provisioning
        && p.m().status.as_ref().and_then(|s| s.state) == Some(MachineState::Available)
        && fast_track_live(p.m(), p.cfg().fast_track_window, p.snap.now)
    {
        // The agent is running and polling: `next` hands it the plan; no
        // power cycle, no new boot token.
        p.event(
            EventType::Normal,
            "DeployStarted",
            format!("DeployRun {run} started on the running agent (fast-track)"),
        );
        return Outcome::Transition {
            next: MachineState::Provisioning,
            event: "DeployStarted",
            requeue: Some(p.cfg().health_interval.min(Duration::from_secs(10))),
        };
    }
    p.event(
        EventType::Normal,
        "DeployStarted",
        format!("DeployRun {run} started"),
    );
    // The inspection's session is over (its agent powers off): a deploy
    // needs a fresh boot and registration.
    p.d.status.agent = None;
    match arm(p, client, http_boot) {
        Outcome::Wait {
            reason: "boot armed",
            requeue,
        } => Outcome::Transition {
            next: MachineState::Provisioning,
            event: "DeployStarted",
            requeue,
        },
        other => other,
    }
}

/// Provisioning: follow the current run; success → Provisioned (no more
/// net boot: the machine boots the entry the agent wrote), failure → a
/// Restart failure and a new run, held after `max_restarts`.
fn provisioning(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Outcome {
    let health = p.cfg().health_interval;
    if let DeployView::Current {
        phase,
        image,
        percent,
        ..
    } = &p.snap.deploy
    {
        p.d.status.deploy = Some(anneal_api::MachineDeploy {
            image: image.clone(),
            phase: phase.map(|ph| format!("{ph:?}")),
            percent: *percent,
        });
    }
    match p.snap.deploy.clone() {
        DeployView::Current {
            run,
            phase: Some(anneal_api::RunPhase::Succeeded),
            ..
        } => {
            p.transition(MachineState::Provisioned);
            let st = &mut p.d.status;
            st.last_successful_run_ref = Some(anneal_api::NameRef::new(&run));
            st.current_run_ref = None;
            st.net_boot = None;
            st.agent = None;
            p.token = TokenOp::Delete;
            p.cond(
                types::PROGRESSING,
                false,
                reasons::DEPLOY_SUCCEEDED,
                &format!("DeployRun {run} succeeded"),
            );
            p.event(
                EventType::Normal,
                reasons::DEPLOY_SUCCEEDED,
                format!("DeployRun {run} succeeded"),
            );
            Outcome::Transition {
                next: MachineState::Provisioned,
                event: reasons::DEPLOY_SUCCEEDED,
                requeue: Some(health),
            }
        }
        DeployView::Current {
            run,
            phase: Some(anneal_api::RunPhase::Failed),
            message,
            ..
        } => run_failed(p, &format!("DeployRun {run} failed: {message}")),
        DeployView::Current { .. } => {
            // Running or waiting for the agent: the boot token bounds the
            // wait for a registration, as during inspection.
            let now = p.snap.now.as_millisecond();
            if p.d.status.net_boot.is_none() && p.d.status.agent.is_none() {
                // No boot armed yet (the DHCP gate held it): arm now.
                return arm(p, client, http_boot);
            }
            if power_on_lost(p, now) {
                // The machine is off although its boot was armed a while
                // ago and no agent registered: the power-on did not take
                // (it raced the agent's own power-off after inspection,
                // or someone switched it off). Power it on again.
                p.event(
                    EventType::Normal,
                    "PowerOnRetried",
                    "the machine is off and no agent registered; powering on again".into(),
                );
                return arm(p, client, http_boot);
            }
            let expired =
                p.d.status
                    .net_boot
                    .as_ref()
                    .and_then(|n| n.expires_at.as_ref())
                    .is_some_and(|t| t.0.as_millisecond() <= now);
            let session_gone = p.d.status.net_boot.is_none()
                && p.d.status.agent.as_ref().is_none_or(|a| {
                    a.expires_at
                        .as_ref()
                        .is_none_or(|t| t.0.as_millisecond() <= now)
                });
            if (expired && p.d.status.agent.is_none()) || session_gone {
                let run =
                    p.d.status
                        .current_run_ref
                        .as_ref()
                        .map(|r| r.name.clone())
                        .unwrap_or_default();
                return run_failed(
                    p,
                    &format!(
                        "the agent did not register for DeployRun {run} before its boot token expired"
                    ),
                );
            }
            Outcome::Wait {
                reason: "deploying",
                requeue: Some(health.min(Duration::from_secs(10))),
            }
        }
        DeployView::Ready { run, image } => start_run(p, &run, image.as_deref(), client, http_boot),
        DeployView::PlanFailed(message) => {
            plan_failed(p, &message);
            Outcome::Wait {
                reason: "deploy plan failed",
                requeue: Some(health),
            }
        }
        DeployView::UpToDate | DeployView::NotRead | DeployView::Adoptable { .. } => {
            Outcome::Wait {
                reason: "nothing to deploy",
                requeue: Some(health),
            }
        }
    }
}

/// How long after arming a boot a machine that the BMC reports off is
/// taken as a lost power-on.
const POWER_ON_GRACE_MS: i64 = 20_000;

/// Provisioning: the BMC reports the machine off, its boot was armed more
/// than [`POWER_ON_GRACE_MS`] ago and no agent registered.
fn power_on_lost(p: &Pass<'_, '_>, now: i64) -> bool {
    let off = matches!(
        p.snap.bmc,
        Bmc::Answer {
            powered_on: false,
            ..
        }
    );
    let armed_at =
        p.d.status
            .net_boot
            .as_ref()
            .and_then(|n| n.expires_at.as_ref())
            .map(|t| t.0.as_millisecond() - token_lifetime_ms(p.m(), p.cfg()));
    off && p.d.status.agent.is_none()
        && armed_at.is_some_and(|at| now.saturating_sub(at) >= POWER_ON_GRACE_MS)
}

/// A failed attempt: a Restart failure; the next pass plans a new run (and
/// arms a new boot) unless `max_restarts` holds the machine.
fn run_failed(p: &mut Pass<'_, '_>, message: &str) -> Outcome {
    failed_attempt(p, reasons::DEPLOY_FAILED, message)
}

/// A failed deploy or wipe attempt (`reason`): a Restart failure; the next
/// pass starts a new attempt unless `max_restarts` holds the machine.
fn failed_attempt(p: &mut Pass<'_, '_>, reason: &'static str, message: &str) -> Outcome {
    let st = &mut p.d.status;
    let restarts = st.restart_count.unwrap_or(0).saturating_add(1);
    st.restart_count = Some(restarts);
    st.error_count = Some(st.error_count.unwrap_or(0).saturating_add(1));
    st.error_type = Some(ErrorType::Restart);
    st.operational_status = Some(OperationalStatus::Error);
    st.error_message = Some(message.to_string());
    st.current_run_ref = None;
    st.net_boot = None;
    st.agent = None;
    p.token = TokenOp::Delete;
    p.cond(types::PROGRESSING, false, reason, message);
    p.event(EventType::Warning, reason, message.to_string());
    let max = p.cfg().max_restarts;
    if restarts >= max {
        p.cond(
            types::RETRY_HELD,
            true,
            reasons::BOOT_RETRY_EXHAUSTED,
            &retry_held_message(max),
        );
        p.event(
            EventType::Warning,
            reasons::BOOT_RETRY_EXHAUSTED,
            format!("{restarts} consecutive failed attempts ({reason}); holding"),
        );
        return Outcome::Held {
            reason: reasons::BOOT_RETRY_EXHAUSTED,
        };
    }
    Outcome::Wait {
        reason: "deploy failed; a new run follows",
        requeue: Some(SOON),
    }
}

/// Deprovisioning (Recycle): the agent's wipe result comes back as the
/// Progressing condition (written by the agent API): Wiped → Available,
/// WipeFailed → a Restart failure and a new boot; an agent that never
/// registers before its token expires is a Restart failure too.
fn deprovisioning(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Outcome {
    let progressing = condition(&p.d.status.conditions, types::PROGRESSING)
        .map(|c| (c.reason.clone(), c.message.clone()));
    match progressing {
        Some((r, _)) if r == reasons::WIPED => {
            p.transition(MachineState::Available);
            let st = &mut p.d.status;
            st.net_boot = None;
            st.agent = None;
            st.last_successful_run_ref = None;
            st.deploy = None;
            p.token = TokenOp::Delete;
            p.cond(
                types::READY,
                true,
                reasons::WIPED,
                "wiped; available for a new claim",
            );
            return Outcome::Transition {
                next: MachineState::Available,
                event: reasons::WIPED,
                requeue: Some(SOON),
            };
        }
        Some((r, message)) if r == reasons::WIPE_FAILED => {
            let outcome =
                failed_attempt(p, reasons::WIPE_FAILED, &format!("wipe failed: {message}"));
            p.cond(
                types::PROGRESSING,
                true,
                reasons::WIPING,
                "reclaimPolicy Recycle: the agent wipes the disks (retry)",
            );
            return outcome;
        }
        _ => {}
    }
    let now = p.snap.now.as_millisecond();
    let expires =
        p.d.status
            .net_boot
            .as_ref()
            .and_then(|n| n.expires_at.as_ref())
            .map(|t| t.0.as_millisecond());
    match expires {
        None => arm(p, client, http_boot),
        Some(exp) if exp <= now && p.d.status.agent.is_none() => failed_attempt(
            p,
            reasons::WIPE_FAILED,
            "the agent did not register for the wipe before its boot token expired",
        ),
        Some(_) => Outcome::Wait {
            reason: "wiping",
            requeue: Some(p.cfg().health_interval.min(Duration::from_secs(10))),
        },
    }
}

/// Retain: the released server is shut down and its boot override
/// cleared, as a reclaim does (Recycle boots it to wipe instead); the
/// Progressing reason `Released` records that it was done.
fn retain_power_off(p: &mut Pass<'_, '_>) {
    // a server the BMC reports off is left alone
    if p.d.status.powered_on != Some(false) {
        p.call(BmcAction::ClearOverride);
        p.call(BmcAction::Shutdown { announce: true });
        p.d.status.powered_on = Some(false);
    }
    p.cond(
        types::PROGRESSING,
        false,
        reasons::RELEASED,
        "the claim was released under reclaimPolicy Retain: powered off, disks untouched",
    );
}

/// Provisioned: a changed intent starts a new run; a released claim
/// leaves the machine Released (disks untouched).
fn provisioned(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Outcome {
    if p.m().spec.claim_ref.is_none() {
        p.transition(MachineState::Released);
        let retain = p.m().spec.reclaim_policy == anneal_api::ReclaimPolicy::Retain;
        if retain && client {
            retain_power_off(p);
        } else {
            p.cond(
                types::PROGRESSING,
                false,
                reasons::RELEASED,
                "the claim was released; disks untouched",
            );
        }
        return Outcome::Transition {
            next: MachineState::Released,
            event: "Released",
            requeue: Some(p.cfg().health_interval),
        };
    }
    if let Some(outcome) = deploy_or_report(p, client, http_boot) {
        return outcome;
    }
    Outcome::Wait {
        reason: "provisioned",
        requeue: Some(p.cfg().health_interval),
    }
}

/// Arms a net boot: a token (minted by the driver), the one-time override
/// and the power-on; held first by the DHCP gate of lease-mode Subnets.
fn arm(p: &mut Pass<'_, '_>, client: bool, http_boot: bool) -> Outcome {
    // No power-on before the lease-mode reservation is live in bootd.
    if client && let Some(recheck) = dhcp_hold(p) {
        return Outcome::Wait {
            reason: "DHCP reservation not live",
            requeue: Some(recheck),
        };
    }
    let lifetime = token_lifetime_ms(p.m(), p.cfg());
    let expires = time_in(p.snap.now, lifetime);
    p.token = TokenOp::Mint;
    if client {
        let target = if http_boot {
            BootTarget::UefiHttp
        } else {
            BootTarget::Pxe
        };
        let reset = if p.d.status.powered_on.unwrap_or(false) {
            ResetType::ForceRestart
        } else {
            ResetType::On
        };
        // No token in status if it fails: the next pass mints a new one.
        p.call(BmcAction::BootOnce { target, reset });
        p.d.status.powered_on = Some(true);
        p.event(
            EventType::Normal,
            "NetBootArmed",
            format!("powered on with a one-time {} override", target.as_str()),
        );
    }
    p.d.status.net_boot = Some(NetBootStatus {
        token_hash: None,
        expires_at: Some(expires),
    });
    p.d.status.agent = None;
    p.cond(
        types::AGENT_REGISTERED,
        false,
        reasons::WAITING_FOR_AGENT,
        "waiting for the agent to register",
    );
    let wait = Duration::from_millis(u64::try_from(lifetime).unwrap_or(0) + 200);
    Outcome::Wait {
        reason: "boot armed",
        requeue: Some(wait.min(p.cfg().health_interval)),
    }
}

/// The DHCP power gate of lease-mode Subnets ([`dhcp_gate`]): Some(recheck)
/// while the Machine's reservation is not live in bootd. Writes the
/// condition, and a Warning Event every `dhcp_reservation_timeout` of
/// waiting.
fn dhcp_hold(p: &mut Pass<'_, '_>) -> Option<Duration> {
    let now = p.snap.now.as_millisecond();
    // lastTransitionTime keeps whole seconds: the wait began at the latest
    // at the end of that second, so the bound is never cut short.
    let waiting_since = condition(&p.d.status.conditions, dhcp_gate::CONDITION)
        .filter(|c| c.status == "False")
        .map(|c| {
            let t = c.last_transition_time.0.as_millisecond();
            if t % 1000 == 0 { t + 999 } else { t }
        });
    match dhcp_gate::evaluate(p.m(), p.snap.subnet.as_ref()) {
        dhcp_gate::Gate::NotApplicable => {
            p.d.status
                .conditions
                .retain(|c| c.type_ != dhcp_gate::CONDITION);
            None
        }
        dhcp_gate::Gate::Ready {
            subnet,
            address,
            revision,
        } => {
            p.warn = WarnOp::Clear;
            let message = format!("{address} is live on Subnet {subnet} (revision {revision})");
            if waiting_since.is_some() {
                p.event(EventType::Normal, dhcp_gate::LIVE, message.clone());
            }
            p.cond(dhcp_gate::CONDITION, true, dhcp_gate::LIVE, &message);
            None
        }
        dhcp_gate::Gate::Waiting { subnet, missing } => {
            let since = waiting_since.unwrap_or(now);
            let elapsed = now.saturating_sub(since).max(0);
            let timeout =
                i64::try_from(p.cfg().dhcp_reservation_timeout.as_millis()).unwrap_or(i64::MAX);
            let overdue = timeout > 0 && elapsed >= timeout;
            let message = dhcp_gate::waiting_message(&subnet, &missing, overdue);
            p.cond(dhcp_gate::CONDITION, false, dhcp_gate::WAITING, &message);
            let mut recheck = DHCP_RECHECK;
            if overdue {
                let periods = elapsed / timeout;
                let before = p
                    .snap
                    .dhcp_warned
                    .filter(|(start, _)| *start == since)
                    .map_or(0, |(_, n)| n);
                if periods > before {
                    p.warn = WarnOp::Set { since, periods };
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
                    p.event(EventType::Warning, dhcp_gate::OVERDUE_EVENT, note);
                }
            } else {
                // wake up for the bound, not later
                let left = u64::try_from(timeout - elapsed).unwrap_or(0);
                recheck = recheck.min(Duration::from_millis(left + 50));
            }
            Some(recheck)
        }
    }
}

/// The handler of a deleted Machine (docs/api.md, Machine
/// `spec.powerOffOnDelete`). Claimed: nothing is touched until the claim
/// releases it (Warning Event `DeletingClaimedHost` naming the claim and
/// the way out). Unclaimed: clear the one-time boot override, and only with
/// `spec.powerOffOnDelete` shut the server down (PoweringOff); delete the
/// boot-token Secret, release the finalizer. force-release, detached or no
/// BMC skip the BMC cleanup. `snap.bmc` is [`Bmc::Resolved`] or
/// [`Bmc::Failed`] (the credentials), [`Bmc::None`] without `spec.bmc`.
pub fn delete(snap: &Snapshot<'_>) -> Decision {
    let mut p = Pass::new(snap);
    p.warn = WarnOp::Clear;
    if skips_cleanup(snap.machine) {
        p.token = TokenOp::Delete;
        return p.finish(Outcome::Release, false);
    }
    if let Some(claim) = &snap.machine.spec.claim_ref {
        let message = format!(
            "claimed by MachineClaim {}: the Machine is deleted once that claim is deleted \
             (the claim's release follows spec.reclaimPolicy); to delete it now without any \
             BMC call, annotate it anneal.dev/force-release",
            claim.name
        );
        p.event(
            EventType::Warning,
            reasons::DELETING_CLAIMED_HOST,
            message.clone(),
        );
        return p.finish(Outcome::CleanupPending { message }, true);
    }
    let power_off = snap.machine.spec.power_off_on_delete;
    if power_off {
        p.transition(MachineState::PoweringOff);
    }
    match &snap.bmc {
        Bmc::Failed(f) => {
            let retry = bmc_failed(&mut p.d, f, snap.bmc_attempts, snap);
            p.backoff = BackoffOp::Failed {
                reason: f.reason,
                attempt: snap.bmc_attempts.saturating_add(1),
            };
            p.finish(
                Outcome::CleanupPending {
                    message: format!("bmc unavailable, retrying in {}s", retry.as_secs()),
                },
                true,
            )
        }
        b if b.usable() => {
            p.call(BmcAction::ClearOverride);
            if power_off {
                p.call(BmcAction::Shutdown { announce: false });
            }
            p.token = TokenOp::Delete;
            // The state written only if the cleanup fails (as before).
            p.finish(Outcome::Release, false)
        }
        _ => p.finish(Outcome::Release, false),
    }
}

/// Whether a delete skips the BMC cleanup: force-release, detached, or no
/// BMC.
pub fn skips_cleanup(m: &Machine) -> bool {
    annotation(m, annotations::FORCE_RELEASE).is_some()
        || annotation(m, annotations::DETACHED).is_some()
        || m.spec.bmc.is_none()
}

#[cfg(test)]
mod tests {
    //! Every transition and hold of docs/lifecycle.md, on hand-built
    //! snapshots: no API server, no BMC, no clock.
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::{Value, json};

    const T0: i64 = 1_800_000_000_000;

    fn now() -> Timestamp {
        Timestamp::from_millisecond(T0).unwrap()
    }

    fn at(ms_from_now: i64) -> String {
        Timestamp::from_millisecond(T0 + ms_from_now)
            .unwrap()
            .to_string()
    }

    /// A Machine with a BMC on Subnet `lab`; `spec` and `status` are merged
    /// in.
    fn machine(annotations: Value, spec: Value, status: Value) -> Machine {
        let mut s = json!({
            "subnetRef": {"name": "lab"},
            "bmc": {"address": "redfish+http://127.0.0.1:1", "credentialsSecretRef": {"name": "bmc"}}
        });
        if let (Some(base), Some(extra)) = (s.as_object_mut(), spec.as_object()) {
            for (k, v) in extra {
                base.insert(k.clone(), v.clone());
            }
        }
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m1", "namespace": "default", "generation": 2,
                         "uid": "u1", "annotations": annotations},
            "spec": s,
            "status": status,
        }))
        .unwrap()
    }

    fn cfg() -> LifecycleConfig {
        LifecycleConfig {
            boot_token_lifetime: Duration::from_secs(600),
            health_interval: Duration::from_secs(60),
            ..LifecycleConfig::default()
        }
    }

    fn snap<'a>(m: &'a Machine, cfg: &'a LifecycleConfig, bmc: Bmc) -> Snapshot<'a> {
        Snapshot {
            machine: m,
            now: now(),
            cfg,
            bmc,
            bmc_attempts: 0,
            bmc_backoff: None,
            hardware_session: None,
            subnet: None,
            dhcp_warned: None,
            deploy: DeployView::NotRead,
        }
    }

    fn answer(powered_on: bool) -> Bmc {
        Bmc::Answer {
            powered_on,
            offers_http_boot: false,
        }
    }

    fn failed(reason: BmcReason) -> Bmc {
        Bmc::Failed(BmcFailure {
            reason,
            message: "connection refused".into(),
        })
    }

    fn actions(d: &Decision) -> Vec<BmcAction> {
        d.actions.iter().map(|p| p.action).collect()
    }

    fn reasons(d: &Decision) -> Vec<&'static str> {
        d.draft.events.iter().map(|e| e.reason).collect()
    }

    fn cond<'d>(d: &'d Decision, type_: &str) -> Option<&'d anneal_api::Condition> {
        condition(&d.draft.status.conditions, type_)
    }

    fn state(d: &Decision) -> MachineState {
        d.draft.status.state.unwrap()
    }

    fn inspecting(extra: Value) -> Value {
        let mut st = json!({"state": "Inspecting", "poweredOn": true,
            "netBoot": {"tokenHash": "h", "expiresAt": at(30_000)}});
        if let (Some(base), Some(extra)) = (st.as_object_mut(), extra.as_object()) {
            for (k, v) in extra {
                base.insert(k.clone(), v.clone());
            }
        }
        st
    }

    fn boot_once(reset: ResetType) -> BmcAction {
        BmcAction::BootOnce {
            target: BootTarget::Pxe,
            reset,
        }
    }

    /// A claim released under Retain leaves the server off with no boot
    /// override; under Recycle it is left for the wipe's boot.
    #[test]
    fn a_retain_release_powers_off_and_clears_the_override() {
        let cfg = cfg();
        let st = json!({"state": "Provisioned", "poweredOn": true, "lastSuccessfulRunRef": {"name": "r1"}});
        let retained = machine(json!({}), json!({}), st.clone());
        let d = apply(&snap(&retained, &cfg, answer(true)));
        assert_eq!(state(&d), MachineState::Released);
        assert_eq!(
            actions(&d),
            vec![
                BmcAction::ClearOverride,
                BmcAction::Shutdown { announce: true }
            ]
        );
        assert_eq!(d.draft.status.powered_on, Some(false));
        assert!(
            cond(&d, types::PROGRESSING)
                .unwrap()
                .message
                .contains("powered off")
        );
        let recycled = machine(json!({}), json!({"reclaimPolicy": "Recycle"}), st);
        let d = apply(&snap(&recycled, &cfg, answer(true)));
        assert_eq!(state(&d), MachineState::Released);
        assert!(actions(&d).is_empty(), "{:?}", actions(&d));
        // the claim controller wrote Released itself: the same, once
        let released = machine(
            json!({}),
            json!({}),
            json!({"state": "Released", "poweredOn": true,
                   "conditions": [{"type": "Ready", "status": "False", "reason": "Released",
                                   "message": "claim c1 was deleted", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        let d = apply(&snap(&released, &cfg, answer(true)));
        assert_eq!(
            actions(&d),
            vec![
                BmcAction::ClearOverride,
                BmcAction::Shutdown { announce: true }
            ]
        );
        let again = machine(
            json!({}),
            json!({}),
            serde_json::to_value(&d.draft.status).unwrap(),
        );
        let d = apply(&snap(&again, &cfg, answer(true)));
        assert!(
            actions(&d).is_empty(),
            "powered off once only: {:?}",
            actions(&d)
        );
    }

    #[test]
    fn enrolling_arms_a_boot_token_override_and_power_on() {
        let cfg = cfg();
        let m = machine(json!({}), json!({}), json!(null));
        let s = snap(&m, &cfg, answer(false));
        assert!(wants_bmc(&s));
        let d = apply(&s);
        assert_eq!(
            d.outcome,
            Outcome::Transition {
                next: MachineState::Inspecting,
                event: "NetBootArmed",
                requeue: Some(cfg.health_interval),
            }
        );
        assert_eq!(state(&d), MachineState::Inspecting);
        assert_eq!(d.token, TokenOp::Mint);
        assert_eq!(actions(&d), vec![boot_once(ResetType::On)]);
        let nb = d.draft.status.net_boot.clone().unwrap();
        assert_eq!(nb.token_hash, None, "the driver fills in the minted hash");
        assert_eq!(nb.expires_at.unwrap().0.as_millisecond(), T0 + 600_000);
        assert_eq!(d.draft.status.powered_on, Some(true));
        assert_eq!(reasons(&d), vec!["StateChanged", "NetBootArmed"]);
        assert_eq!(cond(&d, types::AGENT_REGISTERED).unwrap().status, "False");
        assert_eq!(cond(&d, types::BMC_REACHABLE).unwrap().status, "True");
        assert_eq!(d.backoff, BackoffOp::Clear);
        // the fallback of the power-on holds no token
        assert_eq!(d.actions[0].fallback.status.net_boot, None);
        assert!(d.commit);
    }

    #[test]
    fn enrolling_leaves_a_running_server_unless_allowed_and_prefers_http_boot() {
        let mut cfg = cfg();
        // on, not allowed: no BMC action, no token, Ready=False, a Warning
        let m = machine(json!({}), json!({"bootTimeout": "30s"}), json!(null));
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert!(d.actions.is_empty(), "{:?}", d.actions);
        assert_eq!(d.token, TokenOp::Keep);
        assert_ne!(d.draft.status.state, Some(MachineState::Inspecting));
        assert!(d.draft.status.net_boot.is_none());
        let ready = cond(&d, types::READY).unwrap();
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", reasons::RUNNING_AT_ENROLMENT)
        );
        assert!(
            ready.message.contains("spec.restartRunningForInspection"),
            "{}",
            ready.message
        );
        assert!(reasons(&d).contains(&reasons::RUNNING_AT_ENROLMENT));
        // off: powered on as usual
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(actions(&d), vec![boot_once(ResetType::On)]);
        // allowed: restarted into the network boot
        let m = machine(
            json!({}),
            json!({"bootTimeout": "30s", "restartRunningForInspection": true}),
            json!(null),
        );
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(actions(&d), vec![boot_once(ResetType::ForceRestart)]);
        // bootTimeout below the operator default does not shorten it
        let nb = d.draft.status.net_boot.clone().unwrap();
        assert_eq!(nb.expires_at.unwrap().0.as_millisecond(), T0 + 600_000);
        cfg.prefer_http_boot = true;
        let d = apply(&snap(
            &m,
            &cfg,
            Bmc::Answer {
                powered_on: false,
                offers_http_boot: true,
            },
        ));
        assert_eq!(
            actions(&d),
            vec![BmcAction::BootOnce {
                target: BootTarget::UefiHttp,
                reset: ResetType::On
            }]
        );
        // a longer bootTimeout raises the deadline
        let m = machine(json!({}), json!({"bootTimeout": "1h"}), json!(null));
        let d = apply(&snap(&m, &cfg, answer(false)));
        let nb = d.draft.status.net_boot.clone().unwrap();
        assert_eq!(nb.expires_at.unwrap().0.as_millisecond(), T0 + 3_600_000);
    }

    #[test]
    fn a_deploy_that_succeeded_ends_provisioned_while_the_bmc_fails() {
        let cfg = cfg();
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c"}}),
            json!({"state": "Provisioning", "poweredOn": true,
                   "currentRunRef": {"name": "r1"}}),
        );
        let succeeded = DeployView::Current {
            run: "r1".into(),
            phase: Some(anneal_api::RunPhase::Succeeded),
            message: String::new(),
            image: Some("os".into()),
            percent: Some(100),
        };
        // the BMC's query failed, or it is in its backoff
        let mut failing = snap(&m, &cfg, failed(BmcReason::BmcUnreachable));
        failing.deploy = succeeded.clone();
        let mut backing_off = snap(&m, &cfg, Bmc::None);
        backing_off.bmc_backoff = Some(Duration::from_secs(30));
        backing_off.deploy = succeeded;
        for s in [failing, backing_off] {
            let d = apply(&s);
            assert_eq!(state(&d), MachineState::Provisioned);
            assert!(d.actions.is_empty(), "{:?}", d.actions);
            assert_eq!(
                d.draft
                    .status
                    .last_successful_run_ref
                    .as_ref()
                    .map(|r| r.name.as_str()),
                Some("r1")
            );
            assert!(reasons(&d).contains(&reasons::DEPLOY_SUCCEEDED));
        }
    }

    #[test]
    fn an_externally_provisioned_server_is_adopted_without_a_bmc_action() {
        let cfg = cfg();
        let m = machine(
            json!({}),
            json!({"externallyProvisioned": true, "claimRef": {"name": "c"}}),
            json!(null),
        );
        assert!(wants_deploy(&m));
        // on or off, the claim not confirmed yet: waits, touches nothing
        for on in [true, false] {
            let d = apply(&snap(&m, &cfg, answer(on)));
            assert!(d.actions.is_empty(), "{:?}", d.actions);
            assert_eq!(d.token, TokenOp::Keep);
            assert_ne!(d.draft.status.state, Some(MachineState::Inspecting));
            assert!(d.draft.status.net_boot.is_none());
            let ready = cond(&d, types::READY).unwrap();
            assert_eq!(ready.reason, reasons::WAITING_FOR_CLAIM);
        }
        // the binding holds both ways: Provisioned for the claim, no action
        let mut s = snap(&m, &cfg, answer(true));
        s.deploy = DeployView::Adoptable {
            claim: "c".into(),
            generation: 3,
        };
        let d = apply(&s);
        assert!(d.actions.is_empty(), "{:?}", d.actions);
        assert_eq!(d.token, TokenOp::Keep);
        assert_eq!(state(&d), MachineState::Provisioned);
        let a = d.draft.status.adopted.clone().unwrap();
        assert_eq!((a.claim.as_str(), a.claim_generation), ("c", 3));
        assert!(reasons(&d).contains(&reasons::ADOPTED_PROVISIONED_CLAIM));
        assert_eq!(cond(&d, types::READY).unwrap().status, "True");
        // adopted and up to date: Provisioned stays, still no action
        let adopted = machine(
            json!({}),
            json!({"externallyProvisioned": true, "claimRef": {"name": "c"}}),
            json!({"state": "Provisioned", "poweredOn": true,
                   "adopted": {"claim": "c", "claimGeneration": 3}}),
        );
        let mut s = snap(&adopted, &cfg, answer(true));
        s.deploy = DeployView::UpToDate;
        let d = apply(&s);
        assert!(d.actions.is_empty(), "{:?}", d.actions);
        assert_eq!(state(&d), MachineState::Provisioned);
    }

    #[test]
    fn inspect_disable_goes_to_available_only_with_a_boot_mac() {
        let cfg = cfg();
        let ann = json!({"anneal.dev/inspect-disable": ""});
        let m = machine(
            ann.clone(),
            json!({"bootMACAddress": "52:54:00:aa:bb:01"}),
            json!(null),
        );
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(
            d.outcome,
            Outcome::Transition {
                next: MachineState::Available,
                event: "InspectionDisabled",
                requeue: Some(SOON),
            }
        );
        assert!(d.actions.is_empty());
        assert_eq!(d.token, TokenOp::Keep);
        let m = machine(ann, json!({}), json!(null));
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(state(&d), MachineState::Inspecting);
        assert_eq!(d.token, TokenOp::Mint);
    }

    #[test]
    fn inspecting_waits_until_the_deadline_at_most_one_health_interval() {
        let cfg = cfg();
        let m = machine(json!({}), json!({}), inspecting(json!({})));
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(
            d.outcome,
            Outcome::Wait {
                reason: "waiting for the agent",
                requeue: Some(Duration::from_millis(30_200)),
            }
        );
        assert!(d.actions.is_empty());
        assert_eq!(d.token, TokenOp::Keep);
        let far = inspecting(json!({"netBoot": {"tokenHash": "h", "expiresAt": at(3_600_000)}}));
        let m = machine(json!({}), json!({}), far);
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(d.outcome.requeue(), Some(cfg.health_interval));
        // 1 ms before the deadline: wake just after it
        let near = inspecting(json!({"netBoot": {"tokenHash": "h", "expiresAt": at(1)}}));
        let m = machine(json!({}), json!({}), near);
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(d.outcome.requeue(), Some(Duration::from_millis(201)));
    }

    #[test]
    fn inspecting_to_available_when_reported_even_while_the_bmc_fails() {
        let cfg = cfg();
        let st = inspecting(json!({"agent": {"sessionTokenHash": "s1"}}));
        let m = machine(json!({}), json!({}), st);
        assert!(wants_hardware(&m));
        let mut s = snap(&m, &cfg, failed(BmcReason::BmcUnreachable));
        s.hardware_session = Some("s1".into());
        assert!(!wants_bmc(&s), "the report needs no BMC");
        let d = apply(&s);
        assert_eq!(
            d.outcome,
            Outcome::Transition {
                next: MachineState::Available,
                event: "InspectionReported",
                requeue: Some(SOON),
            }
        );
        assert_eq!(d.draft.status.net_boot, None);
        assert_eq!(d.token, TokenOp::Delete);
        assert!(d.actions.is_empty());
        assert_eq!(cond(&d, types::AGENT_REGISTERED).unwrap().status, "True");
        // the inspection's session is over: its hash is cleared
        let agent = d.draft.status.agent.clone().unwrap();
        assert_eq!(agent.session_token_hash, None);
        assert_eq!(agent.expires_at, None);
        // with fast-track the idle agent keeps it (its plan comes by `next`)
        let mut fast = cfg.clone();
        fast.fast_track_window = Some(Duration::from_secs(600));
        let mut sf = snap(&m, &fast, failed(BmcReason::BmcUnreachable));
        sf.hardware_session = Some("s1".into());
        let d = apply(&sf);
        assert_eq!(state(&d), MachineState::Available);
        assert_eq!(
            d.draft
                .status
                .agent
                .as_ref()
                .and_then(|a| a.session_token_hash.as_deref()),
            Some("s1")
        );
        // the report of another boot does not count
        s.hardware_session = Some("old".into());
        s.bmc = answer(true);
        let d = apply(&s);
        assert_eq!(state(&d), MachineState::Inspecting);
        assert_eq!(
            cond(&d, types::AGENT_REGISTERED).unwrap().reason,
            reasons::REGISTERED
        );
    }

    #[test]
    fn expiry_is_a_restart_failure_and_re_arms_twice_then_holds() {
        let cfg = cfg();
        let expired = |restarts: i32| {
            let mut st = inspecting(json!({
                "netBoot": {"tokenHash": "h", "expiresAt": at(0)},
                "agent": {"sessionTokenHash": "s0"},
            }));
            if restarts > 0 {
                st["restartCount"] = json!(restarts);
                st["errorCount"] = json!(restarts);
            }
            machine(json!({}), json!({}), st)
        };
        for (before, after) in [(0, 1), (1, 2)] {
            let m = expired(before);
            let d = apply(&snap(&m, &cfg, answer(true)));
            let st = &d.draft.status;
            assert_eq!(st.restart_count, Some(after));
            assert_eq!(st.error_count, Some(after));
            assert_eq!(st.error_type, Some(ErrorType::Restart));
            assert_eq!(st.operational_status, Some(OperationalStatus::Error));
            assert_eq!(st.agent, None);
            assert_eq!(st.state, Some(MachineState::Inspecting));
            assert!(reasons(&d).contains(&"InspectionTimedOut"));
            assert_eq!(d.token, TokenOp::Mint);
            assert_eq!(actions(&d), vec![boot_once(ResetType::ForceRestart)]);
            assert_eq!(
                st.net_boot.as_ref().unwrap().expires_at.as_ref().unwrap().0,
                Timestamp::from_millisecond(T0 + 600_000).unwrap()
            );
        }
        let m = expired(2);
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(
            d.outcome,
            Outcome::Held {
                reason: reasons::BOOT_RETRY_EXHAUSTED
            }
        );
        assert_eq!(d.draft.status.restart_count, Some(3));
        assert!(d.actions.is_empty(), "no BMC call when it holds");
        assert_eq!(d.token, TokenOp::Delete);
        assert_eq!(d.draft.status.net_boot, None);
        let held = cond(&d, types::RETRY_HELD).unwrap();
        assert_eq!(
            (held.status.as_str(), held.reason.as_str()),
            ("True", reasons::BOOT_RETRY_EXHAUSTED)
        );
        assert!(
            held.message.starts_with("3 consecutive restart failures"),
            "{}",
            held.message
        );
        assert!(reasons(&d).contains(&reasons::BOOT_RETRY_EXHAUSTED));
        assert_eq!(
            state(&d),
            MachineState::Inspecting,
            "a failure keeps the state"
        );
    }

    #[test]
    fn the_hold_message_follows_max_restarts() {
        let mut cfg = cfg();
        cfg.max_restarts = 5;
        let st = inspecting(json!({
            "netBoot": {"tokenHash": "h", "expiresAt": at(-5)}, "restartCount": 4,
        }));
        let m = machine(json!({}), json!({}), st);
        let d = apply(&snap(&m, &cfg, answer(true)));
        let held = cond(&d, types::RETRY_HELD).unwrap();
        assert!(
            held.message.starts_with("5 consecutive"),
            "{}",
            held.message
        );
        // at 4 of 5 it would have re-armed
        let st = inspecting(json!({
            "netBoot": {"tokenHash": "h", "expiresAt": at(-5)}, "restartCount": 3,
        }));
        let m = machine(json!({}), json!({}), st);
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(d.token, TokenOp::Mint);
    }

    fn held_status() -> Value {
        json!({"state": "Inspecting", "restartCount": 3, "errorCount": 3,
               "errorType": "Restart", "operationalStatus": "error",
               "conditions": [{"type": types::RETRY_HELD, "status": "True", "reason": reasons::BOOT_RETRY_EXHAUSTED,
                               "message": "3 consecutive restart failures; set anneal.dev/clear-error to retry",
                               "observedGeneration": 2,
                               "lastTransitionTime": at(-60_000)}]})
    }

    #[test]
    fn held_stays_held_without_any_bmc_call() {
        let cfg = cfg();
        let m = machine(json!({}), json!({}), held_status());
        let s = snap(&m, &cfg, Bmc::None);
        assert!(!wants_bmc(&s));
        let d = apply(&s);
        assert_eq!(
            d.outcome,
            Outcome::Held {
                reason: reasons::BOOT_RETRY_EXHAUSTED
            }
        );
        assert!(d.actions.is_empty());
        assert_eq!(d.token, TokenOp::Keep);
        assert!(d.draft.events.is_empty());
        // nothing changes: the commit writes nothing
        let mut want = m.status.clone().unwrap();
        want.conditions = d.draft.status.conditions.clone();
        assert_eq!(d.draft.status, want);
        assert_eq!(
            cond(&d, types::RETRY_HELD)
                .unwrap()
                .last_transition_time
                .0
                .to_string(),
            at(-60_000)
        );
    }

    #[test]
    fn clear_error_lifts_the_hold_and_re_arms() {
        let cfg = cfg();
        let m = machine(
            json!({"anneal.dev/clear-error": ""}),
            json!({}),
            held_status(),
        );
        let s = snap(&m, &cfg, answer(false));
        assert!(wants_bmc(&s));
        let d = apply(&s);
        let held = cond(&d, types::RETRY_HELD).unwrap();
        assert_eq!(
            (held.status.as_str(), held.reason.as_str()),
            ("False", reasons::CLEARED)
        );
        assert_eq!(held.last_transition_time.0, now());
        assert_eq!(d.draft.status.restart_count, None);
        assert_eq!(d.draft.status.error_count, None);
        assert_eq!(
            d.draft.status.operational_status,
            Some(OperationalStatus::Ok)
        );
        assert_eq!(d.draft.drop_annotations, vec![annotations::CLEAR_ERROR]);
        assert_eq!(d.token, TokenOp::Mint);
        assert_eq!(actions(&d), vec![boot_once(ResetType::On)]);
        assert!(reasons(&d).contains(&"ErrorCleared"));
    }

    #[test]
    fn available_idle_and_on_is_shut_down_a_claimed_one_stays_on() {
        let cfg = cfg();
        let st = json!({"state": "Available", "poweredOn": true});
        let m = machine(json!({}), json!({}), st.clone());
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(actions(&d), vec![BmcAction::Shutdown { announce: true }]);
        assert_eq!(d.draft.status.powered_on, Some(false));
        assert_eq!(d.actions[0].fallback.status.powered_on, Some(true));
        assert_eq!(d.outcome.requeue(), Some(cfg.health_interval));
        let claimed = machine(json!({}), json!({"claimRef": {"name": "c1"}}), st.clone());
        let d = apply(&snap(&claimed, &cfg, answer(true)));
        assert!(d.actions.is_empty());
        assert_eq!(d.draft.status.powered_on, Some(true));
        // already off: nothing
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert!(d.actions.is_empty());
        // Released and already powered off for its release: not again
        let rel = machine(
            json!({}),
            json!({}),
            json!({"state": reasons::RELEASED, "conditions": [{"type": "Progressing", "status": "False",
                "reason": "Released", "message": "powered off", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        assert!(apply(&snap(&rel, &cfg, answer(true))).actions.is_empty());
    }

    fn with_deploy<'a>(
        m: &'a Machine,
        cfg: &'a LifecycleConfig,
        bmc: Bmc,
        deploy: DeployView,
    ) -> Snapshot<'a> {
        Snapshot {
            deploy,
            ..snap(m, cfg, bmc)
        }
    }

    #[test]
    fn a_ready_run_starts_provisioning_with_a_net_boot() {
        let cfg = cfg();
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            json!({"state": "Available", "poweredOn": false}),
        );
        let d = apply(&with_deploy(
            &m,
            &cfg,
            answer(false),
            DeployView::Ready {
                run: "m1-abc-1".into(),
                image: Some("os".into()),
            },
        ));
        assert_eq!(state(&d), MachineState::Provisioning);
        assert_eq!(d.token, TokenOp::Mint);
        assert!(matches!(actions(&d)[..], [BmcAction::BootOnce { .. }]));
        let st = &d.draft.status;
        assert_eq!(st.current_run_ref.as_ref().unwrap().name, "m1-abc-1");
        assert_eq!(st.last_attempted_run_ref.as_ref().unwrap().name, "m1-abc-1");
        let summary = st.deploy.as_ref().unwrap();
        assert_eq!(
            (summary.image.as_deref(), summary.percent),
            (Some("os"), Some(0))
        );
        assert!(reasons(&d).contains(&"DeployStarted"));
        assert_eq!(
            cond(&d, types::PROGRESSING).unwrap().reason,
            reasons::DEPLOYING
        );
    }

    #[test]
    fn a_plan_that_fails_powers_nothing_on_and_warns_once() {
        let cfg = cfg();
        let why = "the disk hint of Image os matches 2 disks: /dev/vda, /dev/vdb".to_string();
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            json!({"state": "Available", "poweredOn": false}),
        );
        let d = apply(&with_deploy(
            &m,
            &cfg,
            answer(false),
            DeployView::PlanFailed(why.clone()),
        ));
        assert!(d.actions.is_empty(), "no power-on: {:?}", d.actions);
        assert_eq!(d.token, TokenOp::Keep);
        assert_eq!(state(&d), MachineState::Available);
        assert_eq!(reasons(&d), vec![reasons::DEPLOY_PLAN_FAILED]);
        assert!(d.draft.events[0].type_ == EventType::Warning);
        let c = cond(&d, types::PROGRESSING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.message.as_str()),
            ("False", why.as_str())
        );
        // The same failure again: no second Event.
        let again = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            serde_json::to_value(&d.draft.status).unwrap(),
        );
        let d = apply(&with_deploy(
            &again,
            &cfg,
            answer(false),
            DeployView::PlanFailed(why),
        ));
        assert!(d.draft.events.is_empty());
    }

    #[test]
    fn a_succeeded_run_is_provisioned_without_net_boot() {
        let cfg = cfg();
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            json!({"state": "Provisioning", "poweredOn": true, "currentRunRef": {"name": "r1"},
                   "netBoot": {"tokenHash": "h", "expiresAt": at(60_000)}}),
        );
        let d = apply(&with_deploy(
            &m,
            &cfg,
            answer(true),
            DeployView::Current {
                run: "r1".into(),
                phase: Some(anneal_api::RunPhase::Succeeded),
                message: String::new(),
                image: None,
                percent: None,
            },
        ));
        assert_eq!(state(&d), MachineState::Provisioned);
        assert!(d.actions.is_empty());
        assert_eq!(d.token, TokenOp::Delete);
        let st = &d.draft.status;
        assert!(st.current_run_ref.is_none() && st.net_boot.is_none());
        assert_eq!(st.last_successful_run_ref.as_ref().unwrap().name, "r1");
        // Still running: wait.
        let d = apply(&with_deploy(
            &m,
            &cfg,
            answer(true),
            DeployView::Current {
                run: "r1".into(),
                phase: Some(anneal_api::RunPhase::WritingContent),
                message: String::new(),
                image: None,
                percent: None,
            },
        ));
        assert_eq!(state(&d), MachineState::Provisioning);
        assert!(d.actions.is_empty());
    }

    #[test]
    fn failed_runs_are_restart_failures_and_the_third_holds() {
        let cfg = cfg();
        let mut status = json!({"state": "Provisioning", "poweredOn": true,
            "currentRunRef": {"name": "r1"}});
        for n in 1..=3 {
            let m = machine(
                json!({}),
                json!({"claimRef": {"name": "c1"}}),
                status.clone(),
            );
            let d = apply(&with_deploy(
                &m,
                &cfg,
                answer(true),
                DeployView::Current {
                    run: "r1".into(),
                    phase: Some(anneal_api::RunPhase::Failed),
                    message: "WritingContent: piece 7 of os-p3 stayed corrupt".into(),
                    image: None,
                    percent: None,
                },
            ));
            let st = &d.draft.status;
            assert_eq!(st.restart_count, Some(n));
            assert!(st.current_run_ref.is_none());
            assert!(
                st.error_message
                    .as_deref()
                    .unwrap()
                    .contains("piece 7 of os-p3")
            );
            assert!(reasons(&d).contains(&reasons::DEPLOY_FAILED));
            if n < 3 {
                assert_eq!(d.outcome.requeue(), Some(SOON));
            } else {
                assert!(matches!(d.outcome, Outcome::Held { .. }));
                assert_eq!(cond(&d, types::RETRY_HELD).unwrap().status, "True");
            }
            status = serde_json::to_value(&d.draft.status).unwrap();
            status["currentRunRef"] = json!({"name": "r1"});
        }
    }

    #[test]
    fn provisioned_redeploys_on_a_new_intent_and_idles_otherwise() {
        let cfg = cfg();
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            json!({"state": "Provisioned", "poweredOn": true, "lastSuccessfulRunRef": {"name": "r1"}}),
        );
        let d = apply(&with_deploy(&m, &cfg, answer(true), DeployView::UpToDate));
        assert_eq!(state(&d), MachineState::Provisioned);
        assert!(d.actions.is_empty());
        let d = apply(&with_deploy(
            &m,
            &cfg,
            answer(true),
            DeployView::Ready {
                run: "r2".into(),
                image: None,
            },
        ));
        assert_eq!(state(&d), MachineState::Provisioning);
        assert!(matches!(
            actions(&d)[..],
            [BmcAction::BootOnce {
                reset: ResetType::ForceRestart,
                ..
            }]
        ));
    }

    #[test]
    fn a_lost_power_on_while_provisioning_is_retried_after_the_grace() {
        let cfg = cfg();
        let lifetime = i64::try_from(cfg.boot_token_lifetime.as_millis()).unwrap();
        let status = |armed_ms_ago: i64| {
            json!({"state": "Provisioning", "poweredOn": true, "currentRunRef": {"name": "r1"},
                   "netBoot": {"tokenHash": "h", "expiresAt": at(lifetime - armed_ms_ago)}})
        };
        let view = DeployView::Current {
            run: "r1".into(),
            phase: Some(anneal_api::RunPhase::Pending),
            message: String::new(),
            image: None,
            percent: None,
        };
        // Armed 30 s ago, the BMC says off, no agent: powered on again.
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            status(30_000),
        );
        let d = apply(&with_deploy(&m, &cfg, answer(false), view.clone()));
        assert!(
            matches!(
                actions(&d)[..],
                [BmcAction::BootOnce {
                    reset: ResetType::On,
                    ..
                }]
            ),
            "{:?}",
            d.actions
        );
        assert_eq!(d.token, TokenOp::Mint);
        assert!(reasons(&d).contains(&"PowerOnRetried"));
        // Within the grace, or on: wait.
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            status(5_000),
        );
        assert!(
            apply(&with_deploy(&m, &cfg, answer(false), view.clone()))
                .actions
                .is_empty()
        );
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            status(30_000),
        );
        assert!(
            apply(&with_deploy(&m, &cfg, answer(true), view))
                .actions
                .is_empty()
        );
    }

    #[test]
    fn a_run_held_by_the_dhcp_gate_is_armed_once_the_gate_opens() {
        let cfg = cfg();
        // Provisioning, a current run, no boot armed, no agent (the gate
        // held the power-on when the run started).
        let m = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            json!({"state": "Provisioning", "poweredOn": false, "currentRunRef": {"name": "r1"}}),
        );
        let d = apply(&with_deploy(
            &m,
            &cfg,
            answer(false),
            DeployView::Current {
                run: "r1".into(),
                phase: Some(anneal_api::RunPhase::Pending),
                message: String::new(),
                image: None,
                percent: None,
            },
        ));
        assert!(
            matches!(
                actions(&d)[..],
                [BmcAction::BootOnce {
                    reset: ResetType::On,
                    ..
                }]
            ),
            "{:?}",
            d.actions
        );
        assert_eq!(d.token, TokenOp::Mint);
        assert!(d.draft.status.net_boot.is_some());
    }

    #[test]
    fn recycle_wipes_then_returns_available() {
        let cfg = cfg();
        let released = machine(
            json!({}),
            json!({}),
            json!({"state": "Released", "poweredOn": false, "lastSuccessfulRunRef": {"name": "r1"},
                   "conditions": [{"type": "Ready", "status": "False", "reason": "RecyclePending",
                                   "message": "claim c1 was deleted", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        let d = apply(&snap(&released, &cfg, answer(false)));
        assert_eq!(state(&d), MachineState::Deprovisioning);
        assert_eq!(d.token, TokenOp::Mint);
        assert!(matches!(actions(&d)[..], [BmcAction::BootOnce { .. }]));
        assert_eq!(
            cond(&d, types::PROGRESSING).unwrap().reason,
            reasons::WIPING
        );
        // A Retain release (no RecyclePending) stays Released.
        let retained = machine(
            json!({}),
            json!({}),
            json!({"state": "Released", "poweredOn": false,
                   "conditions": [{"type": "Ready", "status": "False", "reason": "Released",
                                   "message": "kept", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        let d2 = apply(&snap(&retained, &cfg, answer(false)));
        assert_eq!(state(&d2), MachineState::Released);
        assert!(d2.actions.is_empty());
        // The agent's report: Wiped → Available, no token, no last run.
        let mut st = serde_json::to_value(&d.draft.status).unwrap();
        st["conditions"] = json!([{"type": "Progressing", "status": "False", "reason": "Wiped",
            "message": "the agent wiped every disk", "lastTransitionTime": "2026-01-01T00:00:00Z"}]);
        let wiped = machine(json!({}), json!({}), st.clone());
        let d3 = apply(&snap(&wiped, &cfg, answer(true)));
        assert_eq!(state(&d3), MachineState::Available);
        assert_eq!(d3.token, TokenOp::Delete);
        assert!(d3.draft.status.last_successful_run_ref.is_none());
        // WipeFailed → a Restart failure, the condition back to Wiping.
        st["conditions"][0]["reason"] = json!("WipeFailed");
        st["conditions"][0]["message"] = json!("/dev/vda: read-only");
        let failed = machine(json!({}), json!({}), st);
        let d4 = apply(&snap(&failed, &cfg, answer(true)));
        assert_eq!(state(&d4), MachineState::Deprovisioning);
        assert_eq!(d4.draft.status.restart_count, Some(1));
        assert!(reasons(&d4).contains(&reasons::WIPE_FAILED));
        assert_eq!(
            cond(&d4, types::PROGRESSING).unwrap().reason,
            reasons::WIPING
        );
    }

    #[test]
    fn fast_track_keeps_the_agent_and_starts_without_a_power_cycle() {
        let mut cfg = cfg();
        cfg.fast_track_window = Some(Duration::from_secs(600));
        let agent =
            json!({"sessionTokenHash": "h", "expiresAt": at(300_000), "lastSeen": at(-60_000)});
        let idle = machine(
            json!({}),
            json!({}),
            json!({"state": "Available", "poweredOn": true, "agent": agent}),
        );
        let d = apply(&snap(&idle, &cfg, answer(true)));
        assert!(d.actions.is_empty(), "not shut down inside the window");
        let claimed = machine(
            json!({}),
            json!({"claimRef": {"name": "c1"}}),
            json!({"state": "Available", "poweredOn": true, "agent": agent}),
        );
        let d = apply(&with_deploy(
            &claimed,
            &cfg,
            answer(true),
            DeployView::Ready {
                run: "r1".into(),
                image: None,
            },
        ));
        assert_eq!(state(&d), MachineState::Provisioning);
        assert!(d.actions.is_empty(), "no power cycle: {:?}", d.actions);
        assert_eq!(d.token, TokenOp::Keep);
        // Outside the window: shut down as before.
        let mut late = cfg.clone();
        late.fast_track_window = Some(Duration::from_secs(30));
        let d = apply(&snap(&idle, &late, answer(true)));
        assert_eq!(actions(&d), vec![BmcAction::Shutdown { announce: true }]);
    }

    #[test]
    fn re_inspect_from_available_and_released() {
        let cfg = cfg();
        for from in ["Available", reasons::RELEASED] {
            let m = machine(
                json!({"anneal.dev/re-inspect": ""}),
                json!({}),
                json!({"state": from, "poweredOn": false}),
            );
            let d = apply(&snap(&m, &cfg, answer(false)));
            assert_eq!(
                d.outcome,
                Outcome::Transition {
                    next: MachineState::Inspecting,
                    event: "ReInspect",
                    requeue: Some(cfg.health_interval),
                },
                "{from}"
            );
            assert_eq!(d.draft.drop_annotations, vec![annotations::RE_INSPECT]);
            assert!(d.draft.delete_hardware, "the old inventory goes");
            assert_eq!(d.token, TokenOp::Mint);
            assert_eq!(actions(&d), vec![boot_once(ResetType::On)]);
        }
    }

    #[test]
    fn park_from_available_and_provisioned_elsewhere_it_waits() {
        let cfg = cfg();
        let park = json!({"anneal.dev/operation": "park"});
        for from in ["Available", reasons::PROVISIONED] {
            let m = machine(
                park.clone(),
                json!({}),
                json!({"state": from, "poweredOn": true}),
            );
            let d = apply(&snap(&m, &cfg, answer(true)));
            assert_eq!(
                d.outcome,
                Outcome::Transition {
                    next: MachineState::Parked,
                    event: "Parked",
                    requeue: Some(cfg.health_interval),
                }
            );
            assert_eq!(actions(&d), vec![BmcAction::Shutdown { announce: false }]);
            assert_eq!(d.draft.status.powered_on, Some(false));
            assert_eq!(d.draft.drop_annotations, vec![annotations::OPERATION]);
            // a failing shutdown leaves the state and the annotation
            let f = BmcFailure {
                reason: BmcReason::BmcUnreachable,
                message: "reset".into(),
            };
            let s = snap(&m, &cfg, answer(true));
            let failed = action_failed(&d, 0, &f, &s);
            assert_eq!(format!("{:?}", failed.draft.status.state.unwrap()), from);
            assert!(failed.draft.drop_annotations.is_empty());
        }
        let m = machine(park, json!({}), inspecting(json!({})));
        let d = apply(&snap(&m, &cfg, answer(true)));
        assert_eq!(state(&d), MachineState::Inspecting);
        assert!(d.draft.drop_annotations.is_empty(), "the request stays");
        assert!(d.actions.is_empty());
    }

    #[test]
    fn unpark_reinspects_or_returns_to_provisioned_when_claimed() {
        let cfg = cfg();
        let unpark = json!({"anneal.dev/operation": "unpark"});
        let parked = json!({"state": "Parked", "poweredOn": false});
        let m = machine(unpark.clone(), json!({}), parked.clone());
        let d = apply(&snap(&m, &cfg, answer(false)));
        // unclaimed: a new inspection refreshes the inventory
        assert_eq!(state(&d), MachineState::Inspecting);
        assert_eq!(d.draft.drop_annotations, vec![annotations::OPERATION]);
        assert!(d.draft.delete_hardware, "the old inventory goes");
        assert!(
            matches!(actions(&d)[..], [BmcAction::BootOnce { .. }]),
            "{:?}",
            actions(&d)
        );
        let m = machine(unpark.clone(), json!({"claimRef": {"name": "c"}}), parked);
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(state(&d), MachineState::Provisioned);
        // unpark elsewhere is dropped
        let m = machine(unpark, json!({}), json!({"state": "Available"}));
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(state(&d), MachineState::Available);
        assert_eq!(d.draft.drop_annotations, vec![annotations::OPERATION]);
    }

    #[test]
    fn detached_makes_no_bmc_call_and_says_so() {
        let cfg = cfg();
        let m = machine(json!({"anneal.dev/detached": ""}), json!({}), json!(null));
        let s = snap(&m, &cfg, Bmc::None);
        assert!(!wants_bmc(&s));
        let d = apply(&s);
        assert_eq!(
            d.draft.status.operational_status,
            Some(OperationalStatus::Detached)
        );
        assert_eq!(state(&d), MachineState::Inspecting);
        assert!(d.actions.is_empty());
        // a backoff does not hold a detached machine
        let mut s = snap(&m, &cfg, Bmc::None);
        s.bmc_backoff = Some(Duration::from_secs(9));
        assert!(apply(&s).outcome.requeue() != Some(Duration::from_secs(9)));
        // attached again: OK
        let m = machine(
            json!({}),
            json!({}),
            json!({"state": "Available", "operationalStatus": "detached"}),
        );
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(
            d.draft.status.operational_status,
            Some(OperationalStatus::Ok)
        );
    }

    #[test]
    fn paused_does_nothing() {
        let cfg = cfg();
        let m = machine(
            json!({"anneal.dev/paused": "", "anneal.dev/reboot": "{\"mode\":\"hard\"}"}),
            json!({}),
            json!({"state": "Available", "poweredOn": true}),
        );
        assert!(paused(&m));
        let s = snap(&m, &cfg, Bmc::None);
        assert!(!wants_bmc(&s));
        let d = apply(&s);
        assert!(!d.commit);
        assert!(d.actions.is_empty());
        assert!(d.draft.events.is_empty());
        assert_eq!(d.outcome.requeue(), None);
    }

    #[test]
    fn reboot_soft_and_hard_are_consumed_kept_when_the_reset_fails() {
        let cfg = cfg();
        for (mode, kind) in [
            ("{\"mode\":\"soft\"}", ResetType::GracefulRestart),
            ("{\"mode\":\"hard\"}", ResetType::ForceRestart),
        ] {
            let m = machine(
                json!({"anneal.dev/reboot": mode}),
                json!({"claimRef": {"name": "c"}}),
                json!({"state": reasons::PROVISIONED, "poweredOn": true}),
            );
            let s = snap(&m, &cfg, answer(true));
            let d = apply(&s);
            assert_eq!(actions(&d), vec![BmcAction::Reset(kind)]);
            assert_eq!(d.draft.drop_annotations, vec![annotations::REBOOT]);
            assert!(reasons(&d).contains(&"Rebooted"));
            let f = BmcFailure {
                reason: BmcReason::QueryFailed,
                message: "500".into(),
            };
            let failed = action_failed(&d, 0, &f, &s);
            assert!(failed.draft.drop_annotations.is_empty());
            assert!(!reasons(&failed).contains(&"Rebooted"));
            assert_eq!(
                failed.outcome,
                Outcome::Wait {
                    reason: "BMC call failed",
                    requeue: Some(Duration::from_secs(5)),
                }
            );
        }
    }

    #[test]
    fn a_failed_reboot_before_a_power_on_arms_nothing() {
        let cfg = cfg();
        let m = machine(
            json!({"anneal.dev/reboot": "{\"mode\":\"hard\"}"}),
            json!({"restartRunningForInspection": true}),
            json!(null),
        );
        let s = snap(&m, &cfg, answer(true));
        let d = apply(&s);
        assert_eq!(
            actions(&d),
            vec![
                BmcAction::Reset(ResetType::ForceRestart),
                boot_once(ResetType::ForceRestart)
            ]
        );
        assert_eq!(d.token, TokenOp::Mint);
        let f = BmcFailure {
            reason: BmcReason::BmcUnreachable,
            message: "refused".into(),
        };
        let failed = action_failed(&d, 0, &f, &s);
        assert_eq!(
            failed.token,
            TokenOp::Keep,
            "no token for a power-on never sent"
        );
        assert_eq!(failed.draft.status.net_boot, None);
        assert_eq!(failed.draft.status.state, Some(MachineState::Enrolling));
        assert!(failed.actions.is_empty());
    }

    fn subnet(dhcp_status: Value) -> Subnet {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "lab", "namespace": "default"},
            "spec": {
                "siteRef": {"name": "site"}, "cidr": "10.0.0.0/24",
                "bootd": {"serverIP": "10.0.0.1", "mode": "External"},
                "dhcp": {"mode": "lease", "gateway": "", "leaseRange": {"start": "10.0.0.100", "end": "10.0.0.110"}}
            },
            "status": {"dhcp": dhcp_status}
        }))
        .unwrap()
    }

    fn live_table(applied: &str) -> Value {
        json!({
            "reservations": [{"address": "10.0.0.100", "machine": "m1", "mac": "52:54:00:aa:bb:01"}],
            "revision": "r1", "appliedRevision": applied,
        })
    }

    #[test]
    fn dhcp_gate_not_applicable_waiting_ready() {
        let cfg = cfg();
        let mac = json!({"bootMACAddress": "52:54:00:aa:bb:01"});
        // no subnet: not applicable, armed at once
        let m = machine(json!({}), mac.clone(), json!(null));
        assert!(wants_subnet(&snap(&m, &cfg, answer(false))));
        assert!(!wants_subnet(&snap(&m, &cfg, Bmc::None)), "no BMC, no gate");
        let idle = machine(json!({}), mac.clone(), json!({"state": "Available"}));
        assert!(!wants_subnet(&snap(&idle, &cfg, answer(false))));
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(d.token, TokenOp::Mint);
        assert!(cond(&d, dhcp_gate::CONDITION).is_none());
        // waiting: no token, no BMC call, the condition says why
        let mut s = snap(&m, &cfg, answer(false));
        s.subnet = Some(subnet(live_table("r0")));
        let d = apply(&s);
        assert_eq!(
            d.outcome,
            Outcome::Wait {
                reason: "DHCP reservation not live",
                requeue: Some(DHCP_RECHECK),
            }
        );
        assert_eq!(d.token, TokenOp::Keep);
        assert!(d.actions.is_empty());
        assert_eq!(state(&d), MachineState::Inspecting);
        let c = cond(&d, dhcp_gate::CONDITION).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", dhcp_gate::WAITING)
        );
        assert!(c.message.contains("appliedRevision r0"), "{}", c.message);
        assert_eq!(d.draft.status.net_boot, None);
        // ready: the condition turns True, an Event, the power-on
        let waiting = serde_json::to_value(&d.draft.status).unwrap();
        let m = machine(json!({}), mac, waiting);
        let mut s = snap(&m, &cfg, answer(false));
        s.subnet = Some(subnet(live_table("r1")));
        let d = apply(&s);
        let c = cond(&d, dhcp_gate::CONDITION).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", dhcp_gate::LIVE)
        );
        assert!(reasons(&d).contains(&dhcp_gate::LIVE));
        assert_eq!(d.token, TokenOp::Mint);
        assert_eq!(actions(&d), vec![boot_once(ResetType::On)]);
        assert_eq!(d.dhcp_warned, WarnOp::Clear);
    }

    #[test]
    fn dhcp_gate_wakes_for_the_bound_and_warns_once_per_period() {
        let cfg = cfg(); // 120 s bound
        let since = T0 - 100_500;
        let st = |since: i64| {
            json!({"state": "Inspecting", "conditions": [{
                "type": dhcp_gate::CONDITION, "status": "False", "reason": dhcp_gate::WAITING,
                "message": "", "lastTransitionTime": Timestamp::from_millisecond(since).unwrap().to_string()}]})
        };
        let mac = json!({"bootMACAddress": "52:54:00:aa:bb:01"});
        let m = machine(json!({}), mac.clone(), st(since));
        let mut s = snap(&m, &cfg, answer(false));
        s.subnet = Some(subnet(json!({})));
        let d = apply(&s);
        // 19.5 s left: the 5 s recheck is shorter
        assert_eq!(d.outcome.requeue(), Some(DHCP_RECHECK));
        assert!(d.draft.events.is_empty());
        // 2.5 s left: wake at the bound
        let m = machine(json!({}), mac.clone(), st(T0 - 117_500));
        let mut s = snap(&m, &cfg, answer(false));
        s.subnet = Some(subnet(json!({})));
        assert_eq!(
            apply(&s).outcome.requeue(),
            Some(Duration::from_millis(2_550))
        );
        // overdue: one Warning Event, remembered
        let since = T0 - 130_500;
        let m = machine(json!({}), mac, st(since));
        let mut s = snap(&m, &cfg, answer(false));
        s.subnet = Some(subnet(json!({})));
        let d = apply(&s);
        assert_eq!(reasons(&d), vec![dhcp_gate::OVERDUE_EVENT]);
        assert_eq!(d.dhcp_warned, WarnOp::Set { since, periods: 1 });
        assert!(
            cond(&d, dhcp_gate::CONDITION)
                .unwrap()
                .message
                .contains("overdue")
        );
        assert!(d.actions.is_empty());
        // warned for this period already: silent
        s.dhcp_warned = Some((since, 1));
        let d = apply(&s);
        assert!(d.draft.events.is_empty());
        assert_eq!(d.dhcp_warned, WarnOp::Keep);
        // the next period warns again
        s.now = Timestamp::from_millisecond(since + 241_000).unwrap();
        let d = apply(&s);
        assert_eq!(d.dhcp_warned, WarnOp::Set { since, periods: 2 });
    }

    #[test]
    fn bmc_failures_per_reason_at_their_cadence() {
        let cfg = cfg();
        let m = machine(json!({}), json!({}), json!({"state": "Available"}));
        for (reason, attempts, retry) in [
            (BmcReason::BmcUnreachable, 0, 15),
            (BmcReason::BmcUnreachable, 4, 15),
            (BmcReason::CredentialsRejected, 0, 300),
            (BmcReason::TlsConfigConflict, 1, 300),
            (BmcReason::CredentialsMissing, 0, 5),
            (BmcReason::CredentialsMissing, 2, 20),
            (BmcReason::QueryFailed, 1, 10),
            (BmcReason::QueryFailed, 30, 1800),
        ] {
            let mut s = snap(&m, &cfg, failed(reason));
            s.bmc_attempts = attempts;
            let d = apply(&s);
            assert_eq!(
                d.outcome.requeue(),
                Some(Duration::from_secs(retry)),
                "{reason:?} after {attempts}"
            );
            assert_eq!(
                d.backoff,
                BackoffOp::Failed {
                    reason,
                    attempt: attempts + 1
                }
            );
            let c = cond(&d, types::BMC_REACHABLE).unwrap();
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("False", reason.as_str())
            );
            assert_eq!(d.draft.status.error_type, Some(ErrorType::Transient));
            assert_eq!(
                d.draft.status.operational_status,
                Some(OperationalStatus::Error)
            );
            assert_eq!(d.draft.status.error_count, Some(1));
            assert_eq!(reasons(&d), vec!["BMCUnavailable"]);
            assert!(d.actions.is_empty());
        }
        // the same reason again: no new Event, no new count
        let st = json!({"state": "Available", "errorCount": 1, "errorType": "Transient",
            "conditions": [{"type": types::BMC_REACHABLE, "status": "False", "reason": reasons::BMC_UNREACHABLE,
                            "message": "connection refused", "lastTransitionTime": at(-1000)}]});
        let m = machine(json!({}), json!({}), st);
        let d = apply(&snap(&m, &cfg, failed(BmcReason::BmcUnreachable)));
        assert!(d.draft.events.is_empty());
        assert_eq!(d.draft.status.error_count, Some(1));
        // during the backoff: no query, no call, wait the rest
        let mut s = snap(&m, &cfg, Bmc::None);
        s.bmc_backoff = Some(Duration::from_secs(7));
        assert!(!wants_bmc(&s));
        let d = apply(&s);
        assert_eq!(d.outcome.requeue(), Some(Duration::from_secs(7)));
        assert!(d.actions.is_empty());
        // recovery: Connected, the transient error cleared, backoff forgotten
        let d = apply(&snap(&m, &cfg, answer(false)));
        assert_eq!(cond(&d, types::BMC_REACHABLE).unwrap().status, "True");
        assert_eq!(d.draft.status.error_type, None);
        assert_eq!(d.draft.status.error_count, None);
        assert_eq!(d.backoff, BackoffOp::Clear);
        assert_eq!(reasons(&d), vec![types::BMC_REACHABLE]);
    }

    #[test]
    fn a_failed_power_on_commits_no_token_and_restarts_the_cadence() {
        let cfg = cfg();
        let m = machine(json!({}), json!({}), json!(null));
        let mut s = snap(&m, &cfg, answer(false));
        s.bmc_attempts = 3;
        let d = apply(&s);
        let f = BmcFailure {
            reason: BmcReason::BmcUnreachable,
            message: "reset".into(),
        };
        let failed = action_failed(&d, 0, &f, &s);
        assert_eq!(failed.draft.status.net_boot, None);
        assert_eq!(failed.draft.status.state, Some(MachineState::Inspecting));
        assert_eq!(failed.token, TokenOp::Keep);
        assert!(failed.commit);
        assert_eq!(
            failed.backoff,
            BackoffOp::Failed {
                reason: BmcReason::BmcUnreachable,
                attempt: 1
            },
            "the answer before cleared the earlier failures"
        );
        assert_eq!(failed.outcome.requeue(), Some(Duration::from_secs(15)));
        assert!(!reasons(&failed).contains(&"NetBootArmed"));
    }

    #[test]
    fn delete_leaves_the_power_unless_asked_and_waits_for_the_claim() {
        let cfg = cfg();
        // unclaimed: the override cleared; the power left as it is, or shut
        // down with spec.powerOffOnDelete
        for (spec, shutdown) in [
            (json!({}), false),
            (json!({"powerOffOnDelete": true}), true),
        ] {
            let m = machine(
                json!({}),
                spec,
                json!({"state": "Available", "poweredOn": true}),
            );
            let s = snap(&m, &cfg, Bmc::Resolved);
            let d = delete(&s);
            assert_eq!(d.outcome, Outcome::Release);
            let mut want = vec![BmcAction::ClearOverride];
            if shutdown {
                want.push(BmcAction::Shutdown { announce: false });
            }
            assert_eq!(actions(&d), want);
            assert_eq!(d.token, TokenOp::Delete);
            assert_eq!(d.dhcp_warned, WarnOp::Clear);
            let to = if shutdown {
                MachineState::PoweringOff
            } else {
                MachineState::Available
            };
            assert_eq!(state(&d), to);
            // a failing BMC call keeps the finalizer and writes the state
            let f = BmcFailure {
                reason: BmcReason::BmcUnreachable,
                message: "refused".into(),
            };
            let failed = action_failed(&d, d.actions.len() - 1, &f, &s);
            assert_eq!(
                failed.outcome,
                Outcome::CleanupPending {
                    message: "refused".into()
                }
            );
            assert!(failed.commit);
            assert_eq!(failed.token, TokenOp::Keep);
            assert_eq!(state(&failed), to);
            // credentials that fail: pending too
            let d = delete(&snap(&m, &cfg, failed_bmc()));
            assert_eq!(
                d.outcome,
                Outcome::CleanupPending {
                    message: "bmc unavailable, retrying in 5s".into()
                }
            );
            assert!(d.commit && d.actions.is_empty());
        }
        // claimed (even with powerOffOnDelete): no BMC call, the state kept,
        // the token kept, a Warning naming the claim and the way out
        for state_ in ["Provisioned", "Provisioning", "Available"] {
            let m = machine(
                json!({}),
                json!({"claimRef": {"name": "c"}, "powerOffOnDelete": true}),
                json!({"state": state_, "poweredOn": true}),
            );
            let d = delete(&snap(&m, &cfg, Bmc::Resolved));
            assert!(d.actions.is_empty(), "{:?}", d.actions);
            assert_eq!(d.token, TokenOp::Keep);
            assert_eq!(
                d.draft.status.state.map(|s| format!("{s:?}")),
                Some(state_.to_string())
            );
            assert!(reasons(&d).contains(&reasons::DELETING_CLAIMED_HOST));
            match &d.outcome {
                Outcome::CleanupPending { message } => {
                    assert!(message.contains("MachineClaim c"), "{message}");
                    assert!(message.contains("anneal.dev/force-release"), "{message}");
                }
                other => panic!("a claimed Machine's delete went on: {other:?}"),
            }
        }
    }

    fn failed_bmc() -> Bmc {
        failed(BmcReason::CredentialsMissing)
    }

    #[test]
    fn force_release_detached_or_no_bmc_skip_the_cleanup() {
        let cfg = cfg();
        let ms = [
            machine(
                json!({"anneal.dev/force-release": ""}),
                json!({}),
                json!({"state": "Available"}),
            ),
            machine(
                json!({"anneal.dev/detached": ""}),
                json!({}),
                json!({"state": "Available"}),
            ),
            machine(
                json!({}),
                json!({"bmc": null}),
                json!({"state": "Available"}),
            ),
        ];
        for m in &ms {
            assert!(skips_cleanup(m));
            let d = delete(&snap(m, &cfg, Bmc::None));
            assert_eq!(d.outcome, Outcome::Release);
            assert!(d.actions.is_empty());
            assert!(!d.commit);
            assert_eq!(d.token, TokenOp::Delete);
        }
        // A Provisioned machine whose BMC answers: force-release deletes it
        // without a single BMC call; without it the cleanup (asked to power
        // off) shuts it down.
        let provisioned = |ann: Value| {
            machine(
                ann,
                json!({"powerOffOnDelete": true}),
                json!({"state": "Provisioned", "poweredOn": true,
                       "lastSuccessfulRunRef": {"name": "r1"}}),
            )
        };
        let forced = provisioned(json!({"anneal.dev/force-release": ""}));
        let d = delete(&snap(&forced, &cfg, answer(true)));
        assert_eq!(d.outcome, Outcome::Release);
        assert!(d.actions.is_empty(), "{:?}", d.actions);
        let plain = provisioned(json!({}));
        assert!(!skips_cleanup(&plain));
        let d = delete(&snap(&plain, &cfg, answer(true)));
        assert!(
            d.actions
                .iter()
                .any(|a| matches!(a.action, BmcAction::Shutdown { .. })),
            "{:?}",
            d.actions
        );
    }

    #[test]
    fn the_hardware_is_read_only_while_inspecting_with_a_session() {
        let m = machine(
            json!({}),
            json!({}),
            json!({"state": "Available", "agent": {"sessionTokenHash": "s"}}),
        );
        assert!(!wants_hardware(&m));
        let m = machine(json!({}), json!({}), inspecting(json!({})));
        assert!(!wants_hardware(&m));
    }
}
