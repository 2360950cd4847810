//! bootd: thin entry point.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anneal_bootd::{Server, ServerOptions, StaticConfig};
use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "bootd",
    version,
    about = "DHCP, TFTP and HTTP network boot for one Subnet"
)]
struct Cli {
    /// Static YAML boot table (labs without a cluster).
    #[arg(long, env = "BOOTD_CONFIG")]
    config: PathBuf,
    /// Interface the DHCP sockets bind to; `auto`: the interface holding
    /// the Subnet's `serverIP` (a managed bootd on the host's network).
    #[arg(long, env = "BOOTD_INTERFACE")]
    interface: Option<String>,
    /// Address TFTP and HTTP listen on.
    #[arg(long, default_value = "0.0.0.0")]
    listen_ip: Ipv4Addr,
    #[arg(long, default_value_t = 67)]
    dhcp_port: u16,
    /// 0 disables it.
    #[arg(long, default_value_t = 4011)]
    pxe_port: u16,
    /// 0 disables it.
    #[arg(long, default_value_t = 69)]
    tftp_port: u16,
    /// Total time one TFTP transfer may take, seconds (then ERROR naming it).
    #[arg(long, default_value_t = anneal_bootd::tftp::TRANSFER_DEADLINE.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    tftp_deadline_secs: u64,
    /// TFTP transfers running at once from one source address (then ERROR naming it).
    #[arg(long, default_value_t = anneal_bootd::tftp::PER_SOURCE_TRANSFERS, value_parser = parse_at_least_one)]
    tftp_per_source: usize,
    #[arg(long, default_value_t = 8080)]
    http_port: u16,
    /// HTTP connections served at once; more wait in the listen backlog.
    #[arg(long, default_value_t = anneal_bootd::http::MAX_CONNECTIONS, value_parser = parse_at_least_one)]
    http_max_connections: usize,
    /// Seconds a client has to send a complete HTTP request head (also the
    /// idle time of a kept-alive connection), then the connection is closed.
    #[arg(long, default_value_t = anneal_bootd::http::HEADER_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    http_header_timeout_secs: u64,
    /// Seconds an HTTP connection may go without a byte moving either way
    /// (a client that stopped reading), then it is closed.
    #[arg(long, default_value_t = anneal_bootd::http::STALL_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    http_stall_timeout_secs: u64,
    /// Lease file (lease mode); its directory is created if missing.
    #[arg(long, env = "BOOTD_LEASE_FILE")]
    lease_file: Option<PathBuf>,
    /// Boot files from one directory, overriding the configuration's
    /// `artifacts` and `filesDir`: `DIR/vmlinuz` (the kernel),
    /// `DIR/initrd.img` (the agent's initramfs), every file of
    /// `DIR/files/` (the first stages: snponly.efi, undionly.kpxe, …) and,
    /// when present, `DIR/aarch64/vmlinuz` and `DIR/aarch64/initrd.img`
    /// (for Machines of `architecture: aarch64`). A managed bootd gets the
    /// content store's `boot` directory.
    #[arg(long)]
    boot_dir: Option<PathBuf>,
    /// iPXE boot script template (default: the shipped one).
    #[arg(long)]
    template: Option<PathBuf>,
    /// Serve the Subnet NAMESPACE/NAME from the API server (KUBECONFIG or
    /// in-cluster): its Machines, reservations and boot tokens replace the
    /// file's machines and dhcp settings; the file still gives artifacts,
    /// files and the API URL.
    #[arg(long, env = "BOOTD_SUBNET")]
    subnet: Option<String>,
    /// Serve DHCPv6 on --interface with this address of bootd's (TFTP and
    /// HTTP also listen on it; the boot URLs name it).
    #[arg(long, requires_all = ["interface", "dhcp6_prefix"])]
    dhcp6_server_ip: Option<std::net::Ipv6Addr>,
    /// The segment's on-link IPv6 prefix, e.g. `2001:db8:77::/64`.
    #[arg(long, requires = "dhcp6_server_ip")]
    dhcp6_prefix: Option<anneal_dhcp::v6::Cidr6>,
    /// IPv6 addresses for machines without an IPv6 reservation,
    /// `FIRST-LAST` (inclusive).
    #[arg(long, requires = "dhcp6_server_ip", value_parser = parse_range6)]
    dhcp6_range: Option<(std::net::Ipv6Addr, std::net::Ipv6Addr)>,
    /// DNS servers handed out over DHCPv6 (repeat the flag).
    #[arg(long, requires = "dhcp6_server_ip")]
    dhcp6_dns: Vec<std::net::Ipv6Addr>,
    /// Send ICMPv6 router advertisements for --dhcp6-prefix on
    /// --interface (managed and other flags set, not a default router) and
    /// answer router solicitations; needs CAP_NET_RAW.
    #[arg(long, requires = "dhcp6_server_ip")]
    router_advertisements: bool,
}

fn load(cli: &Cli) -> anyhow::Result<anneal_bootd::Snapshot> {
    let (cfg, rev) = load_config(cli)?;
    Ok(cfg.snapshot(cli.http_port, rev)?)
}

/// The configuration file, with `--boot-dir` applied.
fn load_config(cli: &Cli) -> anyhow::Result<(StaticConfig, String)> {
    let (mut cfg, rev) = StaticConfig::load(&cli.config)?;
    if let Some(dir) = &cli.boot_dir {
        cfg.use_boot_dir(dir)?;
    }
    Ok((cfg, rev))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        // colours only on a terminal (logs piped to files stay plain)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Some(dir) = cli
        .lease_file
        .as_deref()
        .and_then(std::path::Path::parent)
        .filter(|d| !d.as_os_str().is_empty())
    {
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating the lease file's directory {}", dir.display()))?;
    }
    let mut watch = None;
    let snap = match &cli.subnet {
        Some(key) => {
            let (ns, name) = key
                .split_once('/')
                .context("--subnet must be NAMESPACE/NAME")?;
            let (base, _) = load_config(&cli)?;
            let cfg = anneal_bootd::watch::WatchConfig {
                namespace: ns.into(),
                subnet: name.into(),
                base,
                http_port: cli.http_port,
            };
            let client = kube::Client::try_default()
                .await
                .context("connecting to the api server")?;
            let (snap, _, _) = anneal_bootd::watch::build(&client, &cfg)
                .await
                .context("building the boot table from the cluster")?;
            watch = Some((client, cfg));
            snap
        }
        None => load(&cli).context("loading the boot table")?,
    };
    let interface = match cli.interface.as_deref() {
        Some("auto") => {
            let ip = snap.table.server_ip;
            let found = interface_with(ip)?.with_context(|| {
                format!(
                    "no interface of this host has the address {ip} (serverIP{}): add it to the \
                     provisioning interface, or name one with --interface",
                    cli.subnet
                        .as_deref()
                        .map(|s| format!(" of Subnet {s}"))
                        .unwrap_or_default()
                )
            })?;
            tracing::info!(interface = %found, %ip, "serving on the interface holding serverIP");
            Some(found)
        }
        other => other.map(str::to_string),
    };
    let opts = ServerOptions {
        interface,
        listen_ip: cli.listen_ip,
        dhcp_port: cli.dhcp_port,
        pxe_port: cli.pxe_port,
        tftp_port: cli.tftp_port,
        http_port: cli.http_port,
        lease_file: cli.lease_file.clone(),
        template: cli.template.clone(),
        tftp_limits: anneal_bootd::tftp::TftpLimits {
            deadline: std::time::Duration::from_secs(cli.tftp_deadline_secs),
            per_source: cli.tftp_per_source,
        },
        http_limits: anneal_bootd::http::HttpLimits {
            max_connections: cli.http_max_connections,
            header_timeout: std::time::Duration::from_secs(cli.http_header_timeout_secs),
            stall_timeout: std::time::Duration::from_secs(cli.http_stall_timeout_secs),
        },
        dhcp6: match (cli.dhcp6_server_ip, cli.dhcp6_prefix) {
            (Some(server_ip), Some(prefix)) => Some(anneal_bootd::dhcp6::Dhcp6Options {
                server_ip,
                prefix,
                range: cli.dhcp6_range,
                dns: cli.dhcp6_dns.clone(),
                preferred_lifetime: 1800,
                valid_lifetime: 3600,
            }),
            _ => None,
        },
        router_advertisements: cli.router_advertisements,
    };
    let server = Server::start(opts, snap).await.context("starting bootd")?;
    let cancel = tokio_util::sync::CancellationToken::new();
    if let Some((client, cfg)) = watch.clone() {
        tokio::spawn(anneal_bootd::watch::run(
            client,
            cfg,
            server.shared().clone(),
            cancel.clone(),
        ));
    }
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = hup.recv(), if watch.is_none() => match load(&cli) {
                Ok(s) => {
                    tracing::info!(revision = %s.table.revision, "boot table reloaded");
                    server.install(s);
                }
                Err(e) => tracing::error!(error = format!("{e:#}"), "reload failed; keeping the live table"),
            },
        }
    }
    cancel.cancel();
    server.shutdown().await;
    Ok(())
}

/// The interface holding the IPv4 address `ip`, if one does.
fn interface_with(ip: Ipv4Addr) -> anyhow::Result<Option<String>> {
    let addrs = nix::ifaddrs::getifaddrs().context("listing the host's addresses")?;
    for a in addrs {
        let held = a
            .address
            .as_ref()
            .and_then(|s| s.as_sockaddr_in())
            .map(|s| s.ip());
        if held == Some(ip) {
            return Ok(Some(a.interface_name));
        }
    }
    Ok(None)
}

/// `--dhcp6-range FIRST-LAST`.
fn parse_range6(s: &str) -> Result<(std::net::Ipv6Addr, std::net::Ipv6Addr), String> {
    let bad =
        || format!("{s:?} is not FIRST-LAST (two IPv6 addresses, the first not above the last)");
    let (a, b) = s.split_once('-').ok_or_else(bad)?;
    let (a, b): (std::net::Ipv6Addr, std::net::Ipv6Addr) = (
        a.trim().parse().map_err(|_| bad())?,
        b.trim().parse().map_err(|_| bad())?,
    );
    if u128::from(a) > u128::from(b) {
        return Err(bad());
    }
    Ok((a, b))
}

/// `--tftp-per-source`, `--http-max-connections`: at least 1 (0 would
/// refuse every transfer or connection).
fn parse_at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}
