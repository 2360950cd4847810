//! bootd needs no cluster-wide Secret access: bootd and the
//! manager run with the ServiceAccounts and roles of `deploy/base/` on the
//! real API server (RBAC on). A Machine of namespace `tenant-b` boots from
//! Subnet `lab` of `site-a`, where bootd runs: the manager, acting as
//! `anneal-manager`, mints the boot token in `tenant-b` and publishes bootd's
//! copy into `site-a` (key `tenant-b.m-x.boot-token` of Secret
//! `anneal-boot-tokens`, the one Secret bootd may read); bootd, acting as
//! `anneal-bootd`, builds its table from that copy and holds the token
//! unused; the registration spends it and the copy is removed. bootd's token
//! cannot read (get or list) a Secret of another namespace, nor list
//! Secrets cluster-wide, nor in its own namespace; the manager's uses
//! Secrets only where an operator bound `anneal-manager-secrets` (tenant-b,
//! site-a, anneal-system): a Secret of tenant-c is refused, and so is a
//! cluster-wide list.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use anneal_api::{Machine, Subnet};
use anneal_bootd::state::{BootToken, Token};
use anneal_dhcp::Mac;
use anneal_manager::lifecycle::LifecycleConfig;
use anneal_testinfra::ControlPlane;
use anneal_tests::eventually;
use anneal_tests::lab::{Watcher, lease_subnet};
use anneal_tests::lifecycle::*;
use anneal_tests::rbac::{apply_manifest, enroll_namespace, service_account};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, PostParams};

const MAC: &str = "52:54:00:7f:40:01";
const MAC_BYTES: Mac = Mac([0x52, 0x54, 0, 0x7f, 0x40, 1]);
const COPY: &str = "tenant-b.m-x.boot-token";
const TOKENS: &str = "anneal-boot-tokens";
const WAIT: Duration = Duration::from_secs(60);

fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

/// Key `key` of Secret `namespace/anneal-boot-tokens` (bootd's copy of a
/// boot token), as text.
async fn bootd_copy(client: &kube::Client, namespace: &str, key: &str) -> Option<String> {
    let s = Api::<Secret>::namespaced(client.clone(), namespace)
        .get_opt(TOKENS)
        .await
        .unwrap()?;
    let b = s.data?.remove(key)?;
    Some(String::from_utf8(b.0).unwrap())
}

fn boot_token(w: &Watcher) -> Option<BootToken> {
    w.shared
        .snapshot()
        .machines
        .get(&MAC_BYTES)
        .map(|b| b.token.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootd_reads_tokens_only_in_its_namespace_under_least_privilege() {
    let cp = ControlPlane::start().await.unwrap();
    let admin = prepare(&cp, &[]).await;
    create_namespace(&admin, "site-a").await;
    create_namespace(&admin, "tenant-b").await;
    apply_manifest(&cp, "deploy/base/rbac-manager.yaml", "anneal-system");
    apply_manifest(&cp, "deploy/base/rbac-bootd.yaml", "site-a");
    // the manager's Secrets: the tenant's Machine and the Subnet's namespace
    enroll_namespace(&cp, "tenant-b");
    enroll_namespace(&cp, "site-a");
    let mut subnet = lease_subnet(None);
    subnet.spec.allowed_namespaces = vec!["tenant-b".into()];
    Api::<Subnet>::namespaced(admin.clone(), "site-a")
        .create(&PostParams::default(), &subnet)
        .await
        .unwrap();
    // a tenant's Secret bootd must never read
    let tenant_secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "bmc", "namespace": "tenant-b"},
        "stringData": {"password": "tenant-b's"}
    }))
    .unwrap();
    Api::<Secret>::namespaced(admin.clone(), "tenant-b")
        .create(&PostParams::default(), &tenant_secret)
        .await
        .unwrap();

    let (manager_kc, manager) = service_account(&cp, "anneal-system", "anneal-manager").await;
    // nor does the manager's, in a namespace no operator enrolled
    create_namespace(&admin, "tenant-c").await;
    let mut other = tenant_secret.clone();
    other.metadata.namespace = Some("tenant-c".into());
    Api::<Secret>::namespaced(admin.clone(), "tenant-c")
        .create(&PostParams::default(), &other)
        .await
        .unwrap();
    let e = Api::<Secret>::namespaced(manager.clone(), "tenant-c")
        .get("bmc")
        .await
        .unwrap_err();
    assert_eq!(status_code(&e), Some(403), "{e}");
    let e = Api::<Secret>::all(manager.clone())
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert_eq!(status_code(&e), Some(403), "{e}");
    // its workloads only in its own namespace (a Role there): no Deployment,
    // Job or pod log anywhere else
    {
        use k8s_openapi::api::apps::v1::Deployment;
        use k8s_openapi::api::batch::v1::Job;
        use k8s_openapi::api::core::v1::Pod;
        let deployment: Deployment = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "probe"},
            "spec": {"selector": {"matchLabels": {"a": "b"}},
                     "template": {"metadata": {"labels": {"a": "b"}},
                                  "spec": {"containers": [{"name": "c", "image": "x"}]}}}
        }))
        .unwrap();
        let job: Job = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "probe"},
            "spec": {"template": {"spec": {"restartPolicy": "Never",
                     "containers": [{"name": "c", "image": "x"}]}}}
        }))
        .unwrap();
        let dry = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        for ns in ["tenant-b", "tenant-c", "default"] {
            let e = Api::<Deployment>::namespaced(manager.clone(), ns)
                .create(&dry, &deployment)
                .await
                .unwrap_err();
            assert_eq!(status_code(&e), Some(403), "Deployment in {ns}: {e}");
            let e = Api::<Job>::namespaced(manager.clone(), ns)
                .create(&dry, &job)
                .await
                .unwrap_err();
            assert_eq!(status_code(&e), Some(403), "Job in {ns}: {e}");
            let e = Api::<Pod>::namespaced(manager.clone(), ns)
                .list(&ListParams::default())
                .await
                .unwrap_err();
            assert_eq!(status_code(&e), Some(403), "pods in {ns}: {e}");
        }
        Api::<Deployment>::namespaced(manager.clone(), "anneal-system")
            .create(&dry, &deployment)
            .await
            .unwrap();
        Api::<Job>::namespaced(manager.clone(), "anneal-system")
            .create(&dry, &job)
            .await
            .unwrap();
    }
    let (_, bootd) = service_account(&cp, "site-a", "anneal-bootd").await;

    // bootd's ServiceAccount: no Secret of another namespace, no
    // cluster-wide list, but Machines of every namespace (read only)
    let e = Api::<Secret>::namespaced(bootd.clone(), "tenant-b")
        .get("bmc")
        .await
        .unwrap_err();
    assert_eq!(status_code(&e), Some(403), "{e}");
    let e = Api::<Secret>::namespaced(bootd.clone(), "tenant-b")
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert_eq!(status_code(&e), Some(403), "{e}");
    let e = Api::<Secret>::all(bootd.clone())
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert_eq!(status_code(&e), Some(403), "{e}");
    // Hardening 2: in its own namespace too, no list (a label selector is
    // no RBAC boundary) and no Secret but anneal-boot-tokens
    let site_secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "other", "namespace": "site-a"},
        "stringData": {"key": "site-a's"}
    }))
    .unwrap();
    Api::<Secret>::namespaced(admin.clone(), "site-a")
        .create(&PostParams::default(), &site_secret)
        .await
        .unwrap();
    let e = Api::<Secret>::namespaced(bootd.clone(), "site-a")
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert_eq!(
        status_code(&e),
        Some(403),
        "bootd lists the Secrets of site-a (deploy/base/rbac-bootd.yaml must grant Secret anneal-boot-tokens by resourceNames only): {e}"
    );
    let e = Api::<Secret>::namespaced(bootd.clone(), "site-a")
        .get("other")
        .await
        .unwrap_err();
    assert_eq!(
        status_code(&e),
        Some(403),
        "bootd reads Secret site-a/other: {e}"
    );
    Api::<Machine>::all(bootd.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    let e = Api::<Machine>::namespaced(bootd.clone(), "tenant-b")
        .delete("m-x", &Default::default())
        .await
        .unwrap_err();
    assert_eq!(status_code(&e), Some(403), "{e}");

    // the manager as its ServiceAccount
    let manager = Manager::start(
        &manager_kc,
        LifecycleConfig {
            boot_token_lifetime: Duration::from_secs(300),
            health_interval: Duration::from_secs(5),
            ..LifecycleConfig::default()
        },
        loopback_agent_api(),
    );
    let watcher = Watcher::start_in(&bootd, "site-a").await;
    let mut m = machine("m-x", MAC, None);
    m.spec.subnet_ref.namespace = Some("site-a".into());
    m.metadata.namespace = Some("tenant-b".into());
    Api::<Machine>::namespaced(admin.clone(), "tenant-b")
        .create(&PostParams::default(), &m)
        .await
        .unwrap();

    // the token in the Machine's namespace, bootd's copy in the Subnet's:
    // a key of Secret anneal-boot-tokens, no Secret of its own
    let token = eventually("the boot token in tenant-b", WAIT, || async {
        secret_token(&admin, "tenant-b", "m-x-boot-token").await
    })
    .await;
    let copy = eventually("bootd's copy in site-a", WAIT, || async {
        bootd_copy(&admin, "site-a", COPY).await
    })
    .await;
    assert_eq!(copy, token);
    assert!(
        Api::<Secret>::namespaced(admin.clone(), "site-a")
            .get_opt(COPY)
            .await
            .unwrap()
            .is_none(),
        "a copy Secret {COPY} besides Secret {TOKENS}"
    );

    // bootd, as its ServiceAccount, serves that token (unused)
    let want = Token::new(token.clone());
    eventually("bootd holds the token unused", WAIT, || async {
        match boot_token(&watcher) {
            Some(BootToken::Unused(t)) if t == want => Some(()),
            _ => None,
        }
    })
    .await;

    // the registration spends it: the copy goes, bootd's token is spent
    let agent = AgentClient::new(manager.api_addr, &manager.ca_pem);
    let (code, body) = agent.register_as(&token, Some("tenant-b/m-x"), MAC).await;
    assert_eq!(code, 200, "{body}");
    eventually("the copy removed from anneal-boot-tokens", WAIT, || async {
        bootd_copy(&admin, "site-a", COPY)
            .await
            .is_none()
            .then_some(())
    })
    .await;
    eventually("bootd's token spent", WAIT, || async {
        matches!(boot_token(&watcher), Some(BootToken::Spent)).then_some(())
    })
    .await;
    watcher.stop().await;

    // a Machine of a namespace no operator enrolled: its BMC Secret is
    // refused to the manager, and the Machine says what to bind
    let mut m = machine(
        "m-c",
        "52:54:00:7f:40:02",
        Some(("redfish://192.0.2.1", "bmc")),
    );
    m.metadata.namespace = Some("tenant-c".into());
    Api::<Machine>::namespaced(admin.clone(), "tenant-c")
        .create(&PostParams::default(), &m)
        .await
        .unwrap();
    let said = eventually("m-c says its Secret is refused", WAIT, || async {
        let m = Api::<Machine>::namespaced(admin.clone(), "tenant-c")
            .get("m-c")
            .await
            .unwrap();
        m.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "BMCReachable" && c.status == "False")
            .map(|c| c.message)
            .filter(|msg| msg.contains("bind ClusterRole anneal-manager-secrets"))
    })
    .await;
    assert!(said.contains("namespace tenant-c"), "{said}");
}

/// A Role in `namespace` over Machines and MachineClaims (what an operator
/// grants a tenant) bound to ServiceAccount `namespace/tenant`.
fn grant_tenant(cp: &ControlPlane, namespace: &str) {
    for args in [
        vec!["create", "serviceaccount", "tenant", "-n", namespace],
        vec![
            "create",
            "role",
            "tenant",
            "-n",
            namespace,
            "--verb=get,list,watch,create,update,patch,delete",
            "--resource=machines.anneal.dev,machineclaims.anneal.dev",
        ],
        vec![
            "create",
            "rolebinding",
            "tenant",
            "-n",
            namespace,
            "--role=tenant",
            &format!("--serviceaccount={namespace}:tenant"),
        ],
    ] {
        let out = cp.kubectl().unwrap().args(&args).output().unwrap();
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn refused_for_claim_ref(r: Result<Machine, kube::Error>, what: &str) {
    match r {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{what}: {s:?}");
            assert!(
                s.message
                    .contains("spec.claimRef is written only by the anneal manager"),
                "{what}: the refusal names the field and who writes it: {}",
                s.message
            );
        }
        other => panic!("{what}: admission let it through: {other:?}"),
    }
}

/// Hardening 2, critical: a tenant's Machine cannot name another
/// namespace's claim. Admission (deploy/base/admission.yaml on the real API
/// server) refuses a claimRef written by anyone but the manager's
/// ServiceAccount (create, change, clear), and the manager itself never
/// follows a claimRef into another namespace nor counts a binding the
/// claim's status does not confirm: nothing is planned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_cannot_write_claim_ref() {
    use anneal_api::MachineClaim;
    use anneal_manager::lifecycle::handlers::DeployView;
    use kube::api::{Patch, PatchParams};
    use serde_json::json;

    let cp = ControlPlane::start().await.unwrap();
    let admin = prepare(&cp, &[]).await;
    create_namespace(&admin, "tenant-a").await;
    create_namespace(&admin, "tenant-b").await;
    apply_manifest(&cp, "deploy/base/rbac-manager.yaml", "anneal-system");
    apply_manifest(&cp, "deploy/base/admission.yaml", "anneal-system");
    grant_tenant(&cp, "tenant-b");
    let (_, tenant) = service_account(&cp, "tenant-b", "tenant").await;
    let (_, manager) = service_account(&cp, "anneal-system", "anneal-manager").await;
    let pp = PostParams::default();
    let merge = PatchParams::default();

    // tenant-a's claim, bound to tenant-a's Machine "m"
    let claim: MachineClaim = serde_json::from_value(json!({
        "apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
        "metadata": {"name": "c", "namespace": "tenant-a"},
        "spec": {"machineName": "m", "imageRef": {"name": "secret-os"}}
    }))
    .unwrap();
    let claims_a = Api::<MachineClaim>::namespaced(admin.clone(), "tenant-a");
    claims_a.create(&pp, &claim).await.unwrap();
    claims_a
        .patch_status(
            "c",
            &merge,
            &Patch::Merge(json!({"status": {"phase": "Bound", "machineName": "m"}})),
        )
        .await
        .unwrap();

    let mut m = machine("m", MAC, None);
    m.metadata.namespace = Some("tenant-b".into());
    let mut stolen = m.clone();
    stolen.spec.claim_ref = Some(anneal_api::NameRef {
        name: "c".into(),
        namespace: Some("tenant-a".into()),
    });
    let tenant_machines = Api::<Machine>::namespaced(tenant.clone(), "tenant-b");
    // the policy is in force once it refuses (it compiles asynchronously)
    let first = eventually("the claimRef policy in force", WAIT, || async {
        match tenant_machines.create(&pp, &stolen).await {
            Err(kube::Error::Api(s)) if s.code == 403 => Some(Err(kube::Error::Api(s))),
            Ok(_) => {
                tenant_machines
                    .delete("m", &Default::default())
                    .await
                    .unwrap();
                None
            }
            Err(e) => panic!("creating the tenant's Machine: {e:?}"),
        }
    })
    .await;
    refused_for_claim_ref(first, "a tenant creating a Machine with a claimRef");

    // created without one, the tenant may not add, change or clear it
    tenant_machines.create(&pp, &m).await.unwrap();
    refused_for_claim_ref(
        tenant_machines
            .patch(
                "m",
                &merge,
                &Patch::Merge(
                    json!({"spec": {"claimRef": {"name": "c", "namespace": "tenant-a"}}}),
                ),
            )
            .await,
        "a tenant adding a claimRef",
    );
    // the tenant's other edits pass
    tenant_machines
        .patch(
            "m",
            &merge,
            &Patch::Merge(json!({"metadata": {"labels": {"rack": "r1"}}})),
        )
        .await
        .unwrap();
    // the manager's ServiceAccount writes it (here: across namespaces, as
    // a buggy or older manager could have: the manager's own check below)
    Api::<Machine>::namespaced(manager.clone(), "tenant-b")
        .patch(
            "m",
            &merge,
            &Patch::Merge(json!({"spec": {"claimRef": {"name": "c", "namespace": "tenant-a"}}})),
        )
        .await
        .unwrap();
    for (what, patch) in [
        (
            "a tenant clearing the claimRef",
            json!({"spec": {"claimRef": null}}),
        ),
        (
            "a tenant changing the claimRef",
            json!({"spec": {"claimRef": {"name": "other"}}}),
        ),
    ] {
        refused_for_claim_ref(
            tenant_machines
                .patch("m", &merge, &Patch::Merge(patch))
                .await,
            what,
        );
    }
    tenant_machines
        .patch(
            "m",
            &merge,
            &Patch::Merge(json!({"metadata": {"labels": {"rack": "r2"}}})),
        )
        .await
        .unwrap();

    // the manager never follows it: tenant-a's claim is bound to "m" by
    // name, but in tenant-a; nothing is planned onto tenant-b's machine
    let held = tenant_machines.get("m").await.unwrap();
    let cfg = anneal_manager::deploy::runs::DeployConfig {
        content_url: Some("http://10.0.0.9:8081".into()),
        ..Default::default()
    };
    let view = anneal_manager::deploy::runs::view(&admin, &held, &cfg)
        .await
        .unwrap();
    assert_eq!(
        view,
        DeployView::NotRead,
        "a claimRef into tenant-a planned"
    );
    let runs = Api::<anneal_api::DeployRun>::namespaced(admin.clone(), "tenant-b")
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(runs.items.is_empty(), "runs in tenant-b: {:?}", runs.items);
}

/// `ca.crt` of ConfigMap `anneal-system/anneal-agent-api-ca`, read as
/// `client`.
async fn published_ca(client: &kube::Client) -> Option<String> {
    use k8s_openapi::api::core::v1::ConfigMap;
    Api::<ConfigMap>::namespaced(client.clone(), "anneal-system")
        .get_opt("anneal-agent-api-ca")
        .await
        .unwrap()?
        .data?
        .remove("ca.crt")
}

/// Hardening 2, "the agent API CA private key sits in the Secret users and
/// bootd are told to read": with deploy/base's RBAC as installed (bootd in
/// the manager's namespace), the manager (as `anneal-manager`) keeps the CA
/// in Secret `anneal-agent-api-ca` and publishes its certificate in
/// ConfigMap `anneal-agent-api-ca` (key `ca.crt`): the certificate the live
/// agent API's chain verifies against. bootd's ServiceAccount reads that
/// ConfigMap but neither the Secret nor a list of Secrets. A ConfigMap
/// edited, or deleted, is put right at the manager's next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_api_ca_key_is_the_managers_alone() {
    use anneal_manager::agentapi;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Patch, PatchParams};
    use tokio_util::sync::CancellationToken;

    let cp = ControlPlane::start().await.unwrap();
    let admin = prepare(&cp, &[]).await;
    apply_manifest(&cp, "deploy/base/rbac-manager.yaml", "anneal-system");
    apply_manifest(&cp, "deploy/base/rbac-bootd.yaml", "anneal-system");
    let (_, manager) = service_account(&cp, "anneal-system", "anneal-manager").await;
    let (_, bootd) = service_account(&cp, "anneal-system", "anneal-bootd").await;

    // the manager's agent API, as its ServiceAccount
    let cancel = CancellationToken::new();
    let api = agentapi::start(manager.clone(), loopback_agent_api(), cancel.clone())
        .await
        .unwrap();
    let ca_pem = api.pki().ca_pem.clone();
    let published = published_ca(&admin).await.expect(
        "ConfigMap anneal-system/anneal-agent-api-ca (key ca.crt) after the agent API started: \
         the manager publishes the CA certificate there (agentapi::ca::load_or_create)",
    );
    assert_eq!(published, ca_pem, "the ConfigMap holds another certificate");
    let secret = Api::<Secret>::namespaced(admin.clone(), "anneal-system")
        .get("anneal-agent-api-ca")
        .await
        .unwrap();
    let data = secret.data.unwrap_or_default();
    assert_eq!(
        data["ca.crt"].0,
        ca_pem.as_bytes(),
        "the Secret's certificate"
    );
    assert!(data.contains_key("ca.key"), "the key stays in the Secret");
    // the live chain: a client trusting only the ConfigMap's certificate
    // completes the TLS handshake and gets an HTTP answer
    let (code, body) = AgentClient::new(api.addr(), &published)
        .register("not-a-boot-token", None)
        .await;
    assert!((400..500).contains(&code), "{code} {body}");

    // bootd's ServiceAccount: the ConfigMap, not the Secret, no list
    let seen = eventually(
        "bootd reads ConfigMap anneal-agent-api-ca",
        WAIT,
        || async {
            match Api::<ConfigMap>::namespaced(bootd.clone(), "anneal-system")
                .get("anneal-agent-api-ca")
                .await
            {
                Ok(c) => c.data?.remove("ca.crt"),
                Err(e) if status_code(&e) == Some(403) => None,
                Err(e) => panic!("reading ConfigMap anneal-agent-api-ca as anneal-bootd: {e}"),
            }
        },
    )
    .await;
    assert_eq!(seen, ca_pem);
    let secrets = Api::<Secret>::namespaced(bootd.clone(), "anneal-system");
    let e = secrets.get("anneal-agent-api-ca").await.unwrap_err();
    assert_eq!(
        status_code(&e),
        Some(403),
        "bootd reads Secret anneal-agent-api-ca, the CA's private key (deploy/base/rbac-bootd.yaml): {e}"
    );
    let e = secrets.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(
        status_code(&e),
        Some(403),
        "bootd lists the Secrets of the manager's namespace (deploy/base/rbac-bootd.yaml): {e}"
    );
    let e = secrets
        .list(&ListParams::default().labels("anneal.dev/boot-token-for"))
        .await
        .unwrap_err();
    assert_eq!(status_code(&e), Some(403), "a label selector lists: {e}");
    // what bootd reads: anneal-boot-tokens, by name
    let e = secrets.get("anneal-boot-tokens").await.unwrap_err();
    assert_eq!(status_code(&e), Some(404), "allowed, not yet written: {e}");
    secrets
        .list(&ListParams::default().fields("metadata.name=anneal-boot-tokens"))
        .await
        .unwrap();
    cancel.cancel();
    drop(api);

    // an edited ConfigMap is corrected at the next start, a deleted one
    // written again; the CA stays the Secret's
    let maps = Api::<ConfigMap>::namespaced(admin.clone(), "anneal-system");
    maps.patch(
        "anneal-agent-api-ca",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"data": {"ca.crt": "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"}})),
    )
    .await
    .unwrap();
    let cancel = CancellationToken::new();
    let api = agentapi::start(manager.clone(), loopback_agent_api(), cancel.clone())
        .await
        .unwrap();
    assert_eq!(api.pki().ca_pem, ca_pem, "the CA changed across a restart");
    let fixed = eventually("the edited ConfigMap corrected", WAIT, || async {
        published_ca(&admin).await.filter(|p| *p == ca_pem)
    })
    .await;
    assert_eq!(fixed, ca_pem);
    cancel.cancel();
    drop(api);
    maps.delete("anneal-agent-api-ca", &Default::default())
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let api = agentapi::start(manager.clone(), loopback_agent_api(), cancel.clone())
        .await
        .unwrap();
    eventually("the deleted ConfigMap written again", WAIT, || async {
        published_ca(&admin).await.filter(|p| *p == ca_pem)
    })
    .await;
    cancel.cancel();
    drop(api);
}
