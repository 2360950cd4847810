//! anneal.dev/v1alpha1 custom resource types (feature `crd`) and the agent
//! protocol types (always available, no cluster dependency).
//!
//! With the `crd` feature every kind of the contract (docs/api.md) is a Rust type
//! deriving `kube::CustomResource`; [`crds`] returns the generated
//! CustomResourceDefinitions, the source of the YAML committed under
//! `deploy/base/crds/`.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod agent;
pub mod boot;
pub mod conditions;
mod error;
pub mod mac;

pub use error::error_chain;
pub use mac::{Mac, MacParseError};

#[cfg(feature = "crd")]
mod crd;

#[cfg(feature = "crd")]
pub use crd::*;

/// A stable digest of a string (FNV-1a 64, 16 lowercase hex digits): the
/// revision of a reservation table ([`reservations_revision`], crd feature)
/// and of bootd's static tables. One implementation for the manager and bootd.
pub fn digest(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// The API group of every anneal kind.
pub const GROUP: &str = "anneal.dev";
/// The version of every anneal kind.
pub const VERSION: &str = "v1alpha1";
