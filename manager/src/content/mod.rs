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
pub mod quota;
pub mod upload;

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
    /// Where the content server listens (`None`: no content server).
    pub server_listen: Option<String>,
    /// The staged upload endpoint (`None`: none).
    pub upload: Option<upload::UploadConfig>,
    /// Trackers and seeders of the Sites (`None`: none run).
    pub swarm: Option<crate::swarm::SwarmConfig>,
    /// Managed bootd per Subnet (`spec.bootd.mode: Managed`); `None`: none
    /// runs (such Subnets need a bootd started by hand).
    pub bootd: Option<crate::bootd::BootdConfig>,
}

/// The content server workload: `anneal-agent serve` over the store, one
/// per store (per Site).
pub fn server_spec(listen: &str) -> crate::workload::WorkloadSpec {
    use crate::workload::{Kind, Program, Volume, VolumeSource, WorkloadSpec};
    WorkloadSpec {
        namespace: "anneal".into(),
        name: "content-server".into(),
        kind: Kind::Server,
        program: Program::Agent,
        args: vec![
            "serve".into(),
            "--content-dir".into(),
            "${volume:store}".into(),
            "--listen".into(),
            listen.to_string(),
        ],
        volumes: vec![Volume {
            name: "store".into(),
            mount_path: "/store".into(),
            source: VolumeSource::ContentStore,
        }],
        env: std::collections::BTreeMap::new(),
        labels: [(
            "app.kubernetes.io/component".to_string(),
            "content-server".to_string(),
        )]
        .into(),
        owner: None,
        deadline_secs: None,
        access: Default::default(),
    }
}

/// Keeps the content server running: started when absent, restarted when
/// it died (the executor reports it Failed), checked every 5 s until the
/// scope is cancelled. With the process executor the server is stopped
/// when the scope ends (shutdown or a lost lease); a Deployment stays.
async fn supervise_server(scope: crate::controller::Scope, executor: Executor, listen: String) {
    use crate::workload::Phase;
    let spec = server_spec(&listen);
    loop {
        let step = async {
            match executor.observe(&spec).await?.phase {
                Phase::Running => {}
                Phase::Absent => {
                    executor.ensure(&spec).await?;
                    tracing::info!(%listen, "content server started");
                }
                Phase::Failed | Phase::Succeeded => {
                    tracing::warn!(%listen, "content server ended; restarting it");
                    executor.remove(&spec).await?;
                    executor.ensure(&spec).await?;
                }
            }
            Ok::<_, crate::workload::WorkloadError>(())
        };
        if let Err(e) = step.await {
            tracing::warn!(error = %e, "content server supervision failed; retrying");
        }
        tokio::select! {
            () = scope.cancelled() => {
                // A child process does not outlive the manager's term (the
                // next leader starts its own); a Deployment stays.
                if matches!(executor, Executor::Process(_))
                    && let Err(e) = executor.remove(&spec).await
                {
                    tracing::warn!(error = %e, "stopping the content server failed");
                }
                return;
            }
            () = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
        }
    }
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
    /// The per-namespace byte quota.
    pub store_quota: quota::StoreQuota,
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

/// Runs the three content controllers in `scope` until it is cancelled;
/// `store_quota` is the store's per-namespace byte quota (docs/images.md,
/// "Store quota").
pub async fn controller(
    scope: crate::controller::Scope,
    cfg: ContentConfig,
    store_quota: quota::StoreQuota,
) {
    let ctx = std::sync::Arc::new(ContentContext {
        client: scope.client.clone(),
        recorder: scope.recorder.clone(),
        executor: cfg.executor.clone(),
        store_name: cfg.store_name,
        max_source_bytes: cfg.max_source_bytes,
        store_quota: store_quota.clone(),
        ingest_deadline_secs: cfg.ingest_deadline_secs,
    });
    let server = async {
        if let Some(listen) = cfg.server_listen {
            supervise_server(scope.clone(), ctx.executor.clone(), listen).await;
        }
    };
    let uploads = async {
        if let Some(up) = cfg.upload {
            match upload::start(scope.client.clone(), up, store_quota, scope.cancel.clone()).await {
                Ok(addr) => tracing::info!(%addr, "staged uploads accepted"),
                Err(e) => tracing::error!(
                    error = %anneal_api::error_chain(&e),
                    "the staged upload endpoint did not start"
                ),
            }
        }
    };
    let swarm = async {
        if let Some(sw) = cfg.swarm {
            crate::swarm::controller(scope.clone(), ctx.executor.clone(), sw).await;
        }
    };
    let bootd = async {
        if let Some(b) = cfg.bootd {
            crate::bootd::controller(scope.clone(), ctx.executor.clone(), b).await;
        }
    };
    futures::join!(
        swarm,
        bootd,
        uploads,
        imports::controller(scope.clone(), ctx.clone()),
        contents::controller(scope.clone(), ctx.clone()),
        images::controller(scope.clone()),
        server,
    );
}
