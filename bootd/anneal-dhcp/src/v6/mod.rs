//! DHCPv6 server core for network boot (RFC 8415, RFC 5970 boot options,
//! RFC 6939 client link-layer address): pure decode-and-decide like the
//! DHCPv4 core. The shell hands in a datagram, where it came from, the
//! Subnet's table, the bindings and the time, and gets back a reply with
//! its destination and lease effect, or a counted drop.
//!
//! The MAC gate is the DHCPv4 one: the client's link-layer address comes
//! from a relay's option 79, else a DUID-LL/LLT, else the shell's neighbour
//! entry, else the EUI-64 interface identifier of its link-local source
//! (UEFI firmware sends a DUID-UUID and an EUI-64 link-local address).

mod decide;
mod wire;

pub use decide::{
    BootTable6, Cidr6, Cidr6ParseError, ClientKind6, Decision6, DropReason6, IaNa, Ingress6,
    LeaseEffect6, Leases6, MachineEntry6, Reply6, Request6, decide6, handle6, status,
};
pub use wire::{
    Duid, HOP_COUNT_LIMIT, MAX_OPTIONS, MAX_PACKET6, Malformed6, Message6, MsgType, Options,
    Packet6, RelayHop, eui64_mac, opt,
};

#[cfg(test)]
mod tests;
