//! Day-1 configuration end to end (docs/deploy.md, "Day-1 configuration
//! (cloud-init)"), under TCG: a Debian 12 root built with debootstrap from
//! Debian's packages, with cloud-init and openssh-server and nothing
//! anneal-specific (tests/setup.d/cloudos.sh, tests/src/cloudos.rs), is
//! imported through an ImageImport and deployed by a claim carrying `userData`
//! (a user with an SSH key, a command writing a marker whose value only the
//! Secret holds), generated `networkData` (a static address on the boot NIC,
//! outside the lease range its DHCP lease comes from) and `metaData` (hostname
//! = the Machine's name, the public key from a Secret). The agent writes the
//! NoCloud config drive; the deployed OS's cloud-init reads it on first boot.
//! The test logs in over SSH from the host side of the lab's network (inside
//! the lab's namespace) to the static address and reads `hostname` and the
//! marker.
//!
//! Before that, two malformed `networkData` (an unknown NIC, an address
//! outside the Subnet) are refused before anything is written: the Machine
//! says which field, no DeployRun exists. After it, a changed `userData`
//! redeploys and the new marker is read. Finally no log, Event or status of
//! the runs carries either marker, and no agent request was refused
//! although each run has a hook step silent for longer than the session
//! TTL (the agent keeps its session alive). Last, the running server's
//! claimed Machine is deleted (it waits, Warning `DeletingClaimedHost`),
//! force-released, enrolled again with `spec.externallyProvisioned` and
//! adopted for a new claim: no power or boot request reaches the BMC, no
//! deploy runs, and the OS keeps running (the same boot id over SSH).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_tests::cloudos::{cloud_os, ssh_keygen, ssh_run};
use anneal_tests::e2e::{self, DEPLOY_DISKS, Lab, LabOptions, MACHINE, NAMESPACE};
use anneal_tests::eventually;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// The static address: in the lab Subnet (10.77.0.0/24), outside its lease
/// range (.100–.150) where the VM's DHCP lease (10.77.0.100) comes from.
const STATIC: &str = "10.77.0.60";
const MARKER_1: &str = "day1-marker-7c41e9-first";
const MARKER_2: &str = "day1-marker-0b8d2a-second";
const USER: &str = "ops";
/// The agent sessions' TTL, shorter than a deploy here (a run
/// that outlives it completes, its session renewed while it reports).
const SESSION_TTL: Duration = Duration::from_secs(12);
/// A hook step that prints nothing for longer than [`SESSION_TTL`].
const QUIET: Duration = Duration::from_secs(16);

fn user_data(public_key: &str, marker: &str) -> String {
    format!(
        "#cloud-config\nusers:\n  - name: {USER}\n    shell: /bin/bash\n    lock_passwd: true\n    ssh_authorized_keys:\n      - {public_key}\nruncmd:\n  - [sh, -c, 'umask 022; printf %s {marker} > /var/tmp/anneal-day1']\n"
    )
}

async fn secret(lab: &Lab, name: &str, key: &str, value: &str) {
    let secrets: Api<Secret> = Api::namespaced(lab.cp.client(), NAMESPACE);
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name}, "stringData": {key: value},
            }))
            .unwrap(),
        )
        .await
        .unwrap();
}

async fn patch_claim(lab: &Lab, spec: serde_json::Value) {
    let claims: Api<anneal_api::MachineClaim> = Api::namespaced(lab.cp.client(), NAMESPACE);
    claims
        .patch(
            "day1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await
        .unwrap();
}

/// Waits until the Machine's Progressing condition says DeployPlanFailed
/// with a message holding `want`; returns the message.
async fn plan_refused(lab: &Lab, want: &str) -> String {
    let machines: Api<anneal_api::Machine> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let m = machines.get(MACHINE).await.unwrap();
        let c = m
            .status
            .unwrap_or_default()
            .conditions
            .into_iter()
            .find(|c| {
                c.type_ == "Progressing"
                    && c.reason == "DeployPlanFailed"
                    && c.message.contains(want)
            });
        if let Some(c) = c {
            return c.message;
        }
        assert!(
            Instant::now() < deadline,
            "no DeployPlanFailed naming {want:?} within 180 s"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

async fn runs(lab: &Lab) -> Vec<anneal_api::DeployRun> {
    let api: Api<anneal_api::DeployRun> = Api::namespaced(lab.cp.client(), NAMESPACE);
    api.list(&Default::default()).await.unwrap().items
}

/// Logs in over SSH until the deployed OS answers with `marker` (an older
/// OS may still answer while a redeploy starts); returns `hostname` and
/// `ip -4 -o addr` as it printed them.
async fn login(
    lab: &Lab,
    key: &std::path::Path,
    marker: &str,
    timeout: Duration,
) -> (String, String) {
    let deadline = Instant::now() + timeout;
    let ns = lab.ns.name().to_string();
    loop {
        let (ns, key) = (ns.clone(), key.to_path_buf());
        let got = tokio::task::spawn_blocking(move || {
            ssh_run(
                Some(&ns),
                STATIC,
                USER,
                &key,
                "hostname; cat /var/tmp/anneal-day1; echo; ip -4 -o addr show",
            )
        })
        .await
        .unwrap();
        let last = match got {
            Ok(out) => {
                let mut lines = out.lines();
                let host = lines.next().unwrap_or_default().trim().to_string();
                let seen = lines.next().unwrap_or_default().trim().to_string();
                if seen == marker {
                    return (host, lines.collect::<Vec<_>>().join("\n"));
                }
                format!("answered with marker {seen:?}")
            }
            Err(e) => format!("{e:#}"),
        };
        assert!(
            Instant::now() < deadline,
            "no SSH login to {USER}@{STATIC} showing {marker} within {timeout:?}: {last}\nconsole tail:\n{}",
            e2e::tail(&lab.console(), 60)
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployed_debian_gets_its_user_network_and_meta_data_from_the_claim() {
    let os = tokio::task::spawn_blocking(cloud_os);
    let mut lab = Lab::start_with(
        &|s| println!("e2e-day1: {s}"),
        LabOptions {
            deploy: true,
            session: Some((SESSION_TTL, Duration::from_secs(2))),
            ..LabOptions::default()
        },
    )
    .await
    .unwrap();
    let os = os.await.unwrap().unwrap_or_else(|e| panic!("{e:#}"));
    let t = Instant::now();
    let _server = lab
        .serve_and_import(&[("cloudos", &os.disk, true)], Duration::from_secs(1200))
        .await
        .unwrap();
    println!("e2e-day1: imported in {:.1} s", t.elapsed().as_secs_f64());
    lab.boot_until_available("e2e-day1", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));

    let key = ssh_keygen("e2e-day1").unwrap();
    secret(
        &lab,
        "day1-user",
        "userData",
        &user_data(&key.public, MARKER_1),
    )
    .await;
    secret(&lab, "day1-keys", "authorized_keys", &key.public).await;
    let net = |nic: &str, cidr: &str| json!({"ethernets": [{"name": "prov0", "nic": nic, "addresses": [cidr]}]});

    // A step that reports nothing for longer than the session TTL (issue
    // 44): the agent keeps its session alive meanwhile, so the run's later
    // progress and result are taken.
    Api::<anneal_api::PostHook>::namespaced(lab.cp.client(), NAMESPACE)
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "anneal.dev/v1alpha1", "kind": "PostHook",
                "metadata": {"name": "day1-quiet"},
                "spec": {"steps": [{"name": "quiet", "script": {"inline":
                    format!("#!/bin/sh\nsleep {}\n", QUIET.as_secs())}}]},
            }))
            .unwrap(),
        )
        .await
        .unwrap();

    // refused before anything is written, naming the field
    lab.claim(
        "day1",
        "cloudos",
        DEPLOY_DISKS[0].1,
        json!({"postHookRefs": [{"name": "anneal-default-finalize"}, {"name": "day1-quiet"}],
               "userData": {"name": "day1-user"},
               "networkData": net("storage", &format!("{STATIC}/24")),
               "metaData": {"publicKeysSecretRef": {"name": "day1-keys"}}}),
    )
    .await
    .unwrap();
    let m = plan_refused(&lab, "spec.networkData.ethernets[0].nic").await;
    println!("e2e-day1: refused: {m}");
    patch_claim(&lab, json!({"networkData": net("boot", "10.9.9.9/24")})).await;
    let m = plan_refused(
        &lab,
        "spec.networkData.ethernets[0].addresses[0]: 10.9.9.9 is outside Subnet lab",
    )
    .await;
    println!("e2e-day1: refused: {m}");
    assert!(
        runs(&lab).await.is_empty(),
        "a refused plan wrote a DeployRun"
    );
    assert_eq!(lab.state().await.unwrap(), "Available");

    // the deploy
    let claimed = Instant::now();
    patch_claim(
        &lab,
        json!({"networkData": net("boot", &format!("{STATIC}/24"))}),
    )
    .await;
    lab.wait_state(
        "Provisioned",
        Duration::from_secs(1200),
        &mut e2e::print_states("e2e-day1"),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\nconsole:\n{}", e2e::tail(&lab.console(), 80)));
    let provisioned = claimed.elapsed().as_secs_f64();
    let run = runs(&lab).await.into_iter().next().expect("the run");
    let timings = run.status.clone().unwrap_or_default().phase_timings;
    let (start, end) = (
        timings
            .first()
            .and_then(|t| t.start.clone())
            .expect("the run's first phase start"),
        timings
            .last()
            .and_then(|t| t.end.clone().or(t.start.clone()))
            .expect("the run's end"),
    );
    let ran = end.0.duration_since(start.0).as_secs_f64();
    println!(
        "e2e-day1: the run took {ran:.1} s with sessions of {} s",
        SESSION_TTL.as_secs()
    );
    assert!(
        ran > SESSION_TTL.as_secs_f64(),
        "the run ({ran:.1} s) did not outlive the session TTL: nothing was shown"
    );
    let (host, addrs) = login(&lab, &key.private, MARKER_1, Duration::from_secs(900)).await;
    let ssh = claimed.elapsed().as_secs_f64();
    println!("e2e-day1: claim → Provisioned {provisioned:.1} s, → SSH login {ssh:.1} s");
    assert_eq!(host, MACHINE, "hostname from the generated meta-data");
    let (ns, private) = (lab.ns.name().to_string(), key.private.clone());
    let status = tokio::task::spawn_blocking(move || {
        ssh_run(
            Some(&ns),
            STATIC,
            USER,
            &private,
            "cloud-init status --wait --long; cloud-id",
        )
    })
    .await
    .unwrap()
    .unwrap();
    assert!(
        status.contains("status: done")
            && status.contains("DataSourceNoCloud")
            && status.contains("nocloud"),
        "cloud-init did not finish cleanly from the NoCloud drive: {status}"
    );
    assert!(
        addrs.contains(&format!("prov0    inet {STATIC}/24"))
            || addrs.contains(&format!("prov0 inet {STATIC}/24")),
        "the static address on the renamed boot NIC: {addrs}"
    );
    let first = runs(&lab).await;
    assert_eq!(first.len(), 1);
    let cd = first[0]
        .status
        .clone()
        .unwrap_or_default()
        .config_drive
        .expect("status.configDrive");
    assert_eq!(
        (
            cd.format.as_str(),
            cd.label.as_str(),
            cd.filesystem.as_str()
        ),
        ("NoCloud", "CIDATA", "vfat")
    );
    assert_eq!(cd.partition, 3, "after the image's ESP and root");
    assert_eq!(cd.files, ["meta-data", "network-config", "user-data"]);

    // a changed userData redeploys
    secret(
        &lab,
        "day1-user-2",
        "userData",
        &user_data(&key.public, MARKER_2),
    )
    .await;
    let again = Instant::now();
    patch_claim(&lab, json!({"userData": {"name": "day1-user-2"}})).await;
    let (host, _) = login(&lab, &key.private, MARKER_2, Duration::from_secs(1500)).await;
    println!(
        "e2e-day1: changed userData → SSH login with the new marker {:.1} s",
        again.elapsed().as_secs_f64()
    );
    assert_eq!(host, MACHINE);
    lab.wait_state(
        "Provisioned",
        Duration::from_secs(300),
        &mut e2e::print_states("e2e-day1"),
    )
    .await
    .unwrap();
    let all = runs(&lab).await;
    assert_eq!(all.len(), 2, "one more run for the new intent");
    assert_ne!(all[0].spec.config_hash, all[1].spec.config_hash);

    // no value of the Secrets in any log, Event or status of the runs
    let events: Api<Event> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let machines: Api<anneal_api::Machine> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let claims: Api<anneal_api::MachineClaim> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let mut seen = vec![
        (
            "manager and bootd log",
            std::fs::read_to_string(lab.dir.join("lab.log")).unwrap_or_default(),
        ),
        (
            "Events",
            serde_json::to_string(&events.list(&Default::default()).await.unwrap().items).unwrap(),
        ),
        ("DeployRuns", serde_json::to_string(&all).unwrap()),
        // the runs' console logs (ConfigMaps `<run>-log`)
        (
            "ConfigMaps",
            serde_json::to_string(
                &Api::<ConfigMap>::namespaced(lab.cp.client(), NAMESPACE)
                    .list(&Default::default())
                    .await
                    .unwrap()
                    .items,
            )
            .unwrap(),
        ),
        (
            "Machine",
            serde_json::to_string(&machines.get(MACHINE).await.unwrap()).unwrap(),
        ),
        (
            "MachineClaim",
            serde_json::to_string(&claims.get("day1").await.unwrap()).unwrap(),
        ),
    ];
    // the agent's lines on the serial console (the deployed OS's own boot
    // output follows each run)
    seen.push((
        "agent console",
        lab.console()
            .lines()
            .filter(|l| l.contains("anneal"))
            .collect::<Vec<_>>()
            .join("\n"),
    ));
    let refused: Vec<_> = seen[0]
        .1
        .lines()
        .filter(|l| l.contains("agent api request") && l.contains("status=401"))
        .collect();
    assert!(
        refused.is_empty(),
        "the agent's session lapsed during a run (a silent step of {QUIET:?} > TTL {SESSION_TTL:?}): {refused:?}"
    );
    for (what, text) in &seen {
        assert!(
            !text.is_empty() || *what == "agent console",
            "{what} is empty: nothing was checked"
        );
        for marker in [MARKER_1, MARKER_2] {
            assert!(
                !text.contains(marker),
                "{what} carries the user data's value {marker}"
            );
        }
    }

    delete_and_adopt_the_running_server(&lab, &key.private).await;
}

/// The deployed OS's boot id: the same value before and after means it did
/// not restart.
async fn boot_id(lab: &Lab, key: &std::path::Path) -> String {
    let (ns, key) = (lab.ns.name().to_string(), key.to_path_buf());
    let id = tokio::task::spawn_blocking(move || {
        ssh_run(
            Some(&ns),
            STATIC,
            USER,
            &key,
            "cat /proc/sys/kernel/random/boot_id",
        )
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| panic!("no SSH login to read the boot id: {e:#}"));
    let id = id.trim().to_string();
    assert_eq!(id.len(), 36, "a boot id: {id:?}");
    id
}

/// Waits for an Event of `reason` about the lab's Machine.
async fn machine_event(lab: &Lab, reason: &str) -> Event {
    let events: Api<Event> = Api::namespaced(lab.cp.client(), NAMESPACE);
    eventually(
        &format!("an Event {reason} about Machine {MACHINE}"),
        Duration::from_secs(120),
        || async {
            events
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .into_iter()
                .find(|e| {
                    e.reason.as_deref() == Some(reason)
                        && e.involved_object.name.as_deref() == Some(MACHINE)
                })
        },
    )
    .await
}

/// With the server running its deployed OS: deleting the claimed
/// Machine waits with the Warning `DeletingClaimedHost`; `force-release`
/// then deletes it with no BMC call; the server, enrolled again with
/// `spec.externallyProvisioned` and named by a new claim, is adopted
/// (Provisioned, Event `AdoptedProvisionedClaim`, no DeployRun). Through
/// it all the BMC gets no power or boot request and the OS keeps running
/// (the same boot id, reached over SSH).
async fn delete_and_adopt_the_running_server(lab: &Lab, key: &std::path::Path) {
    let machines: Api<anneal_api::Machine> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let claims: Api<anneal_api::MachineClaim> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let booted = boot_id(lab, key).await;
    let from = lab.bmc_requests().len();
    let t = Instant::now();

    machines
        .delete(MACHINE, &DeleteParams::default())
        .await
        .unwrap();
    let warning = machine_event(lab, "DeletingClaimedHost").await;
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    let m = machines.get(MACHINE).await.unwrap();
    assert!(
        m.metadata.deletion_timestamp.is_some(),
        "the claimed Machine waits"
    );
    assert_eq!(lab.state().await.unwrap(), "Provisioned");
    lab.patch_machine(json!({"metadata": {"annotations": {"anneal.dev/force-release": ""}}}))
        .await
        .unwrap();
    eventually(
        &format!("Machine {MACHINE} gone after force-release"),
        Duration::from_secs(120),
        || async { machines.get_opt(MACHINE).await.unwrap().is_none() },
    )
    .await;
    assert_eq!(boot_id(lab, key).await, booted, "the OS restarted");
    // the old claim lost its machine: deleted (nothing left to release)
    claims
        .delete("day1", &DeleteParams::default())
        .await
        .unwrap();
    eventually("claim day1 gone", Duration::from_secs(120), || async {
        claims.get_opt("day1").await.unwrap().is_none()
    })
    .await;
    println!(
        "e2e-day1: the claimed Machine deleted by force-release in {:.1} s, the OS up",
        t.elapsed().as_secs_f64()
    );

    // enrolled again as already provisioned, for a claim naming it
    let t = Instant::now();
    let runs_before = runs(lab).await.len();
    lab.claim_for(
        MACHINE,
        "day1-adopt",
        "cloudos",
        DEPLOY_DISKS[0].1,
        json!({}),
    )
    .await
    .unwrap();
    let mut m: anneal_api::Machine = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
        "metadata": {"name": MACHINE},
        "spec": serde_json::to_value(&m.spec).unwrap(),
    }))
    .unwrap();
    m.spec.claim_ref = None;
    m.spec.externally_provisioned = true;
    machines.create(&PostParams::default(), &m).await.unwrap();
    eventually(
        &format!("the re-enrolled Machine {MACHINE} Provisioned (adopted)"),
        Duration::from_secs(120),
        || async {
            machines
                .get(MACHINE)
                .await
                .unwrap()
                .status
                .and_then(|s| s.state)
                == Some(anneal_api::MachineState::Provisioned)
        },
    )
    .await;
    machine_event(lab, "AdoptedProvisionedClaim").await;
    let m = machines.get(MACHINE).await.unwrap();
    let adopted = m
        .status
        .unwrap_or_default()
        .adopted
        .expect("status.adopted");
    assert_eq!(adopted.claim, "day1-adopt");
    assert_eq!(
        runs(lab).await.len(),
        runs_before,
        "an adoption deploys nothing"
    );
    assert_eq!(boot_id(lab, key).await, booted, "the OS restarted");
    let asked: Vec<_> = lab.bmc_requests()[from..]
        .iter()
        .filter(|e| e.method != "GET" && e.path.contains("/Systems/"))
        .map(|e| format!("{} {} {:?}", e.method, e.path, e.action))
        .collect();
    assert!(
        asked.is_empty(),
        "power or boot requests while deleting and adopting a running server: {asked:?}"
    );
    println!(
        "e2e-day1: adopted (Provisioned, no BMC power or boot request, no deploy) in {:.1} s",
        t.elapsed().as_secs_f64()
    );
}
