//! The anneal manager: one runtime ([`Runtime`]) running the controllers
//! (claims, readiness rules, reservations, validity, the Machine lifecycle,
//! the Cluster API provider when Cluster API is installed)
//! behind leader election, the agent API, the metadata endpoint, and the
//! CRD YAML generator.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod agentapi;
pub mod bmc;
pub mod bootd;
pub mod capi;
pub mod claims;
pub mod conditions;
pub mod content;
pub mod controller;
pub mod crdgen;
pub mod deploy;
pub mod ipam;
pub mod ipmi;
pub mod leader;
pub mod metadata;
pub mod metrics;
pub mod patch;
pub mod preflight;
pub mod readiness;
mod run;
pub mod swarm;
pub mod validity;
pub mod workload;

pub use run::{RunConfig, RunError, Runtime, run};
pub mod lifecycle;
pub mod redfish;
