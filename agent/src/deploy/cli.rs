//! `anneal-agent deploy --plan plan.json`: runs a plan locally, without the
//! agent API (tests, the bench, a bench-top disk). One JSON object per line
//! on stdout: `progress` lines (phase, partitions, httpBytes, retries in
//! `logLines`), then one `result` or `error` line; logs go to stderr.

use std::path::PathBuf;
use std::time::Duration;

use anneal_api::agent::DeployPlan;
use clap::Args;

use super::{Control, DeployOptions, HookRunner, no_hooks, run_plan};
use crate::jsonl::Out;

/// Arguments of `anneal-agent deploy`.
#[derive(Debug, Args)]
pub struct DeployArgs {
    /// The plan (the `plan` of a `deploy` answer of `next`, as JSON).
    #[arg(long)]
    pub plan: PathBuf,
    /// Seconds between progress lines (default: the plan's).
    #[arg(long)]
    pub progress_interval: Option<f64>,
    /// MiB per HTTP range request.
    #[arg(long, default_value_t = 32)]
    pub range_mib: u64,
    /// Retries of one piece after its first attempt.
    #[arg(long, default_value_t = 4)]
    pub retries: u32,
    /// The first backoff in milliseconds (doubled on every retry).
    #[arg(long, default_value_t = 500)]
    pub backoff_ms: u64,
}

/// Runs the subcommand; true on success.
pub fn run(args: &DeployArgs) -> bool {
    run_with_hooks(args, &mut no_hooks)
}

/// Runs the subcommand with a post-install runner; true on success.
pub fn run_with_hooks(args: &DeployArgs, hooks: &mut HookRunner<'_>) -> bool {
    let out = Out::new();
    let plan: DeployPlan = match std::fs::read(&args.plan)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(p) => p,
        Err(e) => {
            out.line(&serde_json::json!({
                "event": "error",
                "reason": "InvalidPlan",
                "message": format!("reading the plan {}: {e}", args.plan.display()),
            }));
            return false;
        }
    };
    let interval = args
        .progress_interval
        .filter(|s| s.is_finite() && *s > 0.0)
        .map_or(
            Duration::from_secs(u64::from(plan.progress_interval_seconds.max(1))),
            Duration::from_secs_f64,
        );
    let opts = DeployOptions {
        progress_interval: interval,
        range_bytes: args.range_mib.max(1) << 20,
        retries: args.retries,
        backoff: Duration::from_millis(args.backoff_ms),
        allow_files: true,
        ..DeployOptions::default()
    };
    let mut report = |p: &super::Progress| {
        let mut v = serde_json::to_value(p).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert("event".into(), "progress".into());
            o.insert("runId".into(), plan.run_id.clone().into());
        }
        out.line(&v);
        Control::Continue
    };
    match run_plan(&plan, &opts, &mut report, hooks) {
        Ok(f) => {
            out.line(&serde_json::json!({
                "event": "result",
                "status": "succeeded",
                "runId": plan.run_id,
                "seconds": f.seconds,
                "httpBytes": f.http_bytes,
                "contentBytes": f.content_bytes,
                "transfer": f.transfer,
                "timings": f.timings,
            }));
            true
        }
        Err(f) => {
            out.line(&serde_json::json!({
                "event": "error",
                "reason": "DeployFailed",
                "runId": plan.run_id,
                "phase": f.phase.as_str(),
                "message": f.reason(),
                "diskInvalidated": f.wrote,
                "timings": f.timings,
            }));
            false
        }
    }
}
