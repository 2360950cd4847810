//! The Cluster API provider (docs/capi.md) against a real kube-apiserver: no
//! Cluster API controller runs here; the test plays the core's part (a
//! minimal `Cluster` and `Machine` CRD of cluster.x-k8s.io/v1beta2, the
//! Machine owning the AnnealMachine, its bootstrap data Secret) and the
//! anneal side's (the claim's binding, the Machine's state, DeployRuns).
//! Checked: the provider stays off until both API groups are served;
//! `WaitingForBootstrapData` and no claim before `dataSecretName`; then a
//! MachineClaim owned by the AnnealMachine with the Secret (key `value`) as
//! user data, kept in sync with the spec; once the Machine is Provisioned
//! for the claim: providerID, ready, initialization.provisioned and the
//! addresses; a failed DeployRun's message as `DeploymentFailed`; an
//! unreachable BMC as `WaitingForBMC`; deletion deletes the claim and waits
//! for it to go; `clusterctl move`: a moved AnnealMachine (providerID set)
//! takes its Machine over without a deploy (adopted for a new claim, or its
//! former claim taken over), a providerID naming no Machine creates
//! nothing; an AnnealCluster becomes provisioned with its endpoint.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use std::future::Future;
use std::time::{Duration, Instant};

use anneal_api::capi::{AnnealCluster, AnnealMachine};
use anneal_api::{DeployRun, Machine, MachineClaim, Subnet};
use anneal_manager::controller::Scope;
use anneal_testinfra::ControlPlane;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const NS: &str = "capi";
const DEADLINE: Duration = Duration::from_secs(60);

/// Polls `probe` until it returns Some, or fails with `what` and the last
/// thing seen after [`DEADLINE`].
async fn until<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let end = Instant::now() + DEADLINE;
    loop {
        let last = match probe().await {
            Ok(v) => return v,
            Err(last) => last,
        };
        assert!(
            Instant::now() < end,
            "timed out waiting for {what}; last seen: {last}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A minimal CRD of the Cluster API core (v1beta2, schema open).
fn core_crd(kind: &str, plural: &str) -> CustomResourceDefinition {
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.cluster.x-k8s.io")},
        "spec": {
            "group": "cluster.x-k8s.io", "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(),
                      "listKind": format!("{kind}List")},
            "versions": [{"name": "v1beta2", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}}}]
        }
    }))
    .unwrap()
}

fn capi_machine_resource() -> ApiResource {
    ApiResource {
        group: "cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "cluster.x-k8s.io/v1beta2".into(),
        kind: "Machine".into(),
        plural: "machines".into(),
    }
}

fn ready(am: &AnnealMachine) -> (String, String, String) {
    am.status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
        .unwrap_or_default()
}

async fn am_with_reason(api: &Api<AnnealMachine>, name: &str, reason: &str) -> AnnealMachine {
    until(
        &format!("AnnealMachine {name} Ready reason {reason}"),
        || async {
            let am = api.get(name).await.map_err(|e| e.to_string())?;
            let (_, r, m) = ready(&am);
            if r == reason {
                Ok(am)
            } else {
                Err(format!("{r}: {m}"))
            }
        },
    )
    .await
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

async fn create<K>(api: &Api<K>, obj: Value) -> K
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let o: K = serde_json::from_value(obj).unwrap();
    api.create(&PostParams::default(), &o).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annealmachine_claims_deploys_and_releases() {
    let cp = ControlPlane::start().await.unwrap();
    let client: Client = cp.client();

    // Without the kinds the provider stays off; with anneal's alone too.
    assert!(anneal_manager::capi::discover(&client).await.is_none());
    cp.install_crds(&anneal_api::crds()).await.unwrap();
    assert!(anneal_manager::capi::discover(&client).await.is_none());
    cp.install_crds(&[
        core_crd("Cluster", "clusters"),
        core_crd("Machine", "machines"),
    ])
    .await
    .unwrap();
    let served = until("Cluster API kinds served", || async {
        anneal_manager::capi::discover(&client)
            .await
            .ok_or_else(|| "not yet".to_string())
    })
    .await;
    assert_eq!(served.version, "v1beta2");

    let nss: Api<Namespace> = Api::all(client.clone());
    create(
        &nss,
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
    )
    .await;

    let cancel = CancellationToken::new();
    let task = tokio::spawn(anneal_manager::capi::controller(Scope::standalone(
        client.clone(),
        cancel.clone(),
    )));

    // anneal's side: a Subnet holding the Machine's reservation, the Machine
    let subnets: Api<Subnet> = Api::namespaced(client.clone(), NS);
    create(
        &subnets,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
            "metadata": {"name": "lab"},
            "spec": {"siteRef": {"name": "site"}, "cidr": "10.0.0.0/24",
                     "bootd": {"serverIP": "10.0.0.1", "mode": "External"},
                     "dhcp": {"mode": "lease", "gateway": "10.0.0.1",
                              "leaseRange": {"start": "10.0.0.100", "end": "10.0.0.200"}}}}),
    )
    .await;
    merge_status(
        &subnets,
        "lab",
        json!({"dhcp": {"reservations": [
            {"address": "10.0.0.77", "machine": "m1", "mac": "52:54:00:00:00:01"},
            {"address": "10.0.0.78", "machine": "m2", "mac": "52:54:00:00:00:02"}]}}),
    )
    .await;
    let machines: Api<Machine> = Api::namespaced(client.clone(), NS);
    create(
        &machines,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m1", "labels": {"rack": "a"}},
            "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": "52:54:00:00:00:01"}}),
    )
    .await;
    merge_status(&machines, "m1", json!({"state": "Available"})).await;

    // the core's side: the Machine (no bootstrap data yet), then its
    // AnnealMachine, owned by it
    let capi_machines: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), NS, &capi_machine_resource());
    let mut owner = DynamicObject::new("w0", &capi_machine_resource()).within(NS);
    owner.data = json!({"spec": {"clusterName": "c1",
        "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io",
                                    "kind": "KubeadmConfig", "name": "w0"}},
        "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                              "kind": "AnnealMachine", "name": "w0"}}});
    let owner = capi_machines
        .create(&PostParams::default(), &owner)
        .await
        .unwrap();
    let ams: Api<AnnealMachine> = Api::namespaced(client.clone(), NS);
    create(
        &ams,
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "AnnealMachine",
            "metadata": {"name": "w0", "labels": {"cluster.x-k8s.io/cluster-name": "c1"},
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                    "name": "w0", "uid": owner.uid().unwrap(), "controller": true}]},
            "spec": {"selector": {"matchLabels": {"rack": "a"}}, "imageRef": {"name": "debian"},
                "networkData": {"ethernets": [{"name": "eth0", "nic": "boot",
                    "addresses": ["10.0.0.50/24"], "gateway4": "10.0.0.1"}]}}}),
    )
    .await;

    // 1. no bootstrap data: waiting, finalizer on, no claim
    let am = am_with_reason(&ams, "w0", "WaitingForBootstrapData").await;
    assert_eq!(ready(&am).0, "False");
    assert!(
        am.finalizers()
            .iter()
            .any(|f| f == anneal_manager::capi::FINALIZER)
    );
    let claims: Api<MachineClaim> = Api::namespaced(client.clone(), NS);
    assert!(claims.get_opt("w0").await.unwrap().is_none());

    // 2. the bootstrap data Secret appears: a claim with it as user data
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    create(
        &secrets,
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "w0-bootstrap"},
            "stringData": {"value": "#cloud-config\nruncmd: [kubeadm join]\n", "format": "cloud-config"}}),
    )
    .await;
    capi_machines
        .patch(
            "w0",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"bootstrap": {"dataSecretName": "w0-bootstrap"}}})),
        )
        .await
        .unwrap();
    let claim = until("MachineClaim w0", || async {
        claims
            .get_opt("w0")
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "absent".to_string())
    })
    .await;
    let user = claim.spec.user_data.clone().unwrap();
    assert_eq!(
        (user.name.as_str(), user.key.as_deref()),
        ("w0-bootstrap", Some("value"))
    );
    assert_eq!(claim.spec.image_ref.as_ref().unwrap().name, "debian");
    assert_eq!(
        claim.spec.network_data.as_ref().unwrap().ethernets[0]
            .addressing
            .addresses,
        ["10.0.0.50/24"]
    );
    let am = ams.get("w0").await.unwrap();
    let o = &claim.owner_references()[0];
    assert_eq!(
        (o.kind.as_str(), o.uid.as_str(), o.controller),
        ("AnnealMachine", am.uid().unwrap().as_str(), Some(true))
    );
    assert_eq!(
        claim
            .labels()
            .get("cluster.x-k8s.io/cluster-name")
            .map(String::as_str),
        Some("c1")
    );
    let am = am_with_reason(&ams, "w0", "WaitingForMachine").await;
    assert_eq!(
        am.status.as_ref().unwrap().claim_ref.as_ref().unwrap().name,
        "w0"
    );

    // a spec change reaches the claim
    ams.patch(
        "w0",
        &PatchParams::default(),
        &Patch::Merge(&json!({"spec": {"params": {"role": "worker"}}})),
    )
    .await
    .unwrap();
    until("the claim's params synced", || async {
        let c = claims.get("w0").await.map_err(|e| e.to_string())?;
        if c.spec.params.get("role").map(String::as_str) == Some("worker") {
            Ok(())
        } else {
            Err(format!("{:?}", c.spec.params))
        }
    })
    .await;

    // 3. the anneal side binds and deploys (written by hand here)
    machines
        .patch(
            "m1",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"claimRef": {"name": "w0"}}})),
        )
        .await
        .unwrap();
    merge_status(
        &claims,
        "w0",
        json!({"phase": "Bound", "machineName": "m1"}),
    )
    .await;
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), NS);
    create(
        &runs,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": "m1-aaaa0001-1"},
            "spec": {"machineRef": {"name": "m1"}, "claimRef": {"name": "w0"},
                     "imageRef": {"name": "debian"}}}),
    )
    .await;
    merge_status(&runs, "m1-aaaa0001-1", json!({"phase": "Succeeded"})).await;
    merge_status(
        &machines,
        "m1",
        json!({"state": "Provisioned",
               "lastSuccessfulRunRef": {"name": "m1-aaaa0001-1"},
               "lastAttemptedRunRef": {"name": "m1-aaaa0001-1"}}),
    )
    .await;
    let am = am_with_reason(&ams, "w0", "Provisioned").await;
    assert_eq!(am.spec.provider_id.as_deref(), Some("anneal://capi/m1"));
    let st = am.status.clone().unwrap();
    assert_eq!(ready(&am).0, "True");
    assert_eq!(st.ready, Some(true));
    assert_eq!(st.initialization.unwrap().provisioned, Some(true));
    assert_eq!(st.machine_ref.unwrap().name, "m1");
    let addrs: Vec<(String, String)> = st
        .addresses
        .iter()
        .map(|a| (a.type_.clone(), a.address.clone()))
        .collect();
    assert_eq!(
        addrs,
        [
            ("InternalIP".to_string(), "10.0.0.50".to_string()),
            ("InternalIP".into(), "10.0.0.77".into()),
            ("Hostname".into(), "m1".into())
        ]
    );

    // 4. a redeploy that fails: DeploymentFailed quoting the run; the
    // contract's provisioned stays true
    create(
        &runs,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": "m1-bbbb0002-1"},
            "spec": {"machineRef": {"name": "m1"}, "claimRef": {"name": "w0"},
                     "imageRef": {"name": "debian"}}}),
    )
    .await;
    merge_status(
        &runs,
        "m1-bbbb0002-1",
        json!({"phase": "Failed", "conditions": [{"type": "Succeeded", "status": "False",
            "reason": "DeployFailed", "message": "WritingContent: no space left on /dev/sda",
            "lastTransitionTime": "2026-12-01T00:00:00Z"}]}),
    )
    .await;
    merge_status(
        &machines,
        "m1",
        json!({"state": "Provisioning", "lastAttemptedRunRef": {"name": "m1-bbbb0002-1"}}),
    )
    .await;
    let am = am_with_reason(&ams, "w0", "DeploymentFailed").await;
    let (status, _, message) = ready(&am);
    assert_eq!(status, "False");
    assert_eq!(
        message,
        "DeployRun m1-bbbb0002-1 failed: WritingContent: no space left on /dev/sda"
    );
    let st = am.status.clone().unwrap();
    assert_eq!(st.ready, Some(false));
    assert_eq!(st.initialization.unwrap().provisioned, Some(true));

    // 5. the next attempt waits on an unreachable BMC: not a failure
    create(
        &runs,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
            "metadata": {"name": "m1-bbbb0002-2"},
            "spec": {"machineRef": {"name": "m1"}, "claimRef": {"name": "w0"},
                     "imageRef": {"name": "debian"}}}),
    )
    .await;
    merge_status(
        &machines,
        "m1",
        json!({"currentRunRef": {"name": "m1-bbbb0002-2"},
               "lastAttemptedRunRef": {"name": "m1-bbbb0002-2"},
               "conditions": [{"type": "BMCReachable", "status": "False",
                   "reason": "BMCUnreachable", "message": "no answer from redfish://10.1.0.5",
                   "lastTransitionTime": "2026-12-01T00:00:00Z"}]}),
    )
    .await;
    let am = am_with_reason(&ams, "w0", "WaitingForBMC").await;
    assert!(ready(&am).2.contains("10.1.0.5"), "{:?}", ready(&am));

    // 6. deletion: the claim goes first (its release finalizer, the claim
    // controller's, held here by hand), then the AnnealMachine
    claims
        .patch(
            "w0",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": ["anneal.dev/claim-release"]}})),
        )
        .await
        .unwrap();
    ams.delete("w0", &DeleteParams::default()).await.unwrap();
    until("the claim being deleted", || async {
        let c = claims.get("w0").await.map_err(|e| e.to_string())?;
        if c.metadata.deletion_timestamp.is_some() {
            Ok(())
        } else {
            Err("no deletionTimestamp".into())
        }
    })
    .await;
    let am = am_with_reason(&ams, "w0", "Deleting").await;
    assert!(ready(&am).2.contains("Machine m1"), "{:?}", ready(&am));
    claims
        .patch(
            "w0",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    until("the claim and the AnnealMachine gone", || async {
        let c = claims.get_opt("w0").await.map_err(|e| e.to_string())?;
        let a = ams.get_opt("w0").await.map_err(|e| e.to_string())?;
        match (c, a) {
            (None, None) => Ok(()),
            (c, a) => Err(format!(
                "claim present: {}, AnnealMachine present: {}",
                c.is_some(),
                a.is_some()
            )),
        }
    })
    .await;

    // 7. `clusterctl move`: AnnealMachines reappear with new UIDs and
    // spec.providerID set, their claims absent or left by the former ones
    move_keeps_machines_running(&client, &machines, &claims, &ams).await;

    // 8. an AnnealCluster is provisioned once its endpoint is set
    let clusters: Api<AnnealCluster> = Api::namespaced(client.clone(), NS);
    create(
        &clusters,
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "AnnealCluster",
            "metadata": {"name": "c1"}, "spec": {}}),
    )
    .await;
    let cluster_reason = |c: &AnnealCluster| {
        c.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.reason.clone())
            .unwrap_or_default()
    };
    until("AnnealCluster waiting for its endpoint", || async {
        let c = clusters.get("c1").await.map_err(|e| e.to_string())?;
        let r = cluster_reason(&c);
        (r == "WaitingForControlPlaneEndpoint")
            .then_some(())
            .ok_or(r)
    })
    .await;
    clusters
        .patch(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"spec": {"controlPlaneEndpoint": {"host": "10.0.0.2", "port": 6443}}}),
            ),
        )
        .await
        .unwrap();
    let c = until("AnnealCluster provisioned", || async {
        let c = clusters.get("c1").await.map_err(|e| e.to_string())?;
        let st = c.status.clone().unwrap_or_default();
        if st.ready == Some(true) && cluster_reason(&c) == "Provisioned" {
            Ok(st)
        } else {
            Err(format!("{st:?}"))
        }
    })
    .await;
    assert_eq!(c.initialization.unwrap().provisioned, Some(true));

    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the provider stops when cancelled")
        .unwrap();
}

/// A moved AnnealMachine's Machine is taken over by providerID with no
/// deploy: a providerID naming no Machine creates nothing; with the claim
/// absent the Machine is adopted for a new claim (`machineName`) owned by
/// the AnnealMachine; a claim left by the former AnnealMachine is taken
/// over. No DeployRun appears and the Machines stay Provisioned with no run.
async fn move_keeps_machines_running(
    client: &Client,
    machines: &Api<Machine>,
    claims: &Api<MachineClaim>,
    ams: &Api<AnnealMachine>,
) {
    let runs: Api<DeployRun> = Api::namespaced(client.clone(), NS);
    let runs = &runs;
    let moved = |name: &str, id: &str| {
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "AnnealMachine",
            "metadata": {"name": name, "labels": {"cluster.x-k8s.io/cluster-name": "c1"}},
            "spec": {"providerID": id, "selector": {"matchLabels": {"rack": "a"}},
                     "imageRef": {"name": "debian"}}})
    };
    // a Provisioned Machine, deployed for claim `claim` by run `run`
    let provisioned = |m: &'static str, claim: &'static str, run: &'static str| async move {
        create(
            machines,
            json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
                "metadata": {"name": m, "labels": {"rack": "a"}},
                "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": "52:54:00:00:00:02"}}),
        )
        .await;
        machines
            .patch(
                m,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"claimRef": {"name": claim}}})),
            )
            .await
            .unwrap();
        create(
            runs,
            json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
                "metadata": {"name": run},
                "spec": {"machineRef": {"name": m}, "claimRef": {"name": claim},
                         "imageRef": {"name": "debian"}}}),
        )
        .await;
        merge_status(runs, run, json!({"phase": "Succeeded"})).await;
        merge_status(
            machines,
            m,
            json!({"state": "Provisioned", "poweredOn": true,
                   "lastSuccessfulRunRef": {"name": run},
                   "lastAttemptedRunRef": {"name": run}}),
        )
        .await;
    };
    let run_count = || async { runs.list(&Default::default()).await.unwrap().items.len() };

    // a providerID naming no Machine: ProviderIDNotFound, nothing created
    create(ams, moved("w9", "anneal://capi/m9")).await;
    let am = am_with_reason(ams, "w9", "ProviderIDNotFound").await;
    assert!(ready(&am).2.contains("capi/m9"), "{:?}", ready(&am));
    assert!(claims.get_opt("w9").await.unwrap().is_none());

    // the claim is absent, the Machine still names it: adopted, claimed
    provisioned("m2", "w1", "m2-aaaa0001-1").await;
    let before = run_count().await;
    let am = create(ams, moved("w1", "anneal://capi/m2")).await;
    let claim = until("MachineClaim w1", || async {
        claims
            .get_opt("w1")
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "absent".to_string())
    })
    .await;
    assert_eq!(claim.spec.machine_name.as_deref(), Some("m2"));
    assert!(claim.spec.selector.is_none());
    assert_eq!(claim.metadata.generation, Some(1));
    assert_eq!(
        claim.owner_references()[0].uid,
        am.uid().unwrap(),
        "owned by the new AnnealMachine"
    );
    let m2 = machines.get("m2").await.unwrap();
    let adopted = m2.status.as_ref().unwrap().adopted.clone().unwrap();
    assert_eq!(
        (adopted.claim.as_str(), adopted.claim_generation),
        ("w1", 1)
    );
    // the claim controller's part: the Machine names it already
    merge_status(claims, "w1", json!({"phase": "Bound", "machineName": "m2"})).await;
    let am = am_with_reason(ams, "w1", "Provisioned").await;
    assert_eq!(am.spec.provider_id.as_deref(), Some("anneal://capi/m2"));
    let st = am.status.clone().unwrap();
    assert_eq!(st.ready, Some(true));
    assert_eq!(st.initialization.unwrap().provisioned, Some(true));
    assert_eq!(st.machine_ref.unwrap().name, "m2");

    // a claim left by the former AnnealMachine (its UID gone): taken over
    provisioned("m3", "w2", "m3-aaaa0001-1").await;
    create(
        claims,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "MachineClaim",
            "metadata": {"name": "w2", "ownerReferences": [{
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                "kind": "AnnealMachine", "name": "w2",
                "uid": "00000000-0000-0000-0000-00000000dead", "controller": true}]},
            "spec": {"selector": {"matchLabels": {"rack": "a"}}, "imageRef": {"name": "debian"},
                     "userData": {"name": "w2-bootstrap", "key": "value"}}}),
    )
    .await;
    merge_status(claims, "w2", json!({"phase": "Bound", "machineName": "m3"})).await;
    let generation = claims.get("w2").await.unwrap().metadata.generation;
    let am = create(ams, moved("w2", "anneal://capi/m3")).await;
    let am = {
        let got = am_with_reason(ams, "w2", "Provisioned").await;
        assert_eq!(got.uid(), am.uid());
        got
    };
    let claim = claims.get("w2").await.unwrap();
    let owners: Vec<&str> = claim
        .owner_references()
        .iter()
        .map(|o| o.uid.as_str())
        .collect();
    assert_eq!(owners, [am.uid().unwrap().as_str()]);
    assert_eq!(claim.metadata.generation, generation, "spec untouched");
    assert_eq!(claim.spec.user_data.unwrap().name, "w2-bootstrap");

    // no deploy: no DeployRun, no run or power request on the Machines
    assert_eq!(
        run_count().await,
        before + 1,
        "only m3's own, written above"
    );
    for m in ["m2", "m3"] {
        let st = machines.get(m).await.unwrap().status.unwrap();
        assert_eq!(st.state, Some(anneal_api::MachineState::Provisioned), "{m}");
        assert!(st.current_run_ref.is_none(), "{m}");
        assert_eq!(st.powered_on, Some(true), "{m}");
        assert_eq!(
            st.last_successful_run_ref.unwrap().name,
            format!("{m}-aaaa0001-1")
        );
    }
    // the Events
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client.clone(), NS);
    for name in ["w1", "w2"] {
        until(
            &format!("Event AdoptedProvisionedClaim on {name}"),
            || async {
                let list = events
                    .list(&Default::default())
                    .await
                    .map_err(|e| e.to_string())?;
                list.items
                    .iter()
                    .any(|e| {
                        e.reason.as_deref() == Some("AdoptedProvisionedClaim")
                            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                    })
                    .then_some(())
                    .ok_or_else(|| format!("{} events", list.items.len()))
            },
        )
        .await;
    }
}
