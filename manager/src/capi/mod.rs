//! The Cluster API infrastructure provider (docs/capi.md): the AnnealMachine
//! and AnnealCluster controllers, in the manager's runtime under the leader
//! lease like every other controller.
//!
//! They start only when the API server serves both Cluster API's core kinds
//! (`machines.cluster.x-k8s.io`) and this provider's
//! (`annealmachines.infrastructure.cluster.x-k8s.io`); otherwise the task
//! logs once at info and looks again every [`DISCOVERY_RECHECK`], so a
//! deployment without Cluster API is unaffected and one that installs it
//! later needs no restart.
//!
//! AnnealMachine (decisions in [`decide`]): once its owner Cluster API
//! Machine has `spec.bootstrap.dataSecretName`, a MachineClaim of the same
//! name and namespace, owned by it, with the AnnealMachine's spec and that
//! Secret (key `value`) as `userData`, kept in line with the spec; once the
//! bound anneal Machine is Provisioned for the claim, `spec.providerID`
//! (`anneal://<namespace>/<machine>`), `status.initialization.provisioned`,
//! `status.ready`, `status.addresses` and `Ready=True`. Deleting it deletes
//! the claim (the Machine's reclaimPolicy decides Retain or Recycle) and
//! waits for the claim to go before the finalizer is removed. A moved
//! AnnealMachine (`clusterctl move`: `spec.providerID` set, the claim of its
//! name absent or not its own) takes the providerID's Machine over without a
//! deploy: `status.adopted` on the Machine then a new claim naming it, or
//! the former claim's owner references (docs/capi.md).
//!
//! The owner Machine is read as a `DynamicObject` (no Cluster API crate):
//! the version of its owner reference, `spec.bootstrap.dataSecretName`.

/// The Event action of a takeover after `clusterctl move`.
const ADOPT_ACTION: &str = "Adopt";
pub mod decide;

use std::sync::Arc;
use std::time::Duration;

use anneal_api::capi::{
    AnnealCluster, AnnealClusterStatus, AnnealMachine, AnnealMachineStatus, CORE_GROUP, GROUP,
};
use anneal_api::{DeployRun, Machine, MachineClaim, RunPhase, Subnet};
use futures::future::join;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use serde_json::json;
use tracing::{debug, info};

use crate::controller::{Identity, ReconcileError, Scope, drive, is_conflict, patch_params};
use decide::{Bootstrap, ClaimAction, Cleanup, Snapshot};

/// Finalizer holding an AnnealMachine until its claim is gone.
pub const FINALIZER: &str = "annealmachine.infrastructure.cluster.x-k8s.io";
/// Field manager of the provider's writes.
pub const FIELD_MANAGER: &str = "anneal-capi";
/// The annotation Cluster API sets on paused objects.
pub const PAUSED_ANNOTATION: &str = "cluster.x-k8s.io/paused";
/// How often the runtime looks again for the Cluster API kinds when they
/// are not served.
pub const DISCOVERY_RECHECK: Duration = Duration::from_secs(300);

/// The AnnealMachine controller's identity.
pub const ID: Identity = Identity {
    name: "capi",
    kind: "AnnealMachine",
    field_manager: FIELD_MANAGER,
};

/// The AnnealCluster controller's identity.
pub const CLUSTER_ID: Identity = Identity {
    name: "capi-cluster",
    kind: "AnnealCluster",
    field_manager: FIELD_MANAGER,
};

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum CapiError {
    /// An API call failed.
    #[error("api call failed")]
    Kube(#[from] kube::Error),
    /// The object has no namespace.
    #[error("object has no namespace")]
    NoNamespace,
}

impl ReconcileError for CapiError {
    fn is_conflict(&self) -> bool {
        match self {
            Self::Kube(e) => is_conflict(e),
            Self::NoNamespace => false,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(_) => "api",
            Self::NoNamespace => "no_namespace",
        }
    }
}

/// The Cluster API core's Machine kind as the API server serves it, when
/// it serves both it and this provider's AnnealMachine.
pub async fn discover(client: &Client) -> Option<ApiResource> {
    let ours = kube::discovery::group(client, GROUP).await.ok()?;
    ours.recommended_kind("AnnealMachine")?;
    let core = kube::discovery::group(client, CORE_GROUP).await.ok()?;
    core.recommended_kind("Machine").map(|(ar, _)| ar)
}

/// Runs the provider's controllers in `scope` until it is cancelled; waits
/// (quietly after one info line) while the Cluster API kinds are not
/// served.
pub async fn controller(scope: Scope) {
    let mut logged = false;
    let core = loop {
        if let Some(ar) = discover(&scope.client).await {
            break ar;
        }
        if !logged {
            info!(
                "Cluster API kinds not served (machines.{CORE_GROUP}, annealmachines.{GROUP}): \
                 the Cluster API provider stays off; looking again every {} s",
                DISCOVERY_RECHECK.as_secs()
            );
            logged = true;
        } else {
            debug!("Cluster API kinds still not served");
        }
        tokio::select! {
            () = tokio::time::sleep(DISCOVERY_RECHECK) => {}
            () = scope.cancelled() => return,
        }
    };
    info!(version = %core.version, "Cluster API served: starting the provider's controllers");
    join(
        machine_controller(scope.clone(), core),
        cluster_controller(scope),
    )
    .await;
}

struct Context {
    client: Client,
    recorder: kube::runtime::events::Recorder,
}

/// The AnnealMachine controller.
pub async fn machine_controller(scope: Scope, core_machine: ApiResource) {
    let ctx = Arc::new(Context {
        client: scope.client.clone(),
        recorder: scope.recorder.clone(),
    });
    let capi_machines: Api<DynamicObject> = match scope.namespace.as_deref() {
        Some(ns) => Api::namespaced_with(scope.client.clone(), ns, &core_machine),
        None => Api::all_with(scope.client.clone(), &core_machine),
    };
    let controller = Controller::new(scope.api::<AnnealMachine>(), watcher::Config::default())
        .owns(scope.api::<MachineClaim>(), watcher::Config::default())
        // a Machine bound to a claim concerns the AnnealMachine of the
        // claim's name (claims and AnnealMachines share names)
        .watches(scope.api::<Machine>(), watcher::Config::default(), |m| {
            let ns = m.namespace().unwrap_or_default();
            m.spec
                .claim_ref
                .as_ref()
                .filter(|r| r.namespace_or(&ns) == ns)
                .map(|r| ObjectRef::<AnnealMachine>::new(&r.name).within(&ns))
        })
        // a run's end (progress reports are not worth a reconcile)
        .watches(scope.api::<DeployRun>(), watcher::Config::default(), |r| {
            let ended = matches!(
                r.status.as_ref().and_then(|s| s.phase),
                Some(RunPhase::Failed | RunPhase::Succeeded)
            );
            let ns = r.namespace().unwrap_or_default();
            ended.then(|| ObjectRef::<AnnealMachine>::new(&r.spec.claim_ref.name).within(&ns))
        })
        // the Cluster API Machine: its bootstrap data Secret appears
        .watches_with(
            capi_machines,
            core_machine,
            watcher::Config::default(),
            |m: DynamicObject| {
                let ns = m.namespace().unwrap_or_default();
                let infra = m.data.pointer("/spec/infrastructureRef");
                let kind = infra.and_then(|i| i.get("kind")).and_then(|k| k.as_str());
                let name = infra.and_then(|i| i.get("name")).and_then(|k| k.as_str());
                match (kind, name) {
                    (Some("AnnealMachine"), Some(n)) => {
                        Some(ObjectRef::<AnnealMachine>::new(n).within(&ns))
                    }
                    _ => None,
                }
            },
        );
    drive(ID, &scope, controller, reconcile_machine, ctx).await;
}

/// The AnnealCluster controller.
pub async fn cluster_controller(scope: Scope) {
    let ctx = Arc::new(Context {
        client: scope.client.clone(),
        recorder: scope.recorder.clone(),
    });
    let controller = Controller::new(scope.api::<AnnealCluster>(), watcher::Config::default());
    drive(CLUSTER_ID, &scope, controller, reconcile_cluster, ctx).await;
}

async fn reconcile_cluster(c: Arc<AnnealCluster>, ctx: Arc<Context>) -> Result<Action, CapiError> {
    let ns = c.namespace().ok_or(CapiError::NoNamespace)?;
    if c.annotations().contains_key(PAUSED_ANNOTATION) {
        return Ok(Action::await_change());
    }
    let old = c.status.clone().unwrap_or_default();
    let new = decide::decide_cluster(&c, Timestamp::now());
    if new != old {
        let api: Api<AnnealCluster> = Api::namespaced(ctx.client.clone(), &ns);
        write_status::<AnnealCluster, AnnealClusterStatus>(&api, &c.name_any(), &old, &new).await?;
    }
    Ok(Action::await_change())
}

/// A merge patch of the status from `old` to `new` (removed fields become
/// null); a vanished object is not an error.
async fn write_status<K, S>(api: &Api<K>, name: &str, old: &S, new: &S) -> Result<(), CapiError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    S: serde::Serialize,
{
    let old = serde_json::to_value(old).unwrap_or_default();
    let new = serde_json::to_value(new).unwrap_or_default();
    let Some(diff) = crate::patch::merge_diff(&old, &new) else {
        return Ok(());
    };
    match api
        .patch_status(
            name,
            &patch_params(FIELD_MANAGER),
            &Patch::Merge(&json!({ "status": diff })),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

async fn reconcile_machine(am: Arc<AnnealMachine>, ctx: Arc<Context>) -> Result<Action, CapiError> {
    let ns = am.namespace().ok_or(CapiError::NoNamespace)?;
    if am.annotations().contains_key(PAUSED_ANNOTATION) && am.metadata.deletion_timestamp.is_none()
    {
        let old = am.status.clone().unwrap_or_default();
        let mut new = old.clone();
        crate::conditions::set(
            &mut new.conditions,
            anneal_api::conditions::types::READY,
            false,
            anneal_api::capi::reasons::PAUSED,
            format!("the {PAUSED_ANNOTATION} annotation is set: nothing is reconciled"),
            am.metadata.generation,
        );
        let api: Api<AnnealMachine> = Api::namespaced(ctx.client.clone(), &ns);
        write_status::<AnnealMachine, AnnealMachineStatus>(&api, &am.name_any(), &old, &new)
            .await?;
        return Ok(Action::await_change());
    }
    let api: Api<AnnealMachine> = Api::namespaced(ctx.client.clone(), &ns);
    let finalizers = am.finalizers();
    let ours = finalizers.iter().any(|f| f == FINALIZER);
    if am.metadata.deletion_timestamp.is_some() {
        if !ours {
            return Ok(Action::await_change());
        }
        return match cleanup(&am, &ns, &ctx).await? {
            Some(action) => Ok(action),
            None => {
                // the claim is gone: let the AnnealMachine go
                let rest: Vec<&String> = finalizers.iter().filter(|f| *f != FINALIZER).collect();
                set_finalizers(&api, &am, &rest).await?;
                info!(namespace = %ns, annealmachine = %am.name_any(), "claim gone; finalizer removed");
                Ok(Action::await_change())
            }
        };
    }
    if !ours {
        let mut all: Vec<&String> = finalizers.iter().collect();
        let f = FINALIZER.to_string();
        all.push(&f);
        set_finalizers(&api, &am, &all).await?;
        // the write wakes the next pass
        return Ok(Action::await_change());
    }
    apply(&am, &ns, &ctx).await
}

/// Writes `metadata.finalizers` under `am`'s resourceVersion.
async fn set_finalizers(
    api: &Api<AnnealMachine>,
    am: &AnnealMachine,
    finalizers: &[&String],
) -> Result<(), CapiError> {
    let patch = json!({
        "metadata": {"resourceVersion": am.resource_version(), "finalizers": finalizers},
    });
    match api
        .patch(
            &am.name_any(),
            &patch_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The owner reference of kind Machine of group cluster.x-k8s.io, if any.
fn capi_owner(am: &AnnealMachine) -> Option<(ApiResource, String)> {
    am.owner_references().iter().find_map(|o| {
        let (group, version) = o.api_version.split_once('/')?;
        (o.kind == "Machine" && group == CORE_GROUP).then(|| {
            (
                ApiResource {
                    group: group.to_string(),
                    version: version.to_string(),
                    api_version: o.api_version.clone(),
                    kind: "Machine".to_string(),
                    plural: "machines".to_string(),
                },
                o.name.clone(),
            )
        })
    })
}

async fn bootstrap(am: &AnnealMachine, ns: &str, client: &Client) -> Result<Bootstrap, CapiError> {
    let Some((ar, name)) = capi_owner(am) else {
        return Ok(Bootstrap::NoOwner);
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let owner = match api.get_opt(&name).await {
        Ok(o) => o,
        // a version the API server does not serve: as if not there yet
        Err(kube::Error::Api(s)) if s.code == 404 => None,
        Err(e) => return Err(e.into()),
    };
    let Some(owner) = owner else {
        return Ok(Bootstrap::OwnerMissing(name));
    };
    Ok(
        match owner
            .data
            .pointer("/spec/bootstrap/dataSecretName")
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
        {
            Some(secret) => Bootstrap::Ready(secret.to_string()),
            None => Bootstrap::NotReady(name),
        },
    )
}

/// The address of `m` in its Subnet's reservation table, if it has one.
async fn reservation(m: &Machine, client: &Client) -> Result<Option<String>, CapiError> {
    let ns = m.namespace().unwrap_or_default();
    let sns = m.spec.subnet_ref.namespace_or(&ns).to_string();
    let api: Api<Subnet> = Api::namespaced(client.clone(), &sns);
    let subnet = match api.get_opt(&m.spec.subnet_ref.name).await {
        Ok(s) => s,
        // a Subnet of another namespace the manager may not read: no address
        Err(kube::Error::Api(s)) if s.code == 403 => None,
        Err(e) => return Err(e.into()),
    };
    // `Reservation.machine`: the name, `namespace/name` across namespaces
    let key = if sns == ns {
        m.name_any()
    } else {
        format!("{ns}/{}", m.name_any())
    };
    Ok(subnet
        .and_then(|s| s.status)
        .and_then(|s| s.dhcp)
        .and_then(|d| d.reservations.into_iter().find(|r| r.machine == key))
        .map(|r| r.address))
}

async fn apply(am: &AnnealMachine, ns: &str, ctx: &Context) -> Result<Action, CapiError> {
    let name = am.name_any();
    let client = &ctx.client;
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), ns);
    let machines: Api<Machine> = Api::namespaced(client.clone(), ns);
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), ns);
    let boot = bootstrap(am, ns, client).await?;
    let claim = claims.get_opt(&name).await?;
    let machine = match claim
        .as_ref()
        .filter(|c| decide::owns(am, c))
        .and_then(|c| c.status.as_ref())
        .and_then(|s| s.machine_name.clone())
    {
        Some(m) => machines.get_opt(&m).await?,
        None => None,
    };
    let (mut current_run, mut last_success, mut address) = (None, None, None);
    if let Some(m) = &machine {
        let st = m.status.clone().unwrap_or_default();
        if let Some(r) = st.current_run_ref.or(st.last_attempted_run_ref) {
            current_run = runs.get_opt(&r.name).await?;
        }
        if let Some(r) = st.last_successful_run_ref {
            last_success = match &current_run {
                Some(c) if c.name_any() == r.name => Some(c.clone()),
                _ => runs.get_opt(&r.name).await?,
            };
        }
        address = reservation(m, client).await?;
    }
    // a moved AnnealMachine: the anneal Machine its providerID names
    let provider_machine = match am.spec.provider_id.as_deref() {
        Some(id) if !claim.as_ref().is_some_and(|c| decide::owns(am, c)) => {
            match anneal_api::capi::parse_provider_id(id) {
                Some((mns, m)) if mns == ns => machines.get_opt(m).await?,
                _ => None,
            }
        }
        _ => None,
    };
    let snap = Snapshot {
        am,
        bootstrap: &boot,
        claim: claim.as_ref(),
        machine: machine.as_ref(),
        current_run: current_run.as_ref(),
        last_success: last_success.as_ref(),
        reservation: address.as_deref(),
        provider_machine: provider_machine.as_ref(),
    };
    let d = decide::decide(&snap, Timestamp::now());
    if let (Some(a), Some(m)) = (&d.adopt, &provider_machine) {
        // before the claim exists: its first generation counts as deployed,
        // so its binding plans no DeployRun (under the Machine's
        // resourceVersion: a Machine that moved on since it was read is
        // looked at again)
        let patch = json!({
            "metadata": {"resourceVersion": m.resource_version()},
            "status": {"adopted": anneal_api::Adoption {
                claim: a.claim.clone(),
                claim_generation: a.claim_generation,
                at: Some(anneal_api::Time(Timestamp::now())),
            }},
        });
        machines
            .patch_status(
                &a.machine,
                &patch_params(FIELD_MANAGER),
                &Patch::Merge(&patch),
            )
            .await?;
        info!(namespace = %ns, annealmachine = %name, machine = %a.machine,
            "moved AnnealMachine: Machine adopted for its claim");
    }
    match &d.claim {
        ClaimAction::Keep => {}
        ClaimAction::Create(c) => {
            match claims.create(&PostParams::default(), c).await {
                Ok(_) => info!(namespace = %ns, annealmachine = %name, "MachineClaim created"),
                // created by a reconcile before us: the next pass reads it
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    return Ok(Action::requeue(crate::controller::CONFLICT_REQUEUE));
                }
                Err(e) => return Err(e.into()),
            }
        }
        ClaimAction::Sync(spec) => {
            if let Some(live) = &claim {
                let old = serde_json::to_value(&live.spec).unwrap_or_default();
                let new = serde_json::to_value(spec.as_ref()).unwrap_or_default();
                if let Some(diff) = crate::patch::merge_diff(&old, &new) {
                    let patch = json!({
                        "metadata": {"resourceVersion": live.resource_version()},
                        "spec": diff,
                    });
                    claims
                        .patch(&name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
                        .await?;
                    info!(namespace = %ns, annealmachine = %name, "MachineClaim spec synced");
                }
            }
        }
        ClaimAction::TakeOver(owners) => {
            if let Some(live) = &claim {
                let patch = json!({
                    "metadata": {"resourceVersion": live.resource_version(),
                                 "ownerReferences": owners},
                });
                claims
                    .patch(&name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
                    .await?;
                info!(namespace = %ns, annealmachine = %name, "moved AnnealMachine: MachineClaim taken over");
            }
        }
    }
    if let Some(message) = &d.adopted_event {
        crate::controller::publish_event(
            &ctx.recorder,
            am,
            EventType::Normal,
            ADOPT_ACTION,
            anneal_api::capi::reasons::ADOPTED_PROVISIONED_CLAIM,
            message.clone(),
        );
    }
    let api: Api<AnnealMachine> = Api::namespaced(client.clone(), ns);
    if let Some(id) = &d.provider_id {
        let patch = json!({
            "metadata": {"resourceVersion": am.resource_version()},
            "spec": {"providerID": id},
        });
        api.patch(&name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
            .await?;
    }
    let old = am.status.clone().unwrap_or_default();
    if d.status != old {
        write_status::<AnnealMachine, AnnealMachineStatus>(&api, &name, &old, &d.status).await?;
        event_on_change(am, &old, &d.status, ctx);
    }
    Ok(Action::requeue(d.requeue))
}

fn ready_reason(st: &AnnealMachineStatus) -> Option<(&str, &str)> {
    st.conditions
        .iter()
        .find(|c| c.type_ == anneal_api::conditions::types::READY)
        .map(|c| (c.reason.as_str(), c.message.as_str()))
}

/// An Event when the Ready reason changes to one worth telling.
fn event_on_change(
    am: &AnnealMachine,
    old: &AnnealMachineStatus,
    new: &AnnealMachineStatus,
    ctx: &Context,
) {
    use anneal_api::capi::reasons;
    let Some((reason, message)) = ready_reason(new) else {
        return;
    };
    if ready_reason(old).map(|(r, _)| r) == Some(reason) {
        return;
    }
    let type_ = match reason {
        reasons::PROVISIONED | reasons::WAITING_FOR_MACHINE | reasons::PROVISIONING => {
            EventType::Normal
        }
        reasons::DEPLOYMENT_FAILED
        | reasons::WAITING_FOR_BMC
        | reasons::CLAIM_FAILED
        | reasons::CLAIM_NAME_TAKEN
        | reasons::PROVIDER_ID_NOT_FOUND
        | reasons::MACHINE_NOT_ADOPTABLE => EventType::Warning,
        _ => return,
    };
    crate::controller::publish_event(
        &ctx.recorder,
        am,
        type_,
        "Reconcile",
        reason,
        message.to_string(),
    );
}

/// One step of deleting `am`: None when its claim is gone (the finalizer
/// may go), else when to look again.
async fn cleanup(am: &AnnealMachine, ns: &str, ctx: &Context) -> Result<Option<Action>, CapiError> {
    let name = am.name_any();
    let claims: Api<MachineClaim> = Api::namespaced(ctx.client.clone(), ns);
    let claim = claims.get_opt(&name).await?;
    match decide::decide_cleanup(am, claim.as_ref()) {
        Cleanup::Done => Ok(None),
        step => {
            if step == Cleanup::DeleteClaim {
                match claims.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {
                        info!(namespace = %ns, annealmachine = %name, "deleting its MachineClaim");
                    }
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if let Some(c) = &claim {
                let old = am.status.clone().unwrap_or_default();
                let new = decide::deleting_status(am, c, Timestamp::now());
                let api: Api<AnnealMachine> = Api::namespaced(ctx.client.clone(), ns);
                write_status::<AnnealMachine, AnnealMachineStatus>(&api, &name, &old, &new).await?;
            }
            // the claim's deletion (owned: watched) wakes us; the requeue
            // only bounds a missed event
            Ok(Some(Action::requeue(decide::WAITING)))
        }
    }
}
