//! The custom resources of anneal.dev/v1alpha1.

mod common;
mod machine;

pub use common::*;
pub use machine::*;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// Every CustomResourceDefinition of anneal.dev, in the order an operator
/// meets the kinds (API.md).
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![Machine::crd()]
}
