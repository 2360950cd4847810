//! The custom resources of anneal.dev/v1alpha1, and the Cluster API
//! provider's kinds of infrastructure.cluster.x-k8s.io/v1alpha1 ([`capi`]).

pub mod capi;
mod claim;
mod common;
mod content;
mod hooks;
mod machine;
mod network;
pub mod tenancy;

pub use capi::{AnnealCluster, AnnealMachine, AnnealMachineTemplate};
pub use claim::*;
pub use common::*;
pub use content::*;
pub use hooks::*;
pub use machine::*;
pub use network::*;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// Every CustomResourceDefinition of anneal.dev, in the order an operator
/// meets the kinds (docs/api.md), then the Cluster API provider's
/// ([`capi::crds`]).
pub fn crds() -> Vec<CustomResourceDefinition> {
    let mut crds = vec![
        Site::crd(),
        Subnet::crd(),
        ImageImport::crd(),
        PartitionContent::crd(),
        Image::crd(),
        Machine::crd(),
        MachineClaim::crd(),
        MachineHardware::crd(),
        DeployRun::crd(),
        PostHook::crd(),
        ReadinessRule::crd(),
    ];
    crds.extend(capi::crds());
    crds
}
