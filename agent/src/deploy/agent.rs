//! The live environment's deploy: [`run_plan`] with progress sent through
//! the agent API (`progress` answers continue or abort) and the outcome
//! through `result`, a progress line on the console.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use anneal_api::agent::{
    DeployPlan, Outcome, ProgressAction, ProgressRequest, ResultRequest, sanitize_reason,
};
use anneal_api::error_chain;

use super::{Control, DeployOptions, HookRunner, Progress, run_plan};
use crate::client::{AgentClient, Backoff};
use crate::say;

/// How long the agent keeps trying to report a deploy's outcome: longer
/// than a manager's replacement (a new pod, the old leader's Lease
/// expiring) takes.
const RESULT_BUDGET: Duration = Duration::from_secs(300);

/// While the deploy runs: whenever no progress was sent for `every` (a step
/// that reports nothing, such as a long sync or a hook), the last report is
/// sent again. The session is renewed by use (docs/api.md, the agent API),
/// so a silent step longer than the session's TTL would otherwise cost the
/// run its progress and result reports. Ends when `stop` is set.
fn keepalive(
    client: &AgentClient,
    last: &Mutex<Option<(ProgressRequest, Instant)>>,
    stop: &(Mutex<bool>, Condvar),
    every: Duration,
) {
    let every = every.max(Duration::from_secs(1));
    let mut stopped = stop.0.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        stopped = match stop.1.wait_timeout(stopped, every) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        };
        if *stopped {
            return;
        }
        let due = {
            let l = last.lock().unwrap_or_else(|e| e.into_inner());
            l.as_ref()
                .filter(|(_, at)| at.elapsed() >= every)
                .map(|(req, _)| req.clone())
        };
        let Some(req) = due else { continue };
        drop(stopped);
        // an Abort answer is seen by the deploy's own next report
        match client.progress(&ProgressRequest {
            log_lines: Vec::new(),
            ..req.clone()
        }) {
            Ok(_) => *last.lock().unwrap_or_else(|e| e.into_inner()) = Some((req, Instant::now())),
            Err(e) => say!("deploy: keepalive report failed: {}", error_chain(&e)),
        }
        stopped = stop.0.lock().unwrap_or_else(|e| e.into_inner());
    }
}

/// Runs `plan`, reporting to the manager. `Ok` after a reported success;
/// `Err` with the one console line of a failure (already reported).
pub fn run(
    client: &AgentClient,
    plan: &DeployPlan,
    hooks: &mut HookRunner<'_>,
) -> Result<(), String> {
    let total: u64 = plan
        .disks
        .iter()
        .flat_map(|d| &d.contents)
        .map(|c| c.stream_bytes)
        .sum();
    say!(
        "deploy of run {}: {} disk(s), {} content(s), {:.1} MiB to write",
        plan.run_id,
        plan.disks.len(),
        plan.disks.iter().map(|d| d.contents.len()).sum::<usize>(),
        total as f64 / (1u64 << 20) as f64
    );
    let opts = DeployOptions {
        progress_interval: Duration::from_secs(u64::from(
            plan.progress_interval_seconds.clamp(1, 60),
        )),
        ..DeployOptions::default()
    };
    let start = Instant::now();
    let last: Mutex<Option<(ProgressRequest, Instant)>> = Mutex::new(None);
    let stop = (Mutex::new(false), Condvar::new());
    let mut report = |p: &Progress| {
        let done: u64 = p.partitions.iter().map(|x| x.bytes_done).sum();
        let secs = start.elapsed().as_secs_f64().max(0.001);
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let swarm = p.transfer.as_ref().map_or(String::new(), |t| {
            format!(
                ", swarm: {} peers, {:.0} MiB from peers, {:.0} MiB from the seeder, {:.0} MiB uploaded",
                t.peers,
                mib(t.peer_bytes),
                mib(t.seeder_bytes),
                mib(t.uploaded_bytes)
            )
        });
        say!(
            "deploy: {} {}% ({:.0}/{:.0} MiB, {:.1} MiB/s over HTTP{swarm})",
            p.phase.as_str(),
            (done * 100).checked_div(total).unwrap_or(100),
            mib(done),
            mib(total),
            mib(p.http_bytes) / secs
        );
        for l in &p.log_lines {
            say!("deploy: {l}");
        }
        let req = ProgressRequest {
            run_id: plan.run_id.clone(),
            phase: p.phase.as_str().to_string(),
            partitions: p.partitions.clone(),
            http_bytes: p.http_bytes,
            transfer: p.transfer.clone(),
            log_lines: p.log_lines.iter().map(|l| sanitize_reason(l)).collect(),
        };
        let sent = client.progress(&req);
        if sent.is_ok() {
            *last.lock().unwrap_or_else(|e| e.into_inner()) = Some((req, Instant::now()));
        }
        match sent {
            Ok(r) if r.action == ProgressAction::Abort => {
                say!("deploy: the manager asked to abort run {}", plan.run_id);
                Control::Abort
            }
            Ok(_) => Control::Continue,
            Err(e) => {
                // a missed report is not a reason to stop writing
                say!("deploy: progress report failed: {}", error_chain(&e));
                Control::Continue
            }
        }
    };
    let res = std::thread::scope(|s| {
        s.spawn(|| keepalive(client, &last, &stop, opts.progress_interval));
        let res = run_plan(plan, &opts, &mut report, hooks);
        *stop.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        stop.1.notify_all();
        res
    });
    let (outcome, line) = match &res {
        Ok(f) => {
            say!(
                "deploy of run {} succeeded in {:.1} s ({:.1} MiB over HTTP)",
                plan.run_id,
                f.seconds,
                f.http_bytes as f64 / (1u64 << 20) as f64
            );
            for t in &f.timings {
                say!(
                    "deploy: phase {} took {:.1} s",
                    t.phase.as_str(),
                    t.ended_ms.saturating_sub(t.started_ms) as f64 / 1000.0
                );
            }
            (Outcome::Succeeded, None)
        }
        Err(f) => {
            let reason = f.reason();
            let line = format!(
                "FAILED: deploy of run {} in phase {}: {reason}{}",
                plan.run_id,
                f.phase.as_str(),
                if f.wrote {
                    " (the disk was left without a partition table)"
                } else {
                    ""
                }
            );
            (
                Outcome::Failed {
                    reason,
                    phase: Some(f.phase.as_str().to_string()),
                },
                Some(line),
            )
        }
    };
    let req = ResultRequest {
        run_id: plan.run_id.clone(),
        outcome,
    };
    let sent = send_result(client, &req);
    match line {
        Some(l) => Err(l),
        None if sent => Ok(()),
        None => Err(format!(
            "FAILED: deploy of run {} succeeded but the result could not be reported; check that the manager's agent API is reachable",
            plan.run_id
        )),
    }
}

/// Reports the outcome. The manager may be away for a while (its pod
/// replaced, a new leader waiting for the old Lease to expire): the outcome
/// of a deploy is not given up before [`RESULT_BUDGET`]. Whether it was
/// delivered.
fn send_result(client: &AgentClient, req: &ResultRequest) -> bool {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
    let mut sent = false;
    let started = Instant::now();
    for attempt in 1.. {
        match client.result(req) {
            Ok(()) => {
                sent = true;
                break;
            }
            Err(e) if e.is_permanent() => {
                say!("deploy: reporting the result failed: {}", error_chain(&e));
                break;
            }
            Err(e) => {
                let d = backoff.next_delay();
                if started.elapsed() + d > RESULT_BUDGET {
                    say!(
                        "deploy: reporting the result failed (attempt {attempt}, giving up after {:.0} s): {}",
                        started.elapsed().as_secs_f64(),
                        error_chain(&e)
                    );
                    break;
                }
                say!(
                    "deploy: reporting the result failed (attempt {attempt}): {}; retrying in {:.1} s",
                    error_chain(&e),
                    d.as_secs_f64()
                );
                std::thread::sleep(d);
            }
        }
    }
    sent
}
