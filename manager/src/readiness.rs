//! The ReadinessRule controller: lifts a taint from the Machines a rule
//! selects once their listed conditions hold; in `Continuous` mode it puts
//! the taint back whenever a condition stops holding. `BootstrapOnly` never
//! adds a taint: the creator of the Machine does.

use anneal_api::conditions::{reasons, types};
use std::sync::Arc;
use std::time::Duration;

use anneal_api::{EnforcementMode, Machine, NameRef, ReadinessRule, ReadinessRuleStatus, Taint};
use kube::api::{Api, Patch};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{debug, info};

use crate::conditions;
use crate::controller::{Identity, ReconcileError, Scope, drive, is_conflict, patch_params};

const KIND: &str = "ReadinessRule";
/// Field manager of the readiness rule controller's writes.
pub const FIELD_MANAGER: &str = "anneal-readiness";

/// Errors of one rule reconcile.
#[derive(Debug, thiserror::Error)]
pub enum RuleError {
    /// An API call failed.
    #[error("api call failed: {0}")]
    Kube(#[from] kube::Error),
    /// The object has no namespace.
    #[error("object has no namespace")]
    NoNamespace,
}

struct Context {
    client: Client,
    machines: Store<Machine>,
    recorder: Recorder,
}

/// What a rule wants done to one machine's taints, if anything.
#[derive(Debug, PartialEq, Eq)]
pub enum TaintChange {
    /// Remove the rule's taint.
    Remove,
    /// Add the rule's taint.
    Add,
}

fn same_taint(a: &Taint, b: &Taint) -> bool {
    a.key == b.key && a.effect == b.effect
}

/// Whether the machine's conditions satisfy the rule.
pub fn conditions_hold(rule: &ReadinessRule, machine: &Machine) -> bool {
    let have = machine
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    rule.spec
        .conditions
        .iter()
        .all(|want| conditions::status(have, &want.type_) == Some(want.required_status.as_str()))
}

/// The pure decision for one selected machine.
pub fn decide(rule: &ReadinessRule, machine: &Machine) -> Option<TaintChange> {
    let tainted = machine
        .spec
        .taints
        .iter()
        .any(|t| same_taint(t, &rule.spec.taint));
    match (
        conditions_hold(rule, machine),
        tainted,
        rule.spec.enforcement_mode,
    ) {
        (true, true, _) => Some(TaintChange::Remove),
        (false, false, EnforcementMode::Continuous) => Some(TaintChange::Add),
        _ => None,
    }
}

/// The readiness rule controller's identity.
pub const ID: Identity = Identity {
    name: "readiness",
    kind: KIND,
    field_manager: FIELD_MANAGER,
};

/// Runs the readiness rule controller in `scope` until it is cancelled.
/// Its Machine feed is taken when this is called ([`Scope::machines`]).
pub fn controller(scope: Scope) -> impl std::future::Future<Output = ()> + Send + 'static {
    let machines = scope.machines();
    run_controller(scope, machines)
}

async fn run_controller(scope: Scope, machines: crate::controller::Feed<Machine>) {
    let (machines, stream) = machines.touched();
    let controller = Controller::new(scope.api::<ReadinessRule>(), watcher::Config::default());
    let rules = controller.store();
    let ctx = Arc::new(Context {
        client: scope.client.clone(),
        machines,
        recorder: scope.recorder.clone(),
    });
    let controller = controller.watches_shared_stream(stream, move |m: Arc<Machine>| {
        let ns = m.namespace().unwrap_or_default();
        rules
            .state()
            .iter()
            .filter(|r| r.namespace().as_deref() == Some(ns.as_str()))
            .map(|r| ObjectRef::from_obj(r.as_ref()))
            .collect::<Vec<_>>()
    });
    drive(ID, &scope, controller, reconcile, ctx).await;
}

impl ReconcileError for RuleError {
    fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube(e) if is_conflict(e))
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(_) => "api",
            Self::NoNamespace => "no_namespace",
        }
    }
}

async fn reconcile(rule: Arc<ReadinessRule>, ctx: Arc<Context>) -> Result<Action, RuleError> {
    let ns = rule.namespace().ok_or(RuleError::NoNamespace)?;
    let _ = tokio::time::timeout(Duration::from_secs(30), ctx.machines.wait_until_ready()).await;
    let machines_api: Api<Machine> = Api::namespaced(ctx.client.clone(), &ns);
    let mut selected = 0;
    let mut ready = 0;
    let mut tainted = Vec::new();
    let mut requeue_soon = false;
    let mut machines: Vec<Arc<Machine>> = ctx
        .machines
        .state()
        .into_iter()
        .filter(|m| m.namespace().as_deref() == Some(ns.as_str()))
        .filter(|m| rule.spec.machine_selector.matches(m.labels()))
        .collect();
    machines.sort_by_key(|m| m.name_any());
    for m in machines {
        selected += 1;
        let holds = conditions_hold(&rule, &m);
        if holds {
            ready += 1;
        }
        let mut taints = m.spec.taints.clone();
        let change = decide(&rule, &m);
        match change {
            Some(TaintChange::Remove) => taints.retain(|t| !same_taint(t, &rule.spec.taint)),
            Some(TaintChange::Add) => taints.push(rule.spec.taint.clone()),
            None => {}
        }
        if taints.iter().any(|t| same_taint(t, &rule.spec.taint)) {
            tainted.push(NameRef::new(m.name_any()));
        }
        let Some(change) = change else { continue };
        let patch = json!({
            "metadata": {"resourceVersion": m.resource_version()},
            "spec": {"taints": taints},
        });
        match machines_api
            .patch(
                &m.name_any(),
                &patch_params(FIELD_MANAGER),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(updated) => {
                let (reason, note) = match change {
                    TaintChange::Remove => (
                        "TaintRemoved",
                        format!(
                            "readiness rule {} lifted taint {}",
                            rule.name_any(),
                            rule.spec.taint.key
                        ),
                    ),
                    TaintChange::Add => (
                        "TaintApplied",
                        format!(
                            "readiness rule {} applied taint {}",
                            rule.name_any(),
                            rule.spec.taint.key
                        ),
                    ),
                };
                info!(machine = %m.name_any(), rule = %rule.name_any(), reason, "taint changed");
                let ev = Event {
                    type_: EventType::Normal,
                    reason: reason.to_string(),
                    note: Some(note),
                    action: "Taint".to_string(),
                    secondary: Some(rule.object_ref(&())),
                };
                if let Err(e) = ctx.recorder.publish(&ev, &updated.object_ref(&())).await {
                    debug!(error = %e, "publishing event failed");
                }
            }
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => requeue_soon = true,
            Err(e) => return Err(e.into()),
        }
    }

    let generation = rule.metadata.generation;
    let mut status = rule.status.clone().unwrap_or_default();
    let old = status.clone();
    status.selected_machines = Some(selected);
    status.ready_machines = Some(ready);
    status.tainted = tainted;
    status.observed_generation = generation;
    conditions::set(
        &mut status.conditions,
        "Valid",
        true,
        "Valid",
        "spec is valid",
        generation,
    );
    let all = ready == selected;
    conditions::set(
        &mut status.conditions,
        types::READY,
        all,
        if all {
            reasons::ALL_CONDITIONS_HOLD
        } else {
            reasons::CONDITIONS_PENDING
        },
        format!("{ready} of {selected} selected machines satisfy the conditions"),
        generation,
    );
    if status != old {
        let api: Api<ReadinessRule> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = json!({"status": status_value(&status)});
        match api
            .patch_status(
                &rule.name_any(),
                &patch_params(FIELD_MANAGER),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(if requeue_soon {
        Action::requeue(Duration::from_millis(200))
    } else {
        Action::requeue(Duration::from_secs(300))
    })
}

fn status_value(status: &ReadinessRuleStatus) -> serde_json::Value {
    let mut v = serde_json::to_value(status).unwrap_or_default();
    if let Some(obj) = v.as_object_mut() {
        obj.entry("tainted")
            .or_insert(serde_json::Value::Array(Vec::new()));
    }
    v
}
