//! Distribution in the manager (docs/distribution.md, "The manager: trackers,
//! seeders, the Site"), against a real kube-apiserver and the process
//! executor: a Site with a pinned tracker gets its tracker (`anneal-agent
//! tracker` on the Site's `spec.tracker.ip`) and `status.trackerURL`,
//! `status.subnetRefs`; an active DeployRun of an Image on a Machine of the
//! Site starts the seeder of (Image, Site), which announces the Image's
//! contents to the tracker; PartitionContent `status.seeders` counts the
//! machines deploying; the plan's swarm names the tracker; once the run has
//! ended and the grace period is over the seeder is stopped and
//! `status.seeders` emptied. The Image's SeederDegraded follows its seeder:
//! serving, ended (and restarted) with the reason, serving again, none
//! running.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use anneal_api::{DeployRun, Image, Machine, PartitionContent, Site, Subnet};
use anneal_manager::swarm::SwarmConfig;
use anneal_manager::workload::{Executor, Phase, process::ProcessExecutor};
use anneal_testinfra::ControlPlane;
use anneal_tests::wait::eventually;
use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const NS: &str = "rack";

async fn create<K>(client: &Client, obj: Value) -> K
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + k8s_openapi::serde::de::DeserializeOwned
        + k8s_openapi::serde::Serialize,
    K::DynamicType: Default,
{
    let o: K = serde_json::from_value(obj).unwrap();
    Api::<K>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &o)
        .await
        .unwrap()
}

async fn status<K>(client: &Client, name: &str, status: Value)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + k8s_openapi::serde::de::DeserializeOwned,
    K::DynamicType: Default,
{
    Api::<K>::namespaced(client.clone(), NS)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": status })),
        )
        .await
        .unwrap();
}

/// The tracker's answer to an announce of `info_hash` (20 bytes) as a
/// seeder on port 1, as text.
fn announce(port: u16, info_hash: &[u8; 20]) -> String {
    let enc: String = info_hash.iter().map(|b| format!("%{b:02x}")).collect();
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5"])
        .arg(format!(
            "http://127.0.0.1:{port}/announce?info_hash={enc}&peer_id=-XX0000-000000000000&port=1&uploaded=0&downloaded=0&left=0&compact=1"
        ))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The ports of the peers the tracker hands to a leecher of `info_hash`
/// (its compact peer list, BEP 23).
fn announced_ports(port: u16, info_hash: &str) -> Vec<u16> {
    let raw = hex::decode(info_hash).unwrap();
    let enc: String = raw.iter().map(|b| format!("%{b:02x}")).collect();
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5"])
        .arg(format!(
            "http://127.0.0.1:{port}/announce?info_hash={enc}&peer_id=-XX0000-111111111111&port=2&uploaded=0&downloaded=0&left=1&compact=1"
        ))
        .output()
        .unwrap();
    let body = out.stdout;
    let at = body
        .windows(7)
        .position(|w| w == b"5:peers")
        .unwrap_or_else(|| panic!("no peers in {}", String::from_utf8_lossy(&body)))
        + 7;
    let colon = at + body[at..].iter().position(|b| *b == b':').unwrap();
    let len: usize = std::str::from_utf8(&body[at..colon])
        .unwrap()
        .parse()
        .unwrap();
    body[colon + 1..colon + 1 + len]
        .chunks(6)
        .map(|p| u16::from_be_bytes([p[4], p[5]]))
        .collect()
}

/// The tracker's `/stats`, or None while it does not answer.
fn tracker_stats(port: u16) -> Option<Value> {
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5"])
        .arg(format!("http://127.0.0.1:{port}/stats"))
        .output()
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_runs_its_tracker_and_seeds_while_it_deploys() {
    // A content in the store: the root partition of a small GPT disk.
    let agent = tokio::task::spawn_blocking(anneal_tests::artifacts::agent_host)
        .await
        .unwrap();
    let work = tempfile::tempdir().unwrap();
    let disk = anneal_tests::images::gpt_disk(work.path(), 96, 4);
    let cap = work.path().join("cap");
    let st = Command::new(&agent)
        .arg("capture")
        .arg(&disk)
        .arg("--out")
        .arg(&cap)
        .args(["--piece-length", "262144"])
        .status()
        .unwrap();
    assert!(st.success());
    let store = work.path().join("store");
    let dir = store.join(NS).join("root");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(cap.join("p3.index"), dir.join("index")).unwrap();
    std::fs::copy(cap.join("p3.stream"), dir.join("stream")).unwrap();
    // Verified as the publishing workload does: the `verified` marker is
    // what the Site's tracker allows.
    let st = Command::new(&agent)
        .args(["store", "verify", "--store"])
        .arg(&store)
        .args(["--namespace", NS, "--content", "root"])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    let index =
        anneal_image::format::ContentIndex::parse(&std::fs::read(dir.join("index")).unwrap())
            .unwrap();
    let info_hash =
        anneal_image::torrent::Metainfo::from_index(&index, "root", None).info_hash_hex();

    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();

    let _: Site = create(
        &client,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Site",
            "metadata": {"name": "rack1", "namespace": NS},
            "spec": {"seederSubnetRef": {"name": "prov"}, "tracker": {"ip": "127.0.0.1"}}}),
    )
    .await;
    let _: Subnet = create(
        &client,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "prov", "namespace": NS},
            "spec": {"siteRef": {"name": "rack1"}, "cidr": "10.77.0.0/24",
                "bootd": {"serverIP": "10.77.0.1", "mode": "External"},
                "dhcp": {"mode": "proxy"}}}),
    )
    .await;
    let m: Machine = create(
        &client,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "node1", "namespace": NS},
            "spec": {"subnetRef": {"name": "prov"}}}),
    )
    .await;
    let _: PartitionContent = create(
        &client,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "PartitionContent",
            "metadata": {"name": "root", "namespace": NS},
            "spec": {"fsType": "ext4", "usedBytes": index.header.used_bytes,
                "sizeBytes": 16 << 20, "lastExtentEnd": 16 << 20, "blockSize": 4096,
                "pieceLength": 262_144}}),
    )
    .await;
    status::<PartitionContent>(
        &client,
        "root",
        json!({"state": "Ready", "infoHash": info_hash}),
    )
    .await;
    let _: Image = create(
        &client,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Image",
            "metadata": {"name": "debian", "namespace": NS},
            "spec": {"osFamily": "Linux", "bootable": false, "layout": {"partitionTable": "gpt",
                "slots": [{"number": 1, "role": "data", "contentRef": {"name": "root"}}]}}}),
    )
    .await;

    let tracker_port = anneal_testinfra::free_port().unwrap();
    let cfg = SwarmConfig {
        tracker_port,
        tracker_interval_secs: 1,
        seeder_grace_secs: 3,
        ..SwarmConfig::default()
    };
    let cancel = tokio_util::sync::CancellationToken::new();
    let scope = anneal_manager::controller::Scope::standalone(client.clone(), cancel.clone());
    let executor = Executor::Process(ProcessExecutor::new(
        agent.parent().unwrap().to_path_buf(),
        &store,
    ));
    let observer = executor.clone();
    let controller = tokio::spawn(anneal_manager::swarm::controller(
        scope,
        executor,
        cfg.clone(),
    ));

    // The Site: its Subnet, its tracker's URL, the tracker answering.
    let sites: Api<Site> = Api::namespaced(client.clone(), NS);
    let url = format!("http://127.0.0.1:{tracker_port}/announce");
    let s = eventually("the Site's status", Duration::from_secs(60), || async {
        let s = sites.get("rack1").await.ok()?;
        let st = s.status.clone()?;
        (st.tracker_url.as_deref() == Some(url.as_str()) && st.seeder_ready == Some(true))
            .then_some(st)
    })
    .await;
    assert_eq!(
        s.subnet_refs
            .iter()
            .map(|r| r.name.as_str())
            .collect::<Vec<_>>(),
        ["prov"]
    );
    let stats = eventually("the tracker", Duration::from_secs(60), || async {
        tracker_stats(tracker_port)
    })
    .await;
    assert_eq!(stats["torrents"], json!([]), "{stats}");
    // It tracks the store's verified contents only: not an open tracker.
    let refused = announce(tracker_port, &[0x5a; 20]);
    assert!(
        refused.contains("failure reason") && refused.contains("is not tracked here"),
        "{refused}"
    );

    // The plan of a Machine of the Site names the tracker.
    let inputs = anneal_manager::swarm::plan_inputs(&client, &m, &cfg)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(inputs.trackers, std::slice::from_ref(&url));
    assert_eq!(inputs.seeder_hosts, ["127.0.0.1"]);

    // An active run of the Image: its seeder announces the content.
    let _: DeployRun = create(
        &client,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": "node1-run-1", "namespace": NS},
            "spec": {"machineRef": {"name": "node1"}, "claimRef": {"name": "c1"},
                "imageRef": {"name": "debian"}}}),
    )
    .await;
    status::<DeployRun>(&client, "node1-run-1", json!({"phase": "WritingContent"})).await;
    let stats = eventually(
        "the seeder's announce",
        Duration::from_secs(120),
        || async {
            let s = tracker_stats(tracker_port)?;
            s["torrents"]
                .as_array()?
                .iter()
                .any(|t| t["infoHash"] == info_hash.as_str() && t["seeders"] == 1)
                .then_some(s)
        },
    )
    .await;
    println!("tracker: {stats}");
    let contents: Api<PartitionContent> = Api::namespaced(client.clone(), NS);
    eventually("status.seeders", Duration::from_secs(60), || async {
        let c = contents.get("root").await.ok()?;
        let s = c.status?.seeders;
        (s.len() == 1 && s[0].site == "rack1" && s[0].machines == 1).then_some(())
    })
    .await;
    eventually(
        "the Site ready with its seeder",
        Duration::from_secs(60),
        || async {
            let s = sites.get("rack1").await.ok()?.status?;
            (s.seeder_ready == Some(true)).then_some(())
        },
    )
    .await;

    // The Image tells whether its seeders serve (SeederDegraded).
    let images: Api<Image> = Api::namespaced(client.clone(), NS);
    let seeder_degraded = |want: &'static str, reason: &'static str| {
        let images = images.clone();
        async move {
            eventually(
                &format!("Image SeederDegraded={want} {reason}"),
                Duration::from_secs(60),
                || async {
                    let i = images.get("debian").await.ok()?;
                    i.status?.conditions.into_iter().find(|c| {
                        c.type_ == "SeederDegraded" && c.status == want && c.reason == reason
                    })
                },
            )
            .await
        }
    };
    let c = seeder_degraded("False", "SeedersServing").await;
    assert!(c.message.contains("rack1"), "{}", c.message);
    let image = images.get("debian").await.unwrap();
    let site = sites.get("rack1").await.unwrap();
    let seeder = anneal_manager::swarm::seeder_spec(&image, &site, &["root".into()], &cfg).unwrap();
    // It listens on port 0 of its address and announces the port it got.
    let seen = observer.observe(&seeder).await.unwrap();
    let addr: std::net::SocketAddr = seen.progress.as_ref().unwrap()["addr"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(announced_ports(tracker_port, &info_hash), [addr.port()]);
    // The seeder dies and cannot come back (its content's
    // index is gone from the store): the Image says which seeder, where
    // and why.
    std::fs::rename(dir.join("index"), dir.join("index.away")).unwrap();
    observer.remove(&seeder).await.unwrap();
    let c = seeder_degraded("True", "SeederFailed").await;
    assert!(
        c.message.contains(&seeder.name)
            && c.message.contains("Site rack1")
            && c.message.contains("index"),
        "{}",
        c.message
    );
    // The store is repaired: the restarted seeder serves again.
    std::fs::rename(dir.join("index.away"), dir.join("index")).unwrap();
    seeder_degraded("False", "SeedersServing").await;

    // The run ends: after the grace period the seeder stops (it leaves the
    // tracker's table when its announce expires; status.seeders empties).
    let now = k8s_openapi::jiff::Timestamp::now();
    status::<DeployRun>(
        &client,
        "node1-run-1",
        json!({"phase": "Succeeded", "phaseTimings": [{"phase": "WritingContent",
            "start": now.to_string(), "end": now.to_string()}]}),
    )
    .await;
    eventually(
        "status.seeders emptied",
        Duration::from_secs(60),
        || async {
            let c = contents.get("root").await.ok()?;
            c.status?.seeders.is_empty().then_some(())
        },
    )
    .await;
    eventually("the seeder to stop", Duration::from_secs(60), || async {
        let o = observer.observe(&seeder).await.ok()?;
        (o.phase == Phase::Absent).then_some(())
    })
    .await;

    seeder_degraded("False", "NoActiveDeploy").await;

    cancel.cancel();
    controller.await.unwrap();
    // The tracker went with the controller's term (process executor).
    eventually("the tracker to stop", Duration::from_secs(30), || async {
        tracker_stats(tracker_port).is_none().then_some(())
    })
    .await;
}
