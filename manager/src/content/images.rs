//! Image readiness: `status.state` and condition `Ready` from its contents
//! (the `Valid` condition is the validity controller's). Ready when every
//! slot's content exists and is Ready; Failed when one failed or the Image is
//! invalid for a reason a new content cannot fix; Pending otherwise. Also
//! writes what the printer columns show (docs/operators.md, "Columns, short
//! names, `kubectl get anneal`"): `status.slots`, `status.sizeBytes` and
//! `status.usedBytes` ([`sizes`]).

use std::sync::Arc;

use anneal_api::conditions::{reasons, types};
use anneal_api::{ContentState, Image, ImageState, PartitionContent};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
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

/// What an Image's printer columns show: the number of slots, the disk
/// space the layout takes (each slot's `sizeBytes`, else its content's
/// `spec.sizeBytes`; `None` while a slot's size is unknown) and the bytes
/// a deploy writes (the contents' `spec.usedBytes`; `None` while a content
/// does not exist).
pub fn sizes(
    image: &Image,
    content: impl Fn(&str, &str) -> Option<Arc<PartitionContent>>,
) -> (i32, Option<i64>, Option<i64>) {
    let ns = image.namespace().unwrap_or_default();
    let slots = &image.spec.layout.slots;
    let mut size = Some(0i64);
    let mut used = Some(0i64);
    for slot in slots {
        let pc = slot
            .content_ref
            .as_ref()
            .map(|r| content(r.namespace_or(&ns), &r.name));
        let slot_size = slot.size_bytes.or_else(|| {
            pc.as_ref()
                .and_then(|p| p.as_ref().map(|p| p.spec.size_bytes))
        });
        size = size.zip(slot_size).map(|(a, b)| a.saturating_add(b));
        match pc {
            None => {}
            Some(Some(p)) => used = used.map(|u| u.saturating_add(p.spec.used_bytes)),
            Some(None) => used = None,
        }
    }
    (i32::try_from(slots.len()).unwrap_or(i32::MAX), size, used)
}

/// The owner reference an Image puts on each content it uses (not the
/// controller: several Images may share a content).
pub fn owner_ref(image: &Image) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: "anneal.dev/v1alpha1".into(),
        kind: "Image".into(),
        name: image.name_any(),
        uid: image.uid()?,
        controller: Some(false),
        block_owner_deletion: Some(false),
    })
}

/// Makes the Image an owner of every content of its slots (docs/api.md,
/// "PartitionContent"): a content no Image owns any more is collected (the
/// content controller, and Kubernetes' garbage collector where it runs).
async fn own_contents(image: &Image, ctx: &Ctx) -> Result<(), ImageError> {
    let ns = image.namespace().unwrap_or_default();
    let Some(owner) = owner_ref(image) else {
        return Ok(());
    };
    let api: Api<PartitionContent> = Api::namespaced(ctx.client.clone(), &ns);
    for slot in &image.spec.layout.slots {
        let Some(r) = &slot.content_ref else { continue };
        let Some(pc) = ctx.contents.get(&ObjectRef::new(&r.name).within(&ns)) else {
            continue;
        };
        if pc.metadata.deletion_timestamp.is_some()
            || pc.owner_references().iter().any(|o| o.uid == owner.uid)
        {
            continue;
        }
        let mut owners = pc.owner_references().to_vec();
        owners.push(owner.clone());
        let patch = json!({
            "metadata": {"resourceVersion": pc.resource_version(), "ownerReferences": owners},
        });
        api.patch(&r.name, &patch_params(FIELD_MANAGER), &Patch::Merge(&patch))
            .await?;
    }
    Ok(())
}

async fn reconcile(image: Arc<Image>, ctx: Arc<Ctx>) -> Result<Action, ImageError> {
    let ns = image.namespace().unwrap_or_default();
    if image.metadata.deletion_timestamp.is_none() {
        own_contents(&image, &ctx).await?;
    }
    let (state, ready, reason, message) = readiness(&image, |ns, name| {
        ctx.contents.get(&ObjectRef::new(name).within(ns))
    });
    let (slots, size_bytes, used_bytes) = sizes(&image, |ns, name| {
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
    if !changed
        && status.state == Some(state)
        && status.slots == Some(slots)
        && status.size_bytes == size_bytes
        && status.used_bytes == used_bytes
    {
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
        "status": {"state": state, "conditions": all, "slots": slots,
                   "sizeBytes": size_bytes, "usedBytes": used_bytes},
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn image(slots: serde_json::Value) -> Image {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": "ubuntu", "namespace": "lab"},
            "spec": {"layout": {"partitionTable": "gpt", "slots": slots}},
        }))
        .unwrap()
    }

    fn content(name: &str, used: i64, size: i64) -> Arc<PartitionContent> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "PartitionContent",
                "metadata": {"name": name, "namespace": "lab"},
                "spec": {"usedBytes": used, "sizeBytes": size, "lastExtentEnd": used,
                         "blockSize": 4096, "pieceLength": 262144},
            }))
            .unwrap(),
        )
    }

    fn lookup(
        have: &[Arc<PartitionContent>],
    ) -> impl Fn(&str, &str) -> Option<Arc<PartitionContent>> {
        let have = have.to_vec();
        move |ns, name| {
            have.iter()
                .find(|c| c.namespace().as_deref() == Some(ns) && c.name_any() == name)
                .cloned()
        }
    }

    #[test]
    fn sizes_sum_slot_sizes_and_content_used_bytes() {
        let img = image(json!([
            {"number": 1, "role": "esp", "contentRef": {"name": "u-p1"}, "sizeBytes": 536_870_912},
            {"number": 2, "role": "data", "contentRef": {"name": "u-p2"}, "grow": true},
            {"number": 3, "role": "swap", "sizeBytes": 1_073_741_824},
        ]));
        let have = [
            content("u-p1", 6_291_456, 536_870_912),
            content("u-p2", 1_500_000_000, 4_294_967_296),
        ];
        assert_eq!(
            sizes(&img, lookup(&have)),
            (
                3,
                Some(536_870_912 + 4_294_967_296 + 1_073_741_824),
                Some(6_291_456 + 1_500_000_000)
            )
        );
    }

    #[test]
    fn unknown_sizes_stay_absent() {
        // u-p2 does not exist yet: neither its size nor its used bytes are known.
        let img = image(json!([
            {"number": 1, "role": "esp", "contentRef": {"name": "u-p1"}, "sizeBytes": 1000},
            {"number": 2, "role": "data", "contentRef": {"name": "u-p2"}},
        ]));
        let have = [content("u-p1", 10, 1000)];
        assert_eq!(sizes(&img, lookup(&have)), (2, None, None));
        // A blank slot without sizeBytes: the size is unknown, the used bytes are not.
        let img = image(json!([
            {"number": 1, "role": "esp", "contentRef": {"name": "u-p1"}},
            {"number": 2, "role": "data", "fsType": "ext4", "grow": true},
        ]));
        assert_eq!(sizes(&img, lookup(&have)), (2, None, Some(10)));
    }
}
