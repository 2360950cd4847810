//! The manager in process with the `process` executor over a store
//! directory and its staged-upload endpoint on loopback (docs/images.md,
//! "Staged uploads"), plus a ServiceAccount of the tenant namespace allowed
//! to create imageimports, whose token uploads: what `cli_import` and
//! `store_quota` start from; and waiting for an import to finish.

use std::path::Path;
use std::time::Duration;

use anneal_manager::content::ContentConfig;
use anneal_manager::content::quota::StoreQuota;
use anneal_manager::content::upload::UploadConfig;
use anneal_manager::workload::{Executor, process::ProcessExecutor};
use anneal_testinfra::ControlPlane;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::{artifacts, eventually};

const WAIT: Duration = Duration::from_secs(180);

/// A running manager with its upload endpoint, and an uploader's token.
#[derive(Debug)]
pub struct UploadLab {
    /// `https://127.0.0.1:PORT` of the staged-upload endpoint.
    pub url: String,
    /// A token of ServiceAccount `uploader` of the tenant namespace.
    pub token: String,
    /// The agent API CA certificate (PEM) the endpoint's certificate
    /// chains to, as ConfigMap `anneal-agent-api-ca` publishes it.
    pub ca_pem: String,
    shutdown: CancellationToken,
    manager: tokio::task::JoinHandle<Result<(), anneal_manager::RunError>>,
}

impl UploadLab {
    /// Creates namespaces `ns` and `anneal-system`, starts the manager
    /// (sources and uploads up to `max_bytes`; `quota`: the store quota,
    /// none unlimited) over `store`, and waits until the endpoint listens.
    pub async fn start(
        cp: &ControlPlane,
        ns: &str,
        store: &Path,
        max_bytes: u64,
        quota: Option<StoreQuota>,
    ) -> UploadLab {
        let client = cp.client();
        for name in [ns, "anneal-system"] {
            let obj: Namespace =
                serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
            Api::<Namespace>::all(client.clone())
                .create(&PostParams::default(), &obj)
                .await
                .unwrap();
        }
        let agent = artifacts::agent_host();
        let upload_port = anneal_testinfra::free_port().unwrap();
        let mut runtime =
            anneal_manager::Runtime::new(client.clone(), anneal_manager::RunConfig::default())
                .with_content(ContentConfig {
                    executor: Executor::Process(ProcessExecutor::new(
                        agent.parent().unwrap().to_path_buf(),
                        store,
                    )),
                    store_name: "test-store".into(),
                    max_source_bytes: Some(max_bytes),
                    ingest_deadline_secs: 600,
                    server_listen: None,
                    swarm: None,
                    bootd: None,
                    upload: Some(UploadConfig {
                        listen: format!("127.0.0.1:{upload_port}").parse().unwrap(),
                        store: store.to_path_buf(),
                        max_bytes,
                        pki_namespace: "anneal-system".into(),
                        server_names: vec!["127.0.0.1".into()],
                    }),
                });
        if let Some(q) = quota {
            runtime = runtime.with_store_quota(q);
        }
        let shutdown = runtime.shutdown_token();
        let manager = tokio::spawn(runtime.run());

        // A ServiceAccount allowed to create imageimports: its token uploads.
        let dir = tempfile::tempdir().unwrap();
        for obj in [
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "uploader", "namespace": ns}}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "importer", "namespace": ns},
                   "rules": [{"apiGroups": ["anneal.dev"], "resources": ["imageimports"], "verbs": ["create"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "importer", "namespace": ns},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "importer"},
                   "subjects": [{"kind": "ServiceAccount", "name": "uploader", "namespace": ns}]}),
        ] {
            let f = dir.path().join("obj.json");
            std::fs::write(&f, obj.to_string()).unwrap();
            anneal_testinfra::run(cp.kubectl().unwrap().arg("apply").arg("-f").arg(&f)).unwrap();
        }
        let token = anneal_testinfra::run(
            cp.kubectl()
                .unwrap()
                .args(["create", "token", "uploader", "-n", ns]),
        )
        .unwrap()
        .trim()
        .to_string();
        // The endpoint listens once the manager made its CA and published
        // its certificate (ConfigMap anneal-agent-api-ca, what the CLI reads).
        let maps: Api<ConfigMap> = Api::namespaced(client.clone(), "anneal-system");
        let ca_map = eventually("the manager's CA ConfigMap", WAIT, || {
            let maps = maps.clone();
            async move { maps.get_opt("anneal-agent-api-ca").await.ok()? }
        })
        .await;
        eventually("the upload endpoint listens", WAIT, || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", upload_port))
                .await
                .is_ok()
        })
        .await;
        UploadLab {
            url: format!("https://127.0.0.1:{upload_port}"),
            token,
            ca_pem: ca_map.data.unwrap()["ca.crt"].clone(),
            shutdown,
            manager,
        }
    }

    /// Stops the manager and waits for it.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.manager.await;
    }
}

/// Waits (up to 180 s) until ImageImport `ns/name` Succeeded or Failed.
pub async fn import_finished(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> anneal_api::ImageImport {
    use anneal_api::{ImageImport, ImportState};
    let api: Api<ImageImport> = Api::namespaced(client.clone(), ns);
    eventually(&format!("ImageImport {ns}/{name} finished"), WAIT, || {
        let api = api.clone();
        async move {
            let i = api.get(name).await.ok()?;
            matches!(
                i.status.as_ref().and_then(|s| s.state),
                Some(ImportState::Succeeded | ImportState::Failed)
            )
            .then_some(i)
        }
    })
    .await
}
