//! The PartitionContent controller: Pending → Publishing → Ready | Failed,
//! and the deletion guard.
//!
//! - A new content gets the finalizer `anneal.dev/content-protection`.
//! - **Publishing**: a verify workload (`anneal-agent store verify`) reads
//!   the stored stream piece by piece against its index; its result gives
//!   `status.sha256` (of the stream), the store gives `status.storageRef`,
//!   and the content is Ready. A piece that does not match fails it
//!   (VerificationFailed, the message names the piece). The same result
//!   gives `status.infoHash`: the BitTorrent v1 info hash of the content's
//!   torrent, made from its index (`anneal_image::torrent`).
//! - **Deletion**: while an Image slot references the content, or an active
//!   DeployRun streams it (the run's `anneal.dev/contents` annotation), the
//!   finalizer stays and condition DeletionBlocked=True names the referrers
//!   and runs (a Warning Event too); once none does, a remove workload
//!   deletes the stored files and the finalizer is released.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anneal_api::conditions::{reasons, types};
use anneal_api::{
    ContentState, DeployRun, Image, NameRef, PartitionContent, PartitionContentStatus, RunPhase,
};
use kube::ResourceExt;
use kube::api::{Api, Patch};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use serde_json::{Value, json};
use tracing::info;

use super::{CONTENT_FINALIZER, ContentContext};
use crate::conditions;
use crate::controller::{Identity, ReconcileError, Scope, drive, is_conflict, patch_params};
use crate::workload::{Kind, Phase, Program, Volume, VolumeSource, WorkloadSpec, workload_name};

const FIELD_MANAGER: &str = "anneal-contents";

/// The PartitionContent controller's identity.
pub const ID: Identity = Identity {
    name: "contents",
    kind: "PartitionContent",
    field_manager: FIELD_MANAGER,
};

/// Errors of a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ContentError {
    /// The API server refused a request.
    #[error(transparent)]
    Kube(#[from] kube::Error),
    /// The executor failed.
    #[error(transparent)]
    Workload(#[from] crate::workload::WorkloadError),
    /// The object has no namespace.
    #[error("PartitionContent without a namespace")]
    NoNamespace,
}

impl ReconcileError for ContentError {
    fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube(e) if is_conflict(e))
    }
    fn kind(&self) -> &'static str {
        match self {
            Self::Kube(_) => "kube",
            Self::Workload(_) => "workload",
            Self::NoNamespace => "no_namespace",
        }
    }
}

struct Ctx {
    content: Arc<ContentContext>,
    images: Store<Image>,
}

fn store_spec(pc: &PartitionContent, verb: &str) -> WorkloadSpec {
    let ns = pc.namespace().unwrap_or_default();
    let name = pc.name_any();
    let prefix = if verb == "verify" { "verify" } else { "rm" };
    let labels: BTreeMap<String, String> =
        [("anneal.dev/content".to_string(), name.clone())].into();
    WorkloadSpec {
        namespace: ns.clone(),
        name: workload_name(prefix, &ns, &name),
        kind: Kind::Job,
        program: Program::Agent,
        args: vec![
            "store".into(),
            verb.into(),
            "--store".into(),
            "${volume:store}".into(),
            "--namespace".into(),
            ns,
            "--content".into(),
            name,
        ],
        volumes: vec![Volume {
            name: "store".into(),
            mount_path: "/store".into(),
            source: VolumeSource::ContentStore,
        }],
        env: BTreeMap::new(),
        labels,
        owner: None,
        deadline_secs: Some(3600),
        access: Default::default(),
    }
}

/// Images of the content's namespace whose slots name it.
pub fn referrers(images: &Store<Image>, pc: &PartitionContent) -> Vec<String> {
    let ns = pc.namespace().unwrap_or_default();
    let name = pc.name_any();
    let mut out: Vec<String> = images
        .state()
        .iter()
        .filter(|i| i.namespace().as_deref() == Some(ns.as_str()))
        .filter(|i| {
            i.spec.layout.slots.iter().any(|s| {
                s.content_ref
                    .as_ref()
                    .is_some_and(|r| r.name == name && r.namespace_or(&ns) == ns)
            })
        })
        .map(|i| i.name_any())
        .collect();
    out.sort();
    out
}

fn event(
    ctx: &ContentContext,
    pc: &PartitionContent,
    type_: EventType,
    reason: &str,
    note: String,
) {
    crate::controller::publish_event(&ctx.recorder, pc, type_, "Publish", reason, note);
}

async fn write_status(
    pc: &PartitionContent,
    status: &PartitionContentStatus,
    ctx: &ContentContext,
) -> Result<(), ContentError> {
    if pc.status.as_ref() == Some(status) {
        return Ok(());
    }
    let api: Api<PartitionContent> =
        Api::namespaced(ctx.client.clone(), &pc.namespace().unwrap_or_default());
    let patch = json!({
        "metadata": {"resourceVersion": pc.resource_version()},
        "status": status,
    });
    api.patch_status(
        &pc.name_any(),
        &patch_params(FIELD_MANAGER),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

async fn set_finalizers(
    pc: &PartitionContent,
    finalizers: Vec<String>,
    ctx: &ContentContext,
) -> Result<(), ContentError> {
    let api: Api<PartitionContent> =
        Api::namespaced(ctx.client.clone(), &pc.namespace().unwrap_or_default());
    let patch = json!({
        "metadata": {"resourceVersion": pc.resource_version(), "finalizers": finalizers},
    });
    api.patch(
        &pc.name_any(),
        &patch_params(FIELD_MANAGER),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

/// The Image owners of a content (references of kind Image in anneal.dev).
pub fn image_owners(pc: &PartitionContent) -> Vec<(&str, &str)> {
    pc.owner_references()
        .iter()
        .filter(|o| o.kind == "Image" && o.api_version.starts_with("anneal.dev/"))
        .map(|o| (o.name.as_str(), o.uid.as_str()))
        .collect()
}

/// A content is orphaned when it had Image owners, every one of them is
/// gone (by name and UID, asked of the API server, not a cache) and no
/// Image of its namespace references it. A content no Image ever owned
/// (created by hand, or before its Image) is never collected.
async fn orphaned(pc: &PartitionContent, ctx: &Ctx) -> Result<bool, ContentError> {
    let owners = image_owners(pc);
    if owners.is_empty() || !referrers(&ctx.images, pc).is_empty() {
        return Ok(false);
    }
    let api: Api<Image> = Api::namespaced(
        ctx.content.client.clone(),
        &pc.namespace().unwrap_or_default(),
    );
    for (name, uid) in &owners {
        if let Some(i) = api.get_opt(name).await?
            && i.uid().as_deref() == Some(*uid)
        {
            return Ok(false);
        }
    }
    let name = pc.name_any();
    let referenced = api.list(&Default::default()).await?.items.iter().any(|i| {
        i.spec
            .layout
            .slots
            .iter()
            .any(|s| s.content_ref.as_ref().is_some_and(|r| r.name == name))
    });
    Ok(!referenced)
}

/// The active DeployRuns (not Succeeded or Failed) whose plan streams `pc`
/// (their [`CONTENTS_ANNOTATION`](crate::deploy::runs::CONTENTS_ANNOTATION)),
/// as `name (phase)`, sorted.
pub fn active_runs_using(runs: &[DeployRun], pc: &PartitionContent) -> Vec<String> {
    let name = pc.name_any();
    let mut out: Vec<String> = runs
        .iter()
        .filter(|r| r.namespace() == pc.namespace())
        .filter(|r| {
            !matches!(
                r.status.as_ref().and_then(|s| s.phase),
                Some(RunPhase::Succeeded | RunPhase::Failed)
            )
        })
        .filter(|r| {
            r.annotations()
                .get(crate::deploy::runs::CONTENTS_ANNOTATION)
                .is_some_and(|v| v.split(',').any(|c| c == name))
        })
        .map(|r| {
            let phase = r
                .status
                .as_ref()
                .and_then(|s| s.phase)
                .unwrap_or(RunPhase::Pending);
            format!("{} ({phase:?})", r.name_any())
        })
        .collect();
    out.sort();
    out
}

async fn delete(pc: &PartitionContent, ctx: &Ctx) -> Result<Action, ContentError> {
    let c = &ctx.content;
    let refs = referrers(&ctx.images, pc);
    let runs = Api::<DeployRun>::namespaced(c.client.clone(), &pc.namespace().unwrap_or_default())
        .list(&Default::default())
        .await?
        .items;
    let active = active_runs_using(&runs, pc);
    let mut status = pc.status.clone().unwrap_or_default();
    let generation = pc.metadata.generation;
    if !refs.is_empty() || !active.is_empty() {
        let mut why = Vec::new();
        if !refs.is_empty() {
            why.push(format!(
                "referenced by Image {}; delete {} first",
                refs.join(", "),
                if refs.len() == 1 { "it" } else { "them" }
            ));
        }
        if !active.is_empty() {
            why.push(format!(
                "in use by DeployRun {}: removed once the run ends",
                active.join(", ")
            ));
        }
        let message = why.join("; ");
        let changed = conditions::set(
            &mut status.conditions,
            types::DELETION_BLOCKED,
            true,
            reasons::REFERENCED,
            &message,
            generation,
        );
        write_status(pc, &status, c).await?;
        if changed {
            info!(content = %pc.name_any(), %message, "deletion blocked");
            event(c, pc, EventType::Warning, types::DELETION_BLOCKED, message);
        }
        // The Image watch wakes us when a referrer goes; a run's end is
        // polled.
        return Ok(Action::requeue(Duration::from_secs(if active.is_empty() {
            60
        } else {
            5
        })));
    }
    if conditions::set(
        &mut status.conditions,
        types::DELETION_BLOCKED,
        false,
        reasons::UNREFERENCED,
        "no Image references the content; removing its stored files",
        generation,
    ) {
        write_status(pc, &status, c).await?;
    }
    let spec = store_spec(pc, "remove");
    c.executor.ensure(&spec).await?;
    let obs = c.executor.observe(&spec).await?;
    match obs.phase {
        Phase::Absent | Phase::Running => Ok(Action::requeue(Duration::from_millis(500))),
        Phase::Failed => {
            let (reason, message) = obs.failure();
            event(
                c,
                pc,
                EventType::Warning,
                &reason,
                format!("removing the stored files failed (retried): {message}"),
            );
            c.executor.remove(&spec).await?;
            Ok(Action::requeue(Duration::from_secs(10)))
        }
        Phase::Succeeded => {
            c.executor.remove(&spec).await?;
            let rest: Vec<String> = pc
                .finalizers()
                .iter()
                .filter(|f| f.as_str() != CONTENT_FINALIZER)
                .cloned()
                .collect();
            set_finalizers(pc, rest, c).await?;
            info!(content = %pc.name_any(), "stored files removed; finalizer released");
            Ok(Action::await_change())
        }
    }
}

async fn reconcile(pc: Arc<PartitionContent>, ctx: Arc<Ctx>) -> Result<Action, ContentError> {
    pc.namespace().ok_or(ContentError::NoNamespace)?;
    let c = &ctx.content;
    let has_finalizer = pc.finalizers().iter().any(|f| f == CONTENT_FINALIZER);
    if pc.metadata.deletion_timestamp.is_some() {
        if has_finalizer {
            return delete(&pc, &ctx).await;
        }
        return Ok(Action::await_change());
    }
    if !has_finalizer {
        let mut f = pc.finalizers().to_vec();
        f.push(CONTENT_FINALIZER.to_string());
        set_finalizers(&pc, f, c).await?;
        return Ok(Action::await_change());
    }
    if orphaned(&pc, &ctx).await? {
        info!(content = %pc.name_any(), "no Image owns or references the content any more: collected");
        event(
            c,
            &pc,
            EventType::Normal,
            "Orphaned",
            "every Image that owned this content is gone and none references it: deleted".into(),
        );
        Api::<PartitionContent>::namespaced(c.client.clone(), &pc.namespace().unwrap_or_default())
            .delete(&pc.name_any(), &Default::default())
            .await?;
        return Ok(Action::await_change());
    }
    let mut status = pc.status.clone().unwrap_or_default();
    let generation = pc.metadata.generation;
    status.observed_generation = generation;
    match status.state {
        Some(ContentState::Ready | ContentState::Failed) => Ok(Action::await_change()),
        None | Some(ContentState::Pending) => {
            let spec = store_spec(&pc, "verify");
            c.executor.ensure(&spec).await?;
            status.state = Some(ContentState::Publishing);
            conditions::set(
                &mut status.conditions,
                types::READY,
                false,
                reasons::PUBLISHING,
                "verifying every piece of the stored stream against the index",
                generation,
            );
            write_status(&pc, &status, c).await?;
            Ok(Action::requeue(Duration::from_millis(500)))
        }
        Some(ContentState::Publishing) => {
            let spec = store_spec(&pc, "verify");
            c.executor.ensure(&spec).await?;
            let obs = c.executor.observe(&spec).await?;
            match obs.phase {
                Phase::Absent | Phase::Running => Ok(Action::requeue(Duration::from_millis(500))),
                Phase::Failed => {
                    let (_, message) = obs.failure();
                    status.state = Some(ContentState::Failed);
                    conditions::set(
                        &mut status.conditions,
                        types::READY,
                        false,
                        reasons::VERIFICATION_FAILED,
                        &message,
                        generation,
                    );
                    write_status(&pc, &status, c).await?;
                    event(
                        c,
                        &pc,
                        EventType::Warning,
                        reasons::VERIFICATION_FAILED,
                        message,
                    );
                    c.executor.remove(&spec).await?;
                    Ok(Action::await_change())
                }
                Phase::Succeeded => {
                    let out = obs.outcome.unwrap_or_default();
                    let sha = out
                        .get("sha256")
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    let pieces = out.get("pieces").and_then(Value::as_u64).unwrap_or(0);
                    status.state = Some(ContentState::Ready);
                    status.sha256 = Some(sha.to_string());
                    status.index_sha256 = out
                        .get("indexSha256")
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    status.info_hash = out
                        .get("infoHash")
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    status.storage_ref = Some(NameRef::new(&c.store_name));
                    let message = format!(
                        "{pieces} pieces verified; stream sha256 {sha}; stored in {}",
                        c.store_name
                    );
                    conditions::set(
                        &mut status.conditions,
                        types::READY,
                        true,
                        reasons::VERIFIED,
                        &message,
                        generation,
                    );
                    write_status(&pc, &status, c).await?;
                    info!(content = %pc.name_any(), %sha, pieces, "content ready");
                    event(c, &pc, EventType::Normal, reasons::VERIFIED, message);
                    c.executor.remove(&spec).await?;
                    Ok(Action::await_change())
                }
            }
        }
    }
}

/// Runs the PartitionContent controller in `scope` until it is cancelled.
pub async fn controller(scope: Scope, content: Arc<ContentContext>) {
    let (images, image_stream) = scope.reflected::<Image>();
    let controller = Controller::new(scope.api::<PartitionContent>(), watcher::Config::default())
        .watches_stream(image_stream, |i: Image| {
            let ns = i.namespace().unwrap_or_default();
            i.spec
                .layout
                .slots
                .iter()
                .filter_map(|s| s.content_ref.as_ref())
                .map(|r| ObjectRef::new(&r.name).within(r.namespace_or(&ns)))
                .collect::<Vec<_>>()
        });
    let ctx = Arc::new(Ctx { content, images });
    drive(ID, &scope, controller, reconcile, ctx).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(name: &str, ns: &str, contents: &str, phase: Option<&str>) -> DeployRun {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": name, "namespace": ns,
                "annotations": {"anneal.dev/contents": contents}},
            "spec": {"machineRef": {"name": "m"}, "claimRef": {"name": "c"}},
            "status": phase.map_or(json!({}), |p| json!({"phase": p})),
        }))
        .unwrap()
    }

    #[test]
    fn only_active_runs_of_the_namespace_that_stream_the_content_hold_it() {
        let pc: PartitionContent = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "PartitionContent",
            "metadata": {"name": "deb-p3", "namespace": "ns"},
            "spec": {"fsType": "ext4", "usedBytes": 1, "sizeBytes": 1, "lastExtentEnd": 1,
                     "blockSize": 4096, "pieceLength": 4194304}
        }))
        .unwrap();
        let runs = [
            run("m-1", "ns", "deb-p1,deb-p3", Some("WritingContent")),
            run("m-2", "ns", "deb-p3", None),
            run("m-3", "ns", "deb-p3", Some("Succeeded")),
            run("m-4", "ns", "deb-p3", Some("Failed")),
            run("m-5", "other", "deb-p3", Some("WritingContent")),
            run("m-6", "ns", "deb-p33,xdeb-p3", Some("WritingContent")),
        ];
        assert_eq!(
            active_runs_using(&runs, &pc),
            ["m-1 (WritingContent)", "m-2 (Pending)"]
        );
    }
}
