//! anneal-agent: thin entry point; see the library for the work.

use std::path::PathBuf;

use anneal_agent::{cmdline, imaging, init, inventory};
use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "anneal-agent",
    version,
    about = "anneal live-environment agent"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Capture a disk image's partitions into content streams and a layout.
    Capture(imaging::CaptureArgs),
    /// Restore a layout and its contents onto a block device or file.
    Restore(imaging::RestoreArgs),
    /// Run as init (PID 1 of the live environment; chosen automatically when
    /// the process is PID 1).
    Init,
    /// The agent proper, started by PID 1.
    #[command(hide = true)]
    InitWorker,
    /// Print this host's hardware inventory as JSON.
    Inspect(InspectArgs),
    /// Parse a kernel command line and print it as JSON (token redacted).
    Cmdline(CmdlineArgs),
    /// Fetch a source disk image (http, https, staged://), capture it and
    /// publish its contents into a content store (JSON lines on stdout).
    Ingest(anneal_agent::ingest::IngestArgs),
    /// Verify or remove a content of a content store (JSON lines on stdout).
    Store(anneal_agent::store::StoreArgs),
    /// Serve a content store over HTTP/1.1 with byte ranges (the content
    /// server of a Site): `/content/<namespace>/<content>/index|stream`,
    /// verified contents only.
    Serve(ServeArgs),
    /// A minimal HTTP BitTorrent tracker (BEP 3 announce, BEP 23 compact
    /// peers): `/announce`, `/stats`.
    Tracker(TrackerArgs),
    /// Seed contents of a content store over BitTorrent until killed
    /// (JSON line `seeding` on stdout once checked).
    #[cfg(feature = "swarm")]
    Seed(anneal_agent::swarm::SeedArgs),
    /// Fetch one content over BitTorrent onto a slot of a disk or file,
    /// verified piece by piece (JSON lines `written`, `done` on stdout).
    #[cfg(feature = "swarm")]
    SwarmFetch(anneal_agent::swarm::FetchArgs),
    /// Run a deploy plan locally (no agent API): fetch, verify and write
    /// its contents, write the tables (JSON lines on stdout; exit 1 on
    /// failure).
    Deploy(anneal_agent::deploy::cli::DeployArgs),
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The content store: `<namespace>/<content>/{index,stream,verified}`.
    #[arg(long)]
    content_dir: PathBuf,
    /// Listen address.
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: std::net::SocketAddr,
    /// Connections served at once; more are answered 503.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Tracker announce URL written into the torrents served at
    /// `/content/<namespace>/<content>/torrent` (none: no `announce`).
    #[arg(long)]
    tracker: Option<String>,
}

#[derive(Debug, Args)]
struct TrackerArgs {
    /// Listen address.
    #[arg(long, default_value = "0.0.0.0:6969")]
    listen: std::net::SocketAddr,
    /// Announce interval in seconds; a peer silent for two is dropped.
    #[arg(long, default_value_t = 60)]
    interval: u64,
    /// Track only the info hashes in this file (hex, one per line, `#`
    /// comments; re-read when it changes).
    #[arg(long)]
    allow_file: Option<PathBuf>,
    /// Track only the torrents of this content store's verified contents
    /// (rescanned every 5 s).
    #[arg(long, conflicts_with = "allow_file")]
    allow_store: Option<PathBuf>,
    /// Torrents tracked at once.
    #[arg(long, default_value_t = 1024)]
    max_torrents: usize,
    /// Peers per torrent.
    #[arg(long, default_value_t = 1024)]
    max_peers: usize,
    /// Connections served at once; more are answered 503.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
}

#[derive(Debug, Args)]
struct InspectArgs {
    /// Read /sys, /proc and /dev under this root (a captured fixture tree).
    #[arg(long, default_value = "/")]
    root: PathBuf,
    /// Keep removable and USB disks.
    #[arg(long)]
    include_removable: bool,
    /// Do not read partitions to probe filesystems.
    #[arg(long)]
    no_probe: bool,
    /// Listen this many seconds for LLDP on every NIC (brought up for it)
    /// and report each NIC's switch port; 0 (the default) does not listen.
    #[arg(long, default_value_t = 0, value_name = "SECONDS")]
    lldp: u64,
}

#[derive(Debug, Args)]
struct CmdlineArgs {
    /// Read from this file (default /proc/cmdline).
    #[arg(long, conflicts_with = "vectors")]
    file: Option<PathBuf>,
    /// Golden-vector mode: one command line per input line, a JSON array of
    /// {cmdline, result | error} out.
    #[arg(long)]
    vectors: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    if init::is_pid1() {
        init::pid1();
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Capture(args) => {
            tracing_init();
            imaging::capture(&args)
        }
        Command::Restore(args) => {
            tracing_init();
            imaging::restore(&args)
        }
        Command::Ingest(args) => {
            tracing_init();
            // SIGTERM (a deleted Job) or SIGINT: remove the staging and
            // scratch directories, then end with 128 + the signal number.
            // Blocked here, before any thread exists, so only the waiter
            // takes them.
            let work_dirs = anneal_agent::ingest::WorkDirs::default();
            let mut set = nix::sys::signal::SigSet::empty();
            set.add(nix::sys::signal::Signal::SIGTERM);
            set.add(nix::sys::signal::Signal::SIGINT);
            set.thread_block()?;
            let dirs = work_dirs.clone();
            std::thread::Builder::new()
                .name("signals".into())
                .spawn(move || {
                    if let Ok(sig) = set.wait() {
                        tracing::warn!(signal = %sig, "terminated: removing the work directories");
                        dirs.remove_all();
                        std::process::exit(128 + sig as i32);
                    }
                })?;
            if anneal_agent::ingest::run(&args, &work_dirs) {
                Ok(())
            } else {
                std::process::exit(1)
            }
        }
        Command::Store(args) => {
            tracing_init();
            if anneal_agent::store::run(&args) {
                Ok(())
            } else {
                std::process::exit(1)
            }
        }
        Command::Init => anyhow::bail!(
            "init runs only as PID 1 (the initramfs's /init); use `anneal-agent inspect` on a running host"
        ),
        Command::InitWorker => {
            if std::env::var_os(init::INIT_START_ENV).is_none() {
                anyhow::bail!("init-worker is started by PID 1 only");
            }
            init::worker()
        }
        Command::Inspect(a) => {
            let mut hw = inventory::Root::new(&a.root).collect(inventory::Options {
                include_removable: a.include_removable,
                probe_filesystems: !a.no_probe,
            })?;
            let links = inventory::lldp::links(&a.root.join("sys/class/net"));
            let (heard, errors) =
                inventory::lldp::listen(&links, std::time::Duration::from_secs(a.lldp));
            for e in errors {
                eprintln!("warning: {}", anneal_api::error_chain(&e));
            }
            inventory::lldp::annotate(&mut hw.nics, &heard);
            println!("{}", serde_json::to_string_pretty(&hw)?);
            Ok(())
        }
        Command::Serve(a) => {
            tracing_init();
            let mut cfg = anneal_agent::serve::ServeConfig::new(&a.content_dir);
            cfg.max_connections = a.max_connections.max(1);
            cfg.tracker = a.tracker.clone();
            let server = anneal_agent::serve::Server::bind(a.listen, cfg)?;
            tracing::info!(addr = %server.local_addr()?, dir = %a.content_dir.display(), "serving the content store");
            server.run();
            Ok(())
        }
        Command::Tracker(a) => {
            tracing_init();
            let cfg = anneal_agent::tracker::TrackerConfig {
                interval: std::time::Duration::from_secs(a.interval.max(1)),
                max_torrents: a.max_torrents.max(1),
                max_peers: a.max_peers.max(1),
                max_connections: a.max_connections.max(1),
                allow_file: a.allow_file.clone(),
                allow_store: a.allow_store.clone(),
                ..Default::default()
            };
            let tracker = anneal_agent::tracker::Tracker::bind(a.listen, cfg)?;
            tracing::info!(addr = %tracker.local_addr()?, interval = a.interval, allow_file = ?a.allow_file, allow_store = ?a.allow_store, "tracker listening");
            tracker.run();
            Ok(())
        }
        #[cfg(feature = "swarm")]
        Command::Seed(a) => {
            tracing_init();
            // A seeder is a manager's workload: why it ended goes on stdout
            // as the protocol's `error` line (the Image's SeederDegraded
            // message), not only in a backtrace on stderr.
            anneal_agent::swarm::run_seed(&a).inspect_err(|e| {
                println!(
                    "{}",
                    serde_json::json!({"event": "error", "reason": "SeedFailed", "message": format!("{e:#}")})
                );
            })
        }
        #[cfg(feature = "swarm")]
        Command::SwarmFetch(a) => {
            tracing_init();
            anneal_agent::swarm::run_fetch(&a)
        }
        Command::Deploy(args) => {
            tracing_init();
            if anneal_agent::deploy::cli::run(&args) {
                Ok(())
            } else {
                std::process::exit(1)
            }
        }
        Command::Cmdline(a) => {
            if let Some(path) = a.vectors {
                let input = std::fs::read_to_string(&path)?;
                let v: Vec<serde_json::Value> = input
                    .lines()
                    .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                    .map(cmdline_vector)
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(());
            }
            let raw = std::fs::read(a.file.unwrap_or_else(|| "/proc/cmdline".into()))?;
            let p = cmdline::BootParams::parse(&raw)?;
            println!("{}", serde_json::to_string_pretty(&p.redacted_json())?);
            Ok(())
        }
    }
}

/// One golden vector: the input and what the parser made of it.
fn cmdline_vector(line: &str) -> serde_json::Value {
    match cmdline::BootParams::parse(line.as_bytes()) {
        Ok(p) => serde_json::json!({ "cmdline": line, "result": p.redacted_json() }),
        Err(e) => serde_json::json!({ "cmdline": line, "error": e.to_string() }),
    }
}

fn tracing_init() {
    use std::io::IsTerminal as _;
    // colours only on a terminal: logs piped to a file, a test or the
    // serial console's capture stay plain text
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
