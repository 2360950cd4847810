//! Two machines deploy the same Image at once through the swarm, under TCG
//! (docs/distribution.md, "The agent deploys from the swarm"): the lab's Site
//! has a tracker on the VMs' bridge (`spec.tracker.ip`), so the manager runs
//! it and, while the deploys are active, the Image's seeder, both inside the
//! lab's namespace. Two VMs (OVMF, PXE through bootd, the agent in our
//! initramfs) are inspected, then claimed together inside the fast-track
//! window; each agent fetches the test OS's contents over BitTorrent from the
//! seeder and from the other machine, writes each verified piece at its slot,
//! seeds until the other is done, runs the default hook and reboots; both VMs
//! boot their deployed OS (the marker's SHA-256 and their own name on the
//! console). The DeployRuns' `status.transfer` shows the bytes each machine
//! received from the other and from the seeder, and the PartitionContents
//! listed the Site's seeder while the runs were active.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_api::{DeployRun, PartitionContent};
use anneal_tests::e2e::{self, Lab, LabOptions, MACHINE, NAMESPACE, PEER};
use anneal_tests::wait::eventually;
use kube::api::Api;

/// Writes both consoles in full under `$ANNEAL_E2E_CONSOLES` (a
/// directory), when set: the tails in a failure message rarely say why an
/// agent stopped.
fn dump(lab: &Lab) {
    if let Some(dir) = std::env::var_os("ANNEAL_E2E_CONSOLES") {
        let dir = std::path::PathBuf::from(dir);
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(dir.join(format!("{MACHINE}.log")), lab.console());
        if let Some(p) = lab.peer.as_ref() {
            let _ = std::fs::write(dir.join(format!("{PEER}.log")), p.console());
        }
    }
}

/// Polls Machine `name` until its state is `want`, at most `timeout`.
async fn wait_state_of(lab: &Lab, name: &str, want: &str, timeout: Duration) {
    let start = Instant::now();
    let mut last = String::new();
    loop {
        let state = lab.state_of(name).await.unwrap_or_default();
        if state != last {
            println!(
                "e2e-swarm: {name} state {state:?} at {:.1} s",
                lab.since_launch().as_secs_f64()
            );
            last = state.clone();
        }
        dump(lab);
        if state == want {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "{name} not {want} after {timeout:?} (state {state:?}); console tails:\n{}\n---\n{}",
            e2e::tail(&lab.console(), 30),
            e2e::tail(
                &lab.peer.as_ref().map(|p| p.console()).unwrap_or_default(),
                30
            )
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_vms_deploy_the_same_image_at_once_through_the_swarm() {
    let os = tokio::task::spawn_blocking(anneal_tests::testos::test_os);
    let mut lab = Lab::start_with(
        &|s| println!("e2e-swarm: {s}"),
        LabOptions {
            deploy: true,
            swarm: true,
            fast_track_window: Some(Duration::from_secs(900)),
            ..LabOptions::default()
        },
    )
    .await
    .unwrap();
    let os = os.await.unwrap().unwrap();
    let _server = lab
        .serve_and_import(&[("testos", &os.image, true)], Duration::from_secs(900))
        .await
        .unwrap();

    // Both machines inspected; their agents stay up (fast-track window).
    lab.launch_vm().await.unwrap();
    lab.enrol().await.unwrap();
    lab.launch_peer().await.unwrap();
    wait_state_of(&lab, MACHINE, "Available", Duration::from_secs(900)).await;
    wait_state_of(&lab, PEER, "Available", Duration::from_secs(900)).await;

    // Claimed together: both agents get their plans from the next long-poll.
    let t = Instant::now();
    let disk = e2e::DEPLOY_DISKS[0].1;
    lab.claim_for(MACHINE, "deploy", "testos", disk, serde_json::json!({}))
        .await
        .unwrap();
    lab.claim_for(PEER, "deploy-peer", "testos", disk, serde_json::json!({}))
        .await
        .unwrap();

    // While the runs are active the Image's seeder serves its contents:
    // the contents list the Site.
    let contents: Api<PartitionContent> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let seen = eventually(
        "the contents to list the Site's seeder",
        Duration::from_secs(300),
        || async {
            let items = contents.list(&Default::default()).await.ok()?.items;
            let listed: Vec<_> = items
                .iter()
                .filter_map(|c| c.status.as_ref())
                .flat_map(|s| s.seeders.iter())
                .filter(|s| s.site == "site" && s.machines >= 1)
                .collect();
            (!listed.is_empty()).then(|| format!("{listed:?}"))
        },
    )
    .await;
    println!("e2e-swarm: contents' seeders while deploying: {seen}");

    wait_state_of(&lab, MACHINE, "Provisioned", Duration::from_secs(1500)).await;
    wait_state_of(&lab, PEER, "Provisioned", Duration::from_secs(1500)).await;
    println!(
        "e2e-swarm: both Provisioned {:.1} s after the claims",
        t.elapsed().as_secs_f64()
    );

    // Both boot their deployed OS.
    let marker = format!("ANNEAL-MARKER {}", os.marker_sha256);
    lab.wait_deployed_os(&os.marker_sha256).await.unwrap();
    let peer_console = eventually(
        "the peer to boot its deployed OS",
        Duration::from_secs(600),
        || async {
            let c = lab.peer.as_ref().unwrap().console();
            (c.contains(&marker) && c.contains(&format!("ANNEAL-DEPLOYED {PEER}"))).then_some(c)
        },
    )
    .await;
    // The agents fetched over BitTorrent and seeded before their hooks.
    for (name, console) in [(MACHINE, lab.console()), (PEER, peer_console)] {
        assert!(
            console.contains("swarm:"),
            "{name}'s agent reported no swarm figures:\n{}",
            e2e::tail(&console, 60)
        );
    }

    // The runs' transfer figures: bytes from the other machine, from the
    // seeder, nothing that needed the HTTP fallback.
    let runs: Api<DeployRun> = Api::namespaced(lab.cp.client(), NAMESPACE);
    let used: i64 = contents
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|c| c.spec.used_bytes)
        .sum();
    let mut from_peers = 0;
    for r in runs.list(&Default::default()).await.unwrap().items {
        let st = r.status.clone().unwrap_or_default();
        let t = st.transfer.clone().unwrap_or_default();
        println!(
            "e2e-swarm: run {} ({}): {:?}, transfer {t:?}",
            kube::ResourceExt::name_any(&r),
            r.spec.machine_ref.name,
            st.phase
        );
        assert_eq!(st.phase, Some(anneal_api::RunPhase::Succeeded), "{st:?}");
        assert!(t.fallback_reason.is_none(), "{t:?}");
        assert!(
            t.downloaded_bytes + t.seeder_bytes + t.http_bytes >= used,
            "run {} received less than the contents' {used} bytes: {t:?}",
            kube::ResourceExt::name_any(&r)
        );
        from_peers += t.downloaded_bytes;
    }
    assert!(
        from_peers > 0,
        "no DeployRun shows bytes received from the other machine"
    );
    println!("{}", lab.kubectl_get("deployruns,sites").unwrap());
}
