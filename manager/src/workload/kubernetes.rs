//! The `kubernetes` executor: a workload is a Job (or, for a server, a
//! Deployment) from our own static image, applied server-side with the field
//! manager `anneal-workloads`, in the manager's workload namespace where the
//! Site's content store is a PersistentVolumeClaim. A job's result is the
//! last protocol line of its pod's log.
//!
//! Owner references cannot cross namespaces: when the workload namespace is
//! the owner's, the object carries an owner reference (garbage-collected
//! with it); otherwise it carries the owner's namespace, name and UID as
//! labels and the owning controller removes it.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, LogParams, Patch, PatchParams, PropagationPolicy};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use super::{
    Kind, Observation, Phase, Program, VolumeSource, WorkloadError, WorkloadSpec, finished_phase,
    scan_output, tagged_name, workload_name,
};

/// The field manager of every workload object.
pub const FIELD_MANAGER: &str = "anneal-workloads";
/// The label naming a workload object.
pub const WORKLOAD_LABEL: &str = "anneal.dev/workload";

/// Configuration of the `kubernetes` executor.
#[derive(Clone, Debug)]
pub struct KubeConfig {
    /// Namespace the Jobs and Deployments run in.
    pub namespace: String,
    /// The image holding `anneal-agent` at `/anneal-agent`.
    pub image: String,
    /// The image holding `bootd` at `/bootd` (managed Subnets).
    pub bootd_image: String,
    /// The PersistentVolumeClaim of the Site's content store.
    pub content_claim: String,
    /// Servers (the content server, seeders, trackers) on the node's
    /// network instead of the pod network: on an appliance they listen on
    /// the provisioning interface's address, where machines reach them
    /// (`--workload-host-network`). Jobs stay on the pod network; a
    /// workload with its own network attachment keeps it.
    pub server_host_network: bool,
    /// Where and how the pods it creates are scheduled and pulled.
    pub placement: PodPlacement,
}

/// Scheduling and pulling of the pods the kubernetes executor creates
/// (ingest and store Jobs, content server, seeders, trackers, managed
/// bootds): `manager run --workload-*` flags, docs/kubernetes.md
/// "Where the manager's pods run".
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct PodPlacement {
    /// A node label the pods must match, `KEY=VALUE` (repeat the flag).
    #[arg(long = "workload-node-selector", value_parser = parse_node_selector)]
    pub node_selector: Vec<(String, String)>,
    /// A taint the pods tolerate, `KEY[=VALUE][:EFFECT]` as `kubectl taint`
    /// writes it (no value: any value; no effect: every effect); repeat.
    #[arg(long = "workload-toleration", value_parser = parse_toleration)]
    pub tolerations: Vec<Toleration>,
    /// A Secret of the workload namespace holding registry credentials
    /// for the pods' images (repeat the flag).
    #[arg(long = "workload-image-pull-secret")]
    pub image_pull_secrets: Vec<String>,
    /// The pods' imagePullPolicy (`Always` for a moving tag).
    #[arg(long = "workload-image-pull-policy", default_value = "IfNotPresent",
          value_parser = ["Always", "IfNotPresent", "Never"])]
    pub image_pull_policy: String,
}

/// One toleration of [`PodPlacement`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Toleration {
    /// The taint's key.
    pub key: String,
    /// Its value (`None`: operator Exists).
    pub value: Option<String>,
    /// NoSchedule, PreferNoSchedule or NoExecute (`None`: every effect).
    pub effect: Option<String>,
}

/// Parses `KEY=VALUE` of `--workload-node-selector`.
pub fn parse_node_selector(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!(
            "{s:?}: a node selector is KEY=VALUE, e.g. node-role.kubernetes.io/provisioning=true"
        )),
    }
}

/// Parses `KEY[=VALUE][:EFFECT]` of `--workload-toleration`.
pub fn parse_toleration(s: &str) -> Result<Toleration, String> {
    let (kv, effect) = match s.rsplit_once(':') {
        Some((kv, e)) => (kv, Some(e)),
        None => (s, None),
    };
    if let Some(e) = effect
        && !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&e)
    {
        return Err(format!(
            "{s:?}: the effect {e:?} is not NoSchedule, PreferNoSchedule or NoExecute (KEY[=VALUE][:EFFECT])"
        ));
    }
    let (key, value) = match kv.split_once('=') {
        Some((k, v)) => (k, Some(v.to_string())),
        None => (kv, None),
    };
    if key.is_empty() {
        return Err(format!(
            "{s:?}: a toleration needs a key (KEY[=VALUE][:EFFECT])"
        ));
    }
    Ok(Toleration {
        key: key.to_string(),
        value,
        effect: effect.map(str::to_string),
    })
}

impl PodPlacement {
    /// Writes the placement into a pod spec (and the pull policy into its
    /// containers).
    fn apply(&self, pod_spec: &mut Value) {
        if !self.node_selector.is_empty() {
            let sel: BTreeMap<&str, &str> = self
                .node_selector
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            pod_spec["nodeSelector"] = json!(sel);
        }
        if !self.tolerations.is_empty() {
            let tols: Vec<Value> = self
                .tolerations
                .iter()
                .map(|t| {
                    let mut v = json!({"key": t.key});
                    match &t.value {
                        Some(val) => {
                            v["operator"] = json!("Equal");
                            v["value"] = json!(val);
                        }
                        None => v["operator"] = json!("Exists"),
                    }
                    if let Some(e) = &t.effect {
                        v["effect"] = json!(e);
                    }
                    v
                })
                .collect();
            pod_spec["tolerations"] = json!(tols);
        }
        if !self.image_pull_secrets.is_empty() {
            let refs: Vec<Value> = self
                .image_pull_secrets
                .iter()
                .map(|n| json!({"name": n}))
                .collect();
            pod_spec["imagePullSecrets"] = json!(refs);
        }
        let policy = if self.image_pull_policy.is_empty() {
            "IfNotPresent"
        } else {
            self.image_pull_policy.as_str()
        };
        if let Some(cs) = pod_spec["containers"].as_array_mut() {
            for c in cs {
                c["imagePullPolicy"] = json!(policy);
            }
        }
    }
}

/// Runs workloads as Jobs and Deployments.
#[derive(Clone)]
pub struct KubeExecutor {
    client: Client,
    cfg: std::sync::Arc<KubeConfig>,
}

impl std::fmt::Debug for KubeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeExecutor")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

fn kube_err(name: &str, source: kube::Error) -> WorkloadError {
    WorkloadError::Kube {
        name: name.to_string(),
        source,
    }
}

impl KubeExecutor {
    /// An executor for `cfg`.
    pub fn new(client: Client, cfg: KubeConfig) -> Self {
        Self {
            client,
            cfg: std::sync::Arc::new(cfg),
        }
    }

    /// The object name of a workload (see [`object_name_in`]).
    pub fn object_name(&self, spec: &WorkloadSpec) -> String {
        object_name_in(&self.cfg.namespace, spec)
    }

    /// The Job or Deployment of `spec`, as applied.
    pub fn object(&self, spec: &WorkloadSpec) -> Value {
        let name = self.object_name(spec);
        let mut labels: BTreeMap<String, String> = spec.labels.clone();
        labels.insert(WORKLOAD_LABEL.into(), name.clone());
        labels.insert(
            "app.kubernetes.io/managed-by".into(),
            "anneal-manager".into(),
        );
        labels.insert(
            "app.kubernetes.io/name".into(),
            spec.program.binary().into(),
        );
        let mut owner_refs = Vec::new();
        if let Some(o) = &spec.owner {
            if spec.namespace == self.cfg.namespace {
                owner_refs.push(serde_json::to_value(o).unwrap_or_default());
            } else {
                labels.insert("anneal.dev/owner-namespace".into(), spec.namespace.clone());
                labels.insert("anneal.dev/owner-name".into(), o.name.clone());
                labels.insert("anneal.dev/owner-uid".into(), o.uid.clone());
            }
        }
        let args = spec.resolved_args(|v| v.mount_path.clone());
        let mut env: Vec<Value> = spec
            .env
            .iter()
            .map(|(k, v)| json!({"name": k, "value": v}))
            .collect();
        env.push(json!({"name": super::process::WORKLOAD_ENV, "value": format!("{}/{}", spec.namespace, spec.name)}));
        let mounts: Vec<Value> = spec
            .volumes
            .iter()
            .map(|v| match v.source {
                VolumeSource::Files(_) => {
                    json!({"name": v.name, "mountPath": v.mount_path, "readOnly": true})
                }
                _ => json!({"name": v.name, "mountPath": v.mount_path}),
            })
            .collect();
        let volumes: Vec<Value> = spec
            .volumes
            .iter()
            .map(|v| match v.source {
                VolumeSource::ContentStore => json!({
                    "name": v.name,
                    "persistentVolumeClaim": {"claimName": self.cfg.content_claim},
                }),
                VolumeSource::Scratch => json!({"name": v.name, "emptyDir": {}}),
                // readable by the pod's group (fsGroup) only
                VolumeSource::Files(_) => json!({
                    "name": v.name,
                    "secret": {"secretName": self.files_secret_name(spec, &v.name), "defaultMode": 0o440},
                }),
            })
            .collect();
        let image = match spec.program {
            Program::Agent => &self.cfg.image,
            Program::Bootd => &self.cfg.bootd_image,
        };
        let access = &spec.access;
        let privileged = !access.capabilities.is_empty();
        let pod_security = json!({
            "runAsNonRoot": !privileged,
            "runAsUser": if privileged { 0 } else { 65532 },
            "runAsGroup": if privileged { 0 } else { 65532 },
            "seccompProfile": {"type": "RuntimeDefault"},
            // the content store's group: a root workload (bootd) holds no
            // CAP_DAC_OVERRIDE and writes its leases there through it
            "fsGroup": 65532,
        });
        let mut capabilities = json!({"drop": ["ALL"]});
        if privileged {
            capabilities["add"] = json!(access.capabilities);
        }
        let mut pod_meta = json!({"labels": labels});
        if let Some(net) = &access.network_attachment {
            pod_meta["annotations"] = json!({"k8s.v1.cni.cncf.io/networks": net});
        }
        let mut pod_spec = json!({
            "restartPolicy": if spec.kind == Kind::Job { "Never" } else { "Always" },
            "automountServiceAccountToken": access.service_account.is_some(),
            "enableServiceLinks": false,
            "securityContext": pod_security,
            "containers": [{
                "name": "work",
                "image": image,
                // a server that exits says why in its pod's status (and so
                // in its owner's condition): the last lines of its log
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "command": [format!("/{}", spec.program.binary())],
                "args": args,
                "env": env,
                "volumeMounts": mounts,
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "readOnlyRootFilesystem": true,
                    "capabilities": capabilities,
                },
                "resources": {
                    "requests": {"cpu": "100m", "memory": "64Mi"},
                    "limits": {"memory": "256Mi"},
                },
            }],
            "volumes": volumes,
        });
        if let Some(sa) = &access.service_account {
            pod_spec["serviceAccountName"] = json!(sa);
        }
        let host_network = access.host_network
            || (spec.kind == Kind::Server
                && self.cfg.server_host_network
                && access.network_attachment.is_none());
        if host_network {
            pod_spec["hostNetwork"] = json!(true);
            pod_spec["dnsPolicy"] = json!("ClusterFirstWithHostNet");
        }
        self.cfg.placement.apply(&mut pod_spec);
        let pod = json!({"metadata": pod_meta, "spec": pod_spec});
        let metadata = json!({
            "name": name,
            "namespace": self.cfg.namespace,
            "labels": labels,
            "ownerReferences": owner_refs,
        });
        match spec.kind {
            Kind::Job => {
                let mut job_spec = json!({"backoffLimit": 0, "template": pod});
                if let Some(d) = spec.deadline_secs {
                    job_spec["activeDeadlineSeconds"] = json!(d);
                }
                json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job_spec})
            }
            Kind::Server => json!({
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": metadata,
                "spec": {
                    "replicas": 1,
                    "strategy": {"type": "Recreate"},
                    "selector": {"matchLabels": {WORKLOAD_LABEL: name}},
                    "template": pod,
                },
            }),
        }
    }

    /// The Secret holding a [`VolumeSource::Files`] volume's files.
    pub fn files_secret_name(&self, spec: &WorkloadSpec, volume: &str) -> String {
        workload_name(&self.object_name(spec), &self.cfg.namespace, volume)
    }

    /// The Secrets of the workload's [`VolumeSource::Files`] volumes that
    /// have files, as applied (labelled like the workload).
    pub fn files_secrets(&self, spec: &WorkloadSpec) -> Vec<(String, Value)> {
        use base64::Engine as _;
        let obj = self.object(spec);
        spec.volumes
            .iter()
            .filter_map(|v| match &v.source {
                VolumeSource::Files(files) if !files.is_empty() => Some((v, files)),
                _ => None,
            })
            .map(|(v, files)| {
                let name = self.files_secret_name(spec, &v.name);
                let data: serde_json::Map<String, Value> = files
                    .iter()
                    .map(|(k, d)| {
                        (
                            k.clone(),
                            json!(base64::engine::general_purpose::STANDARD.encode(d)),
                        )
                    })
                    .collect();
                let secret = json!({
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "metadata": {
                        "name": name,
                        "namespace": self.cfg.namespace,
                        "labels": obj["metadata"]["labels"],
                        "ownerReferences": obj["metadata"]["ownerReferences"],
                    },
                    "type": "Opaque",
                    "data": data,
                });
                (name, secret)
            })
            .collect()
    }

    /// Applies the object (server-side apply; idempotent), and first the
    /// Secrets of its file volumes when it is created.
    pub async fn ensure(&self, spec: &WorkloadSpec) -> Result<(), WorkloadError> {
        let name = self.object_name(spec);
        let obj = self.object(spec);
        let pp = PatchParams::apply(FIELD_MANAGER).force();
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        match spec.kind {
            Kind::Job => {
                let api: Api<Job> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
                // A Job's pod template is immutable: apply only when absent.
                if api
                    .get_opt(&name)
                    .await
                    .map_err(|e| kube_err(&name, e))?
                    .is_none()
                {
                    for (sname, s) in self.files_secrets(spec) {
                        secrets
                            .patch(&sname, &pp, &Patch::Apply(&s))
                            .await
                            .map_err(|e| kube_err(&name, e))?;
                    }
                    api.patch(&name, &pp, &Patch::Apply(&obj))
                        .await
                        .map_err(|e| kube_err(&name, e))?;
                }
            }
            Kind::Server => {
                for (sname, s) in self.files_secrets(spec) {
                    secrets
                        .patch(&sname, &pp, &Patch::Apply(&s))
                        .await
                        .map_err(|e| kube_err(&name, e))?;
                }
                let api: Api<Deployment> =
                    Api::namespaced(self.client.clone(), &self.cfg.namespace);
                api.patch(&name, &pp, &Patch::Apply(&obj))
                    .await
                    .map_err(|e| kube_err(&name, e))?;
            }
        }
        Ok(())
    }

    /// The Job's state, and the protocol lines of its pod's log.
    pub async fn observe(&self, spec: &WorkloadSpec) -> Result<Observation, WorkloadError> {
        let name = self.object_name(spec);
        match spec.kind {
            Kind::Job => {
                let api: Api<Job> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
                let Some(job) = api.get_opt(&name).await.map_err(|e| kube_err(&name, e))? else {
                    return Ok(Observation::absent());
                };
                let status = job.status.unwrap_or_default();
                let lines = self
                    .log_lines(&format!("batch.kubernetes.io/job-name={name}"))
                    .await;
                let unread = lines.as_ref().err().cloned();
                let (progress, outcome) = lines.unwrap_or_default();
                let (phase, detail) = if status.succeeded.unwrap_or(0) > 0 {
                    match (finished_phase(outcome.as_ref(), true), unread) {
                        (Phase::Succeeded, _) => (Phase::Succeeded, String::new()),
                        (p, Some(why)) => (
                            p,
                            format!("Job {name} succeeded but its result is unknown: {why}"),
                        ),
                        (p, None) => (
                            p,
                            format!("Job {name} succeeded but its pod log holds no result"),
                        ),
                    }
                } else if status.failed.unwrap_or(0) > 0 {
                    (Phase::Failed, format!("Job {name} failed"))
                } else {
                    (Phase::Running, String::new())
                };
                Ok(Observation {
                    phase,
                    progress,
                    outcome,
                    detail,
                })
            }
            Kind::Server => {
                let api: Api<Deployment> =
                    Api::namespaced(self.client.clone(), &self.cfg.namespace);
                let Some(d) = api.get_opt(&name).await.map_err(|e| kube_err(&name, e))? else {
                    return Ok(Observation::absent());
                };
                let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0) > 0;
                // a running server's protocol lines (a seeder's `progress`
                // once it has checked its contents)
                let mut progress = None;
                let detail = if ready {
                    match self.log_lines(&format!("{WORKLOAD_LABEL}={name}")).await {
                        Ok((p, _)) => progress = p,
                        Err(why) => {
                            tracing::warn!(workload = %name, %why, "reading a server's log");
                        }
                    }
                    String::new()
                } else {
                    match self.pod_trouble(&name).await {
                        Some(why) => format!("Deployment {name} has no ready replica: {why}"),
                        None => format!("Deployment {name} has no ready replica"),
                    }
                };
                Ok(Observation {
                    phase: Phase::Running,
                    progress,
                    outcome: None,
                    detail,
                })
            }
        }
    }

    /// Why the newest pod of workload `name` is not ready, as `kubectl
    /// describe` would tell: not scheduled (the scheduler's message), its
    /// container waiting (CrashLoopBackOff, ErrImageNeverPull, …) and how
    /// its last run ended (exit code and the end of its log). `None` when
    /// there is no pod or nothing to say.
    async fn pod_trouble(&self, name: &str) -> Option<String> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let lp = ListParams::default().labels(&format!("{WORKLOAD_LABEL}={name}"));
        let list = pods.list(&lp).await.ok()?;
        let pod = list
            .items
            .iter()
            .max_by_key(|p| p.metadata.creation_timestamp.clone().map(|t| t.0))?;
        pod_trouble(pod)
    }

    /// The last protocol lines (`progress`, the outcome) in the log of the
    /// newest pod matching `selector`; `Err` says why it could not be read
    /// (the manager needs `get` on `pods/log`).
    async fn log_lines(&self, selector: &str) -> Result<(Option<Value>, Option<Value>), String> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let lp = ListParams::default().labels(selector);
        let list = pods
            .list(&lp)
            .await
            .map_err(|e| format!("listing its pods: {e}"))?;
        let Some(pod) = list
            .items
            .iter()
            .max_by_key(|p| p.metadata.creation_timestamp.clone().map(|t| t.0))
        else {
            return Ok((None, None));
        };
        let params = LogParams {
            container: Some("work".into()),
            tail_lines: Some(50),
            ..LogParams::default()
        };
        let text = pods
            .logs(&pod.name_any(), &params)
            .await
            .map_err(|e| format!("reading the log of pod {}: {e}", pod.name_any()))?;
        Ok(scan_output(&text))
    }

    /// Deletes the Deployments of `component` (`app.kubernetes.io/component`)
    /// this manager made whose name is not in `keep`, with their file
    /// Secrets; returns their names. What a controller no longer wants but
    /// cannot find through an owner reference (an owner in another
    /// namespace, or one deleted while no manager ran) goes this way.
    pub async fn sweep_servers(
        &self,
        component: &str,
        keep: &std::collections::BTreeSet<String>,
    ) -> Result<Vec<String>, WorkloadError> {
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let lp = ListParams::default().labels(&format!(
            "app.kubernetes.io/component={component},app.kubernetes.io/managed-by=anneal-manager"
        ));
        let list = api.list(&lp).await.map_err(|e| kube_err(component, e))?;
        let dp = DeleteParams {
            propagation_policy: Some(PropagationPolicy::Background),
            ..DeleteParams::default()
        };
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let mut removed = Vec::new();
        for d in list.items {
            let name = d.name_any();
            if keep.contains(&name) || d.metadata.deletion_timestamp.is_some() {
                continue;
            }
            match api.delete(&name, &dp).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(kube_err(&name, e)),
            }
            let owned = ListParams::default().labels(&format!("{WORKLOAD_LABEL}={name}"));
            for s in secrets
                .list(&owned)
                .await
                .map_err(|e| kube_err(&name, e))?
                .items
            {
                match secrets
                    .delete(&s.name_any(), &DeleteParams::default())
                    .await
                {
                    Ok(_) => {}
                    Err(kube::Error::Api(st)) if st.code == 404 => {}
                    Err(e) => return Err(kube_err(&name, e)),
                }
            }
            removed.push(name);
        }
        Ok(removed)
    }

    /// Deletes the object (and, in the background, its pods).
    pub async fn remove(&self, spec: &WorkloadSpec) -> Result<(), WorkloadError> {
        let name = self.object_name(spec);
        let dp = DeleteParams {
            propagation_policy: Some(PropagationPolicy::Background),
            ..DeleteParams::default()
        };
        let res = match spec.kind {
            Kind::Job => Api::<Job>::namespaced(self.client.clone(), &self.cfg.namespace)
                .delete(&name, &dp)
                .await
                .map(|_| ()),
            Kind::Server => Api::<Deployment>::namespaced(self.client.clone(), &self.cfg.namespace)
                .delete(&name, &dp)
                .await
                .map(|_| ()),
        };
        match res {
            Ok(()) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(kube_err(&name, e)),
        }
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        for v in &spec.volumes {
            if matches!(v.source, VolumeSource::Files(_)) {
                let sname = self.files_secret_name(spec, &v.name);
                match secrets.delete(&sname, &DeleteParams::default()).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => {}
                    Err(e) => return Err(kube_err(&name, e)),
                }
            }
        }
        Ok(())
    }
}

/// [`KubeExecutor::pod_trouble`] for one pod.
pub fn pod_trouble(pod: &Pod) -> Option<String> {
    let pname = pod.name_any();
    let status = pod.status.as_ref()?;
    let mut parts = Vec::new();
    for c in status.conditions.iter().flatten() {
        if c.type_ == "PodScheduled" && c.status == "False" {
            parts.push(format!(
                "pod {pname} not scheduled: {}",
                c.message.as_deref().unwrap_or("no reason given")
            ));
        }
    }
    for cs in status.container_statuses.iter().flatten() {
        if let Some(w) = cs.state.as_ref().and_then(|s| s.waiting.as_ref()) {
            let reason = w.reason.as_deref().unwrap_or("Waiting");
            match w.message.as_deref() {
                Some(m) if !m.is_empty() => parts.push(format!("pod {pname}: {reason}: {m}")),
                _ => parts.push(format!("pod {pname}: {reason}")),
            }
        }
        if let Some(t) = cs.last_state.as_ref().and_then(|s| s.terminated.as_ref()) {
            // the end of the log: the error a program prints last
            let message = t
                .message
                .as_deref()
                .unwrap_or_default()
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or_default()
                .trim();
            let mut line = format!(
                "its last run ended with exit code {} ({}) after {} restart(s)",
                t.exit_code,
                t.reason.as_deref().unwrap_or("Terminated"),
                cs.restart_count
            );
            if !message.is_empty() {
                line.push_str(&format!(": {}", truncate(message, 400)));
            }
            parts.push(line);
        }
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The object name of a workload in the manager's namespace `home`, unique
/// across the owners' namespaces: its own name for the manager's own,
/// `<namespace>-<name>-<tag>` for a tenant's, the tag (8 bytes of SHA-256 of
/// `namespace/name`) keeping `a-b`/`c` apart from `a`/`b-c` and from the
/// manager's own names.
pub fn object_name_in(home: &str, spec: &WorkloadSpec) -> String {
    if spec.namespace == home {
        spec.name.clone()
    } else {
        tagged_name(
            &format!("{}-{}", spec.namespace, spec.name),
            &format!("{}/{}", spec.namespace, spec.name),
            8,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_flags_parse_as_kubectl_writes_them() {
        assert_eq!(
            parse_toleration("dedicated=provisioning:NoSchedule"),
            Ok(Toleration {
                key: "dedicated".into(),
                value: Some("provisioning".into()),
                effect: Some("NoSchedule".into()),
            })
        );
        let any = parse_toleration("node-role.kubernetes.io/control-plane").unwrap();
        assert_eq!((any.value, any.effect), (None, None));
        let e = parse_toleration("k=v:NoSchedul").unwrap_err();
        assert!(e.contains("NoSchedul") && e.contains("NoExecute"), "{e}");
        assert!(parse_toleration("=v").is_err());
        assert_eq!(
            parse_node_selector("rack=r7"),
            Ok(("rack".into(), "r7".into()))
        );
        assert!(
            parse_node_selector("rack")
                .unwrap_err()
                .contains("KEY=VALUE")
        );
    }

    #[test]
    fn placement_goes_into_every_pod_spec() {
        let p = PodPlacement {
            node_selector: vec![("rack".into(), "r7".into())],
            tolerations: vec![
                parse_toleration("dedicated=provisioning:NoSchedule").unwrap(),
                parse_toleration("maintenance").unwrap(),
            ],
            image_pull_secrets: vec!["regcred".into()],
            image_pull_policy: "Always".into(),
        };
        let mut spec = json!({"containers": [{"name": "work"}]});
        p.apply(&mut spec);
        assert_eq!(spec["nodeSelector"], json!({"rack": "r7"}));
        assert_eq!(
            spec["tolerations"],
            json!([
                {"key": "dedicated", "operator": "Equal", "value": "provisioning", "effect": "NoSchedule"},
                {"key": "maintenance", "operator": "Exists"},
            ])
        );
        assert_eq!(spec["imagePullSecrets"], json!([{"name": "regcred"}]));
        assert_eq!(spec["containers"][0]["imagePullPolicy"], "Always");
        // nothing asked: nothing added, the pull policy IfNotPresent
        let mut plain = json!({"containers": [{"name": "work"}]});
        PodPlacement::default().apply(&mut plain);
        assert_eq!(
            plain,
            json!({"containers": [{"name": "work", "imagePullPolicy": "IfNotPresent"}]})
        );
    }

    #[test]
    fn tenant_workload_names_are_injective_across_namespaces() {
        let spec = |ns: &str, name: &str| WorkloadSpec {
            namespace: ns.into(),
            name: name.into(),
            kind: crate::workload::Kind::Job,
            program: crate::workload::Program::Agent,
            args: vec![],
            volumes: vec![],
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            owner: None,
            deadline_secs: None,
            access: crate::workload::Access::default(),
        };
        let home = "anneal-system";
        // Once `<ns>-<name>`: namespace `a-b` + `c` met namespace `a` + `b-c`,
        // and a tenant named like the manager's own workload met it.
        let x = object_name_in(home, &spec("a-b", "ingest-c"));
        let y = object_name_in(home, &spec("a", "b-ingest-c"));
        assert_ne!(x, y);
        let own = object_name_in(home, &spec(home, "bootd-rack1"));
        assert_eq!(own, "bootd-rack1");
        assert_ne!(object_name_in(home, &spec("bootd", "rack1")), "bootd-rack1");
        for n in [&x, &y] {
            assert!(n.len() <= 63 && n.starts_with('a'), "{n}");
        }
    }

    fn pod(status: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "bootd-rack1-abc"},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn a_crash_looping_server_says_why_from_its_last_log_line() {
        let p = pod(json!({
            "containerStatuses": [{
                "name": "work", "image": "i", "imageID": "", "ready": false, "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container=work"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                    "message": "INFO starting\nError: no interface holds serverIP 10.90.0.77 (Subnet anneal-system/rack1)\n\n"}},
            }],
        }));
        let why = pod_trouble(&p).unwrap();
        assert!(
            why.contains("pod bootd-rack1-abc: CrashLoopBackOff: back-off 40s"),
            "{why}"
        );
        assert!(
            why.contains("exit code 1 (Error) after 3 restart(s): Error: no interface holds serverIP 10.90.0.77"),
            "{why}"
        );
        assert!(!why.contains("INFO starting"), "{why}");
    }

    #[test]
    fn an_unscheduled_server_names_the_schedulers_message() {
        let p = pod(json!({
            "conditions": [{"type": "PodScheduled", "status": "False",
                "message": "0/1 nodes are available: 1 node(s) didn't have free ports for the requested pod ports."}],
        }));
        let why = pod_trouble(&p).unwrap();
        assert!(
            why.contains("not scheduled: 0/1 nodes are available"),
            "{why}"
        );
        assert_eq!(pod_trouble(&pod(json!({}))), None);
        assert_eq!(truncate("héllo", 2), "h");
    }
}
