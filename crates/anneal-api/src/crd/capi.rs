//! The Cluster API infrastructure provider's kinds (docs/capi.md), group
//! `infrastructure.cluster.x-k8s.io`, version `v1alpha1`: AnnealCluster
//! (InfraCluster), AnnealMachine (InfraMachine) and AnnealMachineTemplate
//! (InfraMachineTemplate), following the Cluster API provider contract
//! v1beta2 (Cluster API v1.11 and later) with the v1beta1 `status.ready`
//! fields kept for older cores (docs/capi.md).
//!
//! An AnnealMachine carries what a MachineClaim carries (the claim's own
//! types) except `userData`, which comes from the Cluster API Machine's
//! bootstrap data Secret; the manager creates one MachineClaim per
//! AnnealMachine (same name and namespace, owned by it).

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};

use super::claim::{
    AfterDeploy, DataImage, MachineSelector, MetaDataSpec, NetworkData, TransferSpec,
};
use super::common::{Condition, DiskHints, NameRef, Toleration};
use super::content::Params;

/// The API group of the provider's kinds.
pub const GROUP: &str = "infrastructure.cluster.x-k8s.io";
/// The version of the provider's kinds.
pub const VERSION: &str = "v1alpha1";
/// The API group of the Cluster API core kinds (Cluster, Machine).
pub const CORE_GROUP: &str = "cluster.x-k8s.io";
/// The Cluster API contract versions this provider implements: each is a
/// label `cluster.x-k8s.io/<contract>: v1alpha1` on every CRD, which is how
/// the core finds the provider's version for a contract.
pub const CONTRACTS: &[&str] = &["v1beta1", "v1beta2"];
/// The providerID scheme: `anneal://<namespace>/<machine>`.
pub const PROVIDER_ID_SCHEME: &str = "anneal://";
/// The key of a Cluster API bootstrap data Secret that holds the data.
pub const BOOTSTRAP_DATA_KEY: &str = "value";

/// The providerID of the anneal Machine `namespace/name`.
pub fn provider_id(namespace: &str, machine: &str) -> String {
    format!("{PROVIDER_ID_SCHEME}{namespace}/{machine}")
}

/// The anneal Machine (namespace, name) a providerID names, if it is one of
/// ours.
pub fn parse_provider_id(id: &str) -> Option<(&str, &str)> {
    let rest = id.strip_prefix(PROVIDER_ID_SCHEME)?;
    let (ns, name) = rest.split_once('/')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains('/')).then_some((ns, name))
}

/// Condition reasons of the provider's kinds (the `Ready` condition).
pub mod reasons {
    /// AnnealMachine: the Cluster API Machine owning it does not exist yet,
    /// or its `spec.bootstrap.dataSecretName` is not set.
    pub const WAITING_FOR_BOOTSTRAP_DATA: &str = "WaitingForBootstrapData";
    /// AnnealMachine: its MachineClaim is not bound yet.
    pub const WAITING_FOR_MACHINE: &str = "WaitingForMachine";
    /// AnnealMachine: its MachineClaim failed to bind (`machineName` names
    /// no Machine).
    pub const CLAIM_FAILED: &str = "ClaimFailed";
    /// AnnealMachine: a MachineClaim of its name exists and is not its own.
    pub const CLAIM_NAME_TAKEN: &str = "ClaimNameTaken";
    /// AnnealMachine: the bound Machine is being deployed.
    pub const PROVISIONING: &str = "Provisioning";
    /// AnnealMachine: the bound Machine is Provisioned for the claim.
    pub const PROVISIONED: &str = "Provisioned";
    /// AnnealMachine: the claim's current DeployRun failed (the message
    /// quotes the run's); the Machine's lifecycle decides whether a new run
    /// follows.
    pub const DEPLOYMENT_FAILED: &str = "DeploymentFailed";
    /// AnnealMachine: the bound Machine's BMC does not answer (not a
    /// failure: it resumes when the BMC answers).
    pub const WAITING_FOR_BMC: &str = "WaitingForBMC";
    /// AnnealMachine: being deleted; waits until its claim is gone.
    pub const DELETING: &str = "Deleting";
    /// AnnealMachine: the `cluster.x-k8s.io/paused` annotation is set.
    pub const PAUSED: &str = "Paused";
    /// AnnealMachine (moved, `spec.providerID` set, no claim of its own):
    /// the anneal Machine the providerID names does not exist (or is not of
    /// its namespace); nothing is created.
    pub const PROVIDER_ID_NOT_FOUND: &str = "ProviderIDNotFound";
    /// AnnealMachine (moved): the anneal Machine its providerID names is not
    /// Provisioned and free (or bound to a claim of its name), so it cannot
    /// be taken over without a deploy; nothing is created.
    pub const MACHINE_NOT_ADOPTABLE: &str = "MachineNotAdoptable";
    /// Event on an AnnealMachine that took over its Machine (and claim) by
    /// `spec.providerID` without a deploy (`clusterctl move`).
    pub const ADOPTED_PROVISIONED_CLAIM: &str = "AdoptedProvisionedClaim";
    /// AnnealCluster: `spec.controlPlaneEndpoint.host` is not set.
    pub const WAITING_FOR_CONTROL_PLANE_ENDPOINT: &str = "WaitingForControlPlaneEndpoint";
    /// AnnealCluster: the infrastructure is ready.
    pub const CLUSTER_PROVISIONED: &str = "Provisioned";

    /// Every condition reason above (`ADOPTED_PROVISIONED_CLAIM` is an
    /// Event's).
    pub const ALL: &[&str] = &[
        WAITING_FOR_BOOTSTRAP_DATA,
        WAITING_FOR_MACHINE,
        CLAIM_FAILED,
        CLAIM_NAME_TAKEN,
        PROVISIONING,
        PROVISIONED,
        DEPLOYMENT_FAILED,
        WAITING_FOR_BMC,
        DELETING,
        PAUSED,
        PROVIDER_ID_NOT_FOUND,
        MACHINE_NOT_ADOPTABLE,
        WAITING_FOR_CONTROL_PLANE_ENDPOINT,
    ];
}

/// The control plane endpoint of a cluster (`host`, `port`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiEndpoint {
    /// DNS name or IP address of the API server.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(length(max = 512))]
    pub host: String,
    /// TCP port of the API server.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(min = 0, max = 65535))]
    pub port: i32,
}

fn is_zero(v: &i32) -> bool {
    *v == 0
}

/// The contract's `status.initialization`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Initialization {
    /// True once the infrastructure is provisioned; never goes back to
    /// false (Cluster API contract v1beta2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<bool>,
}

/// The cluster's infrastructure: the control plane endpoint.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "AnnealCluster",
    namespaced,
    status = "AnnealClusterStatus",
    shortname = "anncl",
    category = "cluster-api",
    category = "anneal",
    doc = "Cluster API InfraCluster of anneal: the control plane endpoint of a cluster whose machines are anneal Machines.",
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']","description":"The Cluster API Cluster"}"#,
    printcolumn = r#"{"name":"Endpoint","type":"string","jsonPath":".spec.controlPlaneEndpoint.host","description":"The control plane endpoint"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AnnealClusterSpec {
    /// The endpoint of the cluster's API server (a load balancer or virtual
    /// IP in front of the control plane Machines); the cluster's
    /// infrastructure is provisioned once `host` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
}

/// Observed state of an AnnealCluster.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct AnnealClusterStatus {
    /// `provisioned` (contract v1beta2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// The same as `initialization.provisioned`, for Cluster API cores of
    /// contract v1beta1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
    /// Conditions: Ready.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A machine of a Cluster API cluster: what a MachineClaim carries (the
/// user data comes from the Cluster API Machine's bootstrap Secret) and the
/// providerID the manager writes.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "AnnealMachine",
    namespaced,
    status = "AnnealMachineStatus",
    shortname = "annm",
    category = "cluster-api",
    category = "anneal",
    doc = "Cluster API InfraMachine of anneal: one MachineClaim (same name, owned by it) deploys an anneal Machine with the Cluster API Machine's bootstrap data as its user data.",
    printcolumn = r#"{"name":"Cluster","type":"string","jsonPath":".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']","description":"The Cluster API Cluster"}"#,
    printcolumn = r#"{"name":"Machine","type":"string","jsonPath":".status.machineRef.name","description":"The anneal Machine its claim is bound to"}"#,
    printcolumn = r#"{"name":"ProviderID","type":"string","jsonPath":".spec.providerID"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.machineName) != has(self.selector)").message("spec.machineName and spec.selector are mutually exclusive; set exactly one").field_path(".machineName"))]
#[x_kube(validation = Rule::new("!has(oldSelf.machineName) || (has(self.machineName) && self.machineName == oldSelf.machineName)").message("spec.machineName is immutable").field_path(".machineName"))]
#[x_kube(validation = Rule::new("has(oldSelf.selector) == has(self.selector)").message("spec.selector cannot be added or removed after creation").field_path(".selector"))]
#[x_kube(validation = Rule::new("!has(oldSelf.providerID) || (has(self.providerID) && self.providerID == oldSelf.providerID)").message("spec.providerID cannot change once set").field_path(".providerID"))]
pub struct AnnealMachineSpec {
    /// The anneal Machine's identity, `anneal://<namespace>/<machine>`:
    /// written by the manager once the Machine is provisioned for this
    /// AnnealMachine; then immutable.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "providerID"
    )]
    #[schemars(length(min = 1, max = 512))]
    pub provider_id: Option<String>,
    /// Binds exactly the Machine of this name (same namespace). Mutually
    /// exclusive with `selector`; immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub machine_name: Option<String>,
    /// Chooses an Available Machine by labels and reported hardware.
    /// Mutually exclusive with `machineName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<MachineSelector>,
    /// Lets the claim bind machines carrying matching taints.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,
    /// The bootable OS Image to deploy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_ref: Option<NameRef>,
    /// Non-OS images deployed in the same session, each on its own disk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub data_images: Vec<DataImage>,
    /// Hints selecting the disk for the OS image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_disk: Option<DiskHints>,
    /// PostHooks run after the Image's own, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub post_hook_refs: Vec<NameRef>,
    /// Template parameters; override Image params and hook defaults.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: Params,
    /// Per-machine tuning of the content transfer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<TransferSpec>,
    /// Power action when the deployment ends: `Reboot` (default) or
    /// `PowerOff`.
    #[serde(default)]
    pub after_deploy: AfterDeploy,
    /// How long a run of the claim may take from its start before it fails
    /// (a Go duration such as `45m`; default: the manager's
    /// `--deploy-deadline`), copied to the claim's `deployDeadline`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 2, max = 32))]
    pub deploy_deadline: Option<String>,
    /// The deployed OS's network configuration (as a MachineClaim's); its
    /// static addresses are reported in `status.addresses`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_data: Option<NetworkData>,
    /// Generated meta-data settings (as a MachineClaim's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta_data: Option<MetaDataSpec>,
}

/// One address of a machine (Cluster API `MachineAddress`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineAddress {
    /// `Hostname`, `ExternalIP`, `InternalIP`, `ExternalDNS` or
    /// `InternalDNS`.
    #[serde(rename = "type")]
    pub type_: String,
    /// The address.
    pub address: String,
}

/// Observed state of an AnnealMachine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct AnnealMachineStatus {
    /// `provisioned` (contract v1beta2): true once the anneal Machine was
    /// Provisioned for the claim; never goes back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// True while the anneal Machine is Provisioned for the claim (contract
    /// v1beta1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<bool>,
    /// The machine's addresses: `InternalIP` (static addresses of the
    /// network data, the Machine's DHCP reservation), `Hostname`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<MachineAddress>,
    /// The MachineClaim of this AnnealMachine (same name and namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_ref: Option<NameRef>,
    /// The anneal Machine the claim is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_ref: Option<NameRef>,
    /// Conditions: Ready (reasons WaitingForBootstrapData,
    /// WaitingForMachine, ClaimFailed, ClaimNameTaken, Provisioning,
    /// Provisioned, DeploymentFailed, WaitingForBMC, Deleting, Paused).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Labels and annotations given to the AnnealMachines created from a
/// template.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateMeta {
    /// Labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// The AnnealMachine a template stamps out.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct AnnealMachineTemplateResource {
    /// Labels and annotations of the AnnealMachines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMeta>,
    /// The AnnealMachines' spec (without `providerID`).
    pub spec: AnnealMachineSpec,
}

/// The template Cluster API copies into an AnnealMachine for each Machine
/// of a MachineDeployment, MachineSet or control plane.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "AnnealMachineTemplate",
    namespaced,
    shortname = "annmt",
    category = "cluster-api",
    category = "anneal",
    doc = "Cluster API InfraMachineTemplate of anneal: the AnnealMachine spec each Machine of a MachineDeployment or control plane gets.",
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.template.spec.imageRef.name","description":"The OS Image each machine gets"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct AnnealMachineTemplateSpec {
    /// The AnnealMachine each Machine gets.
    pub template: AnnealMachineTemplateResource,
}

/// `crd` with the contract labels (`cluster.x-k8s.io/<contract>: v1alpha1`).
fn with_contract_labels(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let labels = crd.metadata.labels.get_or_insert_with(BTreeMap::new);
    for contract in CONTRACTS {
        labels.insert(format!("{CORE_GROUP}/{contract}"), VERSION.to_string());
    }
    crd
}

/// The provider's CustomResourceDefinitions, with the contract labels.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![
        with_contract_labels(AnnealCluster::crd()),
        with_contract_labels(AnnealMachine::crd()),
        with_contract_labels(AnnealMachineTemplate::crd()),
    ]
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn provider_ids_round_trip() {
        let id = provider_id("tenant-a", "m1");
        assert_eq!(id, "anneal://tenant-a/m1");
        assert_eq!(parse_provider_id(&id), Some(("tenant-a", "m1")));
        assert_eq!(parse_provider_id("metal3://x/y"), None);
        assert_eq!(parse_provider_id("anneal://x"), None);
        assert_eq!(parse_provider_id("anneal:///y"), None);
        assert_eq!(parse_provider_id("anneal://x/y/z"), None);
    }

    #[test]
    fn crds_carry_the_contract_labels_and_group() {
        let crds = crds();
        assert_eq!(crds.len(), 3);
        for crd in &crds {
            assert_eq!(crd.spec.group, GROUP);
            assert_eq!(crd.spec.versions[0].name, VERSION);
            let labels = crd.metadata.labels.as_ref().unwrap();
            assert_eq!(labels["cluster.x-k8s.io/v1beta2"], "v1alpha1");
            assert_eq!(labels["cluster.x-k8s.io/v1beta1"], "v1alpha1");
            assert!(crd.metadata.name.as_deref().unwrap().ends_with(GROUP));
        }
        // objects built in Rust carry no contract label
        let m = AnnealMachine::new("m", AnnealMachineSpec::default());
        assert!(m.metadata.labels.is_none());
    }

    #[test]
    fn contract_field_names() {
        let mut m = AnnealMachine::new(
            "m",
            AnnealMachineSpec {
                provider_id: Some("anneal://ns/m".into()),
                ..Default::default()
            },
        );
        m.status = Some(AnnealMachineStatus {
            initialization: Some(Initialization {
                provisioned: Some(true),
            }),
            ready: Some(true),
            addresses: vec![MachineAddress {
                type_: "InternalIP".into(),
                address: "10.0.0.5".into(),
            }],
            ..Default::default()
        });
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["spec"]["providerID"], "anneal://ns/m");
        assert_eq!(v["status"]["initialization"]["provisioned"], true);
        assert_eq!(v["status"]["ready"], true);
        assert_eq!(
            v["status"]["addresses"],
            json!([{"type": "InternalIP", "address": "10.0.0.5"}])
        );
        let c: AnnealCluster = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "AnnealCluster",
            "metadata": {"name": "c"},
            "spec": {"controlPlaneEndpoint": {"host": "10.0.0.2", "port": 6443}}
        }))
        .unwrap();
        assert_eq!(c.spec.control_plane_endpoint.unwrap().port, 6443);
        let t: AnnealMachineTemplate = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "AnnealMachineTemplate",
            "metadata": {"name": "t"},
            "spec": {"template": {"spec": {"selector": {}, "imageRef": {"name": "debian"}}}}
        }))
        .unwrap();
        assert_eq!(
            t.spec.template.spec.image_ref.unwrap().name,
            "debian".to_string()
        );
    }
}
