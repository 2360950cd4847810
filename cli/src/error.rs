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
    /// An object that the command would create exists already.
    #[error("{kind} {namespace}/{name} already exists: {hint}")]
    AlreadyExists {
        /// Lowercase kind.
        kind: &'static str,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// What to do instead.
        hint: String,
    },
    /// `import FILE` without an endpoint.
    #[error(
        "the manager's staged-upload endpoint is unknown: pass --upload-url https://MANAGER:PORT (the manager's --upload-listen) or set ANNEAL_UPLOAD_URL"
    )]
    NoUploadUrl,
    /// The endpoint is not an https URL.
    #[error("--upload-url {url} is not an https://HOST:PORT URL (the endpoint speaks HTTPS only)")]
    BadUploadUrl {
        /// What was given.
        url: String,
    },
    /// No bearer token for the endpoint.
    #[error(
        "the staged-upload endpoint authenticates bearer tokens only and the kubeconfig user has none: pass --token $(kubectl create token SERVICEACCOUNT -n NAMESPACE) (or set ANNEAL_TOKEN) for a subject allowed to create imageimports"
    )]
    NoToken,
    /// The manager's CA ConfigMap cannot be read.
    #[error(
        "cannot read the manager's CA certificate from ConfigMap {namespace}/anneal-agent-api-ca ({detail}): pass --upload-ca FILE, or --pki-namespace NS if the manager runs elsewhere"
    )]
    CaConfigMap {
        /// The namespace looked in.
        namespace: String,
        /// Why not.
        detail: String,
    },
    /// The CA is not usable PEM.
    #[error(
        "the upload CA holds no usable PEM certificate (check --upload-ca or ConfigMap anneal-agent-api-ca key ca.crt)"
    )]
    BadCa,
    /// A local file cannot be read.
    #[error("cannot read {path} (check the path and its permissions)")]
    ReadFile {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The endpoint cannot be reached.
    #[error(
        "cannot reach the staged-upload endpoint {url}: is the manager running with --upload-listen, and does --upload-url name it?"
    )]
    UploadUnreachable {
        /// The upload URL.
        url: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// TLS with the endpoint failed.
    #[error(
        "TLS with {url} failed: the CA (--upload-ca or ConfigMap anneal-agent-api-ca) must have signed the manager's certificate and the URL's host must be one of its names (the manager's --agent-api-name)"
    )]
    UploadTls {
        /// The upload URL.
        url: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// HTTP with the endpoint failed.
    #[error("the upload to {url} broke off: {detail} (see the manager's log, then retry)")]
    UploadHttp {
        /// The upload URL.
        url: String,
        /// What happened.
        detail: String,
    },
    /// The endpoint refused the upload.
    #[error("the upload to {url} was refused ({status}: {message}): {hint}")]
    UploadRefused {
        /// The upload URL.
        url: String,
        /// HTTP status.
        status: u16,
        /// The endpoint's message.
        message: String,
        /// What to do.
        hint: String,
    },
    /// The endpoint stored something else than was sent.
    #[error(
        "the upload to {url} stored {remote}, but {local} was sent: upload again under another --name"
    )]
    UploadMismatch {
        /// The upload URL.
        url: String,
        /// What was sent.
        local: String,
        /// What the endpoint answered.
        remote: String,
    },
    /// The import failed.
    #[error(
        "imageimport {namespace}/{name} Failed ({reason}): {message} (kubectl describe imageimport {name} -n {namespace}; the spec is immutable: delete it or import under another --name)"
    )]
    ImportFailed {
        /// The namespace.
        namespace: String,
        /// The import.
        name: String,
        /// Condition Succeeded's reason.
        reason: String,
        /// Its message.
        message: String,
    },
    /// The imported Image failed.
    #[error(
        "image {namespace}/{name} Failed ({reason}): {message} (kubectl describe image {name} -n {namespace})"
    )]
    ImageFailed {
        /// The namespace.
        namespace: String,
        /// The Image.
        name: String,
        /// Condition Ready's reason.
        reason: String,
        /// Its message.
        message: String,
    },
    /// A watch failed.
    #[error("watching {kind} {namespace}/{name}")]
    Watch {
        /// Lowercase kind.
        kind: &'static str,
        /// The namespace.
        namespace: String,
        /// The name (`*` for all).
        name: String,
        /// The cause.
        #[source]
        source: Box<kube::runtime::watcher::Error>,
    },
    /// A watch stream ended.
    #[error("the watch of {kind} {namespace}/{name} ended early; run the command again")]
    WatchEnded {
        /// Lowercase kind.
        kind: &'static str,
        /// The namespace.
        namespace: String,
        /// The name (`*` for all).
        name: String,
    },
    /// `watch -l` matched no machine.
    #[error(
        "no machine in namespace {namespace} matches {selector} (kubectl get machines -n {namespace} --show-labels)"
    )]
    NoMachines {
        /// The namespace.
        namespace: String,
        /// The selector.
        selector: String,
    },
    /// Watched runs failed.
    #[error(
        "deploy runs failed in {namespace}: {runs} (kubectl anneal logs MACHINE --run RUN -n {namespace})"
    )]
    RunsFailed {
        /// The namespace.
        namespace: String,
        /// The failed runs.
        runs: String,
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

/// `e` and its sources, `: `-joined.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    anneal_api::error_chain(e)
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
