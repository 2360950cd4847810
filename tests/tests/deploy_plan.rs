//! Deploy planning and the deploy half of the agent protocol on a real
//! control plane (docs/deploy.md): a claimed Available Machine whose disk hint
//! matches two disks gets no run and no net boot (Warning Event
//! DeployPlanFailed naming both disks); fixing the hint writes a DeployRun and
//! its plan Secret and arms a boot; the agent (a test client over real HTTPS)
//! gets the plan from `next`, reports progress (phase, percent, timings, log
//! ConfigMap), is refused for another run, reports success, and the Machine
//! is Provisioned; an unchanged claim starts nothing, a new image starts a
//! new run, naming a PostHook starts one and editing only that PostHook
//! starts another (hooksHash). A Machine without BMC is used: it is armed, never powered.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use anneal_api::{DeployRun, Machine, MachineClaim};
use anneal_manager::agentapi::AgentApiConfig;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_testinfra::ControlPlane;
use anneal_tests::eventually;
use anneal_tests::lifecycle::*;
use hyper::Method;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const CONTENT_URL: &str = "http://10.0.0.9:8081";

fn configs() -> (LifecycleConfig, AgentApiConfig) {
    let mut lc = LifecycleConfig {
        boot_token_lifetime: Duration::from_secs(300),
        health_interval: Duration::from_secs(600),
        // the BMCs of the tests speak plain HTTP (redfish+http://)
        allow_insecure_bmc: true,
        ..LifecycleConfig::default()
    };
    lc.deploy.content_url = Some(CONTENT_URL.into());
    (
        lc,
        AgentApiConfig {
            listen: ([127, 0, 0, 1], 0).into(),
            namespace: "anneal-system".into(),
            server_names: vec!["127.0.0.1".into()],
            session_ttl: Duration::from_secs(600),
            session_renew_after: Duration::from_secs(300),
            long_poll: Duration::from_secs(2),
            fast_track_window: None,
        },
    )
}

fn two_disks() -> Value {
    let mut hw = sample_hardware();
    let disk = |name: &str, serial: &str| {
        json!({"deviceName": name, "sizeBytes": 8u64 << 30, "logicalSectorSize": 512,
               "physicalSectorSize": 512, "rotational": false, "removable": false,
               "serialNumber": serial, "bus": "virtio"})
    };
    hw["disks"] = json!([disk("vda", "OS-DISK"), disk("vdb", "DATA-DISK")]);
    hw
}

async fn apply_with_status(client: &kube::Client, kind: &str, obj: Value) {
    let name = obj["metadata"]["name"].as_str().unwrap().to_string();
    let status = obj["status"].clone();
    let pp = PatchParams::default();
    macro_rules! put {
        ($t:ty) => {{
            let api: Api<$t> = Api::namespaced(client.clone(), "default");
            let o: $t = serde_json::from_value(obj.clone()).unwrap();
            api.create(&PostParams::default(), &o).await.unwrap();
            if !status.is_null() {
                api.patch_status(&name, &pp, &Patch::Merge(&json!({ "status": status })))
                    .await
                    .unwrap();
            }
        }};
    }
    match kind {
        "Image" => put!(anneal_api::Image),
        "PartitionContent" => put!(anneal_api::PartitionContent),
        _ => unreachable!(),
    }
}

async fn image(client: &kube::Client, name: &str) {
    for (p, size, used) in [(1, 64i64 << 20, 4i64 << 20), (3, 1 << 30, 300 << 20)] {
        apply_with_status(
            client,
            "PartitionContent",
            json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "PartitionContent",
                "metadata": {"name": format!("{name}-p{p}"), "namespace": "default"},
                "spec": {"fsType": if p == 1 { "vfat" } else { "ext4" }, "usedBytes": used,
                         "sizeBytes": size, "lastExtentEnd": used, "blockSize": 4096,
                         "pieceLength": 4194304},
                "status": {"state": "Ready", "sha256": format!("{:064x}", p),
                           "indexSha256": format!("{:064x}", p + 100)}}),
        )
        .await;
    }
    apply_with_status(
        client,
        "Image",
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"osFamily": "Linux", "bootable": true, "layout": {"partitionTable": "gpt", "slots": [
                {"number": 1, "role": "esp", "contentRef": {"name": format!("{name}-p1")}},
                {"number": 2, "role": "swap", "fsType": "swap", "sizeBytes": 67108864},
                {"number": 3, "role": "data", "contentRef": {"name": format!("{name}-p3")}}]}},
            "status": {"state": "Ready"}}),
    )
    .await;
}

/// The boot MAC of a Machine of this file (its agent registers from it).
fn mac_of(name: &str) -> &'static str {
    // the file's two Machines: ft-1, else dp-1
    if name == "ft-1" {
        "52:54:00:7f:20:02"
    } else {
        "52:54:00:7f:20:01"
    }
}

/// Waits until `name` is armed (`what` names the wait) and registers with
/// its boot token: the session token.
async fn register_next_boot(
    client: &kube::Client,
    agent: &AgentClient,
    name: &str,
    what: &str,
) -> String {
    let token = eventually(what, Duration::from_secs(30), || async {
        armed_boot_token(client, name).await
    })
    .await;
    let (code, reg) = agent
        .register_as(&token, Some(&format!("default/{name}")), mac_of(name))
        .await;
    assert_eq!(code, 200, "{what}: {reg}");
    reg["sessionToken"].as_str().unwrap().to_string()
}

async fn state(machines: &Api<Machine>, name: &str) -> String {
    machine_json(machines, name).await["status"]["state"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_refusal_run_progress_result_and_redeploy() {
    let cp = ControlPlane::start().await.unwrap();
    let client = prepare(&cp, &[]).await;
    let (lc, api_cfg) = configs();
    let manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    let agent = AgentClient::new(manager.api_addr, &manager.ca_pem);
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), "default");
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), "default");

    // Enrol and inspect through the agent protocol.
    machines
        .create(
            &PostParams::default(),
            &machine("dp-1", mac_of("dp-1"), None),
        )
        .await
        .unwrap();
    let session = register_next_boot(&client, &agent, "dp-1", "dp-1 armed").await;
    let (code, body) = agent
        .call(
            Method::PUT,
            anneal_api::agent::paths::HARDWARE,
            Some(&session),
            Some("1"),
            Some(two_disks()),
        )
        .await;
    assert_eq!(code, 204, "{body}");
    eventually("dp-1 Available", Duration::from_secs(30), || async {
        (state(&machines, "dp-1").await == "Available").then_some(())
    })
    .await;

    // A Ready image and a claim bound by hand (no claim controller here)
    // whose hint matches both disks.
    image(&client, "os-a").await;
    image(&client, "os-b").await;
    let claim: MachineClaim = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
        "metadata": {"name": "c1", "namespace": "default"},
        "spec": {"machineName": "dp-1", "imageRef": {"name": "os-a"},
                 "targetDisk": {"minSizeGigabytes": 4}}}))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let pp = PatchParams::default();
    claims
        .patch_status(
            "c1",
            &pp,
            &Patch::Merge(&json!({"status": {"phase": "Bound", "machineName": "dp-1"}})),
        )
        .await
        .unwrap();
    machines
        .patch(
            "dp-1",
            &pp,
            &Patch::Merge(&json!({"spec": {"claimRef": {"name": "c1"}}})),
        )
        .await
        .unwrap();

    let warning = event(&client, "DeployPlanFailed", Duration::from_secs(30), |e| {
        e.reason.as_deref() == Some("DeployPlanFailed")
    })
    .await;
    let note = warning.note.clone().unwrap_or_default();
    assert!(
        note.contains("/dev/vda") && note.contains("/dev/vdb") && note.contains("matches 2 disks"),
        "{note}"
    );
    let m = machine_json(&machines, "dp-1").await;
    assert_eq!(m["status"]["state"], "Available", "{m}");
    assert!(m["status"]["netBoot"].is_null(), "no boot armed: {m}");
    assert_eq!(cond(&m, "Progressing").unwrap().0, "False");
    assert!(
        runs.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );

    // A hint that picks one disk: a run, its plan, a boot armed.
    claims
        .patch(
            "c1",
            &pp,
            &Patch::Merge(&json!({"spec": {"targetDisk": {"serialNumber": "OS-DISK"}}})),
        )
        .await
        .unwrap();
    let run = eventually("dp-1 Provisioning", Duration::from_secs(30), || async {
        let m = machine_json(&machines, "dp-1").await;
        (m["status"]["state"] == "Provisioning")
            .then(|| {
                m["status"]["currentRunRef"]["name"]
                    .as_str()
                    .map(str::to_string)
            })
            .flatten()
    })
    .await;
    let r = runs.get(&run).await.unwrap();
    assert_eq!(r.spec.resolved_disks[0].device_name, "/dev/vda");
    assert_eq!(r.spec.image_ref.as_ref().unwrap().name, "os-a");
    assert!(r.spec.hooks_hash.as_deref().unwrap().starts_with("sha256:"));
    let plan_secret: Api<Secret> = Api::namespaced(client.clone(), "default");
    assert!(
        plan_secret
            .get_opt(&format!("{run}-plan"))
            .await
            .unwrap()
            .is_some()
    );
    let session = register_next_boot(&client, &agent, "dp-1", "dp-1 re-armed").await;
    let (code, next) = agent.next(&session).await;
    assert_eq!(code, 200);
    assert_eq!(next["action"], "deploy", "{next}");
    let plan = &next["plan"];
    assert_eq!(plan["runId"], run.as_str());
    assert_eq!(plan["disks"][0]["deviceName"], "/dev/vda");
    assert_eq!(
        plan["disks"][0]["contents"][1]["streamUrl"],
        format!("{CONTENT_URL}/content/default/os-a-p3/stream")
    );
    assert_eq!(
        plan["disks"][0]["contents"][1]["indexSha256"],
        format!("{:064x}", 103)
    );
    let steps: Vec<&str> = plan["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["builtin"].as_str().unwrap())
        .collect();
    assert_eq!(
        steps,
        ["mkswap", "install-removable-fallback", "efibootmgr"]
    );

    // Progress: phase, percent, a log line; another run id is refused.
    let progress = |run_id: &str, phase: &str, done: u64| {
        json!({"runId": run_id, "phase": phase,
               "partitions": [{"number": 3, "bytesDone": done, "bytesTotal": 300u64 << 20}],
               "httpBytes": done, "logLines": [format!("{phase} {done}")]})
    };
    let (code, body) = agent
        .call(
            Method::POST,
            anneal_api::agent::paths::PROGRESS,
            Some(&session),
            Some("1"),
            Some(progress("other-run", "WritingContent", 1)),
        )
        .await;
    assert_eq!(code, 409, "{body}");
    for (phase, done) in [("Partitioning", 0u64), ("WritingContent", 150 << 20)] {
        let (code, body) = agent
            .call(
                Method::POST,
                anneal_api::agent::paths::PROGRESS,
                Some(&session),
                Some("1"),
                Some(progress(&run, phase, done)),
            )
            .await;
        assert_eq!(
            (code, body["action"].as_str()),
            (200, Some("continue")),
            "{body}"
        );
    }
    let r = runs.get(&run).await.unwrap();
    let st = r.status.unwrap();
    assert_eq!(st.phase, Some(anneal_api::RunPhase::WritingContent));
    assert_eq!(st.partitions[0].percent, 50);
    assert_eq!(st.percent, Some(50));
    assert!(st.last_progress_time.is_some());
    // kubectl get machines: image and percent of the current run.
    eventually("dp-1 shows 50%", Duration::from_secs(30), || async {
        let m = machine_json(&machines, "dp-1").await;
        (m["status"]["deploy"]["percent"] == 50 && m["status"]["deploy"]["image"] == "os-a")
            .then_some(())
    })
    .await;
    assert_eq!(st.phase_timings.len(), 2);
    assert!(st.phase_timings[0].end.is_some() && st.phase_timings[1].end.is_none());
    let logs: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    let log = logs.get(&format!("{run}-log")).await.unwrap();
    let text = log.data.unwrap()["log"].clone();
    assert!(
        text.contains("Partitioning 0\n") && text.contains("WritingContent 157286400\n"),
        "{text}"
    );

    // Success: Provisioned, no boot token left.
    let (code, body) = agent
        .result(&session, &run, json!({"status": "succeeded"}))
        .await;
    assert_eq!(code, 204, "{body}");
    eventually("dp-1 Provisioned", Duration::from_secs(30), || async {
        let m = machine_json(&machines, "dp-1").await;
        (m["status"]["state"] == "Provisioned"
            && m["status"]["lastSuccessfulRunRef"]["name"] == run.as_str())
        .then_some(())
    })
    .await;
    assert!(boot_token(&client, "dp-1").await.is_none());
    let st = runs.get(&run).await.unwrap().status.unwrap();
    assert_eq!(st.phase, Some(anneal_api::RunPhase::Succeeded));
    assert!(st.phase_timings.iter().all(|t| t.end.is_some()));

    // Nothing changed: no new run (a claim edit that changes no intent wakes
    // the controller, which must decide "up to date").
    claims
        .patch(
            "c1",
            &pp,
            &Patch::Merge(&json!({"metadata": {"labels": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    let provisioned = event(&client, "DeploySucceeded", Duration::from_secs(30), |e| {
        e.reason.as_deref() == Some("DeploySucceeded")
    })
    .await;
    assert!(provisioned.note.unwrap_or_default().contains(&run));

    // A new image: a new run.
    claims
        .patch(
            "c1",
            &pp,
            &Patch::Merge(&json!({"spec": {"imageRef": {"name": "os-b"}}})),
        )
        .await
        .unwrap();
    let run2 = eventually("a second run", Duration::from_secs(30), || async {
        let m = machine_json(&machines, "dp-1").await;
        m["status"]["currentRunRef"]["name"]
            .as_str()
            .filter(|r| *r != run)
            .map(str::to_string)
    })
    .await;
    assert_eq!(
        runs.get(&run2).await.unwrap().spec.image_ref.unwrap().name,
        "os-b"
    );
    assert_eq!(state(&machines, "dp-1").await, "Provisioning");
    // Finish run 2, then release the claim under Recycle (as the claim
    // controller does: Released with RecyclePending, claimRef cleared): the
    // machine boots to wipe every disk and comes back Available.
    let session = register_next_boot(&client, &agent, "dp-1", "dp-1 armed for run 2").await;
    let (code, body) = agent
        .result(&session, &run2, json!({"status": "succeeded"}))
        .await;
    assert_eq!(code, 204, "{body}");
    eventually(
        "dp-1 Provisioned again",
        Duration::from_secs(30),
        || async { (state(&machines, "dp-1").await == "Provisioned").then_some(()) },
    )
    .await;

    // A PostHook named by the claim: a new run (the claim's intent changed);
    // then only the hook is edited: another run (hooksHash), with the new
    // script in its plan.
    let hooks: Api<anneal_api::PostHook> = Api::namespaced(client.clone(), "default");
    let hook = |script: &str| -> anneal_api::PostHook {
        serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "PostHook",
            "metadata": {"name": "site"},
            "spec": {"steps": [{"name": "tag", "script": {"inline": script}}]},
        }))
        .unwrap()
    };
    hooks
        .create(&PostParams::default(), &hook("#!/bin/sh\necho v1\n"))
        .await
        .unwrap();
    claims
        .patch(
            "c1",
            &pp,
            &Patch::Merge(&json!({"spec": {"postHookRefs": [{"name": "site"}]}})),
        )
        .await
        .unwrap();
    let mut done = vec![run.clone(), run2.clone()];
    let mut hashes = Vec::new();
    for (what, script) in [
        ("the claim names a hook", "v1"),
        ("the hook is edited", "v2"),
    ] {
        if script == "v2" {
            let mut h = hooks.get("site").await.unwrap();
            h.spec.steps[0].script.as_mut().unwrap().inline = Some("#!/bin/sh\necho v2\n".into());
            hooks
                .replace("site", &PostParams::default(), &h)
                .await
                .unwrap();
        }
        let next = eventually(
            &format!("a run after {what}"),
            Duration::from_secs(30),
            || async {
                let m = machine_json(&machines, "dp-1").await;
                m["status"]["currentRunRef"]["name"]
                    .as_str()
                    .filter(|r| !done.iter().any(|d| d == r))
                    .map(str::to_string)
            },
        )
        .await;
        let spec = runs.get(&next).await.unwrap().spec;
        hashes.push(spec.hooks_hash.clone().unwrap());
        let session =
            register_next_boot(&client, &agent, "dp-1", &format!("dp-1 armed after {what}")).await;
        let (code, body) = agent.next(&session).await;
        assert_eq!(
            (code, body["action"].as_str()),
            (200, Some("deploy")),
            "{body}"
        );
        let plan = body["plan"].to_string();
        assert!(
            plan.contains(r#""hook":"site""#) && !plan.contains("anneal-default-finalize"),
            "{what}: the plan runs the claim's hook only: {plan}"
        );
        assert!(
            plan.contains(&format!("echo {script}")),
            "{what}: the plan runs {script}: {plan}"
        );
        let (code, body) = agent
            .result(&session, &next, json!({"status": "succeeded"}))
            .await;
        assert_eq!(code, 204, "{body}");
        eventually(
            &format!("dp-1 Provisioned after {what}"),
            Duration::from_secs(30),
            || async {
                let m = machine_json(&machines, "dp-1").await;
                (m["status"]["state"] == "Provisioned"
                    && m["status"]["lastSuccessfulRunRef"]["name"] == next.as_str())
                .then_some(())
            },
        )
        .await;
        done.push(next);
    }
    assert_ne!(hashes[0], hashes[1], "the hook's edit changes hooksHash");

    let m = machines.get("dp-1").await.unwrap();
    let mut conds = m.status.clone().unwrap().conditions;
    conds.retain(|c| c.type_ != "Ready");
    let mut conds = serde_json::to_value(conds).unwrap();
    conds
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "Ready", "status": "False",
        "reason": "RecyclePending", "message": "claim c1 was deleted",
        "lastTransitionTime": "2026-12-01T00:00:00Z"}));
    machines
        .patch_status(
            "dp-1",
            &pp,
            &Patch::Merge(&json!({"status": {"state": "Released", "conditions": conds}})),
        )
        .await
        .unwrap();
    machines
        .patch(
            "dp-1",
            &pp,
            &Patch::Merge(&json!({"spec": {"claimRef": null}})),
        )
        .await
        .unwrap();
    let token = eventually(
        "dp-1 Deprovisioning and armed",
        Duration::from_secs(30),
        || async {
            if state(&machines, "dp-1").await != "Deprovisioning" {
                return None;
            }
            armed_boot_token(&client, "dp-1").await
        },
    )
    .await;
    let (code, reg) = agent
        .register_as(&token, Some("default/dp-1"), mac_of("dp-1"))
        .await;
    assert_eq!(code, 200, "{reg}");
    let session = reg["sessionToken"].as_str().unwrap().to_string();
    let (code, next) = agent.next(&session).await;
    assert_eq!(code, 200);
    assert_eq!(
        next,
        json!({"action": "wipe", "id": "dp-1-wipe", "disks": ["/dev/vda", "/dev/vdb"]})
    );
    let (code, body) = agent
        .result(&session, "dp-1-wipe", json!({"status": "succeeded"}))
        .await;
    assert_eq!(code, 204, "{body}");
    eventually(
        "dp-1 Available after the wipe",
        Duration::from_secs(30),
        || async {
            let m = machine_json(&machines, "dp-1").await;
            (m["status"]["state"] == "Available"
                && cond(&m, "Ready").is_some_and(|c| c.0 == "True"))
            .then_some(())
        },
    )
    .await;
    assert!(boot_token(&client, "dp-1").await.is_none());

    // The label-only edit started nothing: only these four runs exist.
    let mut names: Vec<String> = runs
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(kube::ResourceExt::name_any)
        .collect();
    names.sort();
    done.sort();
    assert_eq!(names, done);
}

/// Fast-track: an inspected machine's agent keeps polling (`wait`, not
/// `poweroff`) inside the window; a claim bound then deploys through the
/// same session, with no new boot token and no power cycle.
/// Enrols `name` through a fast-track agent (one disk), binds claim `name`
/// with `spec` (an image `os-<name>` added) and returns the session and
/// the `deploy` answer its next poll got.
async fn fast_track_to_plan(
    client: &kube::Client,
    agent: &AgentClient,
    name: &str,
    spec: Value,
) -> (String, Value) {
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), "default");
    machines
        .create(&PostParams::default(), &machine(name, mac_of(name), None))
        .await
        .unwrap();
    let session = register_next_boot(client, agent, name, "armed").await;
    let mut hw = two_disks();
    hw["disks"].as_array_mut().unwrap().truncate(1);
    let (code, _) = agent
        .call(
            Method::PUT,
            anneal_api::agent::paths::HARDWARE,
            Some(&session),
            Some("1"),
            Some(hw),
        )
        .await;
    assert_eq!(code, 204);
    eventually("Available", Duration::from_secs(30), || async {
        (state(&machines, name).await == "Available").then_some(())
    })
    .await;
    // Inside the window the agent is told to wait, not to power off.
    let (code, next) = agent.next(&session).await;
    assert_eq!(
        (code, next["action"].as_str()),
        (200, Some("wait")),
        "{next}"
    );
    assert!(boot_token(client, name).await.is_none());

    let os = format!("os-{name}");
    image(client, &os).await;
    let mut spec = spec;
    spec["machineName"] = json!(name);
    spec["imageRef"] = json!({ "name": os });
    let claim: MachineClaim = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
        "metadata": {"name": name, "namespace": "default"}, "spec": spec}))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let pp = PatchParams::default();
    claims
        .patch_status(
            name,
            &pp,
            &Patch::Merge(&json!({"status": {"phase": "Bound", "machineName": name}})),
        )
        .await
        .unwrap();
    machines
        .patch(
            name,
            &pp,
            &Patch::Merge(&json!({"spec": {"claimRef": {"name": name}}})),
        )
        .await
        .unwrap();
    // The same session's next poll gets the plan.
    let plan = eventually(
        "the plan through the running agent",
        Duration::from_secs(30),
        || async {
            let (code, next) = agent.next(&session).await;
            assert_eq!(code, 200, "{next}");
            (next["action"] == "deploy").then_some(next)
        },
    )
    .await;
    (session, plan)
}

fn fast_track_configs() -> (LifecycleConfig, AgentApiConfig) {
    let (mut lc, mut api_cfg) = configs();
    lc.fast_track_window = Some(Duration::from_secs(300));
    api_cfg.fast_track_window = lc.fast_track_window;
    (lc, api_cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_track_deploys_through_the_running_agent() {
    let cp = ControlPlane::start().await.unwrap();
    let client = prepare(&cp, &[]).await;
    let (lc, api_cfg) = fast_track_configs();
    let manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    let agent = AgentClient::new(manager.api_addr, &manager.ca_pem);
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let (session, plan) = fast_track_to_plan(&client, &agent, "ft-1", json!({})).await;
    let run = plan["plan"]["runId"].as_str().unwrap().to_string();
    let m = machine_json(&machines, "ft-1").await;
    assert_eq!(m["status"]["state"], "Provisioning");
    assert_eq!(m["status"]["currentRunRef"]["name"], run.as_str());
    assert!(m["status"]["netBoot"].is_null(), "no boot armed: {m}");
    assert!(
        boot_token(&client, "ft-1").await.is_none(),
        "no new boot token"
    );
    let (code, _) = agent
        .result(&session, &run, json!({"status": "succeeded"}))
        .await;
    assert_eq!(code, 204);
    eventually("ft-1 Provisioned", Duration::from_secs(30), || async {
        (state(&machines, "ft-1").await == "Provisioned").then_some(())
    })
    .await;
}

/// A run that keeps reporting progress but does not end within
/// the claim's `spec.deployDeadline` fails, naming the deadline, and a new
/// run follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_past_its_deadline_fails_naming_it() {
    let cp = ControlPlane::start().await.unwrap();
    let client = prepare(&cp, &[]).await;
    let (lc, api_cfg) = fast_track_configs();
    let manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    let agent = AgentClient::new(manager.api_addr, &manager.ca_pem);
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), "default");
    let (session, plan) =
        fast_track_to_plan(&client, &agent, "ft-1", json!({"deployDeadline": "6s"})).await;
    let run = plan["plan"]["runId"].as_str().unwrap().to_string();
    // The agent writes slowly: a progress report every 500 ms, each a
    // little further, until the manager fails the run.
    let mut done = 0u64;
    let failed = loop {
        done += 1 << 20;
        let (code, body) = agent
            .call(
                Method::POST,
                anneal_api::agent::paths::PROGRESS,
                Some(&session),
                Some("1"),
                Some(json!({"runId": run, "phase": "WritingContent",
                    "partitions": [{"number": 3, "bytesDone": done, "bytesTotal": 300u64 << 20}],
                    "httpBytes": done, "logLines": []})),
            )
            .await;
        let r = runs.get(&run).await.unwrap();
        let st = r.status.unwrap_or_default();
        if st.phase == Some(anneal_api::RunPhase::Failed) {
            break st;
        }
        assert!(
            code == 200 || code == 409,
            "progress answered {code}: {body}"
        );
        assert!(done < 240 << 20, "the run was not failed by its deadline");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let why = failed
        .conditions
        .iter()
        .find(|c| c.type_ == "Succeeded")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    assert!(
        why.contains("deadline of 6 s") && why.contains("spec.deployDeadline"),
        "{why}"
    );
    assert_eq!(failed.deadline_seconds, Some(6));
    // a new run follows
    eventually("a new run", Duration::from_secs(30), || async {
        let m = machine_json(&machines, "ft-1").await;
        m["status"]["currentRunRef"]["name"]
            .as_str()
            .filter(|r| *r != run)
            .map(str::to_string)
    })
    .await;
}

/// A deploy whose BMC stops answering just before the agent
/// reports success ends Provisioned while the BMC still fails (the agent's
/// report is applied before the BMC is tried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deploy_that_succeeds_while_its_bmc_fails_is_provisioned() {
    use anneal_tests::bmc::{BMC_PASSWORD, BmcVm};
    let ns = anneal_testinfra::Netns::create("anldp").unwrap();
    let (cp, mut vm) = tokio::join!(
        ControlPlane::start(),
        BmcVm::launch(&ns, mac_of("bf-1"), None)
    );
    let cp = cp.unwrap();
    let client = prepare(&cp, &[("bmc-b", BMC_PASSWORD)]).await;
    let (mut lc, api_cfg) = configs();
    // the VM runs firmware, not the agent: its graceful shutdown after the
    // inspection never comes, and the forced one follows this soon
    lc.graceful_shutdown_timeout = Duration::from_secs(2);
    let manager = Manager::start(cp.kubeconfig_path(), lc, api_cfg);
    let agent = AgentClient::new(manager.api_addr, &manager.ca_pem);
    let machines: Api<Machine> = Api::namespaced(client.clone(), "default");
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), "default");
    let address = vm.address();
    machines
        .create(
            &PostParams::default(),
            &machine("bf-1", mac_of("bf-1"), Some((&address, "bmc-b"))),
        )
        .await
        .unwrap();
    let session = register_next_boot(&client, &agent, "bf-1", "bf-1 armed").await;
    let mut hw = two_disks();
    hw["disks"].as_array_mut().unwrap().truncate(1);
    let (code, _) = agent
        .call(
            Method::PUT,
            anneal_api::agent::paths::HARDWARE,
            Some(&session),
            Some("1"),
            Some(hw),
        )
        .await;
    assert_eq!(code, 204);
    eventually("bf-1 Available", Duration::from_secs(60), || async {
        (state(&machines, "bf-1").await == "Available").then_some(())
    })
    .await;
    image(&client, "os-bf").await;
    let claim: MachineClaim = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
        "metadata": {"name": "bf", "namespace": "default"},
        "spec": {"machineName": "bf-1", "imageRef": {"name": "os-bf"}}}))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let pp = PatchParams::default();
    claims
        .patch_status(
            "bf",
            &pp,
            &Patch::Merge(&json!({"status": {"phase": "Bound", "machineName": "bf-1"}})),
        )
        .await
        .unwrap();
    machines
        .patch(
            "bf-1",
            &pp,
            &Patch::Merge(&json!({"spec": {"claimRef": {"name": "bf"}}})),
        )
        .await
        .unwrap();
    let session = register_next_boot(&client, &agent, "bf-1", "bf-1 armed to deploy").await;
    let (code, next) = agent.next(&session).await;
    assert_eq!(
        (code, next["action"].as_str()),
        (200, Some("deploy")),
        "{next}"
    );
    let run = next["plan"]["runId"].as_str().unwrap().to_string();

    // The BMC stops answering: a listener on its port that hangs up.
    vm.stop_bmc().await;
    let dead = tokio::net::TcpListener::bind(vm.addr).await.unwrap();
    let dead_task = tokio::spawn(async move {
        while let Ok((s, _)) = dead.accept().await {
            drop(s);
        }
    });
    let (code, body) = agent
        .result(&session, &run, json!({"status": "succeeded"}))
        .await;
    assert_eq!(code, 204, "{body}");
    let m = eventually(
        "bf-1 Provisioned while its BMC fails",
        Duration::from_secs(60),
        || async {
            let m = machine_json(&machines, "bf-1").await;
            (m["status"]["state"] == "Provisioned"
                && m["status"]["lastSuccessfulRunRef"]["name"] == run.as_str())
            .then_some(m)
        },
    )
    .await;
    assert!(m["status"]["netBoot"].is_null(), "{m}");
    assert!(vm.bmc.is_none(), "the BMC was still down");
    dead_task.abort();
}
