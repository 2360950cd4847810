//! DHCPv4 and DHCPv6 ([`v6`]) server cores for network boot: pure decode-and-decide, PXE,
//! UEFI HTTP boot and iPXE options.
//!
//! Nothing here touches a socket or a clock: the shell hands in the bytes of a
//! datagram, the port it arrived on, the boot table, the lease view and the
//! time, and gets back a [`Decision`]: a reply with where to send it, a lease
//! update, or a drop with a counted reason.
//!
//! Decoding of the fixed BOOTP header is left to `dhcproto`; the option area is
//! walked here with strict bounds checks, because `dhcproto` stops silently at
//! the first option it cannot decode (a non-UTF-8 host name would hide the
//! architecture option behind it).
#![cfg_attr(test, allow(clippy::too_many_lines))]

mod decide;
mod lease;
pub mod options;
mod table;
pub mod v6;
mod wire;

/// The MAC type is anneal-api's (one type for the agent, bootd and the manager).
pub use anneal_api::mac::{Mac, MacParseError};
pub use decide::{Decision, Dest, DropReason, Reply, decide};
pub use lease::{Lease, LeaseEffect, Leases};
pub use table::{Arch, BootFiles, BootTable, Cidr, CidrParseError, Loader, MachineEntry, Mode};
pub use wire::{ClientKind, IP_UDP_HEADERS, Ingress, MAX_PACKET, Malformed, Request, ServerPort};

/// Version of the wire contract (options 43/175 layout, boot file selection).
pub const CONTRACT_VERSION: u32 = 1;
