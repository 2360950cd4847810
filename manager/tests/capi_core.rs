//! The Cluster API provider under the real Cluster API (docs/capi.md, "Under
//! the real Cluster API"): the core manager and the kubeadm bootstrap manager
//! of `sigs.k8s.io/cluster-api` (built by tests/setup.sh from
//! tests/controlplane/capi, their CRDs copied from the module) run against a
//! real kube-apiserver beside anneal's Cluster API and claim controllers. The
//! test plays only what is not Cluster API's nor anneal's controllers' part: a
//! control plane provider (a `TestControlPlane` object reporting an
//! initialized control plane, the cluster CA and kubeconfig Secrets, the
//! workload cluster being this same API server) and the deploy (a DeployRun
//! and the Machine's Provisioned state; no VM).
//!
//! Checked: a Cluster on an AnnealCluster and a MachineDeployment of one
//! worker (AnnealMachineTemplate, KubeadmConfigTemplate): the MachineSet
//! makes a Cluster API Machine and an AnnealMachine from the template;
//! kubeadm's bootstrap controller writes the join cloud-config Secret (a
//! bootstrap token in the workload cluster); anneal makes a MachineClaim
//! with it as user data and binds it to an Available Machine; once that is
//! Provisioned the Cluster API Machine has `spec.providerID`
//! `anneal://<ns>/<machine>`, the AnnealMachine's addresses and phase
//! `Provisioned`; a Node of that providerID makes it `Running`; scaling the
//! MachineDeployment to 0 deletes the Machine, the AnnealMachine and the
//! claim, and the anneal Machine is released.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anneal_api::capi::AnnealMachine;
use anneal_api::{Machine, MachineClaim, MachineState};
use anneal_manager::controller::Scope;
use anneal_testinfra::{ChildGroup, ControlPlane, cache_dir, cached_bin, free_port, tail_file};
use k8s_openapi::api::core::v1::{Namespace, Node, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const NS: &str = "capi-core";
const CLUSTER: &str = "c1";
const MD: &str = "workers";
const DEADLINE: Duration = Duration::from_secs(45);
const VERSION: &str = "v1.34.2";
/// The release tests/controlplane/capi pins (its go.mod).
const CAPI_VERSION: &str = "v1.13.6";

/// The Cluster API managers the test started, with their logs.
struct Managers {
    procs: Vec<(ChildGroup, PathBuf)>,
}

impl Managers {
    /// Fails (with the log's tail) when a manager has exited.
    fn check(&mut self) {
        for (p, log) in &mut self.procs {
            if let Some(status) = p.try_exit() {
                panic!(
                    "{} exited ({status}); log {}:\n{}",
                    log.display(),
                    log.display(),
                    tail_file(log)
                );
            }
        }
    }

    fn tails(&self) -> String {
        self.procs
            .iter()
            .map(|(_, log)| format!("--- {}:\n{}", log.display(), tail_file(log)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn kill(&mut self) {
        for (p, _) in &mut self.procs {
            p.kill();
        }
    }
}

/// Polls `probe` until it returns Ok, or fails with `what`, the last thing
/// seen and the managers' logs after [`DEADLINE`].
async fn until<T, F, Fut>(mgrs: &mut Managers, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    let end = start + DEADLINE;
    loop {
        let last = match probe().await {
            Ok(v) => {
                println!(
                    "capi_core: {what} after {:.1} s",
                    start.elapsed().as_secs_f64()
                );
                return v;
            }
            Err(last) => last,
        };
        mgrs.check();
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}; last seen: {last}\n{}",
            mgrs.tails()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn ar(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: kind.into(),
        plural: plural.into(),
    }
}

fn dyn_api(client: &Client, r: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), NS, r)
}

async fn create_dyn(api: &Api<DynamicObject>, r: &ApiResource, name: &str, body: Value) {
    let mut o = DynamicObject::new(name, r).within(NS);
    if let Some(labels) = body.pointer("/metadata/labels") {
        o.metadata.labels = Some(serde_json::from_value(labels.clone()).unwrap());
    }
    o.data = body;
    if let Some(m) = o.data.as_object_mut() {
        m.remove("metadata");
    }
    api.create(&PostParams::default(), &o)
        .await
        .unwrap_or_else(|e| panic!("creating {} {name}: {e}", r.kind));
}

async fn create<K>(api: &Api<K>, obj: Value) -> K
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let o: K = serde_json::from_value(obj).unwrap();
    api.create(&PostParams::default(), &o).await.unwrap()
}

async fn merge_status<K>(api: &Api<K>, name: &str, status: Value)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "status": status })),
    )
    .await
    .unwrap();
}

/// The Cluster API CRDs tests/setup.sh copied from the module (the core's
/// and kubeadm bootstrap's `config/crd/bases`), as served with no
/// conversion webhook (the bases carry none; kustomize adds it) and the
/// contract labels kustomize adds to the bootstrap provider's.
fn capi_crds(dir: &Path) -> Vec<CustomResourceDefinition> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| {
            panic!(
                "{} is missing ({e}): run `bash tests/setup.sh` (it builds the Cluster API managers and copies their CRDs)",
                dir.display()
            )
        })
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 15,
        "{} holds {} CRDs: run `bash tests/setup.sh`",
        dir.display(),
        files.len()
    );
    files
        .iter()
        .map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            let mut v: Value =
                serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if let Some(spec) = v.get_mut("spec").and_then(Value::as_object_mut) {
                spec.remove("conversion");
            }
            if v.pointer("/spec/group").and_then(Value::as_str)
                == Some("bootstrap.cluster.x-k8s.io")
            {
                v["metadata"]["labels"] = json!({
                    "cluster.x-k8s.io/v1beta1": "v1beta1",
                    "cluster.x-k8s.io/v1beta2": "v1beta2",
                });
            }
            serde_json::from_value(v).unwrap_or_else(|e| panic!("{}: {e}", f.display()))
        })
        .collect()
}

/// A control plane provider's kind the test plays (schema open), with the
/// contract label that makes it a v1beta2 control plane.
fn test_control_plane_crd() -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "testcontrolplanes.controlplane.test.anneal.dev",
                     "labels": {"cluster.x-k8s.io/v1beta2": "v1alpha1"}},
        "spec": {
            "group": "controlplane.test.anneal.dev", "scope": "Namespaced",
            "names": {"kind": "TestControlPlane", "plural": "testcontrolplanes",
                      "singular": "testcontrolplane", "listKind": "TestControlPlaneList"},
            "versions": [{"name": "v1alpha1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}]
        }
    }))
    .unwrap()
}

/// Starts one Cluster API manager against the control plane: no leader
/// election, metrics and health endpoints off, the webhook server (which
/// the API server never calls: no webhook configuration is installed) on a
/// free port with a throw-away certificate, MachinePool off.
fn start_manager(cp: &ControlPlane, bin: &str, certs: &Path) -> (ChildGroup, PathBuf) {
    let path = cached_bin(bin).unwrap_or_else(|e| {
        panic!("{e:#} (tests/setup.sh builds the Cluster API managers, tests/setup.d/capi.sh)")
    });
    let log = cp.dir().join(format!("{bin}.log"));
    let child = ChildGroup::spawn_logged(
        bin,
        Command::new(path)
            .arg(format!("--kubeconfig={}", cp.kubeconfig_path().display()))
            .arg("--leader-elect=false")
            .arg("--diagnostics-address=0")
            .arg("--insecure-diagnostics")
            .arg("--health-addr=0")
            .arg(format!("--webhook-port={}", free_port().unwrap()))
            .arg(format!("--webhook-cert-dir={}", certs.display()))
            .arg("--feature-gates=MachinePool=false")
            .arg("--sync-period=1m")
            .arg("--v=2"),
        &log,
    )
    .unwrap();
    (child, log)
}

fn phase(o: &DynamicObject) -> String {
    o.data
        .pointer("/status/phase")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_deployment_on_anneal_machines() {
    let begin = Instant::now();
    let crd_dir = cache_dir().join("capi-crds");
    let crds = capi_crds(&crd_dir);
    for bin in ["capi-manager", "capi-kubeadm-bootstrap-manager"] {
        cached_bin(bin).unwrap_or_else(|e| {
            panic!("{e:#} (tests/setup.sh builds the Cluster API managers, tests/setup.d/capi.sh)")
        });
    }

    let cp = ControlPlane::start().await.unwrap();
    let client: Client = cp.client();
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    cp.install_crds(&crds).await.unwrap();
    cp.install_crds(&[test_control_plane_crd()]).await.unwrap();
    println!(
        "capi_core: control plane and CRDs ready after {:.1} s",
        begin.elapsed().as_secs_f64()
    );

    // the webhook servers' certificate (never used: no webhook is registered)
    let pki = anneal_testinfra::test_pki("capi-webhooks").unwrap();
    let certs = cp.dir().join("capi-webhook-certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::write(certs.join("tls.crt"), &pki.leaf_pem).unwrap();
    std::fs::write(certs.join("tls.key"), &pki.key_pem).unwrap();
    let mut mgrs = Managers {
        procs: vec![
            start_manager(&cp, "capi-manager", &certs),
            start_manager(&cp, "capi-kubeadm-bootstrap-manager", &certs),
        ],
    };

    let nss: Api<Namespace> = Api::all(client.clone());
    create(
        &nss,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
    )
    .await;

    // anneal: the provider's and the claim controller, one Available Machine
    let cancel = CancellationToken::new();
    let capi_task = tokio::spawn(anneal_manager::capi::controller(Scope::standalone(
        client.clone(),
        cancel.clone(),
    )));
    let claims_task = tokio::spawn(anneal_manager::claims::controller(
        Scope::standalone(client.clone(), cancel.clone()),
        4,
    ));
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
    create(
        &machines,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m1", "labels": {"pool": "k8s"}},
            "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": "52:54:00:00:00:01"}}),
    )
    .await;
    merge_status(&machines, "m1", json!({"state": "Available"})).await;

    // the control plane provider's part, played: the workload cluster is
    // this API server (its kubeconfig Secret), the cluster CA its CA (a
    // worker's KubeadmConfig reads only the certificate, for the join's
    // caCertHashes), the control plane initialized at VERSION
    let endpoint = cp.url().trim_start_matches("https://").to_string();
    let (host, port) = endpoint.rsplit_once(':').unwrap();
    let port: u16 = port.parse().unwrap();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let ca = std::fs::read_to_string(cp.dir().join("ca.crt")).unwrap();
    let cluster_label = json!({"cluster.x-k8s.io/cluster-name": CLUSTER});
    create(
        &secrets,
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": format!("{CLUSTER}-ca"), "labels": cluster_label},
            "type": "cluster.x-k8s.io/secret",
            "stringData": {"tls.crt": ca, "tls.key": pki.key_pem}}),
    )
    .await;
    create(
        &secrets,
        json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": format!("{CLUSTER}-kubeconfig"), "labels": cluster_label},
            "type": "cluster.x-k8s.io/secret",
            "stringData": {"value": std::fs::read_to_string(cp.kubeconfig_path()).unwrap()}}),
    )
    .await;
    let tcp = ar(
        "controlplane.test.anneal.dev",
        "v1alpha1",
        "TestControlPlane",
        "testcontrolplanes",
    );
    let tcps = dyn_api(&client, &tcp);
    create_dyn(
        &tcps,
        &tcp,
        CLUSTER,
        json!({"spec": {"version": VERSION,
            "controlPlaneEndpoint": {"host": host, "port": port}}}),
    )
    .await;
    tcps.patch_status(
        CLUSTER,
        &PatchParams::default(),
        &Patch::Merge(&json!({"status": {"version": VERSION,
            "initialization": {"controlPlaneInitialized": true}}})),
    )
    .await
    .unwrap();

    // the user's objects: AnnealCluster, Cluster, templates, MachineDeployment
    let infra = "infrastructure.cluster.x-k8s.io";
    let anneal_clusters = ar(infra, "v1alpha1", "AnnealCluster", "annealclusters");
    create_dyn(
        &dyn_api(&client, &anneal_clusters),
        &anneal_clusters,
        CLUSTER,
        json!({"spec": {"controlPlaneEndpoint": {"host": host, "port": port}}}),
    )
    .await;
    let cluster = ar("cluster.x-k8s.io", "v1beta2", "Cluster", "clusters");
    let clusters = dyn_api(&client, &cluster);
    create_dyn(
        &clusters,
        &cluster,
        CLUSTER,
        json!({"spec": {
            "controlPlaneEndpoint": {"host": host, "port": port},
            "controlPlaneRef": {"apiGroup": "controlplane.test.anneal.dev",
                                "kind": "TestControlPlane", "name": CLUSTER},
            "infrastructureRef": {"apiGroup": infra, "kind": "AnnealCluster", "name": CLUSTER}}}),
    )
    .await;
    let amt = ar(
        infra,
        "v1alpha1",
        "AnnealMachineTemplate",
        "annealmachinetemplates",
    );
    create_dyn(
        &dyn_api(&client, &amt),
        &amt,
        MD,
        json!({"spec": {"template": {"spec": {
            "selector": {"matchLabels": {"pool": "k8s"}},
            "imageRef": {"name": "debian-12-kubeadm"}}}}}),
    )
    .await;
    let kct = ar(
        "bootstrap.cluster.x-k8s.io",
        "v1beta2",
        "KubeadmConfigTemplate",
        "kubeadmconfigtemplates",
    );
    create_dyn(
        &dyn_api(&client, &kct),
        &kct,
        MD,
        json!({"spec": {"template": {"spec": {"joinConfiguration": {"nodeRegistration": {
            "kubeletExtraArgs": [{"name": "node-labels", "value": "anneal.dev/pool=k8s"}]}}}}}}),
    )
    .await;
    let md = ar(
        "cluster.x-k8s.io",
        "v1beta2",
        "MachineDeployment",
        "machinedeployments",
    );
    let mds = dyn_api(&client, &md);
    let md_labels = json!({"cluster.x-k8s.io/cluster-name": CLUSTER,
                           "cluster.x-k8s.io/deployment-name": MD});
    create_dyn(
        &mds,
        &md,
        MD,
        json!({"metadata": {"labels": {"cluster.x-k8s.io/cluster-name": CLUSTER}},
            "spec": {
            "clusterName": CLUSTER, "replicas": 1,
            "selector": {"matchLabels": md_labels},
            // what the defaulting webhook (not registered here) would add
            "rollout": {"strategy": {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}},
            "template": {"metadata": {"labels": md_labels}, "spec": {
                "clusterName": CLUSTER, "version": VERSION,
                "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io",
                    "kind": "KubeadmConfigTemplate", "name": MD}},
                "infrastructureRef": {"apiGroup": infra,
                    "kind": "AnnealMachineTemplate", "name": MD}}}}}),
    )
    .await;

    // 1. the Cluster: infrastructure provisioned (AnnealCluster), control
    // plane initialized (the played provider)
    until(&mut mgrs, "the Cluster initialized", || async {
        let c = clusters.get(CLUSTER).await.map_err(|e| e.to_string())?;
        let init = c.data.pointer("/status/initialization").cloned();
        let ok = init.as_ref().is_some_and(|i| {
            i.get("infrastructureProvisioned") == Some(&json!(true))
                && i.get("controlPlaneInitialized") == Some(&json!(true))
        });
        ok.then_some(()).ok_or_else(|| format!("{init:?}"))
    })
    .await;

    // 2. the MachineSet makes a Machine, its AnnealMachine from the template
    // and its KubeadmConfig; kubeadm writes the bootstrap data Secret
    let machine = ar("cluster.x-k8s.io", "v1beta2", "Machine", "machines");
    let capi_machines = dyn_api(&client, &machine);
    let selector = format!("cluster.x-k8s.io/deployment-name={MD}");
    let m = until(
        &mut mgrs,
        "a Machine of the MachineDeployment with bootstrap data",
        || async {
            let list = capi_machines
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(|e| e.to_string())?;
            let m = list.items.first().ok_or("no Machine")?;
            m.data
                .pointer("/spec/bootstrap/dataSecretName")
                .and_then(Value::as_str)
                .map(|_| m.clone())
                .ok_or_else(|| format!("no dataSecretName: {}", m.data["status"]))
        },
    )
    .await;
    let m_name = m.name_any();
    let am_name = m.data["spec"]["infrastructureRef"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let data_secret = m.data["spec"]["bootstrap"]["dataSecretName"]
        .as_str()
        .unwrap()
        .to_string();
    let ams: Api<AnnealMachine> = Api::namespaced(client.clone(), NS);
    let am = ams.get(&am_name).await.unwrap();
    let owner = am
        .owner_references()
        .iter()
        .find(|o| o.kind == "Machine")
        .expect("the AnnealMachine is owned by the Machine");
    assert_eq!(owner.name, m_name);
    assert_eq!(
        am.spec.image_ref.as_ref().unwrap().name,
        "debian-12-kubeadm",
        "the AnnealMachine's spec is the template's"
    );
    assert_eq!(
        am.labels()
            .get("cluster.x-k8s.io/cluster-name")
            .map(String::as_str),
        Some(CLUSTER)
    );
    let data = secrets.get(&data_secret).await.unwrap();
    let value = data.data.as_ref().unwrap()["value"].0.clone();
    let value = String::from_utf8(value).unwrap();
    assert!(
        value.contains("kubeadm join") && value.contains("anneal.dev/pool=k8s"),
        "kubeadm's join cloud-config: {value}"
    );

    // 3. anneal: a MachineClaim with that Secret as user data, bound by the
    // claim controller to the Available Machine
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), NS);
    let claim = until(&mut mgrs, "the MachineClaim bound", || async {
        let c = claims
            .get_opt(&am_name)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("no claim")?;
        let bound = c.status.as_ref().and_then(|s| s.machine_name.as_deref()) == Some("m1");
        bound
            .then(|| c.clone())
            .ok_or_else(|| format!("{:?}", c.status))
    })
    .await;
    let user = claim.spec.user_data.clone().unwrap();
    assert_eq!(
        (user.name.as_str(), user.key.as_deref()),
        (data_secret.as_str(), Some("value"))
    );
    assert_eq!(
        claim.owner_references()[0].uid,
        am.uid().unwrap(),
        "owned by the AnnealMachine"
    );

    // 4. the deploy, played: a DeployRun of the claim that succeeded, the
    // Machine Provisioned by it
    let runs: Api<anneal_api::DeployRun> = Api::namespaced(client.clone(), NS);
    create(
        &runs,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": "m1-aaaa0001-1"},
            "spec": {"machineRef": {"name": "m1"}, "claimRef": {"name": am_name},
                     "imageRef": {"name": "debian-12-kubeadm"}}}),
    )
    .await;
    merge_status(&runs, "m1-aaaa0001-1", json!({"phase": "Succeeded"})).await;
    merge_status(
        &machines,
        "m1",
        json!({"state": "Provisioned", "poweredOn": true,
               "lastSuccessfulRunRef": {"name": "m1-aaaa0001-1"},
               "lastAttemptedRunRef": {"name": "m1-aaaa0001-1"}}),
    )
    .await;

    // 5. the Cluster API Machine: providerID, infrastructure provisioned,
    // the AnnealMachine's addresses, phase Provisioned
    let provider_id = format!("anneal://{NS}/m1");
    let m = until(&mut mgrs, "the Machine Provisioned", || async {
        let m = capi_machines
            .get(&m_name)
            .await
            .map_err(|e| e.to_string())?;
        let id = m.data.pointer("/spec/providerID").and_then(Value::as_str);
        if phase(&m) == "Provisioned" && id == Some(provider_id.as_str()) {
            Ok(m)
        } else {
            Err(format!("phase {}, providerID {id:?}", phase(&m)))
        }
    })
    .await;
    assert_eq!(
        m.data
            .pointer("/status/initialization/infrastructureProvisioned"),
        Some(&json!(true))
    );
    assert_eq!(
        m.data
            .pointer("/status/initialization/bootstrapDataSecretCreated"),
        Some(&json!(true))
    );
    assert!(
        m.data
            .pointer("/status/addresses")
            .and_then(Value::as_array)
            .is_some_and(|a| a
                .iter()
                .any(|a| a["type"] == "Hostname" && a["address"] == "m1")),
        "the AnnealMachine's addresses: {}",
        m.data["status"]
    );

    // 6. the kubelet registers the Node with --provider-id (played): the
    // Machine is Running with its nodeRef
    let nodes: Api<Node> = Api::all(client.clone());
    create(
        &nodes,
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "m1"},
            "spec": {"providerID": provider_id}}),
    )
    .await;
    until(&mut mgrs, "the Machine Running on Node m1", || async {
        let m = capi_machines
            .get(&m_name)
            .await
            .map_err(|e| e.to_string())?;
        let node = m
            .data
            .pointer("/status/nodeRef/name")
            .and_then(Value::as_str);
        if phase(&m) == "Running" && node == Some("m1") {
            Ok(())
        } else {
            Err(format!("phase {}, nodeRef {node:?}", phase(&m)))
        }
    })
    .await;

    // 7. scale to 0: the Machine, the AnnealMachine and the claim go; the
    // anneal Machine is released
    mds.patch(
        MD,
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"replicas": 0}})),
    )
    .await
    .unwrap();
    until(
        &mut mgrs,
        "the Machine, AnnealMachine and claim deleted",
        || async {
            let m = capi_machines
                .get_opt(&m_name)
                .await
                .map_err(|e| e.to_string())?;
            let a = ams.get_opt(&am_name).await.map_err(|e| e.to_string())?;
            let c = claims.get_opt(&am_name).await.map_err(|e| e.to_string())?;
            match (&m, &a, &c) {
                (None, None, None) => Ok(()),
                _ => Err(format!(
                    "Machine {:?}, AnnealMachine {}, claim {}",
                    m.as_ref().map(phase),
                    a.is_some(),
                    c.is_some()
                )),
            }
        },
    )
    .await;
    let m1 = machines.get("m1").await.unwrap();
    assert!(m1.spec.claim_ref.is_none(), "released: {:?}", m1.spec);
    assert_eq!(
        m1.status.unwrap().state,
        Some(MachineState::Released),
        "Retain keeps the disks: Released"
    );

    cancel.cancel();
    for t in [capi_task, claims_task] {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("anneal's controllers stop when cancelled")
            .unwrap();
    }
    mgrs.kill();
    println!(
        "capi_core: Cluster API {CAPI_VERSION} managers, MachineDeployment up, Provisioned, Running and scaled to 0 in {:.1} s",
        begin.elapsed().as_secs_f64()
    );
}
