//! The `kubernetes` executor against a real API server: the Job of an
//! ImageImport's ingest and a server Deployment are accepted by server-side
//! apply and hold, field by field, what the workload spec says; applying
//! again changes nothing; `observe` and `remove` work on them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use anneal_api::ImageImport;
use anneal_manager::content::ContentContext;
use anneal_manager::content::imports::ingest_spec;
use anneal_manager::workload::kubernetes::{KubeConfig, KubeExecutor};
use anneal_manager::workload::{
    Executor, Kind, Phase, Program, Volume, VolumeSource, WorkloadSpec,
};
use anneal_testinfra::ControlPlane;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, PostParams};
use kube::runtime::events::Recorder;
use kube::{Resource, ResourceExt};
use serde_json::json;

async fn namespace(client: &kube::Client, name: &str) {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_and_deployments_hold_the_workload_spec() {
    let cp = ControlPlane::start().await.unwrap();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    let client = cp.client();
    namespace(&client, "anneal-system").await;
    namespace(&client, "tenant").await;

    // A real ImageImport, so the owner reference carries its UID.
    let imports: Api<ImageImport> = Api::namespaced(client.clone(), "tenant");
    let imp: ImageImport = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
        "metadata": {"name": "debian-12"},
        "spec": {"source": {"url": "https://images.example/debian-12.qcow2",
                            "checksum": format!("sha256:{}", "a".repeat(64)), "format": "qcow2"},
                 "imageName": "debian-12", "contentPrefix": "deb12"},
    }))
    .unwrap();
    let imp = imports.create(&PostParams::default(), &imp).await.unwrap();

    let kcfg = KubeConfig {
        namespace: "anneal-system".into(),
        image: "registry.example/anneal/agent:1.2.3".into(),
        bootd_image: "registry.example/anneal/bootd:1.2.3".into(),
        content_claim: "content-site-a".into(),
        server_host_network: false,
        placement: anneal_manager::workload::kubernetes::PodPlacement {
            node_selector: vec![("anneal.dev/provisioning".into(), "true".into())],
            tolerations: vec![
                anneal_manager::workload::kubernetes::parse_toleration(
                    "dedicated=provisioning:NoSchedule",
                )
                .unwrap(),
            ],
            image_pull_secrets: vec!["regcred".into()],
            image_pull_policy: "Always".into(),
        },
    };
    let kube_ex = KubeExecutor::new(client.clone(), kcfg.clone());
    let ctx = ContentContext {
        client: client.clone(),
        recorder: Recorder::new(client.clone(), anneal_manager::controller::reporter(None)),
        executor: Executor::Kubernetes(kube_ex.clone()),
        store_name: "content-site-a".into(),
        max_source_bytes: Some(10 << 30),
        store_quota: Default::default(),
        ingest_deadline_secs: 3600,
    };
    let spec = ingest_spec(&imp, &ctx);
    let ex = Executor::Kubernetes(kube_ex.clone());
    assert_eq!(ex.observe(&spec).await.unwrap().phase, Phase::Absent);
    ex.ensure(&spec).await.unwrap();

    let jobs: Api<Job> = Api::namespaced(client.clone(), "anneal-system");
    let name = kube_ex.object_name(&spec);
    // a tenant's workload: <namespace>-<name>-<tag>, the tag keeping
    // namespaces apart whose joined names read the same
    assert!(
        name.starts_with("tenant-ingest-debian-12-")
            && name.len() == "tenant-ingest-debian-12-".len() + 16,
        "{name}"
    );
    let job = jobs.get(&name).await.unwrap();
    let labels = job.labels();
    assert_eq!(
        labels.get("anneal.dev/import").map(String::as_str),
        Some("debian-12")
    );
    assert_eq!(
        labels.get("anneal.dev/workload").map(String::as_str),
        Some(name.as_str())
    );
    assert_eq!(
        labels.get("anneal.dev/owner-namespace").map(String::as_str),
        Some("tenant")
    );
    assert_eq!(
        labels.get("anneal.dev/owner-uid").map(String::as_str),
        imp.uid().as_deref()
    );
    assert!(
        job.owner_references().is_empty(),
        "an owner reference cannot cross namespaces"
    );
    let js = job.spec.as_ref().unwrap();
    assert_eq!(js.backoff_limit, Some(0));
    assert_eq!(js.active_deadline_seconds, Some(3600));
    let pod = js.template.spec.as_ref().unwrap();
    assert_eq!(pod.restart_policy.as_deref(), Some("Never"));
    // where and how it runs (--workload-node-selector, -toleration,
    // -image-pull-secret, -image-pull-policy), as the API server kept it
    assert_eq!(
        pod.node_selector
            .as_ref()
            .and_then(|s| s.get("anneal.dev/provisioning"))
            .map(String::as_str),
        Some("true")
    );
    let tol = &pod.tolerations.as_ref().unwrap()[0];
    assert_eq!(
        (
            tol.key.as_deref(),
            tol.operator.as_deref(),
            tol.value.as_deref(),
            tol.effect.as_deref()
        ),
        (
            Some("dedicated"),
            Some("Equal"),
            Some("provisioning"),
            Some("NoSchedule")
        )
    );
    assert_eq!(
        pod.image_pull_secrets.as_ref().unwrap()[0].name.as_str(),
        "regcred"
    );
    assert_eq!(
        pod.containers[0].image_pull_policy.as_deref(),
        Some("Always")
    );
    assert_eq!(pod.automount_service_account_token, Some(false));
    let psc = pod.security_context.as_ref().unwrap();
    assert_eq!(
        (psc.run_as_non_root, psc.run_as_user),
        (Some(true), Some(65532))
    );
    let c = &pod.containers[0];
    assert_eq!(
        c.image.as_deref(),
        Some("registry.example/anneal/agent:1.2.3")
    );
    assert_eq!(
        c.command.as_deref(),
        Some(&["/anneal-agent".to_string()][..])
    );
    let args = c.args.clone().unwrap();
    let expect: Vec<String> = [
        "ingest",
        "--url",
        "https://images.example/debian-12.qcow2",
        "--store",
        "/store",
        "--scratch",
        "/scratch",
        "--namespace",
        "tenant",
        "--import",
        "debian-12",
        "--prefix",
        "deb12",
        "--checksum",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!("sha256:{}", "a".repeat(64)),
        "--format".into(),
        "qcow2".into(),
        "--max-bytes".into(),
        (10u64 << 30).to_string(),
    ])
    .collect();
    assert_eq!(args, expect);
    let env = c.env.clone().unwrap();
    assert!(
        env.iter().any(|e| e.name == "ANNEAL_WORKLOAD"
            && e.value.as_deref() == Some("tenant/ingest-debian-12"))
    );
    let csc = c.security_context.as_ref().unwrap();
    assert_eq!(csc.allow_privilege_escalation, Some(false));
    assert_eq!(csc.read_only_root_filesystem, Some(true));
    let mounts: Vec<(String, String)> = c
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .map(|m| (m.name, m.mount_path))
        .collect();
    assert_eq!(
        mounts,
        [
            ("store".to_string(), "/store".to_string()),
            ("scratch".into(), "/scratch".into())
        ]
    );
    let vols = pod.volumes.clone().unwrap();
    assert_eq!(
        vols[0]
            .persistent_volume_claim
            .as_ref()
            .map(|p| p.claim_name.as_str()),
        Some("content-site-a")
    );
    assert!(vols[1].empty_dir.is_some());
    let limits = c.resources.as_ref().unwrap().limits.clone().unwrap();
    assert_eq!(limits.get("memory").map(|q| q.0.as_str()), Some("256Mi"));
    // Applying again changes nothing.
    ex.ensure(&spec).await.unwrap();
    let again = jobs.get(&name).await.unwrap();
    assert_eq!(again.resource_version(), job.resource_version());
    // No kubelet here: the Job exists and has not finished.
    assert_eq!(ex.observe(&spec).await.unwrap().phase, Phase::Running);

    // A server in the workload namespace: a Deployment with an owner
    // reference, one replica, Recreate.
    let owner = imp.controller_owner_ref(&()).unwrap();
    let server = WorkloadSpec {
        namespace: "anneal-system".into(),
        name: "content-site-a".into(),
        kind: Kind::Server,
        program: Program::Agent,
        args: vec![
            "serve".into(),
            "--content-dir".into(),
            "${volume:store}".into(),
        ],
        volumes: vec![Volume {
            name: "store".into(),
            mount_path: "/store".into(),
            source: VolumeSource::ContentStore,
        }],
        env: [("RUST_LOG".to_string(), "info".to_string())].into(),
        labels: Default::default(),
        owner: Some(owner.clone()),
        deadline_secs: None,
        access: Default::default(),
    };
    ex.ensure(&server).await.unwrap();
    let deps: Api<Deployment> = Api::namespaced(client.clone(), "anneal-system");
    let d = deps.get("content-site-a").await.unwrap();
    assert_eq!(d.owner_references(), [owner]);
    let ds = &d.spec;
    assert_eq!(ds.replicas, Some(1));
    assert_eq!(
        ds.strategy.as_ref().and_then(|s| s.type_.as_deref()),
        Some("Recreate")
    );
    let c = &ds.template.spec.as_ref().unwrap().containers[0];
    assert_eq!(
        c.args.clone().unwrap(),
        ["serve", "--content-dir", "/store"]
    );
    assert_eq!(
        ds.selector
            .match_labels
            .as_ref()
            .and_then(|l| l.get("anneal.dev/workload"))
            .map(String::as_str),
        Some("content-site-a")
    );

    // A managed bootd: the bootd image, the host's network, root with
    // only its three capabilities, bootd's ServiceAccount token; an owner
    // reference to a Subnet of the workload namespace, none (labels
    // instead) to one elsewhere; the sweep removes a bootd no Subnet wants.
    let subnet_of = |ns: &str| -> anneal_api::Subnet {
        let mut s: anneal_api::Subnet = serde_json::from_value(json!({
            "apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "rack1", "namespace": ns, "uid": format!("uid-{ns}")},
            "spec": {"siteRef": {"name": "site"}, "cidr": "10.90.0.0/24",
                     "bootd": {"serverIP": "10.90.0.1", "mode": "Managed"},
                     "dhcp": {"mode": "proxy"}},
        }))
        .unwrap();
        s.metadata.namespace = Some(ns.into());
        s
    };
    let bcfg = anneal_manager::bootd::BootdConfig {
        api_url: Some("https://10.90.0.1:8443".into()),
        ca_namespace: "anneal-system".into(),
        http_port: 8080,
        service_account: "anneal-bootd".into(),
        env: Default::default(),
        allowed_namespaces: vec!["tenant".into()],
    };
    let home =
        anneal_manager::bootd::bootd_spec(&subnet_of("anneal-system"), &bcfg, Some("ab")).unwrap();
    let away = anneal_manager::bootd::bootd_spec(&subnet_of("tenant"), &bcfg, Some("ab")).unwrap();
    ex.ensure(&home).await.unwrap();
    ex.ensure(&away).await.unwrap();
    let d = deps.get("bootd-rack1").await.unwrap();
    assert_eq!(d.owner_references()[0].uid, "uid-anneal-system");
    let pod = d.spec.template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.service_account_name.as_deref(), Some("anneal-bootd"));
    assert_eq!(pod.automount_service_account_token, Some(true));
    let psc = pod.security_context.unwrap();
    assert_eq!(
        (psc.run_as_user, psc.run_as_non_root),
        (Some(0), Some(false))
    );
    let c = &pod.containers[0];
    assert_eq!(
        c.image.as_deref(),
        Some("registry.example/anneal/bootd:1.2.3")
    );
    assert_eq!(c.command.clone().unwrap(), ["/bootd"]);
    let caps = c
        .security_context
        .as_ref()
        .and_then(|s| s.capabilities.clone())
        .unwrap();
    assert_eq!(caps.drop.unwrap(), ["ALL"]);
    assert_eq!(
        caps.add.unwrap(),
        ["NET_BIND_SERVICE", "NET_RAW", "NET_ADMIN"]
    );
    let away_name = kube_ex.object_name(&away);
    let d = deps.get(&away_name).await.unwrap();
    assert!(d.owner_references().is_empty());
    assert_eq!(
        d.labels().get("anneal.dev/owner-uid").map(String::as_str),
        Some("uid-tenant")
    );
    let keep: std::collections::BTreeSet<String> = ["bootd-rack1".to_string()].into();
    let swept = kube_ex
        .sweep_servers(anneal_manager::bootd::COMPONENT, &keep)
        .await
        .unwrap();
    assert_eq!(swept, std::slice::from_ref(&away_name));
    assert!(
        deps.get_opt(&away_name)
            .await
            .unwrap()
            .is_none_or(|d| d.metadata.deletion_timestamp.is_some())
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "anneal-system");
    assert!(
        secrets
            .get_opt(&kube_ex.files_secret_name(&away, "config"))
            .await
            .unwrap()
            .is_none(),
        "the swept bootd's configuration Secret is gone too"
    );
    // the content server is not a bootd: the sweep leaves it
    // (below); on the pod network unless servers are on the node's network
    // (--workload-host-network): then the content server is, Jobs are not
    assert_eq!(
        kube_ex.object(&server)["spec"]["template"]["spec"]["hostNetwork"],
        json!(null)
    );
    let on_host = KubeExecutor::new(
        client.clone(),
        KubeConfig {
            server_host_network: true,
            ..kcfg
        },
    );
    let pod = &on_host.object(&server)["spec"]["template"]["spec"];
    assert_eq!(
        (pod["hostNetwork"].clone(), pod["dnsPolicy"].clone()),
        (json!(true), json!("ClusterFirstWithHostNet"))
    );
    assert_eq!(
        on_host.object(&spec)["spec"]["template"]["spec"]["hostNetwork"],
        json!(null)
    );
    assert!(deps.get_opt("content-site-a").await.unwrap().is_some());
    ex.remove(&home).await.unwrap();

    ex.remove(&spec).await.unwrap();
    ex.remove(&server).await.unwrap();
    assert!(
        jobs.get_opt(&name)
            .await
            .unwrap()
            .is_none_or(|j| j.metadata.deletion_timestamp.is_some())
    );
    assert!(
        deps.get_opt("content-site-a")
            .await
            .unwrap()
            .is_none_or(|d| d.metadata.deletion_timestamp.is_some())
    );
    // Removing what is gone is fine.
    ex.remove(&spec).await.unwrap();

    // An https import with a CA bundle: a Secret beside the Job holds the
    // bundle the controller read, mounted read-only at /ca and passed as
    // --ca-bundle; it goes with the Job.
    let imp: ImageImport = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "ImageImport",
        "metadata": {"name": "private"},
        "spec": {"source": {"url": "https://images.internal/disk.raw",
                            "caBundleSecretRef": {"name": "images-ca"}},
                 "imageName": "private", "contentPrefix": "private"},
    }))
    .unwrap();
    let imp = imports.create(&PostParams::default(), &imp).await.unwrap();
    let mut spec = ingest_spec(&imp, &ctx);
    let pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n".to_vec();
    for v in &mut spec.volumes {
        if let VolumeSource::Files(f) = &mut v.source {
            f.insert("ca.crt".into(), pem.clone());
        }
    }
    ex.ensure(&spec).await.unwrap();
    let name = kube_ex.object_name(&spec);
    let job = jobs.get(&name).await.unwrap();
    let pod = job.spec.unwrap().template.spec.unwrap();
    let c = &pod.containers[0];
    let args = c.args.clone().unwrap();
    let at = args.iter().position(|a| a == "--ca-bundle").unwrap();
    assert_eq!(args[at + 1], "/ca/ca.crt");
    let m = c
        .volume_mounts
        .clone()
        .unwrap()
        .into_iter()
        .find(|m| m.name == "ca")
        .unwrap();
    assert_eq!((m.mount_path.as_str(), m.read_only), ("/ca", Some(true)));
    let vol = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "ca")
        .unwrap();
    let sv = vol.secret.unwrap();
    let secret_name = sv.secret_name.unwrap();
    assert_eq!(secret_name, kube_ex.files_secret_name(&spec, "ca"));
    assert_eq!(sv.default_mode, Some(0o440));
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "anneal-system");
    let secret = secrets.get(&secret_name).await.unwrap();
    assert_eq!(
        secret.data.unwrap().get("ca.crt").map(|b| b.0.clone()),
        Some(pem)
    );
    assert_eq!(
        secret
            .metadata
            .labels
            .unwrap()
            .get("anneal.dev/workload")
            .map(String::as_str),
        Some(name.as_str())
    );
    ex.remove(&spec).await.unwrap();
    assert!(secrets.get_opt(&secret_name).await.unwrap().is_none());
}
