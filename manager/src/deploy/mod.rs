//! Deploy: planning DeployRuns from bound claims (issue 13).

pub mod cloudinit;
pub mod ignition;
pub mod plan;
pub mod runs;
