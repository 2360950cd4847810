//! Deploy: planning DeployRuns from bound claims (docs/deploy.md,
//! "1. Planning").

pub mod cloudinit;
pub mod ignition;
pub mod plan;
pub mod runs;
