//! The claim controller: binds MachineClaims to Machines atomically and
//! releases them when the claim is deleted.
//!
//! Binding is one JSON merge patch of `Machine.spec.claimRef` that carries
//! the Machine's `metadata.resourceVersion`: the API server refuses it with
//! 409 Conflict when anyone wrote the Machine since we read it, so exactly
//! one claim wins a machine no matter how many controllers or replicas race.
//! On 409 the controller moves on to the next candidate from its (re-listed)
//! cache and, when they are exhausted, requeues shortly to re-list.
//!
//! Release (claim deletion, behind the finalizer `anneal.dev/claim-release`):
//! the Machine's `status.state` becomes `Released` first (so no claim can
//! take a machine whose disks still hold the old deployment), then
//! `spec.claimRef` is cleared under the same optimistic lock. `Retain` keeps
//! it `Released` (condition Ready=False, reason `Released`) until it is
//! re-inspected; `Recycle` needs the wipe of the lifecycle controller, so it
//! stays `Released` with reason `RecyclePending` for that controller to pick
//! up.

pub mod index;
pub mod select;

use anneal_api::conditions::{reasons, types};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anneal_api::{
    ClaimPhase, Machine, MachineClaim, MachineClaimStatus, MachineHardware, MachineState,
    ReclaimPolicy, Time,
};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info};

use crate::conditions;
use crate::controller::{
    Identity, Indexed, ReconcileError, Scope, drive, is_conflict, patch_params,
};
use crate::metrics::Metrics;
use index::MachineIndex;
use select::Skip;

/// Finalizer that holds a claim until its machine is released.
pub const FINALIZER: &str = "anneal.dev/claim-release";
const KIND: &str = "MachineClaim";
/// Field manager of the claim controller's writes.
pub const FIELD_MANAGER: &str = "anneal-claims";

/// Errors of one claim reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// An API call failed.
    #[error("api call failed: {0}")]
    Kube(#[source] kube::Error),
    /// The finalizer wrapper failed.
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<ClaimError>>),
    /// The object has no namespace.
    #[error("object has no namespace")]
    NoNamespace,
    /// The machine changed under a release; retried.
    #[error("machine {0} changed during release; retrying")]
    ReleaseConflict(String),
    /// The caches did not sync in time.
    #[error("caches not ready")]
    NotReady,
    /// The bound machine is Parked: its release waits for `unpark` (the
    /// finalizer stays; retried).
    #[error("machine {0} is Parked: the release waits until it is unparked")]
    WaitsForUnpark(String),
}

impl From<kube::Error> for ClaimError {
    fn from(e: kube::Error) -> Self {
        Self::Kube(e)
    }
}

/// Shared state of the claim controller.
pub struct Context {
    client: Client,
    machines: Store<Machine>,
    /// Free machines per namespace and the machine of each claim.
    index: Arc<Indexed<MachineIndex>>,
    hardware: Store<MachineHardware>,
    recorder: Recorder,
    /// Who reports the one-off Events ([`crate::controller::publish_once`]).
    reporter: Reporter,
    metrics: Arc<Metrics>,
    /// Claims bound by this process whose Machine update the cache may not
    /// show yet: claim key -> machine name.
    recent: Mutex<HashMap<String, (String, Instant)>>,
    /// Machines this process bound or lost a race for, hidden from
    /// candidate lists until the cache catches up: machine key -> when.
    taken: Mutex<HashMap<String, Instant>>,
    /// The status this process last wrote per claim UID, until the cache
    /// shows it: a reconcile that runs before the watch delivers our own
    /// write compares against what the server holds, not the stale copy,
    /// and neither writes the status again nor repeats its Event.
    written: Mutex<HashMap<String, (MachineClaimStatus, Instant)>>,
}

impl Context {
    /// The claim's status as the server holds it, as far as we know: our
    /// own last write while the cache lags behind it, else the cached copy.
    fn current_status(&self, claim: &MachineClaim) -> MachineClaimStatus {
        let cached = claim.status.clone().unwrap_or_default();
        let Some(uid) = claim.metadata.uid.as_deref() else {
            return cached;
        };
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        match written.get(uid) {
            Some((w, _)) if *w == cached => {
                // The cache caught up: forget the note.
                written.remove(uid);
                cached
            }
            Some((w, at)) if at.elapsed() < NOTE_TTL => w.clone(),
            Some(_) => {
                written.remove(uid);
                cached
            }
            None => cached,
        }
    }

    /// Takes machine `ns/name` for one bind attempt of this process; false
    /// when another reconcile already took it ([`reserve`]).
    fn reserve(&self, ns: &str, name: &str) -> bool {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        reserve(&mut taken, key(ns, name), Instant::now())
    }

    fn note_written(&self, claim: &MachineClaim, status: &MachineClaimStatus) {
        if let Some(uid) = claim.metadata.uid.clone() {
            let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            written.retain(|_, (_, at)| now.saturating_duration_since(*at) < NOTE_TTL);
            written.insert(uid, (status.clone(), now));
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("claims::Context").finish_non_exhaustive()
    }
}

/// How long a local "bound" or "taken" note outlives the cache lag.
const NOTE_TTL: Duration = Duration::from_secs(30);
/// How long a machine this process bound, lost or is binding stays out of
/// its candidate lists.
const TAKEN_TTL: Duration = Duration::from_secs(2);

/// Takes machine `key` in `taken` for one bind attempt at `now`, unless a
/// concurrent reconcile of this process took it less than [`TAKEN_TTL`]
/// ago. Concurrent claims picking from the same snapshot of free machines
/// otherwise both sent the bind, and the loser's write came back 409 (the
/// only bind conflicts left with one leader).
fn reserve(taken: &mut HashMap<String, Instant>, key: String, now: Instant) -> bool {
    match taken.get(&key) {
        Some(at) if now.saturating_duration_since(*at) < TAKEN_TTL => false,
        _ => {
            taken.insert(key, now);
            true
        }
    }
}

fn key(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// The claim controller's identity.
pub const ID: Identity = Identity {
    name: "claims",
    kind: KIND,
    field_manager: FIELD_MANAGER,
};

/// Runs the claim controller in `scope` until the scope is cancelled. Its
/// Machine feed is taken when this is called ([`Scope::machines`]).
pub fn controller(
    scope: Scope,
    concurrency: u16,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let machines = scope.machines();
    run_controller(scope, concurrency, machines)
}

async fn run_controller(
    scope: Scope,
    concurrency: u16,
    machines: crate::controller::Feed<Machine>,
) {
    let (machines, index, machine_stream) = machines.indexed::<MachineIndex>();
    let (hardware, hardware_stream) = scope.reflected::<MachineHardware>();

    // The claims' own cache is slimmed like the others (no managedFields).
    let (claim_store, claim_writer) = kube::runtime::reflector::store();
    let claim_stream = watcher(scope.api::<MachineClaim>(), watcher::Config::default())
        .default_backoff()
        .modify(crate::controller::slim)
        .reflect(claim_writer)
        .applied_objects();
    let controller = Controller::for_stream(claim_stream, claim_store.clone())
        .with_config(kube::runtime::controller::Config::default().concurrency(concurrency));
    let claim_store2 = claim_store.clone();
    let machines_for_map = machines.clone();

    let ctx = Arc::new(Context {
        client: scope.client.clone(),
        machines,
        index,
        hardware,
        recorder: scope.recorder.clone(),
        reporter: scope.reporter.clone(),
        metrics: scope.metrics.clone(),
        recent: Mutex::new(HashMap::new()),
        taken: Mutex::new(HashMap::new()),
        written: Mutex::new(HashMap::new()),
    });

    let controller = controller
        .watches_shared_stream(machine_stream, move |m: Arc<Machine>| {
            claims_for_machine(&claim_store, &m)
        })
        .watches_stream(hardware_stream, move |hw: MachineHardware| {
            let ns = hw.namespace().unwrap_or_default();
            match machines_for_map.get(&ObjectRef::new(&hw.name_any()).within(&ns)) {
                Some(m) => claims_for_machine(&claim_store2, &m),
                None => Vec::new(),
            }
        });
    drive(ID, &scope, controller, reconcile, ctx).await;
}

/// Claims a Machine event concerns: its bound claim, or, for a machine that
/// could be bound, every unbound claim in its namespace that names it or
/// uses a selector.
fn claims_for_machine(claims: &Store<MachineClaim>, m: &Machine) -> Vec<ObjectRef<MachineClaim>> {
    let ns = m.namespace().unwrap_or_default();
    if let Some(r) = &m.spec.claim_ref {
        // a claimRef into another namespace binds nothing (select::binding_holds)
        if r.namespace_or(&ns) != ns {
            return Vec::new();
        }
        return vec![ObjectRef::new(&r.name).within(&ns)];
    }
    if m.spec.unclaimable || m.metadata.deletion_timestamp.is_some() {
        return Vec::new();
    }
    let name = m.name_any();
    claims
        .state()
        .iter()
        .filter(|c| c.namespace().as_deref() == Some(ns.as_str()))
        .filter(|c| {
            let phase = c.status.as_ref().and_then(|s| s.phase);
            !matches!(phase, Some(ClaimPhase::Bound | ClaimPhase::Failed))
        })
        .filter(|c| {
            c.spec.selector.is_some() || c.spec.machine_name.as_deref() == Some(name.as_str())
        })
        .map(|c| ObjectRef::from_obj(c.as_ref()))
        .collect()
}

impl ReconcileError for ClaimError {
    fn is_conflict(&self) -> bool {
        match self {
            Self::Kube(e) => is_conflict(e),
            Self::ReleaseConflict(_) => true,
            Self::Finalizer(f) => match f.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(e)
                | kube::runtime::finalizer::Error::CleanupFailed(e) => e.is_conflict(),
                kube::runtime::finalizer::Error::AddFinalizer(e)
                | kube::runtime::finalizer::Error::RemoveFinalizer(e) => is_conflict(e),
                _ => false,
            },
            Self::NoNamespace | Self::NotReady | Self::WaitsForUnpark(_) => false,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(_) => "api",
            Self::Finalizer(_) => "finalizer",
            Self::NoNamespace => "no_namespace",
            Self::ReleaseConflict(_) => "release_conflict",
            Self::NotReady => "not_ready",
            Self::WaitsForUnpark(_) => "waits_for_unpark",
        }
    }
}

async fn reconcile(claim: Arc<MachineClaim>, ctx: Arc<Context>) -> Result<Action, ClaimError> {
    let ns = claim.namespace().ok_or(ClaimError::NoNamespace)?;
    let api: Api<MachineClaim> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, claim, |event| async {
        match event {
            Finalizer::Apply(c) => apply(&c, &ctx).await,
            Finalizer::Cleanup(c) => cleanup(&c, &ctx).await,
        }
    })
    .await
    .map_err(|e| ClaimError::Finalizer(Box::new(e)))
}

async fn wait_ready(ctx: &Context) -> Result<(), ClaimError> {
    let ready = async {
        let _ = ctx.machines.wait_until_ready().await;
        let _ = ctx.hardware.wait_until_ready().await;
    };
    tokio::time::timeout(Duration::from_secs(30), ready)
        .await
        .map_err(|_| ClaimError::NotReady)
}

/// The machine bound to this claim, if any: from our own recent binds, the
/// cache, or (when status names a machine the cache disagrees about) a live
/// read.
async fn bound_machine(
    claim: &MachineClaim,
    ns: &str,
    ctx: &Context,
) -> Result<Option<Arc<Machine>>, ClaimError> {
    let name = claim.name_any();
    let ck = key(ns, &name);
    let names_us = |m: &Machine| {
        m.spec
            .claim_ref
            .as_ref()
            .is_some_and(|r| select::ref_names(r, ns, ns, &name))
    };
    let recent = {
        let mut recent = ctx.recent.lock().unwrap_or_else(|e| e.into_inner());
        // one clock read for the scan (a read per note cost more than the binds)
        let now = Instant::now();
        recent.retain(|_, (_, at)| now.saturating_duration_since(*at) < NOTE_TTL);
        recent.get(&ck).map(|(m, _)| m.clone())
    };
    let hint = recent.or_else(|| claim.status.as_ref().and_then(|s| s.machine_name.clone()));
    if let Some(m) = &hint
        && let Some(cached) = ctx.machines.get(&ObjectRef::new(m).within(ns))
        && names_us(&cached)
    {
        return Ok(Some(cached));
    }
    let indexed = ctx.index.read(|i| i.bound_to(ns, &name).cloned());
    if let Some(m) = indexed
        && let Some(found) = ctx.machines.get(&ObjectRef::new(&m).within(ns))
        && names_us(&found)
    {
        return Ok(Some(found));
    }
    if let Some(m) = hint {
        let api: Api<Machine> = Api::namespaced(ctx.client.clone(), ns);
        match api.get_opt(&m).await? {
            Some(live) if names_us(&live) => return Ok(Some(Arc::new(live))),
            _ => {
                ctx.recent
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&ck);
            }
        }
    }
    Ok(None)
}

async fn apply(claim: &MachineClaim, ctx: &Context) -> Result<Action, ClaimError> {
    wait_ready(ctx).await?;
    let ns = claim.namespace().ok_or(ClaimError::NoNamespace)?;
    let status = ctx.current_status(claim);
    if status.phase == Some(ClaimPhase::Failed) {
        return Ok(Action::await_change());
    }

    if let Some(machine) = bound_machine(claim, &ns, ctx).await? {
        write_bound(claim, &machine, ctx).await?;
        return Ok(Action::requeue(Duration::from_secs(600)));
    }
    if status.phase == Some(ClaimPhase::Bound) {
        // The machine let go of us (claimRef cleared or machine deleted).
        write_pending(
            claim,
            reasons::MACHINE_RELEASED,
            "the bound machine no longer names this claim",
            ctx,
        )
        .await?;
    }

    let invalid = match invalid(claim) {
        Some(problem) => Some(problem),
        None => image_problem(claim, &ns, ctx).await?,
    };
    if let Some((reason, message)) = invalid {
        write_pending(claim, reason, &message, ctx).await?;
        return Ok(Action::await_change());
    }

    if let Some(name) = claim.spec.machine_name.clone() {
        return bind_named(claim, &ns, &name, ctx).await;
    }
    bind_selected(claim, &ns, ctx).await
}

/// Spec rules CEL cannot express (checked before binding).
fn invalid(claim: &MachineClaim) -> Option<(&'static str, String)> {
    let mut hints = Vec::new();
    if claim.spec.image_ref.is_some()
        && let Some(t) = &claim.spec.target_disk
    {
        hints.push(("spec.targetDisk".to_string(), t));
    }
    for (i, d) in claim.spec.data_images.iter().enumerate() {
        hints.push((format!("spec.dataImages[{i}].targetDisk"), &d.target_disk));
    }
    for (i, (a_name, a)) in hints.iter().enumerate() {
        for (b_name, b) in hints.iter().skip(i + 1) {
            if a == b {
                return Some((
                    reasons::DUPLICATE_DISK_HINTS,
                    format!(
                        "{a_name} and {b_name} are identical hints: the disks of a claim must differ"
                    ),
                ));
            }
        }
    }
    None
}

/// `spec.imageRef` must name a bootable Image and every data image a
/// non-bootable one (when they exist; a missing Image is the deploy's
/// concern, not the bind's).
async fn image_problem(
    claim: &MachineClaim,
    ns: &str,
    ctx: &Context,
) -> Result<Option<(&'static str, String)>, ClaimError> {
    let get = |r: &anneal_api::NameRef| {
        let api: Api<anneal_api::Image> = Api::namespaced(ctx.client.clone(), r.namespace_or(ns));
        let name = r.name.clone();
        async move { api.get_opt(&name).await }
    };
    if let Some(r) = &claim.spec.image_ref
        && let Some(image) = get(r).await?
        && !image.spec.bootable
    {
        return Ok(Some((
            reasons::IMAGE_NOT_BOOTABLE,
            format!(
                "spec.imageRef: Image {} is not bootable; deploy it as a data image",
                r.name
            ),
        )));
    }
    for (i, d) in claim.spec.data_images.iter().enumerate() {
        if let Some(image) = get(&d.image_ref).await?
            && image.spec.bootable
        {
            return Ok(Some((
                reasons::DATA_IMAGE_BOOTABLE,
                format!(
                    "spec.dataImages[{i}].imageRef: Image {} is bootable; name it in spec.imageRef",
                    d.image_ref.name
                ),
            )));
        }
    }
    Ok(None)
}

async fn bind_named(
    claim: &MachineClaim,
    ns: &str,
    name: &str,
    ctx: &Context,
) -> Result<Action, ClaimError> {
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), ns);
    let mut machine = match ctx.machines.get(&ObjectRef::new(name).within(ns)) {
        Some(m) => (*m).clone(),
        None => match api.get_opt(name).await? {
            Some(m) => m,
            None => {
                write_failed(claim, name, ctx).await?;
                return Ok(Action::await_change());
            }
        },
    };
    for _ in 0..5 {
        if let Err(skip) = select::check_named(&machine, claim) {
            let message = format!("machine {name}: {}", describe(skip));
            write_pending(claim, skip.reason(), &message, ctx).await?;
            return Ok(Action::requeue(Duration::from_secs(300)));
        }
        match try_bind(&machine, claim, ns, ctx).await? {
            Some(bound) => {
                write_bound(claim, &bound, ctx).await?;
                return Ok(Action::requeue(Duration::from_secs(600)));
            }
            None => {
                // 409: read the machine again and re-check.
                match api.get_opt(name).await? {
                    Some(m) => machine = m,
                    None => {
                        write_failed(claim, name, ctx).await?;
                        return Ok(Action::await_change());
                    }
                }
            }
        }
    }
    Ok(Action::requeue(Duration::from_millis(200)))
}

async fn bind_selected(
    claim: &MachineClaim,
    ns: &str,
    ctx: &Context,
) -> Result<Action, ClaimError> {
    let ck = key(ns, &claim.name_any());
    let taken: std::collections::HashSet<String> = {
        let mut taken = ctx.taken.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        taken.retain(|_, at| now.saturating_duration_since(*at) < TAKEN_TTL);
        taken.keys().cloned().collect()
    };
    let mut candidates = free_candidates(claim, ns, &ck, &taken, ctx);
    if !candidates.is_empty() {
        for m in candidates {
            if !ctx.reserve(ns, &m.name_any()) {
                continue;
            }
            if let Some(bound) = try_bind(&m, claim, ns, ctx).await? {
                write_bound(claim, &bound, ctx).await?;
                return Ok(Action::requeue(Duration::from_secs(600)));
            }
        }
        // Every candidate was taken under us: look again shortly.
        return Ok(Action::requeue(Duration::from_millis(100)));
    }
    // No free machine fits: scan them all once to say why.
    let mut skips = BTreeMap::new();
    let mut machines: Vec<Arc<Machine>> = ctx
        .machines
        .state()
        .into_iter()
        .filter(|m| m.namespace().as_deref() == Some(ns))
        .collect();
    machines.sort_by_key(|m| m.name_any());
    for m in machines {
        let name = m.name_any();
        let hw = ctx.hardware.get(&ObjectRef::new(&name).within(ns));
        match select::check_selected(&m, hw.as_deref(), claim) {
            Ok(()) if taken.contains(&key(ns, &name)) => {
                skips.insert(name, Skip::Claimed);
            }
            Ok(()) => candidates.push(m),
            Err(skip) => {
                skips.insert(name, skip);
            }
        }
    }
    if candidates.is_empty() {
        let (reason, message) = match select::best_reason(&skips) {
            Some(Skip::Claimed) if !taken.is_empty() => {
                // Machines are in flux: look again soon.
                write_pending(
                    claim,
                    reasons::NO_MATCHING_MACHINE,
                    "every matching machine is bound",
                    ctx,
                )
                .await?;
                return Ok(Action::requeue(Duration::from_millis(500)));
            }
            Some(skip) => (
                reasons::NO_MATCHING_MACHINE,
                format!(
                    "no machine matches the selector; closest: {}",
                    describe(skip)
                ),
            ),
            None => (
                reasons::NO_MATCHING_MACHINE,
                "no machines in the namespace".to_string(),
            ),
        };
        write_pending(claim, reason, &message, ctx).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    }
    select::rotate(&mut candidates, &ck);
    for m in candidates {
        if !ctx.reserve(ns, &m.name_any()) {
            continue;
        }
        if let Some(bound) = try_bind(&m, claim, ns, ctx).await? {
            write_bound(claim, &bound, ctx).await?;
            return Ok(Action::requeue(Duration::from_secs(600)));
        }
    }
    // Every candidate was taken under us: re-list from the cache shortly.
    Ok(Action::requeue(Duration::from_millis(100)))
}

fn describe(skip: Skip) -> &'static str {
    match skip {
        Skip::Claimed => "bound to another claim",
        Skip::Deleting => "being deleted",
        Skip::Cordoned => "cordoned (spec.unclaimable)",
        Skip::Tainted => "carries a taint this claim does not tolerate",
        Skip::NotAvailable => "not in a state that admits a claim",
        Skip::LabelMismatch => "labels do not match",
        Skip::NoHardware => "no MachineHardware reported yet",
        Skip::HardwareBelowFloor => "hardware below the selector's floors",
    }
}

/// At most this many candidates are tried per reconcile.
const MAX_CANDIDATES: usize = 8;

/// Up to [`MAX_CANDIDATES`] free machines of `ns` the claim's selector
/// accepts, from the index: starting at a per-claim position of the free
/// set (so concurrent claims start at different machines) and wrapping
/// around. Cost: the free machines skipped, not every Machine (nor the
/// ones before the start).
fn free_candidates(
    claim: &MachineClaim,
    ns: &str,
    ck: &str,
    taken: &std::collections::HashSet<String>,
    ctx: &Context,
) -> Vec<Arc<Machine>> {
    ctx.index.read(|i| {
        let Some(free) = i.free(ns) else {
            return Vec::new();
        };
        let start = select::offset(free.len(), ck);
        let mut out = Vec::new();
        for name in free.iter_from(start) {
            if taken.contains(&key(ns, name)) {
                continue;
            }
            let Some(m) = ctx.machines.get(&ObjectRef::new(name).within(ns)) else {
                continue;
            };
            let hw = ctx.hardware.get(&ObjectRef::new(name).within(ns));
            if select::check_selected(&m, hw.as_deref(), claim).is_ok() {
                out.push(m);
                if out.len() == MAX_CANDIDATES {
                    break;
                }
            }
        }
        out
    })
}

/// The bind: one merge patch of `spec.claimRef` carrying the resourceVersion
/// we read. `Ok(None)` on 409 Conflict.
async fn try_bind(
    machine: &Machine,
    claim: &MachineClaim,
    ns: &str,
    ctx: &Context,
) -> Result<Option<Machine>, ClaimError> {
    let name = machine.name_any();
    let Some(rv) = machine.resource_version() else {
        return Ok(None);
    };
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), ns);
    let patch = json!({
        "metadata": {"resourceVersion": rv},
        "spec": {"claimRef": {"name": claim.name_any(), "namespace": ns}},
    });
    match api
        .patch(&name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
        .await
    {
        Ok(bound) => {
            ctx.metrics.binds.inc();
            let now = Instant::now();
            ctx.taken
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key(ns, &name), now);
            ctx.recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key(ns, &claim.name_any()), (name.clone(), now));
            info!(claim = %claim.name_any(), machine = %name, namespace = ns, "bound");
            Ok(Some(bound))
        }
        Err(e) if is_conflict(&e) => {
            ctx.metrics.bind_conflicts.inc();
            ctx.taken
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key(ns, &name), Instant::now());
            debug!(claim = %claim.name_any(), machine = %name, "bind conflict");
            Ok(None)
        }
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

async fn patch_status(
    claim: &MachineClaim,
    status: &MachineClaimStatus,
    ctx: &Context,
) -> Result<(), ClaimError> {
    let current = ctx.current_status(claim);
    if &current == status {
        return Ok(());
    }
    let ns = claim.namespace().ok_or(ClaimError::NoNamespace)?;
    let api: Api<MachineClaim> = Api::namespaced(ctx.client.clone(), &ns);
    // A merge patch only removes what it names as null.
    let mut new = serde_json::to_value(status).unwrap_or_default();
    if let (Ok(old), Some(obj)) = (serde_json::to_value(&current), new.as_object_mut())
        && let Some(old) = old.as_object()
    {
        for k in old.keys() {
            obj.entry(k.clone()).or_insert(serde_json::Value::Null);
        }
    }
    let patch = json!({"status": new});
    match api
        .patch_status(
            &claim.name_any(),
            &patch_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => {
            ctx.note_written(claim, status);
            Ok(())
        }
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The Events' action (what the controller did), not a reason.
const ACTION: &str = "Bind";

async fn event(
    ctx: &Context,
    obj: &impl Resource<DynamicType = ()>,
    type_: EventType,
    reason: &str,
    note: String,
) {
    crate::controller::publish_event(&ctx.recorder, obj, type_, ACTION, reason, note);
}

async fn write_bound(
    claim: &MachineClaim,
    machine: &Machine,
    ctx: &Context,
) -> Result<(), ClaimError> {
    let old = ctx.current_status(claim);
    let mut status = old.clone();
    let generation = claim.metadata.generation;
    let name = machine.name_any();
    let newly = old.phase != Some(ClaimPhase::Bound) || old.machine_name.as_deref() != Some(&name);
    status.phase = Some(ClaimPhase::Bound);
    status.machine_name = Some(name.clone());
    if newly || status.bound_at.is_none() {
        status.bound_at = Some(Time(Timestamp::now()));
    }
    status.observed_generation = generation;
    conditions::set(
        &mut status.conditions,
        "Valid",
        true,
        "Valid",
        "spec is valid",
        generation,
    );
    conditions::set(
        &mut status.conditions,
        "Bound",
        true,
        "Bound",
        format!("bound to machine {name}"),
        generation,
    );
    let state = machine.status.as_ref().and_then(|s| s.state);
    let (ready, reason, message) = match state {
        Some(MachineState::Provisioned) => (
            true,
            reasons::PROVISIONED,
            "the machine is provisioned".to_string(),
        ),
        Some(s) => (false, reasons::NOT_PROVISIONED, format!("machine is {s:?}")),
        None => (
            false,
            reasons::NOT_PROVISIONED,
            "machine state unknown".to_string(),
        ),
    };
    conditions::set(
        &mut status.conditions,
        types::READY,
        ready,
        reason,
        message,
        generation,
    );
    patch_status(claim, &status, ctx).await?;
    if newly {
        // once per bind: no need for the Recorder's cache of repeats
        crate::controller::publish_once(
            &ctx.client,
            &ctx.reporter,
            claim,
            EventType::Normal,
            ACTION,
            "Bound",
            format!("bound to machine {name}"),
        );
    }
    Ok(())
}

async fn write_pending(
    claim: &MachineClaim,
    reason: &str,
    message: &str,
    ctx: &Context,
) -> Result<(), ClaimError> {
    let old = ctx.current_status(claim);
    let mut status = old.clone();
    let generation = claim.metadata.generation;
    status.phase = Some(ClaimPhase::Pending);
    status.machine_name = None;
    status.bound_at = None;
    status.observed_generation = generation;
    let valid = !matches!(
        reason,
        reasons::DUPLICATE_DISK_HINTS | reasons::IMAGE_NOT_BOOTABLE | reasons::DATA_IMAGE_BOOTABLE
    );
    conditions::set(
        &mut status.conditions,
        "Valid",
        valid,
        if valid { "Valid" } else { reason },
        if valid { "spec is valid" } else { message },
        generation,
    );
    let prev_reason = old
        .conditions
        .iter()
        .find(|c| c.type_ == "Bound")
        .map(|c| c.reason.clone());
    conditions::set(
        &mut status.conditions,
        "Bound",
        false,
        reason,
        message,
        generation,
    );
    conditions::set(
        &mut status.conditions,
        types::READY,
        false,
        reasons::NOT_BOUND,
        "the claim is not bound",
        generation,
    );
    patch_status(claim, &status, ctx).await?;
    if prev_reason.as_deref() != Some(reason) {
        let type_ = if valid {
            EventType::Normal
        } else {
            EventType::Warning
        };
        event(ctx, claim, type_, reason, message.to_string()).await;
    }
    Ok(())
}

async fn write_failed(claim: &MachineClaim, name: &str, ctx: &Context) -> Result<(), ClaimError> {
    let mut status = ctx.current_status(claim);
    let generation = claim.metadata.generation;
    let message = format!("machine {name} does not exist");
    status.phase = Some(ClaimPhase::Failed);
    status.machine_name = None;
    status.observed_generation = generation;
    conditions::set(
        &mut status.conditions,
        "Bound",
        false,
        reasons::MACHINE_NOT_FOUND,
        &message,
        generation,
    );
    conditions::set(
        &mut status.conditions,
        types::READY,
        false,
        reasons::NOT_BOUND,
        "the claim is not bound",
        generation,
    );
    patch_status(claim, &status, ctx).await?;
    event(
        ctx,
        claim,
        EventType::Warning,
        reasons::MACHINE_NOT_FOUND,
        message,
    )
    .await;
    Ok(())
}

async fn cleanup(claim: &MachineClaim, ctx: &Context) -> Result<Action, ClaimError> {
    wait_ready(ctx).await?;
    let ns = claim.namespace().ok_or(ClaimError::NoNamespace)?;
    let Some(machine) = bound_machine(claim, &ns, ctx).await? else {
        return Ok(Action::await_change());
    };
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &ns);
    let name = machine.name_any();
    // Always work on a fresh copy: the release is two guarded writes.
    let Some(mut live) = api.get_opt(&name).await? else {
        return Ok(Action::await_change());
    };
    let claim_name = claim.name_any();
    if !live
        .spec
        .claim_ref
        .as_ref()
        .is_some_and(|r| select::ref_names(r, &ns, &ns, &claim_name))
    {
        return Ok(Action::await_change());
    }
    if live.status.as_ref().and_then(|s| s.state) == Some(MachineState::Parked) {
        // Parked: every controller stands down; the release (and a Recycle's
        // wipe) waits for `unpark` (docs/troubleshooting.md,
        // "ReleaseWaitsForUnpark")
        let message = format!(
            "claim {claim_name} was deleted while Machine {name} is Parked: the release waits until it is unparked (kubectl anneal unpark {name})"
        );
        info!(claim = %claim_name, machine = %name, "release waits for unpark");
        // the recorder folds the repeats into one Event's count
        event(
            ctx,
            claim,
            EventType::Warning,
            reasons::RELEASE_WAITS_FOR_UNPARK,
            message,
        )
        .await;
        // an error keeps the finalizer (Ok would let the claim go)
        return Err(ClaimError::WaitsForUnpark(name));
    }
    let (reason, message) = match live.spec.reclaim_policy {
        ReclaimPolicy::Retain => (
            reasons::RELEASED,
            format!(
                "claim {claim_name} was deleted; reclaimPolicy Retain keeps the disks until re-inspection"
            ),
        ),
        ReclaimPolicy::Recycle => (
            reasons::RECYCLE_PENDING,
            format!("claim {claim_name} was deleted; reclaimPolicy Recycle waits for the wipe"),
        ),
    };
    // 1. status.state = Released, guarded by resourceVersion.
    let mut status = live.status.clone().unwrap_or_default();
    status.state = Some(MachineState::Released);
    let generation = live.metadata.generation;
    conditions::set(
        &mut status.conditions,
        types::READY,
        false,
        reason,
        &message,
        generation,
    );
    let patch = json!({
        "metadata": {"resourceVersion": live.resource_version()},
        "status": status,
    });
    live = match api
        .patch_status(&name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
        .await
    {
        Ok(m) => m,
        Err(e) if is_conflict(&e) => return Err(ClaimError::ReleaseConflict(name)),
        Err(e) => return Err(e.into()),
    };
    // 2. clear spec.claimRef under the same lock.
    let patch = json!({
        "metadata": {"resourceVersion": live.resource_version()},
        "spec": {"claimRef": null},
    });
    match api
        .patch(&name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
        .await
    {
        Ok(released) => {
            ctx.metrics.releases.inc();
            ctx.recent
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key(&ns, &claim_name));
            info!(claim = %claim_name, machine = %name, reason, "released");
            event(ctx, &released, EventType::Normal, reason, message).await;
            Ok(Action::await_change())
        }
        Err(e) if is_conflict(&e) => Err(ClaimError::ReleaseConflict(name)),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_is_sent_to_one_bind_at_a_time() {
        let mut taken = HashMap::new();
        let t0 = Instant::now();
        assert!(reserve(&mut taken, "default/m0".into(), t0));
        // a concurrent claim from the same snapshot skips it: no 409 write
        assert!(!reserve(&mut taken, "default/m0".into(), t0));
        assert!(reserve(&mut taken, "default/m1".into(), t0));
        // once the note is stale (the bind failed without a trace), again
        assert!(reserve(&mut taken, "default/m0".into(), t0 + TAKEN_TTL));
    }
}
