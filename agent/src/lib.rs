//! The anneal agent: PID-1 init of the live environment, inventory, deploy,
//! and the capture/restore subcommands that reuse the imaging code.

pub mod imaging;
