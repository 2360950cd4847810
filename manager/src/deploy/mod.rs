//! Deploy: planning DeployRuns from bound claims (issue 13).

pub mod cloudinit;
pub mod plan;
pub mod runs;
