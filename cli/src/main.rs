//! `kubectl anneal`: see docs/operators.md.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = kubectl_anneal::Cli::parse();
    let tty = std::io::stdout().is_terminal();
    let mut out = std::io::stdout().lock();
    match kubectl_anneal::run_on(cli, &mut out, tty).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = out.flush();
            eprintln!("error: {}", anneal_api::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
