//! The pure decisions of the Cluster API provider: from a snapshot of an
//! AnnealMachine and what it depends on (its Cluster API Machine's
//! bootstrap Secret name, its MachineClaim, the bound anneal Machine, the
//! claim's DeployRuns, the Machine's DHCP reservation) to the claim to
//! create or patch, the providerID to write and the status to hold. No I/O:
//! unit-tested without an API server.

use std::time::Duration;

use anneal_api::capi::{
    AnnealCluster, AnnealClusterStatus, AnnealMachine, AnnealMachineSpec, AnnealMachineStatus,
    BOOTSTRAP_DATA_KEY, Initialization, MachineAddress, parse_provider_id, provider_id, reasons,
};
use anneal_api::conditions::types;
use anneal_api::{
    ClaimPhase, DeployRun, Machine, MachineClaim, MachineClaimSpec, MachineState, NameRef,
    RunPhase, SecretDataRef,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};

use crate::conditions;

/// Requeue while something outside the watched kinds may change (a
/// Subnet's reservations, a Machine's BMC).
pub const RECHECK: Duration = Duration::from_secs(300);
/// Requeue while waiting for a deploy to move.
pub const WAITING: Duration = Duration::from_secs(60);

/// What the Cluster API Machine owning an AnnealMachine says about the
/// bootstrap data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bootstrap {
    /// No owner reference of kind Machine (group cluster.x-k8s.io) yet.
    NoOwner,
    /// The owner reference names a Machine that does not exist (yet).
    OwnerMissing(String),
    /// The owner exists; `spec.bootstrap.dataSecretName` is not set yet.
    NotReady(String),
    /// The bootstrap data Secret's name.
    Ready(String),
}

/// Everything one AnnealMachine decision reads.
#[derive(Clone, Copy, Debug)]
pub struct Snapshot<'a> {
    /// The AnnealMachine.
    pub am: &'a AnnealMachine,
    /// Its Cluster API Machine's bootstrap data.
    pub bootstrap: &'a Bootstrap,
    /// The MachineClaim of its name, if any.
    pub claim: Option<&'a MachineClaim>,
    /// The anneal Machine the claim's status names, if any.
    pub machine: Option<&'a Machine>,
    /// The Machine's current DeployRun (`currentRunRef`, else
    /// `lastAttemptedRunRef`), if any.
    pub current_run: Option<&'a DeployRun>,
    /// The Machine's last successful DeployRun, if any.
    pub last_success: Option<&'a DeployRun>,
    /// The Machine's address in its Subnet's `status.dhcp.reservations`.
    pub reservation: Option<&'a str>,
    /// The anneal Machine `spec.providerID` names, read only when the
    /// providerID is set and the claim of its name is not its own (a moved
    /// AnnealMachine, `clusterctl move`); None when it does not exist.
    pub provider_machine: Option<&'a Machine>,
}

/// What to do with the MachineClaim.
#[derive(Clone, Debug)]
pub enum ClaimAction {
    /// Nothing.
    Keep,
    /// Create this claim.
    Create(Box<MachineClaim>),
    /// Make the claim's spec this one (a merge patch of the difference).
    Sync(Box<MachineClaimSpec>),
    /// Take the existing claim over (a moved AnnealMachine): its
    /// `metadata.ownerReferences` become these, under its resourceVersion;
    /// its spec is left as it is.
    TakeOver(Vec<OwnerReference>),
}

/// The adoption record a moved AnnealMachine writes on the anneal Machine
/// (`status.adopted`) before it creates the claim: the claim's first
/// generation counts as deployed, so binding it plans no DeployRun and
/// changes no power.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adopt {
    /// The anneal Machine (in the AnnealMachine's namespace).
    pub machine: String,
    /// The claim it is adopted for.
    pub claim: String,
    /// The generation the new claim gets (1).
    pub claim_generation: i64,
}

/// The outcome of one AnnealMachine decision.
#[derive(Clone, Debug)]
pub struct Decision {
    /// The claim to create or bring in line.
    pub claim: ClaimAction,
    /// `spec.providerID` to write (only when unset).
    pub provider_id: Option<String>,
    /// `status.adopted` to write on the anneal Machine, before the claim
    /// is created.
    pub adopt: Option<Adopt>,
    /// The message of an `AdoptedProvisionedClaim` Event, once the claim
    /// action is done.
    pub adopted_event: Option<String>,
    /// The status to hold.
    pub status: AnnealMachineStatus,
    /// When to look again.
    pub requeue: Duration,
}

/// The claim spec an AnnealMachine asks for, with `user_data` (the
/// bootstrap data Secret, key `value`). A claim field the AnnealMachine does
/// not carry (yet) keeps its default.
#[allow(clippy::needless_update)]
pub fn claim_spec(spec: &AnnealMachineSpec, user_data: Option<SecretDataRef>) -> MachineClaimSpec {
    MachineClaimSpec {
        machine_name: spec.machine_name.clone(),
        selector: spec.selector.clone(),
        tolerations: spec.tolerations.clone(),
        image_ref: spec.image_ref.clone(),
        data_images: spec.data_images.clone(),
        target_disk: spec.target_disk.clone(),
        post_hook_refs: spec.post_hook_refs.clone(),
        params: spec.params.clone(),
        transfer: spec.transfer.clone(),
        after_deploy: spec.after_deploy,
        deploy_deadline: spec.deploy_deadline.clone(),
        user_data,
        network_data: spec.network_data.clone(),
        meta_data: spec.meta_data.clone(),
        ..MachineClaimSpec::default()
    }
}

/// The user data reference of a bootstrap Secret.
pub fn bootstrap_user_data(secret: &str) -> SecretDataRef {
    SecretDataRef {
        name: secret.to_string(),
        key: Some(BOOTSTRAP_DATA_KEY.to_string()),
    }
}

/// The owner reference a claim gets: the AnnealMachine, as controller,
/// blocking its deletion.
pub fn owner_reference(am: &AnnealMachine) -> Option<OwnerReference> {
    Some(OwnerReference {
        block_owner_deletion: Some(true),
        ..am.controller_owner_ref(&())?
    })
}

/// Whether `claim` is `am`'s own (an owner reference with its UID).
pub fn owns(am: &AnnealMachine, claim: &MachineClaim) -> bool {
    let Some(uid) = am.metadata.uid.as_deref() else {
        return false;
    };
    claim.owner_references().iter().any(|o| o.uid == uid)
}

/// The claim `am` creates: same name and namespace, owned by it.
pub fn new_claim(am: &AnnealMachine, secret: &str) -> MachineClaim {
    claim_with(am, Some(bootstrap_user_data(secret)))
}

fn claim_with(am: &AnnealMachine, user_data: Option<SecretDataRef>) -> MachineClaim {
    let mut claim = MachineClaim::new(&am.name_any(), claim_spec(&am.spec, user_data));
    claim.metadata.namespace = am.namespace();
    claim.metadata.owner_references = owner_reference(am).map(|o| vec![o]);
    // the Cluster API labels (cluster name, ...) follow the claim
    let labels: std::collections::BTreeMap<String, String> = am
        .labels()
        .iter()
        .filter(|(k, _)| k.starts_with("cluster.x-k8s.io/"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !labels.is_empty() {
        claim.metadata.labels = Some(labels);
    }
    claim
}

/// The Machine's addresses: the static addresses of the generated network
/// data and the DHCP reservation as `InternalIP` (each once, in that
/// order), then the hostname (`spec.metaData.hostname`, else the Machine's
/// name) as `Hostname`.
pub fn addresses(
    spec: &AnnealMachineSpec,
    machine: &str,
    reservation: Option<&str>,
) -> Vec<MachineAddress> {
    let mut ips: Vec<String> = Vec::new();
    if let Some(nd) = &spec.network_data {
        let links = nd
            .ethernets
            .iter()
            .map(|e| &e.addressing)
            .chain(nd.bonds.iter().map(|b| &b.addressing))
            .chain(nd.vlans.iter().map(|v| &v.addressing));
        for a in links.flat_map(|a| a.addresses.iter()) {
            let ip = a.split('/').next().unwrap_or(a).trim();
            if !ip.is_empty() && !ips.iter().any(|i| i == ip) {
                ips.push(ip.to_string());
            }
        }
    }
    if let Some(r) = reservation
        && !ips.iter().any(|i| i == r)
    {
        ips.push(r.to_string());
    }
    let mut out: Vec<MachineAddress> = ips
        .into_iter()
        .map(|address| MachineAddress {
            type_: "InternalIP".into(),
            address,
        })
        .collect();
    let hostname = spec
        .meta_data
        .as_ref()
        .and_then(|m| m.hostname.clone())
        .unwrap_or_else(|| machine.to_string());
    out.push(MachineAddress {
        type_: "Hostname".into(),
        address: hostname,
    });
    out
}

fn run_is_for(run: &DeployRun, claim: &MachineClaim) -> bool {
    let ns = claim.namespace().unwrap_or_default();
    run.spec.claim_ref.name == claim.name_any() && run.spec.claim_ref.namespace_or(&ns) == ns
}

/// Whether `machine` is Provisioned for `claim`'s intent: bound both ways,
/// state Provisioned with no run in flight, and either its last successful
/// run served this claim or it was adopted for this claim's generation.
pub fn provisioned_for(
    machine: &Machine,
    claim: &MachineClaim,
    last_success: Option<&DeployRun>,
) -> bool {
    let Some(st) = machine.status.as_ref() else {
        return false;
    };
    if st.state != Some(MachineState::Provisioned)
        || st.current_run_ref.is_some()
        || !crate::claims::select::binding_holds(machine, claim)
        || claim.status.as_ref().and_then(|s| s.phase) != Some(ClaimPhase::Bound)
    {
        return false;
    }
    let adopted = st.adopted.as_ref().is_some_and(|a| {
        a.claim == claim.name_any() && Some(a.claim_generation) == claim.metadata.generation
    });
    let deployed = st
        .last_successful_run_ref
        .as_ref()
        .zip(last_success)
        .is_some_and(|(r, run)| r.name == run.name_any() && run_is_for(run, claim));
    adopted || deployed
}

/// The claim spec `am` wants of its existing `claim`: [`claim_spec`];
/// once provisioned (`spec.providerID` set) the claim's choice of Machine
/// (`machineName` | `selector`) stays as it is (a moved AnnealMachine's
/// claim names its Machine while the spec may carry a template's
/// selector).
fn wanted_spec(
    am: &AnnealMachine,
    claim: &MachineClaim,
    user_data: Option<SecretDataRef>,
) -> MachineClaimSpec {
    let mut want = claim_spec(&am.spec, user_data);
    if am.spec.provider_id.is_some() {
        want.machine_name.clone_from(&claim.spec.machine_name);
        want.selector.clone_from(&claim.spec.selector);
    }
    want
}

/// Whether every owner reference of `claim` names a former `am` (an
/// AnnealMachine of its name and namespace with another UID: names are
/// unique, so that object is gone), or it has none.
fn left_by_former_self(am: &AnnealMachine, claim: &MachineClaim) -> bool {
    let name = am.name_any();
    claim.owner_references().iter().all(|o| {
        o.kind == "AnnealMachine"
            && o.api_version.split('/').next() == Some(anneal_api::capi::GROUP)
            && o.name == name
    })
}

/// A moved AnnealMachine (`clusterctl move`: `spec.providerID` set, the
/// claim of its name absent or not its own): the anneal Machine the
/// providerID names is taken over, never deployed. With no claim: the
/// Machine must be Provisioned with no run in flight, free or bound to a
/// claim of this name; its `status.adopted` is written for the claim's
/// first generation, then the claim (`machineName` = that Machine, owned)
/// is created, so binding it plans no DeployRun. With a claim bound to that
/// Machine, left by a former AnnealMachine of this name (or by no owner)
/// and asking for the same: its owner references become this
/// AnnealMachine's. Otherwise nothing is created or touched.
fn moved(
    s: &Snapshot<'_>,
    id: &str,
    out: &mut Decision,
    mut status: AnnealMachineStatus,
    now: Timestamp,
) -> AnnealMachineStatus {
    let am = s.am;
    let name = am.name_any();
    let generation = am.metadata.generation;
    let ns = am.namespace().unwrap_or_default();
    let set = |status: &mut AnnealMachineStatus, reason: &str, msg: String| {
        conditions::set_at(
            &mut status.conditions,
            types::READY,
            false,
            reason,
            msg,
            generation,
            now,
        );
    };
    status.ready = Some(false);
    let target = parse_provider_id(id);
    let (Some((_, mname)), Some(machine)) = (
        target.filter(|(n, _)| *n == ns),
        s.provider_machine
            .filter(|_| target.is_some_and(|(n, _)| n == ns)),
    ) else {
        status.claim_ref = None;
        status.machine_ref = None;
        let msg = match target {
            Some((n, m)) if n == ns => format!(
                "spec.providerID {id} names anneal Machine {n}/{m}, which does not exist; \
                 nothing is created"
            ),
            Some((n, m)) => format!(
                "spec.providerID {id} names anneal Machine {n}/{m}, not of namespace {ns} \
                 (a claim binds only Machines of its own namespace); nothing is created"
            ),
            None => format!(
                "spec.providerID {id} names no anneal Machine (anneal://<namespace>/<machine>); \
                 nothing is created"
            ),
        };
        set(&mut status, reasons::PROVIDER_ID_NOT_FOUND, msg);
        return status;
    };
    let secret = match s.bootstrap {
        Bootstrap::Ready(secret) => Some(bootstrap_user_data(secret)),
        _ => None,
    };
    let Some(claim) = s.claim else {
        let mst = machine.status.clone().unwrap_or_default();
        let free = machine
            .spec
            .claim_ref
            .as_ref()
            .is_none_or(|r| r.name == name && r.namespace_or(&ns) == ns);
        let idle = mst.state == Some(MachineState::Provisioned)
            && mst.current_run_ref.is_none()
            && machine.metadata.deletion_timestamp.is_none();
        if !free || !idle {
            status.claim_ref = None;
            status.machine_ref = None;
            let state = mst
                .state
                .map_or_else(|| "unknown".to_string(), |s| format!("{s:?}"));
            let why = match (&machine.spec.claim_ref, &mst.current_run_ref) {
                (Some(r), _) if !free => format!("bound to MachineClaim {}", r.name),
                (_, Some(r)) => format!("{state}, DeployRun {} in flight", r.name),
                _ if machine.metadata.deletion_timestamp.is_some() => "being deleted".into(),
                _ => state,
            };
            set(
                &mut status,
                reasons::MACHINE_NOT_ADOPTABLE,
                format!(
                    "spec.providerID {id}: Machine {mname} is {why}; a moved AnnealMachine takes \
                     over only a Provisioned Machine with no run in flight, free or bound to a \
                     claim named {name}; nothing is created"
                ),
            );
            return status;
        }
        let mut c = claim_with(am, secret);
        c.spec.machine_name = Some(mname.to_string());
        c.spec.selector = None;
        out.claim = ClaimAction::Create(Box::new(c));
        out.adopt = Some(Adopt {
            machine: mname.to_string(),
            claim: name.clone(),
            claim_generation: 1,
        });
        out.adopted_event = Some(format!(
            "took over Machine {mname} ({id}) without a deploy: adopted for MachineClaim \
             {name}, created for it (no power change, no DeployRun)"
        ));
        status.claim_ref = Some(NameRef::new(&name));
        status.machine_ref = Some(NameRef::new(mname));
        set(
            &mut status,
            reasons::WAITING_FOR_MACHINE,
            format!(
                "taking over Machine {mname} ({id}) without a deploy: creating MachineClaim {name}"
            ),
        );
        return status;
    };
    let bound_there = claim
        .status
        .as_ref()
        .and_then(|c| c.machine_name.as_deref())
        == Some(mname)
        && crate::claims::select::binding_holds(machine, claim);
    let same = wanted_spec(am, claim, claim.spec.user_data.clone()) == claim.spec;
    let why = if claim.metadata.deletion_timestamp.is_some() {
        Some("is being deleted".to_string())
    } else if !left_by_former_self(am, claim) {
        Some("is owned by another object".to_string())
    } else if !bound_there {
        Some(format!(
            "is not bound to Machine {mname} (spec.providerID {id})"
        ))
    } else if !same {
        Some(
            "asks for another spec than this AnnealMachine (taking it over would redeploy)"
                .to_string(),
        )
    } else {
        None
    };
    if let Some(why) = why {
        status.claim_ref = None;
        status.machine_ref = None;
        set(
            &mut status,
            reasons::CLAIM_NAME_TAKEN,
            format!(
                "MachineClaim {name} exists and {why}: it is not taken over; delete or rename it"
            ),
        );
        return status;
    }
    out.claim = ClaimAction::TakeOver(owner_reference(am).into_iter().collect());
    out.adopted_event = Some(format!(
        "took over MachineClaim {name}, bound to Machine {mname} ({id}), without a deploy \
         (no power change, no DeployRun)"
    ));
    status.claim_ref = Some(NameRef::new(&name));
    status.machine_ref = Some(NameRef::new(mname));
    set(
        &mut status,
        reasons::WAITING_FOR_MACHINE,
        format!("taking over MachineClaim {name}, bound to Machine {mname} ({id})"),
    );
    status
}

fn condition_message(conds: &[anneal_api::Condition], type_: &str) -> Option<String> {
    conds
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.message.clone())
}

/// The setter of an AnnealMachine's `Ready` condition, for its `generation`
/// at `now`.
fn ready_setter(
    generation: Option<i64>,
    now: Timestamp,
) -> impl Fn(&mut AnnealMachineStatus, bool, &str, String) {
    move |status: &mut AnnealMachineStatus, ok: bool, reason: &str, msg: String| {
        conditions::set_at(
            &mut status.conditions,
            types::READY,
            ok,
            reason,
            msg,
            generation,
            now,
        );
    }
}

/// The decision for an AnnealMachine that is not being deleted; `now` is
/// the clock of condition transitions.
pub fn decide(s: &Snapshot<'_>, now: Timestamp) -> Decision {
    let am = s.am;
    let mut status = am.status.clone().unwrap_or_default();
    status.observed_generation = am.metadata.generation;
    let mut out = Decision {
        claim: ClaimAction::Keep,
        provider_id: None,
        adopt: None,
        adopted_event: None,
        status: AnnealMachineStatus::default(),
        requeue: RECHECK,
    };
    if let Some(id) = am.spec.provider_id.as_deref()
        && !s.claim.is_some_and(|c| owns(am, c))
    {
        // moved (`clusterctl move`): take the Machine over, never deploy
        out.requeue = WAITING;
        out.status = moved(s, id, &mut out, status, now);
        return out;
    }
    let secret = match s.bootstrap {
        Bootstrap::Ready(secret) => Some(secret.as_str()),
        _ => None,
    };
    out.status = match s.claim {
        None => without_claim(s, secret, &mut out, status, now),
        Some(claim) => with_claim(s, claim, secret, &mut out, status, now),
    };
    out
}

/// No claim of the AnnealMachine's name: it is created once the bootstrap
/// data (`secret`) exist, nothing before.
fn without_claim(
    s: &Snapshot<'_>,
    secret: Option<&str>,
    out: &mut Decision,
    mut status: AnnealMachineStatus,
    now: Timestamp,
) -> AnnealMachineStatus {
    let am = s.am;
    let name = am.name_any();
    let ready = ready_setter(am.metadata.generation, now);
    match secret {
        Some(secret) => {
            out.claim = ClaimAction::Create(Box::new(new_claim(am, secret)));
            status.claim_ref = Some(NameRef::new(&name));
            ready(
                &mut status,
                false,
                reasons::WAITING_FOR_MACHINE,
                format!("creating MachineClaim {name}"),
            );
            out.requeue = WAITING;
        }
        None => {
            let msg = match s.bootstrap {
                Bootstrap::NoOwner => {
                    "waiting for the Cluster API Machine to own this AnnealMachine".to_string()
                }
                Bootstrap::OwnerMissing(m) => {
                    format!("waiting for Cluster API Machine {m} (not found)")
                }
                _ => format!(
                    "waiting for the bootstrap data Secret of Cluster API Machine {} \
                     (spec.bootstrap.dataSecretName)",
                    owner_name(s.bootstrap)
                ),
            };
            status.ready = Some(false);
            ready(&mut status, false, reasons::WAITING_FOR_BOOTSTRAP_DATA, msg);
        }
    }
    status.ready.get_or_insert(false);
    status
}

/// The claim of the AnnealMachine's name exists (and the AnnealMachine is
/// not a moved one): if it is its own, its spec is kept in line and the
/// status follows the claim, its Machine and the Machine's deploy.
fn with_claim(
    s: &Snapshot<'_>,
    claim: &MachineClaim,
    secret: Option<&str>,
    out: &mut Decision,
    mut status: AnnealMachineStatus,
    now: Timestamp,
) -> AnnealMachineStatus {
    let am = s.am;
    let name = am.name_any();
    let ready = ready_setter(am.metadata.generation, now);
    if !owns(am, claim) {
        status.claim_ref = None;
        status.ready = Some(false);
        ready(
            &mut status,
            false,
            reasons::CLAIM_NAME_TAKEN,
            format!(
                "MachineClaim {name} exists and is not owned by this AnnealMachine; \
                 delete or rename it"
            ),
        );
        return status;
    }
    status.claim_ref = Some(NameRef::new(&name));
    // keep the claim's spec in line (the claim's own rules decide whether a
    // change redeploys); its user data stays as written when the owner is
    // not readable now, and always once provisioned (bootstrap data serve
    // the first boot: a moved AnnealMachine's new Secret never redeploys)
    let user_data = if am.spec.provider_id.is_some() {
        claim.spec.user_data.clone()
    } else {
        secret
            .map(bootstrap_user_data)
            .or_else(|| claim.spec.user_data.clone())
    };
    let want = wanted_spec(am, claim, user_data);
    if want != claim.spec {
        out.claim = ClaimAction::Sync(Box::new(want));
    }
    let cst = claim.status.clone().unwrap_or_default();
    let bound_conds = condition_message(&cst.conditions, types::BOUND).unwrap_or_default();
    match cst.phase {
        Some(ClaimPhase::Failed) => {
            status.ready = Some(false);
            status.machine_ref = None;
            ready(
                &mut status,
                false,
                reasons::CLAIM_FAILED,
                format!("MachineClaim {name} failed to bind: {bound_conds}"),
            );
            return status;
        }
        Some(ClaimPhase::Bound) => {}
        _ => {
            status.ready = Some(false);
            status.machine_ref = None;
            let detail = if bound_conds.is_empty() {
                "not bound yet".to_string()
            } else {
                bound_conds
            };
            ready(
                &mut status,
                false,
                reasons::WAITING_FOR_MACHINE,
                format!("MachineClaim {name}: {detail}"),
            );
            out.requeue = WAITING;
            return status;
        }
    }
    let Some(machine) = s.machine else {
        let m = cst.machine_name.unwrap_or_default();
        status.ready = Some(false);
        ready(
            &mut status,
            false,
            reasons::WAITING_FOR_MACHINE,
            format!("MachineClaim {name} is bound to Machine {m}, which is not readable yet"),
        );
        out.requeue = WAITING;
        return status;
    };
    let mname = machine.name_any();
    let ns = machine.namespace().unwrap_or_default();
    status.machine_ref = Some(NameRef::new(&mname));
    if provisioned_for(machine, claim, s.last_success) {
        let id = provider_id(&ns, &mname);
        if am.spec.provider_id.is_none() {
            out.provider_id = Some(id.clone());
        }
        status.initialization = Some(Initialization {
            provisioned: Some(true),
        });
        status.ready = Some(true);
        status.addresses = addresses(&am.spec, &mname, s.reservation);
        ready(
            &mut status,
            true,
            reasons::PROVISIONED,
            format!("Machine {mname} is provisioned for MachineClaim {name} ({id})"),
        );
        return status;
    }
    status.ready = Some(false);
    out.requeue = WAITING;
    not_provisioned_yet(s, claim, machine, &mut status, now);
    status
}

/// `Ready` False for a claim bound to `machine` that is not provisioned
/// for it yet: its DeployRun failed, its BMC does not answer, or its state
/// (and deploy progress).
fn not_provisioned_yet(
    s: &Snapshot<'_>,
    claim: &MachineClaim,
    machine: &Machine,
    status: &mut AnnealMachineStatus,
    now: Timestamp,
) {
    let ready = ready_setter(s.am.metadata.generation, now);
    let mname = machine.name_any();
    let mst = machine.status.clone().unwrap_or_default();
    if let Some(run) = s.current_run.filter(|r| run_is_for(r, claim))
        && run.status.as_ref().and_then(|st| st.phase) == Some(RunPhase::Failed)
    {
        let msg = run
            .status
            .as_ref()
            .and_then(|st| condition_message(&st.conditions, types::SUCCEEDED))
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| "no message".to_string());
        ready(
            status,
            false,
            reasons::DEPLOYMENT_FAILED,
            format!("DeployRun {} failed: {msg}", run.name_any()),
        );
    } else if let Some(c) = mst
        .conditions
        .iter()
        .find(|c| c.type_ == types::BMC_REACHABLE && c.status == "False")
    {
        ready(
            status,
            false,
            reasons::WAITING_FOR_BMC,
            format!(
                "Machine {mname}: the BMC does not answer ({}: {})",
                c.reason, c.message
            ),
        );
    } else {
        let state = mst
            .state
            .map_or_else(|| "unknown".to_string(), |s| format!("{s:?}"));
        let progress = mst
            .deploy
            .as_ref()
            .and_then(|d| d.percent)
            .map(|p| format!(", deploy {p}%"))
            .unwrap_or_default();
        ready(
            status,
            false,
            reasons::PROVISIONING,
            format!("Machine {mname} is {state}{progress}"),
        );
    }
}

fn owner_name(b: &Bootstrap) -> &str {
    match b {
        Bootstrap::OwnerMissing(m) | Bootstrap::NotReady(m) | Bootstrap::Ready(m) => m,
        Bootstrap::NoOwner => "",
    }
}

/// What deleting an AnnealMachine does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cleanup {
    /// Delete its claim (the anneal Machine's reclaimPolicy then decides
    /// Retain or Recycle).
    DeleteClaim,
    /// The claim is being deleted: wait for it to go.
    WaitForClaim,
    /// No claim of its own is left: remove the finalizer.
    Done,
}

/// The next step of deleting `am`, whose claim (of its name) is `claim`.
pub fn decide_cleanup(am: &AnnealMachine, claim: Option<&MachineClaim>) -> Cleanup {
    match claim {
        Some(c) if owns(am, c) => {
            if c.metadata.deletion_timestamp.is_some() {
                Cleanup::WaitForClaim
            } else {
                Cleanup::DeleteClaim
            }
        }
        _ => Cleanup::Done,
    }
}

/// The status of a deleting AnnealMachine waiting for its claim.
pub fn deleting_status(
    am: &AnnealMachine,
    claim: &MachineClaim,
    now: Timestamp,
) -> AnnealMachineStatus {
    let mut status = am.status.clone().unwrap_or_default();
    status.ready = Some(false);
    let machine = claim
        .status
        .as_ref()
        .and_then(|s| s.machine_name.clone())
        .map(|m| format!(" (Machine {m}: its reclaimPolicy decides Retain or Recycle)"))
        .unwrap_or_default();
    conditions::set_at(
        &mut status.conditions,
        types::READY,
        false,
        reasons::DELETING,
        format!(
            "deleting: waiting for MachineClaim {} to be released{machine}",
            claim.name_any()
        ),
        am.metadata.generation,
        now,
    );
    status
}

/// The status of an AnnealCluster: provisioned once
/// `spec.controlPlaneEndpoint.host` is set (never back to false).
pub fn decide_cluster(c: &AnnealCluster, now: Timestamp) -> AnnealClusterStatus {
    let mut status = c.status.clone().unwrap_or_default();
    let generation = c.metadata.generation;
    status.observed_generation = generation;
    let endpoint = c
        .spec
        .control_plane_endpoint
        .as_ref()
        .filter(|e| !e.host.is_empty());
    match endpoint {
        Some(e) => {
            status.initialization = Some(Initialization {
                provisioned: Some(true),
            });
            status.ready = Some(true);
            let port = if e.port == 0 {
                String::new()
            } else {
                format!(":{}", e.port)
            };
            conditions::set_at(
                &mut status.conditions,
                types::READY,
                true,
                reasons::CLUSTER_PROVISIONED,
                format!("control plane endpoint {}{port}", e.host),
                generation,
                now,
            );
        }
        None => {
            if status.initialization.is_none() {
                status.ready = Some(false);
            }
            conditions::set_at(
                &mut status.conditions,
                types::READY,
                false,
                reasons::WAITING_FOR_CONTROL_PLANE_ENDPOINT,
                "waiting for spec.controlPlaneEndpoint.host (set by the user or the control \
                 plane provider)",
                generation,
                now,
            );
        }
    }
    status
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;
    use serde_json::{Value, json};

    fn now() -> Timestamp {
        Timestamp::from_second(1_000_000).unwrap()
    }

    fn am(spec: Value) -> AnnealMachine {
        serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "AnnealMachine",
            "metadata": {"name": "w0", "namespace": "ns", "uid": "am-uid", "generation": 1,
                         "labels": {"cluster.x-k8s.io/cluster-name": "c1", "other": "x"}},
            "spec": spec,
        }))
        .unwrap()
    }

    fn base_am() -> AnnealMachine {
        am(
            json!({"selector": {"matchLabels": {"rack": "a"}}, "imageRef": {"name": "debian"},
                  "networkData": {"ethernets": [{"name": "eth0", "nic": "boot",
                      "addresses": ["10.0.0.50/24", "fd00::5/64"], "gateway4": "10.0.0.1"}]}}),
        )
    }

    fn claim(am: &AnnealMachine, status: Value) -> MachineClaim {
        let mut c = new_claim(am, "w0-bootstrap");
        c.metadata.generation = Some(1);
        c.status = serde_json::from_value(status).unwrap();
        c
    }

    fn machine(spec: Value, status: Value) -> Machine {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m1", "namespace": "ns"},
            "spec": spec, "status": status,
        }))
        .unwrap()
    }

    fn run(name: &str, claim: &str, status: Value) -> DeployRun {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"machineRef": {"name": "m1"}, "claimRef": {"name": claim}},
            "status": status,
        }))
        .unwrap()
    }

    fn bound() -> Value {
        json!({"phase": "Bound", "machineName": "m1"})
    }

    fn snap<'a>(am: &'a AnnealMachine, b: &'a Bootstrap) -> Snapshot<'a> {
        Snapshot {
            am,
            bootstrap: b,
            claim: None,
            machine: None,
            current_run: None,
            last_success: None,
            reservation: None,
            provider_machine: None,
        }
    }

    fn ready(d: &Decision) -> (String, String, String) {
        let c = d
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap();
        (c.status.clone(), c.reason.clone(), c.message.clone())
    }

    #[test]
    fn nothing_is_created_before_the_bootstrap_data() {
        let a = base_am();
        for b in [
            Bootstrap::NoOwner,
            Bootstrap::OwnerMissing("w0".into()),
            Bootstrap::NotReady("w0".into()),
        ] {
            let d = decide(&snap(&a, &b), now());
            assert!(matches!(d.claim, ClaimAction::Keep), "{b:?}");
            assert_eq!(d.provider_id, None);
            let (st, reason, _) = ready(&d);
            assert_eq!(
                (st.as_str(), reason.as_str()),
                ("False", "WaitingForBootstrapData")
            );
            assert_eq!(d.status.ready, Some(false));
            assert!(d.status.initialization.is_none());
        }
    }

    #[test]
    fn the_claim_carries_the_spec_and_the_bootstrap_secret() {
        let a = base_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let d = decide(&snap(&a, &b), now());
        let ClaimAction::Create(c) = &d.claim else {
            panic!("{:?}", d.claim)
        };
        assert_eq!(c.name_any(), "w0");
        assert_eq!(c.namespace().as_deref(), Some("ns"));
        let user = c.spec.user_data.as_ref().unwrap();
        assert_eq!(
            (user.name.as_str(), user.key.as_deref()),
            ("w0-bootstrap", Some("value"))
        );
        assert_eq!(c.spec.image_ref.as_ref().unwrap().name, "debian");
        assert_eq!(c.spec.network_data, a.spec.network_data);
        assert!(c.spec.selector.is_some() && c.spec.machine_name.is_none());
        let o = &c.owner_references()[0];
        assert_eq!(
            (
                o.kind.as_str(),
                o.uid.as_str(),
                o.controller,
                o.block_owner_deletion
            ),
            ("AnnealMachine", "am-uid", Some(true), Some(true))
        );
        assert_eq!(
            c.labels()
                .get("cluster.x-k8s.io/cluster-name")
                .map(String::as_str),
            Some("c1")
        );
        assert!(!c.labels().contains_key("other"));
        assert_eq!(d.status.claim_ref, Some(NameRef::new("w0")));
        assert!(owns(&a, c));
    }

    #[test]
    fn a_spec_change_is_synced_to_the_claim() {
        let a = base_am();
        let c = claim(&a, json!({"phase": "Pending"}));
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        assert!(matches!(decide(&s, now()).claim, ClaimAction::Keep));
        let mut changed = a.clone();
        changed.spec.image_ref = Some(NameRef::new("ubuntu"));
        changed.spec.params.insert("k".into(), "v".into());
        s.am = &changed;
        let ClaimAction::Sync(spec) = decide(&s, now()).claim else {
            panic!()
        };
        assert_eq!(spec.image_ref.unwrap().name, "ubuntu");
        assert_eq!(spec.params["k"], "v");
        assert_eq!(spec.user_data.unwrap().name, "w0-bootstrap");
        // an unreadable owner keeps the claim's user data as it is
        let nb = Bootstrap::OwnerMissing("w0".into());
        s.bootstrap = &nb;
        let ClaimAction::Sync(spec) = decide(&s, now()).claim else {
            panic!()
        };
        assert_eq!(spec.user_data.unwrap().name, "w0-bootstrap");
    }

    #[test]
    fn a_claim_of_someone_else_is_never_touched() {
        let a = base_am();
        let mut c = claim(&a, bound());
        c.metadata.owner_references = None;
        c.spec.image_ref = Some(NameRef::new("other"));
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        let d = decide(&s, now());
        assert!(matches!(d.claim, ClaimAction::Keep));
        assert_eq!(ready(&d).1, "ClaimNameTaken");
        assert_eq!(decide_cleanup(&a, Some(&c)), Cleanup::Done);
    }

    #[test]
    fn an_unbound_or_failed_claim_waits() {
        let a = base_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let pending = claim(
            &a,
            json!({"phase": "Pending", "conditions": [{"type": "Bound", "status": "False",
                "reason": "NoMatch", "message": "no Available machine matches",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        let mut s = snap(&a, &b);
        s.claim = Some(&pending);
        let d = decide(&s, now());
        let (st, reason, msg) = ready(&d);
        assert_eq!(
            (st.as_str(), reason.as_str()),
            ("False", "WaitingForMachine")
        );
        assert!(msg.contains("no Available machine matches"), "{msg}");
        let failed = claim(&a, json!({"phase": "Failed"}));
        s.claim = Some(&failed);
        assert_eq!(ready(&decide(&s, now())).1, "ClaimFailed");
    }

    fn provisioned_machine() -> Machine {
        machine(
            json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "w0"}}),
            json!({"state": "Provisioned", "lastSuccessfulRunRef": {"name": "m1-aaaa-1"},
                   "lastAttemptedRunRef": {"name": "m1-aaaa-1"}}),
        )
    }

    #[test]
    fn a_provisioned_machine_makes_it_ready_with_provider_id_and_addresses() {
        let a = base_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let c = claim(&a, bound());
        let m = provisioned_machine();
        let r = run("m1-aaaa-1", "w0", json!({"phase": "Succeeded"}));
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        s.machine = Some(&m);
        s.current_run = Some(&r);
        s.last_success = Some(&r);
        s.reservation = Some("10.0.0.77");
        let d = decide(&s, now());
        assert_eq!(d.provider_id.as_deref(), Some("anneal://ns/m1"));
        assert_eq!(d.status.ready, Some(true));
        assert_eq!(
            d.status.initialization,
            Some(Initialization {
                provisioned: Some(true)
            })
        );
        let addrs: Vec<(&str, &str)> = d
            .status
            .addresses
            .iter()
            .map(|a| (a.type_.as_str(), a.address.as_str()))
            .collect();
        assert_eq!(
            addrs,
            [
                ("InternalIP", "10.0.0.50"),
                ("InternalIP", "fd00::5"),
                ("InternalIP", "10.0.0.77"),
                ("Hostname", "m1")
            ]
        );
        assert_eq!(d.status.machine_ref, Some(NameRef::new("m1")));
        let (st, reason, _) = ready(&d);
        assert_eq!((st.as_str(), reason.as_str()), ("True", "Provisioned"));
        // a providerID already written is not written again
        let mut with_id = a.clone();
        with_id.spec.provider_id = Some("anneal://ns/m1".into());
        s.am = &with_id;
        assert_eq!(decide(&s, now()).provider_id, None);
    }

    #[test]
    fn provisioned_means_for_this_claim() {
        let a = base_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let c = claim(&a, bound());
        let m = provisioned_machine();
        let other = run("m1-aaaa-1", "someone-else", json!({"phase": "Succeeded"}));
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        s.machine = Some(&m);
        s.last_success = Some(&other);
        let d = decide(&s, now());
        assert_eq!(d.provider_id, None);
        assert_eq!(ready(&d).1, "Provisioning");
        // no run read: not provisioned either
        s.last_success = None;
        assert_eq!(ready(&decide(&s, now())).1, "Provisioning");
        // the binding must hold both ways
        let unbound = machine(
            json!({"subnetRef": {"name": "s"}}),
            json!({"state": "Provisioned", "lastSuccessfulRunRef": {"name": "m1-aaaa-1"}}),
        );
        let mine = run("m1-aaaa-1", "w0", json!({"phase": "Succeeded"}));
        s.machine = Some(&unbound);
        s.last_success = Some(&mine);
        assert_eq!(ready(&decide(&s, now())).1, "Provisioning");
        // adopted for this claim's generation counts
        let adopted = machine(
            json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "w0"},
                   "externallyProvisioned": true}),
            json!({"state": "Provisioned", "adopted": {"claim": "w0", "claimGeneration": 1}}),
        );
        s.machine = Some(&adopted);
        s.last_success = None;
        assert_eq!(ready(&decide(&s, now())).1, "Provisioned");
    }

    fn moved_am() -> AnnealMachine {
        let mut a = base_am();
        a.metadata.uid = Some("new-uid".into());
        a.spec.provider_id = Some("anneal://ns/m1".into());
        a
    }

    #[test]
    fn a_moved_annealmachine_adopts_its_machine_and_creates_the_claim() {
        let a = moved_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let mut s = snap(&a, &b);
        // the Machine the providerID names does not exist: nothing created
        let d = decide(&s, now());
        assert!(matches!(d.claim, ClaimAction::Keep));
        assert_eq!(d.adopt, None);
        let (st, reason, msg) = ready(&d);
        assert_eq!(
            (st.as_str(), reason.as_str()),
            ("False", "ProviderIDNotFound")
        );
        assert!(msg.contains("ns/m1"), "{msg}");
        // another namespace's Machine is never taken
        let mut other = a.clone();
        other.spec.provider_id = Some("anneal://elsewhere/m1".into());
        let m = provisioned_machine();
        s.am = &other;
        s.provider_machine = Some(&m);
        assert_eq!(ready(&decide(&s, now())).1, "ProviderIDNotFound");
        // a Provisioned Machine still naming the claim: adopted, then claimed
        s.am = &a;
        let d = decide(&s, now());
        assert_eq!(
            d.adopt,
            Some(Adopt {
                machine: "m1".into(),
                claim: "w0".into(),
                claim_generation: 1
            })
        );
        let ClaimAction::Create(c) = &d.claim else {
            panic!("{:?}", d.claim)
        };
        assert_eq!(c.spec.machine_name.as_deref(), Some("m1"));
        assert!(c.spec.selector.is_none());
        assert!(owns(&a, c));
        assert_eq!(c.spec.user_data.as_ref().unwrap().name, "w0-bootstrap");
        assert!(
            d.adopted_event
                .as_deref()
                .unwrap()
                .contains("without a deploy")
        );
        assert_eq!(d.provider_id, None);
        assert_eq!(ready(&d).1, "WaitingForMachine");
        // no bootstrap data needed: the Machine is provisioned already
        let nb = Bootstrap::NotReady("w0".into());
        s.bootstrap = &nb;
        let ClaimAction::Create(c) = decide(&s, now()).claim else {
            panic!()
        };
        assert!(c.spec.user_data.is_none());
        // a free Provisioned Machine too
        let free = machine(
            json!({"subnetRef": {"name": "s"}}),
            json!({"state": "Provisioned", "lastSuccessfulRunRef": {"name": "m1-aaaa-1"}}),
        );
        s.provider_machine = Some(&free);
        assert!(decide(&s, now()).adopt.is_some());
    }

    #[test]
    fn a_moved_annealmachine_never_deploys_a_busy_or_foreign_machine() {
        let a = moved_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let ms = [
            machine(
                json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "other"}}),
                json!({"state": "Provisioned"}),
            ),
            machine(
                json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "w0"}}),
                json!({"state": "Provisioning", "currentRunRef": {"name": "m1-bbbb-1"}}),
            ),
            machine(
                json!({"subnetRef": {"name": "s"}}),
                json!({"state": "Available"}),
            ),
        ];
        let mut s = snap(&a, &b);
        for m in &ms {
            s.provider_machine = Some(m);
            let d = decide(&s, now());
            assert!(matches!(d.claim, ClaimAction::Keep));
            assert_eq!(d.adopt, None);
            assert_eq!(ready(&d).1, "MachineNotAdoptable");
        }
    }

    #[test]
    fn a_moved_annealmachine_takes_over_its_former_claim() {
        let old = base_am();
        let a = moved_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let m = provisioned_machine();
        let c = claim(&old, bound());
        assert!(!owns(&a, &c));
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        s.provider_machine = Some(&m);
        let d = decide(&s, now());
        let ClaimAction::TakeOver(owners) = &d.claim else {
            panic!("{:?}", d.claim)
        };
        assert_eq!(owners[0].uid, "new-uid");
        assert_eq!(d.adopt, None, "the claim and its deploy record stay");
        assert!(d.adopted_event.is_some());
        assert_eq!(d.status.claim_ref, Some(NameRef::new("w0")));
        // another spec, another Machine, another owner: not taken over
        let mut changed = c.clone();
        changed.spec.image_ref = Some(NameRef::new("ubuntu"));
        s.claim = Some(&changed);
        assert_eq!(ready(&decide(&s, now())).1, "ClaimNameTaken");
        let elsewhere = claim(&old, json!({"phase": "Bound", "machineName": "m2"}));
        s.claim = Some(&elsewhere);
        assert_eq!(ready(&decide(&s, now())).1, "ClaimNameTaken");
        let mut foreign = c.clone();
        foreign.metadata.owner_references.as_mut().unwrap()[0].name = "someone".into();
        s.claim = Some(&foreign);
        let d = decide(&s, now());
        assert!(matches!(d.claim, ClaimAction::Keep));
        assert_eq!(ready(&d).1, "ClaimNameTaken");
        // once taken over: Provisioned, and a new bootstrap Secret is not
        // copied (it would redeploy)
        let mut mine = c.clone();
        mine.metadata.owner_references = owner_reference(&a).map(|o| vec![o]);
        let r = run("m1-aaaa-1", "w0", json!({"phase": "Succeeded"}));
        let nb = Bootstrap::Ready("w0-bootstrap-new".into());
        s.bootstrap = &nb;
        s.claim = Some(&mine);
        s.machine = Some(&m);
        s.last_success = Some(&r);
        let d = decide(&s, now());
        assert!(matches!(d.claim, ClaimAction::Keep), "{:?}", d.claim);
        assert_eq!(ready(&d).1, "Provisioned");
    }

    #[test]
    fn a_moved_claim_keeps_its_machine_name_against_a_template_selector() {
        let a = moved_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let mut c = claim(&a, bound());
        c.spec.selector = None;
        c.spec.machine_name = Some("m1".into());
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        assert!(matches!(decide(&s, now()).claim, ClaimAction::Keep));
    }

    #[test]
    fn the_deploy_deadline_reaches_the_claim() {
        let mut a = base_am();
        a.spec.deploy_deadline = Some("45m".into());
        assert_eq!(
            claim_spec(&a.spec, None).deploy_deadline.as_deref(),
            Some("45m")
        );
    }

    #[test]
    fn a_failed_run_is_deployment_failed_with_its_message() {
        let a = base_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let c = claim(&a, bound());
        let m = machine(
            json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "w0"}}),
            json!({"state": "Provisioning", "lastAttemptedRunRef": {"name": "m1-aaaa-1"}}),
        );
        let r = run(
            "m1-aaaa-1",
            "w0",
            json!({"phase": "Failed", "conditions": [{"type": "Succeeded", "status": "False",
                "reason": "DeployFailed", "message": "WritingContent: checksum mismatch on piece 7",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        s.machine = Some(&m);
        s.current_run = Some(&r);
        let d = decide(&s, now());
        let (st, reason, msg) = ready(&d);
        assert_eq!(
            (st.as_str(), reason.as_str()),
            ("False", "DeploymentFailed")
        );
        assert_eq!(
            msg,
            "DeployRun m1-aaaa-1 failed: WritingContent: checksum mismatch on piece 7"
        );
        assert_eq!(d.status.ready, Some(false));
        assert_eq!(d.provider_id, None);
        // another claim's failed run is not ours
        let theirs = run("m1-bbbb-1", "old", json!({"phase": "Failed"}));
        s.current_run = Some(&theirs);
        assert_eq!(ready(&decide(&s, now())).1, "Provisioning");
    }

    #[test]
    fn an_unreachable_bmc_waits_without_failing() {
        let a = base_am();
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let c = claim(&a, bound());
        let m = machine(
            json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "w0"}}),
            json!({"state": "Provisioning", "conditions": [{"type": "BMCReachable",
                "status": "False", "reason": "BMCUnreachable", "message": "no answer from 10.1.0.5",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        s.machine = Some(&m);
        let d = decide(&s, now());
        let (st, reason, msg) = ready(&d);
        assert_eq!((st.as_str(), reason.as_str()), ("False", "WaitingForBMC"));
        assert!(
            msg.contains("BMCUnreachable") && msg.contains("10.1.0.5"),
            "{msg}"
        );
        // a provisioned machine stays ready while its BMC is away
        let p = machine(
            json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "w0"}}),
            json!({"state": "Provisioned", "lastSuccessfulRunRef": {"name": "r"},
                "conditions": [{"type": "BMCReachable", "status": "False",
                "reason": "BMCUnreachable", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}),
        );
        let r = run("r", "w0", json!({"phase": "Succeeded"}));
        s.machine = Some(&p);
        s.last_success = Some(&r);
        assert_eq!(ready(&decide(&s, now())).1, "Provisioned");
    }

    #[test]
    fn provisioned_never_goes_back_but_ready_does() {
        let mut a = base_am();
        a.status = Some(AnnealMachineStatus {
            initialization: Some(Initialization {
                provisioned: Some(true),
            }),
            ready: Some(true),
            ..Default::default()
        });
        let b = Bootstrap::Ready("w0-bootstrap".into());
        let c = claim(&a, bound());
        let m = machine(
            json!({"subnetRef": {"name": "s"}, "claimRef": {"name": "w0"}}),
            json!({"state": "Provisioning", "currentRunRef": {"name": "m1-cccc-1"},
                   "deploy": {"percent": 40}}),
        );
        let mut s = snap(&a, &b);
        s.claim = Some(&c);
        s.machine = Some(&m);
        let d = decide(&s, now());
        assert_eq!(d.status.ready, Some(false));
        assert_eq!(
            d.status.initialization.as_ref().unwrap().provisioned,
            Some(true),
            "initialization.provisioned never goes back"
        );
        let (_, reason, msg) = ready(&d);
        assert_eq!(reason, "Provisioning");
        assert!(msg.contains("Provisioning") && msg.contains("40%"), "{msg}");
    }

    #[test]
    fn deletion_deletes_the_claim_then_waits_for_it() {
        let a = base_am();
        let c = claim(&a, bound());
        assert_eq!(decide_cleanup(&a, Some(&c)), Cleanup::DeleteClaim);
        let mut going = c.clone();
        going.metadata.deletion_timestamp = Some(anneal_api::Time(now()));
        assert_eq!(decide_cleanup(&a, Some(&going)), Cleanup::WaitForClaim);
        assert_eq!(decide_cleanup(&a, None), Cleanup::Done);
        let st = deleting_status(&a, &going, now());
        let r = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(r.reason, "Deleting");
        assert!(r.message.contains("Machine m1"), "{}", r.message);
    }

    #[test]
    fn a_cluster_is_provisioned_once_its_endpoint_is_set() {
        let mut c: AnnealCluster = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "AnnealCluster",
            "metadata": {"name": "c1", "namespace": "ns", "generation": 1},
            "spec": {}
        }))
        .unwrap();
        let st = decide_cluster(&c, now());
        assert_eq!(st.ready, Some(false));
        assert!(st.initialization.is_none());
        let r = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "WaitingForControlPlaneEndpoint")
        );
        c.spec.control_plane_endpoint = Some(anneal_api::capi::ApiEndpoint {
            host: "10.0.0.2".into(),
            port: 6443,
        });
        let st = decide_cluster(&c, now());
        assert_eq!(st.ready, Some(true));
        assert_eq!(st.initialization.as_ref().unwrap().provisioned, Some(true));
        let r = st.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
        assert_eq!(
            (r.status.as_str(), r.message.as_str()),
            ("True", "control plane endpoint 10.0.0.2:6443")
        );
    }

    #[test]
    fn addresses_use_the_metadata_hostname_when_given() {
        let mut a = base_am();
        a.spec.meta_data = Some(anneal_api::MetaDataSpec {
            hostname: Some("node-a".into()),
            public_keys_secret_ref: None,
        });
        a.spec.network_data = None;
        let got = addresses(&a.spec, "m1", None);
        assert_eq!(
            got,
            vec![MachineAddress {
                type_: "Hostname".into(),
                address: "node-a".into()
            }]
        );
    }
}
