//! The deploy half of the agent API: `progress` and `result` of the run the
//! Machine is Provisioning with. A session is bound to its Machine; a report
//! for any run other than the Machine's `status.currentRunRef` is refused,
//! so a run's token is useless for another run.

use std::collections::BTreeMap;

use anneal_api::agent::{self, Outcome, ProgressAction, ProgressRequest, ResultRequest};
use anneal_api::conditions::{reasons, types};
use anneal_api::{
    DeployRun, DeployRunStatus, Machine, MachineState, PartitionProgressStatus, PhaseTiming,
    RunPhase, Time, TransferStatus,
};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, Resource as _, ResourceExt};
use serde_json::json;

/// The per-run agent log kept in ConfigMap `<run>-log`, at most this many
/// bytes (the oldest lines go first).
pub const MAX_LOG_BYTES: usize = 512 * 1024;
/// The key of the log in that ConfigMap.
pub const LOG_KEY: &str = "log";

/// Why a report is refused.
#[derive(Debug)]
pub enum Refusal {
    /// The body does not parse or names an unknown phase.
    BadRequest(String),
    /// The run is not this Machine's current run.
    NotCurrent(String),
    /// The API server failed.
    Api(kube::Error),
}

impl From<kube::Error> for Refusal {
    fn from(e: kube::Error) -> Self {
        Self::Api(e)
    }
}

fn current_run(m: &Machine, run_id: &str) -> Result<(), Refusal> {
    let st = m.status.as_ref();
    let provisioning = st.and_then(|s| s.state) == Some(MachineState::Provisioning);
    let current = st
        .and_then(|s| s.current_run_ref.as_ref())
        .is_some_and(|r| r.name == run_id);
    if provisioning && current {
        Ok(())
    } else {
        Err(Refusal::NotCurrent(format!(
            "run {run_id:?} is not the current run of Machine {}",
            m.name_any()
        )))
    }
}

fn parse_phase(s: &str) -> Option<RunPhase> {
    Some(match s {
        "Pending" => RunPhase::Pending,
        "Partitioning" => RunPhase::Partitioning,
        "WritingContent" => RunPhase::WritingContent,
        "RunningPostHook" => RunPhase::RunningPostHook,
        "Finalizing" => RunPhase::Finalizing,
        _ => return None,
    })
}

fn phase_name(p: RunPhase) -> &'static str {
    match p {
        RunPhase::Pending => "Pending",
        RunPhase::Partitioning => "Partitioning",
        RunPhase::WritingContent => "WritingContent",
        RunPhase::RunningPostHook => "RunningPostHook",
        RunPhase::Finalizing => "Finalizing",
        RunPhase::Succeeded => "Succeeded",
        RunPhase::Failed => "Failed",
    }
}

/// Closes the open phase timing and opens `next` (unless it is terminal).
fn enter(timings: &mut Vec<PhaseTiming>, next: RunPhase, now: Timestamp) {
    let name = phase_name(next);
    if timings
        .last()
        .is_some_and(|t| t.phase == name && t.end.is_none())
    {
        return;
    }
    if let Some(last) = timings.last_mut()
        && last.end.is_none()
    {
        last.end = Some(Time(now));
    }
    if !matches!(next, RunPhase::Succeeded | RunPhase::Failed) {
        timings.push(PhaseTiming {
            phase: name.into(),
            start: Some(Time(now)),
            end: None,
        });
    }
}

fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(super::FIELD_MANAGER.into()),
        ..PatchParams::default()
    }
}

async fn write_status(
    client: &Client,
    run: &DeployRun,
    status: &DeployRunStatus,
) -> Result<(), kube::Error> {
    let ns = run.namespace().unwrap_or_default();
    let patch = json!({
        "metadata": {"resourceVersion": run.resource_version()},
        "status": status,
    });
    Api::<DeployRun>::namespaced(client.clone(), &ns)
        .patch_status(&run.name_any(), &patch_params(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Appends lines to the run's log ConfigMap, bounded.
async fn append_log(client: &Client, run: &DeployRun, lines: &[String]) -> Result<(), kube::Error> {
    if lines.is_empty() {
        return Ok(());
    }
    let ns = run.namespace().unwrap_or_default();
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let name = format!("{}-log", run.name_any());
    let mut text = api
        .get_opt(&name)
        .await?
        .and_then(|c| c.data)
        .and_then(|mut d| d.remove(LOG_KEY))
        .unwrap_or_default();
    for l in lines {
        let l: String = l
            .chars()
            .filter(|c| !c.is_control() || *c == '\t')
            .take(4096)
            .collect();
        text.push_str(&l);
        text.push('\n');
    }
    if text.len() > MAX_LOG_BYTES {
        let mut cut = text.len() - MAX_LOG_BYTES;
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        let start = text[cut..].find('\n').map_or(cut, |i| cut + i + 1);
        text = text[start..].to_string();
    }
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns),
            owner_references: run.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([(LOG_KEY.to_string(), text)])),
        ..ConfigMap::default()
    };
    match api.create(&PostParams::default(), &cm).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            api.patch(
                &name,
                &patch_params(),
                &Patch::Merge(&json!({"data": cm.data})),
            )
            .await?;
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// `POST /v1/agent/progress`.
pub async fn progress(
    client: &Client,
    m: &Machine,
    body: &[u8],
) -> Result<ProgressAction, Refusal> {
    let req: ProgressRequest = serde_json::from_slice(body)
        .map_err(|_| Refusal::BadRequest("invalid progress body".into()))?;
    let phase = parse_phase(&req.phase)
        .ok_or_else(|| Refusal::BadRequest(format!("unknown phase {:?}", req.phase)))?;
    current_run(m, &req.run_id)?;
    let ns = m.namespace().unwrap_or_default();
    let api: Api<DeployRun> = Api::namespaced(client.clone(), &ns);
    let Some(run) = api.get_opt(&req.run_id).await? else {
        return Ok(ProgressAction::Abort);
    };
    let mut st = run.status.clone().unwrap_or_default();
    if matches!(st.phase, Some(RunPhase::Succeeded | RunPhase::Failed)) {
        return Ok(ProgressAction::Abort);
    }
    let now = Timestamp::now();
    let done: u64 = req.partitions.iter().map(|p| p.bytes_done).sum();
    let total: u64 = req.partitions.iter().map(|p| p.bytes_total).sum();
    let before: i64 = st.partitions.iter().map(|p| p.bytes_done).sum();
    if let Some(last) = &st.last_progress_time {
        let secs = now.duration_since(last.0).as_secs_f64();
        let delta = i64::try_from(done)
            .unwrap_or(i64::MAX)
            .saturating_sub(before);
        if secs >= 0.5 && delta >= 0 {
            #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
            let mib = (delta as f64 / secs / f64::from(1u32 << 20)) as i64;
            st.throughput_mib_ps = Some(mib);
        }
    }
    st.percent = Some(percent(done, total));
    st.last_progress_time = Some(Time(now));
    enter(&mut st.phase_timings, phase, now);
    st.phase = Some(phase);
    st.partitions = req
        .partitions
        .iter()
        .map(|p| PartitionProgressStatus {
            number: i32::try_from(p.number).unwrap_or(i32::MAX),
            bytes_done: i64::try_from(p.bytes_done).unwrap_or(i64::MAX),
            bytes_total: i64::try_from(p.bytes_total).unwrap_or(i64::MAX),
            percent: percent(p.bytes_done, p.bytes_total),
        })
        .collect();
    let mut transfer = st.transfer.clone().unwrap_or_default();
    transfer.http_bytes = i64::try_from(req.http_bytes).unwrap_or(i64::MAX);
    if let Some(t) = &req.transfer {
        transfer.peers = i32::try_from(t.peers).unwrap_or(i32::MAX);
        transfer.downloaded_bytes = i64::try_from(t.peer_bytes).unwrap_or(i64::MAX);
        transfer.seeder_bytes = i64::try_from(t.seeder_bytes).unwrap_or(i64::MAX);
        transfer.uploaded_bytes = i64::try_from(t.uploaded_bytes).unwrap_or(i64::MAX);
        if let Some(r) = &t.fallback_reason {
            transfer.fallback_reason = Some(anneal_api::agent::sanitize_reason(r));
        }
    }
    st.transfer = Some(TransferStatus { ..transfer });
    write_status(client, &run, &st).await?;
    if let Err(e) = append_log(client, &run, &req.log_lines).await {
        tracing::warn!(run = %req.run_id, error = %e, "cannot keep the agent's log lines");
    }
    Ok(ProgressAction::Continue)
}

fn percent(done: u64, total: u64) -> i32 {
    if total == 0 {
        return 0;
    }
    i32::try_from(done.min(total).saturating_mul(100) / total).unwrap_or(100)
}

/// The id of a Machine's wipe (what `wipe` hands out and `result` names).
pub fn wipe_id(m: &Machine) -> String {
    format!("{}-wipe", m.name_any())
}

/// The disks a Recycle wipes: every disk of the inventory.
pub async fn wipe_disks(client: &Client, m: &Machine) -> Result<Vec<String>, kube::Error> {
    let hw = Api::<anneal_api::MachineHardware>::namespaced(
        client.clone(),
        &m.namespace().unwrap_or_default(),
    )
    .get_opt(&m.name_any())
    .await?;
    Ok(hw
        .map(|h| {
            h.spec
                .disks
                .iter()
                .map(|d| {
                    if d.device_name.starts_with('/') {
                        d.device_name.clone()
                    } else {
                        format!("/dev/{}", d.device_name)
                    }
                })
                .collect()
        })
        .unwrap_or_default())
}

/// The result of a wipe: the Progressing condition the lifecycle acts on.
async fn wipe_result(client: &Client, m: &Machine, outcome: &Outcome) -> Result<(), Refusal> {
    let (reason, message) = match outcome {
        Outcome::Succeeded => (reasons::WIPED, "the agent wiped every disk".to_string()),
        Outcome::Failed { reason, .. } => (reasons::WIPE_FAILED, agent::sanitize_reason(reason)),
    };
    let mut conditions = m.status.clone().unwrap_or_default().conditions;
    crate::conditions::set(
        &mut conditions,
        types::PROGRESSING,
        false,
        reason,
        &message,
        m.metadata.generation,
    );
    let patch = json!({
        "metadata": {"resourceVersion": m.resource_version()},
        "status": {"conditions": conditions},
    });
    Api::<Machine>::namespaced(client.clone(), &m.namespace().unwrap_or_default())
        .patch_status(&m.name_any(), &patch_params(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// `POST /v1/agent/result`.
pub async fn result(client: &Client, m: &Machine, body: &[u8]) -> Result<(), Refusal> {
    let req: ResultRequest = serde_json::from_slice(body)
        .map_err(|_| Refusal::BadRequest("invalid result body".into()))?;
    if m.status.as_ref().and_then(|s| s.state) == Some(MachineState::Deprovisioning)
        && req.run_id == wipe_id(m)
    {
        return wipe_result(client, m, &req.outcome).await;
    }
    current_run(m, &req.run_id)?;
    let ns = m.namespace().unwrap_or_default();
    let api: Api<DeployRun> = Api::namespaced(client.clone(), &ns);
    let Some(run) = api.get_opt(&req.run_id).await? else {
        return Err(Refusal::NotCurrent(format!(
            "run {} does not exist",
            req.run_id
        )));
    };
    let mut st = run.status.clone().unwrap_or_default();
    if matches!(st.phase, Some(RunPhase::Succeeded | RunPhase::Failed)) {
        return Ok(());
    }
    let now = Timestamp::now();
    let generation = run.metadata.generation;
    match &req.outcome {
        Outcome::Succeeded => {
            enter(&mut st.phase_timings, RunPhase::Succeeded, now);
            st.phase = Some(RunPhase::Succeeded);
            for p in &mut st.partitions {
                p.bytes_done = p.bytes_total;
                p.percent = 100;
            }
            st.percent = Some(100);
            // The run's figure: bytes over the time spent writing content.
            let bytes: i64 = st.partitions.iter().map(|p| p.bytes_total).sum();
            if let Some(t) = st
                .phase_timings
                .iter()
                .find(|t| t.phase == "WritingContent")
                && let (Some(a), Some(b)) = (&t.start, &t.end)
            {
                let secs = b.0.duration_since(a.0).as_secs_f64();
                if secs > 0.0 {
                    #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
                    let mib = (bytes as f64 / secs / f64::from(1u32 << 20)) as i64;
                    st.throughput_mib_ps = Some(mib);
                }
            }
            crate::conditions::set(
                &mut st.conditions,
                types::SUCCEEDED,
                true,
                reasons::DEPLOY_SUCCEEDED,
                "the agent wrote every content and ran every step",
                generation,
            );
        }
        Outcome::Failed { reason, phase } => {
            let reason = agent::sanitize_reason(reason);
            let at = phase
                .as_deref()
                .map(|p| {
                    agent::sanitize_reason(p)
                        .chars()
                        .take(32)
                        .collect::<String>()
                })
                .or_else(|| st.phase.map(|p| phase_name(p).to_string()))
                .unwrap_or_else(|| "Pending".into());
            enter(&mut st.phase_timings, RunPhase::Failed, now);
            st.phase = Some(RunPhase::Failed);
            crate::conditions::set(
                &mut st.conditions,
                types::SUCCEEDED,
                false,
                reasons::DEPLOY_FAILED,
                format!("{at}: {reason}"),
                generation,
            );
        }
    }
    st.observed_generation = generation;
    write_status(client, &run, &st).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_close_the_open_phase_and_terminal_phases_open_none() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(1_010).unwrap();
        let t2 = Timestamp::from_second(1_030).unwrap();
        let mut v = Vec::new();
        enter(&mut v, RunPhase::Partitioning, t0);
        enter(&mut v, RunPhase::Partitioning, t1);
        assert_eq!(v.len(), 1, "the same phase again opens nothing");
        enter(&mut v, RunPhase::WritingContent, t1);
        enter(&mut v, RunPhase::Succeeded, t2);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].end, Some(Time(t1)));
        assert_eq!(v[1].phase, "WritingContent");
        assert_eq!(v[1].end, Some(Time(t2)));
    }

    #[test]
    fn percent_is_bounded() {
        assert_eq!(percent(0, 0), 0);
        assert_eq!(percent(50, 200), 25);
        assert_eq!(percent(300, 200), 100);
        assert_eq!(parse_phase("Bogus"), None);
        assert_eq!(
            parse_phase("WritingContent"),
            Some(RunPhase::WritingContent)
        );
    }
}
