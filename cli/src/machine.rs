//! Machine operations: the fields and annotations of docs/api.md.

use std::io::Write;

use anneal_api::{Machine, MachineClaim, ReclaimPolicy};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::{Error, FIELD_MANAGER};

/// `anneal.dev/operation` (`park` | `unpark`).
pub const OPERATION: &str = "anneal.dev/operation";
/// `anneal.dev/re-inspect`.
pub const RE_INSPECT: &str = "anneal.dev/re-inspect";
/// `anneal.dev/clear-error`.
pub const CLEAR_ERROR: &str = "anneal.dev/clear-error";
/// `anneal.dev/reboot` (`{"mode":"hard"|"soft"}`).
pub const REBOOT: &str = "anneal.dev/reboot";

/// A request the manager carries out from an annotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `anneal.dev/operation: park`.
    Park,
    /// `anneal.dev/operation: unpark`.
    Unpark,
    /// `anneal.dev/re-inspect: ""`.
    Reinspect,
    /// `anneal.dev/clear-error: ""`.
    ClearError,
    /// `anneal.dev/reboot: {"mode":"soft"|"hard"}`.
    Reboot {
        /// Forced restart.
        hard: bool,
    },
}

impl Request {
    /// The annotation and the value it is set to.
    fn annotation(self) -> (&'static str, &'static str) {
        match self {
            Self::Park => (OPERATION, "park"),
            Self::Unpark => (OPERATION, "unpark"),
            Self::Reinspect => (RE_INSPECT, ""),
            Self::ClearError => (CLEAR_ERROR, ""),
            Self::Reboot { hard: true } => (REBOOT, r#"{"mode":"hard"}"#),
            Self::Reboot { hard: false } => (REBOOT, r#"{"mode":"soft"}"#),
        }
    }

    /// What the report calls it.
    fn verb(self) -> &'static str {
        match self {
            Self::Park => "park requested",
            Self::Unpark => "unpark requested",
            Self::Reinspect => "re-inspection requested",
            Self::ClearError => "clear-error requested",
            Self::Reboot { hard: true } => "hard reboot requested",
            Self::Reboot { hard: false } => "soft reboot requested",
        }
    }

    /// A note on when the manager acts on it, given the machine's state.
    fn note(self, m: &Machine) -> Option<String> {
        let state = state_of(m);
        match self {
            Self::Park if !matches!(state.as_str(), "Available" | "Provisioned") => Some(format!(
                "the manager parks from Available or Provisioned; the machine is {state}, so the request waits"
            )),
            Self::Unpark if state != "Parked" => Some(format!(
                "the machine is {state}, not Parked: the manager drops the request"
            )),
            Self::Reinspect if !matches!(state.as_str(), "Available" | "Released") => {
                Some(format!(
                    "the manager re-inspects from Available or Released; the machine is {state}, so the request waits"
                ))
            }
            Self::ClearError => {
                let st = m.status.as_ref();
                Some(format!(
                    "errorCount {}, restartCount {}, RetryHeld {}",
                    st.and_then(|s| s.error_count).unwrap_or(0),
                    st.and_then(|s| s.restart_count).unwrap_or(0),
                    condition_status(m, anneal_api::conditions::types::RETRY_HELD)
                ))
            }
            _ => None,
        }
    }
}

/// The Machine `namespace/name`, or a not-found error naming the fix.
pub async fn get(client: &Client, namespace: &str, name: &str) -> Result<Machine, Error> {
    let api: Api<Machine> = Api::namespaced(client.clone(), namespace);
    api.get_opt(name)
        .await
        .map_err(Error::api("reading", "machine", namespace, name))?
        .ok_or_else(|| Error::NotFound {
            kind: "machine",
            namespace: namespace.to_string(),
            name: name.to_string(),
            hint: format!("kubectl get machines -n {namespace}"),
        })
}

/// `status.state` as written on the wire (`-` when unset).
pub fn state_of(m: &Machine) -> String {
    m.status
        .as_ref()
        .and_then(|s| s.state)
        .and_then(|s| serde_json::to_value(s).ok())
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "-".into())
}

/// The status of condition `type_` (`-` when absent).
pub fn condition_status(m: &Machine, type_: &str) -> String {
    m.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .map_or_else(|| "-".into(), |c| c.status.clone())
}

/// `cordon` / `uncordon`: `spec.unclaimable`.
pub async fn set_unclaimable(
    client: &Client,
    namespace: &str,
    name: &str,
    value: bool,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let m = get(client, namespace, name).await?;
    let before = m.spec.unclaimable;
    let verb = if value { "cordoned" } else { "uncordoned" };
    if before == value {
        writeln!(
            out,
            "machine {namespace}/{name} already {verb} (spec.unclaimable: {value})"
        )?;
        return Ok(());
    }
    let api: Api<Machine> = Api::namespaced(client.clone(), namespace);
    let patch = json!({"spec": {"unclaimable": value}});
    api.patch(name, &params(), &Patch::Merge(&patch))
        .await
        .map_err(Error::api("patching", "machine", namespace, name))?;
    writeln!(
        out,
        "machine {namespace}/{name} {verb} (spec.unclaimable: {before} -> {value})"
    )?;
    Ok(())
}

/// Sets the annotation of `req` on the Machine.
pub async fn annotate(
    client: &Client,
    namespace: &str,
    name: &str,
    req: Request,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let m = get(client, namespace, name).await?;
    let (key, value) = req.annotation();
    let before = m
        .annotations()
        .get(key)
        .map_or_else(|| "<unset>".to_string(), |v| format!("{v:?}"));
    let api: Api<Machine> = Api::namespaced(client.clone(), namespace);
    let patch = json!({"metadata": {"annotations": {key: value}}});
    api.patch(name, &params(), &Patch::Merge(&patch))
        .await
        .map_err(Error::api("annotating", "machine", namespace, name))?;
    write!(
        out,
        "machine {namespace}/{name} {} (annotation {key}: {before} -> {value:?})",
        req.verb()
    )?;
    match req.note(&m) {
        Some(note) => writeln!(out, "; {note}")?,
        None => writeln!(out)?,
    }
    Ok(())
}

/// `release`: deletes the MachineClaim bound to the Machine; the manager
/// then releases it per `spec.reclaimPolicy`.
pub async fn release(
    client: &Client,
    namespace: &str,
    name: &str,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let m = get(client, namespace, name).await?;
    let Some(claim_ref) = m.spec.claim_ref.clone() else {
        return Err(Error::NotClaimed {
            namespace: namespace.to_string(),
            name: name.to_string(),
        });
    };
    let claim_ns = claim_ref
        .namespace
        .clone()
        .unwrap_or_else(|| namespace.to_string());
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), &claim_ns);
    let policy = match m.spec.reclaim_policy {
        ReclaimPolicy::Retain => {
            "reclaimPolicy Retain: it stays Released, disks untouched, until `kubectl anneal reinspect`"
        }
        ReclaimPolicy::Recycle => {
            "reclaimPolicy Recycle: its disks are wiped and it returns to Available"
        }
    };
    match claims
        .delete(&claim_ref.name, &DeleteParams::default())
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => {
            return Err(Error::NotFound {
                kind: "machineclaim",
                namespace: claim_ns.clone(),
                name: claim_ref.name.clone(),
                hint: format!(
                    "machine {namespace}/{name} still names it in spec.claimRef; the claim controller clears that, see kubectl describe machine {name} -n {namespace}"
                ),
            });
        }
        Err(e) => {
            return Err(Error::api(
                "deleting",
                "machineclaim",
                &claim_ns,
                &claim_ref.name,
            )(e));
        }
    }
    writeln!(
        out,
        "machine {namespace}/{name} released: machineclaim {claim_ns}/{} deleted (spec.claimRef: {} -> <cleared by the manager>); {policy}",
        claim_ref.name, claim_ref.name
    )?;
    Ok(())
}

fn params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}
