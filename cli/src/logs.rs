//! `logs`: the agent's log of a deploy run, kept by the manager in ConfigMap
//! `<run>-log` (key `log`, the last 512 KiB).

use std::io::Write;

use anneal_api::DeployRun;
use anneal_api::RunPhase;
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};

use crate::Error;

/// The ConfigMap key holding the log.
pub const LOG_KEY: &str = "log";

/// Prints the log of `run`, else of the machine's current run, else its last
/// successful run, else its last attempted run; with `follow`, keeps
/// printing what the agent adds until the run ends.
pub async fn run(
    client: &Client,
    namespace: &str,
    machine: &str,
    run: Option<&str>,
    follow: bool,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let run_name = resolve(client, namespace, machine, run).await?;
    if follow {
        return follow_run(client, namespace, &run_name, out).await;
    }
    print_once(client, namespace, &run_name, out).await
}

/// The run `logs` shows.
async fn resolve(
    client: &Client,
    namespace: &str,
    machine: &str,
    run: Option<&str>,
) -> Result<String, Error> {
    let m = crate::machine::get(client, namespace, machine).await?;
    let run_name = match run {
        Some(r) => {
            let runs: Api<DeployRun> = Api::namespaced(client.clone(), namespace);
            let dr = runs
                .get_opt(r)
                .await
                .map_err(Error::api("reading", "deployrun", namespace, r))?
                .ok_or_else(|| Error::NotFound {
                    kind: "deployrun",
                    namespace: namespace.to_string(),
                    name: r.to_string(),
                    hint: format!(
                        "kubectl get deployruns -n {namespace} -l anneal.dev/machine={machine}"
                    ),
                })?;
            if dr.spec.machine_ref.name != machine {
                return Err(Error::RunOfOtherMachine {
                    namespace: namespace.to_string(),
                    run: r.to_string(),
                    machine: machine.to_string(),
                    owner: dr.spec.machine_ref.name,
                });
            }
            r.to_string()
        }
        None => {
            let st = m.status.as_ref();
            st.and_then(|s| s.current_run_ref.as_ref())
                .or_else(|| st.and_then(|s| s.last_successful_run_ref.as_ref()))
                .or_else(|| st.and_then(|s| s.last_attempted_run_ref.as_ref()))
                .map(|r| r.name.clone())
                .ok_or_else(|| Error::NoRun {
                    namespace: namespace.to_string(),
                    name: machine.to_string(),
                })?
        }
    };
    Ok(run_name)
}

/// Prints the whole log of `run_name` once.
async fn print_once(
    client: &Client,
    namespace: &str,
    run_name: &str,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let cm_name = format!("{run_name}-log");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = cms
        .get_opt(&cm_name)
        .await
        .map_err(Error::api("reading", "configmap", namespace, &cm_name))?
        .ok_or_else(|| Error::NotFound {
            kind: "configmap",
            namespace: namespace.to_string(),
            name: cm_name.clone(),
            hint: format!(
                "the manager creates it when the agent of run {run_name} sends its first log lines: kubectl get deployrun {run_name} -n {namespace}"
            ),
        })?;
    let log = cm
        .data
        .as_ref()
        .and_then(|d| d.get(LOG_KEY))
        .cloned()
        .unwrap_or_default();
    out.write_all(log.as_bytes())?;
    if !log.is_empty() && !log.ends_with('\n') {
        writeln!(out)?;
    }
    Ok(())
}

/// What `follow` has printed: the log as last seen.
#[derive(Debug, Default)]
struct Seen {
    text: String,
}

impl Seen {
    /// The part of `now` not printed yet. The manager keeps the last
    /// 512 KiB, cutting whole lines at the front, so `now` is a suffix of
    /// what was seen (from a line start) followed by new lines.
    fn advance<'a>(&mut self, now: &'a str) -> &'a str {
        let new = if let Some(rest) = now.strip_prefix(self.text.as_str()) {
            rest
        } else {
            let starts = std::iter::once(0).chain(
                self.text
                    .match_indices('\n')
                    .map(|(i, _)| i + 1)
                    .filter(|&i| i < self.text.len()),
            );
            let mut found = None;
            for cut in starts {
                if let Some(rest) = now.strip_prefix(&self.text[cut..]) {
                    found = Some(rest);
                    break;
                }
            }
            // Nothing in common: lines were lost between two reads.
            found.unwrap_or(now)
        };
        self.text = now.to_string();
        new
    }
}

fn log_of(cm: &ConfigMap) -> &str {
    cm.data
        .as_ref()
        .and_then(|d| d.get(LOG_KEY))
        .map_or("", String::as_str)
}

fn finished(run: &DeployRun) -> Option<RunPhase> {
    run.status
        .as_ref()
        .and_then(|s| s.phase)
        .filter(|p| matches!(p, RunPhase::Succeeded | RunPhase::Failed))
}

/// Prints the log of `run_name` and what is appended to it (a watch of its
/// ConfigMap) until the DeployRun is Succeeded, Failed or deleted; then
/// prints what the last read adds and how the run ended (on stderr).
async fn follow_run(
    client: &Client,
    namespace: &str,
    run_name: &str,
    out: &mut dyn Write,
) -> Result<(), Error> {
    let cm_name = format!("{run_name}-log");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), namespace);
    let mut cm_events = watcher::watcher(
        cms.clone(),
        watcher::Config::default().fields(&format!("metadata.name={cm_name}")),
    )
    .boxed();
    let mut run_events = watcher::watcher(
        runs,
        watcher::Config::default().fields(&format!("metadata.name={run_name}")),
    )
    .boxed();
    let watch_err = |kind: &'static str, name: &str| {
        let (namespace, name) = (namespace.to_string(), name.to_string());
        move |source| Error::Watch {
            kind,
            namespace,
            name,
            source: Box::new(source),
        }
    };
    let mut seen = Seen::default();
    let mut run_seen = false;
    let end = loop {
        tokio::select! {
            ev = cm_events.next() => {
                let Some(ev) = ev else { break None };
                match ev.map_err(watch_err("configmap", &cm_name))? {
                    Event::Apply(cm) | Event::InitApply(cm) => {
                        out.write_all(seen.advance(log_of(&cm)).as_bytes())?;
                        out.flush()?;
                    }
                    Event::Delete(_) | Event::Init | Event::InitDone => {}
                }
            }
            ev = run_events.next() => {
                let Some(ev) = ev else { break None };
                match ev.map_err(watch_err("deployrun", run_name))? {
                    Event::Apply(r) | Event::InitApply(r) => {
                        run_seen = true;
                        if let Some(p) = finished(&r) {
                            break Some(format!("{p:?}"));
                        }
                    }
                    Event::Delete(_) => break Some("deleted".to_string()),
                    Event::InitDone if !run_seen => {
                        return Err(Error::NotFound {
                            kind: "deployrun",
                            namespace: namespace.to_string(),
                            name: run_name.to_string(),
                            hint: format!("kubectl get deployruns -n {namespace}"),
                        });
                    }
                    Event::Init | Event::InitDone => {}
                }
            }
        }
    };
    // The agent's last lines reach the ConfigMap before the run's end is
    // written (the manager appends them while answering the progress report
    // that precedes the result), so one read now has them all.
    if let Some(cm) = cms.get_opt(&cm_name).await.map_err(Error::api(
        "reading",
        "configmap",
        namespace,
        &cm_name,
    ))? {
        out.write_all(seen.advance(log_of(&cm)).as_bytes())?;
    }
    if !seen.text.is_empty() && !seen.text.ends_with('\n') {
        writeln!(out)?;
    }
    out.flush()?;
    match end {
        Some(how) => eprintln!("deployrun {namespace}/{run_name} ended: {how}"),
        None => {
            return Err(Error::WatchEnded {
                kind: "deployrun",
                namespace: namespace.to_string(),
                name: run_name.to_string(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Seen;

    #[test]
    fn follows_appends_and_front_cuts() {
        let mut s = Seen::default();
        assert_eq!(s.advance("a\nb\n"), "a\nb\n");
        assert_eq!(s.advance("a\nb\n"), "");
        assert_eq!(s.advance("a\nb\nc\n"), "c\n");
        // The manager cut "a\n" at the front and appended "d\n".
        assert_eq!(s.advance("b\nc\nd\n"), "d\n");
        // Everything replaced: lines were lost, print what is there.
        assert_eq!(s.advance("x\n"), "x\n");
    }
}
