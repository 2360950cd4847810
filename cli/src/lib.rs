//! `kubectl anneal`: the operator's plugin (docs/operators.md).
//!
//! Every command talks to the API server the user's kubeconfig names
//! (`--kubeconfig`, else `KUBECONFIG`, else `~/.kube/config`, else the
//! in-cluster service account) in the namespace of `-n`, else the
//! kubeconfig context's namespace, else `default`. Machine operations write
//! exactly the field or annotation of docs/api.md that the manager honours
//! and print what changed.
#![cfg_attr(test, allow(clippy::too_many_lines))]

use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

mod error;
mod import;
mod logs;
mod machine;
mod progress;
mod status;
mod watch;

pub use error::Error;

/// Field manager of every write of the plugin.
pub const FIELD_MANAGER: &str = "kubectl-anneal";

/// `kubectl anneal`: fleet status, machine operations and per-run agent logs
/// for anneal (group anneal.dev).
#[derive(Debug, Parser)]
#[command(name = "kubectl-anneal", bin_name = "kubectl anneal", version)]
pub struct Cli {
    /// Namespace (default: the kubeconfig context's namespace, else `default`).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// Path of the kubeconfig file (default: `KUBECONFIG`, else `~/.kube/config`).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: the current context).
    #[arg(long, global = true)]
    pub context: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

/// Output formats of listing commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Machine-readable JSON.
    Json,
    /// Machine-readable YAML.
    Yaml,
    /// The tables with more columns.
    Wide,
}

/// `spec.source.format` of an import.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A raw disk image.
    Raw,
    /// A qcow2 disk image.
    Qcow2,
    /// A Clonezilla image directory or a single partclone image.
    Partclone,
}

impl Format {
    fn wire(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Qcow2 => "qcow2",
            Self::Partclone => "partclone",
        }
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The fleet at a glance: machines by state, machines in error with their
    /// reason, deploy runs in progress with percent and throughput.
    Status {
        /// All namespaces.
        #[arg(short = 'A', long)]
        all_namespaces: bool,
        /// Output format (default: tables).
        #[arg(short = 'o', long, value_enum)]
        output: Option<Output>,
    },
    /// Keep new claims off a machine (spec.unclaimable: true).
    Cordon {
        /// The Machine.
        machine: String,
    },
    /// Let claims bind a machine again (spec.unclaimable: false).
    Uncordon {
        /// The Machine.
        machine: String,
    },
    /// Power a machine off and stand every controller down
    /// (annotation anneal.dev/operation=park; from Available or Provisioned).
    Park {
        /// The Machine.
        machine: String,
    },
    /// Bring a parked machine back (annotation anneal.dev/operation=unpark).
    Unpark {
        /// The Machine.
        machine: String,
    },
    /// Inspect a machine again (annotation anneal.dev/re-inspect).
    Reinspect {
        /// The Machine.
        machine: String,
    },
    /// Reset a machine's error counters and lift RetryHeld
    /// (annotation anneal.dev/clear-error).
    ClearError {
        /// The Machine.
        machine: String,
    },
    /// Restart a machine through its BMC (annotation anneal.dev/reboot,
    /// {"mode":"soft"} unless --hard).
    Reboot {
        /// The Machine.
        machine: String,
        /// A forced restart instead of a graceful one.
        #[arg(long)]
        hard: bool,
    },
    /// Release a machine: delete the MachineClaim bound to it; the machine is
    /// then handled per its spec.reclaimPolicy (Retain or Recycle).
    Release {
        /// The Machine.
        machine: String,
    },
    /// Print the agent's log of a machine's deploy run (ConfigMap
    /// `<run>-log`): the current run, else the last successful one, else
    /// the last attempted one.
    Logs {
        /// The Machine.
        machine: String,
        /// A DeployRun of the machine, by name.
        #[arg(long)]
        run: Option<String>,
        /// Keep printing what the agent adds until the run ends.
        #[arg(short = 'f', long)]
        follow: bool,
    },
    /// Import a disk image: a local FILE is uploaded to the manager's
    /// staged-upload endpoint (sha256 computed as it streams), a URL
    /// (http, https, staged://) is fetched by the manager; then ImageImport
    /// NAME is created and followed until its Image is Ready.
    Import {
        /// A local file, or an http(s):// or staged:// URL.
        source: String,
        /// The ImageImport; also the Image and the content prefix unless
        /// --image-name / --content-prefix say otherwise.
        #[arg(long)]
        name: String,
        /// The source's format (default: detected by the manager).
        #[arg(long, value_enum)]
        format: Option<Format>,
        /// The Image to create (default: NAME).
        #[arg(long)]
        image_name: Option<String>,
        /// Prefix of the PartitionContents (default: NAME).
        #[arg(long)]
        content_prefix: Option<String>,
        /// `sha256:<hex>` of a URL source (a file's is computed).
        #[arg(long)]
        checksum: Option<String>,
        /// spec.osFamily (Linux, Windows, FreeBSD, Other).
        #[arg(long)]
        os_family: Option<String>,
        /// The manager's staged-upload endpoint (its --upload-listen), e.g.
        /// https://manager.example:8444.
        #[arg(long, env = "ANNEAL_UPLOAD_URL")]
        upload_url: Option<String>,
        /// PEM file of the endpoint's CA (default: ConfigMap
        /// anneal-agent-api-ca, key ca.crt, in --pki-namespace).
        #[arg(long, env = "ANNEAL_UPLOAD_CA")]
        upload_ca: Option<PathBuf>,
        /// The manager's namespace (where its CA ConfigMap is).
        #[arg(long, default_value = "anneal-system")]
        pki_namespace: String,
        /// Bearer token for the endpoint (default: the kubeconfig user's
        /// token), e.g. $(kubectl create token SERVICEACCOUNT -n NS).
        #[arg(long, env = "ANNEAL_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Live progress of deploy runs (phase, percent, rate, peers) until
    /// every watched run has finished, then a summary table.
    Watch {
        /// Only this Machine's runs.
        machine: Option<String>,
        /// Only the runs of machines matching this label selector.
        #[arg(short = 'l', long, conflicts_with = "machine")]
        selector: Option<String>,
    },
}

/// Runs `cli`, writing its report to `out` (plain lines, no terminal).
pub async fn run(cli: Cli, out: &mut dyn Write) -> Result<(), Error> {
    run_on(cli, out, false).await
}

/// Runs `cli`, writing its report to `out`; `tty`: `out` is a terminal
/// (progress bars are redrawn in place).
pub async fn run_on(cli: Cli, out: &mut dyn Write, tty: bool) -> Result<(), Error> {
    let (client, default_ns, token) = connect(&cli).await?;
    let ns = cli.namespace.clone().unwrap_or(default_ns);
    match cli.command {
        Command::Status {
            all_namespaces,
            output,
        } => {
            let scope = if all_namespaces {
                None
            } else {
                Some(ns.as_str())
            };
            status::run(&client, scope, output, out).await
        }
        Command::Cordon { machine: m } => {
            machine::set_unclaimable(&client, &ns, &m, true, out).await
        }
        Command::Uncordon { machine: m } => {
            machine::set_unclaimable(&client, &ns, &m, false, out).await
        }
        Command::Park { machine: m } => {
            machine::annotate(&client, &ns, &m, machine::Request::Park, out).await
        }
        Command::Unpark { machine: m } => {
            machine::annotate(&client, &ns, &m, machine::Request::Unpark, out).await
        }
        Command::Reinspect { machine: m } => {
            machine::annotate(&client, &ns, &m, machine::Request::Reinspect, out).await
        }
        Command::ClearError { machine: m } => {
            machine::annotate(&client, &ns, &m, machine::Request::ClearError, out).await
        }
        Command::Reboot { machine: m, hard } => {
            let req = machine::Request::Reboot { hard };
            machine::annotate(&client, &ns, &m, req, out).await
        }
        Command::Release { machine: m } => machine::release(&client, &ns, &m, out).await,
        Command::Logs {
            machine: m,
            run,
            follow,
        } => logs::run(&client, &ns, &m, run.as_deref(), follow, out).await,
        Command::Import {
            source,
            name,
            format,
            image_name,
            content_prefix,
            checksum,
            os_family,
            upload_url,
            upload_ca,
            pki_namespace,
            token: upload_token,
        } => {
            let req = import::Request {
                source,
                name,
                image_name,
                content_prefix,
                format: format.map(|f| f.wire().to_string()),
                checksum,
                os_family,
                upload_url,
                upload_ca,
                pki_namespace,
                token: upload_token,
            };
            import::run(&client, &ns, req, token, tty, out).await
        }
        Command::Watch {
            machine: m,
            selector,
        } => {
            let scope = match (m, selector) {
                (Some(m), _) => watch::Scope::Machine(m),
                (None, Some(s)) => watch::Scope::Selector(s),
                (None, None) => watch::Scope::All,
            };
            watch::run(&client, &ns, scope, tty, out).await
        }
    }
}

/// A client for the kubeconfig of `cli`, the namespace of its context and
/// the user's bearer token (if it has one).
async fn connect(cli: &Cli) -> Result<(kube::Client, String, Option<String>), Error> {
    let options = kube::config::KubeConfigOptions {
        context: cli.context.clone(),
        ..Default::default()
    };
    let config = match (&cli.kubeconfig, &cli.context) {
        (Some(path), _) => {
            let kc =
                kube::config::Kubeconfig::read_from(path).map_err(|source| Error::Kubeconfig {
                    path: path.display().to_string(),
                    source: Box::new(source),
                })?;
            kube::Config::from_custom_kubeconfig(kc, &options)
                .await
                .map_err(|source| Error::Kubeconfig {
                    path: path.display().to_string(),
                    source: Box::new(source),
                })?
        }
        (None, Some(_)) => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|source| Error::Kubeconfig {
                path: "$KUBECONFIG or ~/.kube/config".into(),
                source: Box::new(source),
            })?,
        (None, None) => kube::Config::infer()
            .await
            .map_err(|e| Error::InferConfig(Box::new(e)))?,
    };
    let ns = config.default_namespace.clone();
    let token = {
        use secrecy::ExposeSecret as _;
        let auth = &config.auth_info;
        auth.token
            .as_ref()
            .map(|t| t.expose_secret().to_string())
            .or_else(|| {
                auth.token_file
                    .as_ref()
                    .and_then(|f| std::fs::read_to_string(f).ok())
                    .map(|t| t.trim().to_string())
            })
    };
    let client = kube::Client::try_from(config).map_err(|e| Error::Client(Box::new(e)))?;
    Ok((client, ns, token))
}
