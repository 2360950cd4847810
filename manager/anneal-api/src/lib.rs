//! anneal.dev/v1alpha1 custom resource types (feature `crd`) and the agent
//! protocol types (always available, no cluster dependency).
//!
//! With the `crd` feature every kind of the contract (API.md) is a Rust type
//! deriving `kube::CustomResource`; [`crds`] returns the generated
//! CustomResourceDefinitions, the source of the YAML committed under
//! `manager/crds/`.

pub mod agent;

#[cfg(feature = "crd")]
mod crd;

#[cfg(feature = "crd")]
pub use crd::*;

/// The API group of every anneal kind.
pub const GROUP: &str = "anneal.dev";
/// The version of every anneal kind.
pub const VERSION: &str = "v1alpha1";
