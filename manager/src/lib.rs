//! The anneal manager: controllers for claims and readiness rules, and the
//! CRD YAML generator.

pub mod agentapi;
pub mod claims;
pub mod conditions;
pub mod crdgen;
pub mod ipam;
pub mod leader;
pub mod metrics;
pub mod patch;
pub mod readiness;
mod run;
pub mod validity;
pub mod watching;

pub use run::{RunConfig, RunError, run};
pub mod lifecycle;
pub mod redfish;
