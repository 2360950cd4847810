//! The plugin's errors: each names the object and what to do.

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No kubeconfig and not in a cluster.
    #[error(
        "no usable kubeconfig: set KUBECONFIG, pass --kubeconfig FILE, or run inside a cluster"
    )]
    InferConfig(#[source] Box<kube::config::InferConfigError>),
    /// The kubeconfig cannot be read or used.
    #[error("kubeconfig {path} cannot be used (check the file and --context)")]
    Kubeconfig {
        /// The file (or where it was looked for).
        path: String,
        /// The cause.
        #[source]
        source: Box<kube::config::KubeconfigError>,
    },
    /// The client cannot be built from the configuration.
    #[error("cannot build an API client from the kubeconfig")]
    Client(#[source] Box<kube::Error>),
    /// An object does not exist.
    #[error("{kind} {namespace}/{name} not found ({hint})")]
    NotFound {
        /// Lowercase kind, e.g. `machine`.
        kind: &'static str,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The command that shows what exists.
        hint: String,
    },
    /// An API call failed.
    #[error("{action} {kind} {namespace}/{name}")]
    Api {
        /// What was attempted: `reading`, `patching`, ...
        action: &'static str,
        /// Lowercase kind.
        kind: &'static str,
        /// Its namespace (`*` for all).
        namespace: String,
        /// Its name (`*` for a list).
        name: String,
        /// The cause.
        #[source]
        source: Box<kube::Error>,
    },
    /// `release` of a machine no claim holds.
    #[error(
        "machine {namespace}/{name} is not claimed (spec.claimRef is empty): nothing to release"
    )]
    NotClaimed {
        /// The Machine's namespace.
        namespace: String,
        /// The Machine's name.
        name: String,
    },
    /// `logs` of a machine that has no run.
    #[error(
        "machine {namespace}/{name} has no deploy run (status.currentRunRef, lastSuccessfulRunRef and lastAttemptedRunRef are empty); its runs: kubectl get deployruns -n {namespace} -l anneal.dev/machine={name}"
    )]
    NoRun {
        /// The Machine's namespace.
        namespace: String,
        /// The Machine's name.
        name: String,
    },
    /// `logs --run` naming a run of another machine.
    #[error(
        "deployrun {namespace}/{run} belongs to machine {owner}, not {machine} (kubectl get deployruns -n {namespace} -l anneal.dev/machine={machine})"
    )]
    RunOfOtherMachine {
        /// The namespace.
        namespace: String,
        /// The run.
        run: String,
        /// The machine asked for.
        machine: String,
        /// The machine the run names.
        owner: String,
    },
    /// Writing to stdout failed.
    #[error("writing the output")]
    Io(#[from] std::io::Error),
    /// JSON encoding of the report failed.
    #[error("encoding the report as JSON")]
    Json(#[from] serde_json::Error),
    /// YAML encoding of the report failed.
    #[error("encoding the report as YAML")]
    Yaml(#[from] serde_saphyr::SerializeError),
}

impl Error {
    /// An [`Error::Api`] maker for `map_err`.
    pub(crate) fn api(
        action: &'static str,
        kind: &'static str,
        namespace: &str,
        name: &str,
    ) -> impl FnOnce(kube::Error) -> Self {
        let (namespace, name) = (namespace.to_string(), name.to_string());
        move |source| Self::Api {
            action,
            kind,
            namespace,
            name,
            source: Box::new(source),
        }
    }
}
