//! Helpers of the end-to-end tests in `tests/tests/` (and the demo in
//! `tests/examples/`): one copy each, instead of modules included by path.
//!
//! - [`wait`]: the one poller, [`eventually`].
//! - [`artifacts`]: the static agent, the initramfs builder, the
//!   fake manager, built with cargo on demand.
//! - [`agent_vm`]: dnsmasq on a test bridge and a VM booting the agent
//!   directly (`-kernel`/`-initrd`).
//! - [`lab`]: the `lab` Subnet and bootd's table watcher in-process.
//! - [`dhcp_probe`]: what bootd's decision core answers a PXE DISCOVER.
//! - [`bmc`]: a paused QEMU VM behind `anneal-qemu-bmc`, sushy-emulator, a
//!   Redfish client, a test PKI.
//! - [`lifecycle`]: the manager's lifecycle half in a killable runtime, log
//!   capture, the agent protocol over HTTPS, Machine/Secret fixtures.
//! - [`e2e`]: the whole inspection lab (control plane, manager, bootd, VM).
//! - [`node`]: image archives and overlays of the node tests.
//! - [`uploads`]: the manager in process with its staged-upload endpoint
//!   and an uploader's token (`cli_import`, `store_quota`).
//! - [`testos`]: the bootable test OS disk image (GPT, ESP with a UKI, swap,
//!   ext4 root with a marker) the deploy tests import, built and cached.
//!
//! Test code: a failed set-up step panics with what failed, so `unwrap` and
//! `expect` are allowed here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod agent_vm;
pub mod artifacts;
pub mod bmc;
pub mod cloudos;
pub mod dhcp_probe;
pub mod disks;
pub mod e2e;
pub mod images;
pub mod lab;
pub mod lifecycle;
pub mod node;
pub mod node_lab;
pub mod ovmf;
pub mod rbac;
pub mod testos;
pub mod uploads;
pub mod wait;

pub use wait::{eventually, eventually_blocking};
