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
    },
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Crd { out_dir: None } => {
            print!("{}", anneal_manager::crdgen::render_all()?);
        }
        Command::Crd { out_dir: Some(dir) } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for crd in anneal_api::crds() {
                let path = dir.join(anneal_manager::crdgen::file_name(&crd));
                std::fs::write(&path, anneal_manager::crdgen::render(&crd)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
        }
    }
    Ok(())
}
