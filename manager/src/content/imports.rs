//! The ImageImport controller: Pending → Ingesting → Succeeded | Failed.
//!
//! - **Pending**: refuses a taken name before any work (the Image name, or a
//!   PartitionContent named `<prefix>-p<N>` that another import made), and a
//!   namespace with nothing left of its store quota (QuotaExceeded; see
//!   docs/images.md, "Store quota"), then starts the ingest workload
//!   (allowed to capture at most what is left: `--max-store-bytes`) (`anneal-agent ingest`, see
//!   [`crate::workload`]) and moves to Ingesting.
//! - **Ingesting**: copies the workload's progress lines into
//!   `status.progress` (checked every second, written when changed). When the
//!   workload ends with its result, creates one PartitionContent per captured
//!   partition and then the Image, never overwriting: an existing object
//!   that this import did not create fails the import with NameTaken naming
//!   it, and what this import had already created is deleted again. A
//!   failed workload fails the import with the ingest's own reason
//!   (ChecksumMismatch, SourceNotFound, TLSError, …) and message.
//! - **Succeeded / Failed**: `completionTime` is set once; with
//!   `ttlSecondsAfterFinished` the import is deleted that long after it (what
//!   it created stays).
//!
//! Every transition writes condition `Succeeded` and an Event (Warning for
//! a failure). The objects it creates carry the label `anneal.dev/import`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anneal_api::conditions::{reasons, types};
use anneal_api::{
    ByteProgress, ContentSource, Image, ImageImport, ImageImportStatus, ImageSpec, ImportState,
    Layout, NameRef, PartitionContent, PartitionContentSpec, PartitionTable, Slot, SlotRole,
    SourceFormat, Time,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::{info, warn};

use super::{ContentContext, IMPORT_LABEL};
use crate::conditions;
use crate::controller::{Identity, ReconcileError, Scope, drive, is_conflict, patch_params};
use crate::workload::{
    Kind, Observation, Phase, Program, Volume, VolumeSource, WorkloadSpec, workload_name,
};

const FIELD_MANAGER: &str = "anneal-imports";

/// The ImageImport controller's identity.
pub const ID: Identity = Identity {
    name: "imports",
    kind: "ImageImport",
    field_manager: FIELD_MANAGER,
};

/// How often a running ingest is looked at.
const POLL: Duration = Duration::from_secs(1);

/// Errors of a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The API server refused a request.
    #[error(transparent)]
    Kube(#[from] kube::Error),
    /// The executor failed.
    #[error(transparent)]
    Workload(#[from] crate::workload::WorkloadError),
    /// The object has no namespace.
    #[error("ImageImport without a namespace")]
    NoNamespace,
}

impl ReconcileError for ImportError {
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

/// One captured partition, as `anneal-agent ingest` reports it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct IngestedContent {
    /// `<prefix>-p<N>`.
    pub name: String,
    /// Source partition number.
    pub partition_number: i32,
    /// File system.
    #[serde(default)]
    pub fs_type: Option<String>,
    /// Bytes in the stream.
    pub used_bytes: i64,
    /// Partition size.
    pub size_bytes: i64,
    /// End of the last extent.
    pub last_extent_end: i64,
    /// Block size.
    pub block_size: i64,
    /// Piece length.
    pub piece_length: i64,
}

/// `anneal-agent ingest`'s result line.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IngestResult {
    /// SHA-256 of the source, hex; empty when the import gave no checksum
    /// (the source is hashed only to verify one).
    #[serde(default)]
    pub source_sha256: String,
    /// The source's layout (absent for a single partclone image).
    #[serde(default)]
    pub layout: Option<anneal_image::layout::Layout>,
    /// The contents, in partition order.
    pub contents: Vec<IngestedContent>,
}

/// The ingest workload of an import.
pub fn ingest_spec(imp: &ImageImport, ctx: &ContentContext) -> WorkloadSpec {
    let ns = imp.namespace().unwrap_or_default();
    let name = imp.name_any();
    let mut args = vec![
        "ingest".to_string(),
        "--url".into(),
        imp.spec.source.url.clone(),
        "--store".into(),
        "${volume:store}".into(),
        "--scratch".into(),
        "${volume:scratch}".into(),
        "--namespace".into(),
        ns.clone(),
        "--import".into(),
        name.clone(),
        "--prefix".into(),
        imp.spec.content_prefix.clone(),
    ];
    if let Some(c) = &imp.spec.source.checksum {
        args.extend(["--checksum".into(), c.clone()]);
    }
    if let Some(f) = imp.spec.source.format {
        let f = match f {
            SourceFormat::Raw => "raw",
            SourceFormat::Qcow2 => "qcow2",
            SourceFormat::Partclone => "partclone",
        };
        args.extend(["--format".into(), f.into()]);
    }
    if let Some(max) = ctx.max_source_bytes {
        args.extend(["--max-bytes".into(), max.to_string()]);
    }
    let mut volumes = vec![
        Volume {
            name: "store".into(),
            mount_path: "/store".into(),
            source: VolumeSource::ContentStore,
        },
        Volume {
            name: "scratch".into(),
            mount_path: "/scratch".into(),
            source: VolumeSource::Scratch,
        },
    ];
    if imp.spec.source.ca_bundle_secret_ref.is_some() {
        // the files are filled in by `with_ca_bundle` when the job starts
        args.extend([
            "--ca-bundle".into(),
            format!("${{volume:{CA_VOLUME}}}/{CA_FILE}"),
        ]);
        volumes.push(Volume {
            name: CA_VOLUME.into(),
            mount_path: "/ca".into(),
            source: VolumeSource::Files(BTreeMap::new()),
        });
    }
    let mut labels = BTreeMap::new();
    labels.insert(IMPORT_LABEL.to_string(), name.clone());
    WorkloadSpec {
        namespace: ns.clone(),
        name: workload_name("ingest", &ns, &name),
        kind: Kind::Job,
        program: Program::Agent,
        args,
        volumes,
        env: BTreeMap::new(),
        labels,
        owner: imp.controller_owner_ref(&()),
        deadline_secs: Some(ctx.ingest_deadline_secs),
        access: Default::default(),
    }
}

/// `spec` allowed to store at most `budget` bytes (`None`: unlimited).
fn with_store_budget(mut spec: WorkloadSpec, budget: Option<u64>) -> WorkloadSpec {
    if let Some(b) = budget {
        spec.args
            .extend(["--max-store-bytes".to_string(), b.to_string()]);
    }
    spec
}

/// What the import may still store in its namespace (docs/images.md,
/// "Store quota"): `Ok(None)` unlimited, `Ok(Some(bytes))`; the refusal's
/// message when nothing is left. A `staged://` source's own file is not
/// counted: the contents replace it.
async fn store_budget(
    imp: &ImageImport,
    ns: &str,
    ctx: &ContentContext,
) -> Result<Result<Option<u64>, String>, ImportError> {
    use super::quota;
    if ctx.store_quota.limit(ns).is_none() {
        return Ok(Ok(None));
    }
    let consumed = imp.spec.source.url.strip_prefix("staged://");
    let used =
        quota::namespace_usage(&ctx.client, ctx.executor.local_store(), ns, consumed).await?;
    Ok(quota::budget(&ctx.store_quota, ns, used).map_err(|r| r.to_string()))
}

/// The ingest's failure message with what only the manager knows: the
/// flag behind a size cap, the quota and its fix.
fn explain_failure(reason: &str, message: String, ns: &str, ctx: &ContentContext) -> String {
    match reason {
        reasons::QUOTA_EXCEEDED => {
            let quota = ctx
                .store_quota
                .limit(ns)
                .map(|q| format!("the quota is {q} bytes; "))
                .unwrap_or_default();
            format!("{message}; {quota}{}", super::quota::fix(ns))
        }
        "SourceTooLarge" => format!(
            "{message} (the manager's --max-source-bytes: import a smaller or compressed image, or ask the administrator to raise it)"
        ),
        _ => message,
    }
}

/// The ingest job's volume holding the CA bundle, and its file.
const CA_VOLUME: &str = "ca";
const CA_FILE: &str = "ca.crt";

/// `spec` with the CA bundle of `spec.source.caBundleSecretRef` (read from
/// the import's namespace) in its files volume; the reason and message why
/// it cannot be used otherwise.
async fn with_ca_bundle(
    mut spec: WorkloadSpec,
    imp: &ImageImport,
    ns: &str,
    ctx: &ContentContext,
) -> Result<Result<WorkloadSpec, String>, ImportError> {
    let Some(r) = &imp.spec.source.ca_bundle_secret_ref else {
        return Ok(Ok(spec));
    };
    let key = if r.key.is_empty() {
        CA_FILE
    } else {
        r.key.as_str()
    };
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), ns);
    let Some(secret) = secrets.get_opt(&r.name).await? else {
        return Ok(Err(format!(
            "spec.source.caBundleSecretRef: Secret {ns}/{} not found; create it with the PEM CA bundle in key {key}",
            r.name
        )));
    };
    let pem = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|s| s.clone().into_bytes())
        });
    let Some(pem) = pem.filter(|p| p.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----"))
    else {
        return Ok(Err(format!(
            "spec.source.caBundleSecretRef: Secret {ns}/{} has no PEM certificate in key {key}; put the CA bundle (-----BEGIN CERTIFICATE-----) there",
            r.name
        )));
    };
    for v in &mut spec.volumes {
        if v.name == CA_VOLUME {
            v.source = VolumeSource::Files(BTreeMap::from([(CA_FILE.to_string(), pem.clone())]));
        }
    }
    Ok(Ok(spec))
}

fn event(ctx: &ContentContext, imp: &ImageImport, type_: EventType, reason: &str, note: String) {
    crate::controller::publish_event(&ctx.recorder, imp, type_, "Import", reason, note);
}

async fn write_status(
    imp: &ImageImport,
    status: &ImageImportStatus,
    ctx: &ContentContext,
) -> Result<(), ImportError> {
    if imp.status.as_ref() == Some(status) {
        return Ok(());
    }
    let api: Api<ImageImport> =
        Api::namespaced(ctx.client.clone(), &imp.namespace().unwrap_or_default());
    let patch = json!({
        "metadata": {"resourceVersion": imp.resource_version()},
        "status": status,
    });
    api.patch_status(
        &imp.name_any(),
        &patch_params(FIELD_MANAGER),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(())
}

/// Pending while the CA bundle Secret is missing or holds no certificate
/// (created in any order with the import): the condition names the Secret
/// and the fix; looked at again every 5 s.
async fn ca_bundle_missing(
    imp: &ImageImport,
    status: &ImageImportStatus,
    message: String,
    ctx: &ContentContext,
) -> Result<Action, ImportError> {
    let mut next = status.clone();
    next.state = Some(ImportState::Pending);
    next.observed_generation = imp.metadata.generation;
    let changed = conditions::set(
        &mut next.conditions,
        types::SUCCEEDED,
        false,
        reasons::CA_BUNDLE_UNAVAILABLE,
        &message,
        imp.metadata.generation,
    );
    write_status(imp, &next, ctx).await?;
    if changed {
        warn!(import = %imp.name_any(), %message, "waiting for the CA bundle");
        event(
            ctx,
            imp,
            EventType::Warning,
            reasons::CA_BUNDLE_UNAVAILABLE,
            message,
        );
    }
    Ok(Action::requeue(Duration::from_secs(5)))
}

async fn fail(
    imp: &ImageImport,
    reason: &str,
    message: String,
    ctx: &ContentContext,
) -> Result<Action, ImportError> {
    let mut status = imp.status.clone().unwrap_or_default();
    status.state = Some(ImportState::Failed);
    status
        .completion_time
        .get_or_insert_with(|| Time(Timestamp::now()));
    conditions::set(
        &mut status.conditions,
        types::SUCCEEDED,
        false,
        reason,
        &message,
        imp.metadata.generation,
    );
    status.observed_generation = imp.metadata.generation;
    write_status(imp, &status, ctx).await?;
    warn!(import = %imp.name_any(), reason, %message, "import failed");
    event(ctx, imp, EventType::Warning, reason, message);
    Ok(Action::requeue(Duration::from_secs(1)))
}

/// A name this import may not take: an object of `kind` that exists and was
/// not made by it.
fn foreign<K: Resource>(obj: &K, import: &str) -> bool {
    obj.meta()
        .labels
        .as_ref()
        .and_then(|l| l.get(IMPORT_LABEL))
        .map(String::as_str)
        != Some(import)
}

/// Whether `name` is `<prefix>-p<digits>`.
fn is_content_of(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|r| r.strip_prefix("-p"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A taken name, if any, before the ingest starts.
async fn taken_name(
    imp: &ImageImport,
    ns: &str,
    ctx: &ContentContext,
) -> Result<Option<String>, ImportError> {
    let name = imp.name_any();
    let images: Api<Image> = Api::namespaced(ctx.client.clone(), ns);
    if let Some(i) = images.get_opt(&imp.spec.image_name).await?
        && foreign(&i, &name)
    {
        return Ok(Some(format!(
            "spec.imageName: Image {} already exists in namespace {ns}; choose another name or delete it",
            i.name_any()
        )));
    }
    let contents: Api<PartitionContent> = Api::namespaced(ctx.client.clone(), ns);
    for pc in contents.list(&ListParams::default()).await?.items {
        if is_content_of(&pc.name_any(), &imp.spec.content_prefix) && foreign(&pc, &name) {
            return Ok(Some(format!(
                "spec.contentPrefix: PartitionContent {} already exists in namespace {ns}; choose another prefix",
                pc.name_any()
            )));
        }
    }
    Ok(None)
}

fn role(r: anneal_image::layout::Role) -> SlotRole {
    use anneal_image::layout::Role;
    match r {
        Role::Esp => SlotRole::Esp,
        Role::Data => SlotRole::Data,
        Role::Swap => SlotRole::Swap,
        Role::Msr => SlotRole::Msr,
    }
}

/// The Image layout of an ingest result.
pub fn image_layout(result: &IngestResult) -> Layout {
    use anneal_image::layout::TableKind;
    match &result.layout {
        Some(l) => Layout {
            partition_table: match l.partition_table {
                TableKind::Gpt => PartitionTable::Gpt,
                TableKind::Mbr => PartitionTable::Mbr,
            },
            slots: l
                .slots
                .iter()
                .map(|s| {
                    let content = result
                        .contents
                        .iter()
                        .find(|c| c.partition_number as u32 == s.number)
                        .map(|c| NameRef::new(&c.name));
                    let role = role(s.role);
                    Slot {
                        number: s.number as i32,
                        role,
                        // A blank slot keeps its file system only for swap
                        // (made by mkswap with the saved UUID).
                        fs_type: None,
                        uuid: if content.is_none() && role == SlotRole::Swap {
                            s.uuid.clone()
                        } else {
                            None
                        },
                        type_guid: match (&s.type_guid, s.mbr_type) {
                            (Some(g), _) => Some(g.to_lowercase()),
                            (None, Some(t)) => Some(format!("{t:02x}")),
                            (None, None) => None,
                        },
                        part_uuid: s.part_uuid.as_ref().map(|u| u.to_lowercase()),
                        size_bytes: Some(s.size_bytes as i64),
                        grow: s.grow.then_some(true),
                        content_ref: content,
                    }
                })
                .collect(),
        },
        None => Layout {
            partition_table: PartitionTable::Gpt,
            slots: result
                .contents
                .iter()
                .map(|c| Slot {
                    number: c.partition_number,
                    role: if c.fs_type.as_deref() == Some("vfat") {
                        SlotRole::Esp
                    } else {
                        SlotRole::Data
                    },
                    content_ref: Some(NameRef::new(&c.name)),
                    size_bytes: Some(c.size_bytes),
                    ..Slot::default()
                })
                .collect(),
        },
    }
}

/// Creates the contents and the Image of a finished ingest. `Err(message)`
/// when a name is taken (what this call created is deleted again).
async fn create_objects(
    imp: &ImageImport,
    ns: &str,
    result: &IngestResult,
    ctx: &ContentContext,
) -> Result<Result<(), String>, ImportError> {
    let name = imp.name_any();
    let labels: BTreeMap<String, String> = [(IMPORT_LABEL.to_string(), name.clone())].into();
    let contents: Api<PartitionContent> = Api::namespaced(ctx.client.clone(), ns);
    let images: Api<Image> = Api::namespaced(ctx.client.clone(), ns);
    let mut created: Vec<String> = Vec::new();
    let mut taken = None;
    for c in &result.contents {
        let pc = PartitionContent {
            metadata: ObjectMeta {
                name: Some(c.name.clone()),
                namespace: Some(ns.to_string()),
                labels: Some(labels.clone()),
                ..ObjectMeta::default()
            },
            spec: PartitionContentSpec {
                fs_type: c.fs_type.clone().filter(|f| !f.is_empty()),
                used_bytes: c.used_bytes,
                size_bytes: c.size_bytes,
                last_extent_end: c.last_extent_end,
                block_size: c.block_size,
                piece_length: c.piece_length,
                source: Some(ContentSource {
                    import_name: name.clone(),
                    partition_number: c.partition_number,
                }),
            },
            status: None,
        };
        match contents.create(&PostParams::default(), &pc).await {
            Ok(_) => created.push(c.name.clone()),
            Err(kube::Error::Api(s)) if s.code == 409 => match contents.get_opt(&c.name).await? {
                Some(existing) if !foreign(&existing, &name) => {}
                _ => {
                    taken = Some(format!(
                        "PartitionContent {} already exists in namespace {ns}; choose another spec.contentPrefix",
                        c.name
                    ));
                    break;
                }
            },
            Err(e) => return Err(e.into()),
        }
    }
    if taken.is_none() {
        let layout = image_layout(result);
        let has_esp = layout.slots.iter().any(|s| s.role == SlotRole::Esp);
        let image = Image {
            metadata: ObjectMeta {
                name: Some(imp.spec.image_name.clone()),
                namespace: Some(ns.to_string()),
                labels: Some(labels.clone()),
                ..ObjectMeta::default()
            },
            spec: ImageSpec {
                os_family: imp.spec.os_family,
                bootable: imp.spec.bootable,
                layout,
                params: imp.spec.params.clone(),
                post_hook_refs: imp.spec.post_hook_refs.clone(),
                day1_defaults: imp.spec.day1_defaults.clone(),
            },
            status: None,
        };
        if imp.spec.bootable && !has_esp {
            taken = Some(
                "spec.bootable is true but the source has no EFI system partition; import it with bootable: false".to_string(),
            );
        } else {
            match images.create(&PostParams::default(), &image).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    match images.get_opt(&imp.spec.image_name).await? {
                        Some(existing) if !foreign(&existing, &name) => {}
                        _ => {
                            taken = Some(format!(
                                "spec.imageName: Image {} already exists in namespace {ns}",
                                imp.spec.image_name
                            ))
                        }
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    if let Some(message) = taken {
        // Leave nothing behind: the contents this call created go (their
        // finalizer removes the stored files).
        for c in created {
            let _ = contents.delete(&c, &DeleteParams::default()).await;
        }
        return Ok(Err(message));
    }
    Ok(Ok(()))
}

fn progress_of(v: &Value, done: bool) -> ByteProgress {
    let fetched = v.get("bytesFetched").and_then(Value::as_i64).unwrap_or(0);
    let total = v.get("bytesTotal").and_then(Value::as_i64).unwrap_or(0);
    let percent = if done {
        100
    } else if total > 0 {
        ((fetched.min(total) * 100) / total).min(99) as i32
    } else {
        0
    };
    ByteProgress {
        bytes_done: fetched,
        bytes_total: total,
        percent,
        phase: v.get("phase").and_then(Value::as_str).map(str::to_string),
        bytes_captured: v.get("bytesCaptured").and_then(Value::as_i64),
    }
}

/// A finished ingest job: creates the Image and its contents from the
/// job's result and marks the import Succeeded (Failed when the result
/// cannot be read or a name is taken).
async fn succeeded(
    imp: &ImageImport,
    ns: &str,
    status: &ImageImportStatus,
    obs: &Observation,
    ctx: &ContentContext,
) -> Result<Action, ImportError> {
    let name = imp.name_any();
    let outcome = obs.outcome.clone().unwrap_or_default();
    let result: IngestResult = match serde_json::from_value(outcome) {
        Ok(r) => r,
        Err(e) => {
            return fail(
                imp,
                reasons::WORKLOAD_FAILED,
                format!("the ingest result cannot be read: {e}"),
                ctx,
            )
            .await;
        }
    };
    if let Err(message) = create_objects(imp, ns, &result, ctx).await? {
        return fail(imp, reasons::NAME_TAKEN, message, ctx).await;
    }
    let mut next = status.clone();
    next.state = Some(ImportState::Succeeded);
    next.image_ref = Some(NameRef::new(&imp.spec.image_name));
    next.content_refs = result
        .contents
        .iter()
        .map(|c| NameRef::new(&c.name))
        .collect();
    next.completion_time = Some(Time(Timestamp::now()));
    let mut p = obs
        .progress
        .as_ref()
        .map(|p| progress_of(p, true))
        .unwrap_or_default();
    p.percent = 100;
    p.phase = Some("Done".into());
    next.progress = Some(p);
    let verified = if result.source_sha256.is_empty() {
        "no checksum given: the source was not verified".to_owned()
    } else {
        format!("checksum verified: sha256 {}", result.source_sha256)
    };
    let message = format!(
        "Image {} and {} PartitionContent(s) created from {} ({verified})",
        imp.spec.image_name,
        result.contents.len(),
        imp.spec.source.url,
    );
    conditions::set(
        &mut next.conditions,
        types::SUCCEEDED,
        true,
        reasons::IMPORTED,
        &message,
        imp.metadata.generation,
    );
    write_status(imp, &next, ctx).await?;
    info!(import = %name, image = %imp.spec.image_name, contents = result.contents.len(), "import succeeded");
    event(ctx, imp, EventType::Normal, reasons::IMPORTED, message);
    Ok(Action::requeue(Duration::from_secs(1)))
}

async fn reconcile(imp: Arc<ImageImport>, ctx: Arc<ContentContext>) -> Result<Action, ImportError> {
    let ns = imp.namespace().ok_or(ImportError::NoNamespace)?;
    let name = imp.name_any();
    let status = imp.status.clone().unwrap_or_default();
    let spec = ingest_spec(&imp, &ctx);
    match status.state {
        Some(ImportState::Succeeded | ImportState::Failed) => {
            ctx.executor.remove(&spec).await?;
            let Some(ttl) = imp.spec.ttl_seconds_after_finished else {
                return Ok(Action::await_change());
            };
            let done = status
                .completion_time
                .as_ref()
                .map(|t| t.0)
                .unwrap_or_else(Timestamp::now);
            let age = Timestamp::now().duration_since(done).as_secs().max(0);
            if age >= ttl {
                let api: Api<ImageImport> = Api::namespaced(ctx.client.clone(), &ns);
                info!(import = %name, ttl, "ttlSecondsAfterFinished passed; deleting the import");
                match api.delete(&name, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(e.into()),
                }
                return Ok(Action::await_change());
            }
            Ok(Action::requeue(Duration::from_secs((ttl - age) as u64 + 1)))
        }
        None | Some(ImportState::Pending) => {
            if let Some(message) = taken_name(&imp, &ns, &ctx).await? {
                return fail(&imp, reasons::NAME_TAKEN, message, &ctx).await;
            }
            let spec = match store_budget(&imp, &ns, &ctx).await? {
                Ok(budget) => with_store_budget(spec, budget),
                Err(message) => return fail(&imp, reasons::QUOTA_EXCEEDED, message, &ctx).await,
            };
            let spec = match with_ca_bundle(spec, &imp, &ns, &ctx).await? {
                Ok(s) => s,
                Err(message) => return ca_bundle_missing(&imp, &status, message, &ctx).await,
            };
            ctx.executor.ensure(&spec).await?;
            let mut next = status.clone();
            next.state = Some(ImportState::Ingesting);
            next.progress = Some(ByteProgress {
                phase: Some("Fetching".into()),
                ..ByteProgress::default()
            });
            next.observed_generation = imp.metadata.generation;
            conditions::set(
                &mut next.conditions,
                types::SUCCEEDED,
                false,
                reasons::INGESTING,
                format!("ingesting {}", imp.spec.source.url),
                imp.metadata.generation,
            );
            write_status(&imp, &next, &ctx).await?;
            info!(import = %name, workload = %spec.name, "ingest started");
            event(
                &ctx,
                &imp,
                EventType::Normal,
                reasons::INGESTING,
                format!(
                    "ingest job {} started for {}",
                    spec.name, imp.spec.source.url
                ),
            );
            Ok(Action::requeue(POLL))
        }
        Some(ImportState::Ingesting) => {
            // Idempotent: a manager that restarted finds the job (or its
            // result) where it left it; a job that vanished is started
            // again (with its CA bundle).
            let mut obs = ctx.executor.observe(&spec).await?;
            if obs.phase == Phase::Absent {
                let spec = match store_budget(&imp, &ns, &ctx).await? {
                    Ok(budget) => with_store_budget(spec.clone(), budget),
                    Err(message) => {
                        return fail(&imp, reasons::QUOTA_EXCEEDED, message, &ctx).await;
                    }
                };
                let spec = match with_ca_bundle(spec, &imp, &ns, &ctx).await? {
                    Ok(s) => s,
                    Err(message) => {
                        return fail(&imp, reasons::CA_BUNDLE_UNAVAILABLE, message, &ctx).await;
                    }
                };
                ctx.executor.ensure(&spec).await?;
                obs = ctx.executor.observe(&spec).await?;
            }
            match obs.phase {
                Phase::Absent | Phase::Running => {
                    if let Some(p) = &obs.progress {
                        let mut next = status.clone();
                        next.progress = Some(progress_of(p, false));
                        write_status(&imp, &next, &ctx).await?;
                    }
                    Ok(Action::requeue(POLL))
                }
                Phase::Failed => {
                    let (reason, message) = obs.failure();
                    let reason = if reason.is_empty() {
                        reasons::WORKLOAD_FAILED.to_string()
                    } else {
                        reason
                    };
                    let message = explain_failure(&reason, message, &ns, &ctx);
                    fail(&imp, &reason, message, &ctx).await
                }
                Phase::Succeeded => succeeded(&imp, &ns, &status, &obs, &ctx).await,
            }
        }
    }
}

/// Runs the ImageImport controller in `scope` until it is cancelled.
pub async fn controller(scope: Scope, ctx: Arc<ContentContext>) {
    let controller = Controller::new(scope.api::<ImageImport>(), watcher::Config::default());
    drive(ID, &scope, controller, reconcile, ctx).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_names_of_a_prefix() {
        assert!(is_content_of("deb-p1", "deb"));
        assert!(is_content_of("deb-p12", "deb"));
        assert!(!is_content_of("deb-p", "deb"));
        assert!(!is_content_of("deb-px", "deb"));
        assert!(!is_content_of("debx-p1", "deb"));
    }

    #[test]
    fn progress_percent_is_capped_until_done() {
        let v = json!({"event":"progress","phase":"Fetching","bytesFetched":50,"bytesTotal":200,"bytesCaptured":7});
        let p = progress_of(&v, false);
        assert_eq!((p.bytes_done, p.bytes_total, p.percent), (50, 200, 25));
        assert_eq!(p.phase.as_deref(), Some("Fetching"));
        assert_eq!(p.bytes_captured, Some(7));
        let full = json!({"bytesFetched":200,"bytesTotal":200});
        assert_eq!(progress_of(&full, false).percent, 99);
        assert_eq!(progress_of(&full, true).percent, 100);
        assert_eq!(progress_of(&json!({"bytesFetched":5}), false).percent, 0);
    }

    #[test]
    fn layout_maps_roles_blank_slots_and_swap_uuid() {
        let layout: anneal_image::layout::Layout = serde_json::from_value(json!({
            "partitionTable": "gpt", "sectorSize": 512, "diskSize": 1073741824u64,
            "slots": [
                {"number": 1, "role": "esp", "startBytes": 1048576, "sizeBytes": 104857600,
                 "typeGuid": "C12A7328-F81F-11D2-BA4B-00A0C93EC93B", "partUuid": "AAAAAAAA-0000-0000-0000-000000000001",
                 "fsType": "vfat", "contentRef": "deb-p1"},
                {"number": 2, "role": "swap", "startBytes": 105906176, "sizeBytes": 67108864,
                 "typeGuid": "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F", "fsType": "swap", "uuid": "0d3c2f47-0000-4000-8000-000000000002"},
                {"number": 3, "role": "data", "startBytes": 173015040, "sizeBytes": 536870912, "grow": true,
                 "typeGuid": "0FC63DAF-8483-4772-8E79-3D69D8477DE4", "fsType": "ext4", "contentRef": "deb-p3"},
                {"number": 4, "role": "data", "startBytes": 709885952, "sizeBytes": 1048576,
                 "typeGuid": "0FC63DAF-8483-4772-8E79-3D69D8477DE4"}
            ]
        }))
        .expect("layout");
        let c = |n: i32| IngestedContent {
            name: format!("deb-p{n}"),
            partition_number: n,
            fs_type: None,
            used_bytes: 1,
            size_bytes: 1,
            last_extent_end: 1,
            block_size: 4096,
            piece_length: 1 << 20,
        };
        let result = IngestResult {
            source_sha256: String::new(),
            layout: Some(layout),
            contents: vec![c(1), c(3)],
        };
        let l = image_layout(&result);
        assert_eq!(l.partition_table, PartitionTable::Gpt);
        assert_eq!(l.slots.len(), 4);
        assert_eq!(l.slots[0].role, SlotRole::Esp);
        assert_eq!(l.slots[0].content_ref, Some(NameRef::new("deb-p1")));
        assert_eq!(
            l.slots[0].type_guid.as_deref(),
            Some("c12a7328-f81f-11d2-ba4b-00a0c93ec93b")
        );
        assert_eq!(l.slots[1].role, SlotRole::Swap);
        assert_eq!(l.slots[1].content_ref, None);
        assert_eq!(
            l.slots[1].uuid.as_deref(),
            Some("0d3c2f47-0000-4000-8000-000000000002")
        );
        assert_eq!(l.slots[2].grow, Some(true));
        assert_eq!(l.slots[3].content_ref, None);
        assert_eq!(l.slots[3].fs_type, None);
        assert_eq!(l.slots[3].size_bytes, Some(1048576));
    }
}
