//! manager: thin entry point.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "manager", version, about = "The anneal manager")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print every CustomResourceDefinition as YAML (or write one file per
    /// CRD into a directory: `manager crd --out-dir manager/crds`).
    Crd {
        /// Write `<name>.yaml` files into this directory instead of printing.
        #[arg(long)]
        out_dir: Option<PathBuf>,
        /// Also write the Markdown CRD reference (`README.md` and one page per
        /// kind) into this directory: `--reference-dir docs/reference`.
        #[arg(long)]
        reference_dir: Option<PathBuf>,
    },
    /// Run the controllers (claims, readiness rules) against the cluster of
    /// the ambient kubeconfig (KUBECONFIG or in-cluster).
    Run(RunArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "ANNEAL_NAMESPACE")]
    namespace: Option<String>,
    /// Claims reconciled in parallel.
    #[arg(long, default_value_t = 8)]
    concurrency: u16,
    /// Listen address of /metrics.
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: std::net::SocketAddr,
    /// Disable leader election (single replica only).
    #[arg(long)]
    no_leader_election: bool,
    /// Namespace of the leader Lease.
    #[arg(long, default_value = "default", env = "ANNEAL_LEASE_NAMESPACE")]
    lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, default_value = "anneal-manager")]
    lease_name: String,
    /// This replica's identity in the Lease (default: hostname-pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Seconds a Lease stays valid without renewal.
    #[arg(long, default_value_t = 15)]
    lease_duration_secs: u64,
    /// Seconds between renewals.
    #[arg(long, default_value_t = 5)]
    renew_secs: u64,
    /// Machine lifecycle (Redfish, agent API): see `docs/lifecycle.md`.
    #[command(flatten)]
    lifecycle: Box<anneal_manager::lifecycle::LifecycleArgs>,
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the cluster")?;
    // Machine lifecycle (issue 5): the agent API and the Machine controller.
    let _lifecycle = anneal_manager::lifecycle::start_from_args(
        client.clone(),
        &args.lifecycle,
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .context("starting the machine lifecycle")?;
    let identity = args.identity.unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    let lease = (!args.no_leader_election).then(|| anneal_manager::leader::LeaseConfig {
        namespace: args.lease_namespace,
        name: args.lease_name,
        identity,
        lease_duration: std::time::Duration::from_secs(args.lease_duration_secs),
        renew_every: std::time::Duration::from_secs(args.renew_secs),
    });
    let cfg = anneal_manager::RunConfig {
        namespace: args.namespace,
        concurrency: args.concurrency,
        lease,
        metrics_addr: Some(args.metrics_addr),
    };
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    anneal_manager::run(client, cfg, shutdown).await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Crd {
            out_dir,
            reference_dir,
        } => {
            let write = |path: PathBuf, text: String| {
                std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
            };
            let crds = anneal_api::crds();
            match &out_dir {
                None if reference_dir.is_none() => {
                    print!("{}", anneal_manager::crdgen::render_all()?);
                }
                None => {}
                Some(dir) => {
                    std::fs::create_dir_all(dir)
                        .with_context(|| format!("creating {}", dir.display()))?;
                    for crd in &crds {
                        write(
                            dir.join(anneal_manager::crdgen::file_name(crd)),
                            anneal_manager::crdgen::render(crd)?,
                        )?;
                    }
                }
            }
            if let Some(dir) = &reference_dir {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                write(
                    dir.join("README.md"),
                    anneal_manager::crdgen::reference_index(&crds),
                )?;
                for crd in &crds {
                    write(
                        dir.join(anneal_manager::crdgen::reference_file_name(crd)),
                        anneal_manager::crdgen::reference(crd),
                    )?;
                }
            }
        }
        Command::Run(args) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            rt.block_on(run(args))?;
        }
    }
    Ok(())
}
