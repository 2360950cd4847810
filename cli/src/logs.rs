//! `logs`: the agent's log of a deploy run, kept by the manager in ConfigMap
//! `<run>-log` (key `log`, the last 512 KiB).

use std::io::Write;

use anneal_api::DeployRun;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::Api;

use crate::Error;

/// The ConfigMap key holding the log.
pub const LOG_KEY: &str = "log";

/// Prints the log of `run`, else of the machine's current run, else its last
/// successful run, else its last attempted run.
pub async fn run(
    client: &Client,
    namespace: &str,
    machine: &str,
    run: Option<&str>,
    out: &mut dyn Write,
) -> Result<(), Error> {
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
