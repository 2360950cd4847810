//! Images into the cluster, against a real API server with the `process`
//! executor: ImageImports of a raw GPT disk (and the same disk as qcow2)
//! served over HTTP on loopback reach Succeeded; the Image and the
//! PartitionContents are Ready and match what `anneal-agent capture` makes
//! of the same file; the content server serves the verified streams
//! byte-identical to the local capture; refusals (checksum mismatch, 404, a
//! taken name) fail with their reason and a Warning Event and create
//! nothing; a referenced content cannot be deleted until its Image is.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anneal_api::conditions::types;
use anneal_api::{
    ContentState, Image, ImageImport, ImageState, ImportState, PartitionContent, SlotRole,
};
use anneal_image::format::ContentIndex;
use anneal_manager::content::ContentConfig;
use anneal_manager::content::upload::UploadConfig;
use anneal_manager::workload::{Executor, process::ProcessExecutor};
use anneal_testinfra::ControlPlane;
use anneal_tests::images::{
    FileServer, SWAP_UUID, clonezilla_of, gpt_disk, partclone_of_root, sha256_file,
};
use anneal_tests::{artifacts, eventually};
use k8s_openapi::api::core::v1::{Event, Namespace, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "images";
const WAIT: Duration = Duration::from_secs(180);

async fn create_import(client: &Client, name: &str, spec: serde_json::Value) {
    let api: Api<ImageImport> = Api::namespaced(client.clone(), NS);
    let imp: ImageImport = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap();
    api.create(&PostParams::default(), &imp).await.unwrap();
}

/// The content once its verify workload made it Ready (an import's
/// Succeeded means its objects exist, not that they are verified).
async fn content_ready(contents: &Api<PartitionContent>, name: &str) -> PartitionContent {
    eventually(&format!("{name} Ready"), WAIT, || async move {
        let pc = contents.get(name).await.ok()?;
        (pc.status.as_ref().and_then(|s| s.state) == Some(ContentState::Ready)).then_some(pc)
    })
    .await
}

async fn finished(client: &Client, name: &str) -> ImageImport {
    anneal_tests::uploads::import_finished(client, NS, name).await
}

fn condition(i: &ImageImport, type_: &str) -> (String, String, String) {
    let c = i
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .unwrap_or_else(|| panic!("{} has no {type_} condition: {:?}", i.name_any(), i.status));
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

async fn warning_events(client: &Client, object: &str) -> Vec<(String, String)> {
    let api: Api<Event> = Api::namespaced(client.clone(), NS);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(object))
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
        .collect()
}

/// A failed import: its reason, message naming `needle`, a Warning Event,
/// and no Image or content of its names.
async fn assert_refused(
    client: &Client,
    name: &str,
    reason: &str,
    needle: &str,
    image: &str,
    prefix: &str,
) {
    let i = finished(client, name).await;
    assert_eq!(
        i.status.as_ref().and_then(|s| s.state),
        Some(ImportState::Failed),
        "{name}: {:?}",
        i.status
    );
    let (status, r, message) = condition(&i, types::SUCCEEDED);
    assert_eq!(
        (status.as_str(), r.as_str()),
        ("False", reason),
        "{name}: {message}"
    );
    assert!(
        message.contains(needle),
        "{name}: message {message:?} lacks {needle:?}"
    );
    let events = eventually(&format!("a Warning Event for {name}"), WAIT, || async {
        let ev = warning_events(client, name).await;
        ev.iter().any(|(r, _)| r == reason).then_some(ev)
    })
    .await;
    assert!(events.iter().any(|(_, m)| m.contains(needle)), "{events:?}");
    let images: Api<Image> = Api::namespaced(client.clone(), NS);
    assert!(
        images.get_opt(image).await.unwrap().is_none(),
        "{name} created Image {image}"
    );
    let contents: Api<PartitionContent> = Api::namespaced(client.clone(), NS);
    let made: Vec<String> = contents
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(ResourceExt::name_any)
        .filter(|n| n.starts_with(&format!("{prefix}-p")))
        .collect();
    assert!(made.is_empty(), "{name} created contents {made:?}");
}

/// `anneal-agent capture` of `disk` into `out`; the index of each content.
fn capture(agent: &Path, disk: &Path, out: &Path) -> serde_json::Value {
    capture_with(agent, disk, out, &[]);
    serde_json::from_slice(&std::fs::read(out.join("layout.json")).unwrap()).unwrap()
}

fn capture_with(agent: &Path, src: &Path, out: &Path, args: &[&str]) {
    let o = Command::new(agent)
        .arg("capture")
        .arg(src)
        .arg("--out")
        .arg(out)
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn index(path: &Path) -> ContentIndex {
    ContentIndex::parse(&std::fs::read(path).unwrap()).unwrap()
}

/// A content from `status` and `spec` equals the local capture's index.
fn assert_matches_capture(pc: &PartitionContent, idx: &ContentIndex) {
    let h = &idx.header;
    let s = &pc.spec;
    assert_eq!(
        s.used_bytes,
        h.used_bytes as i64,
        "{} usedBytes",
        pc.name_any()
    );
    assert_eq!(
        s.size_bytes,
        h.partition_size as i64,
        "{} sizeBytes",
        pc.name_any()
    );
    assert_eq!(
        s.last_extent_end,
        h.last_extent_end as i64,
        "{} lastExtentEnd",
        pc.name_any()
    );
    assert_eq!(
        s.block_size,
        i64::from(h.block_size),
        "{} blockSize",
        pc.name_any()
    );
    assert_eq!(
        s.piece_length,
        i64::from(h.piece_length),
        "{} pieceLength",
        pc.name_any()
    );
    assert_eq!(
        s.fs_type.as_deref(),
        Some(h.fs_type.as_str()),
        "{} fsType",
        pc.name_any()
    );
    let status = pc.status.as_ref().unwrap();
    assert_eq!(status.state, Some(ContentState::Ready), "{}", pc.name_any());
    assert_eq!(
        status.sha256.as_deref(),
        Some(hex(&h.stream_sha256).as_str()),
        "{} sha256 of the stream",
        pc.name_any()
    );
    assert_eq!(
        status.info_hash,
        Some(
            anneal_image::torrent::Metainfo::from_index(idx, &pc.name_any(), None).info_hash_hex()
        ),
        "{} infoHash: the torrent made from the capture's index",
        pc.name_any()
    );
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imports_reach_ready_contents_and_refusals_create_nothing() {
    let agent = artifacts::agent_host();
    let base = Path::new("/var/tmp/anneal-test");
    std::fs::create_dir_all(base).unwrap();
    let work = tempfile::tempdir_in(base).unwrap();
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let store = work.path().join("store");

    // A 256 MiB GPT disk with 96 MiB of file data, its qcow2, their sums.
    let disk = gpt_disk(&src, 256, 96);
    let qcow = src.join("disk.qcow2");
    let o = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&disk)
        .arg(&qcow)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let raw_sum = sha256_file(&disk);
    let qcow_sum = sha256_file(&qcow);
    let local = work.path().join("local");
    let layout = capture(&agent, &disk, &local);
    let pcl = partclone_of_root(&src, &disk, 256);
    let local_pcl = work.path().join("local-pcl");
    capture_with(&agent, &pcl, &local_pcl, &["--format", "partclone"]);
    let (cz_dir, _cz_tar) = clonezilla_of(&src, &disk, 256);
    let local_cz = work.path().join("local-cz");
    capture_with(&agent, &cz_dir, &local_cz, &["--format", "clonezilla"]);
    let mut hostile = b"partclone-image\0".to_vec();
    hostile.extend(anneal_tests::images::noise(7, 4096));
    std::fs::write(src.join("hostile.pcl"), hostile).unwrap();
    let closed = anneal_testinfra::free_port().unwrap();
    // Larger than the manager's --max-source-bytes (300 MiB); sparse.
    std::fs::File::create(src.join("huge.raw"))
        .unwrap()
        .set_len(400 << 20)
        .unwrap();
    // An https server whose certificate a test CA signed (nobody trusts it
    // but a bundle holding that CA).
    let tls_port = anneal_testinfra::free_port().unwrap();
    let ca_pem = {
        let pki = anneal_testinfra::test_pki("images_import test ca").unwrap();
        std::fs::write(work.path().join("tls.crt"), &pki.leaf_pem).unwrap();
        std::fs::write(work.path().join("tls.key"), &pki.key_pem).unwrap();
        pki.ca_pem
    };
    let _tls_server = anneal_testinfra::ChildGroup::spawn(
        "openssl-s_server",
        Command::new("openssl")
            .args(["s_server", "-quiet", "-WWW", "-accept"])
            .arg(format!("127.0.0.1:{tls_port}"))
            .arg("-cert")
            .arg(work.path().join("tls.crt"))
            .arg("-key")
            .arg(work.path().join("tls.key"))
            .current_dir(&src)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null()),
    )
    .unwrap();

    // A slow source (48 MiB/s: the 256 MiB import takes about 5 s), so
    // progress is observable.
    let server = FileServer::start(&src, Some(48 << 20));

    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();

    let bin_dir = agent.parent().unwrap().to_path_buf();
    let content_port = anneal_testinfra::free_port().unwrap();
    let upload_port = anneal_testinfra::free_port().unwrap();
    let system: Namespace =
        serde_json::from_value(json!({"metadata": {"name": "anneal-system"}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &system)
        .await
        .unwrap();
    let runtime =
        anneal_manager::Runtime::new(client.clone(), anneal_manager::RunConfig::default())
            .with_content(ContentConfig {
                executor: Executor::Process(ProcessExecutor::new(bin_dir, &store)),
                store_name: "test-store".into(),
                max_source_bytes: Some(300 << 20),
                ingest_deadline_secs: 600,
                server_listen: Some(format!("127.0.0.1:{content_port}")),
                swarm: None,
                bootd: None,
                upload: Some(UploadConfig {
                    listen: format!("127.0.0.1:{upload_port}").parse().unwrap(),
                    store: store.clone(),
                    max_bytes: 1 << 30,
                    pki_namespace: "anneal-system".into(),
                    server_names: vec!["127.0.0.1".into()],
                }),
            });
    let shutdown = runtime.shutdown_token();
    let manager = tokio::spawn(runtime.run());

    // --- raw, with its checksum: Succeeded, progress seen at least twice.
    let imports: Api<ImageImport> = Api::namespaced(client.clone(), NS);
    create_import(
        &client,
        "deb-raw",
        json!({
            "source": {"url": server.url("disk.raw"), "checksum": format!("sha256:{raw_sum}")},
            "imageName": "deb", "contentPrefix": "deb",
        }),
    )
    .await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let raw = eventually("deb-raw finished, progress recorded", WAIT, || {
        let imports = imports.clone();
        let seen = seen.clone();
        async move {
            let i = imports.get("deb-raw").await.ok()?;
            let s = i.status.clone().unwrap_or_default();
            let mut seen = seen.lock().unwrap();
            if let Some(p) = &s.progress
                && s.state == Some(ImportState::Ingesting)
                && seen.last() != Some(&(p.bytes_done, p.bytes_captured))
            {
                seen.push((p.bytes_done, p.bytes_captured));
            }
            matches!(s.state, Some(ImportState::Succeeded | ImportState::Failed)).then_some(i)
        }
    })
    .await;
    let st = raw.status.clone().unwrap();
    assert_eq!(
        st.state,
        Some(ImportState::Succeeded),
        "{:?}",
        st.conditions
    );
    let seen = seen.lock().unwrap().clone();
    let moving: Vec<_> = seen.iter().filter(|(d, _)| *d > 0).collect();
    assert!(
        moving.len() >= 2,
        "fewer than two progress updates seen: {seen:?}"
    );
    let p = st.progress.unwrap();
    assert_eq!((p.percent, p.bytes_total), (100, 256 << 20), "{p:?}");
    assert_eq!(st.image_ref.as_ref().map(|r| r.name.as_str()), Some("deb"));
    let content_names: Vec<&str> = st.content_refs.iter().map(|r| r.name.as_str()).collect();
    // Swap has no content (mkswap recreates it with its UUID); the
    // unformatted partition is a raw content with nothing used.
    assert_eq!(content_names, ["deb-p1", "deb-p3", "deb-p4"]);

    // The Image: layout as the source, Ready once its contents are.
    let images: Api<Image> = Api::namespaced(client.clone(), NS);
    let image = eventually("Image deb Ready", WAIT, || {
        let images = images.clone();
        async move {
            let i = images.get("deb").await.ok()?;
            (i.status.as_ref().and_then(|s| s.state) == Some(ImageState::Ready)).then_some(i)
        }
    })
    .await;
    let slots = &image.spec.layout.slots;
    assert_eq!(slots.len(), 4, "{slots:?}");
    assert_eq!(slots[0].role, SlotRole::Esp);
    assert_eq!(slots[1].role, SlotRole::Swap);
    assert_eq!(slots[1].uuid.as_deref(), Some(SWAP_UUID));
    assert_eq!(slots[2].role, SlotRole::Data);
    assert_eq!(
        slots[3].content_ref.as_ref().map(|r| r.name.as_str()),
        Some("deb-p4")
    );
    for (slot, captured) in slots.iter().zip(layout["slots"].as_array().unwrap()) {
        assert_eq!(
            slot.size_bytes,
            captured["sizeBytes"].as_i64(),
            "slot {}",
            slot.number
        );
        assert_eq!(
            slot.part_uuid.as_deref().map(str::to_uppercase),
            captured["partUuid"].as_str().map(str::to_uppercase),
            "slot {}",
            slot.number
        );
    }
    assert!(image.spec.bootable);

    // The contents: Ready, their spec equal to the local capture's index,
    // the stored files byte-identical to it.
    let contents: Api<PartitionContent> = Api::namespaced(client.clone(), NS);
    for (name, local_name) in [("deb-p1", "p1"), ("deb-p3", "p3"), ("deb-p4", "p4")] {
        let pc = content_ready(&contents, name).await;
        let idx = index(&local.join(format!("{local_name}.index")));
        assert_matches_capture(&pc, &idx);
        assert_eq!(
            sha256_file(&store.join(NS).join(name).join("stream")),
            sha256_file(&local.join(format!("{local_name}.stream"))),
            "{name}: stored stream differs from the local capture"
        );
        assert!(
            pc.finalizers()
                .iter()
                .any(|f| f == "anneal.dev/content-protection")
        );
    }
    assert!(
        store
            .join(NS)
            .join(".imports/deb-raw/layout.json")
            .is_file()
    );

    // The manager's content server serves the verified stream,
    // byte-identical to the local capture's.
    let fetched = work.path().join("fetched.stream");
    let url = format!("http://127.0.0.1:{content_port}/content/{NS}/deb-p3/stream");
    eventually("the content server serves deb-p3", WAIT, || {
        let (url, fetched) = (url.clone(), fetched.clone());
        async move {
            Command::new("curl")
                .args(["-sf", "-o"])
                .arg(&fetched)
                .arg(&url)
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        }
    })
    .await;
    assert_eq!(sha256_file(&fetched), sha256_file(&local.join("p3.stream")));

    // --- staged upload: a ServiceAccount allowed to create imageimports
    // uploads the disk over HTTPS; the import of staged://NAME succeeds.
    for obj in [
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "uploader", "namespace": NS}}),
        json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody", "namespace": NS}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "importer", "namespace": NS},
               "rules": [{"apiGroups": ["anneal.dev"], "resources": ["imageimports"], "verbs": ["create"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "importer", "namespace": NS},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "importer"},
               "subjects": [{"kind": "ServiceAccount", "name": "uploader", "namespace": NS}]}),
    ] {
        let f = work.path().join("obj.json");
        std::fs::write(&f, obj.to_string()).unwrap();
        anneal_testinfra::run(cp.kubectl().unwrap().arg("apply").arg("-f").arg(&f)).unwrap();
    }
    let token = |sa: &str| {
        anneal_testinfra::run(
            cp.kubectl()
                .unwrap()
                .args(["create", "token", sa, "-n", NS]),
        )
        .unwrap()
        .trim()
        .to_string()
    };
    let (good, nobody) = (token("uploader"), token("nobody"));
    // the CA certificate as a user reads it: ConfigMap anneal-agent-api-ca
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), "anneal-system");
    let ca = eventually("the agent API CA ConfigMap", WAIT, || {
        let maps = maps.clone();
        async move {
            let c = maps.get_opt("anneal-agent-api-ca").await.ok()??;
            Some(c.data?.get("ca.crt")?.clone().into_bytes())
        }
    })
    .await;
    let ca_file = work.path().join("ca.pem");
    std::fs::write(&ca_file, ca).unwrap();
    let upload = |token: Option<&str>, name: &str| -> (String, String) {
        let mut c = Command::new("curl");
        c.args(["-sS", "-o", "-", "-w", "\n%{http_code}", "--cacert"])
            .arg(&ca_file)
            .arg("-T")
            .arg(&disk);
        if let Some(t) = token {
            c.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        let o = c
            .arg(format!(
                "https://127.0.0.1:{upload_port}/v1/staged/{NS}/{name}"
            ))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let (body, code) = text.rsplit_once('\n').unwrap_or((&text, ""));
        (code.to_string(), body.to_string())
    };
    let (code, body) = eventually("the upload endpoint answers", WAIT, || {
        let r = upload(None, "disk-upload");
        async move { (r.0 != "000").then_some(r) }
    })
    .await;
    assert_eq!(code, "401", "no token: {body}");
    let (code, body) = upload(Some(&nobody), "disk-upload");
    assert_eq!(code, "403", "a token without create imageimports: {body}");
    let (code, body) = upload(Some(&good), "disk-upload");
    assert_eq!(code, "201", "{body}");
    let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["sha256"], raw_sum.as_str());
    assert_eq!(answer["bytes"], 256u64 << 20);
    let (code, _) = upload(Some(&good), "disk-upload");
    assert_eq!(code, "409", "a staged upload is never overwritten");
    create_import(
        &client,
        "staged",
        json!({
            "source": {"url": "staged://disk-upload", "checksum": answer["checksum"]},
            "imageName": "staged", "contentPrefix": "stg",
        }),
    )
    .await;
    let st = finished(&client, "staged").await;
    assert_eq!(
        st.status.as_ref().and_then(|s| s.state),
        Some(ImportState::Succeeded),
        "{:?}",
        st.status
    );
    assert_eq!(st.status.unwrap().content_refs.len(), 3);

    // --- the same disk as qcow2: the same contents.
    create_import(&client, "deb-qcow", json!({
        "source": {"url": server.url("disk.qcow2"), "checksum": format!("sha256:{qcow_sum}"), "format": "qcow2"},
        "imageName": "deb-q", "contentPrefix": "debq",
    }))
    .await;
    let q = finished(&client, "deb-qcow").await;
    assert_eq!(
        q.status.as_ref().and_then(|s| s.state),
        Some(ImportState::Succeeded),
        "{:?}",
        q.status
    );
    for (name, local_name) in [("debq-p1", "p1"), ("debq-p3", "p3")] {
        let pc = content_ready(&contents, name).await;
        assert_matches_capture(&pc, &index(&local.join(format!("{local_name}.index"))));
    }
    let leftovers: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() == ".staging")
        .flat_map(|e| walk_files(&e.path()))
        .collect();
    assert!(
        leftovers.is_empty(),
        "staging or scratch files left: {leftovers:?}"
    );

    // --- a single partclone image (deleted by its TTL once done; what it
    // made stays) and a Clonezilla image directory as tar.
    create_import(
        &client,
        "root-pcl",
        json!({
            "source": {"url": server.url("root.pcl"), "format": "partclone"},
            "imageName": "root-only", "contentPrefix": "pcl", "bootable": false,
            "ttlSecondsAfterFinished": 0,
        }),
    )
    .await;
    create_import(
        &client,
        "cz",
        json!({
            "source": {"url": server.url("cz.tar"), "format": "partclone"},
            "imageName": "cz", "contentPrefix": "cz",
        }),
    )
    .await;
    let c = finished(&client, "cz").await;
    assert_eq!(
        c.status.as_ref().and_then(|s| s.state),
        Some(ImportState::Succeeded),
        "{:?}",
        c.status
    );
    for (name, local_name) in [("cz-p1", "p1"), ("cz-p3", "p3")] {
        let pc = content_ready(&contents, name).await;
        assert_matches_capture(&pc, &index(&local_cz.join(format!("{local_name}.index"))));
    }
    let cz_image = images.get("cz").await.unwrap();
    assert_eq!(cz_image.spec.layout.slots[1].role, SlotRole::Swap);
    assert_eq!(
        cz_image.spec.layout.slots[1].uuid.as_deref(),
        Some(SWAP_UUID)
    );
    eventually("root-pcl deleted by its TTL", WAIT, || {
        let imports = imports.clone();
        async move {
            imports
                .get_opt("root-pcl")
                .await
                .ok()
                .map(|o| o.is_none())
                .unwrap_or(false)
        }
    })
    .await;
    let pc = content_ready(&contents, "pcl-p1").await;
    assert_matches_capture(&pc, &index(&local_pcl.join("p1.index")));
    assert!(
        images.get_opt("root-only").await.unwrap().is_some(),
        "the TTL deleted what the import made"
    );

    // --- refusals: nothing created, the reason in status and an Event.
    create_import(
        &client,
        "gone",
        json!({
            "source": {"url": format!("http://127.0.0.1:{closed}/disk.raw")},
            "imageName": "gone", "contentPrefix": "gone",
        }),
    )
    .await;
    create_import(
        &client,
        "hostile",
        json!({
            "source": {"url": server.url("hostile.pcl"), "format": "partclone"},
            "imageName": "hostile", "contentPrefix": "hostile", "bootable": false,
        }),
    )
    .await;
    let wrong = "0".repeat(64);
    create_import(
        &client,
        "bad-sum",
        json!({
            "source": {"url": server.url("disk.raw"), "checksum": format!("sha256:{wrong}")},
            "imageName": "bad-sum", "contentPrefix": "badsum",
        }),
    )
    .await;
    create_import(
        &client,
        "missing",
        json!({
            "source": {"url": server.url("nope.raw")},
            "imageName": "missing", "contentPrefix": "missing",
        }),
    )
    .await;
    create_import(
        &client,
        "taken",
        json!({
            "source": {"url": server.url("disk.raw")},
            "imageName": "deb", "contentPrefix": "taken",
        }),
    )
    .await;
    assert_refused(
        &client,
        "bad-sum",
        "ChecksumMismatch",
        &raw_sum,
        "bad-sum",
        "badsum",
    )
    .await;
    assert_refused(
        &client,
        "bad-sum",
        "ChecksumMismatch",
        &wrong,
        "bad-sum",
        "badsum",
    )
    .await;
    assert_refused(
        &client,
        "missing",
        "SourceNotFound",
        "nope.raw",
        "missing",
        "missing",
    )
    .await;
    let t = finished(&client, "taken").await;
    let (_, reason, message) = condition(&t, types::SUCCEEDED);
    assert_eq!(reason, "NameTaken", "{message}");
    assert!(message.contains("Image deb"), "{message}");
    assert!(
        images
            .get("deb")
            .await
            .unwrap()
            .labels()
            .get("anneal.dev/import")
            .map(String::as_str)
            == Some("deb-raw"),
        "the existing Image was overwritten"
    );

    // --- https with a test CA: without a bundle TLSError, nothing created;
    // with spec.source.caBundleSecretRef Pending (CABundleUnavailable) until
    // the Secret exists, then Succeeded with the source's checksum.
    let tls_url = format!("https://127.0.0.1:{tls_port}/disk.raw");
    create_import(
        &client,
        "tls-untrusted",
        json!({
            "source": {"url": tls_url},
            "imageName": "tls-untrusted", "contentPrefix": "tlsu",
        }),
    )
    .await;
    create_import(
        &client,
        "tls-ca",
        json!({
            "source": {"url": tls_url, "checksum": format!("sha256:{raw_sum}"),
                       "caBundleSecretRef": {"name": "images-ca"}},
            "imageName": "tls-ca", "contentPrefix": "tlsca",
        }),
    )
    .await;
    assert_refused(
        &client,
        "tls-untrusted",
        "TLSError",
        &tls_url,
        "tls-untrusted",
        "tlsu",
    )
    .await;
    let waiting = eventually("tls-ca waits for its CA bundle", WAIT, || {
        let imports = imports.clone();
        async move {
            let i = imports.get("tls-ca").await.ok()?;
            let c = i
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == types::SUCCEEDED)?
                .clone();
            (c.reason == "CABundleUnavailable").then_some((i, c.message))
        }
    })
    .await;
    assert_eq!(
        waiting.0.status.as_ref().and_then(|s| s.state),
        Some(ImportState::Pending)
    );
    assert!(
        waiting.1.contains("images/images-ca") && waiting.1.contains("ca.crt"),
        "{}",
        waiting.1
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "images-ca"},
        "stringData": {"ca.crt": ca_pem},
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let tls = finished(&client, "tls-ca").await;
    let st = tls.status.clone().unwrap();
    assert_eq!(
        st.state,
        Some(ImportState::Succeeded),
        "{:?}",
        st.conditions
    );
    let tls_contents: Vec<&str> = st.content_refs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(tls_contents, ["tlsca-p1", "tlsca-p3", "tlsca-p4"]);
    for (name, local_name) in [("tlsca-p1", "p1"), ("tlsca-p4", "p4")] {
        let pc = content_ready(&contents, name).await;
        assert_matches_capture(&pc, &index(&local.join(format!("{local_name}.index"))));
    }
    // the bundle file goes with the finished job
    eventually("the CA bundle file removed with its job", WAIT, || async {
        walk_files(&store.join(".workloads"))
            .iter()
            .all(|p| !p.ends_with("ca.crt"))
            .then_some(())
    })
    .await;

    // --- admission: the CA bundle Secret only from the import's own
    // namespace, and only for https.
    for (name, source, needle) in [
        (
            "ca-elsewhere",
            json!({"url": tls_url, "caBundleSecretRef": {"name": "images-ca", "namespace": "other"}}),
            "spec.source.caBundleSecretRef.namespace",
        ),
        (
            "ca-plain-http",
            json!({"url": server.url("disk.raw"), "caBundleSecretRef": {"name": "images-ca"}}),
            "spec.source.caBundleSecretRef needs an https://",
        ),
    ] {
        let imp: ImageImport = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
            "metadata": {"name": name},
            "spec": {"source": source, "imageName": name, "contentPrefix": name},
        }))
        .unwrap();
        let err = imports
            .create(&PostParams::default(), &imp)
            .await
            .expect_err(name);
        assert!(err.to_string().contains(needle), "{name}: {err}");
    }

    // --- deletion: refused while the Image references the content.
    contents
        .delete("deb-p3", &DeleteParams::default())
        .await
        .unwrap();
    let blocked = eventually("deb-p3 DeletionBlocked", WAIT, || {
        let contents = contents.clone();
        async move {
            let pc = contents.get("deb-p3").await.ok()?;
            let c = pc
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == types::DELETION_BLOCKED)?;
            (c.status == "True").then(|| c.message.clone())
        }
    })
    .await;
    assert!(blocked.contains("Image deb"), "{blocked}");
    assert!(
        store.join(NS).join("deb-p3/stream").is_file(),
        "files removed while referenced"
    );
    // --- and while an active DeployRun streams it: the Image
    // goes, the content stays until the run ends, the run named.
    let runs: Api<anneal_api::DeployRun> = Api::namespaced(client.clone(), NS);
    runs.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": "m-run-1", "annotations": {"anneal.dev/contents": "deb-p1,deb-p3"}},
            "spec": {"machineRef": {"name": "m"}, "claimRef": {"name": "c"}, "imageRef": {"name": "deb"}},
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    let set_phase = |phase: &'static str| {
        let runs = runs.clone();
        async move {
            runs.patch_status(
                "m-run-1",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(json!({"status": {"phase": phase}})),
            )
            .await
            .unwrap();
        }
    };
    set_phase("WritingContent").await;
    // Images own their contents (docs/api.md, "PartitionContent"); a second
    // Image keeps deb-p4
    eventually("deb owns deb-p1", WAIT, || {
        let contents = contents.clone();
        async move {
            let pc = contents.get("deb-p1").await.ok()?;
            pc.owner_references()
                .iter()
                .any(|o| o.kind == "Image" && o.name == "deb")
                .then_some(())
        }
    })
    .await;
    let mut keep = images.get("deb").await.unwrap();
    keep.metadata = kube::api::ObjectMeta {
        name: Some("deb-keep".into()),
        namespace: Some(NS.into()),
        ..Default::default()
    };
    keep.status = None;
    keep.spec.bootable = false;
    keep.spec.post_hook_refs.clear();
    keep.spec
        .layout
        .slots
        .retain(|s| s.content_ref.as_ref().is_some_and(|r| r.name == "deb-p4"));
    images.create(&PostParams::default(), &keep).await.unwrap();
    images
        .delete("deb", &DeleteParams::default())
        .await
        .unwrap();
    let held = eventually("deb-p3 held by the run", WAIT, || {
        let contents = contents.clone();
        async move {
            let pc = contents.get("deb-p3").await.ok()?;
            let c = pc
                .status
                .as_ref()?
                .conditions
                .iter()
                .find(|c| c.type_ == types::DELETION_BLOCKED)?;
            (c.status == "True" && !c.message.contains("Image deb")).then(|| c.message.clone())
        }
    })
    .await;
    assert!(
        held.contains("DeployRun m-run-1 (WritingContent)"),
        "{held}"
    );
    assert!(
        store.join(NS).join("deb-p3/stream").is_file(),
        "files removed while a run streams them"
    );
    set_phase("Succeeded").await;
    eventually("deb-p3 deleted", WAIT, || {
        let contents = contents.clone();
        async move {
            contents
                .get_opt("deb-p3")
                .await
                .ok()
                .map(|o| o.is_none())
                .unwrap_or(false)
        }
    })
    .await;
    assert!(
        !store.join(NS).join("deb-p3").exists(),
        "stored files of deb-p3 remain"
    );
    // the orphan deb-p1 (its only Image gone) is collected with its files;
    // deb-p4, which deb-keep still uses, stays
    eventually("orphaned deb-p1 collected", WAIT, || {
        let contents = contents.clone();
        async move {
            contents
                .get_opt("deb-p1")
                .await
                .ok()
                .map(|o| o.is_none())
                .unwrap_or(false)
                .then_some(())
        }
    })
    .await;
    assert!(
        !store.join(NS).join("deb-p1").exists(),
        "stored files of the orphan deb-p1 remain"
    );
    assert!(
        contents.get_opt("deb-p4").await.unwrap().is_some(),
        "deb-p4 was collected while Image deb-keep uses it"
    );

    shutdown.cancel();
    manager.await.unwrap().unwrap();
    // The content server went with the manager.
    let o = Command::new("curl")
        .args(["-s", "-o", "/dev/null"])
        .arg(&url)
        .status()
        .unwrap();
    assert!(!o.success(), "the content server outlived the manager");
    drop(server);
}

fn walk_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk_files(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}
