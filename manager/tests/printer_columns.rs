//! The printer columns answer the first question about each kind, as the
//! real kube-apiserver renders them (`kubectl get` asks for
//! `application/json;as=Table;v=v1;g=meta.k8s.io`): Machine (state,
//! operational status, claim, image, deploy %, age), DeployRun (machine,
//! phase, %, rate, age), Subnet (DHCP mode, reservations, bootd ready,
//! pool exhausted, applied revision), PartitionContent (state, file system,
//! used), Image (state, slots, size), and every kind is in the category
//! `anneal` with a short name.
//! (A JSONPath column shows only the first match of `[*]`: counts such as
//! an Image's slots or a Subnet's reservations need a status field.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(clippy::too_many_lines)]

use anneal_api::{DeployRun, Image, Machine, PartitionContent, Subnet};
use anneal_testinfra::ControlPlane;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

async fn table(cp: &ControlPlane, ns: &str, plural: &str) -> Value {
    anneal_testinfra::get_table(&cp.client(), ns, plural)
        .await
        .unwrap()
}

fn columns(t: &Value, wide: bool) -> (Vec<String>, Vec<Value>) {
    anneal_testinfra::table_row(t, 0, wide)
}

fn cell<'a>(names: &[String], values: &'a [Value], name: &str) -> &'a Value {
    let i = names
        .iter()
        .position(|n| n == name)
        .unwrap_or_else(|| panic!("no column {name} in {names:?}"));
    &values[i]
}

async fn create<K>(api: &Api<K>, obj: Value, status: Option<Value>)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let o: K = serde_json::from_value(obj).unwrap();
    let created = api.create(&PostParams::default(), &o).await.unwrap();
    if let Some(s) = status {
        let name = created.meta().name.clone().unwrap();
        api.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": s })),
        )
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_show_the_first_question_of_each_kind() {
    let cp = ControlPlane::start().await.unwrap();
    let crds = anneal_api::crds();
    for crd in &crds {
        let names = &crd.spec.names;
        // (the Cluster API provider's kinds are also in `cluster-api`)
        assert!(
            names
                .categories
                .as_deref()
                .unwrap_or_default()
                .contains(&"anneal".to_string()),
            "{} is not in the category anneal",
            names.kind
        );
        assert!(
            names.short_names.as_ref().is_some_and(|s| !s.is_empty()),
            "{} has no short name",
            names.kind
        );
    }
    cp.install_crds(&crds).await.unwrap();
    let ns = "default";

    let machines: Api<Machine> = Api::namespaced(cp.client(), ns);
    create(
        &machines,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Machine",
               "metadata": {"name": "m1"},
               "spec": {"subnetRef": {"name": "lab"}, "bootMACAddress": "52:54:00:00:00:01",
                        "claimRef": {"name": "c1"}}}),
        Some(
            json!({"state": "Provisioning", "operationalStatus": "OK", "poweredOn": true,
                    "deploy": {"image": "ubuntu", "phase": "WritingContent", "percent": 37}}),
        ),
    )
    .await;
    let t = table(&cp, ns, "machines").await;
    let (names, values) = columns(&t, false);
    assert_eq!(
        names,
        [
            "Name",
            "State",
            "Operational",
            "Claim",
            "Image",
            "Deploy%",
            "Cordoned",
            "Powered",
            "Age"
        ],
        "{t}"
    );
    assert_eq!(cell(&names, &values, "Name"), "m1");
    assert_eq!(cell(&names, &values, "State"), "Provisioning");
    assert_eq!(cell(&names, &values, "Operational"), "OK");
    assert_eq!(cell(&names, &values, "Claim"), "c1");
    assert_eq!(cell(&names, &values, "Image"), "ubuntu");
    assert_eq!(cell(&names, &values, "Deploy%"), 37);
    assert!(
        cell(&names, &values, "Age")
            .as_str()
            .is_some_and(|a| !a.is_empty()),
        "{t}"
    );
    let (wide, wvalues) = columns(&t, true);
    assert_eq!(cell(&wide, &wvalues, "MAC"), "52:54:00:00:00:01");

    let runs: Api<DeployRun> = Api::namespaced(cp.client(), ns);
    create(
        &runs,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "DeployRun",
               "metadata": {"name": "m1-0123abcd-1"},
               "spec": {"machineRef": {"name": "m1"}, "claimRef": {"name": "c1"},
                        "imageRef": {"name": "ubuntu"}}}),
        Some(json!({"phase": "WritingContent", "percent": 37, "throughputMiBps": 112})),
    )
    .await;
    let t = table(&cp, ns, "deployruns").await;
    let (names, values) = columns(&t, false);
    assert_eq!(
        names,
        [
            "Name", "Machine", "Phase", "Percent", "MiB/s", "Image", "Age"
        ],
        "{t}"
    );
    assert_eq!(cell(&names, &values, "Machine"), "m1");
    assert_eq!(cell(&names, &values, "Phase"), "WritingContent");
    assert_eq!(cell(&names, &values, "Percent"), 37);
    assert_eq!(cell(&names, &values, "MiB/s"), 112);
    let (wide, wvalues) = columns(&t, true);
    assert_eq!(cell(&wide, &wvalues, "Claim"), "c1");

    let subnets: Api<Subnet> = Api::namespaced(cp.client(), ns);
    create(
        &subnets,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Subnet",
               "metadata": {"name": "lab"},
               "spec": {"siteRef": {"name": "s"}, "cidr": "10.0.0.0/24",
                        "bootd": {"serverIP": "10.0.0.1", "mode": "External"},
                        "dhcp": {"mode": "lease", "gateway": "",
                                 "leaseRange": {"start": "10.0.0.100", "end": "10.0.0.200"}}}}),
        Some(
            json!({"dhcp": {"revision": "r1", "appliedRevision": "r1", "reservations": [
                        {"address": "10.0.0.100", "machine": "m1", "mac": "52:54:00:00:00:01",
                         "since": "2026-12-01T00:00:00Z"}]},
                    "reservationCount": 1, "bootdReady": true,
                    "conditions": [{"type": "DHCPPoolExhausted", "status": "False",
                                    "reason": "AddressesAvailable", "message": "",
                                    "lastTransitionTime": "2026-12-01T00:00:00Z"}]}),
        ),
    )
    .await;
    let t = table(&cp, ns, "subnets").await;
    let (names, values) = columns(&t, true);
    println!("subnets: {names:?} {values:?}");
    assert_eq!(cell(&names, &values, "DHCP"), "lease");
    assert_eq!(cell(&names, &values, "Pool Exhausted"), "False");
    assert_eq!(cell(&names, &values, "Applied"), "r1");
    // The count and bootd's readiness (status fields the IPAM controller
    // writes, set here by hand as no manager runs; manager_ipam.rs tests that
    // the controller writes them).
    assert_eq!(cell(&names, &values, "Reservations"), 1, "{t}");
    assert_eq!(cell(&names, &values, "Bootd Ready"), true, "{t}");
    let (names, _) = columns(&t, false);
    assert_eq!(
        names,
        [
            "Name",
            "Site",
            "CIDR",
            "Bootd",
            "DHCP",
            "Reservations",
            "Bootd Ready",
            "Pool Exhausted",
            "Age"
        ],
        "{t}"
    );

    // PartitionContent: state, file system, used bytes.
    let contents: Api<PartitionContent> = Api::namespaced(cp.client(), ns);
    create(
        &contents,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "PartitionContent",
               "metadata": {"name": "ubuntu-p2"},
               "spec": {"fsType": "ext4", "usedBytes": 1_500_000_000_i64,
                        "sizeBytes": 4_294_967_296_i64, "lastExtentEnd": 4_000_000_000_i64,
                        "blockSize": 4096, "pieceLength": 4_194_304}}),
        Some(json!({"state": "Ready"})),
    )
    .await;
    let t = table(&cp, ns, "partitioncontents").await;
    let (names, values) = columns(&t, false);
    assert_eq!(names, ["Name", "State", "FS", "Used", "Size", "Age"], "{t}");
    assert_eq!(cell(&names, &values, "State"), "Ready");
    assert_eq!(cell(&names, &values, "FS"), "ext4");
    assert_eq!(cell(&names, &values, "Used"), 1_500_000_000_i64);
    assert_eq!(cell(&names, &values, "Size"), 4_294_967_296_i64);

    // Image: state, slots, size (status fields the Image controller
    // writes; its `sizes` is unit-tested in content/images.rs).
    let images: Api<Image> = Api::namespaced(cp.client(), ns);
    create(
        &images,
        json!({"apiVersion": "anneal.dev/v1alpha1", "kind": "Image",
               "metadata": {"name": "ubuntu"},
               "spec": {"bootable": true, "layout": {"partitionTable": "gpt", "slots": [
                   {"number": 1, "role": "esp", "sizeBytes": 536_870_912},
                   {"number": 2, "role": "data", "contentRef": {"name": "ubuntu-p2"}}]}}}),
        Some(
            json!({"state": "Ready", "slots": 2, "sizeBytes": 4_831_838_208_i64,
                    "usedBytes": 1_500_000_000_i64}),
        ),
    )
    .await;
    let t = table(&cp, ns, "images").await;
    let (names, values) = columns(&t, false);
    assert_eq!(
        names,
        ["Name", "State", "OS", "Bootable", "Slots", "Size", "Age"],
        "{t}"
    );
    assert_eq!(cell(&names, &values, "State"), "Ready");
    assert_eq!(cell(&names, &values, "Slots"), 2);
    assert_eq!(cell(&names, &values, "Size"), 4_831_838_208_i64);
    let (wide, wvalues) = columns(&t, true);
    assert_eq!(cell(&wide, &wvalues, "Used"), 1_500_000_000_i64);
    assert_eq!(cell(&wide, &wvalues, "Table"), "gpt");
}
