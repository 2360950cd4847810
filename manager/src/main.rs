//! manager: thin entry point.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "manager", version)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let _cli = Cli::parse();
    Ok(())
}
