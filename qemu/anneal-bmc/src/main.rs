//! anneal-qemu-bmc: a Redfish BMC for one QEMU VM (see the library docs).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "anneal-qemu-bmc",
    version,
    about = "A Redfish BMC for one QEMU VM, over QMP"
)]
struct Cli {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// QEMU's QMP socket (`-qmp unix:PATH,server=on,wait=off`).
    #[arg(long)]
    qmp: PathBuf,
    /// Where the BMC persists its boot override.
    #[arg(long)]
    state_file: PathBuf,
    /// JSON-lines log of every request.
    #[arg(long)]
    request_log: Option<PathBuf>,
    /// Basic-auth user.
    #[arg(long, default_value = "admin")]
    username: String,
    /// File holding the Basic-auth password (default password: `password`).
    #[arg(long)]
    password_file: Option<PathBuf>,
    /// ComputerSystem Id.
    #[arg(long, default_value = "qemu")]
    system_id: String,
    /// PEM certificate chain: serve HTTPS (needs --tls-key).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
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
    let password = match &cli.password_file {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading {}", p.display()))?
            .trim_end()
            .to_string(),
        None => "password".to_string(),
    };
    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(c), Some(k)) => Some((std::fs::read(c)?, std::fs::read(k)?)),
        _ => None,
    };
    let bmc = anneal_qemu_bmc::start(anneal_qemu_bmc::BmcConfig {
        listen: cli.listen,
        qmp: cli.qmp,
        state_file: cli.state_file,
        request_log: cli.request_log,
        username: cli.username,
        password,
        system_id: cli.system_id,
        tls,
    })
    .await?;
    println!("anneal-qemu-bmc listening on {}", bmc.addr());
    tokio::signal::ctrl_c().await?;
    bmc.stop().await;
    Ok(())
}
