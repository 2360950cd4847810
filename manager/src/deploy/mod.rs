//! Deploy: planning DeployRuns from bound claims (issue 13).

pub mod plan;
pub mod runs;
