//! anneal-agent: thin entry point; see the library for the work.

use anneal_agent::imaging;
use clap::{Parser, Subcommand};

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
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Capture(args) => imaging::capture(&args),
        Command::Restore(args) => imaging::restore(&args),
    }
}
