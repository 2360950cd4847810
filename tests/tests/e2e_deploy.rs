//! Deploy end to end, under TCG (docs/deploy.md, "6. What the VM tests show"):
//! the test OS (tests/src/testos.rs: a GPT image with the OS loader only under
//! `\EFI\anneal\`, swap, an ext4 root with a marker) is imported through an
//! ImageImport from an HTTP server, the lab's VM (OVMF, PXE through bootd, the
//! agent in our initramfs) is inspected, claimed and deployed: the agent
//! streams the contents from the content server into the disk, runs the
//! default hook (mkswap, install-removable-fallback, efibootmgr) and reboots;
//! OVMF boots the load option the agent wrote (first in BootOrder; the only
//! anneal entry in the VARS store) and the test OS prints the marker's SHA-256
//! and the Machine's name. The Machine is Provisioned.
//!
//! The same VM then goes through the rest of a machine's life
//! (fast-track): the first claim is bound inside the
//! manager's fast-track window, so it deploys without a new PXE boot; the
//! deployed VM is power-cycled through the BMC (`anneal.dev/reboot`) and
//! boots its disk again, with no DHCP DISCOVER reaching bootd after the
//! deploy; the claim is released under `Retain` (Released, the disk's GPT
//! untouched), the machine re-inspected (Available), claimed again once its
//! agent was powered off (a cold deploy: power-on through the BMC, PXE,
//! agent), and released under `Recycle`: the agent wipes the disk (no GPT at
//! either end, no filesystem signature where the partitions were) and the
//! Machine returns to Available.
//!
//! `kubectl anneal watch MACHINE` runs in a real terminal (tmux) from the
//! first claim on: its bar moves during the deploy and it ends with a table
//! that shows the run Succeeded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_tests::disks::{gpt_partitions, probe};
use anneal_tests::e2e::{self, Lab, LabOptions, MACHINE};

/// The lab manager's fast-track window.
const FAST_TRACK: Duration = Duration::from_secs(45);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_vm_is_deployed_and_boots_its_disk() {
    let os = tokio::task::spawn_blocking(anneal_tests::testos::test_os);
    let plugin = tokio::task::spawn_blocking(anneal_tests::artifacts::kubectl_anneal);
    let mut lab = Lab::start_with(
        &|s| println!("e2e-deploy: {s}"),
        LabOptions {
            deploy: true,
            fast_track_window: Some(FAST_TRACK),
            ..LabOptions::default()
        },
    )
    .await
    .unwrap();
    let os = os.await.unwrap().unwrap();
    let t = Instant::now();
    let _server = lab
        .serve_and_import(&[("testos", &os.image, true)], Duration::from_secs(900))
        .await
        .unwrap();
    println!("e2e-deploy: imported in {:.1} s", t.elapsed().as_secs_f64());
    lab.boot_until_available("e2e-deploy", Duration::from_secs(600))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut log = e2e::print_states("e2e-deploy");
    // Claimed inside the fast-track window: the agent that inspected the
    // machine gets the plan from its next long-poll, no PXE boot.
    let discovers = lab.dhcp_discovers();
    let fast = Instant::now();
    lab.claim(
        "deploy",
        "testos",
        e2e::DEPLOY_DISKS[0].1,
        serde_json::json!({}),
    )
    .await
    .unwrap();
    // `kubectl anneal watch` in a terminal from the claim on; the screen is
    // sampled while the deploy runs, one capture kept per (phase, percent).
    let plugin = plugin.await.unwrap();
    let term = tempfile::tempdir().unwrap();
    let tmux = anneal_testinfra::Tmux::start(
        term.path(),
        &format!(
            "{} --kubeconfig {} -n {} watch {MACHINE}; echo \"watch exited $?\"; echo WATCH-DONE; exec sleep 3600",
            plugin.display(),
            lab.cp.kubeconfig_path().display(),
            e2e::NAMESPACE
        ),
    )
    .unwrap();
    let mut screens: std::collections::BTreeMap<(String, u32), String> = Default::default();
    {
        let provisioned = lab.wait_state("Provisioned", Duration::from_secs(1500), &mut log);
        tokio::pin!(provisioned);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                r = &mut provisioned => {
                    r.unwrap_or_else(|e| panic!("{e:#}"));
                    break;
                }
                _ = tick.tick() => {
                    let s = tmux.capture();
                    if let Some(key) = watch_bar(&s) {
                        screens.entry(key).or_insert(s);
                    }
                }
            }
        }
    }
    let last = tmux
        .until("WATCH-DONE", Duration::from_secs(120))
        .await
        .unwrap();
    println!(
        "e2e-deploy: watch showed {:?}",
        screens.keys().collect::<Vec<_>>()
    );
    let (key, mid) = screens
        .iter()
        .filter(|((_, p), _)| *p < 100)
        // The capture nearest half-way through writing, for the record.
        .min_by_key(|((phase, p), _)| (phase != "WritingContent", p.abs_diff(50)))
        .unwrap_or_else(|| panic!("no capture of the run in progress; final screen:\n{last}"));
    println!("e2e-deploy: watch mid-deploy ({key:?}):\n{mid}");
    println!("e2e-deploy: watch at the end:\n{last}");
    assert!(last.contains("watch exited 0"), "{last}");
    // The bar moved: the same line, redrawn in place, from the mid-deploy
    // percent to 100 %.
    let end = watch_bar(&last).unwrap_or_else(|| panic!("no bar at the end:\n{last}"));
    assert_eq!(end, ("Succeeded".to_string(), 100), "{last}");
    assert!(key.1 < end.1, "the bar moved from {key:?} to {end:?}");
    assert_eq!(
        last.lines()
            .filter(|l| l.starts_with(MACHINE) && l.contains('['))
            .count(),
        1,
        "one bar, redrawn in place:\n{last}"
    );
    // The summary table: a row of the run, Succeeded at 100 %.
    assert!(
        last.lines()
            .any(|l| l.starts_with("MACHINE") && l.contains("RESULT")),
        "{last}"
    );
    let row = last
        .lines()
        .find(|l| {
            l.starts_with(&format!("{MACHINE} ")) && !l.contains('[') && l.contains("Succeeded")
        })
        .unwrap_or_else(|| panic!("no table row of {MACHINE}:\n{last}"));
    assert!(row.contains("100%"), "{row}");
    drop(tmux);
    lab.wait_deployed_os(&os.marker_sha256).await.unwrap();
    let marker = format!("ANNEAL-MARKER {}", os.marker_sha256);
    let fast_secs = fast.elapsed().as_secs_f64();
    println!("e2e-deploy: fast-track claim → deployed OS marker in {fast_secs:.1} s");
    assert_eq!(
        lab.dhcp_discovers(),
        discovers,
        "a fast-track deploy and the reboot into the deployed OS send no DHCP DISCOVER"
    );
    assert_eq!(lab.anneal_boot_entry().unwrap(), r"\EFI\BOOT\BOOTX64.EFI");
    println!("{}", lab.kubectl_get_machines().unwrap());
    // `kubectl get` columns as the real API server renders them.
    let client = lab.cp.client();
    let row = |t: &serde_json::Value, name: &str| {
        anneal_testinfra::table_row_named(t, name)
            .unwrap_or_else(|| panic!("no row {name}: {t}"))
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let m = row(
        &anneal_testinfra::get_table(&client, e2e::NAMESPACE, "machines")
            .await
            .unwrap(),
        MACHINE,
    );
    assert_eq!(
        (&m["State"], &m["Claim"], &m["Image"], &m["Operational"]),
        (
            &serde_json::json!("Provisioned"),
            &serde_json::json!("deploy"),
            &serde_json::json!("testos"),
            &serde_json::json!("OK")
        ),
        "{m:?}"
    );
    let imp = row(
        &anneal_testinfra::get_table(&client, e2e::NAMESPACE, "imageimports")
            .await
            .unwrap(),
        "testos",
    );
    assert_eq!(
        (&imp["State"], &imp["Image"], &imp["Progress"]),
        (
            &serde_json::json!("Succeeded"),
            &serde_json::json!("testos"),
            &serde_json::json!(100)
        ),
        "{imp:?}"
    );
    // The run's story: phase timings and the agent's deploy lines.
    let runs: kube::Api<anneal_api::DeployRun> =
        kube::Api::namespaced(lab.cp.client(), e2e::NAMESPACE);
    let run_table = anneal_testinfra::get_table(&client, e2e::NAMESPACE, "deployruns")
        .await
        .unwrap();
    for r in runs.list(&Default::default()).await.unwrap().items {
        let cells = row(&run_table, &kube::ResourceExt::name_any(&r));
        assert_eq!(
            (&cells["Machine"], &cells["Phase"], &cells["Percent"]),
            (
                &serde_json::json!(MACHINE),
                &serde_json::json!("Succeeded"),
                &serde_json::json!(100)
            ),
            "{cells:?}"
        );
        let st = r.status.clone().unwrap_or_default();
        println!(
            "e2e-deploy: run {} phase {:?}, {} MiB/s last",
            kube::ResourceExt::name_any(&r),
            st.phase,
            st.throughput_mib_ps.unwrap_or_default()
        );
        for t in &st.phase_timings {
            let secs = match (&t.start, &t.end) {
                (Some(a), Some(b)) => b.0.duration_since(a.0).as_secs_f64(),
                _ => f64::NAN,
            };
            println!("e2e-deploy:   {:<16} {secs:>7.1} s", t.phase);
        }
    }
    for line in lab.console().lines().filter(|l| {
        l.contains("anneal:")
            && (l.contains("deploy")
                || l.contains("hook")
                || l.contains("step")
                || l.contains("MiB"))
    }) {
        println!("e2e-deploy: console: {}", line.trim_end());
    }
    // Power-cycled through the BMC: the disk boots again, never PXE.
    let disk = lab.disk_path(e2e::DEPLOY_DISKS[0].1);
    lab.patch_machine(serde_json::json!({"metadata": {"annotations": {
        "anneal.dev/reboot": "{\"mode\":\"hard\"}"}}}))
        .await
        .unwrap();
    lab.wait_console(&marker, 2, Duration::from_secs(300))
        .await
        .unwrap();
    assert_eq!(
        lab.dhcp_discovers(),
        discovers,
        "the power-cycled machine booted its disk without DHCP"
    );
    println!("e2e-deploy: power-cycled through the BMC, booted its disk again");

    // Retain: Released, the disk untouched.
    let deployed = gpt_partitions(&disk).expect("the deployed disk has a GPT");
    assert!(deployed.len() >= 3, "{deployed:?}");
    let head = std::fs::read(&disk)
        .map(|b| b[..34 * 512].to_vec())
        .unwrap();
    let released_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    lab.delete_claim("deploy").await.unwrap();
    lab.wait_state("Released", Duration::from_secs(1800), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    // ...and left off with no boot override (docs/troubleshooting.md,
    // "Released"): the manager shuts down a released server that is on (the
    // test OS powers itself off once its markers are printed, so here it is
    // usually off already); the Machine says so
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let system = lab.bmc_system().unwrap();
        let machines: kube::Api<anneal_api::Machine> =
            kube::Api::namespaced(lab.cp.client(), e2e::NAMESPACE);
        let m = machines.get(e2e::MACHINE).await.unwrap();
        let said = m.status.as_ref().is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == "Progressing"
                    && c.reason == "Released"
                    && c.message.contains("powered off")
            })
        });
        if said
            && system["PowerState"] == "Off"
            && system["Boot"]["BootSourceOverrideEnabled"] == "Disabled"
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a Retain release left the server {} with override {} (Machine says powered off: {said}); BMC log since: {:?}",
            system["PowerState"],
            system["Boot"]["BootSourceOverrideEnabled"],
            lab.bmc_requests()
                .into_iter()
                .filter(|r| r.ts_ms >= released_at && r.method != "GET")
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let after = std::fs::read(&disk)
        .map(|b| b[..34 * 512].to_vec())
        .unwrap();
    assert!(head == after, "Retain left the partition table as it was");
    assert_eq!(gpt_partitions(&disk), Some(deployed.clone()));
    println!("e2e-deploy: released under Retain, disk untouched");

    // Re-inspected, then claimed once the fast-track window has passed
    // (the agent powered off): a cold deploy.
    lab.patch_machine(serde_json::json!({
        "metadata": {"annotations": {"anneal.dev/re-inspect": ""}},
        "spec": {"reclaimPolicy": "Recycle"}}))
        .await
        .unwrap();
    lab.wait_state("Inspecting", Duration::from_secs(1800), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    lab.wait_state("Available", Duration::from_secs(1800), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let deadline = Instant::now() + FAST_TRACK + Duration::from_secs(120);
    while lab.powered_on().await.unwrap() != Some(false) {
        assert!(
            Instant::now() < deadline,
            "the idle agent was not powered off after the fast-track window"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let cold = Instant::now();
    lab.claim(
        "deploy-2",
        "testos",
        e2e::DEPLOY_DISKS[0].1,
        serde_json::json!({}),
    )
    .await
    .unwrap();
    lab.wait_state("Provisioned", Duration::from_secs(1800), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    lab.wait_console(&marker, 3, Duration::from_secs(600))
        .await
        .unwrap();
    let cold_secs = cold.elapsed().as_secs_f64();
    println!(
        "e2e-deploy: cold claim (power-on) → deployed OS marker in {cold_secs:.1} s; \
         fast-track saved {:.1} s",
        cold_secs - fast_secs
    );

    // Recycle: the agent wipes the disk, the Machine is Available again.
    let deployed = gpt_partitions(&disk).expect("the redeployed disk has a GPT");
    let signed = deployed
        .iter()
        .filter(|(first, _)| !probe(&disk, *first).is_empty())
        .count();
    assert!(
        signed >= 3,
        "the deployed ESP, swap and root carry signatures before the wipe: {deployed:?}"
    );
    lab.delete_claim("deploy-2").await.unwrap();
    lab.wait_state("Deprovisioning", Duration::from_secs(1800), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    lab.wait_state("Available", Duration::from_secs(1800), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        gpt_partitions(&disk),
        None,
        "no GPT at either end after the wipe"
    );
    for (first, _) in &deployed {
        let found = probe(&disk, *first);
        assert!(
            found.is_empty(),
            "a signature survived the wipe at byte {first}: {found}"
        );
    }
    println!("e2e-deploy: released under Recycle, disk wiped, Available");
    println!("{}", lab.kubectl_get_machines().unwrap());
}

/// (phase, percent) of the watch's bar line on `screen`, if one shows.
fn watch_bar(screen: &str) -> Option<(String, u32)> {
    let line = screen
        .lines()
        .find(|l| l.starts_with(MACHINE) && l.contains('[') && l.contains('%'))?;
    let mut words = line.split_whitespace();
    let phase = words.nth(2)?.to_string();
    let pct = line
        .split(']')
        .nth(1)?
        .trim_start()
        .split('%')
        .next()?
        .trim();
    Some((phase, pct.parse().ok()?))
}
