//! `capture` and `restore` subcommands over the `anneal-image` library.

use clap::Args;

/// Arguments of `anneal-agent capture`.
#[derive(Debug, Args)]
pub struct CaptureArgs {
    /// Source disk image.
    pub source: std::path::PathBuf,
}

/// Arguments of `anneal-agent restore`.
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Target block device or file.
    pub target: std::path::PathBuf,
}

/// Runs `capture`.
pub fn capture(args: &CaptureArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "capture of {} is not available in this build",
        args.source.display()
    )
}

/// Runs `restore`.
pub fn restore(args: &RestoreArgs) -> anyhow::Result<()> {
    anyhow::bail!(
        "restore to {} is not available in this build",
        args.target.display()
    )
}
