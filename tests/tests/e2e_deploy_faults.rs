//! Deploy failures end to end, under TCG (docs/deploy.md, "6. What the VM
//! tests show"), in one VM with two disks:
//!
//! 1. A claim deploys the test OS to the first disk and a data image to the
//!    second. While the agent writes, the VM loses power (`ForceOff` sent to
//!    its BMC behind the manager's back): the OS disk is left without a
//!    partition table (the table is written last, so nothing half-written
//!    boots); the run stalls and fails naming the silence; the manager
//!    restarts it, the next attempt succeeds and the deployed OS boots.
//!    The second disk holds the data image's filesystem, the OS disk does
//!    not.
//! 2. The claim then names a PostHook whose script exits 3: the new run
//!    fails naming the hook, the step, the exit code and the output tail, in
//!    the DeployRun, in the Machine's status, in a Warning Event and on the
//!    console. The hook is then edited (nothing else): a new run starts
//!    (hooksHash) and its step, past its 5 s timeout, is killed and named
//!    the same way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Seek, SeekFrom};
use std::time::{Duration, Instant};

use anneal_api::DeployRun;
use anneal_tests::disks::{ext4_uuids, gpt_partitions};
use anneal_tests::e2e::{self, Lab, LabOptions, MACHINE, NAMESPACE};
use anneal_tests::wait::eventually;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};

async fn runs(lab: &Lab) -> Vec<DeployRun> {
    let api: Api<DeployRun> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let mut items = api.list(&ListParams::default()).await.unwrap().items;
    items.sort_by_key(|r| r.metadata.creation_timestamp.clone().map(|t| t.0));
    items
}

fn phase(r: &DeployRun) -> String {
    r.status
        .as_ref()
        .and_then(|s| s.phase)
        .map(|p| format!("{p:?}"))
        .unwrap_or_default()
}

/// Waits until `f` holds for the lab's runs (polled; the error names what
/// was awaited and shows the runs and the console).
async fn until_runs(
    lab: &Lab,
    what: &str,
    timeout: Duration,
    f: impl Fn(&[DeployRun]) -> bool,
) -> Vec<DeployRun> {
    let deadline = Instant::now() + timeout;
    loop {
        let rs = runs(lab).await;
        if f(&rs) {
            return rs;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not after {timeout:?}; runs {:?}; console tail:\n{}",
            rs.iter()
                .map(|r| (kube::ResourceExt::name_any(r), phase(r)))
                .collect::<Vec<_>>(),
            e2e::tail(&lab.console(), 40)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Waits for a Warning Event whose message contains `text` (the lifecycle
/// pass that records a failed attempt writes it after the run's status).
async fn warning_event(events: &Api<Event>, text: &str) {
    eventually(
        &format!("a Warning Event naming {text:?}"),
        Duration::from_secs(120),
        || async {
            events
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .any(|e| {
                    e.type_.as_deref() == Some("Warning")
                        && e.message.as_deref().is_some_and(|n| n.contains(text))
                })
        },
    )
    .await;
}

/// Whether the Machine is held (`RetryHeld=True`).
async fn held(machines: &Api<anneal_api::Machine>) -> bool {
    let m = serde_json::to_value(machines.get(MACHINE).await.unwrap()).unwrap();
    m["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "RetryHeld" && c["status"] == "True")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_loss_mid_write_data_disk_and_a_failing_hook() {
    let os = tokio::task::spawn_blocking(anneal_tests::testos::test_os);
    let mut lab = Lab::start_with(
        &|s| println!("e2e-faults: {s}"),
        LabOptions {
            deploy: true,
            stall_timeout: Some(Duration::from_secs(40)),
            ..LabOptions::default()
        },
    )
    .await
    .unwrap();
    let os = os.await.unwrap().unwrap();
    let data_dir = lab.dir.join("data");
    std::fs::create_dir_all(&data_dir).unwrap();
    let data = anneal_tests::images::gpt_disk(&data_dir, 96, 8);
    let data_uuid = ext4_uuids(&data)
        .pop()
        .expect("the data image's ext4 has a UUID");
    let _server = lab
        .serve_and_import(
            &[("testos", &os.image, true), ("data", &data, false)],
            Duration::from_secs(900),
        )
        .await
        .unwrap();
    // The hook of part 2.
    let hooks: Api<anneal_api::PostHook> = Api::namespaced(lab.cp.client(), NAMESPACE);
    hooks
        .create(
            &Default::default(),
            &serde_json::from_value(serde_json::json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "PostHook",
                "metadata": {"name": "site-check"},
                "spec": {"steps": [{"name": "raid-ready", "script": {"inline":
                    "#!/bin/sh\necho \"checking {{ machineName }}\"\necho 'controller cache not ready' >&2\nexit 3\n"}}]}
            }))
            .unwrap(),
        )
        .await
        .unwrap();

    lab.boot_until_available("e2e-faults", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut log = e2e::print_states("e2e-faults");
    let (os_serial, data_serial) = (e2e::DEPLOY_DISKS[0].1, e2e::DEPLOY_DISKS[1].1);
    let (os_disk, data_disk) = (lab.disk_path(os_serial), lab.disk_path(data_serial));
    lab.claim(
        "faults",
        "testos",
        os_serial,
        serde_json::json!({"dataImages": [
            {"imageRef": {"name": "data"}, "targetDisk": {"serialNumber": data_serial}}]}),
    )
    .await
    .unwrap();

    // 1. Power lost while the agent writes: cut when its console shows
    // WritingContent between 1 and 80 % (the console, not the run's status,
    // which trails the agent by a progress report or more).
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let console = lab.console();
        let writing = console
            .lines()
            .filter_map(|l| l.split("anneal: deploy: WritingContent ").nth(1))
            .filter_map(|rest| rest.split('%').next()?.trim().parse::<u32>().ok())
            .any(|pct| (1..=80).contains(&pct));
        if writing {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent never reported WritingContent; console tail:\n{}",
            e2e::tail(&console, 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lab.bmc_reset("ForceOff").unwrap();
    let console = lab.console();
    assert!(
        !console.contains("anneal: deploy: Finalizing"),
        "the power was cut after the contents were written; console tail:\n{}",
        e2e::tail(&console, 20)
    );
    let first = kube::ResourceExt::name_any(runs(&lab).await.last().unwrap());
    println!("e2e-faults: power lost while {first} was writing");
    assert_eq!(
        gpt_partitions(&os_disk),
        None,
        "a deploy cut mid-write leaves the OS disk without a partition table"
    );
    let rs = until_runs(
        &lab,
        "the cut run failed and another one succeeded",
        Duration::from_secs(1200),
        |rs| {
            rs.iter()
                .any(|r| kube::ResourceExt::name_any(r) == first && phase(r) == "Failed")
                && rs.iter().any(|r| phase(r) == "Succeeded")
        },
    )
    .await;
    let cut = rs
        .iter()
        .find(|r| kube::ResourceExt::name_any(*r) == first)
        .unwrap();
    let cut_status = serde_json::to_string(&cut.status).unwrap();
    println!("e2e-faults: {first}: {cut_status}");
    assert!(
        cut_status.contains("no progress") || cut_status.contains("stall"),
        "the cut run's failure names the silence: {cut_status}"
    );
    lab.wait_state("Provisioned", Duration::from_secs(1800), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    lab.wait_console(
        &format!("ANNEAL-MARKER {}", os.marker_sha256),
        1,
        Duration::from_secs(600),
    )
    .await
    .unwrap();
    println!("e2e-faults: the next attempt deployed and the OS booted");
    assert!(
        ext4_uuids(&data_disk).contains(&data_uuid),
        "the data image's filesystem {data_uuid} is on the data disk: {:?}",
        ext4_uuids(&data_disk)
    );
    assert!(
        !ext4_uuids(&os_disk).contains(&data_uuid),
        "the OS disk does not carry the data image: {:?}",
        ext4_uuids(&os_disk)
    );

    // 2. A hook whose script exits 3.
    let before = runs(&lab).await.len();
    let claims: Api<anneal_api::MachineClaim> = Api::namespaced(lab.cp.client(), NAMESPACE);
    claims
        .patch(
            "faults",
            &Default::default(),
            &kube::api::Patch::Merge(serde_json::json!({
                "spec": {"postHookRefs": [{"name": "site-check"}]}})),
        )
        .await
        .unwrap();
    let rs = until_runs(
        &lab,
        "the hook's run failed",
        Duration::from_secs(900),
        // the first failed run of the new intent: its next attempt may
        // already be planned, so the newest run is not the failed one
        |rs| rs.iter().skip(before).any(|r| phase(r) == "Failed"),
    )
    .await;
    let failed = rs
        .iter()
        .skip(before)
        .find(|r| phase(r) == "Failed")
        .map(|r| serde_json::to_string(&r.status).unwrap())
        .unwrap();
    for want in [
        "site-check",
        "raid-ready",
        "exited with code 3",
        "controller cache not ready",
    ] {
        assert!(failed.contains(want), "run status names {want:?}: {failed}");
    }
    // The agent API writes the run's Failed status; the Machine's next
    // lifecycle pass records the failed attempt (its error and a Warning
    // Event) after it: wait for that pass, not for the run alone.
    let machines: Api<anneal_api::Machine> = Api::namespaced(lab.cp.client(), NAMESPACE);
    eventually(
        "the Machine's status to name the hook and the exit code",
        Duration::from_secs(120),
        || async {
            let m = serde_json::to_string(&machines.get(MACHINE).await.unwrap().status).unwrap();
            if m.contains("site-check") && m.contains("exited with code 3") {
                Ok(())
            } else {
                Err(m)
            }
        },
    )
    .await;
    let events: Api<Event> = Api::namespaced(lab.cp.client(), NAMESPACE);
    warning_event(&events, "exited with code 3").await;
    lab.wait_console("script exited with code 3", 1, Duration::from_secs(60))
        .await
        .unwrap();
    println!(
        "e2e-faults: the failing hook is named in the run, the Machine, an Event and on the console"
    );

    // 2b. The same hook edited (only the hook: hooksHash changes, so a new
    // run starts): its step now outlives its 5 s timeout and is killed.
    let before = runs(&lab).await.len();
    hooks
        .patch(
            "site-check",
            &Default::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"steps": [
                {"name": "wait-for-raid", "timeoutSeconds": 5, "script": {"inline":
                    "#!/bin/sh\necho 'waiting for the RAID controller'\nsleep 600\n"}}]}})),
        )
        .await
        .unwrap();
    let timed_out = |r: &DeployRun| {
        phase(r) == "Failed"
            && serde_json::to_string(&r.status)
                .unwrap()
                .contains("exceeded its timeout of 5 s")
    };
    let rs = until_runs(
        &lab,
        "the edited hook's run failed on its timeout",
        Duration::from_secs(900),
        |rs| rs.iter().skip(before).any(timed_out),
    )
    .await;
    let failed = rs
        .iter()
        .skip(before)
        .find(|r| timed_out(r))
        .map(|r| serde_json::to_string(&r.status).unwrap())
        .unwrap();
    for want in [
        "site-check",
        "wait-for-raid",
        "waiting for the RAID controller",
    ] {
        assert!(failed.contains(want), "run status names {want:?}: {failed}");
    }
    warning_event(&events, "exceeded its timeout of 5 s").await;
    lab.wait_console("exceeded its timeout of 5 s", 1, Duration::from_secs(60))
        .await
        .unwrap();
    println!("e2e-faults: the edited hook started a run; its step was killed at its timeout");

    // 3. A corrupt range: one byte of testos-p3's stream flipped on disk.
    let stream = lab
        .store
        .clone()
        .unwrap()
        .join(NAMESPACE)
        .join("testos-p3")
        .join("stream");
    let at = 32u64 << 20;
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&stream)
            .unwrap();
        let mut b = [0u8; 1];
        f.seek(SeekFrom::Start(at)).unwrap();
        f.read_exact(&mut b).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&[b[0] ^ 0xff]).unwrap();
        f.sync_all().unwrap();
    }
    lab.patch_machine(
        serde_json::json!({"metadata": {"annotations": {"anneal.dev/debug-shell": ""}}}),
    )
    .await
    .unwrap();
    let before = runs(&lab).await.len();
    claims
        .patch(
            "faults",
            &Default::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"postHookRefs": null}})),
        )
        .await
        .unwrap();
    let failed_on_piece = |r: &DeployRun| {
        phase(r) == "Failed"
            && serde_json::to_string(&r.status)
                .unwrap()
                .contains("failed its SHA-1")
    };
    // The attempts of part 2's intents already planned run first and fail
    // too; the third failure in a row holds the machine (RetryHeld), which
    // `clear-error` lifts, once, so the new intent gets its attempts.
    let deadline = Instant::now() + Duration::from_secs(1200);
    let mut cleared = false;
    let rs = loop {
        let rs = runs(&lab).await;
        if rs.iter().skip(before).any(failed_on_piece) {
            break rs;
        }
        if !cleared && held(&machines).await {
            lab.patch_machine(
                serde_json::json!({"metadata": {"annotations": {"anneal.dev/clear-error": ""}}}),
            )
            .await
            .unwrap();
            cleared = true;
            println!("e2e-faults: held after part 2's attempts; clear-error");
        }
        assert!(
            Instant::now() < deadline,
            "no run failed on the corrupt piece; runs {:?}; console tail:\n{}",
            rs.iter()
                .map(|r| (kube::ResourceExt::name_any(r), phase(r)))
                .collect::<Vec<_>>(),
            e2e::tail(&lab.console(), 40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let corrupt = rs
        .iter()
        .skip(before)
        .find(|r| failed_on_piece(r))
        .map(|r| serde_json::to_string(&r.status).unwrap())
        .unwrap();
    assert!(
        corrupt.contains("content testos-p3: piece "),
        "the run names the content and the piece: {corrupt}"
    );
    assert_eq!(
        gpt_partitions(&os_disk),
        None,
        "a run failed on a corrupt piece leaves the OS disk unbootable"
    );
    lab.wait_console("re-fetching", 1, Duration::from_secs(60))
        .await
        .unwrap();
    println!("e2e-faults: the corrupt piece was re-fetched, then the run failed naming it");

    // 4. Held after three failures; the last agent's shell stays.
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let held = held(&machines).await;
        let console = lab.console();
        let shell_after_last_failure = console
            .rfind("failed its SHA-1")
            .is_some_and(|at| console[at..].contains("anneal# "));
        if held && shell_after_last_failure {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not held with a shell prompt on the console (held {held}); console tail:\n{}",
            e2e::tail(&console, 40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    lab.type_on_console("\necho ANNEAL-SHELL-$((6*7))\n")
        .unwrap();
    lab.wait_console("ANNEAL-SHELL-42", 1, Duration::from_secs(120))
        .await
        .unwrap();
    println!("e2e-faults: held after three failures; the debug shell answered on the console");
}
