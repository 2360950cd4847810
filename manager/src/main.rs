//! manager: thin entry point.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
// a single-value flag given twice keeps the last value (a kustomize patch
// appends its own `--content-url` after the base's)
#[command(
    name = "manager",
    version,
    about = "The anneal manager",
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print every CustomResourceDefinition as YAML (or write one file per
    /// CRD into a directory: `manager crd --out-dir deploy/base/crds`).
    Crd {
        /// Write `<name>.yaml` files into this directory instead of printing.
        #[arg(long)]
        out_dir: Option<PathBuf>,
        /// Also write the Markdown CRD reference (`README.md` and one page per
        /// kind) into this directory: `--reference-dir docs/reference`.
        #[arg(long)]
        reference_dir: Option<PathBuf>,
    },
    /// Run the manager (controllers behind leader election, agent API,
    /// /metrics) against the cluster of the ambient kubeconfig (KUBECONFIG
    /// or in-cluster).
    Run(Box<RunArgs>),
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
    /// Serve the metadata endpoint (Day-1 data over HTTP: OpenStack layout,
    /// NoCloud seed, Ignition; docs/deploy.md) here, on the provisioning
    /// network, e.g. `10.0.0.2:8089`. Unset: not served.
    #[arg(long)]
    metadata_listen: Option<std::net::SocketAddr>,
    /// Images: the ImageImport, PartitionContent and Image controllers.
    #[command(flatten)]
    content: ContentArgs,
    /// Machine lifecycle (Redfish, agent API): see `docs/lifecycle.md`.
    #[command(flatten)]
    lifecycle: Box<anneal_manager::lifecycle::LifecycleArgs>,
}

/// Where workloads (ingest, store verify/remove) run: docs/images.md.
#[derive(Debug, clap::Args)]
struct ContentArgs {
    /// `process` (child processes on this host; needs --content-dir) or
    /// `kubernetes` (Jobs from --workload-image). Unset: no image
    /// controllers run.
    #[arg(long, value_parser = ["process", "kubernetes"])]
    workload_executor: Option<String>,
    /// The content store directory (process executor).
    #[arg(long)]
    content_dir: Option<PathBuf>,
    /// Directory holding `anneal-agent` (process executor; default: the
    /// manager binary's own directory).
    #[arg(long)]
    workload_bin_dir: Option<PathBuf>,
    /// Image of the workloads (kubernetes executor).
    #[arg(long)]
    workload_image: Option<String>,
    /// Namespace the workload Jobs run in (kubernetes executor).
    #[arg(long, default_value = "anneal-system")]
    workload_namespace: String,
    /// PersistentVolumeClaim of the content store (kubernetes executor).
    #[arg(long, default_value = "anneal-content")]
    content_claim: String,
    /// Run the content server, seeders and trackers on the node's network
    /// (kubernetes executor; an appliance: they listen on the provisioning
    /// interface's address). Jobs stay on the pod network.
    #[arg(long)]
    workload_host_network: bool,
    /// Node selector, tolerations, pull secrets and pull policy of the
    /// workload pods (kubernetes executor).
    #[command(flatten)]
    placement: anneal_manager::workload::kubernetes::PodPlacement,
    /// Run the content server (`anneal-agent serve` over the store) listening
    /// here, e.g. `0.0.0.0:8088`; unset: no content server.
    #[arg(long)]
    content_listen: Option<String>,
    /// Accept staged uploads (`PUT /v1/staged/<ns>/<name>`, HTTPS, a
    /// Kubernetes bearer token) here; process executor only.
    #[arg(long)]
    upload_listen: Option<std::net::SocketAddr>,
    /// Refuse import sources (and staged uploads) larger than this many
    /// bytes; 0: no limit (docs/images.md, "Store quota").
    #[arg(long, default_value_t = 64 << 30)]
    max_source_bytes: u64,
    /// Bytes of the content store each namespace may hold (its
    /// PartitionContents' stored bytes plus its staged uploads); 0:
    /// unlimited (docs/images.md, "Store quota").
    #[arg(long, default_value_t = 200 << 30)]
    store_quota_bytes_per_namespace: u64,
    /// A namespace's own quota, `NAMESPACE=BYTES` (0: unlimited); repeat
    /// for more namespaces.
    #[arg(long, value_parser = anneal_manager::content::quota::StoreQuota::parse_override)]
    store_quota_namespace: Vec<(String, u64)>,
    /// Longest an ingest job may run, in seconds.
    #[arg(long, default_value_t = 6 * 3600)]
    ingest_deadline_secs: i64,
    /// A namespace besides the manager's whose Subnets may get a managed
    /// bootd (a root DHCP server on the host's network); repeat the flag.
    /// Elsewhere a Managed Subnet gets `BootdNotAllowed` and no bootd.
    #[arg(long)]
    managed_bootd_namespace: Vec<String>,
    /// Image of a managed bootd (kubernetes executor): `bootd` at `/bootd`.
    #[arg(long, default_value = "docker.io/anneal/bootd:dev")]
    bootd_image: String,
    /// The agent API's URL as booted machines reach it, written into a
    /// managed bootd's boot scripts (default: `https://NAME:PORT` with the
    /// first `--agent-api-name` that is not a loopback one).
    #[arg(long)]
    bootd_api_url: Option<String>,
    /// ServiceAccount of a managed bootd (kubernetes executor; see
    /// deploy/base/rbac-bootd.yaml).
    #[arg(long, default_value = "anneal-bootd")]
    bootd_service_account: String,
    /// HTTP port of a managed bootd (kernel, initramfs, iPXE scripts).
    #[arg(long, default_value_t = 8080)]
    bootd_http_port: u16,
}

impl ContentArgs {
    /// The store quota of `--store-quota-bytes-per-namespace` and
    /// `--store-quota-namespace`.
    fn store_quota(&self) -> anneal_manager::content::quota::StoreQuota {
        anneal_manager::content::quota::StoreQuota {
            per_namespace: self.store_quota_bytes_per_namespace,
            overrides: self.store_quota_namespace.iter().cloned().collect(),
        }
    }

    /// `--max-source-bytes`, `None` for 0 (no limit).
    fn max_source_bytes(&self) -> Option<u64> {
        (self.max_source_bytes > 0).then_some(self.max_source_bytes)
    }

    fn config(
        &self,
        client: &kube::Client,
        pki_namespace: &str,
        server_names: &[String],
        agent_api_port: u16,
    ) -> anyhow::Result<Option<anneal_manager::content::ContentConfig>> {
        use anneal_manager::workload::{Executor, kubernetes, process};
        let Some(kind) = self.workload_executor.as_deref() else {
            return Ok(None);
        };
        let (executor, store_name) = if kind == "process" {
            let dir = self.content_dir.clone().context(
                "--workload-executor process needs --content-dir DIR (the content store)",
            )?;
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("creating the content store {}", dir.display()))?;
            let bin_dir = match &self.workload_bin_dir {
                Some(d) => d.clone(),
                None => std::env::current_exe()
                    .context("locating the manager binary")?
                    .parent()
                    .map(std::path::Path::to_path_buf)
                    .context("the manager binary has no directory")?,
            };
            anyhow::ensure!(
                bin_dir.join("anneal-agent").exists(),
                "{} has no anneal-agent: build it (cargo build -p anneal-agent) or pass --workload-bin-dir",
                bin_dir.display()
            );
            (
                Executor::Process(process::ProcessExecutor::new(bin_dir, &dir)),
                dir.display().to_string(),
            )
        } else {
            let image = self
                .workload_image
                .clone()
                .context("--workload-executor kubernetes needs --workload-image IMAGE")?;
            (
                Executor::Kubernetes(kubernetes::KubeExecutor::new(
                    client.clone(),
                    kubernetes::KubeConfig {
                        namespace: self.workload_namespace.clone(),
                        image,
                        bootd_image: self.bootd_image.clone(),
                        content_claim: self.content_claim.clone(),
                        server_host_network: self.workload_host_network,
                        placement: self.placement.clone(),
                    },
                )),
                self.content_claim.clone(),
            )
        };
        let upload = match (self.upload_listen, &executor) {
            (Some(listen), Executor::Process(p)) => {
                Some(anneal_manager::content::upload::UploadConfig {
                    listen,
                    store: p.store_dir().to_path_buf(),
                    max_bytes: self.max_source_bytes().unwrap_or(u64::MAX),
                    pki_namespace: pki_namespace.to_string(),
                    server_names: server_names.to_vec(),
                })
            }
            (Some(_), Executor::Kubernetes(_)) => anyhow::bail!(
                "--upload-listen needs --workload-executor process (the upload is written into the local content store)"
            ),
            (None, _) => None,
        };
        Ok(Some(anneal_manager::content::ContentConfig {
            executor,
            store_name,
            max_source_bytes: self.max_source_bytes(),
            ingest_deadline_secs: self.ingest_deadline_secs,
            server_listen: self.content_listen.clone(),
            upload,
            swarm: None,
            bootd: Some(anneal_manager::bootd::BootdConfig {
                api_url: anneal_manager::bootd::BootdConfig::api_url_from(
                    self.bootd_api_url.as_deref(),
                    server_names,
                    agent_api_port,
                ),
                ca_namespace: pki_namespace.to_string(),
                http_port: self.bootd_http_port,
                service_account: self.bootd_service_account.clone(),
                allowed_namespaces: self.managed_bootd_namespace.clone(),
                // the API server's address as this manager was given it
                // (a node without kube-proxy); a pod otherwise gets the
                // same from its kubelet
                env: ["KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"]
                    .iter()
                    .filter_map(|k| std::env::var(k).ok().map(|v| (k.to_string(), v)))
                    .collect(),
            }),
        }))
    }
}

impl RunArgs {
    /// The start-up check (docs/lifecycle.md, "Start-up checks"): one line
    /// per setting that keeps this configuration from provisioning.
    fn preflight(&self) -> Vec<String> {
        use anneal_manager::preflight::{Executor, Settings, probe_writable, problems};
        let c = &self.content;
        let executor = match c.workload_executor.as_deref() {
            Some("process") => Some(Executor::Process),
            Some(_) => Some(Executor::Kubernetes),
            None => None,
        };
        let content_dir_probe = c
            .content_dir
            .as_deref()
            .filter(|_| executor == Some(Executor::Process))
            .map(|d| probe_writable(d).map_err(|e| e.to_string()));
        problems(&Settings {
            lifecycle: !self.lifecycle.no_lifecycle,
            agent_api_listen: self.lifecycle.agent_api_listen,
            agent_api_names: &self.lifecycle.agent_api_names,
            executor,
            content_dir: c.content_dir.as_deref(),
            content_dir_probe,
            workload_image: c.workload_image.as_deref(),
            content_url: self.lifecycle.content_url.as_deref(),
            content_listen: c.content_listen.as_deref(),
            bootd_api_url: c.bootd_api_url.as_deref(),
            upload_listen: c.upload_listen,
        })
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = kube::Client::try_default()
        .await
        .context("connecting to the cluster")?;
    let identity = args.identity.unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        format!("{}-{}", host.trim(), std::process::id())
    });
    // BMCs see which replica calls them.
    anneal_manager::redfish::http::set_identity(&identity);
    let lease = (!args.no_leader_election).then(|| anneal_manager::leader::LeaseConfig {
        namespace: args.lease_namespace,
        name: args.lease_name,
        identity,
        lease_duration: std::time::Duration::from_secs(args.lease_duration_secs),
        renew_every: std::time::Duration::from_secs(args.renew_secs),
    });
    let metadata = args
        .metadata_listen
        .map(|listen| anneal_manager::metadata::MetadataConfig {
            listen,
            namespace: args.namespace.clone(),
        });
    let cfg = anneal_manager::RunConfig {
        namespace: args.namespace,
        concurrency: args.concurrency,
        lease,
        metrics_addr: Some(args.metrics_addr),
    };
    let content = args.content.config(
        &client,
        &args.lifecycle.manager_namespace,
        &args.lifecycle.agent_api_names,
        args.lifecycle.agent_api_listen.port(),
    )?;
    let mut runtime = anneal_manager::Runtime::new(client, cfg);
    if let Some(md) = metadata {
        runtime = runtime.with_metadata(md);
    }
    if let Some(mut content) = content {
        content.swarm = Some(args.lifecycle.swarm.clone());
        runtime = runtime
            .with_content(content)
            .with_store_quota(args.content.store_quota());
    }
    if let Some((lifecycle, agent_api)) = args
        .lifecycle
        .configs()
        .context("reading the lifecycle flags")?
    {
        runtime = runtime.with_lifecycle(lifecycle, agent_api);
    }
    let shutdown = runtime.shutdown_token();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: shutting down"),
        }
        shutdown.cancel();
    });
    runtime.run().await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // colours only on a terminal (logs piped to files stay plain)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
                    write(
                        dir.join("kustomization.yaml"),
                        anneal_manager::crdgen::kustomization(&crds),
                    )?;
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
            // before connecting anywhere: every line, then a non-zero exit
            let refused = args.preflight();
            if !refused.is_empty() {
                for line in &refused {
                    eprintln!("{line}");
                }
                anyhow::bail!(
                    "refusing to start: {} setting(s) above keep this configuration from \
                     provisioning (docs/lifecycle.md, \"Start-up checks\")",
                    refused.len()
                );
            }
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the runtime")?;
            rt.block_on(run(*args))?;
        }
    }
    Ok(())
}
