//! Images into the cluster: the ImageImport, PartitionContent and Image
//! controllers, and what they share (the workload executor that runs the
//! ingest and store jobs against the Site's content store).
//!
//! The content store (one per Site: a volume in a cluster, `--content-dir`
//! on an appliance) is laid out `<namespace>/<content>/{index,stream}`
//! (plus `verified` once checked) and `<namespace>/.imports/<import>/layout.json`;
//! only ingest writes it, only the content server reads it, and a content is
//! never overwritten. See docs/images.md.

pub mod contents;
pub mod images;
pub mod imports;

use kube::Client;
use kube::runtime::events::Recorder;

use crate::workload::Executor;

/// The label on every object an import created: the import's name.
pub const IMPORT_LABEL: &str = "anneal.dev/import";
/// The finalizer that keeps a referenced content and removes its files.
pub const CONTENT_FINALIZER: &str = "anneal.dev/content-protection";

/// What the content controllers share.
#[derive(Clone, Debug)]
pub struct ContentConfig {
    /// Runs the ingest and store workloads.
    pub executor: Executor,
    /// The name recorded as `status.storageRef` (the store's volume).
    pub store_name: String,
    /// Refuse sources larger than this many bytes.
    pub max_source_bytes: Option<u64>,
    /// Longest an ingest job may run, in seconds.
    pub ingest_deadline_secs: i64,
}

/// [`ContentConfig`] plus the client and the event recorder.
pub struct ContentContext {
    /// The API client.
    pub client: Client,
    /// Events.
    pub recorder: Recorder,
    /// Runs the workloads.
    pub executor: Executor,
    /// `status.storageRef` of every content.
    pub store_name: String,
    /// Source size limit.
    pub max_source_bytes: Option<u64>,
    /// Ingest deadline.
    pub ingest_deadline_secs: i64,
}

impl std::fmt::Debug for ContentContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContentContext")
            .field("executor", &self.executor)
            .field("store_name", &self.store_name)
            .finish_non_exhaustive()
    }
}

/// Runs the three content controllers in `scope` until it is cancelled.
pub async fn controller(scope: crate::controller::Scope, cfg: ContentConfig) {
    let ctx = std::sync::Arc::new(ContentContext {
        client: scope.client.clone(),
        recorder: scope.recorder.clone(),
        executor: cfg.executor,
        store_name: cfg.store_name,
        max_source_bytes: cfg.max_source_bytes,
        ingest_deadline_secs: cfg.ingest_deadline_secs,
    });
    futures::join!(
        imports::controller(scope.clone(), ctx.clone()),
        contents::controller(scope.clone(), ctx),
        images::controller(scope),
    );
}
