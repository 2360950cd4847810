//! The anneal agent: PID-1 init of the live environment, inventory, deploy,
//! and the capture/restore subcommands that reuse the imaging code.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod client;
pub mod cmdline;
pub mod console;
pub mod deploy;
pub mod fetch;
pub mod imaging;
pub mod ingest;
pub mod init;
pub mod inventory;
pub mod jsonl;
pub mod modules;
pub mod net;
pub mod posthook;
pub mod serve;
pub mod store;
#[cfg(feature = "swarm")]
pub mod swarm;
pub mod tracker;
