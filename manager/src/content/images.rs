//! Image readiness: `status.state` and condition `Ready` from its contents
//! (the `Valid` condition is the validity controller's). Ready when every
//! slot's content exists and is Ready; Failed when one failed or the Image
//! is invalid for a reason a new content cannot fix; Pending otherwise.

use std::sync::Arc;

use anneal_api::conditions::{reasons, types};
use anneal_api::{ContentState, Image, ImageState, PartitionContent};
use kube::ResourceExt;
use kube::api::{Api, Patch};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use serde_json::json;

use crate::conditions;
use crate::controller::{Identity, ReconcileError, Scope, drive, is_conflict, patch_params};

const FIELD_MANAGER: &str = "anneal-images";

/// The Image readiness controller's identity.
pub const ID: Identity = Identity {
    name: "images",
    kind: "Image",
    field_manager: FIELD_MANAGER,
};

/// Errors of a reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The API server refused a request.
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

impl ReconcileError for ImageError {
    fn is_conflict(&self) -> bool {
        matches!(self, Self::Kube(e) if is_conflict(e))
    }
    fn kind(&self) -> &'static str {
        "kube"
    }
}

struct Ctx {
    client: kube::Client,
    contents: Store<PartitionContent>,
}

/// The state, Ready, reason and message of an Image given its contents.
pub fn readiness(
    image: &Image,
    content: impl Fn(&str, &str) -> Option<Arc<PartitionContent>>,
) -> (ImageState, bool, &'static str, String) {
    let ns = image.namespace().unwrap_or_default();
    let mut waiting = Vec::new();
    for (i, slot) in image.spec.layout.slots.iter().enumerate() {
        let Some(r) = &slot.content_ref else { continue };
        let rns = r.namespace_or(&ns);
        if rns != ns {
            return (
                ImageState::Failed,
                false,
                reasons::CONTENT_NAMESPACE_MISMATCH,
                format!("spec.layout.slots[{i}].contentRef names namespace {rns}, not {ns}"),
            );
        }
        let Some(pc) = content(rns, &r.name) else {
            waiting.push(format!("{} (does not exist)", r.name));
            continue;
        };
        if let Some(size) = slot.size_bytes
            && pc.spec.last_extent_end > size
        {
            return (
                ImageState::Failed,
                false,
                reasons::CONTENT_DOES_NOT_FIT,
                format!(
                    "spec.layout.slots[{i}].sizeBytes {size} is smaller than PartitionContent {} lastExtentEnd {}",
                    r.name, pc.spec.last_extent_end
                ),
            );
        }
        match pc.status.as_ref().and_then(|s| s.state) {
            Some(ContentState::Ready) => {}
            Some(ContentState::Failed) => {
                return (
                    ImageState::Failed,
                    false,
                    reasons::CONTENT_FAILED,
                    format!("PartitionContent {} failed", r.name),
                );
            }
            s => waiting.push(format!(
                "{} ({})",
                r.name,
                s.map(|s| format!("{s:?}"))
                    .unwrap_or_else(|| "Pending".into())
            )),
        }
    }
    if waiting.is_empty() {
        (
            ImageState::Ready,
            true,
            reasons::CONTENTS_READY,
            "every content is Ready".to_string(),
        )
    } else {
        (
            ImageState::Pending,
            false,
            reasons::CONTENT_NOT_READY,
            format!("waiting for {}", waiting.join(", ")),
        )
    }
}

async fn reconcile(image: Arc<Image>, ctx: Arc<Ctx>) -> Result<Action, ImageError> {
    let ns = image.namespace().unwrap_or_default();
    let (state, ready, reason, message) = readiness(&image, |ns, name| {
        ctx.contents.get(&ObjectRef::new(name).within(ns))
    });
    let mut status = image.status.clone().unwrap_or_default();
    let generation = image.metadata.generation;
    let changed = conditions::set(
        &mut status.conditions,
        types::READY,
        ready,
        reason,
        &message,
        generation,
    );
    if !changed && status.state == Some(state) {
        return Ok(Action::await_change());
    }
    status.state = Some(state);
    // Only our fields: the validity controller owns Valid.
    let ours: Vec<_> = status
        .conditions
        .iter()
        .filter(|c| c.type_ == types::READY)
        .cloned()
        .collect();
    let mut all = image
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    all.retain(|c| c.type_ != types::READY);
    all.extend(ours);
    let api: Api<Image> = Api::namespaced(ctx.client.clone(), &ns);
    let patch = json!({
        "metadata": {"resourceVersion": image.resource_version()},
        "status": {"state": state, "conditions": all},
    });
    api.patch_status(
        &image.name_any(),
        &patch_params(FIELD_MANAGER),
        &Patch::Merge(&patch),
    )
    .await?;
    Ok(Action::await_change())
}

/// Runs the Image readiness controller in `scope` until it is cancelled.
pub async fn controller(scope: Scope) {
    let (contents, content_stream) = scope.reflected::<PartitionContent>();
    let (images, image_stream) = scope.reflected::<Image>();
    let images_for_map = images.clone();
    let controller = Controller::for_stream(image_stream, images).watches_stream(
        content_stream,
        move |pc: PartitionContent| {
            let ns = pc.namespace().unwrap_or_default();
            let name = pc.name_any();
            images_for_map
                .state()
                .iter()
                .filter(|i| i.namespace().as_deref() == Some(ns.as_str()))
                .filter(|i| {
                    i.spec
                        .layout
                        .slots
                        .iter()
                        .any(|s| s.content_ref.as_ref().is_some_and(|r| r.name == name))
                })
                .map(|i| ObjectRef::from_obj(i.as_ref()))
                .collect::<Vec<_>>()
        },
    );
    let ctx = Arc::new(Ctx {
        client: scope.client.clone(),
        contents,
    });
    drive(ID, &scope, controller, reconcile, ctx).await;
}
