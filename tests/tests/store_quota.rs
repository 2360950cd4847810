#![allow(clippy::too_many_lines)]
//! The content store's per-namespace byte quota (docs/images.md, "Store
//! quota") against a real API server and the manager in process (the
//! `process` executor, its staged-upload endpoint on loopback), the quota
//! 64 MiB: a first import (~45 MiB stored) and a small staged upload fit;
//! a staged upload that would pass the quota is refused with 413 before a
//! byte is written (Content-Length) and ended at the quota when it streams
//! without one, leaving no file; a second import of the same disk is stopped
//! by its ingest (QuotaExceeded, nothing published); once the namespace is
//! full, an import is refused before any ingest starts. Each message names
//! the namespace, the quota, what is used and the fix.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use anneal_api::{ImageImport, PartitionContent};
use anneal_manager::content::quota::StoreQuota;
use anneal_testinfra::ControlPlane;
use anneal_tests::images::{FileServer, gpt_disk};
use anneal_tests::uploads::UploadLab;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "tenant";
const QUOTA: u64 = 64 << 20;

async fn create_import(client: &Client, name: &str, url: &str) {
    let api: Api<ImageImport> = Api::namespaced(client.clone(), NS);
    let imp: ImageImport = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
        "metadata": {"name": name},
        "spec": {"source": {"url": url, "format": "raw"}, "imageName": name,
                 "contentPrefix": name},
    }))
    .unwrap();
    api.create(&PostParams::default(), &imp).await.unwrap();
}

async fn finished(client: &Client, name: &str) -> ImageImport {
    anneal_tests::uploads::import_finished(client, NS, name).await
}

fn succeeded(i: &ImageImport) -> (String, String, String) {
    let c = i
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Succeeded"))
        .unwrap_or_else(|| panic!("{} has no Succeeded condition", i.name_any()));
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

async fn events(client: &Client, object: &str) -> Vec<(String, String, String)> {
    let api: Api<Event> = Api::namespaced(client.clone(), NS);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(object))
        .map(|e| {
            (
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default(),
            )
        })
        .collect()
}

/// `PUT /v1/staged/tenant/<name>` with curl: the status and the body.
/// `chunked`: the body goes without a Content-Length.
fn put(url: &str, ca: &Path, token: &str, name: &str, file: &Path, chunked: bool) -> (u16, String) {
    let mut cmd = std::process::Command::new("curl");
    cmd.args(["-sS", "--cacert"])
        .arg(ca)
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .args(["-w", "\n%{http_code}"]);
    if chunked {
        cmd.args(["-H", "Transfer-Encoding: chunked", "-T", "-"])
            .stdin(std::fs::File::open(file).unwrap());
    } else {
        cmd.arg("-T").arg(file);
    }
    let o = cmd
        .arg(format!("{url}/v1/staged/{NS}/{name}"))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    println!("PUT staged/{NS}/{name} (chunked: {chunked}): {code} {body}");
    (code.trim().parse().unwrap_or(0), body.to_string())
}

fn staged_dir_entries(store: &Path) -> Vec<String> {
    std::fs::read_dir(store.join(NS).join(".staged"))
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn file_of(dir: &Path, name: &str, bytes: usize) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, vec![0x5a; bytes]).unwrap();
    p
}

async fn stored_bytes(client: &Client) -> u64 {
    let api: Api<PartitionContent> = Api::namespaced(client.clone(), NS);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|pc| pc.spec.used_bytes as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_quota_refuses_the_upload_and_import_that_would_pass_it() {
    let base = Path::new("/var/tmp/anneal-test");
    std::fs::create_dir_all(base).unwrap();
    let work = tempfile::tempdir_in(base).unwrap();
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let store = work.path().join("store");
    // 128 MiB, GPT: ESP, swap, ext4 root with 40 MiB of files.
    gpt_disk(&src, 128, 40);
    let server = FileServer::start(&src, None);

    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let quota = StoreQuota {
        per_namespace: QUOTA,
        overrides: Default::default(),
    };
    let lab = UploadLab::start(&cp, NS, &store, 1 << 30, Some(quota)).await;
    let (url, token) = (lab.url.clone(), lab.token.clone());
    let ca = work.path().join("ca.crt");
    std::fs::write(&ca, &lab.ca_pem).unwrap();

    // --- the first import fits.
    create_import(&client, "first", &server.url("disk.raw")).await;
    let first = finished(&client, "first").await;
    let (status, reason, message) = succeeded(&first);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("True", "Imported"),
        "{message}"
    );
    let stored = stored_bytes(&client).await;
    assert!(
        stored > QUOTA / 2 && stored < QUOTA - (8 << 20),
        "the disk's contents take {stored} bytes: the test needs between half the quota and the quota less 8 MiB"
    );

    // --- a small staged upload fits and counts.
    let small = file_of(work.path(), "small.bin", 4 << 20);
    let (code, body) = put(&url, &ca, &token, "small", &small, false);
    assert_eq!(code, 201, "{body}");
    let used = stored + (4 << 20);

    // --- one that would pass the quota: refused before a byte is written.
    let left = QUOTA - used;
    let big = file_of(work.path(), "big.bin", left as usize + (1 << 20));
    let (code, body) = put(&url, &ca, &token, "big", &big, false);
    assert_eq!(code, 413, "{body}");
    for part in [
        format!(
            "namespace {NS} is at its content store quota: {QUOTA} bytes, {used} used ({stored} by PartitionContents, {} by staged uploads)",
            4 << 20
        ),
        format!("{} more asked for", left + (1 << 20)),
        "--store-quota-bytes-per-namespace".to_string(),
        format!("--store-quota-namespace {NS}=BYTES"),
    ] {
        assert!(body.contains(&part), "{part:?} not in {body}");
    }
    assert_eq!(staged_dir_entries(&store), vec!["small".to_string()]);

    // --- streamed without a length: ended at the quota, nothing left.
    let (code, body) = put(&url, &ca, &token, "big", &big, true);
    assert_eq!(code, 413, "{body}");
    assert!(
        body.contains("ended after ")
            && body.contains(&format!("content store quota: {QUOTA} bytes"))
            && body.contains("--store-quota-bytes-per-namespace"),
        "{body}"
    );
    assert_eq!(staged_dir_entries(&store), vec!["small".to_string()]);

    // --- a second import of the same disk: its ingest stops at what is
    // left, nothing is published.
    create_import(&client, "second", &server.url("disk.raw")).await;
    let second = finished(&client, "second").await;
    let (status, reason, message) = succeeded(&second);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "QuotaExceeded"),
        "{message}"
    );
    for part in [
        "past the ".to_string(),
        format!(
            "bytes left of the namespace's content store quota; nothing was published; the quota is {QUOTA} bytes"
        ),
        format!("namespace {NS}"),
        "--store-quota-bytes-per-namespace".to_string(),
    ] {
        assert!(message.contains(&part), "{part:?} not in {message}");
    }
    let ev = events(&client, "second").await;
    assert!(
        ev.iter()
            .any(|(t, r, m)| t == "Warning" && r == "QuotaExceeded" && *m == message),
        "{ev:?}"
    );
    assert_eq!(
        stored_bytes(&client).await,
        stored,
        "the second import stored nothing"
    );
    let mut in_ns: Vec<String> = std::fs::read_dir(store.join(NS))
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("second"))
        .collect();
    in_ns.sort();
    assert!(in_ns.is_empty(), "published after all: {in_ns:?}");

    // --- the namespace full (a staged upload of exactly what is left): an
    // import is refused before its ingest starts.
    let fill = file_of(work.path(), "fill.bin", left as usize);
    let (code, body) = put(&url, &ca, &token, "fill", &fill, false);
    assert_eq!(code, 201, "{body}");
    create_import(&client, "third", &server.url("disk.raw")).await;
    let third = finished(&client, "third").await;
    let (status, reason, message) = succeeded(&third);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "QuotaExceeded"),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "namespace {NS} is at its content store quota: {QUOTA} bytes, {QUOTA} used ({stored} by PartitionContents, {} by staged uploads)",
            QUOTA - stored
        )) && message.contains("delete Images and their PartitionContents"),
        "{message}"
    );
    let ev = events(&client, "third").await;
    assert!(
        ev.iter()
            .any(|(t, r, _)| t == "Warning" && r == "QuotaExceeded"),
        "{ev:?}"
    );
    assert!(
        !ev.iter().any(|(_, r, _)| r == "Ingesting"),
        "no ingest started: {ev:?}"
    );

    lab.stop().await;
}
