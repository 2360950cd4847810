//! Deploy end to end, under TCG (issue 13, first acceptance line): the test
//! OS (tests/src/testos.rs: a GPT image with the OS loader only under
//! `\EFI\anneal\`, swap, an ext4 root with a marker) is imported through an
//! ImageImport from an HTTP server, the lab's VM (OVMF, PXE through bootd,
//! the agent in our initramfs) is inspected, claimed and deployed: the agent
//! streams the contents from the content server into the disk, runs the
//! default hook (mkswap, install-removable-fallback, efibootmgr) and reboots;
//! OVMF boots the load option the agent wrote (first in BootOrder; the only
//! anneal entry in the VARS store) and the test OS prints the marker's
//! SHA-256 and the Machine's name. The Machine is Provisioned.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use anneal_tests::e2e::{self, Lab, LabOptions, MACHINE, Progress};
use anneal_tests::images::{FileServer, sha256_file};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_vm_is_deployed_and_boots_its_disk() {
    let os = tokio::task::spawn_blocking(anneal_tests::testos::test_os);
    let mut lab = Lab::start_with(
        &|s| println!("e2e-deploy: {s}"),
        LabOptions { deploy: true },
    )
    .await
    .unwrap();
    let os = os.await.unwrap().unwrap();
    let src = lab.dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::copy(&os.image, src.join("testos.raw")).unwrap();
    let sum = sha256_file(&src.join("testos.raw"));
    let server = FileServer::start(&src, None);
    let t = Instant::now();
    lab.import(
        "testos",
        &server.url("testos.raw"),
        &sum,
        Duration::from_secs(900),
    )
    .await
    .unwrap();
    println!("e2e-deploy: imported in {:.1} s", t.elapsed().as_secs_f64());

    lab.launch_vm().await.unwrap();
    lab.enrol().await.unwrap();
    let mut log = |p: Progress<'_>| {
        if let Progress::State(s, t) = p {
            println!("e2e-deploy: state {s:?} at {:.1} s", t.as_secs_f64());
        }
    };
    lab.wait_available(Duration::from_secs(600), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let power_on = Instant::now();
    lab.claim(
        "deploy",
        "testos",
        e2e::DEPLOY_DISKS[0].1,
        serde_json::json!({}),
    )
    .await
    .unwrap();
    lab.wait_state("Provisioned", Duration::from_secs(1500), &mut log)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let marker = format!("ANNEAL-MARKER {}", os.marker_sha256);
    let name = format!("ANNEAL-DEPLOYED {MACHINE}");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let console = lab.console();
        if console.contains(&marker) && console.contains(&name) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the deployed OS did not print {marker:?} and {name:?}; console tail:\n{}",
            e2e::tail(&console, 60)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!(
        "e2e-deploy: claim → deployed OS marker in {:.1} s",
        power_on.elapsed().as_secs_f64()
    );
    let vars = std::fs::read(lab.vm.as_ref().unwrap().vars_path()).unwrap();
    let (entries, order) = anneal_tests::ovmf::boot_entries(&vars).unwrap();
    let ours: Vec<_> = entries
        .iter()
        .filter(|e| e.description.starts_with("anneal"))
        .collect();
    assert_eq!(ours.len(), 1, "exactly one anneal entry: {entries:?}");
    assert_eq!(
        order.first(),
        Some(&ours[0].number),
        "first in BootOrder: {order:?}"
    );
    assert_eq!(
        ours[0]
            .file
            .as_deref()
            .map(str::to_ascii_uppercase)
            .as_deref(),
        Some(r"\EFI\BOOT\BOOTX64.EFI")
    );
    println!("{}", lab.kubectl_get_machines().unwrap());
    // The run's story: phase timings and the agent's deploy lines.
    let runs: kube::Api<anneal_api::DeployRun> =
        kube::Api::namespaced(lab.cp.client(), e2e::NAMESPACE);
    for r in runs.list(&Default::default()).await.unwrap().items {
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
}
