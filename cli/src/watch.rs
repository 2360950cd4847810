//! `watch [MACHINE | -l SELECTOR]`: live progress of deploy runs from a
//! watch of DeployRuns (never a polling loop): on a terminal a bar per run
//! (phase, percent, rate, peers) redrawn in place, otherwise one line per
//! change of phase or percent; when every watched run has finished, a
//! summary table.
//!
//! Watched are the runs in progress when the watch starts and every run of
//! the selected machines that appears while it runs; with none in progress
//! at the start, the command waits for one.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::time::{Duration, Instant};

use anneal_api::{DeployRun, Machine, RunPhase};
use futures::StreamExt;
use kube::api::{Api, ListParams};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};

use crate::Error;
use crate::progress::{self, Board};

/// Which machines' runs are watched.
#[derive(Debug, Clone)]
pub enum Scope {
    /// Every machine of the namespace.
    All,
    /// One machine.
    Machine(String),
    /// The machines matching a label selector (at the start).
    Selector(String),
}

/// A watched run as last seen.
#[derive(Debug, Clone)]
struct Row {
    machine: String,
    phase: Option<RunPhase>,
    percent: i64,
    mib: Option<i64>,
    peers: i32,
    /// First phase start to last phase end, from status.phaseTimings.
    took: Option<Duration>,
    /// The first phase's start, from status.phaseTimings.
    started: Option<k8s_openapi::jiff::Timestamp>,
    first_seen: Instant,
    deleted: bool,
    message: Option<String>,
}

impl Row {
    fn of(r: &DeployRun, first_seen: Instant) -> Self {
        let st = r.status.clone().unwrap_or_default();
        let start = st
            .phase_timings
            .iter()
            .filter_map(|t| t.start.as_ref())
            .min();
        let end = st.phase_timings.iter().filter_map(|t| t.end.as_ref()).max();
        let took = match (start, end) {
            (Some(a), Some(b)) => Some(Duration::from_millis(
                u64::try_from(b.0.duration_since(a.0).as_millis()).unwrap_or(0),
            )),
            _ => None,
        };
        let message = st
            .conditions
            .iter()
            .find(|c| c.type_ == "Succeeded" && c.status == "False")
            .map(|c| c.message.clone());
        Self {
            machine: r.spec.machine_ref.name.clone(),
            phase: st.phase,
            percent: i64::from(st.percent.unwrap_or(0)),
            mib: st.throughput_mib_ps,
            peers: st.transfer.map_or(0, |t| t.peers),
            took,
            started: start.map(|t| t.0),
            first_seen,
            deleted: false,
            message,
        }
    }

    fn finished(&self) -> bool {
        self.deleted || matches!(self.phase, Some(RunPhase::Succeeded | RunPhase::Failed))
    }

    fn phase_text(&self) -> String {
        if self.deleted {
            return "Deleted".into();
        }
        self.phase
            .map_or_else(|| "Pending".into(), |p| format!("{p:?}"))
    }

    fn mib_text(&self) -> String {
        self.mib.map_or_else(|| "-".into(), |m| m.to_string())
    }

    /// What a plain line says (printed again only when it changes).
    fn plain(&self, run: &str) -> String {
        format!(
            "{} {run} {} {}% {} MiB/s peers {}",
            self.machine,
            self.phase_text(),
            self.percent,
            self.mib_text(),
            self.peers
        )
    }

    /// How long the run took (finished) or has been running: from its
    /// first phase's start (else from when the watch first saw it).
    fn elapsed(&self) -> Duration {
        if self.finished()
            && let Some(took) = self.took
        {
            return took;
        }
        self.started
            .and_then(|s| {
                let d = k8s_openapi::jiff::Timestamp::now().duration_since(s);
                Duration::try_from(d).ok()
            })
            .unwrap_or_else(|| self.first_seen.elapsed())
    }

    fn bar_line(&self, run: &str, mw: usize, rw: usize) -> String {
        let elapsed = self.elapsed();
        format!(
            "{:<mw$}  {run:<rw$}  {:<15} {} {:>3}%  {:>5} MiB/s  {:>2} peers  {}",
            self.machine,
            self.phase_text(),
            progress::bar(u64::try_from(self.percent).unwrap_or(0)),
            self.percent,
            self.mib_text(),
            self.peers,
            progress::duration(elapsed),
        )
    }
}

fn in_scope(scope: &Scope, machines: &BTreeSet<String>, r: &DeployRun) -> bool {
    match scope {
        Scope::All => true,
        Scope::Machine(m) => r.spec.machine_ref.name == *m,
        Scope::Selector(_) => machines.contains(&r.spec.machine_ref.name),
    }
}

/// Runs `watch`.
pub async fn run(
    client: &Client,
    namespace: &str,
    scope: Scope,
    tty: bool,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let mut machines = BTreeSet::new();
    let what = match &scope {
        Scope::All => format!("namespace {namespace}"),
        Scope::Machine(m) => {
            crate::machine::get(client, namespace, m).await?;
            format!("machine {namespace}/{m}")
        }
        Scope::Selector(sel) => {
            let api: Api<Machine> = Api::namespaced(client.clone(), namespace);
            let list = api
                .list(&ListParams::default().labels(sel))
                .await
                .map_err(Error::api("listing", "machine", namespace, sel))?;
            machines = list.items.iter().map(ResourceExt::name_any).collect();
            if machines.is_empty() {
                return Err(Error::NoMachines {
                    namespace: namespace.to_string(),
                    selector: sel.clone(),
                });
            }
            format!("{} machines of {namespace} matching {sel}", machines.len())
        }
    };
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), namespace);
    let mut events = watcher::watcher(runs, watcher::Config::default()).boxed();
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    let mut printed: BTreeMap<String, String> = BTreeMap::new();
    let mut board = Board::default();
    let mut waiting_said = false;
    // Runs that had finished when the watch started: an update to one
    // later (a label, a finalizer) does not bring it back.
    let mut before: BTreeSet<String> = BTreeSet::new();
    // On a terminal the elapsed times tick and a redraw the throttle
    // refused is made on the next tick.
    let mut tick = tokio::time::interval(progress::REDRAW * 2);
    let mut dirty = false;
    loop {
        let next = tokio::select! {
            ev = events.next() => ev,
            _ = tick.tick() => {
                let stale = board
                    .last_drawn()
                    .is_some_and(|t| t.elapsed() >= Duration::from_secs(1));
                if tty && !rows.is_empty() && (dirty || stale) {
                    board.draw(out, &board_lines(&what, &rows), true)?;
                    dirty = false;
                }
                continue;
            }
        };
        let Some(ev) = next else {
            return Err(Error::WatchEnded {
                kind: "deployrun",
                namespace: namespace.to_string(),
                name: "*".into(),
            });
        };
        let ev = ev.map_err(|source| Error::Watch {
            kind: "deployrun",
            namespace: namespace.to_string(),
            name: "*".into(),
            source: Box::new(source),
        })?;
        match ev {
            Event::InitApply(r) => {
                let name = r.name_any();
                if !in_scope(&scope, &machines, &r) {
                    continue;
                }
                let first = rows.get(&name).map_or_else(Instant::now, |x| x.first_seen);
                let row = Row::of(&r, first);
                if rows.contains_key(&name) || !row.finished() {
                    rows.insert(name, row);
                } else {
                    before.insert(name);
                }
            }
            Event::Apply(r) => {
                let name = r.name_any();
                if !in_scope(&scope, &machines, &r) || before.contains(&name) {
                    continue;
                }
                let first = rows.get(&name).map_or_else(Instant::now, |x| x.first_seen);
                rows.insert(name, Row::of(&r, first));
            }
            Event::Delete(r) => {
                if let Some(row) = rows.get_mut(&r.name_any()) {
                    row.deleted = true;
                }
            }
            Event::Init => continue,
            Event::InitDone => {
                if rows.is_empty() && !waiting_said {
                    waiting_said = true;
                    writeln!(out, "waiting for a deploy run of {what}")?;
                    out.flush()?;
                }
            }
        }
        if rows.is_empty() {
            continue;
        }
        let done = rows.values().all(Row::finished);
        if tty {
            dirty = !board.draw(out, &board_lines(&what, &rows), done)?;
        } else {
            for (name, row) in &rows {
                let line = row.plain(name);
                if printed.get(name) != Some(&line) {
                    writeln!(out, "{line}")?;
                    printed.insert(name.clone(), line);
                }
            }
            out.flush()?;
        }
        if done {
            break;
        }
    }
    summary(&rows, out)?;
    let failed: Vec<String> = rows
        .iter()
        .filter(|(_, r)| r.deleted || r.phase == Some(RunPhase::Failed))
        .map(|(n, _)| n.clone())
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(Error::RunsFailed {
            namespace: namespace.to_string(),
            runs: failed.join(", "),
        })
    }
}

/// The terminal's block: a header and a bar per run.
fn board_lines(what: &str, rows: &BTreeMap<String, Row>) -> Vec<String> {
    let mw = rows
        .values()
        .map(|r| r.machine.len())
        .max()
        .unwrap_or(0)
        .max(7);
    let rw = rows.keys().map(String::len).max().unwrap_or(0).max(3);
    let running = rows.values().filter(|r| !r.finished()).count();
    let mut lines = vec![format!(
        "Deploy runs of {what}: {running} running, {} finished",
        rows.len() - running
    )];
    lines.extend(rows.iter().map(|(n, r)| r.bar_line(n, mw, rw)));
    lines
}

/// The table printed when every watched run has finished.
fn summary(rows: &BTreeMap<String, Row>, out: &mut dyn Write) -> Result<(), Error> {
    let mut table = vec![[
        "MACHINE".to_string(),
        "RUN".into(),
        "RESULT".into(),
        "PERCENT".into(),
        "DURATION".into(),
        "MiB/s".into(),
        "PEERS".into(),
        "MESSAGE".into(),
    ]];
    for (name, r) in rows {
        table.push([
            r.machine.clone(),
            name.clone(),
            r.phase_text(),
            format!("{}%", r.percent),
            progress::duration(r.elapsed()),
            r.mib_text(),
            r.peers.to_string(),
            r.message.clone().unwrap_or_default(),
        ]);
    }
    let widths: Vec<usize> = (0..8)
        .map(|i| table.iter().map(|row| row[i].len()).max().unwrap_or(0))
        .collect();
    writeln!(out)?;
    for row in &table {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        writeln!(out, "{}", line.join("  ").trim_end())?;
    }
    out.flush()?;
    Ok(())
}
