//! `kubectl anneal import` (docs/operators.md, "`kubectl anneal`") as a
//! process against a real API server and the manager (in process, the
//! `process` executor, its staged-upload endpoint on loopback): a 256 MiB GPT
//! disk (ext4 data) is uploaded with progress lines (stdout is a pipe), its
//! sha256 computed while it streams, and the ImageImport of `staged://NAME` is
//! followed to Succeeded and its Image to Ready; a URL is imported without an
//! upload; refusals (name taken, 409, 413, a bad token, an unreachable
//! endpoint) name the object and the fix. In a real terminal (tmux) the upload
//! and the import are each one bar redrawn in place.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use anneal_api::{Image, ImageImport, ImageState, ImportState};
use anneal_testinfra::ControlPlane;
use anneal_tests::images::{FileServer, gpt_disk, sha256_file};
use anneal_tests::uploads::UploadLab;
use anneal_tests::{artifacts, eventually};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams};
use serde_json::json;

const NS: &str = "images";
const WAIT: Duration = Duration::from_secs(180);

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn plugin(bin: &Path, kubeconfig: &Path, args: &[&str]) -> Out {
    let o = tokio::process::Command::new(bin)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-n", NS])
        .args(args)
        .env_remove("KUBECONFIG")
        .env_remove("ANNEAL_TOKEN")
        .output()
        .await
        .unwrap();
    let r = Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    let shown: Vec<&str> = args
        .iter()
        .map(|a| if a.len() > 100 { "<token>" } else { a })
        .collect();
    println!(
        "$ kubectl anneal -n {NS} {}\n{}{}(exit {})",
        shown.join(" "),
        r.stdout,
        r.stderr,
        r.code
    );
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_uploads_a_file_with_progress_and_ends_with_a_ready_image() {
    let bin = artifacts::kubectl_anneal();
    let base = Path::new("/var/tmp/anneal-test");
    std::fs::create_dir_all(base).unwrap();
    let work = tempfile::tempdir_in(base).unwrap();
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let store = work.path().join("store");
    // 256 MiB, GPT: ESP, swap, ext4 root with 96 MiB of files.
    let disk = gpt_disk(&src, 256, 96);
    let disk_sum = sha256_file(&disk);
    // Larger than the manager's --max-source-bytes (300 MiB); sparse.
    let huge = src.join("huge.raw");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(400 << 20)
        .unwrap();
    let server = FileServer::start(&src, None);

    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    let lab = UploadLab::start(&cp, NS, &store, 300 << 20, None).await;
    let token = lab.token.clone();

    let kc = cp.kubeconfig_path().to_path_buf();
    let url = lab.url.clone();
    let disk_arg = disk.display().to_string();
    let upload_args = |name: &'static str, file: &str| -> Vec<String> {
        [
            "import",
            file,
            "--name",
            name,
            "--format",
            "raw",
            "--upload-url",
            &url,
            "--token",
            &token,
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect()
    };
    let call = |args: Vec<String>| {
        let (bin, kc) = (bin.clone(), kc.clone());
        async move {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            plugin(&bin, &kc, &a).await
        }
    };

    // --- the upload: progress lines, the checksum, Succeeded, Ready.
    let r = call(upload_args("disk", &disk_arg)).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let up: Vec<&str> = r
        .stdout
        .lines()
        .filter(|l| l.starts_with("upload images/disk: "))
        .collect();
    assert!(
        up.first()
            .is_some_and(|l| l.contains("0 B of 256.0 MiB (0%)")),
        "{up:?}"
    );
    assert!(
        up.last()
            .is_some_and(|l| l.contains("256.0 MiB of 256.0 MiB (100%)") && l.contains("MiB/s")),
        "{up:?}"
    );
    let percents: Vec<u64> = up
        .iter()
        .filter_map(|l| l.split('(').nth(1)?.split('%').next()?.parse().ok())
        .collect();
    assert!(
        percents.len() >= 11 && percents.windows(2).all(|w| w[0] < w[1]),
        "a line per 10 % step, rising: {percents:?}"
    );
    assert!(up.iter().all(|l| l.contains("ETA")), "{up:?}");
    assert!(r.stdout.contains("as staged://disk in "), "{}", r.stdout);
    assert!(
        r.stdout.contains(&format!("sha256:{disk_sum}")),
        "the checksum computed while streaming: {}",
        r.stdout
    );
    assert!(
        r.stdout.contains("imageimport images/disk Succeeded"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .trim_end()
            .ends_with("image images/disk Ready (4 slots)"),
        "{}",
        r.stdout
    );
    let imports: Api<ImageImport> = Api::namespaced(client.clone(), NS);
    let imp = imports.get("disk").await.unwrap();
    assert_eq!(
        imp.spec.source.checksum.as_deref(),
        Some(format!("sha256:{disk_sum}").as_str())
    );
    assert_eq!(imp.spec.source.url, "staged://disk");
    assert_eq!(
        imp.status.as_ref().and_then(|s| s.state),
        Some(ImportState::Succeeded)
    );
    let images: Api<Image> = Api::namespaced(client.clone(), NS);
    assert_eq!(
        images
            .get("disk")
            .await
            .unwrap()
            .status
            .and_then(|s| s.state),
        Some(ImageState::Ready)
    );

    // --- a URL: no upload, the import followed to a Ready Image.
    let r = call(vec![
        "import".into(),
        server.url("disk.raw"),
        "--name".into(),
        "viaurl".into(),
        "--checksum".into(),
        format!("sha256:{disk_sum}"),
    ])
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stdout.contains("upload images/"), "{}", r.stdout);
    assert!(
        r.stdout.contains("imageimport images/viaurl: Ingesting"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .trim_end()
            .ends_with("image images/viaurl Ready (4 slots)"),
        "{}",
        r.stdout
    );

    // --- in a real terminal (tmux): the upload and the import are each one
    // bar redrawn in place, ending at 100 %.
    let term = tempfile::tempdir().unwrap();
    let tmux = anneal_testinfra::Tmux::start(
        term.path(),
        &format!(
            "{} --kubeconfig {} -n {NS} {}; echo \"import exited $?\"; exec sleep 3600",
            bin.display(),
            kc.display(),
            upload_args("tty", &disk_arg).join(" ")
        ),
    )
    .unwrap();
    let screen = tmux.until("import exited", WAIT).await.unwrap();
    drop(tmux);
    println!("--- terminal:\n{screen}");
    assert!(screen.contains("import exited 0"), "{screen}");
    let full = format!("[{}]", "#".repeat(30));
    let up: Vec<&str> = screen
        .lines()
        .filter(|l| l.contains("upload images/tty: "))
        .collect();
    assert!(
        up.len() == 1
            && up[0].starts_with(&full)
            && up[0].contains("256.0 MiB of 256.0 MiB (100%)")
            && up[0].contains("MiB/s")
            && up[0].contains("ETA"),
        "one upload bar, redrawn in place, full: {up:?}"
    );
    let imp: Vec<&str> = screen
        .lines()
        .filter(|l| l.contains("imageimport images/tty: "))
        .collect();
    assert!(
        imp.len() == 1 && imp[0].starts_with(&full) && imp[0].contains("Succeeded Done 100%"),
        "one import bar, redrawn in place, full: {imp:?}"
    );
    assert!(
        screen.contains("image images/tty Ready (4 slots)"),
        "{screen}"
    );

    // --- refusals name the object and the fix.
    let r = call(upload_args("disk", &disk_arg)).await;
    assert_ne!(r.code, 0);
    assert!(
        r.stderr
            .contains("imageimport images/disk already exists: an import never overwrites"),
        "{}",
        r.stderr
    );
    // A successful import removed its upload (docs/images.md, "Staged
    // upload"); an upload no import has consumed yet keeps its name: 409 from
    // the endpoint.
    let staged = store.join("images/.staged/disk");
    assert!(!staged.exists(), "the staged upload outlived its import");
    imports
        .delete("disk", &DeleteParams::default())
        .await
        .unwrap();
    eventually("imageimport disk deleted", WAIT, || {
        let imports = imports.clone();
        async move { imports.get_opt("disk").await.ok()?.is_none().then_some(()) }
    })
    .await;
    std::fs::write(&staged, b"an upload waiting for its import").unwrap();
    let mut args = upload_args("disk", &disk_arg);
    args.extend(["--image-name".into(), "disk2".into()]);
    let r = call(args).await;
    assert_ne!(r.code, 0);
    assert!(
        r.stderr
            .contains("was refused (409: staged://disk already exists")
            && r.stderr
                .contains("kubectl anneal import staged://disk --name OTHER"),
        "{}",
        r.stderr
    );
    let r = call(upload_args("huge", &huge.display().to_string())).await;
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("was refused (413:") && r.stderr.contains("--max-source-bytes"),
        "{}",
        r.stderr
    );
    let mut args = upload_args("other", &disk_arg);
    let n = args.len();
    args[n - 1] = "not-a-token".into();
    let r = call(args).await;
    assert!(
        r.stderr.contains("was refused (401:") && r.stderr.contains("kubectl create token"),
        "{}",
        r.stderr
    );
    let closed = anneal_testinfra::free_port().unwrap();
    let r = call(vec![
        "import".into(),
        disk_arg.clone(),
        "--name".into(),
        "other".into(),
        "--upload-url".into(),
        format!("https://127.0.0.1:{closed}"),
        "--token".into(),
        token.clone(),
    ])
    .await;
    assert!(
        r.stderr.contains(&format!(
            "cannot reach the staged-upload endpoint https://127.0.0.1:{closed}/v1/staged/images/other"
        )) && r.stderr.contains("--upload-listen"),
        "{}",
        r.stderr
    );
    let r = call(vec![
        "import".into(),
        disk_arg.clone(),
        "--name".into(),
        "other".into(),
    ])
    .await;
    assert!(r.stderr.contains("pass --upload-url"), "{}", r.stderr);
    assert!(
        imports.get_opt("other").await.unwrap().is_none(),
        "a refused upload creates no import"
    );

    // --- Hardening 2: a user who may read no Secret of anneal-system (the
    // CA's private key stays there) imports with the CA certificate the
    // manager publishes in ConfigMap anneal-agent-api-ca: its kubeconfig
    // (the uploader's token) gets that one ConfigMap, and the imports and
    // Images of its namespace.
    for obj in [
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "tenant-importer", "namespace": NS},
               "rules": [{"apiGroups": ["anneal.dev"], "resources": ["imageimports", "images"], "verbs": ["get", "list", "watch", "create"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "tenant-importer", "namespace": NS},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant-importer"},
               "subjects": [{"kind": "ServiceAccount", "name": "uploader", "namespace": NS}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "anneal-ca-reader", "namespace": "anneal-system"},
               "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["anneal-agent-api-ca"], "verbs": ["get"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "anneal-ca-reader", "namespace": "anneal-system"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "anneal-ca-reader"},
               "subjects": [{"kind": "ServiceAccount", "name": "uploader", "namespace": NS}]}),
    ] {
        let f = work.path().join("obj.json");
        std::fs::write(&f, obj.to_string()).unwrap();
        anneal_testinfra::run(cp.kubectl().unwrap().arg("apply").arg("-f").arg(&f)).unwrap();
    }
    let (tenant_kc, tenant) = anneal_tests::rbac::service_account(&cp, NS, "uploader").await;
    let e = Api::<Secret>::namespaced(tenant.clone(), "anneal-system")
        .get("anneal-agent-api-ca")
        .await
        .unwrap_err();
    assert!(
        matches!(&e, kube::Error::Api(s) if s.code == 403),
        "the uploader reads the CA Secret: {e}"
    );
    let small_dir = work.path().join("small");
    std::fs::create_dir_all(&small_dir).unwrap();
    let small = gpt_disk(&small_dir, 80, 4).display().to_string();
    let r = plugin(
        &bin,
        &tenant_kc,
        &[
            "import",
            &small,
            "--name",
            "tenant-disk",
            "--format",
            "raw",
            "--upload-url",
            &url,
        ],
    )
    .await;
    assert_eq!(
        r.code, 0,
        "a user without Secrets in anneal-system imports with ConfigMap anneal-agent-api-ca's certificate: {}",
        r.stderr
    );
    assert!(
        r.stdout.contains("upload images/tenant-disk: ") && r.stdout.contains("(100%)"),
        "{}",
        r.stdout
    );

    let _ = tokio::time::timeout(Duration::from_secs(30), lab.stop()).await;
}
