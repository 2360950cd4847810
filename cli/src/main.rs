//! `kubectl anneal`: see docs/operators.md.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = kubectl_anneal::Cli::parse();
    let mut out = std::io::stdout().lock();
    match kubectl_anneal::run(cli, &mut out).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = out.flush();
            eprintln!("error: {}", anneal_api::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
