//! `status`: the fleet at a glance.

use std::collections::BTreeMap;
use std::io::Write;

use anneal_api::conditions::types;
use anneal_api::{DeployRun, Machine};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde::Serialize;

use crate::machine::state_of;
use crate::{Error, Output};

/// The report, also the `-o json|yaml` document.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// The namespace, or `*` for all.
    pub namespace: String,
    /// Number of Machines.
    pub machines: usize,
    /// Machines per `status.state` (`-` when not set yet).
    pub by_state: BTreeMap<String, usize>,
    /// Machines with `operationalStatus: error` or `RetryHeld=True`.
    pub errors: Vec<MachineError>,
    /// DeployRuns not Succeeded or Failed yet.
    pub runs: Vec<RunProgress>,
}

/// A machine in error.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MachineError {
    /// `namespace/name`.
    pub machine: String,
    /// `status.state`.
    pub state: String,
    /// The reason of the condition that tells why (docs/troubleshooting.md).
    pub reason: String,
    /// `status.errorType`.
    pub error_type: String,
    /// `status.errorCount`.
    pub error_count: i32,
    /// `status.errorMessage`.
    pub message: String,
}

/// A run in progress.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RunProgress {
    /// `namespace/name` of the DeployRun.
    pub run: String,
    /// Its Machine.
    pub machine: String,
    /// Its Image.
    pub image: String,
    /// `status.phase`.
    pub phase: String,
    /// `status.percent`.
    pub percent: i32,
    /// `status.throughputMiBps`.
    pub throughput_mi_bps: i64,
    /// `status.transfer.peers`.
    pub peers: i64,
}

/// Lists Machines and DeployRuns of `namespace` (all when `None`) and prints
/// the report.
pub async fn run(
    client: &Client,
    namespace: Option<&str>,
    output: Option<Output>,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let (machines, runs): (Api<Machine>, Api<DeployRun>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let scope = namespace.unwrap_or("*");
    let machines = machines
        .list(&ListParams::default())
        .await
        .map_err(Error::api("listing", "machines", scope, "*"))?
        .items;
    let runs = runs
        .list(&ListParams::default())
        .await
        .map_err(Error::api("listing", "deployruns", scope, "*"))?
        .items;
    let report = build(scope, &machines, &runs);
    match output {
        Some(Output::Json) => writeln!(out, "{}", serde_json::to_string_pretty(&report)?)?,
        Some(Output::Yaml) => write!(out, "{}", serde_saphyr::to_string(&report)?)?,
        Some(Output::Wide) => print(&report, true, out)?,
        None => print(&report, false, out)?,
    }
    Ok(())
}

fn wire<T: Serialize>(v: Option<T>) -> String {
    v.and_then(|v| serde_json::to_value(v).ok())
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "-".into())
}

/// The reason that tells why a machine is in error: RetryHeld, then a
/// failing BMCReachable, then a failed Progressing, then AgentCompatible.
fn error_reason(m: &Machine) -> Option<String> {
    let conds = &m.status.as_ref()?.conditions;
    let find = |t: &str, s: &str| {
        conds
            .iter()
            .find(|c| c.type_ == t && c.status == s)
            .map(|c| c.reason.clone())
    };
    find(types::RETRY_HELD, "True")
        .or_else(|| find(types::BMC_REACHABLE, "False"))
        .or_else(|| {
            find(types::PROGRESSING, "False").filter(|r| {
                use anneal_api::conditions::reasons;
                [
                    reasons::DEPLOY_FAILED,
                    reasons::DEPLOY_PLAN_FAILED,
                    reasons::WIPE_FAILED,
                ]
                .contains(&r.as_str())
            })
        })
        .or_else(|| find(types::AGENT_COMPATIBLE, "False"))
}

/// The report of `machines` and `runs`.
pub fn build(scope: &str, machines: &[Machine], runs: &[DeployRun]) -> Report {
    let mut by_state = BTreeMap::new();
    let mut errors = Vec::new();
    for m in machines {
        *by_state.entry(state_of(m)).or_insert(0) += 1;
        let st = m.status.as_ref();
        let op = wire(st.and_then(|s| s.operational_status));
        let reason = error_reason(m);
        let held = st.is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == types::RETRY_HELD && c.status == "True")
        });
        if op == "error" || held {
            errors.push(MachineError {
                machine: format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any()),
                state: state_of(m),
                reason: reason.unwrap_or_else(|| "-".into()),
                error_type: wire(st.and_then(|s| s.error_type)),
                error_count: st.and_then(|s| s.error_count).unwrap_or(0),
                message: st.and_then(|s| s.error_message.clone()).unwrap_or_default(),
            });
        }
    }
    let mut active = Vec::new();
    for r in runs {
        let st = r.status.as_ref();
        let phase = wire(st.and_then(|s| s.phase));
        if phase == "Succeeded" || phase == "Failed" {
            continue;
        }
        active.push(RunProgress {
            run: format!("{}/{}", r.namespace().unwrap_or_default(), r.name_any()),
            machine: r.spec.machine_ref.name.clone(),
            image: r
                .spec
                .image_ref
                .as_ref()
                .map_or_else(|| "-".into(), |i| i.name.clone()),
            phase,
            percent: st.and_then(|s| s.percent).unwrap_or(0),
            throughput_mi_bps: st.and_then(|s| s.throughput_mib_ps).unwrap_or(0),
            peers: st
                .and_then(|s| s.transfer.as_ref())
                .map_or(0, |t| i64::from(t.peers)),
        });
    }
    errors.sort_by(|a, b| a.machine.cmp(&b.machine));
    active.sort_by(|a, b| a.run.cmp(&b.run));
    Report {
        namespace: scope.to_string(),
        machines: machines.len(),
        by_state,
        errors,
        runs: active,
    }
}

/// Prints `rows` as left-aligned columns.
fn table(rows: &[Vec<String>], out: &mut dyn Write) -> std::io::Result<()> {
    let cols = rows.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for r in rows {
        let mut line = String::new();
        for (i, cell) in r.iter().enumerate() {
            if i + 1 == cols {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}   ", w = widths[i]));
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

fn print(r: &Report, wide: bool, out: &mut dyn Write) -> Result<(), Error> {
    let states: Vec<String> = r.by_state.iter().map(|(s, n)| format!("{s} {n}")).collect();
    writeln!(
        out,
        "Machines in {}: {} ({})",
        r.namespace,
        r.machines,
        if states.is_empty() {
            "none".to_string()
        } else {
            states.join(", ")
        }
    )?;
    writeln!(out)?;
    if r.errors.is_empty() {
        writeln!(out, "Machines in error: none")?;
    } else {
        writeln!(out, "Machines in error: {}", r.errors.len())?;
        let mut rows = vec![vec![
            "MACHINE".to_string(),
            "STATE".into(),
            "REASON".into(),
            "ERRORS".into(),
            "MESSAGE".into(),
        ]];
        for e in &r.errors {
            let mut msg = e.message.clone();
            if !wide && msg.chars().count() > 60 {
                msg = msg.chars().take(57).collect::<String>() + "...";
            }
            rows.push(vec![
                e.machine.clone(),
                e.state.clone(),
                e.reason.clone(),
                e.error_count.to_string(),
                msg,
            ]);
        }
        table(&rows, out)?;
    }
    writeln!(out)?;
    if r.runs.is_empty() {
        writeln!(out, "Deploy runs in progress: none")?;
    } else {
        writeln!(out, "Deploy runs in progress: {}", r.runs.len())?;
        let mut header = vec![
            "RUN".to_string(),
            "MACHINE".into(),
            "PHASE".into(),
            "PERCENT".into(),
            "MIB/S".into(),
        ];
        if wide {
            header.extend(["IMAGE".to_string(), "PEERS".into()]);
        }
        let mut rows = vec![header];
        for p in &r.runs {
            let mut row = vec![
                p.run.clone(),
                p.machine.clone(),
                p.phase.clone(),
                format!("{}%", p.percent),
                p.throughput_mi_bps.to_string(),
            ];
            if wide {
                row.extend([p.image.clone(), p.peers.to_string()]);
            }
            rows.push(row);
        }
        table(&rows, out)?;
    }
    Ok(())
}
