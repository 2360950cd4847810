//! `kubectl anneal`: the operator's plugin (docs/operators.md).
//!
//! Every command talks to the API server the user's kubeconfig names
//! (`--kubeconfig`, else `KUBECONFIG`, else `~/.kube/config`, else the
//! in-cluster service account) in the namespace of `-n`, else the
//! kubeconfig context's namespace, else `default`. Machine operations write
//! exactly the field or annotation of docs/api.md that the manager honours
//! and print what changed.

use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

mod error;
mod logs;
mod machine;
mod status;

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
    },
}

/// Runs `cli`, writing its report to `out`.
pub async fn run(cli: Cli, out: &mut dyn Write) -> Result<(), Error> {
    let (client, default_ns) = connect(&cli).await?;
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
        Command::Logs { machine: m, run } => logs::run(&client, &ns, &m, run.as_deref(), out).await,
    }
}

/// A client for the kubeconfig of `cli` and the namespace of its context.
async fn connect(cli: &Cli) -> Result<(kube::Client, String), Error> {
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
    let client = kube::Client::try_from(config).map_err(|e| Error::Client(Box::new(e)))?;
    Ok((client, ns))
}
