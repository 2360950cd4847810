//! Workloads: programs the manager runs for its controllers (ingest jobs and
//! content verification now; the content server, seeders, trackers and
//! managed bootd later), described once and run by one of two executors.
//!
//! A [`WorkloadSpec`] names the program (a binary of our own static images),
//! its arguments, its volumes (directories: the Site's content store, a
//! scratch directory) and its environment. Arguments refer to a volume as
//! `${volume:NAME}`; each executor substitutes where that volume is for it.
//!
//! - [`process::ProcessExecutor`] (`--workload-executor process`): child
//!   processes on the manager's host, supervised by PID, their stdout kept in
//!   a file so a restarted manager still reads a finished job's result. For a
//!   single-host appliance, the demo and the tests.
//! - [`kubernetes::KubeExecutor`] (`--workload-executor kubernetes`): a Job
//!   (or a Deployment for a server) from our own image, applied server-side;
//!   the result is read from the pod's log.
//!
//! The program's stdout is a protocol: one JSON object per line, `{"event":
//! "progress", …}` while it works and a last `{"event": "result", …}` or
//! `{"event": "error", "reason": …, "message": …}` (see `anneal-agent ingest`
//! and `anneal-agent store`). [`Observation`] carries the last progress and
//! the final event.

pub mod kubernetes;
pub mod process;

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde_json::Value;

/// The program a workload runs: a binary of our own images.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Program {
    /// `anneal-agent` (ingest, store verify/remove, the content server).
    Agent,
    /// `bootd` (a managed Subnet's DHCP, TFTP and HTTP boot server).
    Bootd,
}

impl Program {
    /// The binary's file name (also its path in the image: `/<name>`).
    pub fn binary(self) -> &'static str {
        match self {
            Self::Agent => "anneal-agent",
            Self::Bootd => "bootd",
        }
    }
}

/// What a workload needs beyond an unprivileged, non-root pod with no
/// ServiceAccount token (the default: every workload but bootd).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Access {
    /// The host's network namespace (bootd answers DHCP on the segment).
    pub host_network: bool,
    /// A Multus NetworkAttachmentDefinition (`namespace/name`) the pod
    /// attaches through instead.
    pub network_attachment: Option<String>,
    /// Runs as root with only these capabilities (`NET_BIND_SERVICE`, …);
    /// empty: as the unprivileged user with none.
    pub capabilities: Vec<String>,
    /// The ServiceAccount whose token the program uses to watch the API
    /// server; `None`: no token is mounted.
    pub service_account: Option<String>,
}

/// Runs to completion (a Job) or serves until removed (a Deployment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Runs once; its last stdout line is the result.
    Job,
    /// Runs until removed.
    Server,
}

/// Where a volume's directory comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VolumeSource {
    /// The Site's content store.
    ContentStore,
    /// An empty scratch directory that lives as long as the workload.
    Scratch,
    /// Files the controller supplies (file name to bytes; for example a CA
    /// bundle read from a Secret), read-only for the program and removed
    /// with the workload. Process: written with mode 0600 into a directory
    /// (0700) in the workload's state directory; kubernetes: a Secret named
    /// like the Job in the workload namespace, mounted as a Secret volume.
    /// Supplied when the workload starts: an empty map means "already
    /// written" to an executor whose workload exists.
    Files(BTreeMap<String, Vec<u8>>),
}

/// A directory the program sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Volume {
    /// Name, referred to in arguments as `${volume:NAME}`.
    pub name: String,
    /// Where it is mounted in a container.
    pub mount_path: String,
    /// What it holds.
    pub source: VolumeSource,
}

/// One workload, as both executors run it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadSpec {
    /// Namespace of the object it works for.
    pub namespace: String,
    /// Name, unique in that namespace among workloads (a DNS-1123 label).
    pub name: String,
    /// Job or server.
    pub kind: Kind,
    /// The binary.
    pub program: Program,
    /// Arguments; `${volume:NAME}` is replaced by the volume's directory.
    pub args: Vec<String>,
    /// Volumes.
    pub volumes: Vec<Volume>,
    /// Environment.
    pub env: BTreeMap<String, String>,
    /// Labels of the created objects.
    pub labels: BTreeMap<String, String>,
    /// The object the workload belongs to (deleted with it in a cluster).
    pub owner: Option<OwnerReference>,
    /// Longest run time of a job, in seconds.
    pub deadline_secs: Option<i64>,
    /// Privileges beyond the default.
    pub access: Access,
}

impl WorkloadSpec {
    /// The arguments with every `${volume:NAME}` replaced by `path(volume)`.
    pub fn resolved_args(&self, path: impl Fn(&Volume) -> String) -> Vec<String> {
        self.args
            .iter()
            .map(|a| {
                let mut out = a.clone();
                for v in &self.volumes {
                    out = out.replace(&format!("${{volume:{}}}", v.name), &path(v));
                }
                out
            })
            .collect()
    }
}

/// How far a workload got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Not started (or removed).
    Absent,
    /// Running.
    Running,
    /// Ended with a `result` line.
    Succeeded,
    /// Ended with an `error` line, a non-zero exit or no result at all.
    Failed,
}

/// What an executor knows about a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Observation {
    /// The phase.
    pub phase: Phase,
    /// The last `progress` line.
    pub progress: Option<Value>,
    /// The final `result` or `error` line.
    pub outcome: Option<Value>,
    /// A human-readable detail for a failure without an `error` line (exit
    /// code, the executor's own reason).
    pub detail: String,
}

impl Observation {
    /// Nothing known.
    pub fn absent() -> Self {
        Self {
            phase: Phase::Absent,
            progress: None,
            outcome: None,
            detail: String::new(),
        }
    }

    /// The `reason` and `message` of a failure, from the error line or the
    /// detail.
    pub fn failure(&self) -> (String, String) {
        match &self.outcome {
            Some(v) if v.get("event").and_then(Value::as_str) == Some("error") => (
                v.get("reason")
                    .and_then(Value::as_str)
                    .unwrap_or("WorkloadFailed")
                    .to_string(),
                v.get("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
            ),
            _ => ("WorkloadFailed".to_string(), self.detail.clone()),
        }
    }
}

/// Reads the protocol lines of a program's stdout: the last progress and the
/// final event (`result` or `error`). Lines that are not JSON objects are
/// ignored.
pub fn scan_output(text: &str) -> (Option<Value>, Option<Value>) {
    let mut progress = None;
    let mut outcome = None;
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        match v.get("event").and_then(Value::as_str) {
            Some("progress") => progress = Some(v),
            Some("result" | "error") => outcome = Some(v),
            _ => {}
        }
    }
    (progress, outcome)
}

/// The phase a finished program's output says, given whether it exited 0.
pub fn finished_phase(outcome: Option<&Value>, exit_ok: bool) -> Phase {
    match outcome.and_then(|v| v.get("event")).and_then(Value::as_str) {
        Some("result") if exit_ok => Phase::Succeeded,
        _ => Phase::Failed,
    }
}

/// A workload name: `<prefix>-<name>`, cut to a DNS-1123 label (63) with a
/// hash suffix when too long, so distinct inputs stay distinct.
pub fn workload_name(prefix: &str, namespace: &str, name: &str) -> String {
    let full = format!("{prefix}-{name}");
    if full.len() <= 63 {
        return full;
    }
    tagged_name(&full, &format!("{namespace}/{name}"), 5)
}

/// `base` (cut to fit a DNS-1123 label) followed by `-` and the first
/// `tag_bytes` bytes of SHA-256(`key`) in hex: always tagged, so two names
/// whose `-`-joined parts read the same (`a-b` + `c`, `a` + `b-c`) differ
/// when their keys (which keep the parts apart) differ.
pub fn tagged_name(base: &str, key: &str, tag_bytes: usize) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(key.as_bytes());
    let tag = hex::encode(&digest[..tag_bytes.min(digest.len())]);
    let keep = 63usize.saturating_sub(tag.len() + 1);
    let head: String = base.chars().take(keep).collect();
    format!("{}-{tag}", head.trim_end_matches(['-', '.']))
}

/// Why a pass of a controller that runs workloads (managed bootd, the
/// swarm) failed: it is retried on the next pass.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// Reading or writing the objects the pass works from.
    #[error(transparent)]
    Kube(#[from] kube::Error),
    /// The executor.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
}

/// Errors of an executor.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The API server refused an object.
    #[error("workload {name}: {source}")]
    Kube {
        /// The workload.
        name: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// A process could not be started or observed.
    #[error("workload {name}: {message}")]
    Process {
        /// The workload.
        name: String,
        /// What went wrong.
        message: String,
    },
}

/// The executor chosen by `--workload-executor`.
#[derive(Clone, Debug)]
pub enum Executor {
    /// Child processes on this host.
    Process(process::ProcessExecutor),
    /// Jobs and Deployments in the cluster.
    Kubernetes(kubernetes::KubeExecutor),
}

impl Executor {
    /// Starts the workload unless it exists (idempotent).
    pub async fn ensure(&self, spec: &WorkloadSpec) -> Result<(), WorkloadError> {
        match self {
            Self::Process(p) => p.ensure(spec),
            Self::Kubernetes(k) => k.ensure(spec).await,
        }
    }

    /// What the workload is doing.
    pub async fn observe(&self, spec: &WorkloadSpec) -> Result<Observation, WorkloadError> {
        match self {
            // reads /proc and may wait a few ms for a process mid-exec: off
            // the async executor
            Self::Process(p) => blocking(p, spec, |p, s| p.observe(s)).await,
            Self::Kubernetes(k) => k.observe(spec).await,
        }
    }

    /// Stops the workload and forgets it.
    pub async fn remove(&self, spec: &WorkloadSpec) -> Result<(), WorkloadError> {
        match self {
            // waits up to 5 s for the process group to end: off the async
            // executor
            Self::Process(p) => blocking(p, spec, |p, s| p.remove(s)).await,
            Self::Kubernetes(k) => k.remove(spec).await,
        }
    }

    /// Where the content store is for code that runs in the manager's own
    /// process (`Some` for the process executor only).
    pub fn local_store(&self) -> Option<&std::path::Path> {
        match self {
            Self::Process(p) => Some(p.store_dir()),
            Self::Kubernetes(_) => None,
        }
    }
}

/// Runs a blocking call of the process executor on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    p: &process::ProcessExecutor,
    spec: &WorkloadSpec,
    f: fn(&process::ProcessExecutor, &WorkloadSpec) -> Result<T, WorkloadError>,
) -> Result<T, WorkloadError> {
    let (p, s) = (p.clone(), spec.clone());
    let name = format!("{}/{}", spec.namespace, spec.name);
    tokio::task::spawn_blocking(move || f(&p, &s))
        .await
        .map_err(|e| WorkloadError::Process {
            name,
            message: format!("the blocking task ended abnormally: {e}"),
        })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scans_progress_and_outcome() {
        let out = "log noise\n{\"event\":\"progress\",\"bytesFetched\":1}\n{\"event\":\"progress\",\"bytesFetched\":2}\n{\"event\":\"result\",\"x\":1}\n";
        let (p, o) = scan_output(out);
        assert_eq!(p.and_then(|v| v["bytesFetched"].as_i64()), Some(2));
        assert_eq!(o.as_ref().and_then(|v| v["x"].as_i64()), Some(1));
        assert_eq!(finished_phase(o.as_ref(), true), Phase::Succeeded);
        assert_eq!(finished_phase(o.as_ref(), false), Phase::Failed);
        let (_, e) =
            scan_output("{\"event\":\"error\",\"reason\":\"ChecksumMismatch\",\"message\":\"m\"}");
        assert_eq!(finished_phase(e.as_ref(), true), Phase::Failed);
        let obs = Observation {
            phase: Phase::Failed,
            progress: None,
            outcome: e,
            detail: String::new(),
        };
        assert_eq!(obs.failure(), ("ChecksumMismatch".into(), "m".into()));
    }

    #[test]
    fn names_fit_a_label_and_stay_distinct() {
        assert_eq!(workload_name("ingest", "ns", "ubuntu"), "ingest-ubuntu");
        let long = "a".repeat(80);
        let a = workload_name("ingest", "ns1", &long);
        let b = workload_name("ingest", "ns2", &long);
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b);
    }

    #[test]
    fn tagged_names_keep_parts_apart() {
        // `a-b` + `c` and `a` + `b-c` join to the same text: the key (which
        // separates the parts with `/`) tells them apart.
        let x = tagged_name("seed-a-b-c", "ns/a-b/c", 5);
        let y = tagged_name("seed-a-b-c", "ns/a/b-c", 5);
        assert_ne!(x, y);
        assert!(x.starts_with("seed-a-b-c-") && x.len() == "seed-a-b-c-".len() + 10);
        let long = tagged_name(&"x".repeat(100), "k", 8);
        assert_eq!(long.len(), 63, "{long}");
    }

    #[test]
    fn resolves_volume_placeholders() {
        let spec = WorkloadSpec {
            namespace: "ns".into(),
            name: "w".into(),
            kind: Kind::Job,
            program: Program::Agent,
            args: vec![
                "--store".into(),
                "${volume:store}".into(),
                "--x=${volume:scratch}/f".into(),
            ],
            volumes: vec![
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
            ],
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            owner: None,
            deadline_secs: None,
            access: Access::default(),
        };
        assert_eq!(
            spec.resolved_args(|v| v.mount_path.clone()),
            vec!["--store", "/store", "--x=/scratch/f"]
        );
    }
}
